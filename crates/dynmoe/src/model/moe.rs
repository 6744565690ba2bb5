//! The mixture-of-experts block, shared by every architecture: route each token from
//! its full probability vector, then run each expert once on all the tokens routed to
//! it (gathered into one matrix), and scatter the weighted outputs back.
//!
//! The full, unmasked probability vector of every token is returned to the caller:
//! calibration and the resident-set runtime read it.

use super::config::Router;
use super::weights::{Mlp, Moe};
use crate::backend::Backend;

/// The experts chosen for one token and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Expert ids, best first.
    pub experts: Vec<u32>,
    /// Weight of each chosen expert's output.
    pub weights: Vec<f32>,
}

/// Picks the `top_k` most probable experts of one token. Ties go to the lower id.
pub fn route(probs: &[f32], top_k: usize, router: Router) -> Route {
    let mut order: Vec<u32> = (0..probs.len() as u32).collect();
    order.sort_by(|&a, &b| {
        probs[b as usize]
            .total_cmp(&probs[a as usize])
            .then(a.cmp(&b))
    });
    order.truncate(top_k);
    let mut weights: Vec<f32> = order.iter().map(|&e| probs[e as usize]).collect();
    match router {
        Router::SoftmaxTopK { renormalize: true } => {
            let sum: f32 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        Router::SoftmaxTopK { renormalize: false } => {}
    }
    Route {
        experts: order,
        weights,
    }
}

/// Buffers for one MoE call, sized for `rows` tokens.
pub struct MoeScratch<B: Backend> {
    logits: B::Tensor,
    xs: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    ys: B::Tensor,
    shared_gate: B::Tensor,
}

impl<B: Backend> MoeScratch<B> {
    /// Buffers for up to `rows` tokens of width `hidden` through experts of width at most
    /// `intermediate`, with `experts` router outputs.
    pub fn new(b: &B, rows: usize, hidden: usize, intermediate: usize, experts: usize) -> Self {
        MoeScratch {
            logits: b.alloc(rows * experts),
            xs: b.alloc(rows * hidden),
            gate: b.alloc(rows * intermediate),
            up: b.alloc(rows * intermediate),
            ys: b.alloc(rows * hidden),
            shared_gate: b.alloc(rows),
        }
    }
}

/// `out = down(silu(gate(x)) * up(x))` on `rows` rows of `x`; `gate` and `up` are scratch.
fn run_mlp<B: Backend>(
    b: &B,
    mlp: &Mlp<B>,
    x: &B::Tensor,
    rows: usize,
    gate: &mut B::Tensor,
    up: &mut B::Tensor,
    out: &mut B::Tensor,
) {
    let (h, i) = (mlp.gate_proj.in_dim, mlp.gate_proj.out_dim);
    b.matmul(x, &mlp.gate_proj.w, rows, h, i, gate);
    b.matmul(x, &mlp.up_proj.w, rows, h, i, up);
    b.silu_mul(gate, up, rows * i);
    b.matmul(gate, &mlp.down_proj.w, rows, i, h, out);
}

/// A dense SwiGLU MLP on `rows` rows: `out = mlp(x)`.
pub fn dense<B: Backend>(
    b: &B,
    mlp: &Mlp<B>,
    x: &B::Tensor,
    rows: usize,
    s: &mut MoeScratch<B>,
    out: &mut B::Tensor,
) {
    run_mlp(b, mlp, x, rows, &mut s.gate, &mut s.up, out);
}

/// The MoE block on `rows` rows of `x`: `out = Σ_k w_k · expert_k(x) (+ shared)`.
/// Returns the full router probabilities, `[rows, num_experts]`.
pub fn forward<B: Backend>(
    b: &B,
    moe: &Moe<B>,
    top_k: usize,
    router: Router,
    x: &B::Tensor,
    rows: usize,
    s: &mut MoeScratch<B>,
    out: &mut B::Tensor,
) -> Vec<f32> {
    let MoeScratch {
        logits,
        xs,
        gate,
        up,
        ys,
        shared_gate,
    } = s;
    let (e, h) = (moe.gate.out_dim, moe.gate.in_dim);
    b.matmul(x, &moe.gate.w, rows, h, e, logits);
    b.softmax_rows(logits, rows, e);
    let mut probs = vec![0.0f32; rows * e];
    b.download(logits, &mut probs);

    // Group tokens by expert so each expert runs once, on a matrix of its tokens.
    let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); e];
    for r in 0..rows {
        let chosen = route(&probs[r * e..(r + 1) * e], top_k, router);
        for (&x, &w) in chosen.experts.iter().zip(&chosen.weights) {
            routed[x as usize].0.push(r as u32);
            routed[x as usize].1.push(w);
        }
    }

    let zeros = b.zeros(rows * h);
    b.write_rows(&zeros, out, 0, rows, h);
    for (expert, (tokens, weights)) in moe.experts.iter().zip(&routed) {
        if tokens.is_empty() {
            continue;
        }
        b.gather_rows(x, tokens, h, xs);
        run_mlp(b, expert, xs, tokens.len(), gate, up, ys);
        b.scatter_add_rows(ys, tokens, weights, h, out);
    }

    if let (Some(shared), Some(shared_gate_proj)) = (&moe.shared_expert, &moe.shared_expert_gate) {
        b.matmul(x, &shared_gate_proj.w, rows, h, 1, shared_gate);
        let mut g = vec![0.0f32; rows];
        b.download(shared_gate, &mut g);
        let scales: Vec<f32> = g.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect();
        run_mlp(b, shared, x, rows, gate, up, ys);
        let all: Vec<u32> = (0..rows as u32).collect();
        b.scatter_add_rows(ys, &all, &scales, h, out);
    }
    probs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_best_first_and_renormalises() {
        let probs = [0.1, 0.4, 0.2, 0.3];
        let r = route(&probs, 2, Router::SoftmaxTopK { renormalize: true });
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights[0] - 4.0 / 7.0).abs() < 1e-6 && (r.weights[1] - 3.0 / 7.0).abs() < 1e-6);
        let r = route(&probs, 2, Router::SoftmaxTopK { renormalize: false });
        assert_eq!(r.weights, vec![0.4, 0.3]);
    }

    #[test]
    fn ties_go_to_the_lower_id() {
        let r = route(&[0.25; 4], 2, Router::SoftmaxTopK { renormalize: false });
        assert_eq!(r.experts, vec![0, 1]);
    }
}
