//! One file per architecture, chosen by one `match` on `model_type`. Each says where
//! its tensors live in the checkpoint; the forward pass and the MoE block are shared.

pub mod mixtral;
pub mod olmoe;
pub mod qwen2_moe;
pub mod qwen3_moe;

use super::checkpoint::Checkpoint;
use super::config::{Arch, FfnKind};
use super::weights::{Ffn, Layer, Loader, Moe};
use super::Error;
use crate::backend::Backend;

/// How the configured architecture names layer `layer`'s feed-forward tensors.
pub fn ffn_names(arch: Arch, ckpt: &Checkpoint, layer: usize) -> FfnNames {
    match arch {
        Arch::Qwen3Moe => qwen3_moe::ffn_names(ckpt, layer),
        Arch::Qwen2Moe => qwen2_moe::ffn_names(ckpt, layer),
        Arch::Mixtral => mixtral::ffn_names(ckpt, layer),
        Arch::Olmoe => olmoe::ffn_names(ckpt, layer),
    }
}

/// Loads decoder layer `i` with the naming of the configured architecture.
pub fn load_layer<B: Backend>(ld: &Loader<B>, i: usize) -> Result<Layer<B>, Error> {
    layer_with(ld, i, &ffn_names(ld.config.arch, ld.ckpt, i))
}

/// How an architecture names the feed-forward block of a layer.
pub struct FfnNames {
    /// Under `model.layers.{i}.`: `mlp` or `block_sparse_moe`.
    pub block: &'static str,
    /// Router tensor under the block (`gate`).
    pub router: &'static str,
    /// Gate, up and down projections of an expert (or dense MLP).
    pub projections: [&'static str; 3],
    /// Shared expert and its sigmoid gate under the block, if the architecture has one.
    pub shared: Option<(&'static str, &'static str)>,
}

/// The projection names most architectures use.
pub const SWIGLU: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// `mlp.gate` and `mlp.experts.{e}.{gate,up,down}_proj`, no shared expert (Qwen3-MoE,
/// OLMoE, and Mixtral as newer transformers versions write it).
pub const ROUTED_MLP: FfnNames = FfnNames {
    block: "mlp",
    router: "gate",
    projections: SWIGLU,
    shared: None,
};

/// Norms, attention and the feed-forward block of layer `i`, named by `names`.
pub fn layer_with<B: Backend>(
    ld: &Loader<B>,
    i: usize,
    names: &FfnNames,
) -> Result<Layer<B>, Error> {
    let c = ld.config;
    let (input_layernorm, post_attention_layernorm) = ld.layer_norms(i)?;
    let prefix = format!("model.layers.{i}.{}", names.block);
    let mlp = match c.layers[i].ffn {
        FfnKind::Dense { intermediate } => {
            Ffn::Dense(ld.mlp(&prefix, names.projections, intermediate)?)
        }
        FfnKind::Moe => {
            let (shared_expert, shared_expert_gate) =
                match (names.shared, c.moe.shared_expert_intermediate) {
                    (Some((mlp, gate)), Some(width)) => (
                        Some(ld.mlp(&format!("{prefix}.{mlp}"), names.projections, width)?),
                        Some(ld.linear(&format!("{prefix}.{gate}"), 1, c.hidden_size, false)?),
                    ),
                    _ => (None, None),
                };
            let (experts, source) = ld.routed_experts(i, &prefix, names.projections)?;
            Ffn::Moe(Moe {
                gate: ld.linear(
                    &format!("{prefix}.{}", names.router),
                    c.moe.num_experts,
                    c.hidden_size,
                    false,
                )?,
                experts,
                shared_expert,
                shared_expert_gate,
                source: Box::new(source),
                keep: None,
            })
        }
    };
    Ok(Layer {
        input_layernorm,
        self_attn: ld.attention(i)?,
        post_attention_layernorm,
        mlp,
    })
}
