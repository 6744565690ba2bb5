//! Attention: prefill (tiled and a block per row and head), one row split over the
//! keys, and a decode step's preamble and attention at the position on the device.

use super::*;
use dynmoe::backend::NOT_A_TOKEN;

#[test]
fn attention_matches_the_reference() {
    let Some(_) = gpu() else { return };
    // Decode and prefill, grouped queries, a window, and a context longer than one
    // 1024-key tile of the kernel.
    let cases = [
        (1, 200, 32, 4, 128, None),
        (16, 0, 8, 2, 64, None),
        (9, 1500, 4, 4, 128, None),
        (12, 40, 8, 1, 64, Some(16)),
        (3, 2000, 2, 1, 256, Some(1100)),
    ];
    for (rows, pos0, heads, kv_heads, head_dim, window) in cases {
        let ctx = pos0 + rows;
        let q = fresh(rows * heads * head_dim, 30);
        let k = fresh(ctx * kv_heads * head_dim, 31);
        let v = fresh(ctx * kv_heads * head_dim, 32);
        let shape = AttentionShape {
            rows,
            pos0,
            heads,
            kv_heads,
            head_dim,
            window,
        };
        both!(
            &format!("attention {rows}@{pos0} h{heads}/{kv_heads} d{head_dim} w{window:?}"),
            &[&q, &k, &v],
            q.len(),
            1e-5,
            |b, t, o| b.attention(&t[0], &t[1], &t[2], shape, o)
        );
    }
}

#[test]
fn prefill_attention_matches_the_reference_both_ways() {
    let Some(g) = gpu() else { return };
    // Several query rows against the CPU result: rows 2 to 512 (one tile of 64 query slots,
    // ragged tiles, many), from position 0 and later (chunked prefill), GQA ratios 1, 4
    // and 8 (a tile spans 64, 16 or 8 positions), head widths 64, 128, 96 (part of the
    // kernel's float4s) and 66 (not whole float4s: the per-row kernel either way),
    // windows none, 100 and 1. The cache holds 37 positions past the last row, poisoned
    // with NaN: no key past a row's own position may count.
    let heads_of = [(4, 4), (8, 2), (8, 1)];
    let mut case = 0u64;
    for head_dim in [64, 128, 96, 66] {
        for (heads, kv_heads) in heads_of {
            for rows in [2, 17, 64, 65, 300, 512] {
                for pos0 in [0, 300] {
                    for window in [None, Some(100), Some(1)] {
                        case += 1;
                        let shape = AttentionShape {
                            rows,
                            pos0,
                            heads,
                            kv_heads,
                            head_dim,
                            window,
                        };
                        check_prefill(g, shape, 37, 900 + case);
                    }
                }
            }
        }
    }
    // Qwen3-30B-A3B's heads, a whole 512-token prompt and a chunk of one after it.
    for pos0 in [0, 512] {
        let shape = AttentionShape {
            rows: 512,
            pos0,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            window: None,
        };
        check_prefill(g, shape, 0, 1900 + pos0 as u64);
    }
}

/// Attention of `shape` on the CPU reference, then on the device; the cache holds `spare`
/// positions of NaN after the context.
fn check_prefill(g: &Cuda, shape: AttentionShape, spare: usize, seed: u64) {
    let kvw = shape.kv_heads * shape.head_dim;
    let ctx = shape.pos0 + shape.rows;
    let q = fresh(shape.rows * shape.heads * shape.head_dim, seed);
    let mut k = fresh(ctx * kvw, seed + 10_000);
    let mut v = fresh(ctx * kvw, seed + 20_000);
    k.resize((ctx + spare) * kvw, f32::NAN);
    v.resize((ctx + spare) * kvw, f32::NAN);
    let op = |b: &Cpu, t: &[Vec<f32>], o: &mut Vec<f32>| b.attention(&t[0], &t[1], &t[2], shape, o);
    let want = run(&Cpu::reference(), &[&q, &k, &v], q.len(), op);
    let got = run(g, &[&q, &k, &v], q.len(), |b, t, o| {
        b.attention(&t[0], &t[1], &t[2], shape, o)
    });
    let e = rel_err(&got, &want);
    let label = format!(
        "attention {}@{} h{}/{} d{} w{:?}",
        shape.rows, shape.pos0, shape.heads, shape.kv_heads, shape.head_dim, shape.window
    );
    println!("check {label:<44} rel_err {e:.2e}");
    assert!(e < 1e-5, "{label}: rel err {e:.2e} over 1e-5");
}

#[test]
fn a_step_handed_no_token_embeds_nan_not_a_read_past_the_table() {
    let Some(g) = gpu() else { return };
    // A queued decode step runs on whatever the step before it picked, before the host
    // has seen it: after logits that were not finite, that is NOT_A_TOKEN, which must give
    // NaN (and so NOT_A_TOKEN again), never a read outside the table.
    let (vocab, dim) = (1000, 96);
    let table = fresh(vocab * dim, 610);
    // Values bf16 holds exactly are uploaded as a bf16 table.
    for (bf16, values) in [(false, table.clone()), (true, bf16_values(&table))] {
        let m = g.upload_matrix(&values, vocab, dim);
        for id in [NOT_A_TOKEN, vocab as u32] {
            let step = g.upload(&[f32::from_bits(id), f32::from_bits(3)]);
            let mut out = g.upload(&fresh(dim, 611));
            g.embed_at(Weight::Dense(&m), dim, &step, &mut out);
            let mut got = vec![0.0f32; dim];
            g.download(&out, &mut got);
            println!(
                "check embed_at id {id} (bf16 {bf16}): all NaN {}",
                got.iter().all(|v| v.is_nan())
            );
            assert!(got.iter().all(|v| v.is_nan()), "id {id}, bf16 {bf16}");
        }
    }
}

#[test]
fn decode_step_ops_match_the_reference() {
    let Some(_) = gpu() else { return };
    // Token and position read from a step tensor (u32 bits), as a recorded decode step
    // reads them: embedding, RoPE, the cache row written, attention over the cache, and
    // the argmax written after the values before it.
    let (vocab, dim) = (1000, 96);
    let (heads, kv_heads, head_dim) = (8, 2, 64);
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / head_dim as f32))
        .collect();
    for (tok, pos) in [(0u32, 0u32), (737, 5), (999, 1300)] {
        let step = [f32::from_bits(tok), f32::from_bits(pos)];
        let table = fresh(vocab * dim, 600 + pos as u64);
        both!(
            &format!("embed_at token {tok}"),
            &[&step],
            dim,
            1e-6,
            |b, t, o| b.embed_at(
                Weight::Dense(&b.upload_matrix(&table, vocab, dim)),
                dim,
                &t[0],
                o
            )
        );
        let x = fresh(heads * head_dim, 601 + pos as u64);
        both!(
            &format!("rope_at position {pos}"),
            &[&x, &step],
            x.len(),
            1e-5,
            |b, t, o| {
                b.write_rows(&t[0], o, 0, 1, x.len());
                b.rope_at(o, &t[1], heads, head_dim, &inv_freq)
            }
        );
        let ctx = pos as usize + 1;
        let kvw = kv_heads * head_dim;
        let cache = fresh(ctx * kvw, 602 + pos as u64);
        let row = fresh(kvw, 603 + pos as u64);
        both!(
            &format!("write_row_at position {pos}"),
            &[&cache, &row, &step],
            cache.len(),
            1e-7,
            |b, t, o| {
                b.write_rows(&t[0], o, 0, ctx, kvw);
                b.write_row_at(&t[1], o, &t[2], kvw)
            }
        );
        // Caches longer than the context, as a state's are: chunks past the position
        // must count for nothing.
        let (k, v) = (fresh((ctx + 300) * kvw, 604), fresh((ctx + 300) * kvw, 605));
        let q = fresh(heads * head_dim, 606 + pos as u64);
        for window in [None, Some(100)] {
            let shape = one_row(heads, kv_heads, head_dim, window);
            both!(
                &format!("attention_at position {pos} w{window:?}"),
                &[&q, &k, &v, &step],
                q.len(),
                1e-5,
                |b, t, o| b.attention_at(&t[0], &t[1], &t[2], shape, &t[3], o)
            );
        }
        // Three rows of logits, the best of row 1 planted at `tok`, a tie in row 2.
        let mut logits = fresh(3 * vocab, 607 + pos as u64);
        logits[vocab + tok as usize] = 50.0;
        logits[2 * vocab + 3] = 60.0;
        logits[2 * vocab + 900] = 60.0;
        let before = fresh(4, 608);
        let want = {
            let cpu = Cpu::reference();
            let mut o = before.clone();
            cpu.argmax_rows(&logits, 3, vocab, &mut o, 4 - 3);
            o
        };
        let g = gpu().unwrap();
        let (lt, mut ot) = (g.upload(&logits), g.upload(&before));
        g.argmax_rows(&lt, 3, vocab, &mut ot, 1);
        let mut got = vec![0.0; 4];
        g.download(&ot, &mut got);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        println!("check argmax_rows {:?}", bits(&got[1..]));
        assert_eq!(bits(&got), bits(&want), "argmax rows");
        assert_eq!(got[2].to_bits(), tok, "planted maximum");
        assert_eq!(got[3].to_bits(), 3, "ties go to the lower index");
    }
}

#[test]
fn one_row_attention_matches_the_reference() {
    let Some(_) = gpu() else { return };
    // One query row, through `attention_at` (the position read from device memory, as a
    // recorded step reads it) and `attention`: GQA ratios 1, 4, 8, 6 (a head tile part
    // full) and 12 (two tiles), head widths 64, 128, 256, 96 (rows of part of the grouped
    // kernel's float4s) and 66 (not whole float4s: the per-head kernel),
    // positions at and across the edges of 16- and 64-key chunks, windows. The cache's
    // capacity sets the chunks: as long as the context, longer (chunks past the position
    // count for nothing), and 8192 positions (chunks of several score steps and V
    // batches).
    let shapes = [
        (8, 8, 64),
        (16, 4, 128),
        (32, 4, 128),
        (32, 4, 64),
        (6, 1, 128),
        (24, 2, 96),
        (8, 1, 256),
        (8, 2, 66),
    ];
    let most = 8192;
    for (i, &(heads, kv_heads, head_dim)) in shapes.iter().enumerate() {
        let kvw = kv_heads * head_dim;
        let (k, v) = (
            fresh(most * kvw, 700 + i as u64),
            fresh(most * kvw, 720 + i as u64),
        );
        let q = fresh(heads * head_dim, 740 + i as u64);
        for pos in [0usize, 5, 63, 64, 1300] {
            let step = [f32::from_bits(7), f32::from_bits(pos as u32)];
            for capacity in [pos + 1, pos + 701, most] {
                let (k, v) = (&k[..capacity * kvw], &v[..capacity * kvw]);
                for window in [None, Some(100), Some(1)] {
                    let label = format!(
                        "h{heads}/{kv_heads} d{head_dim} @{pos} cap {capacity} w{window:?}"
                    );
                    let mut shape = one_row(heads, kv_heads, head_dim, window);
                    if window == Some(100) {
                        shape.pos0 = pos;
                        both!(&label, &[&q, k, v], q.len(), 1e-5, |b, t, o| b
                            .attention(&t[0], &t[1], &t[2], shape, o));
                    } else {
                        both!(&label, &[&q, k, v, &step], q.len(), 1e-5, |b, t, o| b
                            .attention_at(&t[0], &t[1], &t[2], shape, &t[3], o));
                    }
                }
            }
        }
    }
}
/// A decode step's attention inputs: q, k and v as the q/k/v products wrote them, the
/// per-head norms' weights, caches of `capacity` rows and the step tensor (token and
/// position bits, both `pos`).
fn step_inputs(shape: AttentionShape, pos: u32, capacity: usize, salt: u64) -> [Vec<f32>; 8] {
    let (qw, kvw) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    [
        fresh(qw, salt),
        fresh(kvw, salt + 1),
        fresh(kvw, salt + 2),
        fresh(shape.head_dim, salt + 3),
        fresh(shape.head_dim, salt + 4),
        fresh(capacity * kvw, salt + 5),
        fresh(capacity * kvw, salt + 6),
        vec![f32::from_bits(pos), f32::from_bits(pos)],
    ]
}

/// Copies of what the preamble writes in place (q, k and the two caches) from the
/// uploaded [`step_inputs`] `t`, and the per-head norm (with `normed`).
fn step_buffers<'t, B: Backend>(
    b: &B,
    t: &'t [B::Tensor],
    shape: AttentionShape,
    capacity: usize,
    normed: bool,
) -> ([B::Tensor; 4], Option<HeadNorm<'t, B::Tensor>>) {
    let (qw, kvw) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    let copy = |i: usize, rows: usize, width: usize| {
        let mut c = b.alloc(rows * width);
        b.write_rows(&t[i], &mut c, 0, rows, width);
        c
    };
    let bufs = [
        copy(0, 1, qw),
        copy(1, 1, kvw),
        copy(5, capacity, kvw),
        copy(6, capacity, kvw),
    ];
    let norm = normed.then_some(HeadNorm {
        q: &t[3],
        k: &t[4],
        eps: 1e-6,
    });
    (bufs, norm)
}

/// One query row of `heads` and `kv_heads` heads of `head_dim`, at the step tensor's
/// position.
fn one_row(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
) -> AttentionShape {
    AttentionShape {
        rows: 1,
        pos0: 0,
        heads,
        kv_heads,
        head_dim,
        window,
    }
}

#[test]
fn attention_preamble_matches_the_single_ops() {
    let Some(_) = gpu() else { return };
    // q/k per-head norm (or none), RoPE at the step's position, k and v into that cache
    // row: Qwen3-30B-A3B's heads, narrow and ragged heads (48 pairs over 64 threads),
    // wide ones (320 pairs, two a thread), and an odd width the device leaves to the
    // single ops.
    let cases = [
        (32, 4, 128),
        (8, 2, 64),
        (3, 1, 96),
        (4, 2, 256),
        (2, 1, 640),
        (2, 1, 6),
    ];
    for (heads, kv_heads, head_dim) in cases {
        let inv_freq = dynmoe::model::forward::rope_inv_freq(1e6, head_dim, 1.0);
        let (qw, kvw) = (heads * head_dim, kv_heads * head_dim);
        let shape = one_row(heads, kv_heads, head_dim, None);
        for (pos, normed) in [(0u32, true), (5, false), (1300, true)] {
            let ctx = pos as usize + 3;
            let inputs = step_inputs(shape, pos, ctx, 800 + pos as u64 + head_dim as u64);
            let inputs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let total = qw + kvw + 2 * ctx * kvw;
            both!(
                &format!(
                    "attention_preamble_at {heads}/{kv_heads}x{head_dim} @{pos} norm {normed}"
                ),
                &inputs,
                total,
                1e-5,
                |b, t, o| {
                    let ([mut qs, mut ks, mut kcs, mut vcs], norm) =
                        step_buffers(b, t, shape, ctx, normed);
                    b.attention_preamble_at(
                        &mut qs, &mut ks, &t[2], norm, shape, &inv_freq, &t[7], &mut kcs, &mut vcs,
                    );
                    b.write_rows(&qs, o, 0, 1, qw);
                    b.write_rows(&ks, o, qw / kvw, 1, kvw);
                    b.write_rows(&kcs, o, qw / kvw + 1, ctx, kvw);
                    b.write_rows(&vcs, o, qw / kvw + 1 + ctx, ctx, kvw)
                }
            );
        }
    }
}

#[test]
fn attention_step_matches_the_preamble_then_attention() {
    let Some(_) = gpu() else { return };
    // The decode step's attention with its preamble (the preamble kernel, then the grouped
    // attention) against the single ops: Qwen3-30B-A3B's heads, two head tiles (GQA 12),
    // narrow, wide and 96-wide heads, and an odd width the device leaves to the single
    // ops; the first position, one inside the first chunk and one far into a cache longer
    // than the context, with a window and without. The output and both caches are
    // compared.
    let cases = [
        (32, 4, 128),
        (24, 2, 64),
        (4, 2, 256),
        (3, 1, 96),
        (2, 2, 6),
    ];
    for (heads, kv_heads, head_dim) in cases {
        let inv_freq = dynmoe::model::forward::rope_inv_freq(1e6, head_dim, 1.0);
        let (qw, kvw) = (heads * head_dim, kv_heads * head_dim);
        for (pos, normed, window) in [(0u32, true, None), (5, false, None), (700, true, Some(100))]
        {
            let shape = one_row(heads, kv_heads, head_dim, window);
            let capacity = pos as usize + 40;
            let inputs = step_inputs(shape, pos, capacity, 900 + pos as u64 + head_dim as u64);
            let inputs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            both!(
                &format!(
                    "attention_step_at {heads}/{kv_heads}x{head_dim} @{pos} norm {normed} \
                     w{window:?}"
                ),
                &inputs,
                qw + 2 * capacity * kvw,
                1e-5,
                |b, t, o| {
                    let ([mut qs, mut ks, mut kcs, mut vcs], norm) =
                        step_buffers(b, t, shape, capacity, normed);
                    let mut out = b.alloc(qw);
                    b.attention_step_at(
                        &mut qs, &mut ks, &t[2], norm, shape, &inv_freq, &t[7], &mut kcs, &mut vcs,
                        &mut out,
                    );
                    let n = capacity * kvw;
                    concat(b, &[(&out, qw), (&kcs, n), (&vcs, n)], o)
                }
            );
        }
    }
}
