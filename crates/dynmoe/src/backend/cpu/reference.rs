//! Plain f32 reference of every op: one loop nest each, no threads, no tricks.
//!
//! This is the oracle. Fast kernels on any backend are checked against these functions
//! by normalised error on fresh random inputs; the reference forward built from them is
//! checked against transformers' logits.

use crate::backend::AttentionShape;

/// See [`crate::backend::Backend::embed`].
pub fn embed(table: &[f32], dim: usize, ids: &[u32], out: &mut [f32]) {
    for (r, &id) in ids.iter().enumerate() {
        let id = id as usize;
        out[r * dim..(r + 1) * dim].copy_from_slice(&table[id * dim..(id + 1) * dim]);
    }
}

/// RMSNorm of one row.
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * inv);
    }
}

/// See [`crate::backend::Backend::rms_norm`].
pub fn rms_norm(x: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32, out: &mut [f32]) {
    for r in 0..rows {
        rms_norm_row(
            &x[r * dim..(r + 1) * dim],
            w,
            eps,
            &mut out[r * dim..(r + 1) * dim],
        );
    }
}

/// See [`crate::backend::Backend::rms_norm_inplace`].
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], rows: usize, dim: usize, eps: f32) {
    let mut row = vec![0.0; dim];
    for r in 0..rows {
        row.copy_from_slice(&x[r * dim..(r + 1) * dim]);
        rms_norm_row(&row, w, eps, &mut x[r * dim..(r + 1) * dim]);
    }
}

/// See [`crate::backend::Backend::matmul`].
pub fn matmul(x: &[f32], w: &[f32], rows: usize, in_dim: usize, out_dim: usize, out: &mut [f32]) {
    for r in 0..rows {
        let xr = &x[r * in_dim..(r + 1) * in_dim];
        for o in 0..out_dim {
            let wo = &w[o * in_dim..(o + 1) * in_dim];
            out[r * out_dim + o] = xr.iter().zip(wo).map(|(a, b)| a * b).sum();
        }
    }
}

/// See [`crate::backend::Backend::add_bias`].
pub fn add_bias(x: &mut [f32], bias: &[f32], rows: usize) {
    let dim = bias.len();
    for r in 0..rows {
        for (v, b) in x[r * dim..(r + 1) * dim].iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// See [`crate::backend::Backend::add`].
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// SiLU, `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// See [`crate::backend::Backend::silu_mul`].
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// See [`crate::backend::Backend::clamp`].
pub fn clamp(x: &mut [f32], limit: f32) {
    for v in x {
        *v = v.clamp(-limit, limit);
    }
}

/// Softmax of one row, max-subtracted.
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// See [`crate::backend::Backend::softmax_rows`].
pub fn softmax_rows(x: &mut [f32], rows: usize, dim: usize) {
    for r in 0..rows {
        softmax(&mut x[r * dim..(r + 1) * dim]);
    }
}

/// Rotary embedding of one head at one position ("rotate half": element `i` pairs
/// with `i + head_dim / 2`).
pub fn rope_head(x: &mut [f32], position: usize, inv_freq: &[f32]) {
    rotate_half(x, &turns(position, inv_freq));
}

/// The `(sin, cos)` of each frequency's angle at `position`: f32 throughout, as
/// transformers computes cos/sin in float32.
pub fn turns(position: usize, inv_freq: &[f32]) -> Vec<(f32, f32)> {
    inv_freq
        .iter()
        .map(|&f| (position as f32 * f).sin_cos())
        .collect()
}

/// Rotates one head by `turns` (`(sin, cos)` a frequency): element `i` pairs with
/// `i + turns.len()`.
pub fn rotate_half(x: &mut [f32], turns: &[(f32, f32)]) {
    let half = turns.len();
    for (i, &(sin, cos)) in turns.iter().enumerate() {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos - b * sin;
        x[i + half] = b * cos + a * sin;
    }
}

/// See [`crate::backend::Backend::rope`].
pub fn rope(x: &mut [f32], positions: &[usize], heads: usize, head_dim: usize, inv_freq: &[f32]) {
    let width = heads * head_dim;
    for (r, &p) in positions.iter().enumerate() {
        for h in 0..heads {
            let start = r * width + h * head_dim;
            rope_head(&mut x[start..start + head_dim], p, inv_freq);
        }
    }
}

/// See [`crate::backend::Backend::write_rows`].
pub fn write_rows(src: &[f32], dst: &mut [f32], dst_row: usize, rows: usize, width: usize) {
    dst[dst_row * width..(dst_row + rows) * width].copy_from_slice(&src[..rows * width]);
}

/// Attention for one query row and one head: softmax(q·K / sqrt(d)) · V over the visible
/// keys. `scores` is scratch of at least `p + 1` entries.
#[allow(clippy::too_many_arguments)]
pub fn attend_one(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    p: usize,
    kv_head: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let in_order = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    attend_one_with(in_order, q, k, v, s, p, kv_head, scores, out);
}

/// [`attend_one`] with its q·k products taken by `dot` (the fast backend's run in
/// several lanes).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn attend_one_with(
    dot: impl Fn(&[f32], &[f32]) -> f32,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    p: usize,
    kv_head: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = s.head_dim;
    let kv_width = s.kv_heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    let lo = s.first_visible(p);
    let scores = &mut scores[..p + 1 - lo];
    let at = kv_head * d;
    for (j, sc) in (lo..=p).zip(scores.iter_mut()) {
        *sc = dot(q, &k[j * kv_width + at..j * kv_width + at + d]) * scale;
    }
    softmax(scores);
    out.fill(0.0);
    for (j, &w) in (lo..=p).zip(scores.iter()) {
        let vj = &v[j * kv_width + at..j * kv_width + at + d];
        for (o, &x) in out.iter_mut().zip(vj) {
            *o += w * x;
        }
    }
}

/// See [`crate::backend::Backend::attention`].
pub fn attention(q: &[f32], k: &[f32], v: &[f32], s: &AttentionShape, out: &mut [f32]) {
    let d = s.head_dim;
    let group = s.heads / s.kv_heads;
    let width = s.heads * d;
    let mut scores = vec![0.0; s.pos0 + s.rows];
    for r in 0..s.rows {
        let p = s.pos0 + r;
        for h in 0..s.heads {
            let at = r * width + h * d;
            attend_one(
                &q[at..at + d],
                k,
                v,
                s,
                p,
                h / group,
                &mut scores,
                &mut out[at..at + d],
            );
        }
    }
}

/// See [`crate::backend::Backend::gather_rows`].
pub fn gather_rows(src: &[f32], rows: &[u32], width: usize, dst: &mut [f32]) {
    for (r, &i) in rows.iter().enumerate() {
        let i = i as usize;
        dst[r * width..(r + 1) * width].copy_from_slice(&src[i * width..(i + 1) * width]);
    }
}

/// See [`crate::backend::Backend::scatter_add_rows`].
pub fn scatter_add_rows(src: &[f32], rows: &[u32], scales: &[f32], width: usize, dst: &mut [f32]) {
    for (r, (&i, &s)) in rows.iter().zip(scales).enumerate() {
        let i = i as usize;
        for (d, &x) in dst[i * width..(i + 1) * width]
            .iter_mut()
            .zip(&src[r * width..(r + 1) * width])
        {
            *d += s * x;
        }
    }
}
