//! Elementwise and row ops, norms, dense products (f32 and bf16, one, three at once)
//! and the argmax of long rows.

use super::*;

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
        .embed(
            Weight::Dense(&b.upload_matrix(&table, vocab, dim)),
            dim,
            &ids,
            o
        ));
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
        |b, _t, o| b.embed(
            Weight::Dense(&b.upload_matrix(&table, vocab, dim)),
            dim,
            &ids,
            o
        )
    );
    for tok in [0u32, 999, 321] {
        let step = [f32::from_bits(tok), f32::from_bits(3)];
        both!(
            &format!("embed_at bf16 token {tok}"),
            &[&step],
            dim,
            1e-7,
            |b, t, o| b.embed_at(
                Weight::Dense(&b.upload_matrix(&table, vocab, dim)),
                dim,
                &t[0],
                o
            )
        );
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

/// `Backend::argmax_rows`' rule: the largest value of each row, ties to the lower index;
/// `NOT_A_TOKEN` for a row that holds a NaN or an infinity.
fn argmax_plain(x: &[f32], rows: usize, dim: usize) -> Vec<u32> {
    (0..rows)
        .map(|r| {
            let row = &x[r * dim..(r + 1) * dim];
            if !row.iter().all(|v| v.is_finite()) {
                return dynmoe::backend::NOT_A_TOKEN;
            }
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[best] {
                    best = i;
                }
            }
            best as u32
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
        // Row 0: a tie between two blocks (the lower wins).
        let (a, b) = (dim / 3, dim - 1);
        x[a] = 50.0;
        x[b] = 50.0;
        if rows > 1 {
            // Row 1: one infinity in a middle block, below the row's largest value.
            x[dim + dim / 2] = f32::NEG_INFINITY;
            x[dim] = 60.0;
        }
        if rows > 2 {
            // Row 2: one NaN, in the last block.
            x[3 * dim - 1] = f32::NAN;
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
