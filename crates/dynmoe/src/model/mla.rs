//! Multi-head latent attention (DeepSeek-V3, Kimi-K2), run as the attention every other
//! architecture runs.
//!
//! transformers computes a query per head as `[q_nope (d_n), q_rope (d_r)]` from q's
//! low-rank path, and a key and value per head by expanding one shared latent
//! `c = rms_norm(kv_a x)` through `kv_b`: `k = [k_nope_h(c), k_rope]`, `v = v_h(c)`, the
//! rotary part `k_rope` shared by every head. The scores are scaled by `1/√(d_n + d_r)`
//! times YaRN's `mscale²`, and the rotary values are interleaved pairs.
//!
//! This module builds, at load, projections that give queries, keys and values in the
//! layout of ordinary attention heads of `d = d_n + d_r` values, so that the caches, the
//! rotary op and the attention kernels of every backend run it unchanged:
//!
//! - each head is laid out as `checkpoint::arch::partial_rotary` lays out a partially
//!   rotating head: the rotary pairs half a head apart (the interleaved pairs taken apart
//!   first), the values without position in the pairs that turn by nothing;
//! - `k = c·Kᵀ + k_rope·Pᵀ`: `K` is `kv_b`'s key rows in that layout (zeros at the
//!   rotary positions) and `P` a matrix of ones that puts the shared rotary key at every
//!   head's rotary positions;
//! - `v = c·Vᵀ`, each head's `v_head_dim` values first and zeros after, and `o_proj`'s
//!   columns spread to match;
//! - YaRN's `mscale²` is folded into the query projection and its rotary scaling into the
//!   rotary rows of the query and of the shared key.
//!
//! This is the expanded form: the cache holds a key and a value per head. The latent
//! cache with the up-projections absorbed into the query and output products is the
//! faster form for decoding, still to come.

use super::weights::{Attention, Linear, LinearWeight, Loader};
use super::Error;
use crate::backend::Backend;
use crate::checkpoint::arch::partial_rotary::PartialRotary;
use crate::checkpoint::config::MlaConfig;

/// The parts of latent attention besides the q, k, v and o projections of [`Attention`]
/// (which, for it, read the low-rank query and the latent; see the module's comment).
pub struct Mla<B: Backend> {
    /// q's low-rank path: `q_a_proj` and `q_a_layernorm`; `None` where `q_proj` reads
    /// the layer's input.
    pub q_a: Option<(Linear<B>, B::Tensor)>,
    /// The latent's projection: `kv_a_proj_with_mqa`'s first `kv_lora_rank` rows.
    pub kv_a: Linear<B>,
    /// `kv_a_layernorm`.
    pub kv_a_norm: B::Tensor,
    /// The shared rotary key's projection: `kv_a_proj_with_mqa`'s last rows, pairs taken
    /// apart, times YaRN's rotary scaling.
    pub k_rope: Linear<B>,
    /// `[heads · d, d_r]` of ones and zeros: the shared rotary key at each head's rotary
    /// positions.
    pub place: Linear<B>,
}

/// Where a value of a laid-out head comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Value `.0` of the part without position.
    Nope(usize),
    /// Rotary value `.0`, counted with the pairs taken apart (`x0, x2, …, x1, x3, …`).
    Rope(usize),
}

/// The layout of one q/k head: for each of its `d_n + d_r` positions, what it holds.
fn head_layout(m: &MlaConfig) -> Vec<Slot> {
    let (nope, rope) = (m.qk_nope_head_dim, m.qk_rope_head_dim);
    let order = PartialRotary {
        head_dim: nope + rope,
        rotary_dim: rope,
    }
    .order();
    order
        .into_iter()
        .map(|o| {
            if o < rope {
                Slot::Rope(o)
            } else {
                Slot::Nope(o - rope)
            }
        })
        .collect()
}

/// Where rotary value `r` (pairs taken apart) is stored among a head's `rope` values.
fn stored_rope(m: &MlaConfig, r: usize) -> usize {
    let half = m.qk_rope_head_dim / 2;
    match (m.interleaved, r < half) {
        (false, _) => r,
        (true, true) => 2 * r,
        (true, false) => 2 * (r - half) + 1,
    }
}

/// Layer `layer`'s latent attention: the [`Attention`] whose projections give heads of
/// `d_n + d_r` values, with its [`Mla`] parts.
pub fn load<B: Backend>(
    ld: &Loader<B>,
    layer: usize,
    m: &MlaConfig,
) -> Result<Attention<B>, Error> {
    let c = ld.config;
    let p = format!("model.layers.{layer}.self_attn");
    if let Some(name) = ld.coded.keys().find(|n| n.starts_with(&format!("{p}."))) {
        return Err(Error::Config(format!(
            "{name}: coded latent-attention projections are not supported yet; keep the \
             attention layers at bf16 (--dense-codec bf16)"
        )));
    }
    let (heads, h) = (c.num_heads, c.hidden_size);
    let (nope, rope, vd, lora) = (
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let d = nope + rope;
    if vd > d {
        return Err(Error::Config(format!(
            "{p}: v_head_dim {vd} is wider than a query head ({d}); the expanded form pads \
             values to a query head's width"
        )));
    }
    let layout = head_layout(m);
    let yarn = c.rope.yarn.as_ref();
    let rotary_scale = yarn.map_or(1.0, |y| y.attention_factor()) as f32;
    let softmax_scale = yarn.map_or(1.0, |y| y.softmax_mscale()) as f32;
    let dense = |data: Vec<f32>, out_dim: usize, in_dim: usize| Linear {
        w: LinearWeight::Dense(ld.backend.upload_matrix(&data, out_dim, in_dim)),
        bias: None,
        in_dim,
        out_dim,
    };
    // A matrix of `heads · d` rows, row (head, position) from `row(head, slot)` (`None`:
    // zeros), each `width` wide.
    let laid_out =
        |width: usize, row: &dyn Fn(usize, Slot) -> Option<(usize, f32)>, src: &[f32]| {
            let mut out = vec![0.0f32; heads * d * width];
            for hd in 0..heads {
                for (pos, &slot) in layout.iter().enumerate() {
                    if let Some((r, scale)) = row(hd, slot) {
                        let to = (hd * d + pos) * width;
                        let from = &src[r * width..(r + 1) * width];
                        out[to..to + width]
                            .iter_mut()
                            .zip(from)
                            .for_each(|(o, v)| *o = v * scale);
                    }
                }
            }
            out
        };

    // Queries: each stored head is [nope, rope interleaved].
    let q_row = |hd: usize, slot: Slot| {
        Some(match slot {
            Slot::Nope(n) => (hd * d + n, softmax_scale),
            Slot::Rope(r) => (
                hd * d + nope + stored_rope(m, r),
                softmax_scale * rotary_scale,
            ),
        })
    };
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
    let q_stored = ld.ckpt.f32(&q_name, &[heads * d, q_in])?;
    let q_proj = dense(laid_out(q_in, &q_row, &q_stored), heads * d, q_in);

    // Keys and values: `kv_b` holds per head [k nope, v].
    let kv_b = ld.ckpt.f32(
        &format!("{p}.kv_b_proj.weight"),
        &[heads * (nope + vd), lora],
    )?;
    let k_row = |hd: usize, slot: Slot| match slot {
        Slot::Nope(n) => Some((hd * (nope + vd) + n, 1.0)),
        Slot::Rope(_) => None,
    };
    let k_proj = dense(laid_out(lora, &k_row, &kv_b), heads * d, lora);
    let mut v = vec![0.0f32; heads * d * lora];
    for hd in 0..heads {
        for j in 0..vd {
            let from = (hd * (nope + vd) + nope + j) * lora;
            v[(hd * d + j) * lora..(hd * d + j + 1) * lora]
                .copy_from_slice(&kv_b[from..from + lora]);
        }
    }
    let v_proj = dense(v, heads * d, lora);
    let unit: Vec<f32> = (0..rope * rope)
        .map(|i| if i % (rope + 1) == 0 { 1.0 } else { 0.0 })
        .collect();
    let place_row = |_: usize, slot: Slot| match slot {
        Slot::Rope(r) => Some((r, 1.0)),
        Slot::Nope(_) => None,
    };
    let place = dense(laid_out(rope, &place_row, &unit), heads * d, rope);

    let kv_a_all = ld
        .ckpt
        .f32(&format!("{p}.kv_a_proj_with_mqa.weight"), &[lora + rope, h])?;
    let kv_a = dense(kv_a_all[..lora * h].to_vec(), lora, h);
    let mut k_rope = vec![0.0f32; rope * h];
    for r in 0..rope {
        let from = (lora + stored_rope(m, r)) * h;
        k_rope[r * h..(r + 1) * h]
            .iter_mut()
            .zip(&kv_a_all[from..from + h])
            .for_each(|(o, v)| *o = v * rotary_scale);
    }
    let k_rope = dense(k_rope, rope, h);
    let kv_a_norm = ld.tensor(&format!("{p}.kv_a_layernorm.weight"), &[lora])?;

    // The output projection reads each head's first v_head_dim values.
    let o_stored = ld
        .ckpt
        .f32(&format!("{p}.o_proj.weight"), &[h, heads * vd])?;
    let mut o = vec![0.0f32; h * heads * d];
    for (row, stored) in o
        .chunks_exact_mut(heads * d)
        .zip(o_stored.chunks_exact(heads * vd))
    {
        for hd in 0..heads {
            row[hd * d..hd * d + vd].copy_from_slice(&stored[hd * vd..(hd + 1) * vd]);
        }
    }
    let o_proj = dense(o, h, heads * d);

    Ok(Attention {
        q_proj,
        k_proj,
        v_proj,
        o_proj,
        qk_norm: None,
        mla: Some(Box::new(Mla {
            q_a,
            kv_a,
            kv_a_norm,
            k_rope,
            place,
        })),
    })
}

/// Queries, keys and values of `rows` normed rows `xn` into `outs` (`[rows, heads · d]`
/// each), as the module's comment lays them out.
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
    let linear = |x: &B::Tensor, l: &Linear<B>, out: &mut B::Tensor| {
        b.linear(x, l.weight(), rows, l.in_dim, l.out_dim, out)
    };
    match &mla.q_a {
        Some((q_a, norm)) => {
            let mut low = b.alloc(rows * q_a.out_dim);
            linear(xn, q_a, &mut low);
            b.rms_norm_inplace(&mut low, norm, rows, q_a.out_dim, eps);
            linear(&low, &a.q_proj, qs);
        }
        None => linear(xn, &a.q_proj, qs),
    }
    let lora = mla.kv_a.out_dim;
    let mut latent = b.alloc(rows * lora);
    linear(xn, &mla.kv_a, &mut latent);
    b.rms_norm_inplace(&mut latent, &mla.kv_a_norm, rows, lora, eps);
    let mut k_rope = b.alloc(rows * mla.k_rope.out_dim);
    linear(xn, &mla.k_rope, &mut k_rope);
    linear(&latent, &a.k_proj, ks);
    let mut placed = b.alloc(rows * a.k_proj.out_dim);
    linear(&k_rope, &mla.place, &mut placed);
    b.add(ks, &placed, rows * a.k_proj.out_dim);
    linear(&latent, &a.v_proj, vs);
}
