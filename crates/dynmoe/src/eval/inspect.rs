//! Where a model's parameters and bytes are: counts by kind of tensor, bytes by dtype,
//! and the parameters one token activates.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::checkpoint::arch::{classify, TensorKind};
use crate::checkpoint::{Checkpoint, Config};
use crate::model::Error;

/// Parameter and byte accounting of a checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct Inventory {
    /// `model_type`.
    pub arch: String,
    /// Decoder layers.
    pub layers: usize,
    /// Of which mixture-of-experts.
    pub moe_layers: usize,
    /// Routed experts per MoE layer.
    pub experts_per_layer: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Parameters in the checkpoint.
    pub params_total: u64,
    /// Parameters by kind of tensor.
    pub params_by_kind: BTreeMap<TensorKind, u64>,
    /// Bytes on disk by dtype (tensor data only).
    pub bytes_by_dtype: BTreeMap<String, u64>,
    /// Parameters of one routed expert.
    pub params_per_expert: u64,
    /// Parameters one token runs through: everything but the routed experts it skips
    /// (and the embedding, which is a lookup).
    pub params_active_per_token: u64,
    /// Bytes of the checkpoint files.
    pub file_bytes: u64,
    /// Bytes of KV cache one position of context takes (f32, every layer).
    pub kv_cache_bytes_per_position: u64,
    /// For latent attention: the same with each head's key and value expanded.
    pub expanded_kv_bytes_per_position: Option<u64>,
    /// Expert stores of a converted directory (`experts.bin`, `experts3.bin`, `experts2.bin`).
    pub expert_stores: Vec<StoreInfo>,
}

/// One expert store on disk.
#[derive(Debug, Clone, Serialize)]
pub struct StoreInfo {
    /// File name.
    pub file: String,
    /// Bits per code.
    pub bits: u32,
    /// Size of the file.
    pub bytes: u64,
    /// File bytes × 8 per routed expert parameter: codes, scales, biases and padding.
    pub bits_per_weight: f64,
}

/// Counts a checkpoint's parameters and bytes.
pub fn inventory(config: &Config, ckpt: &Checkpoint) -> Result<Inventory, Error> {
    let mut by_kind: BTreeMap<TensorKind, u64> = BTreeMap::new();
    let mut by_dtype: BTreeMap<String, u64> = BTreeMap::new();
    for name in ckpt.names() {
        let info = ckpt.info(name)?;
        let n: u64 = info.shape.iter().map(|&d| d as u64).product();
        *by_kind.entry(classify(name)).or_default() += n;
        *by_dtype.entry(format!("{:?}", info.dtype)).or_default() +=
            n * info.dtype.bitsize() as u64 / 8;
    }
    let moe_layers = config.moe_layers().count();
    let m = &config.moe;
    let per_expert = 3 * (config.hidden_size * m.expert_intermediate) as u64;
    // A converted directory keeps its routed experts in the stores, not the checkpoint.
    let all_experts = (moe_layers * m.num_experts) as u64 * per_expert;
    by_kind
        .entry(TensorKind::RoutedExperts)
        .or_insert(all_experts);
    let total: u64 = by_kind.values().sum();
    let routed = by_kind
        .get(&TensorKind::RoutedExperts)
        .copied()
        .unwrap_or(0);
    let embedding = by_kind.get(&TensorKind::Embedding).copied().unwrap_or(0);
    let lm_head_is_embedding =
        config.tie_word_embeddings && !by_kind.contains_key(&TensorKind::LmHead);
    let active = total - routed + (moe_layers * m.top_k) as u64 * per_expert
        - if lm_head_is_embedding { 0 } else { embedding };
    let file_bytes = ckpt
        .files()
        .map(|p| std::fs::metadata(p).map(|md| md.len()).unwrap_or(0))
        .sum();
    let dir = ckpt
        .files()
        .next()
        .and_then(Path::parent)
        .unwrap_or(Path::new("."));
    let expert_stores = [4, 3, 2]
        .into_iter()
        .filter_map(|bits| {
            let file = crate::store::data_file_name(bits);
            let bytes = std::fs::metadata(dir.join(&file)).ok()?.len();
            Some(StoreInfo {
                file,
                bits,
                bytes,
                bits_per_weight: bytes as f64 * 8.0 / all_experts as f64,
            })
        })
        .collect();
    Ok(Inventory {
        arch: config.arch.model_type().to_string(),
        layers: config.layers.len(),
        moe_layers,
        experts_per_layer: m.num_experts,
        top_k: m.top_k,
        params_total: total,
        params_by_kind: by_kind,
        bytes_by_dtype: by_dtype,
        params_per_expert: per_expert,
        params_active_per_token: active,
        file_bytes,
        kv_cache_bytes_per_position: config.kv_cache_bytes_per_position() as u64,
        expanded_kv_bytes_per_position: config.expanded_kv_bytes_per_position().map(|b| b as u64),
        expert_stores,
    })
}

/// Opens a model directory and counts it.
pub fn inspect_dir(dir: &Path) -> Result<Inventory, Error> {
    let config = Config::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(dir)?;
    inventory(&config, &ckpt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_tensor_names_of_every_architecture() {
        let cases = [
            ("model.embed_tokens.weight", TensorKind::Embedding),
            ("lm_head.weight", TensorKind::LmHead),
            (
                "model.layers.0.self_attn.q_proj.weight",
                TensorKind::Attention,
            ),
            ("model.layers.0.self_attn.q_norm.weight", TensorKind::Norm),
            ("model.layers.0.input_layernorm.weight", TensorKind::Norm),
            ("model.layers.0.mlp.gate.weight", TensorKind::Router),
            (
                "model.layers.0.block_sparse_moe.gate.weight",
                TensorKind::Router,
            ),
            (
                "model.layers.0.mlp.shared_expert_gate.weight",
                TensorKind::Router,
            ),
            (
                "model.layers.0.mlp.experts.3.up_proj.weight",
                TensorKind::RoutedExperts,
            ),
            (
                "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                TensorKind::RoutedExperts,
            ),
            (
                "model.layers.0.mlp.shared_expert.up_proj.weight",
                TensorKind::SharedExperts,
            ),
            ("model.layers.1.mlp.gate_proj.weight", TensorKind::DenseMlp),
        ];
        for (name, kind) in cases {
            assert_eq!(classify(name), kind, "{name}");
        }
    }
}
