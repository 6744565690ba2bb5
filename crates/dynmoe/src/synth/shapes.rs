//! The published models `--like` names: their shapes, as their `config.json` files give
//! them, and the tensors a checkpoint of each holds.

use std::path::PathBuf;

use crate::model::Error;

/// What an architecture's layers hold besides attention and the routed experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Family {
    /// Qwen3-MoE: per-head q/k norms, a softmax router, every layer a MoE layer.
    Qwen3Moe,
    /// GLM-4.5: leading dense layers, shared experts beside the routed ones, the grouped
    /// sigmoid router (one group) with its correction bias, q/k/v bias, rotary over half
    /// of each head.
    Glm4Moe {
        /// Dense layers before the first MoE layer (`first_k_dense_replace`).
        leading_dense: usize,
        /// Width of their MLPs (`intermediate_size`).
        dense_intermediate: usize,
        /// Shared experts per MoE layer, each as wide as a routed one.
        shared_experts: usize,
        /// `routed_scaling_factor`.
        scale: f64,
        /// Per-head q/k RMSNorm (`use_qk_norm`).
        qk_norm: bool,
    },
}

/// The shape of a published model.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Name as given to `--like`.
    pub name: &'static str,
    /// Architecture and what it adds.
    pub family: Family,
    /// Residual width.
    pub hidden: usize,
    /// Width of each routed expert.
    pub moe_intermediate: usize,
    /// Decoder layers of the full model.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// RoPE base.
    pub rope_theta: f64,
}

/// The shapes `--like` knows, from the models' published configs.
pub const SHAPES: [Shape; 5] = [
    Shape {
        name: "qwen3-30b-a3b",
        family: Family::Qwen3Moe,
        hidden: 2048,
        moe_intermediate: 768,
        layers: 48,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        experts: 128,
        top_k: 8,
        vocab: 151936,
        rope_theta: 1e6,
    },
    Shape {
        name: "qwen3-235b-a22b",
        family: Family::Qwen3Moe,
        hidden: 4096,
        moe_intermediate: 1536,
        layers: 94,
        heads: 64,
        kv_heads: 4,
        head_dim: 128,
        experts: 128,
        top_k: 8,
        vocab: 151936,
        rope_theta: 1e6,
    },
    Shape {
        name: "qwen3-coder-480b-a35b",
        family: Family::Qwen3Moe,
        hidden: 6144,
        moe_intermediate: 2560,
        layers: 62,
        heads: 96,
        kv_heads: 8,
        head_dim: 128,
        experts: 160,
        top_k: 8,
        vocab: 151936,
        rope_theta: 1e7,
    },
    Shape {
        name: "glm-4.5",
        family: Family::Glm4Moe {
            leading_dense: 3,
            dense_intermediate: 12288,
            shared_experts: 1,
            scale: 2.5,
            qk_norm: true,
        },
        hidden: 5120,
        moe_intermediate: 1536,
        layers: 92,
        heads: 96,
        kv_heads: 8,
        head_dim: 128,
        experts: 160,
        top_k: 8,
        vocab: 151552,
        rope_theta: 1e6,
    },
    Shape {
        name: "glm-4.5-air",
        family: Family::Glm4Moe {
            leading_dense: 1,
            dense_intermediate: 10944,
            shared_experts: 1,
            scale: 1.0,
            qk_norm: false,
        },
        hidden: 4096,
        moe_intermediate: 1408,
        layers: 46,
        heads: 96,
        kv_heads: 8,
        head_dim: 128,
        experts: 128,
        top_k: 8,
        vocab: 151552,
        rope_theta: 1e6,
    },
];

/// The shape called `name`.
pub fn shape(name: &str) -> Result<Shape, Error> {
    SHAPES
        .iter()
        .find(|s| s.name == name)
        .copied()
        .ok_or_else(|| {
            crate::checkpoint::Error::InvalidField {
                path: PathBuf::from(name),
                field: "like".into(),
                reason: format!(
                    "no model shape {name:?}; known: {}",
                    SHAPES.map(|s| s.name).join(", ")
                ),
            }
            .into()
        })
}

impl Shape {
    /// The `model_type` of its `config.json`.
    pub fn model_type(&self) -> &'static str {
        match self.family {
            Family::Qwen3Moe => "qwen3_moe",
            Family::Glm4Moe { .. } => "glm4_moe",
        }
    }

    /// The first MoE layer: every later one is one too.
    fn first_moe_layer(&self) -> usize {
        match self.family {
            Family::Qwen3Moe => 0,
            Family::Glm4Moe { leading_dense, .. } => leading_dense,
        }
    }

    /// The MoE layers of its first `layers` decoder layers.
    pub fn moe_layers(&self, layers: usize) -> Vec<usize> {
        (self.first_moe_layer().min(layers)..layers).collect()
    }

    /// `config.json` of this shape with `layers` decoder layers.
    pub fn config_json(&self, layers: usize) -> serde_json::Value {
        let common = serde_json::json!({
            "eos_token_id": 0,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "moe_intermediate_size": self.moe_intermediate,
            "norm_topk_prob": true,
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "vocab_size": self.vocab,
        });
        let own = match self.family {
            Family::Qwen3Moe => serde_json::json!({
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "attention_bias": false,
                "decoder_sparse_step": 1,
                "intermediate_size": 3 * self.hidden,
                "max_position_embeddings": 40960,
                "mlp_only_layers": [],
                "num_experts": self.experts,
                "rms_norm_eps": 1e-6,
                "sliding_window": null,
                "use_sliding_window": false,
            }),
            Family::Glm4Moe {
                leading_dense,
                dense_intermediate,
                shared_experts,
                scale,
                qk_norm,
            } => serde_json::json!({
                "architectures": ["Glm4MoeForCausalLM"],
                "model_type": "glm4_moe",
                "attention_bias": true,
                "first_k_dense_replace": leading_dense,
                "intermediate_size": dense_intermediate,
                "max_position_embeddings": 131072,
                "n_group": 1,
                "n_routed_experts": self.experts,
                "n_shared_experts": shared_experts,
                "partial_rotary_factor": 0.5,
                "rms_norm_eps": 1e-5,
                "routed_scaling_factor": scale,
                "topk_group": 1,
                "use_qk_norm": qk_norm,
            }),
        };
        let mut config = common;
        let map = config.as_object_mut().expect("an object");
        map.extend(own.as_object().expect("an object").clone());
        config
    }

    /// The tensors of decoder layer `l`, or of the rest (`None`), with their shapes.
    pub(super) fn tensors(&self, l: Option<usize>) -> Vec<(String, Vec<usize>)> {
        let mut t = self.dense_tensors(l);
        if let Some(l) = l.filter(|&l| l >= self.first_moe_layer()) {
            let (h, i) = (self.hidden, self.moe_intermediate);
            let p = format!("model.layers.{l}.mlp.experts");
            for e in 0..self.experts {
                t.push((format!("{p}.{e}.gate_proj.weight"), vec![i, h]));
                t.push((format!("{p}.{e}.up_proj.weight"), vec![i, h]));
                t.push((format!("{p}.{e}.down_proj.weight"), vec![h, i]));
            }
        }
        t
    }

    /// The tensors of decoder layer `l`, or of the rest (`None`), that are not routed
    /// experts, with their shapes.
    pub(super) fn dense_tensors(&self, l: Option<usize>) -> Vec<(String, Vec<usize>)> {
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        let Some(l) = l else {
            return vec![
                ("model.embed_tokens.weight".into(), vec![self.vocab, h]),
                ("model.norm.weight".into(), vec![h]),
                ("lm_head.weight".into(), vec![self.vocab, h]),
            ];
        };
        let p = format!("model.layers.{l}");
        let mut t = vec![
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
        ];
        let head_norms = [
            (format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]),
            (format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]),
        ];
        let mlp = |prefix: String, width: usize| {
            [
                (format!("{prefix}.gate_proj.weight"), vec![width, h]),
                (format!("{prefix}.up_proj.weight"), vec![width, h]),
                (format!("{prefix}.down_proj.weight"), vec![h, width]),
            ]
        };
        match self.family {
            Family::Qwen3Moe => {
                t.extend(head_norms);
                t.push((format!("{p}.mlp.gate.weight"), vec![self.experts, h]));
            }
            Family::Glm4Moe {
                leading_dense,
                dense_intermediate,
                shared_experts,
                qk_norm,
                ..
            } => {
                for (proj, width) in [("q", q), ("k", kv), ("v", kv)] {
                    t.push((format!("{p}.self_attn.{proj}_proj.bias"), vec![width]));
                }
                if qk_norm {
                    t.extend(head_norms);
                }
                if l < leading_dense {
                    t.extend(mlp(format!("{p}.mlp"), dense_intermediate));
                } else {
                    t.push((format!("{p}.mlp.gate.weight"), vec![self.experts, h]));
                    t.push((
                        format!("{p}.mlp.gate.e_score_correction_bias"),
                        vec![self.experts],
                    ));
                    let width = shared_experts * self.moe_intermediate;
                    t.extend(mlp(format!("{p}.mlp.shared_experts"), width));
                }
            }
        }
        t
    }
}
