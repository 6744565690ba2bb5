//! A model's weights on a backend and its forward pass.
//!
//! [`load`] opens a model directory (a Hugging Face checkpoint, a converted directory
//! with expert stores, or a compressed one), reads it through [`crate::checkpoint`] and
//! the stores, and uploads the weights to a [`Backend`] ([`weights`]). The forward pass
//! ([`forward`]) is written once against that backend for every architecture; the
//! mixture-of-experts block is shared ([`moe`]).

pub mod forward;
pub mod moe;
pub mod synth;
pub mod weights;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use forward::{Model, State};

use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, Config, Tokenizer};
use crate::store::dense_vq::{vq_layers, CodedLayers};
use crate::store::vq_encode::VqExperts;
use crate::store::ExpertStore;

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
    /// More tokens than the state's KV cache holds.
    #[error("context overflow: {needed} positions needed, the KV cache holds {capacity}")]
    ContextOverflow {
        /// Positions the call needs.
        needed: usize,
        /// Positions the cache holds.
        capacity: usize,
    },
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
}

impl Codecs {
    /// The codec asked for `layer`, if any.
    pub fn of(&self, layer: usize) -> Option<crate::codec::Codec> {
        self.per_layer.get(&layer).copied().or(self.default)
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
        }
    }
}

/// Loads config, weights and tokenizer from a model directory: a Hugging Face checkpoint,
/// or a converted directory whose experts are read from their 4-bit store (in a
/// directory without one, from its most precise store: see `store::default_bits`).
pub fn load<B: Backend>(dir: &Path, backend: B) -> Result<LoadedModel<B>, Error> {
    load_with(dir, backend, &ExpertBits::default())
}

/// [`load`], with the routed experts of a converted directory at `bits` (stores at 3
/// and 2 bits are built from the 4-bit one if they are missing or unusable).
pub fn load_with<B: Backend>(
    dir: &Path,
    backend: B,
    bits: &ExpertBits,
) -> Result<LoadedModel<B>, Error> {
    load_with_codecs(dir, backend, &Codecs::from(bits))
}

/// [`load`], with each MoE layer's routed experts in the codec `codecs` asks for.
pub fn load_with_codecs<B: Backend>(
    dir: &Path,
    backend: B,
    codecs: &Codecs,
) -> Result<LoadedModel<B>, Error> {
    load_with_progress(dir, backend, codecs, &mut |_, _| {})
}

/// [`load_with_codecs`], calling `progress(done, total)` with the expert records written
/// while a VQ expert store is built (a one-time cost of the first load at a rung), and
/// with the dense weights coded.
pub fn load_with_progress<B: Backend>(
    dir: &Path,
    backend: B,
    codecs: &Codecs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedModel<B>, Error> {
    use crate::codec::Codec;
    if crate::store::compressed::is_compressed(dir) {
        if codecs != &Codecs::default() {
            return Err(Error::Config(format!(
                "{} is a compressed model: it runs the codecs of its plan.json",
                dir.display()
            )));
        }
        return Ok(crate::store::compressed::load(dir, backend)?.0);
    }
    let config = Config::from_file(&dir.join("config.json"))?;
    let checkpoint = Checkpoint::open(dir)?;
    let converted = crate::store::is_converted(dir);
    let mut bits = ExpertBits {
        default: converted.then(|| crate::store::default_bits(dir)),
        ..ExpertBits::default()
    };
    let mut rungs = BTreeMap::new();
    for layer in config.moe_layers() {
        let refuse = |codec, why: &str| Error::Codec {
            dir: dir.to_path_buf(),
            layer,
            codec,
            why: why.to_string(),
        };
        match codecs.of(layer) {
            None => {}
            Some(Codec::Affine { bits: b }) => {
                if !converted {
                    return Err(Error::NoExpertStore {
                        dir: dir.to_path_buf(),
                    });
                }
                bits.per_layer.insert(layer, b);
            }
            Some(c @ Codec::Vq { .. }) => {
                if converted {
                    return Err(refuse(
                        c,
                        "VQ rungs are encoded from the bf16 experts of a Hugging Face checkpoint, \
                         and a converted directory keeps only the 4-bit store",
                    ));
                }
                let rung = c
                    .rung()
                    .map_err(|e| refuse(c, &e.to_string()))?
                    .expect("a VQ codec has a rung");
                rungs.insert(layer, rung);
            }
            Some(Codec::Bf16) if converted => {
                return Err(refuse(
                    Codec::Bf16,
                    "a converted directory keeps its experts in the 4-bit store",
                ))
            }
            Some(Codec::Bf16) => {}
        }
    }
    let stores = if converted {
        Some(open_stores(dir, &config, &bits)?)
    } else {
        None
    };
    let vq = stored_vq_experts(dir, &config, &checkpoint, &rungs, progress)?;
    let coded = coded_layers(
        dir,
        &checkpoint,
        &config,
        [codecs.dense, codecs.head],
        converted,
        progress,
    )?;
    let model = Model::load(config, &checkpoint, stores, &vq, &coded, backend)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        model,
        tokenizer,
    })
}

/// The dense linear layers (`codecs[0]`) and the untied LM head (`codecs[1]`) of the
/// checkpoint in `dir` coded at their codecs (none coded for bf16 or unset): at a VQ rung
/// from the coded files beside it, encoded on first use; at an affine width quantized
/// from the checkpoint's values, which a converted directory (`converted`) keeps too.
pub fn coded_layers(
    dir: &Path,
    ckpt: &Checkpoint,
    config: &Config,
    codecs: [Option<crate::codec::Codec>; 2],
    converted: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CodedLayers, Error> {
    use crate::codec::Codec;
    use crate::store::dense_vq;
    let mut by_codec: BTreeMap<Codec, dense_vq::WeightShapes> = BTreeMap::new();
    for (i, codec) in codecs.into_iter().enumerate() {
        let Some(codec) = codec.filter(|&c| c != Codec::Bf16) else {
            continue;
        };
        let rung = dense_vq::rung_of(codec).map_err(Error::Config)?;
        if converted && rung.is_some() {
            return Err(Error::Config(format!(
                "{}: layers at {codec} are encoded from a Hugging Face checkpoint's bf16 \
                 weights; a converted directory holds none",
                dir.display()
            )));
        }
        let weights = if i == 0 {
            dense_vq::dense_linear_weights(ckpt)?
        } else {
            dense_vq::lm_head_weight(ckpt, config)?
                .into_iter()
                .collect()
        };
        by_codec.entry(codec).or_default().extend(weights);
    }
    let mut out = CodedLayers::new();
    for (codec, weights) in by_codec {
        match codec {
            Codec::Affine { bits } => {
                out.extend(dense_vq::quantize_affine(ckpt, bits, &weights, progress)?)
            }
            _ => {
                let rung = dense_vq::rung_of(codec)
                    .map_err(Error::Config)?
                    .expect("a VQ codec is coded into a file");
                let coded = dense_vq::ensure(dir, ckpt, rung, &weights, progress)?;
                out.extend(vq_layers(coded));
            }
        }
    }
    Ok(out)
}

/// The VQ experts of the layers in `rungs` (decoder layer → rung), read from the VQ
/// expert stores of the checkpoint directory `dir`: encoded once, on the first load that
/// asks for a layer at a rung, and reused by every later one (see `store::vq`);
/// `progress(done, total)` counts the records written while building.
pub fn stored_vq_experts(
    dir: &Path,
    config: &Config,
    ckpt: &Checkpoint,
    rungs: &BTreeMap<usize, crate::codec::vq::Rung>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BTreeMap<usize, VqExperts>, Error> {
    if rungs.is_empty() {
        return Ok(BTreeMap::new());
    }
    let ensured = crate::store::vq::ensure(dir, config, ckpt, rungs, progress)?;
    Ok(ensured
        .stores
        .into_iter()
        .map(|(layer, store)| (layer, VqExperts::Stored { store, layer }))
        .collect())
}

/// The expert store each MoE layer reads, built where missing.
fn open_stores(
    dir: &Path,
    config: &Config,
    bits: &ExpertBits,
) -> Result<weights::LayerStores, Error> {
    let mut wanted: Vec<u32> = Vec::new();
    for layer in config.moe_layers() {
        let b = bits.of(layer);
        if !matches!(b, 2..=4) {
            return Err(Error::ExpertBits { layer, bits: b });
        }
        if !wanted.contains(&b) {
            wanted.push(b);
        }
    }
    // Opening checks a store (manifest, size, a byte-for-byte spot check); only the
    // derived stores that fail it are built, together, and opened again.
    let mut opened = BTreeMap::new();
    let mut missing = Vec::new();
    for &b in &wanted {
        match ExpertStore::open(dir, b) {
            Ok(store) => {
                opened.insert(b, Arc::new(store));
            }
            Err(_) if b < 4 => missing.push(b),
            Err(e) => return Err(e.into()),
        }
    }
    if !missing.is_empty() {
        crate::store::lowbit::ensure_many(dir, &missing)?;
        for b in missing {
            opened.insert(b, Arc::new(ExpertStore::open(dir, b)?));
        }
    }
    Ok(config
        .moe_layers()
        .map(|layer| (layer, opened[&bits.of(layer)].clone()))
        .collect())
}
