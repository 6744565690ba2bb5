//! Qwen2-MoE (`qwen2_moe`): Qwen1.5-MoE, Qwen2-57B-A14B.
//!
//! Bias on q, k and v; softmax router; a shared expert on every token, scaled by
//! `sigmoid(shared_expert_gate(x))` and added to the routed experts' output.

use super::{FfnNames, ROUTED_MLP};
use crate::checkpoint::Checkpoint;

/// Layer `layer`'s feed-forward tensors: as Qwen3-MoE plus `mlp.shared_expert.*` and
/// `mlp.shared_expert_gate`.
pub fn ffn_names(_: &Checkpoint, _layer: usize) -> FfnNames {
    FfnNames {
        shared: Some(("shared_expert", Some("shared_expert_gate"))),
        ..ROUTED_MLP
    }
}
