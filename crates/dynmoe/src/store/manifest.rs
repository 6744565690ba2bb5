//! The JSON manifest beside each store file (`experts.bin` → `experts.json`,
//! `experts2.bin` → `experts2.json`, `experts3.bin` → `experts3.json`).
//!
//! A manifest states what its store holds (precision, layout version, expert shape,
//! record size and count) and what it was built from (a fingerprint of the checkpoint
//! for the base store, of the base store for a low-bit one). It is written after its
//! data file and is the commit mark of a store: a data file without a manifest is never
//! trusted. The manifest is only a claim, though; see `lowbit::usable` for the check of
//! the bytes themselves.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::layout::{Layout, PAGE};
use super::Error;
use crate::codec::affine::GROUP_SIZE;

/// The `format` field of every manifest.
pub const FORMAT: &str = "dynmoe-expert-store";

/// The current version: the records of version 2 ([`VERSION_UNCHECKED`]) and a
/// checksum of every record in the manifest (see `docs/FORMAT.md`).
pub const VERSION: u32 = 3;

/// The records of the current layout (2- and 3-bit codes laid out so that one masked
/// cast yields four codes consecutive in the deinterleaved input) without checksums: a
/// damaged record could not be told from a good one, so such a store is rebuilt (2 and
/// 3 bits) or converted again (4 bits).
pub const VERSION_UNCHECKED: u32 = 2;

/// The older layout, whose 2-bit codes sit one after another in input order. Kernels
/// for the current layout would read such a store as noise, so it is always rebuilt.
pub const VERSION_SEQUENTIAL_Q2: u32 = 1;

/// The `scale_dtype` of every store: scales and biases are bf16.
pub const SCALE_DTYPE: &str = "bf16";

/// The contents of a manifest file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Layout version ([`VERSION`] for stores this build writes).
    pub version: u32,
    /// Name of the data file, relative to the manifest's directory.
    pub file: String,
    /// Bits per code: 4 for `experts.bin`, 2 or 3 for the low-bit stores.
    pub bits: u32,
    /// Weights per scale/bias pair along a row: 64.
    pub group_size: usize,
    /// Element type of scales and biases: `bf16`.
    pub scale_dtype: String,
    /// Bytes between record starts: 16384.
    pub page: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of an expert's hidden layer.
    pub intermediate: usize,
    /// The MoE layers, ascending: record `i` belongs to `layers[i / experts_per_layer]`.
    pub layers: Vec<usize>,
    /// Routed experts per MoE layer.
    pub experts_per_layer: usize,
    /// Bytes per record.
    pub record_size: u64,
    /// Records in the file: `layers.len() × experts_per_layer`.
    pub record_count: u64,
    /// Size of the data file: `record_count × record_size`.
    pub file_size: u64,
    /// Per record, in record order, its [`record_checksum`]: FNV-1a 64 over the whole
    /// record, padding included.
    pub checksums: Vec<String>,
    /// Identity of this store's contents; derived stores name it as their source.
    pub fingerprint: String,
    /// The model the experts belong to.
    pub model: ModelInfo,
    /// What the store was built from.
    pub source: Source,
    /// Who built it, and when.
    pub created: Created,
}

/// The model a store belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// `model_type` of its `config.json`.
    pub model_type: String,
    /// Name of the checkpoint directory it was converted from.
    pub name: String,
}

/// What a store was built from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// `checkpoint` (the base store, or a VQ store encoded from it), `store` (a low-bit
    /// store, from `experts.bin`) or `synthetic` (random records, see `store::synth` and
    /// `store::synth_vq`).
    pub kind: String,
    /// For a checkpoint: FNV-1a 64 over its shards' names, sizes and headers and its
    /// `config.json`. For a store: the source store's own `fingerprint`. For random
    /// records: FNV-1a 64 over the generator, its seed and the experts' shape.
    pub fingerprint: String,
    /// The source files and their sizes in bytes (none for random records).
    pub files: Vec<SourceFile>,
    /// For random records: the generator and seed that make them again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator: Option<Generator>,
}

/// The random generator of a synthetic store's records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Generator {
    /// Name and version of the generator (`store::synth::GENERATOR` for affine stores,
    /// `store::synth_vq::GENERATOR` for VQ stores).
    pub name: String,
    /// Its seed.
    pub seed: u64,
}

/// One source file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    /// File name, relative to the source directory.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
}

/// Who built a store, and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Created {
    /// Program and version.
    pub by: String,
    /// Seconds since the Unix epoch.
    pub unix_time: u64,
    /// What the step did, in words.
    pub note: String,
}

impl Created {
    /// Stamped now by this build of dynmoe.
    pub fn now(note: &str) -> Created {
        Created {
            by: format!("dynmoe {}", env!("CARGO_PKG_VERSION")),
            unix_time: unix_time(),
            note: note.to_string(),
        }
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Manifest {
    /// Reads a manifest, checking only that it is JSON of the right structure and
    /// format; [`Manifest::layout`] checks that its fields agree with each other.
    pub fn read(path: &Path) -> Result<Manifest, Error> {
        // Format and version first: an older manifest may not parse as this one, and
        // "older layout" is a better answer than "missing field".
        let value = super::read_manifest_value(path)?;
        let field = |name: &str| value.get(name).cloned().unwrap_or_default();
        if field("format") != FORMAT {
            return Err(Error::manifest(
                path,
                "format",
                format!("is {}, expected {FORMAT:?}", field("format")),
            ));
        }
        if let Some(version) = field("version").as_u64() {
            if version != VERSION as u64 {
                return Err(Error::manifest(path, "version", version_reason(version)));
            }
        }
        super::manifest_from_value(path, value)
    }

    /// Writes the manifest as pretty JSON (not atomically: see `atomic::create_output`).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("a manifest serialises");
        bytes.push(b'\n');
        bytes
    }

    /// Checks that the fields agree with each other and with this build's layout, and
    /// returns the layout they describe. `path` names the manifest in errors.
    pub fn layout(&self, path: &Path) -> Result<Layout, Error> {
        let bad = |field: &str, reason: String| Err(Error::manifest(path, field, reason));
        if self.version != VERSION {
            return bad("version", version_reason(self.version as u64));
        }
        if self.group_size != GROUP_SIZE {
            return bad(
                "group_size",
                format!("is {}, expected {GROUP_SIZE}", self.group_size),
            );
        }
        if self.scale_dtype != SCALE_DTYPE {
            return bad(
                "scale_dtype",
                format!("is {:?}, expected {SCALE_DTYPE:?}", self.scale_dtype),
            );
        }
        if self.page != PAGE {
            return bad("page", format!("is {}, expected {PAGE}", self.page));
        }
        let layout = Layout::new(self.bits, self.hidden, self.intermediate)
            .map_err(|e| Error::manifest(path, "bits", e.to_string()))?;
        if self.record_size != layout.record_size as u64 {
            return bad(
                "record_size",
                format!(
                    "is {}, the layout of {}-bit experts {}×{} needs {}",
                    self.record_size, self.bits, self.hidden, self.intermediate, layout.record_size
                ),
            );
        }
        let count = (self.layers.len() * self.experts_per_layer) as u64;
        if self.record_count != count || count == 0 {
            return bad(
                "record_count",
                format!(
                    "is {}, {} layers × {} experts make {count}",
                    self.record_count,
                    self.layers.len(),
                    self.experts_per_layer
                ),
            );
        }
        if self.file_size != layout.file_size(count as usize) {
            return bad(
                "file_size",
                format!(
                    "is {}, {count} records need {}",
                    self.file_size,
                    layout.file_size(count as usize)
                ),
            );
        }
        if !self.layers.windows(2).all(|w| w[0] < w[1]) {
            return bad("layers", "must be strictly ascending".to_string());
        }
        if self.checksums.len() as u64 != count {
            return bad(
                "checksums",
                format!(
                    "has {} entries, one per record needs {count}",
                    self.checksums.len()
                ),
            );
        }
        Ok(layout)
    }

    /// Whether two manifests describe the same experts (model, layers and shape), as a
    /// low-bit store and its base must.
    pub fn same_experts(&self, other: &Manifest) -> bool {
        self.hidden == other.hidden
            && self.intermediate == other.intermediate
            && self.layers == other.layers
            && self.experts_per_layer == other.experts_per_layer
            && self.model == other.model
    }
}

fn version_reason(version: u64) -> String {
    match version {
        1 => "is 1: the older layout, with 2-bit codes one at a time in input order".to_string(),
        2 => "is 2: written before stores carried record checksums (`dynmoe store ensure` \
              rebuilds a 2- or 3-bit store; convert the checkpoint again for experts.bin)"
            .to_string(),
        v if v > VERSION as u64 => format!("is {v}, newer than this build reads ({VERSION})"),
        v => format!("is {v}, expected {VERSION}"),
    }
}

/// The checksum of a whole record, padding included, as manifests write it: FNV-1a 64
/// over its bytes (`fnv1a64:` and 16 hex digits). The affine stores' `checksums` and the
/// VQ stores' `layers[i].checksums` hold these.
pub fn record_checksum(record: &[u8]) -> String {
    Fnv64::default().bytes(record).hex()
}

/// FNV-1a, 64 bits: a small, well-defined hash for change detection (never for
/// security or integrity against an adversary). Byte strings are hashed with their
/// length first so that concatenations cannot collide by shifting a boundary.
#[derive(Debug, Clone, Copy)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv64 {
    /// Hashes raw bytes.
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }

    /// Hashes a u64, little-endian.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Hashes a length-prefixed byte string.
    pub fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.u64(bytes.len() as u64).bytes(bytes)
    }

    /// The hash so far.
    pub fn finish(&self) -> u64 {
        self.0
    }

    /// The hash as written in manifests: `fnv1a64:` and 16 hex digits.
    pub fn hex(&self) -> String {
        format!("fnv1a64:{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_known_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(Fnv64::default().finish(), 0xcbf29ce484222325);
        assert_eq!(Fnv64::default().bytes(b"a").finish(), 0xaf63dc4c8601ec8c);
        assert_eq!(
            Fnv64::default().bytes(b"foobar").finish(),
            0x85944171f73967e8
        );
    }

    #[test]
    fn field_boundaries_matter() {
        let a = Fnv64::default().field(b"ab").field(b"c").finish();
        let b = Fnv64::default().field(b"a").field(b"bc").finish();
        assert_ne!(a, b);
    }
}
