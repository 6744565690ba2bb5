//! Loading a Hugging Face MoE checkpoint and running its forward pass.
//!
//! `Model::load` reads `config.json` (see [`config`]), memory-maps the safetensors
//! shards (see [`checkpoint`]), names every tensor through the architecture's file
//! under [`arch`], and uploads the weights to a [`Backend`]. The forward pass
//! ([`forward`]) is written once against that backend for every architecture; the
//! mixture-of-experts block is shared ([`moe`]).

pub mod arch;
pub mod checkpoint;
pub mod config;
pub mod forward;
pub mod moe;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};

pub use checkpoint::Checkpoint;
pub use config::{Arch, Config};
pub use forward::{Model, State};
pub use tokenizer::Tokenizer;

use crate::backend::Backend;

/// Everything that can go wrong reading or running a model. Each variant names the
/// file and the field or tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A JSON file is malformed or has the wrong structure.
    #[error("{path}: malformed JSON: {reason}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// `model_type` names an architecture dynmoe does not run.
    #[error("{path}: model_type {model_type:?} is not supported (supported: qwen3_moe, qwen2_moe, mixtral, olmoe)")]
    UnsupportedArch {
        /// The config file.
        path: PathBuf,
        /// What it says.
        model_type: String,
    },
    /// A required configuration field is absent.
    #[error("{path}: missing field {field:?}")]
    MissingField {
        /// The config file.
        path: PathBuf,
        /// The field.
        field: String,
    },
    /// A configuration field has a value dynmoe cannot use.
    #[error("{path}: field {field:?}: {reason}")]
    InvalidField {
        /// The config file.
        path: PathBuf,
        /// The field.
        field: String,
        /// Why.
        reason: String,
    },
    /// The directory has neither `model.safetensors` nor an index of shards.
    #[error("{dir}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights {
        /// The model directory.
        dir: PathBuf,
    },
    /// A safetensors file is malformed or truncated.
    #[error("{path}: invalid safetensors file: {reason}")]
    Safetensors {
        /// The shard.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the configuration requires is not in the checkpoint.
    #[error("{path}: tensor {tensor} is missing")]
    MissingTensor {
        /// A shard of the checkpoint (the first one, when no shard names it).
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// A tensor's shape disagrees with the configuration.
    #[error("{path}: tensor {tensor} has shape {found:?}, the config implies {expected:?}")]
    TensorShape {
        /// The shard holding it.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Shape the config implies.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor's dtype is not one dynmoe reads.
    #[error("{path}: tensor {tensor} has dtype {dtype}, expected bf16, f16 or f32")]
    TensorDtype {
        /// The shard holding it.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its dtype.
        dtype: String,
    },
    /// The tokenizer could not be loaded or used.
    #[error("{path}: tokenizer: {reason}")]
    Tokenizer {
        /// tokenizer.json or tokenizer_config.json.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A token id outside the vocabulary was fed to the model.
    #[error("token id {id} is outside the vocabulary of {vocab} entries")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
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

/// A model directory opened for running: configuration, weights on a backend, tokenizer.
pub struct LoadedModel<B: Backend> {
    /// Directory it came from.
    pub dir: PathBuf,
    /// The forward pass and its weights.
    pub model: Model<B>,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
}

/// Loads config, weights and tokenizer from a Hugging Face model directory.
pub fn load<B: Backend>(dir: &Path, backend: B) -> Result<LoadedModel<B>, Error> {
    let config = Config::from_file(&dir.join("config.json"))?;
    let checkpoint = Checkpoint::open(dir)?;
    let model = Model::load(config, &checkpoint, backend)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        model,
        tokenizer,
    })
}
