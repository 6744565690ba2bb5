//! Mixtral (`mixtral`).
//!
//! Top-k over the router's softmax, always renormalised over the k chosen (the same as a
//! softmax over the k selected logits); experts as `w1` (gate), `w3` (up), `w2` (down)
//! under `block_sparse_moe` in published checkpoints; optional sliding-window attention.

use super::{FfnNames, ROUTED_MLP};
use crate::checkpoint::Checkpoint;

/// Layer `layer`'s feed-forward tensors, in the published layout
/// (`block_sparse_moe.experts.{e}.w1/w3/w2`) or, when that is absent, in the
/// `mlp.experts` layout newer transformers versions write.
pub fn ffn_names(ckpt: &Checkpoint, layer: usize) -> FfnNames {
    if ckpt.contains(&format!(
        "model.layers.{layer}.block_sparse_moe.gate.weight"
    )) {
        FfnNames {
            block: "block_sparse_moe",
            projections: ["w1", "w3", "w2"],
            ..ROUTED_MLP
        }
    } else {
        ROUTED_MLP
    }
}
