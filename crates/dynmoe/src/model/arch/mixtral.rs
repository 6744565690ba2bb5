//! Mixtral (`mixtral`).
//!
//! Top-k over the router's softmax, always renormalised over the k chosen (the same as a
//! softmax over the k selected logits); experts as `w1` (gate), `w3` (up), `w2` (down)
//! under `block_sparse_moe` in published checkpoints; optional sliding-window attention.

use super::{layer_with, FfnNames, ROUTED_MLP};
use crate::backend::Backend;
use crate::model::weights::{Layer, Loader};
use crate::model::Error;

/// Layer `i`, in the published layout (`block_sparse_moe.experts.{e}.w1/w3/w2`) or, when
/// that is absent, in the `mlp.experts` layout newer transformers versions write.
pub fn layer<B: Backend>(ld: &Loader<B>, i: usize) -> Result<Layer<B>, Error> {
    let published = ld
        .ckpt
        .contains(&format!("model.layers.{i}.block_sparse_moe.gate.weight"));
    let names = if published {
        FfnNames {
            block: "block_sparse_moe",
            router: "gate",
            projections: ["w1", "w3", "w2"],
            shared: None,
        }
    } else {
        ROUTED_MLP
    };
    layer_with(ld, i, &names)
}
