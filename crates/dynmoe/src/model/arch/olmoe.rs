//! OLMoE (`olmoe`).
//!
//! q and k RMSNorm over the whole projection (before the split into heads), optional
//! clamping of q, k and v to ±`clip_qkv`; softmax router, top-8 of 64 in the released
//! model, not renormalised by default.

use super::{layer_with, ROUTED_MLP};
use crate::backend::Backend;
use crate::model::weights::{Layer, Loader};
use crate::model::Error;

/// Layer `i`: `model.layers.{i}.mlp.gate`, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`.
pub fn layer<B: Backend>(ld: &Loader<B>, i: usize) -> Result<Layer<B>, Error> {
    layer_with(ld, i, &ROUTED_MLP)
}
