//! A model's weights on a backend and its forward pass.
//!
//! [`load`] opens a model directory (a Hugging Face checkpoint, a converted directory
//! with expert stores, or a compressed one), reads it through [`crate::checkpoint`] and
//! the stores, and uploads the weights to a [`Backend`] ([`weights`]). The forward pass
//! ([`forward`]) is written once against that backend for every architecture; the
//! mixture-of-experts block is shared ([`moe`]).

pub mod forward;
pub mod mla;
pub mod moe;
pub mod rope;
pub mod weights;

use std::collections::BTreeMap;
use std::path::PathBuf;

mod load;

pub use forward::{DecodeOptions, Decoding, Model, State};
pub use load::{
    coded_layers, load, load_compressed, load_with, load_with_codecs, load_with_progress,
    stored_vq_experts,
};

use crate::backend::Backend;
use crate::checkpoint::Tokenizer;

/// Everything that can go wrong loading or running a model. Each variant names the
/// file and the field or tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::Error),
    /// A run-time setting that cannot apply to this model.
    #[error("{0}")]
    Config(String),
    /// A token id outside the vocabulary was fed to the model.
    #[error("token id {id} is outside the vocabulary of {vocab} entries")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// An expert store could not be built or opened.
    #[error(transparent)]
    Store(Box<crate::store::Error>),
    /// Expert precision was asked of a directory that has no expert stores.
    #[error("{dir}: --expert-bits needs a converted model directory (experts.bin); run `dynmoe convert` first")]
    NoExpertStore {
        /// The model directory.
        dir: PathBuf,
    },
    /// A codec that cannot be had from this directory.
    #[error("{dir}: layer {layer} asks for {codec}: {why}")]
    Codec {
        /// The model directory.
        dir: PathBuf,
        /// The layer.
        layer: usize,
        /// The codec asked for.
        codec: crate::codec::Codec,
        /// Why not.
        why: String,
    },
    /// A matrix could not be encoded.
    #[error("{tensor}: {source}")]
    Encode {
        /// The matrix.
        tensor: String,
        /// What the codec said.
        source: crate::codec::CodecError,
    },
    /// An expert precision other than 4, 3 or 2 bits.
    #[error("expert bits {bits} for layer {layer}: stores exist at 4, 3 and 2 bits")]
    ExpertBits {
        /// The layer.
        layer: usize,
        /// What was asked.
        bits: u32,
    },
    /// The model produced NaN or infinite logits: damaged or out-of-range weights, or a
    /// configuration that divides by zero. Never turned into a token.
    #[error("the logits at position {position} are not finite numbers (NaN or infinity): the weights or the configuration are damaged")]
    NonFiniteLogits {
        /// The position whose logits they are.
        position: usize,
    },
    /// More tokens than the state's KV cache holds.
    #[error("context overflow: {needed} positions needed, the KV cache holds {capacity}")]
    ContextOverflow {
        /// Positions the call needs.
        needed: usize,
        /// Positions the cache holds.
        capacity: usize,
    },
}

impl Error {
    /// An error of the file system on `path`, for `map_err`.
    pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
        move |source| {
            crate::checkpoint::Error::Io {
                path: path.to_path_buf(),
                source,
            }
            .into()
        }
    }
}

/// Index of the largest logit (the lowest index on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A model directory opened for running: configuration, weights on a backend, tokenizer.
pub struct LoadedModel<B: Backend> {
    /// Directory it came from.
    pub dir: PathBuf,
    /// The forward pass and its weights.
    pub model: Model<B>,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
}

impl From<crate::store::Error> for Error {
    fn from(e: crate::store::Error) -> Error {
        Error::Store(Box::new(e))
    }
}

/// Precision of the routed experts when a model directory carries expert stores
/// (`dynmoe convert`): a default for every MoE layer and per-layer overrides. Unset
/// means 4 bits, the base store.
#[derive(Debug, Clone, Default)]
pub struct ExpertBits {
    /// Bits of every MoE layer not overridden.
    pub default: Option<u32>,
    /// Bits of particular layers.
    pub per_layer: BTreeMap<usize, u32>,
}

impl ExpertBits {
    /// Whether anything was asked.
    pub fn is_set(&self) -> bool {
        self.default.is_some() || !self.per_layer.is_empty()
    }

    /// Bits of `layer`.
    pub fn of(&self, layer: usize) -> u32 {
        self.per_layer
            .get(&layer)
            .copied()
            .or(self.default)
            .unwrap_or(4)
    }
}

/// The codecs a model runs with: of the routed experts per MoE layer (a default and
/// per-layer overrides), and of the dense linear layers. Unset means the directory's own
/// form: bf16 for a Hugging Face checkpoint, the 4-bit store for a converted
/// directory's experts. Affine expert codecs (`q4`, `q3`, `q2`) need a converted
/// directory; VQ rungs are read from the VQ stores beside a checkpoint, encoded from its
/// bf16 weights on first use ([`stored_vq_experts`], [`crate::store::dense_vq`]). Dense
/// layers at an affine width are quantized at load, from either kind of directory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Codecs {
    /// Codec of every MoE layer not overridden.
    pub default: Option<crate::codec::Codec>,
    /// Codecs of particular layers.
    pub per_layer: BTreeMap<usize, crate::codec::Codec>,
    /// Codec of the dense linear layers (attention projections, shared experts, dense
    /// MLPs): bf16, an affine width or a VQ rung.
    pub dense: Option<crate::codec::Codec>,
    /// Codec of an untied LM head: bf16, an affine width or a VQ rung.
    pub head: Option<crate::codec::Codec>,
    /// Codec of the token embeddings (and a head tied to them), decoded a row at a time
    /// at lookup: bf16, an affine width or a VQ rung.
    pub embedding: Option<crate::codec::Codec>,
}

impl Codecs {
    /// The codec asked for `layer`, if any.
    pub fn of(&self, layer: usize) -> Option<crate::codec::Codec> {
        self.per_layer.get(&layer).copied().or(self.default)
    }

    /// The codecs of the tensors outside the routed experts (bf16 where unset).
    pub fn groups(&self) -> crate::store::dense_vq::GroupCodecs {
        let or_bf16 = |c: Option<crate::codec::Codec>| c.unwrap_or(crate::codec::Codec::Bf16);
        crate::store::dense_vq::GroupCodecs::uniform(
            or_bf16(self.dense),
            or_bf16(self.head),
            or_bf16(self.embedding),
        )
    }
}

impl From<&ExpertBits> for Codecs {
    fn from(b: &ExpertBits) -> Codecs {
        let affine = |bits| crate::codec::Codec::Affine { bits };
        Codecs {
            default: b.default.map(affine),
            per_layer: b
                .per_layer
                .iter()
                .map(|(&l, &bits)| (l, affine(bits)))
                .collect(),
            dense: None,
            head: None,
            embedding: None,
        }
    }
}
