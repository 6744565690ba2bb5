//! Multi-head latent attention (DeepSeek-V3, Kimi-K2) over a latent cache.
//!
//! transformers computes a query per head as `[q_nope (d_n), q_rope (d_r)]` from q's
//! low-rank path, and a key and value per head by expanding one shared latent
//! `c = rms_norm(kv_a x)` (`d_c` values) through `kv_b`: `k_h = [U_h c, k_rope]`,
//! `v_h = V_h c`, the rotary part `k_rope` shared by every head. Scores are scaled by
//! `mscale² / √(d_n + d_r)` (YaRN), and the rotary values are interleaved pairs.
//!
//! Since `q_nope · U_h c = (U_hᵀ q_nope) · c`, attention can read the latent itself: the
//! cache holds, per position, one key `[c, k_rope]` of `d_c + d_r` values shared by every
//! head (multi-query attention with one key head), a query head is
//! `[U_hᵀ q_nope, q_rope]`, and a head's output, a mix of latents, becomes a value head
//! through `V_h` before the output projection. So the cache costs `d_c + d_r` values a
//! position and layer, against `heads · (d_n + d_r + d_v)` expanded; the up-projections
//! run once per query head instead of once per cached position and head.
//!
//! Heads are laid out as `checkpoint::arch::partial_rotary` lays out a partially
//! rotating head (the interleaved pairs taken apart first): the rotary pairs half a head
//! apart, the latent in the pairs that turn by nothing. The caches, the rotary op and the
//! attention kernels of every backend then run it as ordinary attention; the values are
//! the latent alone (zeros at the rotary positions). YaRN's scalings are folded into the
//! query and the shared rotary key at load, and so is the ratio of the softmax scale
//! to the `1/√(d_c + d_r)` the attention op applies.

use super::weights::{Attention, Linear, LinearWeight, Loader};
use super::Error;
use crate::backend::Backend;
use crate::checkpoint::arch::partial_rotary::PartialRotary;
use crate::checkpoint::config::MlaConfig;

/// The parts of latent attention besides [`Attention`]'s projections, which for it are:
/// `q_proj` the queries' position-free part `[heads · d_n, q_in]`, `k_proj` and
/// `v_proj` the latent put in a head's latent positions `[d_c + d_r, d_c]`, and `o_proj`
/// the checkpoint's own.
pub struct Mla<B: Backend> {
    /// q's low-rank path: `q_a_proj` and `q_a_layernorm`; `None` where `q_proj` reads
    /// the layer's input.
    pub q_a: Option<(Linear<B>, B::Tensor)>,
    /// The queries' rotary part `[heads · d_r, q_in]`, pairs taken apart.
    pub q_rope: Linear<B>,
    /// Per head `[d_c + d_r, d_n]`: `U_hᵀ` in a head's latent positions, zeros at its
    /// rotary ones.
    pub absorb_k: Vec<B::Matrix>,
    /// Per head `[d_v, d_c + d_r]`: `V_h` reading a head's latent positions.
    pub absorb_v: Vec<B::Matrix>,
    /// The latent's projection: `kv_a_proj_with_mqa`'s first `d_c` rows.
    pub kv_a: Linear<B>,
    /// `kv_a_layernorm`.
    pub kv_a_norm: B::Tensor,
    /// The shared rotary key's projection: `kv_a_proj_with_mqa`'s last rows, pairs taken
    /// apart.
    pub k_rope: Linear<B>,
    /// `[d_c + d_r, d_r]` of ones and zeros: a rotary part put in a head's rotary
    /// positions.
    pub place_rope: Linear<B>,
}

/// Where a value of a laid-out head comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Value `.0` of the latent.
    Latent(usize),
    /// Rotary value `.0`, counted with the pairs taken apart (`x0, x2, …, x1, x3, …`).
    Rope(usize),
}

/// The layout of one head of `d_c + d_r` values: for each position, what it holds.
fn head_layout(m: &MlaConfig) -> Vec<Slot> {
    let (latent, rope) = (m.kv_lora_rank, m.qk_rope_head_dim);
    PartialRotary {
        head_dim: latent + rope,
        rotary_dim: rope,
    }
    .order()
    .into_iter()
    .map(|o| match o < rope {
        true => Slot::Rope(o),
        false => Slot::Latent(o - rope),
    })
    .collect()
}

/// Where rotary value `r` (pairs taken apart) is stored among a head's `d_r` values.
fn stored_rope(m: &MlaConfig, r: usize) -> usize {
    let half = m.qk_rope_head_dim / 2;
    match (m.interleaved, r < half) {
        (false, _) => r,
        (true, true) => 2 * r,
        (true, false) => 2 * (r - half) + 1,
    }
}

/// Layer `layer`'s latent attention: the [`Attention`] whose projections give heads of
/// `d_c + d_r` values over a one-head latent cache, with its [`Mla`] parts.
pub fn load<B: Backend>(
    ld: &Loader<B>,
    layer: usize,
    m: &MlaConfig,
) -> Result<Attention<B>, Error> {
    let c = ld.config;
    let p = format!("model.layers.{layer}.self_attn");
    let (heads, h) = (c.num_heads, c.hidden_size);
    let (nope, rope, vd) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
    let (lora, d, width) = (m.kv_lora_rank, nope + rope, m.kv_lora_rank + rope);
    let layout = head_layout(m);
    let yarn = c.rope.yarn.as_ref();
    let rotary_scale = yarn.map_or(1.0, |y| y.attention_factor()) as f32;
    // The softmax scale transformers applies over what the attention op applies.
    let mscale = yarn.map_or(1.0, |y| y.softmax_mscale());
    let q_scale = (mscale * (width as f64 / d as f64).sqrt()) as f32;
    let upload =
        |data: &[f32], rows: usize, cols: usize| ld.backend.upload_matrix(data, rows, cols);
    let dense = |data: &[f32], out_dim: usize, in_dim: usize| Linear {
        w: LinearWeight::Dense(upload(data, out_dim, in_dim)),
        bias: None,
        in_dim,
        out_dim,
    };
    // `[d_c + d_r, cols]`: row `pos` is `row(slot)` where it gives one, else zeros.
    let laid_out = |cols: usize, row: &dyn Fn(Slot) -> Option<Vec<f32>>| {
        let mut out = vec![0.0f32; width * cols];
        for (pos, &slot) in layout.iter().enumerate() {
            if let Some(values) = row(slot) {
                out[pos * cols..(pos + 1) * cols].copy_from_slice(&values);
            }
        }
        out
    };
    let unit = |n: usize, i: usize| -> Vec<f32> { (0..n).map(|j| (i == j) as u8 as f32).collect() };

    // Queries: each stored head is [nope, rope interleaved].
    let (q_a, q_in) = match m.q_lora_rank {
        Some(rank) => {
            let a = ld.linear(&format!("{p}.q_a_proj"), rank, h, false)?;
            let norm = ld.tensor(&format!("{p}.q_a_layernorm.weight"), &[rank])?;
            (Some((a, norm)), rank)
        }
        None => (None, h),
    };
    let q_name = match m.q_lora_rank {
        Some(_) => format!("{p}.q_b_proj.weight"),
        None => format!("{p}.q_proj.weight"),
    };
    let q = ld.ckpt.f32(&q_name, &[heads * d, q_in])?;
    let q_row = |hd: usize, i: usize, scale: f32| {
        q[(hd * d + i) * q_in..(hd * d + i + 1) * q_in]
            .iter()
            .map(move |v| v * scale)
    };
    let q_nope: Vec<f32> = (0..heads)
        .flat_map(|hd| (0..nope).flat_map(move |n| q_row(hd, n, q_scale)))
        .collect();
    let q_rope: Vec<f32> = (0..heads)
        .flat_map(|hd| {
            (0..rope).flat_map(move |r| q_row(hd, nope + stored_rope(m, r), q_scale * rotary_scale))
        })
        .collect();

    // Keys and values: `kv_b` holds per head [U_h (d_n rows), V_h (d_v rows)], each d_c wide.
    let kv_b = ld.ckpt.f32(
        &format!("{p}.kv_b_proj.weight"),
        &[heads * (nope + vd), lora],
    )?;
    let kv_b_at = |hd: usize, i: usize, j: usize| kv_b[(hd * (nope + vd) + i) * lora + j];
    let absorb_k = (0..heads)
        .map(|hd| {
            let m = laid_out(nope, &|slot| match slot {
                Slot::Latent(j) => Some((0..nope).map(|n| kv_b_at(hd, n, j)).collect()),
                Slot::Rope(_) => None,
            });
            upload(&m, width, nope)
        })
        .collect();
    let absorb_v = (0..heads)
        .map(|hd| {
            let mut v = vec![0.0f32; vd * width];
            for o in 0..vd {
                for (pos, &slot) in layout.iter().enumerate() {
                    if let Slot::Latent(j) = slot {
                        v[o * width + pos] = kv_b_at(hd, nope + o, j);
                    }
                }
            }
            upload(&v, vd, width)
        })
        .collect();
    let place_latent = laid_out(lora, &|slot| match slot {
        Slot::Latent(j) => Some(unit(lora, j)),
        Slot::Rope(_) => None,
    });
    let place_rope = laid_out(rope, &|slot| match slot {
        Slot::Rope(r) => Some(unit(rope, r)),
        Slot::Latent(_) => None,
    });

    let kv_a = ld
        .ckpt
        .f32(&format!("{p}.kv_a_proj_with_mqa.weight"), &[lora + rope, h])?;
    let k_rope: Vec<f32> = (0..rope)
        .flat_map(|r| {
            let from = (lora + stored_rope(m, r)) * h;
            kv_a[from..from + h].iter().map(|v| v * rotary_scale)
        })
        .collect();

    Ok(Attention {
        q_proj: dense(&q_nope, heads * nope, q_in),
        k_proj: dense(&place_latent, width, lora),
        v_proj: dense(&place_latent, width, lora),
        o_proj: ld.linear(&format!("{p}.o_proj"), h, heads * vd, false)?,
        qk_norm: None,
        mla: Some(Box::new(Mla {
            q_a,
            q_rope: dense(&q_rope, heads * rope, q_in),
            absorb_k,
            absorb_v,
            kv_a: dense(&kv_a[..lora * h], lora, h),
            kv_a_norm: ld.tensor(&format!("{p}.kv_a_layernorm.weight"), &[lora])?,
            k_rope: dense(&k_rope, rope, h),
            place_rope: dense(&place_rope, width, rope),
        })),
    })
}

/// `out = x Wᵀ` on `rows` rows of a dense [`Linear`] without bias.
fn linear<B: Backend>(b: &B, x: &B::Tensor, l: &Linear<B>, rows: usize, out: &mut B::Tensor) {
    b.linear(x, l.weight(), rows, l.in_dim, l.out_dim, out);
}

/// Queries (`[rows, heads · (d_c + d_r)]`), the shared key and value of the latent cache
/// (`[rows, d_c + d_r]` each) of `rows` normed rows `xn` into `outs`.
pub fn project<B: Backend>(
    b: &B,
    a: &Attention<B>,
    mla: &Mla<B>,
    eps: f32,
    xn: &B::Tensor,
    rows: usize,
    outs: [&mut B::Tensor; 3],
) {
    let [qs, ks, vs] = outs;
    let heads = mla.absorb_k.len();
    let (width, rope) = (mla.place_rope.out_dim, mla.place_rope.in_dim);
    let low = mla.q_a.as_ref().map(|(q_a, norm)| {
        let mut low = b.alloc(rows * q_a.out_dim);
        linear(b, xn, q_a, rows, &mut low);
        b.rms_norm_inplace(&mut low, norm, rows, q_a.out_dim, eps);
        low
    });
    let q_in = low.as_ref().unwrap_or(xn);
    let mut q_nope = b.alloc(rows * a.q_proj.out_dim);
    linear(b, q_in, &a.q_proj, rows, &mut q_nope);
    let nope = a.q_proj.out_dim / heads;
    b.matmul_heads(&q_nope, &mla.absorb_k, rows, nope, width, qs);
    // Each head's rotary part into its rotary positions: one row per (row, head).
    let mut q_rope = b.alloc(rows * heads * rope);
    linear(b, q_in, &mla.q_rope, rows, &mut q_rope);
    let mut placed = b.alloc(rows * heads * width);
    linear(b, &q_rope, &mla.place_rope, rows * heads, &mut placed);
    b.add(qs, &placed, rows * heads * width);

    let lora = mla.kv_a.out_dim;
    let mut latent = b.alloc(rows * lora);
    linear(b, xn, &mla.kv_a, rows, &mut latent);
    b.rms_norm_inplace(&mut latent, &mla.kv_a_norm, rows, lora, eps);
    linear(b, &latent, &a.k_proj, rows, ks);
    linear(b, &latent, &a.v_proj, rows, vs);
    let mut k_rope = b.alloc(rows * rope);
    linear(b, xn, &mla.k_rope, rows, &mut k_rope);
    let mut placed = b.alloc(rows * width);
    linear(b, &k_rope, &mla.place_rope, rows, &mut placed);
    b.add(ks, &placed, rows * width);
}

/// The output projection of attention's output `attn` (`[rows, heads · (d_c + d_r)]`,
/// each head a mix of latents): each head's values `V_h`, then `o_proj`, into `out`.
pub fn output<B: Backend>(
    b: &B,
    a: &Attention<B>,
    mla: &Mla<B>,
    attn: &B::Tensor,
    rows: usize,
    out: &mut B::Tensor,
) {
    let width = mla.place_rope.out_dim;
    let heads = mla.absorb_v.len();
    let vd = a.o_proj.in_dim / heads;
    let mut values = b.alloc(rows * heads * vd);
    b.matmul_heads(attn, &mla.absorb_v, rows, width, vd, &mut values);
    b.linear(
        &values,
        a.o_proj.weight(),
        rows,
        a.o_proj.in_dim,
        a.o_proj.out_dim,
        out,
    );
}
