//! OLMoE (`olmoe`).
//!
//! q and k RMSNorm over the whole projection (before the split into heads), optional
//! clamping of q, k and v to ±`clip_qkv`; softmax router, top-8 of 64 in the released
//! model, not renormalised by default.

use super::{FfnNames, ROUTED_MLP};
use crate::checkpoint::Checkpoint;

/// Layer `layer`'s feed-forward tensors: `model.layers.{i}.mlp.gate`, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`.
pub fn ffn_names(_: &Checkpoint, _layer: usize) -> FfnNames {
    ROUTED_MLP
}
