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
    /// DeepSeek-V3 (Kimi-K2 alike): multi-head latent attention with YaRN, and GLM-4.5's
    /// leading dense layers, shared expert and grouped sigmoid router.
    DeepseekV3 {
        /// Dense layers before the first MoE layer (`first_k_dense_replace`).
        leading_dense: usize,
        /// Width of their MLPs (`intermediate_size`).
        dense_intermediate: usize,
        /// Expert groups (`n_group`) and the groups a token's experts come from.
        groups: [usize; 2],
        /// `routed_scaling_factor`.
        scale: f64,
        /// The latent attention's widths.
        mla: MlaShape,
        /// YaRN: factor, original context, beta_fast, beta_slow.
        yarn: [f64; 4],
    },
}

/// The widths of multi-head latent attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaShape {
    /// `q_lora_rank`.
    pub q_lora: usize,
    /// `kv_lora_rank`.
    pub kv_lora: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim`.
    pub rope: usize,
    /// `v_head_dim`.
    pub v: usize,
}

/// DeepSeek-V3's and Kimi-K2's latent attention.
const DEEPSEEK_MLA: MlaShape = MlaShape {
    q_lora: 1536,
    kv_lora: 512,
    nope: 128,
    rope: 64,
    v: 128,
};

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
pub const SHAPES: [Shape; 7] = [
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
    Shape {
        name: "deepseek-v3",
        family: Family::DeepseekV3 {
            leading_dense: 3,
            dense_intermediate: 18432,
            groups: [8, 4],
            scale: 2.5,
            mla: DEEPSEEK_MLA,
            yarn: [40.0, 4096.0, 32.0, 1.0],
        },
        hidden: 7168,
        moe_intermediate: 2048,
        layers: 61,
        heads: 128,
        kv_heads: 128,
        head_dim: 192,
        experts: 256,
        top_k: 8,
        vocab: 129280,
        rope_theta: 10000.0,
    },
    Shape {
        name: "kimi-k2",
        family: Family::DeepseekV3 {
            leading_dense: 1,
            dense_intermediate: 18432,
            groups: [1, 1],
            scale: 2.827,
            mla: DEEPSEEK_MLA,
            yarn: [32.0, 4096.0, 1.0, 1.0],
        },
        hidden: 7168,
        moe_intermediate: 2048,
        layers: 61,
        heads: 64,
        kv_heads: 64,
        head_dim: 192,
        experts: 384,
        top_k: 8,
        vocab: 163840,
        rope_theta: 50000.0,
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
            Family::DeepseekV3 { .. } => "deepseek_v3",
        }
    }

    /// The first MoE layer: every later one is one too.
    fn first_moe_layer(&self) -> usize {
        match self.family {
            Family::Qwen3Moe => 0,
            Family::Glm4Moe { leading_dense, .. } | Family::DeepseekV3 { leading_dense, .. } => {
                leading_dense
            }
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
            Family::DeepseekV3 {
                leading_dense,
                dense_intermediate,
                groups,
                scale,
                mla,
                yarn,
            } => serde_json::json!({
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "attention_bias": false,
                "first_k_dense_replace": leading_dense,
                "intermediate_size": dense_intermediate,
                "kv_lora_rank": mla.kv_lora,
                "max_position_embeddings": 163840,
                "n_group": groups[0],
                "n_routed_experts": self.experts,
                "n_shared_experts": 1,
                "q_lora_rank": mla.q_lora,
                "qk_nope_head_dim": mla.nope,
                "qk_rope_head_dim": mla.rope,
                "rms_norm_eps": 1e-6,
                "rope_interleave": true,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": yarn[0],
                    "original_max_position_embeddings": yarn[1],
                    "beta_fast": yarn[2],
                    "beta_slow": yarn[3],
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                },
                "routed_scaling_factor": scale,
                "topk_group": groups[1],
                "v_head_dim": mla.v,
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
        ];
        let a = format!("{p}.self_attn");
        match self.family {
            Family::DeepseekV3 { mla: m, .. } => t.extend([
                (format!("{a}.q_a_proj.weight"), vec![m.q_lora, h]),
                (format!("{a}.q_a_layernorm.weight"), vec![m.q_lora]),
                (
                    format!("{a}.q_b_proj.weight"),
                    vec![self.heads * (m.nope + m.rope), m.q_lora],
                ),
                (
                    format!("{a}.kv_a_proj_with_mqa.weight"),
                    vec![m.kv_lora + m.rope, h],
                ),
                (format!("{a}.kv_a_layernorm.weight"), vec![m.kv_lora]),
                (
                    format!("{a}.kv_b_proj.weight"),
                    vec![self.heads * (m.nope + m.v), m.kv_lora],
                ),
                (format!("{a}.o_proj.weight"), vec![h, self.heads * m.v]),
            ]),
            _ => t.extend([
                (format!("{a}.q_proj.weight"), vec![q, h]),
                (format!("{a}.k_proj.weight"), vec![kv, h]),
                (format!("{a}.v_proj.weight"), vec![kv, h]),
                (format!("{a}.o_proj.weight"), vec![h, q]),
            ]),
        }
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
            Family::Glm4Moe { qk_norm, .. } => {
                for (proj, width) in [("q", q), ("k", kv), ("v", kv)] {
                    t.push((format!("{p}.self_attn.{proj}_proj.bias"), vec![width]));
                }
                if qk_norm {
                    t.extend(head_norms);
                }
            }
            Family::DeepseekV3 { .. } => {}
        }
        // GLM-4.5's and DeepSeek-V3's feed-forward blocks.
        let (leading_dense, dense_intermediate, shared_experts) = match self.family {
            Family::Qwen3Moe => return t,
            Family::Glm4Moe {
                leading_dense,
                dense_intermediate,
                shared_experts,
                ..
            } => (leading_dense, dense_intermediate, shared_experts),
            Family::DeepseekV3 {
                leading_dense,
                dense_intermediate,
                ..
            } => (leading_dense, dense_intermediate, 1),
        };
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
        t
    }
}
