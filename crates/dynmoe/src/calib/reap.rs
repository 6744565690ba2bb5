//! REAP saliency as its authors define it: for expert j of a layer, the mean over the
//! calibration tokens routed to j of `g_j(x) · ‖f_j(x)‖₂`, with `g` the router weight
//! renormalised over the top-k and `f_j` the expert's output.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::backend::route::route;
use crate::backend::Backend;
use crate::checkpoint::config::Router;
use crate::model::weights::Moe;
use crate::model::{moe::expert_group, moe::MoeObserver};
use crate::model::{Error, LoadedModel};

/// Saliency of every expert of every MoE layer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Saliency {
    /// Per decoder layer, per expert: the mean of `g · ‖f(x)‖` over its routed tokens
    /// (0 for an expert no token chose).
    pub layers: BTreeMap<usize, Vec<f64>>,
    /// Per decoder layer, per expert: how many tokens chose it.
    pub routed: BTreeMap<usize, Vec<u64>>,
    /// Tokens run.
    pub tokens: usize,
}

impl Saliency {
    /// Per layer, every expert by descending saliency (ties to the lower id): the first
    /// K are static REAP's resident set.
    pub fn ranking(&self) -> BTreeMap<usize, Vec<u32>> {
        self.layers
            .iter()
            .map(|(&l, s)| {
                let mut order: Vec<u32> = (0..s.len() as u32).collect();
                order.sort_by(|&a, &b| s[b as usize].total_cmp(&s[a as usize]).then(a.cmp(&b)));
                (l, order)
            })
            .collect()
    }
}

/// The observer that accumulates REAP saliency over forward calls.
pub struct Reap {
    top_k: usize,
    router: Router,
    sums: BTreeMap<usize, Vec<f64>>,
    counts: BTreeMap<usize, Vec<u64>>,
    tokens: usize,
}

impl Reap {
    /// An empty accumulator for `router` picking `top_k` experts.
    pub fn new(top_k: usize, router: Router) -> Reap {
        Reap {
            top_k,
            router,
            sums: BTreeMap::new(),
            counts: BTreeMap::new(),
            tokens: 0,
        }
    }

    /// The saliency so far.
    pub fn saliency(&self) -> Saliency {
        Saliency {
            layers: self
                .sums
                .iter()
                .map(|(&l, s)| {
                    let c = &self.counts[&l];
                    let mean = s
                        .iter()
                        .zip(c)
                        .map(|(&s, &c)| if c > 0 { s / c as f64 } else { 0.0 })
                        .collect();
                    (l, mean)
                })
                .collect(),
            routed: self.counts.clone(),
            tokens: self.tokens,
        }
    }
}

impl<B: Backend> MoeObserver<B> for Reap {
    fn observe(
        &mut self,
        b: &B,
        layer: usize,
        block: &Moe<B>,
        x: &B::Tensor,
        rows: usize,
        probs: &[f32],
    ) {
        let (e, h) = (block.gate.out_dim, block.gate.in_dim);
        // The experts the model's router chooses; the authors' g is their weight
        // renormalised over the k chosen, whatever the router then does with it.
        let bias = block.score_bias.as_deref();
        let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); e];
        for r in 0..rows {
            let p = &probs[r * e..(r + 1) * e];
            let chosen = route(p, bias, self.top_k, self.router);
            let sum: f32 = chosen.experts.iter().map(|&j| p[j as usize]).sum();
            for &j in &chosen.experts {
                let g = p[j as usize] / sum;
                routed[j as usize].0.push(r as u32);
                routed[j as usize].1.push(g);
            }
        }
        let sums = self.sums.entry(layer).or_insert_with(|| vec![0.0; e]);
        let counts = self.counts.entry(layer).or_insert_with(|| vec![0; e]);
        let mut out = b.alloc(rows * h);
        let mut host = vec![0.0f32; rows * h];
        for (j, (tokens, gates)) in routed.iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            // f_j alone on its tokens: unit scales into a zeroed buffer.
            let ones = vec![1.0f32; tokens.len()];
            b.write_rows(&b.zeros(rows * h), &mut out, 0, rows, h);
            b.swiglu_groups(
                x,
                h,
                &[expert_group(&block.experts, j, tokens, &ones)],
                &mut out,
            );
            b.download(&out, &mut host);
            for (&r, &g) in tokens.iter().zip(gates) {
                let row = &host[r as usize * h..(r as usize + 1) * h];
                let norm = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
                sums[j] += g as f64 * norm;
                counts[j] += 1;
            }
        }
        if Some(&layer) == self.sums.keys().next() {
            self.tokens += rows;
        }
    }
}

/// REAP saliency of `m` on `text`: chunks of `ctx` tokens (the cache cleared for each,
/// the first token replaced by BOS when the tokenizer uses one, as perplexity does), at
/// most `max_chunks` of them; a shorter text is run as one chunk. Run it without a
/// resident set: the hidden states should be the full model's.
pub fn reap_saliency<B: Backend>(
    m: &LoadedModel<B>,
    text: &str,
    ctx: usize,
    max_chunks: Option<usize>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Saliency, Error> {
    let tokens = m.tokenizer.encode(text)?;
    let ctx = ctx.max(1);
    let mut chunks: Vec<&[u32]> = tokens.chunks(ctx).filter(|c| c.len() == ctx).collect();
    if chunks.is_empty() && !tokens.is_empty() {
        chunks.push(&tokens);
    }
    if let Some(max) = max_chunks {
        chunks.truncate(max);
    }
    let mut reap = Reap::new(m.model.config.moe.top_k, m.model.config.moe.router);
    let mut state = m.model.new_state(ctx.max(tokens.len().min(ctx)));
    for (i, chunk) in chunks.iter().enumerate() {
        let mut chunk = chunk.to_vec();
        if let Some(bos) = m.tokenizer.bos {
            chunk[0] = bos;
        }
        state.clear();
        m.model
            .forward_observed(&mut state, &chunk, chunk.len(), Some(&mut reap))?;
        progress(i + 1, chunks.len());
    }
    Ok(reap.saliency())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::model::weights::{Experts, Linear, LinearWeight, Mlp};
    use crate::store::{records::LayerSource, records::RecordFormat};
    use crate::testing::{fresh, rel_err};

    fn linear(b: &Cpu, out_dim: usize, in_dim: usize, salt: u64) -> (Linear<Cpu>, Vec<f32>) {
        let w: Vec<f32> = fresh(out_dim * in_dim, salt)
            .iter()
            .map(|v| v * 0.3)
            .collect();
        (
            Linear {
                w: LinearWeight::Dense(b.upload_matrix(&w, out_dim, in_dim)),
                bias: None,
                in_dim,
                out_dim,
            },
            w,
        )
    }

    /// `x Wᵀ` by hand.
    fn mul(x: &[f32], w: &[f32], rows: usize, i: usize, o: usize) -> Vec<f32> {
        let mut y = vec![0.0f32; rows * o];
        for r in 0..rows {
            for c in 0..o {
                y[r * o + c] = (0..i).map(|k| x[r * i + k] * w[c * i + k]).sum();
            }
        }
        y
    }

    #[test]
    fn saliency_matches_a_direct_computation() {
        let b = Cpu::reference();
        let (e, h, inter, k, rows) = (6, 16, 8, 2, 40);
        let (gate, wg) = linear(&b, e, h, 1);
        let mut mlps = Vec::new();
        let mut ws = Vec::new();
        for j in 0..e as u64 {
            let (g, gw) = linear(&b, inter, h, 10 + j);
            let (u, uw) = linear(&b, inter, h, 20 + j);
            let (d, dw) = linear(&b, h, inter, 30 + j);
            mlps.push(Mlp {
                gate_proj: g,
                up_proj: u,
                down_proj: d,
            });
            ws.push((gw, uw, dw));
        }
        let block = Moe {
            gate,
            experts: Experts::Dense(mlps),
            shared_expert: None,
            shared_expert_gate: None,
            score_bias: None,
            keep: None,
            shadows: None,
            source: Box::new(LayerSource {
                format: RecordFormat::Dense {
                    dtype: safetensors::Dtype::F32,
                    hidden: h,
                    intermediate: inter,
                },
                experts: Vec::new(),
                checksums: None,
            }),
        };
        let x = fresh(rows * h, 2);
        let logits = mul(&x, &wg, rows, h, e);
        let probs: Vec<f32> = logits
            .chunks(e)
            .flat_map(|l| {
                let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let s: f32 = l.iter().map(|v| (v - m).exp()).sum();
                l.iter().map(move |v| (v - m).exp() / s).collect::<Vec<_>>()
            })
            .collect();

        let mut reap = Reap::new(k, Router::SoftmaxTopK { renormalize: false });
        reap.observe(&b, 3, &block, &b.upload(&x), rows, &probs);
        let got = &reap.saliency().layers[&3];

        // Direct: top-k by probability, weights renormalised, expert output norms.
        let (mut sum, mut n) = (vec![0.0f64; e], vec![0u64; e]);
        for r in 0..rows {
            let p = &probs[r * e..(r + 1) * e];
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &c| p[c].total_cmp(&p[a]));
            let top = &order[..k];
            let z: f32 = top.iter().map(|&j| p[j]).sum();
            let xr = &x[r * h..(r + 1) * h];
            for &j in top {
                let (gw, uw, dw) = &ws[j];
                let g = mul(xr, gw, 1, h, inter);
                let u = mul(xr, uw, 1, h, inter);
                let a: Vec<f32> = g
                    .iter()
                    .zip(&u)
                    .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                let y = mul(&a, dw, 1, inter, h);
                let norm = y.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
                sum[j] += (p[j] / z) as f64 * norm;
                n[j] += 1;
            }
        }
        let want: Vec<f32> = (0..e)
            .map(|j| {
                if n[j] > 0 {
                    (sum[j] / n[j] as f64) as f32
                } else {
                    0.0
                }
            })
            .collect();
        let got32: Vec<f32> = got.iter().map(|&v| v as f32).collect();
        assert!(
            want.iter().filter(|&&v| v > 0.0).count() >= 3,
            "too few experts routed"
        );
        assert!(rel_err(&got32, &want) < 1e-5, "{got32:?} vs {want:?}");
        assert_eq!(reap.saliency().routed[&3], n);
        let ranking = reap.saliency().ranking()[&3].clone();
        for w in ranking.windows(2) {
            assert!(want[w[0] as usize] >= want[w[1] as usize] - 1e-6);
        }
    }
}
