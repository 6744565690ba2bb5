//! Where each architecture keeps its tensors: one file per architecture, chosen by one
//! `match` on `model_type`, and the classification of a checkpoint's tensors by name.
//! The forward pass and the MoE block are shared (`model`).

pub mod deepseek_v3;
pub mod glm4_moe;
pub mod mixtral;
pub mod olmoe;
pub mod partial_rotary;
pub mod qwen2_moe;
pub mod qwen3_moe;

use serde::Serialize;

use super::config::{Arch, Config};
use super::Checkpoint;

/// How the configured architecture names layer `layer`'s feed-forward tensors.
pub fn ffn_names(arch: Arch, ckpt: &Checkpoint, layer: usize) -> FfnNames {
    match arch {
        Arch::Qwen3Moe => qwen3_moe::ffn_names(ckpt, layer),
        Arch::Qwen2Moe => qwen2_moe::ffn_names(ckpt, layer),
        Arch::Mixtral => mixtral::ffn_names(ckpt, layer),
        Arch::Olmoe => olmoe::ffn_names(ckpt, layer),
        Arch::Glm4Moe => glm4_moe::ffn_names(ckpt, layer),
        Arch::DeepseekV3 => deepseek_v3::ffn_names(ckpt, layer),
    }
}

/// How an architecture names the feed-forward block of a layer.
pub struct FfnNames {
    /// Under `model.layers.{i}.`: `mlp` or `block_sparse_moe`.
    pub block: &'static str,
    /// Router tensor under the block (`gate`).
    pub router: &'static str,
    /// Gate, up and down projections of an expert (or dense MLP).
    pub projections: [&'static str; 3],
    /// Shared expert under the block, if the architecture has one, and its sigmoid gate,
    /// if it has one.
    pub shared: Option<(&'static str, Option<&'static str>)>,
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

/// The kinds of tensor a MoE checkpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// Token embedding.
    Embedding,
    /// Output projection.
    LmHead,
    /// q, k, v, o projections and their biases.
    Attention,
    /// RMSNorm weights (layer, q/k and final norms).
    Norm,
    /// Router (and shared-expert gate) weights.
    Router,
    /// Routed experts.
    RoutedExperts,
    /// Shared experts.
    SharedExperts,
    /// Dense MLPs of non-MoE layers.
    DenseMlp,
    /// Anything else.
    Other,
}

/// Classifies a checkpoint tensor by its name.
pub fn classify(name: &str) -> TensorKind {
    if name.contains("embed_tokens") {
        TensorKind::Embedding
    } else if name.starts_with("lm_head") {
        TensorKind::LmHead
    } else if name.contains("norm") {
        TensorKind::Norm
    } else if name.contains("self_attn") {
        TensorKind::Attention
    } else if name.contains("shared_expert_gate")
        || name.ends_with("mlp.gate.weight")
        || name.ends_with("mlp.gate.e_score_correction_bias")
        || name.ends_with("block_sparse_moe.gate.weight")
    {
        TensorKind::Router
    } else if name.contains("shared_expert") {
        TensorKind::SharedExperts
    } else if name.contains(".experts.") {
        TensorKind::RoutedExperts
    } else if name.contains(".mlp.") {
        TensorKind::DenseMlp
    } else {
        TensorKind::Other
    }
}

/// Whether tensor `name` of shape `shape` is a dense linear weight: an attention
/// projection, a shared expert's or a dense MLP's matrix. These are what a model's dense
/// codec applies to; embeddings, the LM head, routers and norms keep their precision.
pub fn is_dense_linear(name: &str, shape: &[usize]) -> bool {
    matches!(
        classify(name),
        TensorKind::Attention | TensorKind::SharedExperts | TensorKind::DenseMlp
    ) && shape.len() == 2
}

/// The decoder layer a tensor belongs to (`model.layers.{i}.…`), if any.
pub fn layer_of(name: &str) -> Option<usize> {
    let rest = name.split("layers.").nth(1)?;
    rest.split('.').next()?.parse().ok()
}

/// A group of tensors outside the routed experts that takes one codec: the token
/// embeddings, an untied LM head, or the dense linear weights of one decoder layer
/// (attention projections, shared expert, dense MLP). Routers and norms belong to none:
/// they stay as the checkpoint has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CodedGroup {
    /// `model.embed_tokens.weight` (also the LM head when they are tied).
    Embedding,
    /// An untied `lm_head.weight`.
    Head,
    /// The dense linear weights of decoder layer `.0`.
    Dense(usize),
}

impl CodedGroup {
    /// The group of tensor `name` of shape `shape` in a model of configuration `config`.
    pub fn of(name: &str, shape: &[usize], config: &Config) -> Option<CodedGroup> {
        if shape.len() != 2 {
            return None;
        }
        // Latent attention's projections are laid out at load from the checkpoint's
        // values (`model::mla`): they stay at its precision, as routers do.
        if config.mla.is_some() && classify(name) == TensorKind::Attention {
            return None;
        }
        let tied = config.tie_word_embeddings;
        match classify(name) {
            TensorKind::Embedding => Some(CodedGroup::Embedding),
            TensorKind::LmHead if !tied => Some(CodedGroup::Head),
            _ if is_dense_linear(name, shape) => layer_of(name).map(CodedGroup::Dense),
            _ => None,
        }
    }
}

impl std::fmt::Display for CodedGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CodedGroup::Embedding => f.write_str("embedding"),
            CodedGroup::Head => f.write_str("lm_head"),
            CodedGroup::Dense(l) => write!(f, "layers.{l}.dense"),
        }
    }
}

// As its name, so that a map from groups is a JSON object (`plan.json`'s `groups`).
impl Serialize for CodedGroup {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for CodedGroup {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<CodedGroup, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for CodedGroup {
    type Err = String;
    fn from_str(s: &str) -> Result<CodedGroup, String> {
        let layer = s
            .strip_prefix("layers.")
            .and_then(|r| r.strip_suffix(".dense"))
            .and_then(|l| l.parse().ok());
        match (s, layer) {
            ("embedding", _) => Ok(CodedGroup::Embedding),
            ("lm_head", _) => Ok(CodedGroup::Head),
            (_, Some(l)) => Ok(CodedGroup::Dense(l)),
            _ => Err(format!(
                "{s:?} is not a tensor group (embedding, lm_head or layers.N.dense)"
            )),
        }
    }
}
