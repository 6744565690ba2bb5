//! Reading a Hugging Face checkpoint directory: `config.json` in transformers 4.x and 5.x
//! styles ([`config`]), the safetensors shards memory-mapped ([`Checkpoint`]), the tokenizer
//! and chat template files ([`tokenizer`]), and where each architecture keeps its tensors
//! ([`arch`], [`experts`]). Nothing here knows of codecs, stores or backends: every layer
//! above reads checkpoints through this one (docs/ARCHITECTURE.md).

pub mod arch;
pub mod config;
pub mod experts;
mod shards;
pub mod tokenizer;

use std::path::PathBuf;

pub use config::{Arch, Config};
pub use shards::{first_non_finite, float_size, widen, Checkpoint, RawTensor, TensorInfo};
pub use tokenizer::Tokenizer;

/// Everything that can go wrong reading a checkpoint directory: its config, its
/// safetensors shards, its tokenizer. Each variant names the file and the field or tensor
/// involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A path that must be a regular file is a FIFO, a device or a directory: reading
    /// it would hang or read anything.
    #[error("{path}: not a regular file")]
    NotRegular {
        /// The path.
        path: PathBuf,
    },
    /// A weight that is NaN or infinite: a model with one gives NaN logits.
    #[error("{path}: tensor {tensor}: element {index} is {value}, not a finite number (damaged weights; `--no-check-weights` loads them anyway)")]
    NotFinite {
        /// The shard.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The element's index, row-major.
        index: usize,
        /// Its value.
        value: f32,
    },
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
    #[error("{dir}: no model.safetensors, model.safetensors.index.json or dense.safetensors")]
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
}

/// Opens `path` for reading if it is a regular file; a FIFO (whose opening blocks until a
/// writer comes), a device or a directory is [`Error::NotRegular`]. Errors of the file
/// system keep their kind (a missing file is `NotFound`).
pub fn open_regular(path: &std::path::Path) -> Result<std::fs::File, Error> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    if !std::fs::metadata(path).map_err(io)?.is_file() {
        return Err(Error::NotRegular {
            path: path.to_path_buf(),
        });
    }
    std::fs::File::open(path).map_err(io)
}

/// The bytes of the regular file `path` ([`open_regular`]).
pub fn read_regular(path: &std::path::Path) -> Result<Vec<u8>, Error> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_regular(path)?
        .read_to_end(&mut bytes)
        .map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(bytes)
}

static FINITE_CHECK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether weights read from a checkpoint are checked to be finite as they are widened to
/// f32 (on by default; [`Error::NotFinite`] names the first bad one). The scan runs on
/// every core and costs a fraction of the widening; turning it off (`--no-check-weights`)
/// is for loading a checkpoint known to hold non-finite values on purpose.
pub fn set_finite_check(on: bool) {
    FINITE_CHECK.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_finite_check`] left the check on.
pub fn finite_check() -> bool {
    FINITE_CHECK.load(std::sync::atomic::Ordering::Relaxed)
}
