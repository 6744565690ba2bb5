//! The weights of one decoder layer, shared by every architecture. Architecture files
//! under [`crate::checkpoint::arch`] only say which checkpoint tensor goes where.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::Error;
use crate::backend::{Backend, Weight};
use crate::checkpoint::arch;
use crate::checkpoint::config::FfnKind;
use crate::checkpoint::config::{Config, QkNorm, Router};
use crate::checkpoint::experts::Extent;
use crate::checkpoint::experts::{ExpertShape, ExpertTensors};
use crate::checkpoint::Checkpoint;
use crate::store::dense_vq::{CodedLayers, CodedWeight};
use crate::store::vq_encode::VqExperts;
use crate::store::ExpertStore;
use crate::store::{records::LayerSource, records::RecordFormat};

/// A linear layer `y = x Wᵀ + b`, `W` stored `[out_dim, in_dim]`.
pub struct Linear<B: Backend> {
    /// `[out_dim, in_dim]`.
    pub w: LinearWeight<B>,
    /// `[out_dim]`, if the layer has a bias.
    pub bias: Option<B::Tensor>,
    /// Input features.
    pub in_dim: usize,
    /// Output features.
    pub out_dim: usize,
}

/// The weight of a [`Linear`] layer.
pub enum LinearWeight<B: Backend> {
    /// At the checkpoint's precision, on the backend.
    Dense(B::Matrix),
    /// Coded in host memory.
    Coded(CodedWeight),
}

impl<B: Backend> Linear<B> {
    /// The weight, as the backend's products take it.
    pub fn weight(&self) -> Weight<'_, B::Matrix> {
        match &self.w {
            LinearWeight::Dense(m) => Weight::Dense(m),
            LinearWeight::Coded(CodedWeight::Vq(m)) => Weight::Vq(m.view()),
            LinearWeight::Coded(CodedWeight::Affine(m)) => Weight::Affine(m.view()),
        }
    }

    /// The weight when it is dense: what paths that only take a dense matrix (the
    /// router on the device) need.
    pub fn dense(&self) -> Option<&B::Matrix> {
        match &self.w {
            LinearWeight::Dense(m) => Some(m),
            LinearWeight::Coded(_) => None,
        }
    }
}

/// A SwiGLU MLP: `down(silu(gate(x)) * up(x))`. Dense MLPs, routed experts and shared
/// experts are all this.
pub struct Mlp<B: Backend> {
    /// `[intermediate, hidden]`.
    pub gate_proj: Linear<B>,
    /// `[intermediate, hidden]`.
    pub up_proj: Linear<B>,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear<B>,
}

/// Self-attention projections and optional q/k norms.
pub struct Attention<B: Backend> {
    /// `[heads * head_dim, hidden]`.
    pub q_proj: Linear<B>,
    /// `[kv_heads * head_dim, hidden]`.
    pub k_proj: Linear<B>,
    /// `[kv_heads * head_dim, hidden]`.
    pub v_proj: Linear<B>,
    /// `[hidden, heads * head_dim]`.
    pub o_proj: Linear<B>,
    /// q and k RMSNorm weights: `[head_dim]` each (per head) or `[q_dim]`/`[kv_dim]` (whole).
    pub qk_norm: Option<(B::Tensor, B::Tensor)>,
    /// Latent attention's other parts (DeepSeek-V3): q, k and v then read what
    /// `model::mla` says, not the layer's input.
    pub mla: Option<Box<super::mla::Mla<B>>>,
}

/// The routed experts of one MoE layer.
pub enum Experts<B: Backend> {
    /// f32 tensors on the backend, one SwiGLU MLP per expert.
    Dense(Vec<Mlp<B>>),
    /// Records of an expert store, read in place; `layer` is the decoder layer.
    Stored {
        /// The store (4, 3 or 2 bits).
        store: Arc<ExpertStore>,
        /// Decoder layer whose records these are.
        layer: usize,
    },
    /// Coded at a rung of the VQ ladder: encoded in host memory, or records of a VQ
    /// expert store read in place.
    Vq(VqExperts),
}

/// The expert store each MoE layer reads, by decoder layer.
pub type LayerStores = BTreeMap<usize, Arc<ExpertStore>>;

/// A mixture-of-experts block.
pub struct Moe<B: Backend> {
    /// Router, `[num_experts, hidden]`.
    pub gate: Linear<B>,
    /// Routed experts.
    pub experts: Experts<B>,
    /// Shared expert, run on every token (Qwen2-MoE; GLM-4.5's shared experts as one).
    pub shared_expert: Option<Mlp<B>>,
    /// Sigmoid gate of the shared expert, `[1, hidden]` (Qwen2-MoE); without one the
    /// shared expert's output is added as it is.
    pub shared_expert_gate: Option<Linear<B>>,
    /// A sigmoid router's correction bias, `[num_experts]`, added to the scores for the
    /// choice of experts only; routing runs on the host, so it stays there.
    pub score_bias: Option<Vec<f32>>,
    /// Where each routed expert's record lives on disk: what a resident set reads.
    pub source: Box<LayerSource>,
    /// Experts a plan removed, without resident slots: routing is confined to the ones
    /// marked `true` (their logits kept, the others' set to −∞). `None`: every expert.
    pub keep: Option<Vec<bool>>,
    /// Every expert at a low rung of the VQ ladder: with `keep`, routing is then not
    /// confined, and an expert outside `keep` runs its shadow (docs/ARCHITECTURE.md,
    /// Residency).
    pub shadows: Option<VqExperts>,
}

/// Feed-forward block of a layer.
pub enum Ffn<B: Backend> {
    /// Dense SwiGLU.
    Dense(Mlp<B>),
    /// Mixture of experts.
    Moe(Moe<B>),
}

/// One decoder layer.
pub struct Layer<B: Backend> {
    /// `[hidden]`.
    pub input_layernorm: B::Tensor,
    /// Attention.
    pub self_attn: Attention<B>,
    /// `[hidden]`.
    pub post_attention_layernorm: B::Tensor,
    /// Feed-forward block.
    pub mlp: Ffn<B>,
}

/// Reads checkpoint tensors onto a backend, checking every shape.
pub struct Loader<'a, B: Backend> {
    /// The checkpoint.
    pub ckpt: &'a Checkpoint,
    /// Expert stores by MoE layer, when the model directory was converted.
    pub stores: Option<&'a LayerStores>,
    /// MoE layers whose experts come encoded at a VQ rung ([`encode_experts`]).
    pub vq: &'a BTreeMap<usize, VqExperts>,
    /// Dense linear layers and the LM head coded, by weight tensor name.
    pub coded: &'a CodedLayers,
    /// The backend the weights go to.
    pub backend: &'a B,
    /// The resolved configuration.
    pub config: &'a Config,
}

impl<B: Backend> Loader<'_, B> {
    /// A tensor of exactly this shape.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<B::Tensor, Error> {
        Ok(self.backend.upload(&self.ckpt.f32(name, shape)?))
    }

    /// A weight matrix `[out_dim, in_dim]` at the checkpoint's precision.
    pub fn matrix(&self, name: &str, out_dim: usize, in_dim: usize) -> Result<B::Matrix, Error> {
        let data = self.ckpt.f32(name, &[out_dim, in_dim])?;
        Ok(self.backend.upload_matrix(&data, out_dim, in_dim))
    }

    /// `{prefix}.weight` and, if `bias`, `{prefix}.bias`.
    pub fn linear(
        &self,
        prefix: &str,
        out_dim: usize,
        in_dim: usize,
        bias: bool,
    ) -> Result<Linear<B>, Error> {
        let name = format!("{prefix}.weight");
        let w = match self.coded.get(&name) {
            Some(m) if m.shape() == (out_dim, in_dim) => LinearWeight::Coded(m.clone()),
            Some(m) => {
                let (rows, cols) = m.shape();
                return Err(Error::Config(format!(
                    "{name}: coded as {rows}×{cols}, the config implies {out_dim}×{in_dim}"
                )));
            }
            None => LinearWeight::Dense(self.matrix(&name, out_dim, in_dim)?),
        };
        Ok(Linear {
            w,
            bias: if bias {
                Some(self.tensor(&format!("{prefix}.bias"), &[out_dim])?)
            } else {
                None
            },
            in_dim,
            out_dim,
        })
    }

    /// A SwiGLU MLP whose three projections are `{prefix}.{names.0/1/2}` (gate, up, down).
    pub fn mlp(
        &self,
        prefix: &str,
        names: [&str; 3],
        intermediate: usize,
    ) -> Result<Mlp<B>, Error> {
        let h = self.config.hidden_size;
        Ok(Mlp {
            gate_proj: self.linear(&format!("{prefix}.{}", names[0]), intermediate, h, false)?,
            up_proj: self.linear(&format!("{prefix}.{}", names[1]), intermediate, h, false)?,
            down_proj: self.linear(&format!("{prefix}.{}", names[2]), h, intermediate, false)?,
        })
    }

    /// The routed experts of decoder layer `layer`: from its expert store when the model
    /// directory has one, else the checkpoint tensors under `{prefix}.experts`; and
    /// where each expert's record sits in its file.
    pub fn routed_experts(
        &self,
        layer: usize,
        prefix: &str,
        names: [&'static str; 3],
    ) -> Result<(Experts<B>, LayerSource), Error> {
        if let Some(coded) = self.vq.get(&layer) {
            // A resident set over in-memory encodings has nothing to read them from;
            // `Model::reservoir` refuses it, so the checkpoint's extents stand here.
            let source = match coded {
                VqExperts::Stored { store, layer } => store.layer_source(*layer),
                VqExperts::Encoded(_) => self.expert_source(prefix, names)?,
            };
            return Ok((Experts::Vq(coded.clone()), source));
        }
        let Some(stores) = self.stores else {
            let source = self.expert_source(prefix, names)?;
            return Ok((Experts::Dense(self.experts(prefix, names)?), source));
        };
        let store = stores.get(&layer).expect("a store for every MoE layer");
        let c = self.config;
        let layout = store.layout();
        let found = (
            store.experts_per_layer(),
            layout.hidden,
            layout.intermediate,
        );
        let expected = (c.moe.num_experts, c.hidden_size, c.moe.expert_intermediate);
        if found != expected || store.record_index(layer, 0).is_none() {
            return Err(crate::checkpoint::Error::TensorShape {
                path: store.path().to_path_buf(),
                tensor: format!("experts of layer {layer} (experts, hidden, intermediate)"),
                expected: vec![expected.0, expected.1, expected.2],
                found: vec![found.0, found.1, found.2],
            }
            .into());
        }
        let source = LayerSource {
            format: RecordFormat::Affine(*layout),
            experts: (0..c.moe.num_experts)
                .map(|e| {
                    let index = store.record_index(layer, e).expect("checked above");
                    vec![Extent {
                        file: store.path().to_path_buf(),
                        offset: layout.record_offset(index),
                        len: layout.record_size,
                    }]
                })
                .collect(),
            checksums: Some(
                (0..c.moe.num_experts)
                    .map(|e| {
                        let index = store.record_index(layer, e).expect("checked above");
                        store.checksum(index).to_string()
                    })
                    .collect(),
            ),
        };
        Ok((
            Experts::Stored {
                store: store.clone(),
                layer,
            },
            source,
        ))
    }

    /// Where the checkpoint keeps each routed expert under `{prefix}.experts`.
    fn expert_source(&self, prefix: &str, names: [&'static str; 3]) -> Result<LayerSource, Error> {
        let shape = ExpertShape::of(self.config);
        let tensors = ExpertTensors::find(self.ckpt, prefix, names)?;
        let mut dtype = None;
        let mut experts = Vec::with_capacity(shape.experts);
        for e in 0..shape.experts {
            let mut runs = Vec::with_capacity(3);
            for p in 0..3 {
                let (extent, dt) = tensors.extent(self.ckpt, &shape, e, p)?;
                if *dtype.get_or_insert(dt) != dt {
                    return Err(crate::checkpoint::Error::TensorDtype {
                        path: extent.file,
                        tensor: format!("{prefix}.experts ({e}, projection {p})"),
                        dtype: format!(
                            "{dt:?}, while other experts of the layer are {:?}",
                            dtype.unwrap()
                        ),
                    }
                    .into());
                }
                runs.push(extent);
            }
            experts.push(runs);
        }
        Ok(LayerSource {
            format: RecordFormat::Dense {
                dtype: dtype.unwrap_or(safetensors::Dtype::F32),
                hidden: shape.hidden,
                intermediate: shape.intermediate,
            },
            experts,
            checksums: None,
        })
    }

    /// The routed experts under `{prefix}.experts`, wherever [`ExpertTensors`] finds them.
    pub fn experts(&self, prefix: &str, names: [&'static str; 3]) -> Result<Vec<Mlp<B>>, Error> {
        let shape = ExpertShape::of(self.config);
        let tensors = ExpertTensors::find(self.ckpt, prefix, names)?;
        let linear = |e: usize, p: usize| -> Result<Linear<B>, Error> {
            let [out_dim, in_dim] = shape.matrix(p);
            let data = tensors.matrix(self.ckpt, &shape, e, p)?.0;
            Ok(Linear {
                w: LinearWeight::Dense(self.backend.upload_matrix(&data, out_dim, in_dim)),
                bias: None,
                in_dim,
                out_dim,
            })
        };
        (0..shape.experts)
            .map(|e| {
                Ok(Mlp {
                    gate_proj: linear(e, 0)?,
                    up_proj: linear(e, 1)?,
                    down_proj: linear(e, 2)?,
                })
            })
            .collect()
    }

    /// Attention of layer `layer` under `model.layers.{layer}.self_attn`.
    pub fn attention(&self, layer: usize) -> Result<Attention<B>, Error> {
        let c = self.config;
        if let Some(m) = &c.mla {
            return super::mla::load(self, layer, m);
        }
        let p = format!("model.layers.{layer}.self_attn");
        let (h, q, kv) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let qk_norm = match c.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead => Some((
                self.tensor(&format!("{p}.q_norm.weight"), &[c.head_dim])?,
                self.tensor(&format!("{p}.k_norm.weight"), &[c.head_dim])?,
            )),
            QkNorm::Whole => Some((
                self.tensor(&format!("{p}.q_norm.weight"), &[q])?,
                self.tensor(&format!("{p}.k_norm.weight"), &[kv])?,
            )),
        };
        Ok(Attention {
            q_proj: self.linear(&format!("{p}.q_proj"), q, h, c.qkv_bias)?,
            k_proj: self.linear(&format!("{p}.k_proj"), kv, h, c.qkv_bias)?,
            v_proj: self.linear(&format!("{p}.v_proj"), kv, h, c.qkv_bias)?,
            o_proj: self.linear(&format!("{p}.o_proj"), h, q, c.o_bias)?,
            qk_norm,
            mla: None,
        })
    }

    /// The two RMSNorm weights around attention of layer `layer`.
    pub fn layer_norms(&self, layer: usize) -> Result<(B::Tensor, B::Tensor), Error> {
        let h = self.config.hidden_size;
        Ok((
            self.tensor(
                &format!("model.layers.{layer}.input_layernorm.weight"),
                &[h],
            )?,
            self.tensor(
                &format!("model.layers.{layer}.post_attention_layernorm.weight"),
                &[h],
            )?,
        ))
    }
}

/// Loads decoder layer `i` with the naming of the configured architecture.
pub fn load_layer<B: Backend>(ld: &Loader<B>, i: usize) -> Result<Layer<B>, Error> {
    layer_with(ld, i, &arch::ffn_names(ld.config.arch, ld.ckpt, i))
}

/// Norms, attention and the feed-forward block of layer `i`, named by `names`.
pub fn layer_with<B: Backend>(
    ld: &Loader<B>,
    i: usize,
    names: &arch::FfnNames,
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
                        gate.map(|g| ld.linear(&format!("{prefix}.{g}"), 1, c.hidden_size, false))
                            .transpose()?,
                    ),
                    _ => (None, None),
                };
            let score_bias = match c.moe.router {
                Router::SigmoidGroups { .. } => Some(ld.ckpt.f32(
                    &format!("{prefix}.{}.e_score_correction_bias", names.router),
                    &[c.moe.num_experts],
                )?),
                Router::SoftmaxTopK { .. } => None,
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
                score_bias,
                source: Box::new(source),
                keep: None,
                shadows: None,
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
