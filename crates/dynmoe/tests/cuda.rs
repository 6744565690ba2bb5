//! The CUDA backend against the CPU reference: every op on fresh random inputs with
//! poisoned outputs (‖gpu − ref‖ / ‖ref‖ printed for each), dense weights both as bf16
//! (values rounded to bf16 first, as checkpoints hold them) and as f32, then the fixtures
//! (bf16 checkpoints) end to end
//! (perplexity within 1e-3 relative and identical greedy decodes, from the checkpoint
//! and from its 4-, 3- and 2-bit expert stores).
//!
//! Without the `cuda` feature this file is empty; with it but on a machine without a
//! GPU, each test prints why it was skipped and passes.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::sync::OnceLock;

use dynmoe::backend::cuda::Tuning;
use dynmoe::backend::{
    AddNorm, AttentionShape, Backend, Cpu, Cuda, DeviceRoute, HeadNorm, MoeInput, RoutedExperts,
    SwiGluGroup, Weight,
};
use dynmoe::codec::affine::AffineMatrix;
use dynmoe::eval::ppl::{perplexity, PplOptions};
use dynmoe::model::config::Router;
use dynmoe::model::moe::route;
use dynmoe::model::{self, Codecs, ExpertBits};
use dynmoe::residency::confine;
use dynmoe::runtime::generate::{generate_ids, Sampling};
use dynmoe::testing::{
    fixture, fixtures_root, fresh, greedy_reference, rel_err, GreedyReference, Rng, TempDir,
};
use half::bf16;

/// The device, or `None` after printing why the test is skipped.
fn gpu() -> Option<&'static Cuda> {
    static GPU: OnceLock<Result<Cuda, String>> = OnceLock::new();
    match GPU.get_or_init(|| Cuda::new(0).map_err(|e| e.to_string())) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// The device run without tensor cores (the portable kernels older devices run), once
/// [`gpu`] has found it.
fn portable() -> &'static Cuda {
    static PORTABLE: OnceLock<Cuda> = OnceLock::new();
    PORTABLE.get_or_init(|| {
        let g = gpu().expect("checked by the caller");
        let tuning = Tuning {
            tensor_cores: false,
            ..g.tuning().clone()
        };
        Cuda::with_tuning(0, tuning).expect("the device was made once")
    })
}

/// The device as [`gpu`] runs it (tensor cores where it has them), or [`portable`].
fn device(tensor_cores: bool) -> &'static Cuda {
    if tensor_cores {
        gpu().expect("checked by the caller")
    } else {
        portable()
    }
}

fn root() -> PathBuf {
    fixtures_root().join("../..")
}

/// `v` rounded to bf16 values: a matrix the device keeps in bf16.
fn bf16_values(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Runs `op` on a backend with the inputs uploaded and an output of `out_len` made by
/// `alloc` (NaN on both backends), and returns the output.
fn run<B: Backend>(
    b: &B,
    inputs: &[&[f32]],
    out_len: usize,
    op: impl FnOnce(&B, &[B::Tensor], &mut B::Tensor),
) -> Vec<f32> {
    let ts: Vec<B::Tensor> = inputs.iter().map(|x| b.upload(x)).collect();
    let mut out = b.alloc(out_len);
    op(b, &ts, &mut out);
    let mut host = vec![0.0; out_len];
    b.download(&out, &mut host);
    host
}

/// The same op on the reference and the device `g`; asserts and prints the error.
fn check(
    g: &Cuda,
    label: &str,
    inputs: &[&[f32]],
    out_len: usize,
    tol: f64,
    op_cpu: impl FnOnce(&Cpu, &[Vec<f32>], &mut Vec<f32>),
    op_gpu: impl FnOnce(&Cuda, &[<Cuda as Backend>::Tensor], &mut <Cuda as Backend>::Tensor),
) {
    let want = run(&Cpu::reference(), inputs, out_len, op_cpu);
    let got = run(g, inputs, out_len, op_gpu);
    let e = rel_err(&got, &want);
    println!("check {label:<44} rel_err {e:.2e}");
    assert!(e < tol, "{label}: rel err {e:.2e} over {tol:.0e}");
}

/// The same op on both, written once: a macro because the two backends' tensor types
/// differ and a closure cannot be generic. `on g;` first: on device `g` rather than
/// [`gpu`].
macro_rules! both {
    ($label:expr, $inputs:expr, $out_len:expr, $tol:expr, |$b:ident, $t:ident, $o:ident| $body:expr) => {
        both!(on gpu().expect("checked by the caller"); $label, $inputs, $out_len, $tol, |$b, $t, $o| $body)
    };
    (on $g:expr; $label:expr, $inputs:expr, $out_len:expr, $tol:expr, |$b:ident, $t:ident, $o:ident| $body:expr) => {
        check(
            $g,
            $label,
            $inputs,
            $out_len,
            $tol,
            |$b, $t, $o| $body,
            |$b, $t, $o| $body,
        )
    };
}

/// `parts` (each a tensor and how many of its values) laid out one after another in
/// `out`, as rows of width 1 so that any offset can be written.
fn concat<B: Backend>(b: &B, parts: &[(&B::Tensor, usize)], out: &mut B::Tensor) {
    let mut at = 0;
    for &(t, n) in parts {
        b.write_rows(t, out, at, n, 1);
        at += n;
    }
}

#[test]
fn elementwise_and_row_ops_match_the_reference() {
    let Some(_) = gpu() else { return };
    for (rows, dim) in [(1, 2048), (7, 96), (33, 4096)] {
        let n = rows * dim;
        let (x, w, y) = (fresh(n, 1), fresh(dim, 2), fresh(n, 3));
        let s = format!("{rows}x{dim}");
        both!(&format!("rms_norm {s}"), &[&x, &w], n, 1e-5, |b, t, o| b
            .rms_norm(&t[0], &t[1], rows, dim, 1e-6, o));
        both!(
            &format!("rms_norm_inplace {s}"),
            &[&x, &w],
            n,
            1e-5,
            |b, t, o| {
                b.write_rows(&t[0], o, 0, rows, dim);
                b.rms_norm_inplace(o, &t[1], rows, dim, 1e-6)
            }
        );
        both!(&format!("add_bias {s}"), &[&x, &w], n, 1e-6, |b, t, o| {
            b.write_rows(&t[0], o, 0, rows, dim);
            b.add_bias(o, &t[1], rows)
        });
        both!(&format!("add {s}"), &[&x, &y], n, 1e-6, |b, t, o| {
            b.write_rows(&t[0], o, 0, rows, dim);
            b.add(o, &t[1], n)
        });
        both!(&format!("silu_mul {s}"), &[&x, &y], n, 1e-5, |b, t, o| {
            b.write_rows(&t[0], o, 0, rows, dim);
            b.silu_mul(o, &t[1], n)
        });
        both!(&format!("clamp {s}"), &[&x], n, 1e-6, |b, t, o| {
            b.write_rows(&t[0], o, 0, rows, dim);
            b.clamp(o, 0.7, n)
        });
        both!(&format!("softmax_rows {s}"), &[&x], n, 1e-5, |b, t, o| {
            b.write_rows(&t[0], o, 0, rows, dim);
            b.softmax_rows(o, rows, dim)
        });
    }
    let (vocab, dim) = (1000, 256);
    let table = fresh(vocab * dim, 4);
    let mut rng = Rng::new(5);
    let ids: Vec<u32> = (0..9)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect();
    both!("embed 9 of 1000x256", &[], 9 * dim, 1e-7, |b, _t, o| b
        .embed(&b.upload_matrix(&table, vocab, dim), dim, &ids, o));
    let src = fresh(50 * dim, 6);
    let rows: Vec<u32> = (0..20).map(|_| (rng.next_u64() % 50) as u32).collect();
    both!(
        "gather_rows 20 of 50x256",
        &[&src],
        20 * dim,
        1e-7,
        |b, t, o| b.gather_rows(&t[0], &rows, dim, o)
    );
    let distinct: Vec<u32> = (0..20).map(|i| (i * 7 % 50) as u32).collect();
    let scales = fresh(20, 7);
    let base = fresh(50 * dim, 8);
    both!(
        "scatter_add_rows 20 into 50x256",
        &[&src, &base],
        50 * dim,
        1e-6,
        |b, t, o| {
            b.write_rows(&t[1], o, 0, 50, dim);
            b.scatter_add_rows(&t[0], &distinct, &scales, dim, o)
        }
    );
    both!(
        "write_rows 5 at row 3",
        &[&src],
        20 * dim,
        0.0 + 1e-7,
        |b, t, o| {
            b.write_rows(&b.zeros(20 * dim), o, 0, 20, dim);
            b.write_rows(&t[0], o, 3, 5, dim)
        }
    );
}

#[test]
fn rope_matches_the_reference() {
    let Some(_) = gpu() else { return };
    for (rows, heads, head_dim, pos0) in [(1, 32, 128, 4000), (17, 4, 64, 0), (5, 8, 256, 33)] {
        let x = fresh(rows * heads * head_dim, 10);
        let inv_freq = dynmoe::model::forward::rope_inv_freq(1e6, head_dim, 1.0);
        // Consecutive positions (computed on the device) and reversed ones (uploaded).
        for reversed in [false, true] {
            let mut positions: Vec<usize> = (pos0..pos0 + rows).collect();
            if reversed {
                positions.reverse();
            }
            both!(
                &format!("rope {rows}x{heads}x{head_dim} @{pos0} reversed {reversed}"),
                &[&x],
                x.len(),
                1e-5,
                |b, t, o| {
                    b.write_rows(&t[0], o, 0, rows, heads * head_dim);
                    b.rope(o, &positions, heads, head_dim, &inv_freq)
                }
            );
        }
    }
}

#[test]
fn dense_matmul_matches_the_reference() {
    let Some(_) = gpu() else { return };
    // Up to 4 rows with whole float4s run as the matrix-vector kernel (the LM head's
    // width among them); the rest, and a ragged width, through cuBLAS.
    let cases = [
        (1, 2048, 4096),
        (1, 2048, 151936),
        (3, 768, 2048),
        (4, 4096, 80),
        (2, 250, 33),
        (7, 256, 80),
        (64, 768, 2048),
    ];
    for (rows, in_dim, out_dim) in cases {
        let (x, w) = (fresh(rows * in_dim, 20), fresh(out_dim * in_dim, 21));
        assert!(
            !gpu().unwrap().upload_matrix(&w, out_dim, in_dim).is_bf16(),
            "values bf16 would round stay f32"
        );
        both!(
            &format!("matmul {rows}x{in_dim} -> {out_dim}"),
            &[&x],
            rows * out_dim,
            1e-5,
            |b, t, o| b.matmul(
                &t[0],
                &b.upload_matrix(&w, out_dim, in_dim),
                rows,
                in_dim,
                out_dim,
                o
            )
        );
    }
}

#[test]
fn bf16_matmul_matches_the_reference() {
    let Some(g) = gpu() else { return };
    // Up to 4 rows run as the bf16 matrix-vector kernel: 16-byte loads of 8 weights when
    // the width is a multiple of 8 (the LM head's among them), one weight per lane
    // otherwise (100, 250, 7 columns). More rows widen the matrix to f32 in a scratch
    // buffer for cuBLAS: made for 2048 × 768, reused for the two smaller matrices after
    // it, then grown for a 151936 × 2048 LM head at 5 rows. One row of whole 8s takes a
    // warp per 2048 columns, the parts added in shared memory: 2 parts (one short) of
    // 4096 and 2056 columns, 8 of 16384 and of 20000 (each past its loads held at once).
    let cases = [
        (1, 2048, 4096),
        (1, 4096, 2048),
        (1, 2056, 37),
        (1, 16384, 20),
        (1, 20000, 9),
        (1, 250, 33),
        (1, 2048, 151936),
        (4, 2048, 151936),
        (2, 768, 2048),
        (3, 4096, 80),
        (4, 100, 96),
        (2, 250, 33),
        (1, 7, 5),
        (64, 768, 2048),
        (300, 2048, 512),
        (7, 256, 80),
        (5, 250, 33),
        (5, 2048, 151936),
    ];
    // More rows run on tensor cores (x split into two bf16 parts) or, with those off,
    // through the widened matrix: both ways are checked.
    let ways = cases
        .iter()
        .flat_map(|&c| [(c, true), (c, false)])
        .filter(|&((rows, _, _), tc)| tc || rows > 4);
    for ((rows, in_dim, out_dim), tensor_cores) in ways {
        let x = fresh(rows * in_dim, 22);
        let w = bf16_values(&fresh(out_dim * in_dim, 23));
        assert!(
            g.upload_matrix(&w, out_dim, in_dim).is_bf16(),
            "bf16 values are kept in bf16"
        );
        both!(
            on device(tensor_cores);
            &format!("matmul bf16 {rows}x{in_dim} -> {out_dim} tensor cores {tensor_cores}"),
            &[&x],
            rows * out_dim,
            1e-5,
            |b, t, o| b.matmul(
                &t[0],
                &b.upload_matrix(&w, out_dim, in_dim),
                rows,
                in_dim,
                out_dim,
                o
            )
        );
    }
    // One value off bf16 keeps the whole matrix in f32.
    let mut w = bf16_values(&fresh(64 * 96, 24));
    w[1000] = f32::from_bits(w[1000].to_bits() | 1);
    assert!(!g.upload_matrix(&w, 64, 96).is_bf16());
    assert_eq!(g.upload_matrix(&w, 64, 96).bytes(), 64 * 96 * 4);
    assert_eq!(
        g.upload_matrix(&bf16_values(&w), 64, 96).bytes(),
        64 * 96 * 2
    );
    // Embedding rows from a bf16 table, by host ids and by the id in a step tensor.
    let (vocab, dim) = (1000, 256);
    let table = bf16_values(&fresh(vocab * dim, 25));
    let ids = [0u32, 999, 17, 17, 500];
    both!(
        "embed bf16 5 of 1000x256",
        &[],
        ids.len() * dim,
        1e-7,
        |b, _t, o| b.embed(&b.upload_matrix(&table, vocab, dim), dim, &ids, o)
    );
    for tok in [0u32, 999, 321] {
        let step = [f32::from_bits(tok), f32::from_bits(3)];
        both!(
            &format!("embed_at bf16 token {tok}"),
            &[&step],
            dim,
            1e-7,
            |b, t, o| b.embed_at(&b.upload_matrix(&table, vocab, dim), dim, &t[0], o)
        );
    }
}

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
            |b, t, o| b.embed_at(&b.upload_matrix(&table, vocab, dim), dim, &t[0], o)
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

#[test]
fn norms_and_the_fused_residual_norm_match_the_reference() {
    let Some(_) = gpu() else { return };
    // Both launch shapes (a warp per row up to 512 wide, a block per row above), widths
    // on and off the 16-byte loads (multiples of 4 or not), one row and several: the
    // per-head q/k norm (32 x 128), the hidden norm (1 x 2048), prefill-like rows.
    let cases = [
        (1, 2048),
        (32, 128),
        (4, 128),
        (9, 512),
        (3, 513),
        (1, 130),
        (5, 7),
        (2, 2050),
        (17, 4096),
        (1, 1),
    ];
    for (rows, dim) in cases {
        let n = rows * dim;
        let (x, w, d) = (fresh(n, 20 + dim as u64), fresh(dim, 21), fresh(n, 22));
        let s = format!("{rows}x{dim}");
        both!(&format!("rms_norm {s}"), &[&x, &w], n, 1e-5, |b, t, o| b
            .rms_norm(&t[0], &t[1], rows, dim, 1e-6, o));
        both!(
            &format!("rms_norm_inplace {s}"),
            &[&x, &w],
            n,
            1e-5,
            |b, t, o| {
                b.write_rows(&t[0], o, 0, rows, dim);
                b.rms_norm_inplace(o, &t[1], rows, dim, 1e-6)
            }
        );
        // The sum left in x, then the norm: both halves of the output.
        both!(
            &format!("add_rms_norm {s}"),
            &[&x, &d, &w],
            2 * n,
            1e-5,
            |b, t, o| {
                let (mut xs, mut out) = (b.alloc(n), b.alloc(n));
                b.write_rows(&t[0], &mut xs, 0, rows, dim);
                b.add_rms_norm(&mut xs, &t[1], &t[2], rows, dim, 1e-6, &mut out);
                concat(b, &[(&xs, n), (&out, n)], o)
            }
        );
        // Out of place: the sum, the norm, and x as it was.
        both!(
            &format!("add_rms_norm_to {s}"),
            &[&x, &d, &w],
            3 * n,
            1e-5,
            |b, t, o| {
                let (mut sum, mut out) = (b.alloc(n), b.alloc(n));
                let add = AddNorm {
                    x: &t[0],
                    delta: Some(&t[1]),
                    w: &t[2],
                    eps: 1e-6,
                };
                b.add_rms_norm_to(add, rows, dim, &mut sum, &mut out);
                concat(b, &[(&sum, n), (&out, n), (&t[0], n)], o)
            }
        );
    }
}

/// The device's argmax rule: the largest value of each row, ties to the lower index, NaN
/// never chosen, 0 for a row of NaN only.
fn argmax_plain(x: &[f32], rows: usize, dim: usize) -> Vec<u32> {
    (0..rows)
        .map(|r| {
            let row = &x[r * dim..(r + 1) * dim];
            let mut best: Option<usize> = None;
            for (i, &v) in row.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|b| v > row[b]) {
                    best = Some(i);
                }
            }
            best.unwrap_or(0) as u32
        })
        .collect()
}

#[test]
fn argmax_over_long_rows_matches_a_plain_loop() {
    let Some(g) = gpu() else { return };
    // The LM-head width (149 blocks a row), ragged widths (a last block of a few values),
    // one block only, several rows at once; rows run in turn on the same counters, so a
    // count left behind would show in the next call.
    let cases = [
        (1, 151936),
        (3, 5000),
        (2, 1025),
        (1, 1024),
        (4, 7),
        (1, 1),
        (3, 151936),
    ];
    for (case, &(rows, dim)) in cases.iter().enumerate() {
        let mut x = fresh(rows * dim, 700 + case as u64);
        // Row 0: a tie between two blocks (the lower wins), NaN beside them.
        let (a, b) = (dim / 3, dim - 1);
        x[a] = 50.0;
        x[b] = 50.0;
        if a > 0 {
            x[a - 1] = f32::NAN;
        }
        if rows > 1 {
            // Row 1: only NaN and -inf, the first -inf past the first block.
            for v in &mut x[dim..2 * dim] {
                *v = f32::NAN;
            }
            x[dim + dim / 2] = f32::NEG_INFINITY;
            x[dim + dim - 1] = f32::NEG_INFINITY;
        }
        if rows > 2 {
            // Row 2: NaN only.
            for v in &mut x[2 * dim..3 * dim] {
                *v = f32::NAN;
            }
        }
        let want = argmax_plain(&x, rows, dim);
        let at = 2;
        let (xt, mut ot) = (g.upload(&x), g.upload(&fresh(at + rows, 701)));
        g.argmax_rows(&xt, rows, dim, &mut ot, at);
        let mut got = vec![0.0f32; at + rows];
        g.download(&ot, &mut got);
        let got_ids: Vec<u32> = got[at..].iter().map(|v| v.to_bits()).collect();
        println!("check argmax_rows {rows}x{dim} {got_ids:?} want {want:?}");
        assert_eq!(got_ids, want, "argmax {rows}x{dim}");
        let kept = fresh(at, 701);
        assert_eq!(
            got[..at].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            kept.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "values before `at` kept"
        );
    }
    // Inside a recorded step, replayed with new values: the counts must be back at zero
    // after every replay. A backend of its own, since a recording takes in whatever
    // other tests' threads queue on the shared one's stream; one call first grows its
    // scratch outside the record, as a decode state's first (unrecorded) step does.
    let g = &Cuda::new(0).unwrap();
    let dim = 151936;
    let x0 = fresh(dim, 710);
    let (mut xt, mut ot) = (g.upload(&x0), g.alloc(1));
    g.argmax_rows(&xt, 1, dim, &mut ot, 0);
    let key = (usize::MAX - 7, 0);
    for round in 0..4u64 {
        let mut x = fresh(dim, 711 + round);
        let planted = (round as usize * 40_000 + 17) % dim;
        x[planted] = 90.0;
        g.upload_into(&x, &mut xt);
        let replayed = g.replay_step(key, &mut || {
            g.argmax_rows(&xt, 1, dim, &mut ot, 0);
            true
        });
        assert_eq!(replayed, g.tuning().graphs, "ran from a recorded graph");
        let mut got = [0.0f32];
        g.download(&ot, &mut got);
        println!(
            "check argmax_rows replay {round}: {} (recorded steps {})",
            got[0].to_bits(),
            g.recorded_steps()
        );
        assert_eq!(got[0].to_bits() as usize, planted, "replay {round}");
    }
}

#[test]
fn three_products_in_one_launch_match_the_reference() {
    let Some(_) = gpu() else { return };
    // A layer's q, k and v shapes (one launch over the three when all are bf16 and at
    // most 4 rows), output widths off the 8 rows of a block, widths off the 16-byte loads,
    // and the fallbacks: 6 rows (cuBLAS) and f32 matrices.
    let cases = [
        ([512, 64, 64], 2048, 1, true),
        ([37, 5, 5], 2048, 4, true),
        ([37, 5, 5], 4096, 1, true),
        ([9, 3, 17], 24, 1, true),
        ([37, 5, 5], 100, 3, true),
        ([9, 3, 17], 24, 2, true),
        ([40, 8, 8], 256, 6, true),
        ([40, 8, 8], 256, 2, false),
    ];
    for (case, &(dims, cols, rows, bf16)) in cases.iter().enumerate() {
        let salt = 900 + 10 * case as u64;
        let ws: Vec<Vec<f32>> = (0..3)
            .map(|j| {
                let w = fresh(dims[j] * cols, salt + j as u64);
                if bf16 {
                    bf16_values(&w)
                } else {
                    w
                }
            })
            .collect();
        let x = fresh(rows * cols, salt + 5);
        let total: usize = dims.iter().sum();
        both!(
            &format!("linear3 {dims:?} x {cols} rows {rows} bf16 {bf16}"),
            &[&x],
            rows * total,
            1e-5,
            |b, t, o| {
                let m: Vec<_> = (0..3)
                    .map(|j| b.upload_matrix(&ws[j], dims[j], cols))
                    .collect();
                let (mut q, mut k, mut v) = (
                    b.alloc(rows * dims[0]),
                    b.alloc(rows * dims[1]),
                    b.alloc(rows * dims[2]),
                );
                b.linear3(
                    &t[0],
                    [
                        Weight::Dense(&m[0]),
                        Weight::Dense(&m[1]),
                        Weight::Dense(&m[2]),
                    ],
                    rows,
                    cols,
                    dims,
                    [&mut q, &mut k, &mut v],
                );
                concat(
                    b,
                    &[
                        (&q, rows * dims[0]),
                        (&k, rows * dims[1]),
                        (&v, rows * dims[2]),
                    ],
                    o,
                )
            }
        );
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

/// A random matrix quantized to MLX 4 bits and repacked at `bits`.
type Affine = AffineMatrix;

fn affine(rows: usize, cols: usize, bits: u32, salt: u64) -> Affine {
    AffineMatrix::quantize(&fresh(rows * cols, salt), rows, cols, bits).unwrap()
}

#[test]
fn affine_products_match_the_reference_at_every_width_and_batch() {
    let Some(_) = gpu() else { return };
    // Expert shapes of Qwen3-30B-A3B (768 x 2048 and back), a padded input (80 columns
    // of a 128-column matrix), batches on the matrix-vector path (1, 3, 4, 6: one and
    // two tiles) and on the expand-then-GEMM path (9, 40).
    let shapes = [(768, 2048, 2048), (2048, 768, 768), (96, 128, 80)];
    for bits in [4, 3, 2] {
        for (i, &(rows, cols, in_dim)) in shapes.iter().enumerate() {
            let m = affine(rows, cols, bits, 40 + i as u64);
            for batch in [1, 3, 4, 6, 9, 40] {
                let x = fresh(batch * in_dim, 50 + batch as u64);
                let w = m.view();
                both!(
                    &format!("affine q{bits} {rows}x{cols} (in {in_dim}) batch {batch}"),
                    &[&x],
                    batch * rows,
                    1e-5,
                    |b, t, o| b.matmul_affine(&t[0], &w, batch, in_dim, o)
                );
            }
        }
    }
}

#[test]
fn dense_affine_products_match_the_reference_every_way() {
    let Some(_) = gpu() else { return };
    // Dense layers at an affine codec: the LM head and attention shapes of Qwen3-30B-A3B
    // (one row: `dense_mma`, which splits a job of the narrow ones over warps and loops a
    // grid over the head's 9 496 tiles), a ragged 100-row matrix with a padded input, and
    // prompts of 9 and 300 rows (the grouped GEMM with one group). Each also the other
    // way: one row through the matrix-vector kernel, prompts through expand-then-GEMM.
    let shapes = [
        (151936, 2048, 2048, 1),
        (4096, 2048, 2048, 1),
        (2048, 4096, 4096, 1),
        (512, 2048, 2048, 1),
        (100, 192, 150, 1),
        (4096, 2048, 2048, 9),
        (512, 2048, 2048, 300),
        (100, 192, 150, 40),
    ];
    for bits in [4, 3, 2] {
        for (i, &(rows, cols, in_dim, batch)) in shapes.iter().enumerate() {
            let m = affine(rows, cols, bits, 70 + i as u64);
            let x = fresh(batch * in_dim, 75 + i as u64);
            let w = m.view();
            for tensor_cores in [true, false] {
                both!(
                    on device(tensor_cores);
                    &format!(
                        "dense q{bits} {rows}x{cols} (in {in_dim}) rows {batch} mma {tensor_cores}"
                    ),
                    &[&x],
                    batch * rows,
                    1e-5,
                    |b, t, o| b.matmul_affine(&t[0], &w, batch, in_dim, o)
                );
            }
        }
        // A layer's q, k and v at the codec in one launch (on tensor cores), and a ragged
        // three; without tensor cores, one product after another.
        for (case, (dims, cols)) in [([4096, 512, 512], 2048), ([37, 5, 21], 128)]
            .into_iter()
            .enumerate()
        {
            let ms: Vec<Affine> = (0..3)
                .map(|j| affine(dims[j], cols, bits, 80 + 3 * case as u64 + j as u64))
                .collect();
            let x = fresh(cols, 85 + case as u64);
            let total: usize = dims.iter().sum();
            for tensor_cores in [true, false] {
                both!(
                    on device(tensor_cores);
                    &format!("linear3 q{bits} {dims:?} x {cols} mma {tensor_cores}"),
                    &[&x],
                    total,
                    1e-5,
                    |b, t, o| {
                        let (mut q, mut k, mut v) =
                            (b.alloc(dims[0]), b.alloc(dims[1]), b.alloc(dims[2]));
                        b.linear3(
                            &t[0],
                            [0, 1, 2].map(|j| Weight::Affine(ms[j].view())),
                            1,
                            cols,
                            dims,
                            [&mut q, &mut k, &mut v],
                        );
                        concat(b, &[(&q, dims[0]), (&k, dims[1]), (&v, dims[2])], o)
                    }
                );
            }
        }
    }
}

/// The [`AddNorm`] of inputs `[x, delta, w]` (`dim` wide), with the add or without;
/// without, `sum` (which no op then writes) is set to x, the residual it stands for.
fn add_norm_case<'t, B: Backend>(
    b: &B,
    t: &'t [B::Tensor],
    added: bool,
    eps: f32,
    sum: &mut B::Tensor,
    dim: usize,
) -> AddNorm<'t, B::Tensor> {
    if !added {
        b.write_rows(&t[0], sum, 0, 1, dim);
    }
    AddNorm {
        x: &t[0],
        delta: added.then_some(&t[1]),
        w: &t[2],
        eps,
    }
}

#[test]
fn residual_norms_folded_into_the_products_match_the_reference() {
    let Some(_) = gpu() else { return };
    // A decode step's q/k/v (one `dense_mma` launch that adds the residual and norms its
    // input itself) and its LM head, at each codec: Qwen3-30B-A3B's shapes and a ragged
    // three over a padded input; with the residual add and without it (the first
    // layer's norm reads the embedding), and each also through the separate norm
    // (matrix-vector kernels). Outputs: the products, then the sum.
    let eps = 1e-6;
    for bits in [4, 3, 2] {
        for (case, (dims, cols, in_dim)) in
            [([4096, 512, 512], 2048, 2048), ([37, 5, 21], 192, 150)]
                .into_iter()
                .enumerate()
        {
            let salt = 300 + 10 * case as u64 + bits as u64;
            let ms: Vec<Affine> = (0..3)
                .map(|j| affine(dims[j], cols, bits, salt + j as u64))
                .collect();
            let head = affine(if case == 0 { 151936 } else { 300 }, cols, bits, salt + 3);
            let (x, d, w) = (
                fresh(in_dim, salt + 4),
                fresh(in_dim, salt + 5),
                fresh(in_dim, salt + 6),
            );
            for (added, tensor_cores) in [(true, true), (false, true), (true, false)] {
                let g = device(tensor_cores);
                let label = format!(
                    "q{bits} {dims:?} x {cols} (in {in_dim}) add {added} mma {tensor_cores}"
                );
                let total: usize = dims.iter().sum();
                both!(
                    on g;
                    &format!("add_rms_norm_linear3 {label}"),
                    &[&x, &d, &w],
                    total + in_dim,
                    1e-5,
                    |b, t, o| {
                        let (mut q, mut k, mut v) =
                            (b.alloc(dims[0]), b.alloc(dims[1]), b.alloc(dims[2]));
                        let (mut sum, mut xn) = (b.alloc(in_dim), b.alloc(in_dim));
                        let n = add_norm_case(b, t, added, eps, &mut sum, in_dim);
                        b.add_rms_norm_linear3(
                            n,
                            &mut sum,
                            &mut xn,
                            [0, 1, 2].map(|j| Weight::Affine(ms[j].view())),
                            1,
                            in_dim,
                            dims,
                            [&mut q, &mut k, &mut v],
                        );
                        let parts = [(&q, dims[0]), (&k, dims[1]), (&v, dims[2]), (&sum, in_dim)];
                        concat(b, &parts, o)
                    }
                );
                let rows = head.rows;
                both!(
                    on g;
                    &format!("add_rms_norm_linear head {rows} {label}"),
                    &[&x, &d, &w],
                    rows + in_dim,
                    1e-5,
                    |b, t, o| {
                        let (mut out, mut sum, mut xn) =
                            (b.alloc(rows), b.alloc(in_dim), b.alloc(in_dim));
                        let n = add_norm_case(b, t, added, eps, &mut sum, in_dim);
                        let view = Weight::Affine(head.view());
                        b.add_rms_norm_linear(
                            n, &mut sum, &mut xn, view, 1, in_dim, rows, &mut out,
                        );
                        concat(b, &[(&out, rows), (&sum, in_dim)], o)
                    }
                );
            }
        }
    }
}

#[test]
fn vq_products_match_the_reference() {
    let Some(_) = gpu() else { return };
    use dynmoe::codec::vq::{VqMatrix, LADDER};
    // Ragged widths (80 columns: one block of 128; 1500: a block of 1024 and a padded
    // tail), the expert shapes (2048 columns: two blocks of 1024; 768: three of 256),
    // at every rung: books in shared memory and in global memory, vectors of 2 to 16
    // values. Batches 1-4 run from the codes, 5 and 40 decode and run a GEMM.
    let shapes = [(96usize, 80usize), (37, 1500), (768, 2048), (2048, 768)];
    for (ri, rung) in LADDER.into_iter().enumerate() {
        for (si, &(rows, cols)) in shapes.iter().enumerate() {
            let w = fresh(rows * cols, 90 + si as u64);
            let m = VqMatrix::encode(&w, rows, cols, rung, 7 + (ri * 4 + si) as u64).unwrap();
            let view = m.view();
            for batch in [1, 2, 3, 4, 5, 40] {
                let x = fresh(batch * cols, 95 + batch as u64);
                both!(
                    &format!("{} {rows}x{cols} batch {batch}", rung.name()),
                    &[&x],
                    batch * rows,
                    1e-5,
                    |b, t, o| b.matmul_vq(&t[0], &view, batch, o)
                );
            }
        }
    }
}

#[test]
fn vq_rotation_matches_the_cpu_rotation() {
    let Some(g) = gpu() else { return };
    use dynmoe::codec::vq::rotation::{block_size, rotate_row, signs};
    // rotate_row also divides each block by its stored norm and multiplies by √R; the
    // activations are rotated without either, so its output is scaled back to compare.
    for (rows, cols, seed) in [
        (3usize, 1500usize, 11u64),
        (4, 80, 12),
        (2, 2048, 13),
        (1, 13, 14),
    ] {
        let block = block_size(cols);
        let blocks = cols.div_ceil(block);
        let x = fresh(rows * cols, 700 + seed);
        let s = signs(seed, block);
        let mut want = Vec::with_capacity(rows * blocks * block);
        for row in x.chunks_exact(cols) {
            let mut dst = vec![0.0f32; blocks * block];
            let mut norms = Vec::new();
            rotate_row(row, &s, &mut dst, |n| norms.push(n.to_f32()));
            for (d, n) in dst.chunks_exact(block).zip(&norms) {
                want.extend(d.iter().map(|v| v * n / (block as f32).sqrt()));
            }
        }
        let xd = g.upload(&x);
        let mut out = g.alloc(want.len());
        g.vq_rotate(&xd, rows, cols, seed, block, &mut out);
        let mut got = vec![0.0; want.len()];
        g.download(&out, &mut got);
        let e = rel_err(&got, &want);
        println!("check vq rotation {rows}x{cols} (block {block}) rel_err {e:.2e}");
        assert!(e < 1e-5, "vq rotation {rows}x{cols}: rel err {e:.2e}");
    }
}

#[test]
fn vq_experts_through_swiglu_groups_match_the_reference() {
    let Some(_) = gpu() else { return };
    use dynmoe::codec::vq::{Rung, VqMatrix};
    // Experts 80 wide (the down input one padded block of 128) over 256-wide rows, with
    // 1 to 20 rows each (matrix-vector and GEMM paths), at a rung with the book in shared
    // memory and one with it in global memory; an affine expert rides along.
    let (hidden, inter, tokens) = (256, 80, 24);
    let x = fresh(tokens * hidden, 170);
    let base = fresh(tokens * hidden, 171);
    let mut rng = Rng::new(172);
    let counts = [1usize, 4, 5, 20];
    for rung in ["3", "2"] {
        let rung = Rung::parse(rung).unwrap();
        let mats: Vec<[VqMatrix; 3]> = (0..counts.len() as u64)
            .map(|e| {
                let enc = |rows, cols, salt| {
                    VqMatrix::encode(&fresh(rows * cols, salt), rows, cols, rung, salt).unwrap()
                };
                [
                    enc(inter, hidden, 180 + 3 * e),
                    enc(inter, hidden, 181 + 3 * e),
                    enc(hidden, inter, 182 + 3 * e),
                ]
            })
            .collect();
        let rows: Vec<Vec<u32>> = counts
            .iter()
            .map(|&n| {
                let mut r: Vec<u32> = (0..tokens as u32).collect();
                for i in (1..r.len()).rev() {
                    r.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                r.truncate(n);
                r
            })
            .collect();
        let scales: Vec<Vec<f32>> = counts.iter().map(|&n| fresh(n, 190 + n as u64)).collect();
        let aff = [
            affine(inter, hidden, 4, 195),
            affine(inter, hidden, 4, 196),
            affine(hidden, 128, 4, 197),
        ];
        let aff_rows: Vec<u32> = (0..tokens as u32).step_by(5).collect();
        let aff_scales = fresh(aff_rows.len(), 198);
        both!(
            &format!("swiglu_groups {} rows {counts:?} + affine q4", rung.name()),
            &[&x, &base],
            tokens * hidden,
            1e-5,
            |b, t, o| {
                b.write_rows(&t[1], o, 0, tokens, hidden);
                let mut groups: Vec<SwiGluGroup<'_, _>> = mats
                    .iter()
                    .zip(rows.iter().zip(&scales))
                    .map(|(m, (r, s))| SwiGluGroup {
                        gate: Weight::Vq(m[0].view()),
                        up: Weight::Vq(m[1].view()),
                        down: Weight::Vq(m[2].view()),
                        intermediate: inter,
                        rows: r,
                        scales: s,
                    })
                    .collect();
                groups.push(SwiGluGroup {
                    gate: Weight::Affine(aff[0].view()),
                    up: Weight::Affine(aff[1].view()),
                    down: Weight::Affine(aff[2].view()),
                    intermediate: inter,
                    rows: &aff_rows,
                    scales: &aff_scales,
                });
                b.swiglu_groups(&t[0], hidden, &groups, o)
            }
        );
    }
}

#[test]
fn moe_dispatch_matches_the_reference() {
    let Some(_) = gpu() else { return };
    // Experts 80 wide (the down input padded to 128) over 256-wide rows, with 1 to 70
    // rows each; a dense group rides along. On tensor cores every affine group runs
    // through the grouped GEMMs (ragged tiles of 32 pairs, 64 outputs); without, the
    // grouped matrix-vector launch takes the groups of at most 8 rows and the rest run
    // one by one (expand then GEMM).
    let (hidden, inter, tokens) = (256, 80, 80);
    let x = fresh(tokens * hidden, 70);
    let base = fresh(tokens * hidden, 71);
    let mut rng = Rng::new(72);
    let counts = [1usize, 3, 5, 8, 9, 20, 2, 33, 70];
    for (bits, tensor_cores) in [
        (4, true),
        (3, true),
        (2, true),
        (4, false),
        (3, false),
        (2, false),
    ] {
        let mats: Vec<[Affine; 3]> = (0..counts.len() as u64)
            .map(|e| {
                [
                    affine(inter, hidden, bits, 80 + 3 * e),
                    affine(inter, hidden, bits, 81 + 3 * e),
                    affine(hidden, 128, bits, 82 + 3 * e),
                ]
            })
            .collect();
        let rows: Vec<Vec<u32>> = counts
            .iter()
            .map(|&n| {
                let mut r: Vec<u32> = (0..tokens as u32).collect();
                for i in (1..r.len()).rev() {
                    r.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                r.truncate(n);
                r
            })
            .collect();
        let scales: Vec<Vec<f32>> = counts.iter().map(|&n| fresh(n, 90 + n as u64)).collect();
        // The dense group in bf16 at 4 and 2 bits, in f32 at 3; its 8 rows take the
        // widen-then-cuBLAS path for bf16.
        let dense_bf16 = bits != 3;
        let dense = [
            fresh(inter * hidden, 95),
            fresh(inter * hidden, 96),
            fresh(hidden * inter, 97),
        ]
        .map(|m| if dense_bf16 { bf16_values(&m) } else { m });
        let dense_rows: Vec<u32> = (0..tokens as u32).step_by(3).collect();
        let dense_scales = fresh(dense_rows.len(), 98);
        both!(
            on device(tensor_cores);
            &format!("swiglu_groups q{bits} tensor cores {tensor_cores} + dense bf16 {dense_bf16}"),
            &[&x, &base],
            tokens * hidden,
            1e-5,
            |b, t, o| {
                b.write_rows(&t[1], o, 0, tokens, hidden);
                let d = [
                    b.upload_matrix(&dense[0], inter, hidden),
                    b.upload_matrix(&dense[1], inter, hidden),
                    b.upload_matrix(&dense[2], hidden, inter),
                ];
                let mut groups: Vec<SwiGluGroup<'_, _>> = mats
                    .iter()
                    .zip(rows.iter().zip(&scales))
                    .map(|(m, (r, s))| SwiGluGroup {
                        gate: Weight::Affine(m[0].view()),
                        up: Weight::Affine(m[1].view()),
                        down: Weight::Affine(m[2].view()),
                        intermediate: inter,
                        rows: r,
                        scales: s,
                    })
                    .collect();
                groups.push(SwiGluGroup {
                    gate: Weight::Dense(&d[0]),
                    up: Weight::Dense(&d[1]),
                    down: Weight::Dense(&d[2]),
                    intermediate: inter,
                    rows: &dense_rows,
                    scales: &dense_scales,
                });
                b.swiglu_groups(&t[0], hidden, &groups, o)
            }
        );
    }
}

/// The host route of the block: probabilities `[rows, E]` and the output of the chosen
/// experts, on the CPU reference.
#[allow(clippy::too_many_arguments)]
fn routed_reference<'w>(
    x: &[f32],
    gate: &[f32],
    rows: usize,
    hidden: usize,
    experts: usize,
    weights: &dyn Fn(usize) -> [Weight<'w, Vec<f32>>; 3],
    top_k: usize,
    renormalize: bool,
    keep: Option<&[bool]>,
) -> (Vec<f32>, Vec<f32>) {
    let cpu = Cpu::reference();
    let mut probs = vec![f32::NAN; rows * experts];
    cpu.matmul(
        &x.to_vec(),
        &gate.to_vec(),
        rows,
        hidden,
        experts,
        &mut probs,
    );
    cpu.softmax_rows(&mut probs, rows, experts);
    let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); experts];
    for r in 0..rows {
        let p = &probs[r * experts..(r + 1) * experts];
        let router = Router::SoftmaxTopK { renormalize };
        let chosen = match keep {
            Some(k) => route(&confine(p, k), top_k, router),
            None => route(p, top_k, router),
        };
        for (&e, &w) in chosen.experts.iter().zip(&chosen.weights) {
            routed[e as usize].0.push(r as u32);
            routed[e as usize].1.push(w);
        }
    }
    let groups: Vec<SwiGluGroup<'_, Vec<f32>>> = routed
        .iter()
        .enumerate()
        .filter(|(_, (r, _))| !r.is_empty())
        .map(|(e, (r, s))| {
            let [gate, up, down] = weights(e);
            SwiGluGroup {
                gate,
                up,
                down,
                intermediate: match gate {
                    Weight::Affine(a) => a.rows,
                    Weight::Vq(v) => v.rows,
                    Weight::Dense(_) => unreachable!("quantized experts"),
                },
                rows: r,
                scales: s,
            }
        })
        .collect();
    let mut out = vec![0.0f32; rows * hidden];
    cpu.swiglu_groups(&x.to_vec(), hidden, &groups, &mut out);
    (probs, out)
}

/// The codes of the experts [`check_routed`] makes: affine at a width, or a VQ rung.
#[derive(Clone, Copy)]
enum Codes {
    Affine(u32),
    Vq(&'static str),
}

/// Random experts `inter` wide over `hidden`-wide rows, gate, up and down each.
enum Experts {
    Affine(Vec<[Affine; 3]>),
    Vq(Vec<[dynmoe::codec::vq::VqMatrix; 3]>),
}

impl Experts {
    fn new(codes: Codes, experts: usize, hidden: usize, inter: usize) -> Experts {
        let salt = |e: usize, p: usize| 300 + (3 * e + p) as u64;
        match codes {
            Codes::Affine(bits) => {
                // The down input padded to whole quantization groups.
                let down_cols = inter.next_multiple_of(64);
                Experts::Affine(
                    (0..experts)
                        .map(|e| {
                            [
                                affine(inter, hidden, bits, salt(e, 0)),
                                affine(inter, hidden, bits, salt(e, 1)),
                                affine(hidden, down_cols, bits, salt(e, 2)),
                            ]
                        })
                        .collect(),
                )
            }
            Codes::Vq(rung) => {
                use dynmoe::codec::vq::{Rung, VqMatrix};
                let rung = Rung::parse(rung).unwrap();
                let enc = |rows, cols, salt| {
                    VqMatrix::encode(&fresh(rows * cols, salt), rows, cols, rung, salt).unwrap()
                };
                Experts::Vq(
                    (0..experts)
                        .map(|e| {
                            [
                                enc(inter, hidden, salt(e, 0)),
                                enc(inter, hidden, salt(e, 1)),
                                enc(hidden, inter, salt(e, 2)),
                            ]
                        })
                        .collect(),
                )
            }
        }
    }

    fn weights<T>(&self, e: usize) -> [Weight<'_, T>; 3] {
        match self {
            Experts::Affine(m) => m[e].each_ref().map(|m| Weight::Affine(m.view())),
            Experts::Vq(m) => m[e].each_ref().map(|m| Weight::Vq(m.view())),
        }
    }
}

impl std::fmt::Display for Codes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Codes::Affine(bits) => write!(f, "q{bits}"),
            Codes::Vq(rung) => write!(f, "vq{rung}"),
        }
    }
}

/// [`Cuda::routed_moe`] against the host route for `experts` random experts (`inter`
/// wide over `hidden`-wide rows) coded as `codes`, for each case (rows, top-k,
/// renormalise, plan mask). With `tie`, experts 3 and 7 have the same router row, the
/// largest logit of row 0 (so top-1 must pick expert 3, the lower id).
fn check_routed(g: &Cuda, hidden: usize, inter: usize, experts: usize, codes: Codes, tie: bool) {
    let keep: Vec<bool> = (0..experts).map(|e| e % 3 != 1).collect();
    let mats = Experts::new(codes, experts, hidden, inter);
    // Past 8 rows (a prompt) pairs are grouped by expert on the device and run through
    // the grouped GEMMs on tensor cores (VQ ones over 512 rows of top-8 in chunks of
    // 4 096 pairs); VQ rungs of 2-value vectors, and rotation blocks under 64, through
    // the decode kernels.
    let mut cases = vec![
        (1, 4, true, false),
        (1, 2, false, true),
        (3, 4, false, false),
        (8, 3, true, true),
        (9, 4, true, false),
        (40, 3, false, true),
    ];
    if experts >= 16 {
        cases.extend([
            (1, 8, true, false),
            (5, 8, true, true),
            (2, 8, false, false),
            (300, 8, true, true),
        ]);
        if matches!(codes, Codes::Vq(_)) {
            cases.push((600, 8, false, true));
        }
    }
    if tie {
        cases.extend([(1, 1, false, false), (1, 1, true, false)]);
    }
    for (case, &(rows, top_k, renormalize, masked)) in cases.iter().enumerate() {
        let salt = 400 + 10 * case as u64 + experts as u64;
        let x = fresh(rows * hidden, salt);
        // Router weights scaled so the probabilities are spread, not one-hot; in bf16
        // (as a checkpoint's) on every other case.
        let mut gate: Vec<f32> = fresh(experts * hidden, salt + 1)
            .iter()
            .map(|v| v * 0.1)
            .collect();
        if tie {
            for e in [3, 7] {
                for (w, xv) in gate[e * hidden..(e + 1) * hidden].iter_mut().zip(&x) {
                    *w = 0.05 * xv;
                }
            }
        }
        let gate_bf16 = case % 2 == 0;
        let gate = if gate_bf16 { bf16_values(&gate) } else { gate };
        let keep = masked.then_some(keep.as_slice());
        let host = |e: usize| -> [Weight<'_, Vec<f32>>; 3] { mats.weights(e) };
        let (want_p, want) = routed_reference(
            &x,
            &gate,
            rows,
            hidden,
            experts,
            &host,
            top_k,
            renormalize,
            keep,
        );
        let dev = |e: usize| -> [Weight<'_, _>; 3] { mats.weights(e) };
        // One block id for every case: each new set of weights under it must replace
        // the device table, never reuse it.
        let ex = RoutedExperts {
            id: 7,
            count: experts,
            weights: &dev,
        };
        let r = DeviceRoute {
            top_k,
            renormalize,
            keep,
        };
        // The probabilities land after `at` poisoned values, as a layer's do.
        let at = 5;
        let (xd, gd) = (g.upload(&x), g.upload_matrix(&gate, experts, hidden));
        assert_eq!(gd.is_bf16(), gate_bf16);
        let mut probs = g.alloc(at + rows * experts);
        let mut out = g.alloc(rows * hidden);
        // Without tensor cores a prompt's affine experts would each be read once per row:
        // the device declines them for the host path, and leaves the outputs alone.
        let declines = !g.tensor_cores() && rows > 8 && matches!(codes, Codes::Affine(_));
        assert_eq!(
            g.routed_moe(
                MoeInput::Rows(&xd),
                rows,
                hidden,
                &gd,
                &ex,
                r,
                &mut probs,
                at,
                &mut out
            ),
            !declines,
            "experts of one shape and codes route on the device (declines {declines})"
        );
        if declines {
            let mut left = vec![0.0; rows * hidden];
            g.download(&out, &mut left);
            assert!(left.iter().all(|v| v.is_nan()), "a declined block wrote");
            continue;
        }
        let mut got = vec![0.0; rows * hidden];
        g.download(&out, &mut got);
        let mut got_p = vec![0.0; at + rows * experts];
        g.download(&probs, &mut got_p);
        let (e_out, e_p) = (rel_err(&got, &want), rel_err(&got_p[at..], &want_p));
        println!(
            "check routed moe {codes} E {experts} rows {rows} top-{top_k} renorm {renormalize:<5} \
             mask {masked:<5} gate bf16 {gate_bf16:<5} tie {tie:<5} tensor cores {:<5} \
             out {e_out:.2e} probs {e_p:.2e}",
            g.tensor_cores(),
        );
        // Past 8 rows a bf16 router's product runs on tensor cores over two bf16 parts of
        // x (about 16 of its bits), and the probabilities differ from the reference by up
        // to ~8e-6 (cuBLAS picks the GEMM per call); the experts' weights carry that.
        let tol = if rows > 8 && gate_bf16 { 2e-5 } else { 1e-5 };
        assert!(
            e_out < tol && e_p < tol,
            "routed moe: {e_out:.2e} {e_p:.2e} over {tol:.0e}"
        );
        assert!(
            got_p[..at].iter().all(|v| v.is_nan()),
            "wrote before its slot"
        );
        if rows == 1 {
            check_routed_add_norm(g, &gate, &gd, &ex, r, hidden, salt, &host, keep);
        }
    }
}

/// A decode step's MoE block reading its row through the post-attention residual add
/// and norm ([`MoeInput::AddNorm`], which the router folds in where it can): the output
/// and probabilities against the reference on the normed row, and the sum the block
/// writes (and the normed row, where the norm is a launch of its own: folded in, nothing
/// writes it).
#[allow(clippy::too_many_arguments)]
fn check_routed_add_norm<'w>(
    g: &Cuda,
    gate: &[f32],
    gd: &<Cuda as Backend>::Matrix,
    ex: &RoutedExperts<'_, <Cuda as Backend>::Matrix>,
    r: DeviceRoute<'_>,
    hidden: usize,
    salt: u64,
    host: &dyn Fn(usize) -> [Weight<'w, Vec<f32>>; 3],
    keep: Option<&[bool]>,
) {
    let (x, d, w) = (
        fresh(hidden, salt + 5),
        fresh(hidden, salt + 6),
        fresh(hidden, salt + 7),
    );
    let eps = 1e-6;
    let sum: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b).collect();
    let mut xn = vec![0.0; hidden];
    Cpu::reference().rms_norm(&sum, &w, 1, hidden, eps, &mut xn);
    let experts = ex.count;
    let (want_p, want) = routed_reference(
        &xn,
        gate,
        1,
        hidden,
        experts,
        host,
        r.top_k,
        r.renormalize,
        keep,
    );
    let (xd, dd, wd) = (g.upload(&x), g.upload(&d), g.upload(&w));
    {
        let (mut sum_d, mut xn_d) = (g.alloc(hidden), g.alloc(hidden));
        let mut probs = g.alloc(experts);
        let mut out = g.alloc(hidden);
        let input = MoeInput::AddNorm {
            n: AddNorm {
                x: &xd,
                delta: Some(&dd),
                w: &wd,
                eps,
            },
            sum: &mut sum_d,
            xn: &mut xn_d,
        };
        assert!(g.routed_moe(input, 1, hidden, gd, ex, r, &mut probs, 0, &mut out));
        let got = |t: &<Cuda as Backend>::Tensor, n: usize| {
            let mut v = vec![0.0; n];
            g.download(t, &mut v);
            v
        };
        // Folded (the router and the routed gate/up read the residual through the norm),
        // the normed row is left as `alloc` made it: NaN.
        let row = got(&xn_d, hidden);
        let fold = row.iter().all(|v| v.is_nan());
        let [e_out, e_p, e_sum, e_xn] = [
            rel_err(&got(&out, hidden), &want),
            rel_err(&got(&probs, experts), &want_p),
            rel_err(&got(&sum_d, hidden), &sum),
            if fold { 0.0 } else { rel_err(&row, &xn) },
        ];
        println!(
            "check routed moe through the residual norm, folded {fold:<5}: out {e_out:.2e} \
             probs {e_p:.2e} sum {e_sum:.2e} row {e_xn:.2e}"
        );
        assert!(
            [e_out, e_p, e_sum, e_xn].iter().all(|&e| e < 1e-5),
            "routed moe with its norm: {e_out:.2e} {e_p:.2e} {e_sum:.2e} {e_xn:.2e}"
        );
    }
}

#[test]
fn moe_routed_on_the_device_matches_the_host_route() {
    let Some(g) = gpu() else { return };
    // 12 experts 80 wide (the down input padded to 128) over 256-wide rows; top-k with
    // and without renormalisation and a plan's mask, one row (decode) to 300 (a prompt,
    // through the grouped GEMMs). Then 128 experts (a block routes its row), with a tie,
    // and 260 (past the 256 a block routes: the route kernel first). At 4 and 2 bits the
    // experts are held in unit tiles (the tiled routed kernels and grouped GEMMs), at 3 in
    // rows. Rows 2112 wide and experts 1600 wide give the tensor-core warps more 64-column
    // units than they load at once (33 for gate and up: 5 a warp and none for the last;
    // 4 × 26 for down), so those take a second round. One row through a bf16 router
    // starts the gate/up kernel early (x staged and the table copied before its launch
    // wait) and down's blocks load their words before theirs; a router in f32 does not.
    // Then the same without tensor cores: decode steps through the matrix-vector kernels,
    // the experts in rows, prompts declined for the host path.
    for g in [g, portable()] {
        for bits in [4, 3, 2] {
            check_routed(g, 256, 80, 12, Codes::Affine(bits), false);
        }
        check_routed(g, 128, 32, 128, Codes::Affine(4), true);
        check_routed(g, 128, 32, 260, Codes::Affine(2), true);
        check_routed(g, 2112, 1600, 6, Codes::Affine(3), false);
    }
}

#[test]
fn vq_experts_routed_on_the_device_match_the_host_route() {
    let Some(g) = gpu() else { return };
    // Experts 80 wide over 256-wide rows (gate and up rotated in one block of 256, down
    // in one padded block of 128) at a rung of each vector length: 8 (book of 64 KiB and
    // of 1 MiB), 4, 16 and 2; prompts take the grouped GEMMs but at 2. Then 128 experts
    // top-8 as Qwen3-30B-A3B routes them, with a tie and past 512 rows (two chunks), over
    // 32-value blocks (down's: prompts through the decode kernels); and that model's own
    // shape (two blocks of 1024 for gate and up, three of 256 for down).
    // Then without tensor cores: decode steps and prompts on CUDA cores (with them, but at
    // 2 values a vector and under 64-value blocks, on tensor cores).
    for g in [g, portable()] {
        for rung in ["1.5", "2", "3", "0.7", "5"] {
            check_routed(g, 256, 80, 12, Codes::Vq(rung), false);
        }
        check_routed(g, 128, 32, 128, Codes::Vq("1.5"), true);
        check_routed(g, 2048, 768, 10, Codes::Vq("1.5"), false);
    }
}

#[test]
fn device_weight_copies_follow_the_host_words() {
    let Some(g) = gpu() else { return };
    // The same host buffer rewritten in place: the cached device copy must not be
    // served for the new words.
    let mut m = affine(64, 128, 4, 60);
    let x = fresh(128, 61);
    let xt = g.upload(&x);
    let mut first = vec![0.0; 64];
    let mut out = g.alloc(64);
    g.matmul_affine(&xt, &m.view(), 1, 128, &mut out);
    g.download(&out, &mut first);
    let fresh_words = affine(64, 128, 4, 62).words;
    m.words.copy_from_slice(&fresh_words);
    let mut second = vec![0.0; 64];
    g.matmul_affine(&xt, &m.view(), 1, 128, &mut out);
    g.download(&out, &mut second);
    let mut want = vec![0.0; 64];
    Cpu::reference().matmul_affine(&x, &m.view(), 1, 128, &mut want);
    assert!(rel_err(&second, &want) < 1e-5);
    assert!(rel_err(&first, &want) > 1e-2);
}

#[test]
fn device_vq_copies_follow_the_host_codes() {
    let Some(g) = gpu() else { return };
    use dynmoe::codec::vq::{Rung, VqMatrix};
    // Codes rewritten in place, the seed and norms unchanged: the fingerprint's sampled
    // code bytes must tell the copies apart.
    let rung = Rung::parse("3").unwrap();
    let (rows, cols) = (64, 256);
    let mut m = VqMatrix::encode(&fresh(rows * cols, 160), rows, cols, rung, 5).unwrap();
    let other = VqMatrix::encode(&fresh(rows * cols, 161), rows, cols, rung, 5).unwrap();
    let x = fresh(cols, 162);
    let xt = g.upload(&x);
    let mut out = g.alloc(rows);
    let mut first = vec![0.0; rows];
    g.matmul_vq(&xt, &m.view(), 1, &mut out);
    g.download(&out, &mut first);
    m.codes.copy_from_slice(&other.codes);
    let mut second = vec![0.0; rows];
    g.matmul_vq(&xt, &m.view(), 1, &mut out);
    g.download(&out, &mut second);
    let mut want = vec![0.0; rows];
    Cpu::reference().matmul_vq(&x, &m.view(), 1, &mut want);
    assert!(rel_err(&second, &want) < 1e-5);
    assert!(rel_err(&first, &want) > 1e-2);
}

fn test_text(domain: &str) -> String {
    std::fs::read_to_string(root().join("data/corpus").join(domain).join("test.txt")).unwrap()
}

/// Perplexity over 4 chunks of 512 on the CPU and the device, and the greedy decode of
/// 24 tokens after a 16-token prompt on both. The caller has checked for a device.
/// CPU and GPU perplexity, greedy decodes and one decode step's router probabilities and
/// logits of the model in `dir` loaded with `codecs`. With `routed`, every MoE layer's
/// experts are quantized, so each routes on the device and decode steps are recorded.
fn compare_end_to_end(label: &str, dir: &std::path::Path, codecs: &Codecs, routed: bool) {
    let cpu = model::load_with_codecs(dir, Cpu::fast(), codecs).unwrap();
    // The device backend is borrowed by every model; `Cuda` is not `Clone`, so each
    // model gets its own backend on the same device.
    let dev = model::load_with_codecs(dir, Cuda::new(0).unwrap(), codecs).unwrap();
    let opts = PplOptions {
        ctx: 512,
        max_chunks: Some(4),
        ..PplOptions::default()
    };
    for domain in ["en", "code"] {
        let text = test_text(domain);
        let a = perplexity(&cpu, &text, opts, &mut |_, _| {}).unwrap();
        let b = perplexity(&dev, &text, opts, &mut |_, _| {}).unwrap();
        let rel = (a.ppl - b.ppl).abs() / a.ppl;
        println!(
            "ppl {label:<22} {domain:<5} cpu {:.6} cuda {:.6} rel {rel:.2e}",
            a.ppl, b.ppl
        );
        assert!(rel < 1e-3, "{label} {domain}: cpu {} cuda {}", a.ppl, b.ppl);
        let prompt = &cpu.tokenizer.encode(&text).unwrap()[..16];
        let s = Sampling::default();
        let x = generate_ids(&cpu, prompt, 24, s, &[], &mut |_| {}).unwrap();
        let y = generate_ids(&dev, prompt, 24, s, &[], &mut |_| {}).unwrap();
        println!(
            "greedy {label:<19} {domain:<5} equal {} (decode {:.0} tok/s cpu, {:.0} cuda)",
            x.tokens == y.tokens,
            x.decode_tokens_per_second,
            y.decode_tokens_per_second
        );
        assert_eq!(
            x.tokens, y.tokens,
            "{label} {domain}: greedy decodes differ"
        );
    }
    // With quantized experts every MoE layer routes on the device, so the decode steps
    // after the first were replayed from a recorded graph.
    let recorded = dev.model.backend().recorded_steps();
    println!("graphs {label:<19} recorded decode steps {recorded}");
    if routed {
        assert!(recorded > 0, "{label}: no decode step was recorded");
    }
    // A decode step's router probabilities (read back once, at the end of the step, when
    // the device routes) against the CPU's, layer by layer.
    let text = test_text("en");
    let ids = &cpu.tokenizer.encode(&text).unwrap()[..9];
    let (mut sc, mut sd) = (cpu.model.new_state(16), dev.model.new_state(16));
    cpu.model.forward(&mut sc, &ids[..8], 8).unwrap();
    dev.model.forward(&mut sd, &ids[..8], 8).unwrap();
    let lc = cpu.model.forward(&mut sc, &ids[8..], 0).unwrap();
    let ld = dev.model.forward(&mut sd, &ids[8..], 0).unwrap();
    let worst = sc
        .router_probs
        .iter()
        .zip(&sd.router_probs)
        .map(|(a, b)| {
            assert_eq!(a.len(), b.len(), "{label}: router probabilities of a layer");
            if a.is_empty() {
                0.0
            } else {
                rel_err(b, a)
            }
        })
        .fold(0.0f64, f64::max);
    let e_logits = rel_err(&ld, &lc);
    println!("decode step {label:<19} router probs {worst:.2e} logits {e_logits:.2e}");
    assert!(
        worst < 1e-4 && e_logits < 1e-4,
        "{label}: decode step differs"
    );
}

#[test]
fn a_plan_mask_routes_alike_on_the_device() {
    let Some(_) = gpu() else { return };
    let converted = TempDir::new("cuda-mask");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    let eb = ExpertBits {
        default: Some(4),
        ..ExpertBits::default()
    };
    let mut cpu = model::load_with(converted.dir(), Cpu::fast(), &eb).unwrap();
    let mut dev = model::load_with(converted.dir(), Cuda::new(0).unwrap(), &eb).unwrap();
    let e = cpu.model.config.moe.num_experts;
    let layers: Vec<usize> = cpu.model.config.moe_layers().collect();
    for (j, &l) in layers.iter().enumerate() {
        let keep: Vec<bool> = (0..e).map(|x| (x + j) % 4 != 0).collect();
        cpu.model.set_expert_mask(l, Some(keep.clone())).unwrap();
        dev.model.set_expert_mask(l, Some(keep)).unwrap();
    }
    let prompt = &cpu.tokenizer.encode(&test_text("en")).unwrap()[..16];
    let s = Sampling::default();
    let x = generate_ids(&cpu, prompt, 24, s, &[], &mut |_| {}).unwrap();
    let y = generate_ids(&dev, prompt, 24, s, &[], &mut |_| {}).unwrap();
    println!("greedy small-moe q4 masked equal {}", x.tokens == y.tokens);
    assert_eq!(x.tokens, y.tokens, "masked greedy decodes differ");
}

#[test]
fn fixtures_agree_with_the_cpu_end_to_end() {
    let Some(_) = gpu() else { return };
    for name in [
        "tiny-moe",
        "small-moe",
        "tiny-qwen2-moe",
        "tiny-olmoe",
        "tiny-mixtral",
    ] {
        compare_end_to_end(name, &fixture(name), &Codecs::default(), false);
    }
    let converted = TempDir::new("cuda-stores");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    for bits in [4, 3, 2] {
        let eb = ExpertBits {
            default: Some(bits),
            ..ExpertBits::default()
        };
        let label = format!("small-moe q{bits}");
        compare_end_to_end(&label, converted.dir(), &(&eb).into(), true);
    }
    // Every expert at a VQ rung (encoded beside a copy of the checkpoint on first load),
    // routed on the device by the VQ kernels: gate and up rotated in one block of 256,
    // down in one padded block of 128.
    let copy = dynmoe::testing::fixture_copy("small-moe");
    for rung in ["vq1.5", "vq3"] {
        let codecs = Codecs {
            default: Some(rung.parse().unwrap()),
            ..Codecs::default()
        };
        compare_end_to_end(&format!("small-moe {rung}"), copy.dir(), &codecs, true);
    }
}

/// Resident sets in device memory (the small fixture's 4-bit store, and its experts at
/// vq1.5, 12 of 32 experts per layer, dynamic swaps every 4 tokens from a RAM and a disk
/// reservoir): each greedy step, replayed from a recorded graph or run through
/// `forward`, picks the token the CPU picks with routing masked to the sets that step
/// used; swaps happen and commit only once their copies have landed; and a whole
/// sequence through the device slots (the prompt path) equals the CPU model masked to
/// the final sets. The 4- and 2-bit stores' slots in unit tiles (on tensor cores) and in
/// rows (without).
#[test]
fn resident_sets_in_device_memory_route_as_masks() {
    let Some(_) = gpu() else { return };
    let converted = TempDir::new("cuda-residency");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    for bits in [4, 2] {
        let codecs = (&ExpertBits {
            default: Some(bits),
            ..ExpertBits::default()
        })
            .into();
        let tiles = check_resident_sets(&format!("q{bits}"), converted.dir(), &codecs, true);
        // Tiled slots are sized by their tiles, not by the record's whole pages: the
        // device bytes say which the sets held.
        let rows = check_resident_sets(
            &format!("q{bits} without tensor cores"),
            converted.dir(),
            &codecs,
            false,
        );
        assert_ne!(
            rows, tiles,
            "q{bits}: slots in tiles took the records' size"
        );
    }
    // VQ slots hold each expert's rotation signs beside its record.
    let copy = dynmoe::testing::fixture_copy("small-moe");
    let codecs = Codecs {
        default: Some("vq1.5".parse().unwrap()),
        ..Codecs::default()
    };
    check_resident_sets("vq1.5", copy.dir(), &codecs, false);
}

/// Checks resident sets of the model at `dir` (`tensor_cores`: 4- and 2-bit affine slots
/// in unit tiles); returns the device bytes the sets took.
fn check_resident_sets(
    label: &str,
    dir: &std::path::Path,
    codecs: &Codecs,
    tensor_cores: bool,
) -> usize {
    use dynmoe::residency::{Mode, PolicyParams, ReservoirKind, ResidencyConfig, ResidentCount};
    let mut cpu = model::load_with_codecs(dir, Cpu::fast(), codecs).unwrap();
    let backend = if tensor_cores {
        Cuda::new(0).unwrap()
    } else {
        let tuning = Tuning {
            tensor_cores: false,
            ..Tuning::from_env().unwrap()
        };
        Cuda::with_tuning(0, tuning).unwrap()
    };
    let mut dev = model::load_with_codecs(dir, backend, codecs).unwrap();
    let mut device_bytes = 0;
    let e = cpu.model.config.moe.num_experts;
    let layers: Vec<usize> = cpu.model.config.moe_layers().collect();
    for kind in [ReservoirKind::Ram, ReservoirKind::Disk] {
        let cfg = ResidencyConfig {
            resident: ResidentCount::Count(12),
            mode: Mode::Dynamic,
            reservoir: kind,
            policy: PolicyParams {
                interval: 4,
                max_swaps: 2,
                margin: 0.0,
                half_lives: [4.0, 16.0],
            },
            loader_threads: 2,
        };
        let reservoir = dev.model.reservoir(kind).unwrap();
        let res = dev
            .model
            .new_residency(reservoir, cfg, &std::collections::BTreeMap::new())
            .unwrap();
        dev.model.set_residency(Some(res));
        let rep = dev.model.residency().unwrap().report();
        assert_eq!(
            rep.layers_on_device,
            layers.len(),
            "{label} {kind:?}: sets on the host"
        );

        let ids = cpu.tokenizer.encode(&test_text("en")).unwrap();
        let prompt = &ids[..16];
        let (mut sc, mut sd) = (cpu.model.new_state(64), dev.model.new_state(64));
        let masks = |m: &mut model::LoadedModel<Cpu>,
                     sets: &std::collections::BTreeMap<usize, Vec<u32>>| {
            for (&l, set) in sets {
                let mut keep = vec![false; e];
                set.iter().for_each(|&x| keep[x as usize] = true);
                m.model.set_expert_mask(l, Some(keep)).unwrap();
            }
        };
        let r = dev.model.residency().unwrap();
        masks(&mut cpu, &r.resident_sets());
        let lc = cpu.model.forward(&mut sc, prompt, 15).unwrap();
        let ld = dev.model.forward(&mut sd, prompt, 15).unwrap();
        let err = rel_err(&ld, &lc);
        println!("residency {label} {kind:?} prompt through device slots: logits {err:.2e}");
        assert!(
            err < 1e-4,
            "{label} {kind:?}: prompt logits differ ({err:.2e})"
        );
        dev.model.residency().unwrap().wait_loads();

        let mut next = dynmoe::runtime::generate::argmax(&lc);
        let mut changed = 0;
        let mut before = dev.model.residency().unwrap().resident_sets();
        for step in 0..40 {
            // Every other step through `forward` (one row, the logits read back) rather
            // than the recorded step: both must route over the sets alone.
            let t = if step % 2 == 0 {
                dev.model.decode_greedy(&mut sd, next).unwrap()
            } else {
                dynmoe::runtime::generate::argmax(&dev.model.forward(&mut sd, &[next], 0).unwrap())
            };
            let r = dev.model.residency().unwrap();
            let used = r.resident_sets();
            changed += (used != before) as usize;
            before = used.clone();
            masks(&mut cpu, &used);
            let want =
                dynmoe::runtime::generate::argmax(&cpu.model.forward(&mut sc, &[next], 0).unwrap());
            assert_eq!(
                t, want,
                "{label} {kind:?} step {step}: device slots and CPU mask disagree"
            );
            // Both reservoirs commit at the same boundaries: every load lands before
            // the next step (a real run never waits).
            r.wait_loads();
            next = t;
        }
        let rep = dev.model.residency().unwrap().report();
        println!(
            "residency {label} {kind:?}: {} swaps, {} bytes moved, {} stalls, {} late boundaries, sets changed at {changed} steps, {} graphs recorded, {:.1} MB on the device",
            rep.counters.swaps,
            rep.counters.bytes_moved,
            rep.counters.stalls,
            rep.counters.late_boundaries,
            dev.model.backend().recorded_steps(),
            rep.device_bytes as f64 / 1e6
        );
        assert!(
            rep.counters.swaps > 0 && changed > 0,
            "{label} {kind:?}: no swap committed"
        );
        assert_eq!(rep.counters.loads_failed, 0);
        assert!(
            dev.model.backend().recorded_steps() > 0,
            "no decode step recorded"
        );

        // The whole sequence again in one call, through the slots as they are once the
        // loads waited for above commit at its start (read after it: no commit happens
        // inside a call).
        let seq = &ids[..24];
        let (mut sc, mut sd) = (cpu.model.new_state(24), dev.model.new_state(24));
        let ld = dev.model.forward(&mut sd, seq, 0).unwrap();
        let sets = dev.model.residency().unwrap().resident_sets();
        masks(&mut cpu, &sets);
        let lc = cpu.model.forward(&mut sc, seq, 0).unwrap();
        let err = rel_err(&ld, &lc);
        println!("residency {label} {kind:?} sequence after swaps: logits {err:.2e}");
        assert!(
            err < 1e-4,
            "{label} {kind:?}: sequence logits differ ({err:.2e})"
        );
        device_bytes = rep.device_bytes;
        dev.model.set_residency(None);
        for &l in &layers {
            cpu.model.set_expert_mask(l, None).unwrap();
        }
    }
    device_bytes
}

/// `advance_step` against the CPU's (the token's bits copied, the position one on), and
/// `read_async`: more reads under way than the backend keeps buffers for, each holding
/// the values its tensor had when it was queued though the tensor is overwritten right
/// after, finished out of order, one dropped unfinished.
#[test]
fn step_advance_and_queued_reads_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let at = 5;
    let mut chosen = fresh(at + 3, 901);
    chosen[at] = f32::from_bits(4321);
    let step = [f32::from_bits(17), f32::from_bits(99)];
    let cpu = Cpu::reference();
    let mut want = cpu.upload(&step);
    cpu.advance_step(&mut want, &cpu.upload(&chosen), at);
    let (mut st, ct) = (g.upload(&step), g.upload(&chosen));
    g.advance_step(&mut st, &ct, at);
    g.advance_step(&mut st, &ct, at);
    let mut got = [0.0f32; 2];
    g.download(&st, &mut got);
    println!(
        "check advance_step {} {}",
        got[0].to_bits(),
        got[1].to_bits()
    );
    assert_eq!(want[0].to_bits(), 4321);
    assert_eq!(want[1].to_bits(), 100);
    assert_eq!((got[0].to_bits(), got[1].to_bits()), (4321, 101));

    let len = 3000;
    let mut t = g.upload(&fresh(len, 910));
    let mut reads = Vec::new();
    for r in 0..6u64 {
        reads.push((r, g.read_async(&t, len - r as usize)));
        g.upload_into(&fresh(len, 911 + r), &mut t);
    }
    let dropped = reads.remove(2);
    drop(dropped);
    for (r, read) in reads.into_iter().rev() {
        let values = g.finish_read(read);
        let want = fresh(len, 910 + r);
        assert_eq!(values.len(), len - r as usize, "read {r}");
        assert!(
            values
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "read {r}: not the values queued before it"
        );
    }
    assert!(g.finish_read(g.read_async(&t, 0)).is_empty());
}

/// `decode_greedy_many` on the device (every MoE layer routed there, so the step is
/// recorded and the steps queued back to back, each replay reading the token and
/// position the one before left) against `decode_greedy` called token by token: the
/// same tokens and router probabilities; stopped early, `decode_greedy` goes on from
/// the last token handed over; with graphs off it takes the steps one call at a time.
#[test]
fn queued_greedy_decode_is_decode_greedy_on_the_device() {
    let Some(g) = gpu() else { return };
    let converted = TempDir::new("cuda-queued");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    let eb = ExpertBits {
        default: Some(4),
        ..ExpertBits::default()
    };
    let mut tokens = Vec::new();
    for graphs in [true, false] {
        // A backend of its own: a recording takes in what other tests queue on a shared
        // one.
        let tuning = Tuning {
            graphs,
            ..g.tuning().clone()
        };
        let dev =
            model::load_with(converted.dir(), Cuda::with_tuning(0, tuning).unwrap(), &eb).unwrap();
        let m = &dev.model;
        let prompt = &dev.tokenizer.encode(&test_text("en")).unwrap()[..16];
        let (p, n, stop) = (prompt.len(), 32, 7);
        let GreedyReference {
            state: mut s,
            first,
            tokens: want,
            probs,
        } = greedy_reference(m, prompt, n);
        assert_eq!(
            m.backend().recorded_steps() > 0,
            graphs,
            "graphs {graphs}: steps recorded"
        );
        s.pos = p;
        let mut got = Vec::new();
        let k = m
            .decode_greedy_many(&mut s, first, n, &mut |t| {
                got.push(t);
                true
            })
            .unwrap();
        println!("queued greedy (graphs {graphs}): equal {}", got == want);
        assert_eq!((k, &got), (n, &want), "graphs {graphs}");
        assert_eq!(s.pos, p + n);
        let worst = s
            .router_probs
            .iter()
            .zip(&probs[n - 1])
            .filter(|(a, _)| !a.is_empty())
            .map(|(a, b)| rel_err(a, b))
            .fold(0.0f64, f64::max);
        assert!(
            worst < 1e-6,
            "graphs {graphs}: router probabilities {worst:.2e}"
        );

        s.pos = p;
        got.clear();
        let k = m
            .decode_greedy_many(&mut s, first, n, &mut |t| {
                got.push(t);
                got.len() < stop
            })
            .unwrap();
        assert_eq!(
            (k, &got[..]),
            (stop, &want[..stop]),
            "graphs {graphs} stopped"
        );
        assert_eq!(s.pos, p + stop);
        let next = m.decode_greedy(&mut s, want[stop - 1]).unwrap();
        assert_eq!(
            next, want[stop],
            "graphs {graphs}: decode_greedy after the stop"
        );
        tokens.push(want);
    }
    assert_eq!(
        tokens[0], tokens[1],
        "the same tokens with graphs and without"
    );
}
