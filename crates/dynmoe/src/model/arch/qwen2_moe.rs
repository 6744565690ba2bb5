//! Qwen2-MoE (`qwen2_moe`): Qwen1.5-MoE, Qwen2-57B-A14B.
//!
//! Bias on q, k and v; softmax router; a shared expert on every token, scaled by
//! `sigmoid(shared_expert_gate(x))` and added to the routed experts' output.

use super::{layer_with, FfnNames, SWIGLU};
use crate::backend::Backend;
use crate::model::weights::{Layer, Loader};
use crate::model::Error;

/// Layer `i`: as Qwen3-MoE plus `mlp.shared_expert.*` and `mlp.shared_expert_gate`.
pub fn layer<B: Backend>(ld: &Loader<B>, i: usize) -> Result<Layer<B>, Error> {
    layer_with(
        ld,
        i,
        &FfnNames {
            block: "mlp",
            router: "gate",
            projections: SWIGLU,
            shared: Some(("shared_expert", "shared_expert_gate")),
        },
    )
}
