//! The mixture-of-experts block, shared by every architecture: route each token from
//! its full probability vector, then run each expert once on all the tokens routed to
//! it (gathered into one matrix), and scatter the weighted outputs back.
//!
//! The full, unmasked probability vector of every token is returned to the caller:
//! calibration and the resident-set runtime read it. With a resident set, routing is
//! confined to the residents and their weights are read from the set's slots.

use rayon::prelude::*;

use super::weights::{Experts, Mlp, Moe};
use crate::backend::route::{confine, route, Route};
use crate::backend::{Backend, DeviceRoute, MoeInput, RoutedExperts, SwiGluGroup, Weight};
use crate::checkpoint::config::Router;
use crate::residency::LayerSet;

/// Sees every MoE block of a forward call: the block, its input rows `x`
/// (`[rows, hidden]`, normalised) and their unmasked router probabilities
/// (`[rows, E]`). Calibration (REAP saliency) is written against this.
pub trait MoeObserver<B: Backend> {
    /// Called once per MoE layer, after the block ran.
    fn observe(
        &mut self,
        b: &B,
        layer: usize,
        block: &Moe<B>,
        x: &B::Tensor,
        rows: usize,
        probs: &[f32],
    );
}

/// The logistic function, `1 / (1 + e^-v)`.
fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// The group that runs `mlp` on `rows` with output weights `scales`.
fn group<'a, B: Backend>(
    mlp: &'a Mlp<B>,
    rows: &'a [u32],
    scales: &'a [f32],
) -> SwiGluGroup<'a, B::Matrix> {
    SwiGluGroup {
        gate: mlp.gate_proj.weight(),
        up: mlp.up_proj.weight(),
        down: mlp.down_proj.weight(),
        intermediate: mlp.gate_proj.out_dim,
        rows,
        scales,
    }
}

/// The group that runs routed expert `e` on `rows`, from the layer's own weights.
pub fn expert_group<'a, B: Backend>(
    experts: &'a Experts<B>,
    e: usize,
    rows: &'a [u32],
    scales: &'a [f32],
) -> SwiGluGroup<'a, B::Matrix> {
    match experts {
        Experts::Dense(mlps) => group(&mlps[e], rows, scales),
        Experts::Stored { store, layer } => {
            SwiGluGroup::of_record(store.record(*layer, e), rows, scales)
        }
        Experts::Vq(m) => SwiGluGroup::of_vq(m.expert(e), rows, scales),
    }
}

/// A dense SwiGLU MLP on `rows` rows: `out = mlp(x)`.
pub fn dense<B: Backend>(b: &B, mlp: &Mlp<B>, x: &B::Tensor, rows: usize, out: &mut B::Tensor) {
    let h = mlp.down_proj.out_dim;
    let all: Vec<u32> = (0..rows as u32).collect();
    let ones = vec![1.0f32; rows];
    b.write_rows(&b.zeros(rows * h), out, 0, rows, h);
    b.swiglu_groups(x, h, &[group(mlp, &all, &ones)], out);
}

/// The routing options of a block.
#[derive(Debug, Clone, Copy)]
pub struct Routing {
    /// Experts per token.
    pub top_k: usize,
    /// How weights are formed.
    pub router: Router,
}

/// The MoE block on `rows` rows of `x`: `out = Σ_k w_k · expert_k(x) (+ shared)`,
/// confined to `set`'s residents when given (`track`: feed its evidence). Returns the
/// full, unmasked router probabilities, `[rows, num_experts]`.
#[allow(clippy::too_many_arguments)]
pub fn forward<B: Backend>(
    b: &B,
    moe: &Moe<B>,
    routing: Routing,
    x: &B::Tensor,
    rows: usize,
    out: &mut B::Tensor,
    mut set: Option<&mut LayerSet<B>>,
    track: bool,
) -> Vec<f32> {
    let Routing { top_k, router } = routing;
    let (e, h) = (moe.gate.out_dim, moe.gate.in_dim);
    let mut logits = b.alloc(rows * e);
    b.linear(x, moe.gate.weight(), rows, h, e, &mut logits);
    let scored = matches!(router, Router::SigmoidGroups { .. });
    if !scored {
        b.softmax_rows(&mut logits, rows, e);
    }
    let mut probs = vec![0.0f32; rows * e];
    b.download(&logits, &mut probs);
    if scored {
        // A sigmoid router's scores are made where they are routed, on the host.
        probs.iter_mut().for_each(|v| *v = sigmoid(*v));
    }
    let bias = moe.score_bias.as_deref();

    // Group tokens by expert so each expert runs once, on a matrix of its tokens.
    let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); e];
    let routes: Vec<Route> = match set {
        Some(ref mut s) => s.route(&probs, rows, bias, top_k, router, track),
        None => probs
            .par_chunks(e)
            .map(|p| match (&moe.keep, &moe.shadows) {
                (Some(keep), None) => route(&confine(p, keep, router), bias, top_k, router),
                _ => route(p, bias, top_k, router),
            })
            .collect(),
    };
    let set = set.map(|s| &*s);
    for (r, chosen) in routes.iter().enumerate() {
        for (&x, &w) in chosen.experts.iter().zip(&chosen.weights) {
            routed[x as usize].0.push(r as u32);
            routed[x as usize].1.push(w);
        }
    }
    // The shared expert is one more group over every row, weighted by its sigmoid gate
    // where it has one.
    let all: Vec<u32> = (0..rows as u32).collect();
    let shared_scales: Vec<f32> = match &moe.shared_expert_gate {
        Some(gate) => {
            let mut g = b.alloc(rows);
            b.linear(x, gate.weight(), rows, h, 1, &mut g);
            let mut scales = vec![0.0f32; rows];
            b.download(&g, &mut scales);
            scales.into_iter().map(sigmoid).collect()
        }
        None => vec![1.0; rows],
    };

    let mut groups: Vec<SwiGluGroup<'_, B::Matrix>> = routed
        .iter()
        .enumerate()
        .filter(|(_, (tokens, _))| !tokens.is_empty())
        .map(
            |(e, (tokens, scales))| match (set, &moe.keep, &moe.shadows) {
                (Some(s), ..) => s.group(e, tokens, scales),
                (None, Some(keep), Some(shadows)) if !keep[e] => {
                    SwiGluGroup::of_vq(shadows.expert(e), tokens, scales)
                }
                _ => expert_group(&moe.experts, e, tokens, scales),
            },
        )
        .collect();
    if let Some(shared) = &moe.shared_expert {
        groups.push(group(shared, &all, &shared_scales));
    }

    b.write_rows(&b.zeros(rows * h), out, 0, rows, h);
    b.swiglu_groups(x, h, &groups, out);
    probs
}

/// The MoE block routed on the backend: `out` as [`forward`] makes it of the rows `x`
/// reads (which [`MoeInput::AddNorm`] has the backend write first), the unmasked
/// probabilities left on the backend in `probs[probs_at ..]`. With `slots` (a resident
/// set in the backend's memory) routing is confined to the residents and their weights
/// read from the slots ([`Backend::routed_moe_slots`]); otherwise every expert of an
/// affine store or at a VQ rung is routed ([`Backend::routed_moe`]). Returns `false`,
/// having done nothing, when the block or the backend needs the host path: a shared
/// expert (its gate is read on the host), a coded router, dense experts, or a backend
/// without the path for these experts.
#[allow(clippy::too_many_arguments)]
pub fn forward_on_device<B: Backend>(
    b: &B,
    moe: &Moe<B>,
    routing: Routing,
    x: MoeInput<'_, B::Tensor>,
    rows: usize,
    out: &mut B::Tensor,
    probs: &mut B::Tensor,
    probs_at: usize,
    slots: Option<&B::Slots>,
) -> bool {
    // The device's routing confines to `keep`; shadows run on the host.
    if !routable_on_device(moe) || (moe.keep.is_some() && moe.shadows.is_some()) {
        return false;
    }
    let Some(gate) = moe.gate.dense() else {
        return false;
    };
    // A sigmoid router's grouped choice runs on the host.
    let Router::SoftmaxTopK { renormalize } = routing.router else {
        return false;
    };
    let hidden = moe.gate.in_dim;
    let route = DeviceRoute {
        top_k: routing.top_k,
        renormalize,
        keep: moe.keep.as_deref(),
    };
    if let Some(slots) = slots {
        // The residents are the mask.
        let route = DeviceRoute {
            keep: None,
            ..route
        };
        return b.routed_moe_slots(x, rows, hidden, gate, slots, route, probs, probs_at, out);
    }
    if matches!(moe.experts, Experts::Dense(_)) {
        return false;
    }
    let weights = |e: usize| match &moe.experts {
        Experts::Stored { store, layer } => {
            let r = store.record(*layer, e);
            [
                Weight::Affine(r.gate),
                Weight::Affine(r.up),
                Weight::Affine(r.down),
            ]
        }
        Experts::Vq(vq) => vq.expert(e).map(Weight::Vq),
        Experts::Dense(_) => unreachable!("dense experts return above"),
    };
    let experts = RoutedExperts {
        id: moe as *const Moe<B> as usize,
        count: moe.gate.out_dim,
        weights: &weights,
    };
    b.routed_moe(x, rows, hidden, gate, &experts, route, probs, probs_at, out)
}

/// Whether a block's routing can run on a backend: no shared expert (its gate is read on
/// the host) and a router kept as a plain matrix.
pub fn routable_on_device<B: Backend>(moe: &Moe<B>) -> bool {
    moe.shared_expert.is_none() && moe.gate.dense().is_some()
}
