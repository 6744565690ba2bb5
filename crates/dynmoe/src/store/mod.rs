//! On-disk expert stores: record layout, manifests, building, checking and reading.
//!
//! A converted model directory holds the dense tensors (`dense.safetensors`, the
//! tokenizer and config files) and the routed experts in page-aligned records:
//!
//! - `experts.bin` + `experts.json`: every expert as MLX affine 4-bit codes, written by
//!   [`base::convert`] from a Hugging Face checkpoint;
//! - `experts2.bin` + `experts2.json`, `experts3.bin` + `experts3.json`: the same
//!   experts at 2 and 3 bits, derived from `experts.bin` in process by [`lowbit`];
//! - `experts-vq{bits}.bin` + `experts-vq{bits}.json` beside a Hugging Face
//!   checkpoint: chosen layers' experts at a rung of the VQ ladder, encoded once from
//!   the checkpoint's weights by [`vq`];
//! - `dense-vq{bits}.safetensors` beside a Hugging Face checkpoint: its dense linear
//!   layers at a rung of the VQ ladder ([`dense_vq`]);
//! - `experts.lock`: the lock writers and readers share (see [`atomic`]).
//!
//! [`synth`] writes the same stores with random records for the shapes of published
//! models, with or without `experts.bin`, and [`synth_vq`] VQ stores of random records
//! for synthetic compressed model directories ([`compressed`]).
//!
//! [`layout::Layout`] fixes where each part of a record sits, [`manifest::Manifest`]
//! what a store claims to hold, and [`reader::ExpertStore`] maps a checked store and
//! hands out [`AffineView`](crate::codec::affine::kernels::AffineView)s over it.
//! `docs/FORMAT.md` specifies the bytes.
//!
//! ```no_run
//! use std::path::Path;
//! use dynmoe::store::{base, lowbit, reader::ExpertStore};
//! let out = Path::new("q30");
//! base::convert(Path::new("Qwen3-30B-A3B"), out, &mut |_, _| {})?;
//! lowbit::ensure(out, 2)?;
//! let store = ExpertStore::open(out, 2)?;
//! let expert = store.record(0, 5);
//! assert_eq!(expert.down.rows, store.layout().hidden);
//! # Ok::<(), dynmoe::store::Error>(())
//! ```

pub mod atomic;
pub mod base;
pub mod compressed;
pub mod dense_vq;
pub mod journal;
pub mod layout;
pub mod lowbit;
pub mod manifest;
pub mod plan;
pub mod reader;
pub mod records;
// Random stores of the shapes of published models: what a synthetic record is stays here,
// since loading checks such stores against their generator; writing them is API only for
// tests, benchmarks and `dynmoe synth` (the `testing` feature).
#[cfg(any(test, feature = "testing"))]
pub mod synth;
#[cfg(not(any(test, feature = "testing")))]
#[allow(dead_code, unused_imports)]
mod synth;
#[cfg(any(test, feature = "testing"))]
pub mod synth_vq;
#[cfg(not(any(test, feature = "testing")))]
#[allow(dead_code, unused_imports)]
mod synth_vq;
mod tensors;
pub mod vq;
pub mod vq_encode;
mod vq_write;

use std::path::{Path, PathBuf};

pub use layout::{Layout, Proj, PAGE};
pub use manifest::Manifest;
pub use reader::{ExpertRecord, ExpertStore};
pub use tensors::content_fingerprint;

/// The 4-bit base store.
pub const BASE_FILE: &str = "experts.bin";

/// The non-expert tensors of a converted model.
pub const DENSE_FILE: &str = "dense.safetensors";

/// The data file of the store at `bits`: `experts.bin` at 4 bits, else
/// `experts{bits}.bin`.
pub fn data_file_name(bits: u32) -> String {
    match bits {
        4 => BASE_FILE.to_string(),
        b => format!("experts{b}.bin"),
    }
}

/// The manifest of the store at `bits`: `experts.json` at 4 bits, else
/// `experts{bits}.json`.
pub fn manifest_file_name(bits: u32) -> String {
    match bits {
        4 => "experts.json".to_string(),
        b => format!("experts{b}.json"),
    }
}

/// Whether `dir` is a converted model directory: it holds the data file of an affine
/// expert store (`experts.bin`, or only a low-bit one where a synthetic directory was
/// written without it).
pub fn is_converted(dir: &Path) -> bool {
    layout::SUPPORTED_BITS
        .iter()
        .any(|&b| dir.join(data_file_name(b)).exists())
}

/// The precision a converted directory's experts run at when none is asked: 4 bits, the
/// base store, or in a directory without `experts.bin` the most precise store whose
/// manifest is there.
pub fn default_bits(dir: &Path) -> u32 {
    if dir.join(BASE_FILE).exists() {
        return 4;
    }
    [3, 2]
        .into_iter()
        .find(|&b| dir.join(manifest_file_name(b)).exists())
        .unwrap_or(4)
}

/// Everything that can go wrong building, checking or reading a store. Each variant
/// names the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The 4-bit store every other one is built from is not there.
    #[error("{path}: missing; `dynmoe convert` writes the 4-bit expert store (`dynmoe synth --bits 4` a random one)")]
    MissingBase {
        /// `experts.bin` or `experts.json`.
        path: PathBuf,
    },
    /// A store file is not there.
    #[error("{path}: missing")]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// A manifest is not JSON of the manifest's structure.
    #[error("{path}: malformed manifest: {reason}")]
    ManifestJson {
        /// The manifest.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// A manifest field has a value this build cannot use or that disagrees with the
    /// rest of the manifest.
    #[error("{path}: field {field:?} {reason}")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A data file's size disagrees with its manifest.
    #[error("{path}: {found} bytes, the manifest implies {expected} (truncated or overwritten)")]
    Size {
        /// The data file.
        path: PathBuf,
        /// Bytes the manifest implies.
        expected: u64,
        /// Bytes on disk.
        found: u64,
    },
    /// A store whose manifest reads well but whose bytes are not what its source
    /// packs to, or whose source has changed.
    #[error("{path}: not usable: {reason}")]
    Unusable {
        /// The data file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A record whose bytes do not match the checksum its manifest gives it: damaged
    /// on disk or overwritten.
    #[error("{path}: record {record} (layer {layer}, expert {expert}) is damaged: checksum {found}, the manifest says {expected}")]
    Damaged {
        /// The data file.
        path: PathBuf,
        /// The record's index in the file.
        record: usize,
        /// Its MoE layer.
        layer: usize,
        /// Its expert.
        expert: usize,
        /// The checksum of the bytes on disk.
        found: String,
        /// The checksum the manifest gives.
        expected: String,
    },
    /// A mapped data file changed in place under the running process (truncated,
    /// copied over): its records can no longer be trusted, or even read.
    #[error("{path}: changed while in use ({what}); stopped rather than read it")]
    Changed {
        /// The data file.
        path: PathBuf,
        /// What changed.
        what: String,
    },
    /// A path that should be a regular file is something else (a FIFO, a device, a
    /// directory), which reading would hang on or misread.
    #[error("{path}: not a regular file")]
    NotRegular {
        /// The path.
        path: PathBuf,
    },
    /// A precision no store holds.
    #[error("{bits}-bit stores are not supported (supported: 2, 3 and 4)")]
    UnsupportedBits {
        /// The precision asked for.
        bits: u32,
    },
    /// Expert dimensions that no layout holds.
    #[error("expert shape: {reason}")]
    BadShape {
        /// What is wrong.
        reason: String,
    },
    /// Conversion would write over its own input.
    #[error("{dir}: the output directory is the checkpoint directory; choose another")]
    SameDirectory {
        /// The directory.
        dir: PathBuf,
    },
    /// A tensor could not be quantized.
    #[error("{path}: tensor {tensor}: {reason}")]
    Codec {
        /// The shard holding it.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What the codec said.
        reason: String,
    },
    /// A matrix could not be encoded.
    #[error("{tensor}: {source}")]
    Encode {
        /// The matrix.
        tensor: String,
        /// What the codec said.
        source: crate::codec::CodecError,
    },
    /// The checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::Error),
}

/// The JSON value of the manifest at `path`: a missing file is [`Error::Missing`], text
/// that is not JSON [`Error::ManifestJson`]. Callers check `format` and `version` on the
/// value before deserialising it ([`manifest_from_value`]), so that an older manifest is
/// named as older rather than as malformed.
pub(crate) fn read_manifest_value(path: &Path) -> Result<serde_json::Value, Error> {
    let text = read_file(path)?;
    serde_json::from_slice(&text).map_err(|e| Error::ManifestJson {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// The bytes of the regular file at `path`; a missing file is [`Error::Missing`], a FIFO
/// or device [`Error::NotRegular`].
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, Error> {
    crate::checkpoint::read_regular(path).map_err(atomic::regular_error)
}

/// A manifest read by [`read_manifest_value`], as `T`.
pub(crate) fn manifest_from_value<T: serde::de::DeserializeOwned>(
    path: &Path,
    value: serde_json::Value,
) -> Result<T, Error> {
    serde_json::from_value(value).map_err(|e| Error::ManifestJson {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

impl Error {
    /// A bad manifest field.
    pub fn manifest(path: &Path, field: &str, reason: impl Into<String>) -> Error {
        Error::Manifest {
            path: path.to_path_buf(),
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}
