//! Model configuration, read in two steps: a raw serde view of `config.json` that
//! tolerates both transformers 4.x and 5.x field styles and unknown keys, resolved
//! into a [`Config`] with no optional fields and every architecture default applied.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::Error;

/// The architectures dynmoe runs, one per `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// Qwen3-MoE: per-head q/k RMSNorm, softmax router, no shared expert.
    Qwen3Moe,
    /// Qwen2-MoE: qkv bias, a shared expert behind a sigmoid gate.
    Qwen2Moe,
    /// Mixtral: top-k over softmax, always renormalised.
    Mixtral,
    /// OLMoE: q/k RMSNorm over the whole projection, optional qkv clipping.
    Olmoe,
    /// GLM-4.5: DeepSeek-V3's grouped sigmoid router, a shared expert, leading dense
    /// layers, partial rotary, q/k/v bias, optional per-head q/k norms.
    Glm4Moe,
    /// DeepSeek-V3 (and Kimi-K2): multi-head latent attention with YaRN, and GLM-4.5's
    /// router, shared experts and leading dense layers.
    DeepseekV3,
}

impl Arch {
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Mixtral => "mixtral",
            Arch::Olmoe => "olmoe",
            Arch::Glm4Moe => "glm4_moe",
            Arch::DeepseekV3 => "deepseek_v3",
        }
    }
}

/// Where q/k normalisation sits, if anywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// No normalisation of queries and keys.
    None,
    /// RMSNorm over each head's `head_dim` values (Qwen3).
    PerHead,
    /// RMSNorm over the whole q (or k) projection before it is split into heads (OLMoE).
    Whole,
}

/// How router logits become expert weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Router {
    /// Softmax over all experts, top-k of the probabilities, optionally renormalised over
    /// the k chosen. Mixtral is the renormalised case.
    SoftmaxTopK {
        /// Divide the k chosen probabilities by their sum.
        renormalize: bool,
    },
    /// DeepSeek-V3's router (GLM-4.5's too): each expert scores `sigmoid(logit)`; a
    /// per-layer correction bias is added for the choice only; the experts fall in
    /// `groups` equal groups, each scored by the sum of its two best, and the top-k are
    /// chosen within the `top_groups` best groups. The weights are the chosen scores
    /// without the bias, optionally divided by their sum, times `scale`.
    SigmoidGroups {
        /// Equal groups the experts fall in (`n_group`).
        groups: usize,
        /// Groups a token's experts may come from (`topk_group`).
        top_groups: usize,
        /// Divide the chosen scores by their sum (`norm_topk_prob`).
        renormalize: bool,
        /// Multiplies every weight (`routed_scaling_factor`).
        scale: f32,
    },
}

/// The feed-forward block of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    /// A dense SwiGLU MLP of this width.
    Dense {
        /// Width of its hidden layer.
        intermediate: usize,
    },
    /// A routed mixture of experts (see [`MoeConfig`]).
    Moe,
}

/// One decoder layer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerConfig {
    /// Dense MLP or mixture of experts.
    pub ffn: FfnKind,
    /// Keys further back than this many positions are not attended to.
    pub sliding_window: Option<usize>,
}

/// The routed experts, shared by every MoE layer of the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Width of one routed expert's hidden layer.
    pub expert_intermediate: usize,
    /// Router semantics.
    pub router: Router,
    /// Width of the shared expert, if the architecture has one.
    pub shared_expert_intermediate: Option<usize>,
}

/// Rotary position embedding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Base of the inverse frequencies.
    pub theta: f32,
    /// Positions are divided by this factor ("linear" scaling); 1 for none.
    pub linear_factor: f32,
    /// Leading values of each head that rotate (`head_dim · partial_rotary_factor`); the
    /// rest pass through. Equal to `head_dim` but for partial rotary (GLM-4.5) and
    /// latent attention (`qk_rope_head_dim`).
    pub rotary_dim: usize,
    /// YaRN's frequency scaling (DeepSeek-V3), if configured.
    pub yarn: Option<Yarn>,
}

/// YaRN rotary scaling, as transformers parameterises it (`rope_type: "yarn"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Context extension factor.
    pub factor: f64,
    /// The context the model was pretrained at.
    pub original_max_position_embeddings: f64,
    /// Rotations beyond which frequencies are kept (extrapolated).
    pub beta_fast: f64,
    /// Rotations below which frequencies are divided by `factor` (interpolated).
    pub beta_slow: f64,
    /// Numerator of the rotary dims' scaling, with `mscale_all_dim`.
    pub mscale: Option<f64>,
    /// Scales every q·k product by `mscale(factor, mscale_all_dim)²` (latent attention).
    pub mscale_all_dim: Option<f64>,
    /// The rotary dims' scaling when given outright.
    pub attention_factor: Option<f64>,
    /// Round the correction range outwards.
    pub truncate: bool,
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): queries from a low-rank path,
/// keys and values expanded per head from one shared latent, and one rotary key shared
/// by every head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    /// Width of q's low-rank path (`q_a_proj`), or `None` for a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the shared latent (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Values of each q/k head without position (`qk_nope_head_dim`).
    pub qk_nope_head_dim: usize,
    /// Values of each q/k head that rotate (`qk_rope_head_dim`).
    pub qk_rope_head_dim: usize,
    /// Values of each value head (`v_head_dim`).
    pub v_head_dim: usize,
    /// The rotary values come in interleaved pairs `(x0, x1), (x2, x3), …`.
    pub interleaved: bool,
}

/// A resolved configuration: every field present, every default applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Architecture, from `model_type`.
    pub arch: Arch,
    /// Token vocabulary (rows of the embedding and LM head).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one attention head; may differ from `hidden_size / num_heads`.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Rotary embedding.
    pub rope: RopeConfig,
    /// Longest context the model was built for.
    pub max_position_embeddings: usize,
    /// The LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q, k and v projections carry a bias.
    pub qkv_bias: bool,
    /// The output projection carries a bias.
    pub o_bias: bool,
    /// q/k normalisation.
    pub qk_norm: QkNorm,
    /// Queries, keys and values are clamped to ±this (OLMoE).
    pub clip_qkv: Option<f32>,
    /// Per layer: dense or MoE, sliding window.
    pub layers: Vec<LayerConfig>,
    /// Multi-head latent attention, for DeepSeek-V3. It runs over a latent cache of one
    /// key head (`model::mla`): `head_dim` is then `kv_lora_rank + qk_rope_head_dim`
    /// and `num_kv_heads` is 1.
    pub mla: Option<MlaConfig>,
    /// The experts.
    pub moe: MoeConfig,
    /// Storage dtype named by the checkpoint (`bfloat16`, `float16`, `float32`).
    pub dtype: String,
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
}

impl Config {
    /// Layers whose feed-forward block is a mixture of experts.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.ffn == FfnKind::Moe)
            .map(|(i, _)| i)
    }

    /// Width of the query projection (`num_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key and value projections (`num_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of KV cache a position takes: f32 keys and values of every layer.
    pub fn kv_cache_bytes_per_position(&self) -> usize {
        2 * self.layers.len() * self.kv_dim() * size_of::<f32>()
    }

    /// For latent attention, what a position would take with each head's key and value
    /// expanded from the latent, as transformers caches them after expanding (f32 too).
    pub fn expanded_kv_bytes_per_position(&self) -> Option<usize> {
        let m = self.mla?;
        let per_head = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim;
        Some(self.layers.len() * self.num_heads * per_head * size_of::<f32>())
    }

    /// Reads and resolves `config.json`.
    pub fn from_file(path: &Path) -> Result<Config, Error> {
        let bytes = super::read_regular(path)?;
        let text = String::from_utf8(bytes).map_err(|e| Error::Json {
            path: path.to_path_buf(),
            reason: format!("not UTF-8: {e}"),
        })?;
        Config::from_json(&text, path)
    }

    /// Resolves a `config.json` text; `path` only names the file in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Config, Error> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| match field_at(text, e.line(), e.column()) {
                Some(field) if e.is_data() => Error::InvalidField {
                    path: path.to_path_buf(),
                    field,
                    reason: e.to_string(),
                },
                _ => Error::Json {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                },
            })?;
        raw.resolve(path)
    }
}

/// The largest value a size field of `config.json` may have: well above every published
/// model (Qwen3-Coder-480B: 62 layers, 6144 wide, 160 experts, vocabulary 151 936,
/// 262 144 positions), small enough that nothing sized from it fails to allocate before
/// the checkpoint's own shapes are checked against it.
fn max_size(field: &str) -> usize {
    match field {
        "num_hidden_layers" => 4096,
        "num_attention_heads" | "num_key_value_heads" | "head_dim" => 4096,
        "num_experts" | "num_experts_per_tok" => 1 << 16,
        "vocab_size" => 1 << 24,
        "max_position_embeddings" => 1 << 24,
        // hidden_size and the MLP widths.
        _ => 1 << 20,
    }
}

/// The JSON key whose value a serde error points into: the last `"key":` before the
/// error's line and column. serde reports positions, not field names.
fn field_at(text: &str, line: usize, column: usize) -> Option<String> {
    let row = text.lines().nth(line.checked_sub(1)?)?;
    let before = row.get(..column.min(row.len()))?;
    let colon = before.rfind("\":")?;
    let open = before[..colon].rfind('"')?;
    Some(before[open + 1..colon].to_string())
}

/// `config.json` as written by transformers 4.x or 5.x, every field optional.
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    hidden_act: Option<String>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    tie_word_embeddings: Option<bool>,
    // 4.x: top-level rope_theta and rope_scaling; 5.x: rope_parameters.
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    attention_bias: Option<bool>,
    qkv_bias: Option<bool>,
    clip_qkv: Option<f64>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    num_experts_per_tok: Option<usize>,
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    norm_topk_prob: Option<bool>,
    // DeepSeek-V3 and GLM-4.5.
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    first_k_dense_replace: Option<usize>,
    routed_scaling_factor: Option<f64>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    use_qk_norm: Option<bool>,
    // DeepSeek-V3's latent attention.
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_interleave: Option<bool>,
    // 4.x: top level; 5.x: in rope_parameters.
    partial_rotary_factor: Option<f64>,
    // 4.x: torch_dtype; 5.x: dtype.
    torch_dtype: Option<String>,
    dtype: Option<String>,
    eos_token_id: Option<Value>,
}

/// Per-architecture defaults, as transformers' config classes define them.
struct Defaults {
    rms_norm_eps: f64,
    rope_theta: f64,
    norm_topk_prob: bool,
    qkv_bias: bool,
}

fn defaults(arch: Arch) -> Defaults {
    match arch {
        Arch::Qwen3Moe => Defaults {
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            norm_topk_prob: false,
            qkv_bias: false,
        },
        Arch::Qwen2Moe => Defaults {
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            norm_topk_prob: false,
            qkv_bias: true,
        },
        Arch::Mixtral => Defaults {
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            norm_topk_prob: true,
            qkv_bias: false,
        },
        Arch::Olmoe => Defaults {
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            norm_topk_prob: false,
            qkv_bias: false,
        },
        Arch::Glm4Moe => Defaults {
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            norm_topk_prob: true,
            qkv_bias: false,
        },
        Arch::DeepseekV3 => Defaults {
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            norm_topk_prob: true,
            qkv_bias: false,
        },
    }
}

impl RawConfig {
    fn resolve(self, path: &Path) -> Result<Config, Error> {
        let missing = |field: &str| Error::MissingField {
            path: path.to_path_buf(),
            field: field.to_string(),
        };
        let invalid = |field: &str, reason: String| Error::InvalidField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };

        let model_type = self
            .model_type
            .clone()
            .ok_or_else(|| missing("model_type"))?;
        let arch = match model_type.as_str() {
            "qwen3_moe" => Arch::Qwen3Moe,
            "qwen2_moe" => Arch::Qwen2Moe,
            "mixtral" => Arch::Mixtral,
            "olmoe" => Arch::Olmoe,
            "glm4_moe" => Arch::Glm4Moe,
            "deepseek_v3" => Arch::DeepseekV3,
            _ => {
                return Err(Error::UnsupportedArch {
                    path: path.to_path_buf(),
                    model_type,
                })
            }
        };
        let d = defaults(arch);

        // Sizes are bounded before anything is allocated from them: a mistyped size
        // is an error naming the field, not a failed allocation that aborts.
        let positive = |value: Option<usize>, field: &str| -> Result<usize, Error> {
            match value {
                None => Err(missing(field)),
                Some(0) => Err(invalid(field, "must be positive".into())),
                Some(v) if v > max_size(field) => Err(invalid(
                    field,
                    format!(
                        "{v} is beyond what any model has (at most {})",
                        max_size(field)
                    ),
                )),
                Some(v) => Ok(v),
            }
        };
        let vocab_size = positive(self.vocab_size, "vocab_size")?;
        let hidden_size = positive(self.hidden_size, "hidden_size")?;
        let num_layers = positive(self.num_hidden_layers, "num_hidden_layers")?;
        let num_heads = positive(self.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = positive(
            self.num_key_value_heads.or(Some(num_heads)),
            "num_key_value_heads",
        )?;
        if num_heads % num_kv_heads != 0 {
            return Err(invalid(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads = {num_heads}"),
            ));
        }
        let mla = match arch {
            Arch::DeepseekV3 => Some(MlaConfig {
                q_lora_rank: match self.q_lora_rank {
                    None => None,
                    r => Some(positive(r, "q_lora_rank")?),
                },
                kv_lora_rank: positive(self.kv_lora_rank, "kv_lora_rank")?,
                qk_nope_head_dim: positive(self.qk_nope_head_dim, "qk_nope_head_dim")?,
                qk_rope_head_dim: positive(self.qk_rope_head_dim, "qk_rope_head_dim")?,
                v_head_dim: positive(self.v_head_dim, "v_head_dim")?,
                interleaved: self.rope_interleave.unwrap_or(true),
            }),
            _ => None,
        };
        if let Some(m) = &mla {
            // transformers expands the latent into one key and one value per query head.
            if num_kv_heads != num_heads {
                return Err(invalid(
                    "num_key_value_heads",
                    format!("{num_kv_heads}: latent attention expands one key per query head, {num_heads}"),
                ));
            }
            if m.qk_rope_head_dim % 2 != 0 {
                return Err(invalid(
                    "qk_rope_head_dim",
                    format!(
                        "{} is odd; rotary embedding needs pairs",
                        m.qk_rope_head_dim
                    ),
                ));
            }
            if self.attention_bias.unwrap_or(false) {
                return Err(invalid(
                    "attention_bias",
                    "latent attention with biases is not supported (DeepSeek-V3 and Kimi-K2 have none)".into(),
                ));
            }
        }
        // Latent attention runs as multi-query attention over its latent cache
        // (`model::mla`): one key head of the latent and the rotary key, which every
        // query head, as wide, reads.
        let num_kv_heads = if mla.is_some() { 1 } else { num_kv_heads };
        let head_dim = match (self.head_dim, &mla) {
            (_, Some(m)) => m.kv_lora_rank + m.qk_rope_head_dim,
            (Some(h), None) => positive(Some(h), "head_dim")?,
            (None, None) if hidden_size % num_heads == 0 => hidden_size / num_heads,
            (None, None) => {
                return Err(invalid(
                    "head_dim",
                    format!("absent, and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"),
                ))
            }
        };
        if head_dim % 2 != 0 {
            return Err(invalid(
                "head_dim",
                format!("{head_dim} is odd; rotary embedding needs pairs"),
            ));
        }
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(invalid(
                    "hidden_act",
                    format!("{act:?} is not supported (only \"silu\")"),
                ));
            }
        }

        let rotary = mla.map_or(head_dim, |m| m.qk_rope_head_dim);
        let rope = self.resolve_rope(path, d.rope_theta, rotary, arch == Arch::DeepseekV3)?;

        let num_experts = positive(
            match arch {
                Arch::Mixtral => self.num_local_experts.or(self.num_experts),
                Arch::Glm4Moe | Arch::DeepseekV3 => self.n_routed_experts,
                _ => self.num_experts.or(self.num_local_experts),
            },
            "num_experts",
        )?;
        let top_k = positive(self.num_experts_per_tok, "num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(invalid(
                "num_experts_per_tok",
                format!("{top_k} exceeds num_experts = {num_experts}"),
            ));
        }
        let expert_intermediate = match arch {
            // Mixtral's experts are as wide as its (absent) dense MLP.
            Arch::Mixtral | Arch::Olmoe => positive(self.intermediate_size, "intermediate_size")?,
            _ => positive(self.moe_intermediate_size, "moe_intermediate_size")?,
        };
        let renormalize = match arch {
            Arch::Mixtral => true,
            _ => self.norm_topk_prob.unwrap_or(d.norm_topk_prob),
        };
        let shared_expert_intermediate = match arch {
            Arch::Qwen2Moe => Some(positive(
                self.shared_expert_intermediate_size,
                "shared_expert_intermediate_size",
            )?),
            // The shared experts run as one MLP of their summed width.
            Arch::Glm4Moe | Arch::DeepseekV3 => match self.n_shared_experts.unwrap_or(1) {
                0 => None,
                n => Some(positive(
                    expert_intermediate.checked_mul(n),
                    "n_shared_experts",
                )?),
            },
            _ => None,
        };
        let router = match arch {
            Arch::Glm4Moe | Arch::DeepseekV3 => {
                self.sigmoid_router(num_experts, top_k, renormalize, path)?
            }
            _ => Router::SoftmaxTopK { renormalize },
        };

        let layers = self.resolve_layers(arch, num_layers, path)?;

        let dtype = self
            .dtype
            .clone()
            .or(self.torch_dtype.clone())
            .unwrap_or_else(|| "bfloat16".to_string());

        // A token id is a u32 below the vocabulary: 2^32 + 3 is an error, not token 3.
        let token_id = |v: &Value| -> Result<u32, Error> {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|&id| (id as usize) < vocab_size)
                .ok_or_else(|| {
                    invalid(
                        "eos_token_id",
                        format!("{v} is not a token id below vocab_size = {vocab_size}"),
                    )
                })
        };
        let eos_token_ids = match &self.eos_token_id {
            None | Some(Value::Null) => Vec::new(),
            Some(n @ Value::Number(_)) => vec![token_id(n)?],
            Some(Value::Array(items)) => items.iter().map(token_id).collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(invalid("eos_token_id", format!("unexpected value {other}")))
            }
        };
        let rms_norm_eps = self.rms_norm_eps.unwrap_or(d.rms_norm_eps);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0 && (rms_norm_eps as f32) > 0.0) {
            return Err(invalid(
                "rms_norm_eps",
                format!("{rms_norm_eps} is not a positive finite number"),
            ));
        }
        let rms_norm_eps = rms_norm_eps as f32;
        let max_position_embeddings = match self.max_position_embeddings {
            None => 4096,
            Some(n) => positive(Some(n), "max_position_embeddings")?,
        };
        let clip_qkv = match self.clip_qkv {
            Some(c) if !(c.is_finite() && c > 0.0) => {
                return Err(invalid(
                    "clip_qkv",
                    format!("{c} is not a positive finite number"),
                ))
            }
            c => c.map(|c| c as f32),
        };

        let attention_bias = self.attention_bias.unwrap_or(false);
        let qkv_bias = match arch {
            Arch::Qwen2Moe => self.qkv_bias.unwrap_or(d.qkv_bias),
            _ => attention_bias,
        };

        Ok(Config {
            arch,
            vocab_size,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            rope,
            max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias: !matches!(arch, Arch::Qwen2Moe | Arch::Glm4Moe) && attention_bias,
            qk_norm: match arch {
                Arch::Qwen3Moe => QkNorm::PerHead,
                Arch::Olmoe => QkNorm::Whole,
                Arch::Glm4Moe if self.use_qk_norm.unwrap_or(false) => QkNorm::PerHead,
                _ => QkNorm::None,
            },
            clip_qkv: match arch {
                Arch::Olmoe => clip_qkv,
                _ => None,
            },
            layers,
            mla,
            moe: MoeConfig {
                num_experts,
                top_k,
                expert_intermediate,
                router,
                shared_expert_intermediate,
            },
            dtype,
            eos_token_ids,
        })
    }

    /// The grouped sigmoid router of `num_experts` experts choosing `top_k`.
    fn sigmoid_router(
        &self,
        num_experts: usize,
        top_k: usize,
        renormalize: bool,
        path: &Path,
    ) -> Result<Router, Error> {
        let invalid = |field: &str, reason: String| Error::InvalidField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        let groups = self.n_group.unwrap_or(1);
        if groups == 0 || !num_experts.is_multiple_of(groups) || num_experts / groups < 2 {
            return Err(invalid(
                "n_group",
                format!("{groups} groups of {num_experts} experts: each group needs at least two experts and the same count"),
            ));
        }
        let top_groups = self.topk_group.unwrap_or(1);
        if top_groups == 0 || top_groups > groups {
            return Err(invalid(
                "topk_group",
                format!("{top_groups} is not between 1 and n_group = {groups}"),
            ));
        }
        if top_k > top_groups * (num_experts / groups) {
            return Err(invalid(
                "num_experts_per_tok",
                format!("{top_k} exceeds the experts of topk_group = {top_groups} groups"),
            ));
        }
        let scale = self.routed_scaling_factor.unwrap_or(1.0);
        if !(scale.is_finite() && scale > 0.0) {
            return Err(invalid(
                "routed_scaling_factor",
                format!("{scale} is not a positive finite number"),
            ));
        }
        Ok(Router::SigmoidGroups {
            groups,
            top_groups,
            renormalize,
            scale: scale as f32,
        })
    }

    /// The rotary embedding over `head_dim` values of each head (before a partial
    /// factor); YaRN only where `yarn_allowed`, the architectures that fold its scaling
    /// into their weights.
    fn resolve_rope(
        &self,
        path: &Path,
        default_theta: f64,
        head_dim: usize,
        yarn_allowed: bool,
    ) -> Result<RopeConfig, Error> {
        let invalid = |field: &str, reason: String| Error::InvalidField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        // 5.x folds theta and scaling into rope_parameters; 4.x keeps them apart.
        let (params, field) = match (&self.rope_parameters, &self.rope_scaling) {
            (Some(p), _) if !p.is_null() => (Some(p), "rope_parameters"),
            (_, Some(s)) if !s.is_null() => (Some(s), "rope_scaling"),
            _ => (None, "rope_scaling"),
        };
        let mut theta = self.rope_theta.unwrap_or(default_theta);
        let mut linear_factor = 1.0;
        let mut partial = self.partial_rotary_factor;
        let mut yarn = None;
        if let Some(p) = params {
            let obj = p
                .as_object()
                .ok_or_else(|| invalid(field, "expected an object".into()))?;
            if let Some(t) = obj.get("rope_theta") {
                theta = t
                    .as_f64()
                    .ok_or_else(|| invalid(field, "rope_theta is not a number".into()))?;
            }
            if let Some(f) = obj.get("partial_rotary_factor") {
                partial = Some(f.as_f64().ok_or_else(|| {
                    invalid(field, "partial_rotary_factor is not a number".into())
                })?);
            }
            let kind = obj
                .get("rope_type")
                .or_else(|| obj.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            match kind {
                "default" => {}
                "linear" => {
                    linear_factor = obj
                        .get("factor")
                        .and_then(Value::as_f64)
                        .ok_or_else(|| invalid(field, "linear scaling without a factor".into()))?;
                    if !(linear_factor.is_finite() && linear_factor > 0.0) {
                        return Err(invalid(
                            field,
                            format!("factor {linear_factor} is not a positive finite number"),
                        ));
                    }
                }
                "yarn" if yarn_allowed => yarn = Some(yarn_of(obj, self, field, path)?),
                other => {
                    return Err(invalid(
                        field,
                        format!("rope type {other:?} is not supported"),
                    ));
                }
            }
        }
        if !(theta.is_finite() && theta > 0.0 && (theta as f32).is_finite()) {
            return Err(invalid(
                "rope_theta",
                format!("{theta} is not positive and finite"),
            ));
        }
        // As transformers sizes it: int(head_dim · factor), which must leave pairs.
        let rotary_dim = match partial.unwrap_or(1.0) {
            f if f > 0.0 && f <= 1.0 => (head_dim as f64 * f) as usize,
            f => {
                return Err(invalid(
                    "partial_rotary_factor",
                    format!("{f} is not in (0, 1]"),
                ))
            }
        };
        if rotary_dim == 0 || rotary_dim % 2 != 0 {
            return Err(invalid(
                "partial_rotary_factor",
                format!("rotates {rotary_dim} of head_dim {head_dim} values; rotary embedding needs pairs"),
            ));
        }
        Ok(RopeConfig {
            theta: theta as f32,
            linear_factor: linear_factor as f32,
            rotary_dim,
            yarn,
        })
    }

    fn resolve_layers(
        &self,
        arch: Arch,
        num_layers: usize,
        path: &Path,
    ) -> Result<Vec<LayerConfig>, Error> {
        let invalid = |field: &str, reason: String| Error::InvalidField {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason,
        };
        let mlp_only = self.mlp_only_layers.clone().unwrap_or_default();
        let leading_dense = match arch {
            Arch::Glm4Moe => self.first_k_dense_replace.unwrap_or(1),
            Arch::DeepseekV3 => self.first_k_dense_replace.unwrap_or(3),
            _ => 0,
        };
        if let Some(&bad) = mlp_only.iter().find(|&&l| l >= num_layers) {
            return Err(invalid(
                "mlp_only_layers",
                format!("layer {bad} does not exist"),
            ));
        }
        let sparse_step = self.decoder_sparse_step.unwrap_or(1);
        if sparse_step == 0 {
            return Err(invalid("decoder_sparse_step", "must be positive".into()));
        }
        if let Some(types) = &self.layer_types {
            if types.len() != num_layers {
                return Err(invalid(
                    "layer_types",
                    format!("{} entries for {num_layers} layers", types.len()),
                ));
            }
        }
        let window = self.sliding_window;
        (0..num_layers)
            .map(|i| {
                let dense = match arch {
                    Arch::Qwen3Moe | Arch::Qwen2Moe => {
                        mlp_only.contains(&i) || (i + 1) % sparse_step != 0
                    }
                    Arch::Glm4Moe | Arch::DeepseekV3 => i < leading_dense,
                    Arch::Mixtral | Arch::Olmoe => false,
                };
                let ffn = if dense {
                    FfnKind::Dense {
                        intermediate: self.intermediate_size.ok_or_else(|| {
                            Error::MissingField {
                                path: path.to_path_buf(),
                                field: "intermediate_size".into(),
                            }
                        })?,
                    }
                } else {
                    FfnKind::Moe
                };
                let sliding = match (arch, &self.layer_types) {
                    (_, Some(types)) => match types[i].as_str() {
                        "full_attention" => false,
                        "sliding_attention" => true,
                        other => {
                            return Err(invalid(
                                "layer_types",
                                format!("unknown layer type {other:?}"),
                            ))
                        }
                    },
                    (Arch::Mixtral, None) => window.is_some(),
                    (Arch::Qwen3Moe, None) => self.use_sliding_window.unwrap_or(false),
                    (Arch::Qwen2Moe, None) => {
                        self.use_sliding_window.unwrap_or(false)
                            && i >= self.max_window_layers.unwrap_or(28)
                    }
                    (Arch::Olmoe | Arch::Glm4Moe | Arch::DeepseekV3, None) => false,
                };
                let sliding_window = match (sliding, window) {
                    (true, Some(w)) => Some(w),
                    (true, None) => {
                        return Err(invalid(
                            "sliding_window",
                            format!("layer {i} slides but no window is given"),
                        ))
                    }
                    (false, _) => None,
                };
                Ok(LayerConfig {
                    ffn,
                    sliding_window,
                })
            })
            .collect()
    }
}

/// YaRN's parameters from a `rope_scaling` (or `rope_parameters`) object `obj`, with
/// transformers' defaults; `field` names the object in errors.
fn yarn_of(
    obj: &serde_json::Map<String, Value>,
    raw: &RawConfig,
    field: &str,
    path: &Path,
) -> Result<Yarn, Error> {
    let invalid = |reason: String| Error::InvalidField {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason,
    };
    let number = |key: &str| -> Result<Option<f64>, Error> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(invalid(format!("yarn {key} {v} is not a finite number"))),
            },
        }
    };
    let original = number("original_max_position_embeddings")?
        .ok_or_else(|| invalid("yarn without original_max_position_embeddings".into()))?;
    // As transformers: without a factor, the extension the two lengths imply.
    let factor = match number("factor")? {
        Some(f) => f,
        None => raw.max_position_embeddings.unwrap_or(0) as f64 / original,
    };
    if !(factor > 0.0 && original >= 1.0) {
        return Err(invalid(format!(
            "yarn factor {factor} over {original} original positions"
        )));
    }
    Ok(Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: number("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
        beta_slow: number("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
        mscale: number("mscale")?,
        mscale_all_dim: number("mscale_all_dim")?,
        attention_factor: number("attention_factor")?,
        truncate: obj.get("truncate").and_then(Value::as_bool).unwrap_or(true),
    })
}

#[cfg(test)]
mod tests;
