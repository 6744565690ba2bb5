//! Qwen3-MoE (`qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B.
//!
//! Per-head q/k RMSNorm before RoPE; softmax router, top-k, renormalised when
//! `norm_topk_prob`; no shared expert; `mlp_only_layers` and `decoder_sparse_step`
//! make some layers dense.

use super::{FfnNames, ROUTED_MLP};
use crate::checkpoint::Checkpoint;

/// Layer `layer`'s feed-forward tensors: `model.layers.{i}.mlp.gate`, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`.
pub fn ffn_names(_: &Checkpoint, _layer: usize) -> FfnNames {
    ROUTED_MLP
}
