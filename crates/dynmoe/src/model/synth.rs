//! Checkpoints with the shapes of published MoE models and random weights, so that
//! speed can be measured on exactly those shapes without downloading them.
//!
//! The directory holds a `config.json` of the named model (its first `layers` layers, if
//! asked), bf16 safetensors in Hugging Face's per-expert layout (one shard per decoder
//! layer plus one for the embedding, final norm and LM head, found through
//! `model.safetensors.index.json`) and a tokenizer copied from another model directory.
//! Weights are uniform with a standard deviation of 0.02 (norms are ones), drawn from a
//! seed, so two runs with the same arguments write the same bytes. Every file is written
//! atomically and the index last.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::bf16;
use rayon::prelude::*;
use safetensors::tensor::{Dtype, TensorView};

use super::Error;
use crate::store::atomic;
use crate::testing::Rng;

/// The shape of a published model.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Name as given to `--like`.
    pub name: &'static str,
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

/// The shapes `--like` knows (Qwen3-MoE, from the models' published configs).
pub const SHAPES: [Shape; 2] = [
    Shape {
        name: "qwen3-30b-a3b",
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
];

/// The shape called `name`.
pub fn shape(name: &str) -> Result<Shape, Error> {
    SHAPES
        .iter()
        .find(|s| s.name == name)
        .copied()
        .ok_or_else(|| Error::InvalidField {
            path: PathBuf::from(name),
            field: "like".into(),
            reason: format!(
                "no model shape {name:?}; known: {}",
                SHAPES.map(|s| s.name).join(", ")
            ),
        })
}

/// What [`synth`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SynthReport {
    /// Output directory.
    pub dir: PathBuf,
    /// Decoder layers written.
    pub layers: usize,
    /// Parameters written.
    pub params: usize,
    /// Bytes of safetensors written.
    pub bytes: usize,
}

impl Shape {
    /// `config.json` of this shape with `layers` decoder layers.
    pub fn config_json(&self, layers: usize) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": false,
            "decoder_sparse_step": 1,
            "eos_token_id": 0,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "intermediate_size": 3 * self.hidden,
            "max_position_embeddings": 40960,
            "mlp_only_layers": [],
            "moe_intermediate_size": self.moe_intermediate,
            "norm_topk_prob": true,
            "num_attention_heads": self.heads,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_sliding_window": false,
            "vocab_size": self.vocab,
        })
    }

    /// The tensors of decoder layer `l`, or of the rest (`None`), with their shapes.
    fn tensors(&self, l: Option<usize>) -> Vec<(String, Vec<usize>)> {
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
            (format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]),
            (format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]),
            (format!("{p}.mlp.gate.weight"), vec![self.experts, h]),
        ];
        let i = self.moe_intermediate;
        for e in 0..self.experts {
            t.push((format!("{p}.mlp.experts.{e}.gate_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.experts.{e}.up_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.experts.{e}.down_proj.weight"), vec![h, i]));
        }
        t
    }
}

/// bf16 little-endian bytes of tensor `name`: ones for norms, else uniform with
/// standard deviation 0.02 from a generator seeded by `seed` and the name.
fn tensor_bytes(name: &str, n: usize, seed: u64) -> Vec<u8> {
    if name.ends_with("norm.weight") {
        return bf16::ONE.to_le_bytes().repeat(n);
    }
    let salt = name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut rng = Rng::seeded(salt);
    let half_width = 0.02 * 3f32.sqrt();
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        let v = (2.0 * rng.uniform() - 1.0) * half_width;
        out.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
    }
    out
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a random checkpoint of `shape` with its first `layers` layers (all if `None`)
/// into `out`, with the tokenizer files of `tokenizer_dir`. `progress(done, total)`
/// counts shards.
pub fn synth(
    shape: &Shape,
    layers: Option<usize>,
    tokenizer_dir: &Path,
    out: &Path,
    seed: u64,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SynthReport, Error> {
    let layers = layers.unwrap_or(shape.layers);
    if layers == 0 || layers > shape.layers {
        return Err(Error::InvalidField {
            path: out.to_path_buf(),
            field: "layers".into(),
            reason: format!("{layers} layers asked of a {}-layer model", shape.layers),
        });
    }
    std::fs::create_dir_all(out).map_err(io(out))?;
    let index_path = out.join("model.safetensors.index.json");
    // The index is the commit mark: gone until every shard is in place.
    atomic::remove_committed(&index_path)?;
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        let src = tokenizer_dir.join(file);
        if src.exists() {
            let bytes = std::fs::read(&src).map_err(io(&src))?;
            atomic::write_file(&out.join(file), &bytes)?;
        }
    }
    let config = serde_json::to_vec_pretty(&shape.config_json(layers)).expect("config serializes");
    atomic::write_file(&out.join("config.json"), &config)?;

    let shards: Vec<Option<usize>> = (0..layers).map(Some).chain([None]).collect();
    let mut weight_map = BTreeMap::new();
    let (mut params, mut bytes) = (0, 0);
    for (k, &layer) in shards.iter().enumerate() {
        let file = match layer {
            Some(l) => format!("model-layer-{l:03}.safetensors"),
            None => "model-rest.safetensors".to_string(),
        };
        let tensors = shape.tensors(layer);
        let data: Vec<Vec<u8>> = tensors
            .par_iter()
            .map(|(name, dims)| tensor_bytes(name, dims.iter().product(), seed))
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .zip(&data)
            .map(|((name, dims), d)| {
                let v = TensorView::new(Dtype::BF16, dims.clone(), d).expect("sizes agree");
                (name.clone(), v)
            })
            .collect();
        let path = out.join(&file);
        let serialized = safetensors::serialize(views, None).map_err(|e| Error::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        atomic::write_file(&path, &serialized)?;
        for (name, dims) in &tensors {
            params += dims.iter().product::<usize>();
            weight_map.insert(name.clone(), file.clone());
        }
        bytes += serialized.len();
        progress(k + 1, shards.len());
    }
    let index = serde_json::json!({
        "metadata": {"total_size": bytes},
        "weight_map": weight_map,
    });
    atomic::write_file(
        &index_path,
        &serde_json::to_vec_pretty(&index).expect("index serializes"),
    )?;
    Ok(SynthReport {
        dir: out.to_path_buf(),
        layers,
        params,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::checkpoint::Checkpoint;
    use crate::model::config::Config;
    use crate::testing::{fixture, TempDir};

    /// A two-layer checkpoint of a shrunken Qwen3-30B-A3B shape loads, runs, and is the
    /// same bytes when written twice.
    #[test]
    fn a_small_shape_round_trips_through_the_loader() {
        let s = Shape {
            name: "small",
            hidden: 64,
            moe_intermediate: 64,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            experts: 8,
            top_k: 2,
            vocab: 8192,
            rope_theta: 1e6,
        };
        let (a, b) = (TempDir::new("synth-a"), TempDir::new("synth-b"));
        let tok = fixture("small-moe");
        let r = synth(&s, Some(2), &tok, a.dir(), 7, &mut |_, _| {}).unwrap();
        synth(&s, Some(2), &tok, b.dir(), 7, &mut |_, _| {}).unwrap();
        assert_eq!(r.layers, 2);
        let c = Config::from_file(&a.path("config.json")).unwrap();
        assert_eq!((c.layers.len(), c.hidden_size, c.moe.top_k), (2, 64, 2));
        let ckpt = Checkpoint::open(a.dir()).unwrap();
        assert_eq!(ckpt.names().len(), 3 + 2 * (9 + 3 * 8));
        for f in ["model-layer-001.safetensors", "model-rest.safetensors"] {
            assert_eq!(
                std::fs::read(a.path(f)).unwrap(),
                std::fs::read(b.path(f)).unwrap(),
                "{f}"
            );
        }
        let m = crate::model::load(a.dir(), crate::backend::Cpu::fast()).unwrap();
        let mut state = m.model.new_state(8);
        let logits = m.model.forward(&mut state, &[1, 2, 3], 2).unwrap();
        assert!(logits.len() == 8192 && logits.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn unknown_shapes_and_layer_counts_are_refused() {
        let e = shape("qwen9").unwrap_err().to_string();
        assert!(e.contains("qwen3-30b-a3b"), "{e}");
        let dir = TempDir::new("synth-bad");
        let s = shape("qwen3-30b-a3b").unwrap();
        let e = synth(
            &s,
            Some(49),
            &fixture("small-moe"),
            dir.dir(),
            0,
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("49 layers"), "{e}");
    }
}
