//! GLM-4.5 and GLM-4.5-Air (`glm4_moe`).
//!
//! Grouped-query attention with q/k/v bias (no bias on the output), optional per-head q/k
//! RMSNorm, and rotary embedding over the leading `partial_rotary_factor` of each head;
//! the first `first_k_dense_replace` layers are dense; every other layer routes with
//! DeepSeek-V3's grouped sigmoid router (`mlp.gate.weight` and its float32
//! `mlp.gate.e_score_correction_bias`) and adds the shared experts
//! (`mlp.shared_experts.*`, one MLP of their summed width, with no gate). The
//! multi-token-prediction layers published after the last decoder layer are not read.

use super::{FfnNames, ROUTED_MLP};
use crate::checkpoint::Checkpoint;

/// Layer `layer`'s feed-forward tensors: as Qwen3-MoE plus `mlp.shared_experts.*`.
pub fn ffn_names(_: &Checkpoint, _layer: usize) -> FfnNames {
    FfnNames {
        shared: Some(("shared_experts", None)),
        ..ROUTED_MLP
    }
}
