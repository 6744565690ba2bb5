//! Qwen3-MoE (`qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B.
//!
//! Per-head q/k RMSNorm before RoPE; softmax router, top-k, renormalised when
//! `norm_topk_prob`; no shared expert; `mlp_only_layers` and `decoder_sparse_step`
//! make some layers dense.

use super::{layer_with, ROUTED_MLP};
use crate::backend::Backend;
use crate::model::weights::{Layer, Loader};
use crate::model::Error;

/// Layer `i`: `model.layers.{i}.mlp.gate`, `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`.
pub fn layer<B: Backend>(ld: &Loader<B>, i: usize) -> Result<Layer<B>, Error> {
    layer_with(ld, i, &ROUTED_MLP)
}
