//! Fast CPU kernels: the same functions as [`super::reference`], threaded with rayon,
//! with dense matrix products through the `gemm` crate. Each is checked against its
//! reference twin by normalised error on fresh random inputs (see the tests below and
//! `tests/backend_parity.rs`).

use rayon::prelude::*;

use super::reference;
use super::with_padded_columns;
use crate::backend::{AttentionShape, SwiGluGroup, Weight};
use crate::codec::affine::kernels::{self, AffineView};
use crate::codec::affine::lowbit;
use crate::codec::dense::{dot_lanes, matmul, matmul_serial, matmul_strided, matmul_with, Strided};
use crate::codec::vq;

/// Above this many rows a stored matrix is expanded to f32 once and multiplied with
/// gemm: the expansion is one pass over the weights shared by every row, and gemm's
/// tiling beats the matrix-vector kernels once there are enough rows to tile.
const EXPAND_ABOVE_ROWS: usize = 16;

/// See [`crate::backend::Backend::matmul_affine`]; `parallel` uses every thread.
pub fn matmul_affine(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &AffineView<'_>,
    out: &mut [f32],
    parallel: bool,
) {
    with_padded_columns(x, rows, in_dim, w.cols, |x| {
        let out = &mut out[..rows * w.rows];
        if rows > EXPAND_ABOVE_ROWS {
            let dense = lowbit::dequantize(w.words, w.scales, w.biases, w.rows, w.cols, w.bits);
            matmul_with(x, &dense, rows, w.cols, w.rows, out, parallel);
        } else if parallel {
            kernels::matmul(x, rows, w, out);
        } else {
            kernels::matmul_serial(x, rows, w, out);
        }
    })
}

/// See [`crate::backend::Backend::swiglu_groups`]. With at least as many groups as
/// threads (prefill, and decode over top-k experts), groups run in parallel with
/// single-threaded products; with fewer, one group at a time with threaded products.
/// Outputs are added in group order either way, so the result does not depend on the
/// thread count.
pub fn swiglu_groups(
    x: &[f32],
    hidden: usize,
    groups: &[SwiGluGroup<'_, Vec<f32>>],
    out: &mut [f32],
) {
    let parallel_groups = groups.len() >= rayon::current_num_threads();
    // One thread per group, or every thread inside each product: never both.
    let product = |x: &[f32],
                   w: Weight<'_, Vec<f32>>,
                   rows: usize,
                   in_dim: usize,
                   out_dim: usize,
                   out: &mut [f32]| match w {
        Weight::Dense(t) if parallel_groups => matmul_serial(x, t, rows, in_dim, out_dim, out),
        Weight::Dense(t) => matmul(x, t, rows, in_dim, out_dim, out),
        Weight::Affine(v) => matmul_affine(x, rows, in_dim, &v, out, !parallel_groups),
        Weight::Vq(v) if parallel_groups => {
            vq::kernels::matmul_serial(&x[..rows * in_dim], rows, &v, &mut out[..rows * out_dim])
        }
        Weight::Vq(v) => {
            vq::kernels::matmul(&x[..rows * in_dim], rows, &v, &mut out[..rows * out_dim])
        }
    };
    let run = |g: &SwiGluGroup<'_, Vec<f32>>| -> Vec<f32> {
        let (n, i) = (g.rows.len(), g.intermediate);
        let mut xs = vec![0.0f32; n * hidden];
        reference::gather_rows(x, g.rows, hidden, &mut xs);
        let (mut gate, mut up) = (vec![0.0f32; n * i], vec![0.0f32; n * i]);
        product(&xs, g.gate, n, hidden, i, &mut gate);
        product(&xs, g.up, n, hidden, i, &mut up);
        reference::silu_mul(&mut gate, &up);
        let mut ys = vec![0.0f32; n * hidden];
        product(&gate, g.down, n, i, hidden, &mut ys);
        ys
    };
    let outputs: Vec<Vec<f32>> = if parallel_groups {
        groups.par_iter().map(run).collect()
    } else {
        groups.iter().map(run).collect()
    };
    for (g, ys) in groups.iter().zip(&outputs) {
        reference::scatter_add_rows(ys, g.rows, g.scales, hidden, out);
    }
}

/// See [`crate::backend::Backend::rms_norm`].
pub fn rms_norm(x: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32, out: &mut [f32]) {
    out[..rows * dim]
        .par_chunks_mut(dim)
        .zip(x[..rows * dim].par_chunks(dim))
        .for_each(|(o, xr)| reference::rms_norm_row(xr, w, eps, o));
}

/// See [`crate::backend::Backend::attention`]. A few rows (decode) run one task per
/// (row, head); a chunk of rows runs in blocks of [`QUERY_BLOCK`] queries, each block's
/// scores and outputs two dense products (the scores of a row that may not see a key are
/// masked before its softmax).
pub fn attention(q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape, out: &mut [f32]) {
    if s.rows >= QUERY_BLOCK / 2 {
        return attention_blocked(q, k, v, s, out);
    }
    let d = s.head_dim;
    let group = s.heads / s.kv_heads;
    out[..s.rows * s.heads * d]
        .par_chunks_mut(d)
        .enumerate()
        .for_each_init(
            || vec![0.0f32; s.pos0 + s.rows],
            |scores, (i, o)| {
                let (r, h) = (i / s.heads, i % s.heads);
                let q = &q[i * d..(i + 1) * d];
                attend_one(q, k, v, s, s.pos0 + r, h / group, scores, o);
            },
        );
}

/// Query rows of one block of [`attention_blocked`]: enough that the products tile well,
/// few enough that a prompt has a block for every thread.
const QUERY_BLOCK: usize = 64;

fn attention_blocked(q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape, out: &mut [f32]) {
    let (d, heads) = (s.head_dim, s.heads);
    let (group, kv_width, width) = (heads / s.kv_heads, s.kv_heads * d, heads * d);
    let scale = 1.0 / (d as f32).sqrt();
    let blocks = s.rows.div_ceil(QUERY_BLOCK);
    let done: Vec<(usize, usize, Vec<f32>)> = (0..heads * blocks)
        .into_par_iter()
        .map(|t| {
            let (h, b) = (t / blocks, t % blocks);
            let (kv_at, r0) = ((h / group) * d, b * QUERY_BLOCK);
            let n = QUERY_BLOCK.min(s.rows - r0);
            // The keys any row of the block sees.
            let (lo, hi) = (s.first_visible(s.pos0 + r0), s.pos0 + r0 + n);
            let keys = hi - lo;
            // The block's queries, and the head's keys read as their transpose, in place.
            let qs = Strided {
                data: &q[r0 * width + h * d..],
                rows: n,
                cols: d,
                row_stride: width,
                col_stride: 1,
            };
            let kt = Strided {
                data: &k[lo * kv_width + kv_at..],
                rows: d,
                cols: keys,
                row_stride: 1,
                col_stride: kv_width,
            };
            let mut scores = vec![0.0f32; n * keys];
            matmul_strided(qs, kt, &mut scores);
            for (i, row) in scores.chunks_exact_mut(keys).enumerate() {
                let p = s.pos0 + r0 + i;
                let first = s.first_visible(p) - lo;
                let visible = &mut row[first..p + 1 - lo];
                visible.iter_mut().for_each(|x| *x *= scale);
                reference::softmax(visible);
                row[..first].fill(0.0);
                row[p + 1 - lo..].fill(0.0);
            }
            let p = Strided {
                data: &scores,
                rows: n,
                cols: keys,
                row_stride: keys,
                col_stride: 1,
            };
            let vs = Strided {
                data: &v[lo * kv_width + kv_at..],
                rows: keys,
                cols: d,
                row_stride: kv_width,
                col_stride: 1,
            };
            let mut o = vec![0.0f32; n * d];
            matmul_strided(p, vs, &mut o);
            (h, r0, o)
        })
        .collect();
    for (h, r0, o) in done {
        for (i, row) in o.chunks_exact(d).enumerate() {
            let at = (r0 + i) * width + h * d;
            out[at..at + d].copy_from_slice(row);
        }
    }
}

/// See [`crate::backend::Backend::rope`]: each row's angles once for all of its heads
/// (the reference takes them per head), rows in parallel.
pub fn rope(x: &mut [f32], positions: &[usize], heads: usize, head_dim: usize, inv_freq: &[f32]) {
    let width = heads * head_dim;
    x[..positions.len() * width]
        .par_chunks_mut(width)
        .zip(positions.par_iter())
        .with_min_len(16)
        .for_each(|(row, &p)| {
            let turns = reference::turns(p, inv_freq);
            for head in row.chunks_exact_mut(head_dim) {
                reference::rotate_half(head, &turns);
            }
        });
}

/// [`reference::attend_one`] with its q·k products in sixteen lanes, compiled for AVX-512
/// or AVX2 where the processor has them: the crate is built for baseline x86-64, whose
/// vectors are four lanes wide.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    p: usize,
    kv_head: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    // The same function compiled for each instruction set.
    macro_rules! compiled_for {
        ($name:ident, $features:literal) => {
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            fn $name(
                q: &[f32],
                k: &[f32],
                v: &[f32],
                s: &AttentionShape,
                p: usize,
                kv_head: usize,
                scores: &mut [f32],
                out: &mut [f32],
            ) {
                reference::attend_one_with(dot_lanes::<16>, q, k, v, s, p, kv_head, scores, out)
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    {
        compiled_for!(avx512, "avx512f,avx2,fma");
        compiled_for!(avx2, "avx2,fma");
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the processor has the features it is compiled for.
            return unsafe { avx512(q, k, v, s, p, kv_head, scores, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: as above.
            return unsafe { avx2(q, k, v, s, p, kv_head, scores, out) };
        }
    }
    reference::attend_one_with(dot_lanes::<16>, q, k, v, s, p, kv_head, scores, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh, poisoned, rel_err};

    #[test]
    fn matmul_matches_reference_at_every_row_count() {
        for (seed, rows) in [1usize, 2, 4, 5, 17, 64].into_iter().enumerate() {
            let (k, n) = (96, 131);
            let x = fresh(rows * k, seed as u64);
            let w = fresh(n * k, 100 + seed as u64);
            let mut want = poisoned(rows * n);
            let mut got = poisoned(rows * n);
            reference::matmul(&x, &w, rows, k, n, &mut want);
            matmul(&x, &w, rows, k, n, &mut got);
            let e = rel_err(&got, &want);
            assert!(e < 1e-5, "rows {rows}: rel err {e}");
        }
    }

    #[test]
    fn swiglu_groups_match_the_reference_dispatch() {
        use crate::backend::{Backend, Cpu};
        let (hidden, inter, rows) = (64, 48, 37);
        let x = fresh(rows * hidden, 40);
        let experts: Vec<[Vec<f32>; 3]> = (0..5u64)
            .map(|e| {
                [
                    fresh(inter * hidden, 50 + e),
                    fresh(inter * hidden, 60 + e),
                    fresh(hidden * inter, 70 + e),
                ]
            })
            .collect();
        // Expert e takes every row r with r % (e + 2) == 0; expert 4 takes none.
        let rows_of: Vec<Vec<u32>> = (0..5u32)
            .map(|e| {
                if e == 4 {
                    vec![]
                } else {
                    (0..rows as u32).filter(|r| r % (e + 2) == 0).collect()
                }
            })
            .collect();
        let weights_of: Vec<Vec<f32>> = rows_of
            .iter()
            .map(|r| fresh(r.len(), 80 + r.len() as u64))
            .collect();
        for n_groups in [1, 5] {
            let groups: Vec<SwiGluGroup<'_, Vec<f32>>> = (0..n_groups)
                .map(|e| SwiGluGroup {
                    gate: Weight::Dense(&experts[e][0]),
                    up: Weight::Dense(&experts[e][1]),
                    down: Weight::Dense(&experts[e][2]),
                    intermediate: inter,
                    rows: &rows_of[e],
                    scales: &weights_of[e],
                })
                .collect();
            let base = fresh(rows * hidden, 90);
            let (mut want, mut got) = (base.clone(), base.clone());
            Cpu::reference().swiglu_groups(&x, hidden, &groups, &mut want);
            swiglu_groups(&x, hidden, &groups, &mut got);
            let e = rel_err(&got, &want);
            assert!(e < 1e-5, "{n_groups} groups: rel err {e}");
        }
    }

    #[test]
    fn rms_norm_matches_reference() {
        let (rows, dim) = (7, 48);
        let x = fresh(rows * dim, 3);
        let w = fresh(dim, 4);
        let mut want = poisoned(rows * dim);
        let mut got = poisoned(rows * dim);
        reference::rms_norm(&x, &w, rows, dim, 1e-6, &mut want);
        rms_norm(&x, &w, rows, dim, 1e-6, &mut got);
        assert!(rel_err(&got, &want) < 1e-6);
    }

    #[test]
    fn rope_is_the_reference_exactly() {
        let (heads, d) = (3, 16);
        let inv_freq = crate::model::forward::rope_inv_freq(10000.0, d, 1.0);
        for rows in [1usize, 40] {
            let positions: Vec<usize> = (0..rows).map(|r| 5 + 3 * r).collect();
            let x = fresh(rows * heads * d, 140 + rows as u64);
            let (mut want, mut got) = (x.clone(), x);
            reference::rope(&mut want, &positions, heads, d, &inv_freq);
            rope(&mut got, &positions, heads, d, &inv_freq);
            assert_eq!(got, want, "{rows} rows");
        }
    }

    /// `attention` against the reference on fresh inputs of shape `s`.
    fn attention_rel_err(s: AttentionShape, seed: u64) -> f64 {
        let ctx = s.pos0 + s.rows;
        let q = fresh(s.rows * s.heads * s.head_dim, seed);
        let k = fresh(ctx * s.kv_heads * s.head_dim, seed + 1);
        let v = fresh(ctx * s.kv_heads * s.head_dim, seed + 2);
        let mut want = poisoned(q.len());
        let mut got = poisoned(q.len());
        reference::attention(&q, &k, &v, &s, &mut want);
        attention(&q, &k, &v, &s, &mut got);
        rel_err(&got, &want)
    }

    #[test]
    fn blocked_attention_matches_reference() {
        // 150 rows: two whole blocks and a short one; a window shorter than a block.
        for (seed, (pos0, window)) in [(0, None), (7, None), (5, Some(40))]
            .into_iter()
            .enumerate()
        {
            let s = AttentionShape {
                rows: 150,
                pos0,
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
                window,
            };
            let e = attention_rel_err(s, 110 + 10 * seed as u64);
            assert!(e < 1e-5, "pos0 {pos0} window {window:?}: rel err {e}");
        }
    }

    #[test]
    fn attention_matches_reference_with_and_without_window() {
        for (seed, window) in [None, Some(5)].into_iter().enumerate() {
            let s = AttentionShape {
                rows: 9,
                pos0: 6,
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                window,
            };
            let e = attention_rel_err(s, 10 + 10 * seed as u64);
            assert!(e < 1e-6, "window {window:?}: rel err {e}");
        }
    }
}
