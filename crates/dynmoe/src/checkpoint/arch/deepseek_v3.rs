//! DeepSeek-V3 and R1, and Kimi-K2, which ships as the same architecture (`deepseek_v3`).
//!
//! Multi-head latent attention: `q_a_proj`, `q_a_layernorm` and `q_b_proj` (or one
//! `q_proj`), `kv_a_proj_with_mqa` giving the latent and the shared rotary key,
//! `kv_a_layernorm`, `kv_b_proj` expanding the latent into each head's key and value, and
//! `o_proj`; how they run is `model::mla`. The feed-forward blocks are named as
//! GLM-4.5's: the first `first_k_dense_replace` layers dense, the rest routed by the
//! grouped sigmoid router with its correction bias, beside the shared experts. The
//! multi-token-prediction layer published after the last decoder layer is not read.

use super::{FfnNames, ROUTED_MLP};
use crate::checkpoint::Checkpoint;

/// Layer `layer`'s feed-forward tensors: as Qwen3-MoE plus `mlp.shared_experts.*`.
pub fn ffn_names(_: &Checkpoint, _layer: usize) -> FfnNames {
    FfnNames {
        shared: Some(("shared_experts", None)),
        ..ROUTED_MLP
    }
}
