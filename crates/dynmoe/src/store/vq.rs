//! VQ expert stores: the routed experts of chosen MoE layers coded at a rung of the VQ
//! ladder, encoded once from a Hugging Face checkpoint and kept beside it.
//!
//! There is one store per rung, `experts-vq{bits}.bin` with its manifest
//! `experts-vq{bits}.json` (`experts-vq1.5.bin`, `experts-vq2.bin`, ...), holding the
//! layers asked for at that rung so far. A plan that puts its layers at several rungs
//! reads several stores; a later plan that moves a layer to a rung whose store lacks it
//! extends that store, copying the records it already holds and encoding only the new
//! layer. Records are page-aligned, one expert each: a 64-byte header (layer, expert,
//! the three rotation seeds, the rung), then gate, up and down codes and their fp16
//! block norms, so a record read into a slot or mapped in place is three [`VqView`]s
//! with no copy. `docs/FORMAT.md` §13 specifies the bytes.
//!
//! The manifest names the checkpoint the store was encoded from (its fingerprint: shard
//! headers and `config.json`), the codebook the codes index, and a checksum of every
//! record. Stores are written as the affine ones are (`atomic`): data to a temporary
//! file, flushed, renamed, then the manifest, under the directory's exclusive lock, the
//! manifest removed first; so a half-written store is never used. One writer
//! ([`write_store`]) does this for stores encoded here and for stores of random records
//! ([`super::synth_vq`]), whose manifest names their generator instead of a checkpoint
//! and which opening holds to it (a few records made again and compared).
//!
//! ```no_run
//! use std::collections::BTreeMap;
//! use std::path::Path;
//! use dynmoe::codec::vq::Rung;
//! use dynmoe::checkpoint::{Checkpoint, Config};
//! use dynmoe::store::vq;
//! let dir = Path::new("Qwen3-30B-A3B");
//! let config = Config::from_file(&dir.join("config.json"))?;
//! let ckpt = Checkpoint::open(dir)?;
//! let rungs = config.moe_layers().map(|l| (l, Rung::parse("vq2").unwrap())).collect();
//! let done = vq::ensure(dir, &config, &ckpt, &rungs, &mut |_, _| {})?;
//! let [gate, _up, _down] = done.stores[&0].record(0, 5);
//! assert_eq!(gate.rows, config.moe.expert_intermediate);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use half::f16;
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::atomic;
use super::layout::{round_up, Part, ALIGN, PAGE};
use super::manifest::{Created, Fnv64, ModelInfo, Source};
use super::{lowbit, tensors, Error};
use crate::checkpoint::experts::expert_tensors;
use crate::checkpoint::{experts::ExpertShape, experts::Extent};
use crate::checkpoint::{Checkpoint, Config};
use crate::codec::vq::{rotation, row_bytes, Rung, VqMatrix, VqView};
use crate::store::{records::LayerSource, records::RecordFormat};
use crate::store::{vq_encode::encode_expert, vq_encode::vq_seed};

/// The `format` field of every VQ store manifest.
pub const FORMAT: &str = "dynmoe-vq-expert-store";

/// The record layout version this build writes and reads.
pub const VERSION: u32 = 1;

/// Bytes of the header at the start of every record.
pub const HEADER: usize = 64;

/// The first eight bytes of every record.
pub const RECORD_MAGIC: [u8; 8] = *b"DMVQREC1";

/// Stores up to this size have every record's checksum verified when opened (about a
/// tenth of a second); larger ones a spot check of records spread through the file, as
/// the affine stores do.
pub const FULL_CHECK_BYTES: u64 = 256 << 20;

/// How the rotation seed of each matrix follows from its place in the model, as the
/// manifest's `seed` field states it (see [`vq_seed`]).
pub const SEED_RULE: &str = "(layer * experts_per_layer + expert) * 3 + projection";

/// The data file of `rung`'s store: `experts-vq1.5.bin`.
pub fn data_file_name(rung: Rung) -> String {
    format!("experts-{}.bin", rung.name())
}

/// The manifest of `rung`'s store: `experts-vq1.5.json`.
pub fn manifest_file_name(rung: Rung) -> String {
    format!("experts-{}.json", rung.name())
}

/// Where one projection's codes and norms sit in a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VqMatrixLayout {
    /// Output features.
    pub rows: usize,
    /// Input features, as in the checkpoint (no padding: the rotation pads its blocks).
    pub cols: usize,
    /// Rotation block, `rotation::block_size(cols)`.
    pub block: usize,
    /// `rows × row_bytes(rung, cols)` bytes of codes.
    pub codes: Part,
    /// `rows × ⌈cols / block⌉` fp16 norms.
    pub norms: Part,
}

/// The layout of every record of one VQ store: one rung, one expert shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VqLayout {
    /// The rung.
    pub rung: Rung,
    /// Residual width.
    pub hidden: usize,
    /// Expert width.
    pub intermediate: usize,
    /// Gate, up and down, in record order.
    pub matrices: [VqMatrixLayout; 3],
    /// One past the last meaningful byte; the rest of the record is zero.
    pub data_end: usize,
    /// Bytes per record: `data_end` rounded up to [`PAGE`].
    pub record_size: usize,
}

impl VqLayout {
    /// The layout of a record of an expert of this shape at `rung`: the header, the
    /// three code parts, then the three norm parts, each at a multiple of [`ALIGN`].
    pub fn new(rung: Rung, hidden: usize, intermediate: usize) -> Result<VqLayout, Error> {
        if hidden == 0 || intermediate == 0 {
            return Err(Error::BadShape {
                reason: format!("hidden {hidden} and intermediate {intermediate} must be positive"),
            });
        }
        let shapes = [
            (intermediate, hidden),
            (intermediate, hidden),
            (hidden, intermediate),
        ];
        let mut cursor = HEADER;
        let mut take = |len: usize| {
            let part = Part {
                offset: round_up(cursor, ALIGN),
                len,
            };
            cursor = part.end();
            part
        };
        let codes = shapes.map(|(rows, cols)| take(rows * row_bytes(rung, cols)));
        let norms =
            shapes.map(|(rows, cols)| take(rows * cols.div_ceil(rotation::block_size(cols)) * 2));
        let matrices = [0, 1, 2].map(|m| VqMatrixLayout {
            rows: shapes[m].0,
            cols: shapes[m].1,
            block: rotation::block_size(shapes[m].1),
            codes: codes[m],
            norms: norms[m],
        });
        Ok(VqLayout {
            rung,
            hidden,
            intermediate,
            matrices,
            data_end: cursor,
            record_size: round_up(cursor, PAGE),
        })
    }

    /// File offset of record `index`.
    pub fn record_offset(&self, index: usize) -> u64 {
        index as u64 * self.record_size as u64
    }

    /// Size of a store of `records` records.
    pub fn file_size(&self, records: usize) -> u64 {
        self.record_offset(records)
    }
}

/// The header of a record, as [`pack_record`] writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// Decoder layer.
    pub layer: u32,
    /// Expert id.
    pub expert: u32,
    /// Rotation seeds of gate, up and down.
    pub seeds: [u64; 3],
    /// Values per vector, `p`.
    pub dim: u32,
    /// Bits per index, `k`.
    pub index_bits: u32,
}

impl RecordHeader {
    /// The header at the start of `record`, or `None` when the magic is not there.
    pub fn read(record: &[u8]) -> Option<RecordHeader> {
        if record.len() < HEADER || record[..8] != RECORD_MAGIC {
            return None;
        }
        let u32_at = |at: usize| u32::from_le_bytes(record[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(record[at..at + 8].try_into().unwrap());
        Some(RecordHeader {
            layer: u32_at(8),
            expert: u32_at(12),
            seeds: [u64_at(16), u64_at(24), u64_at(32)],
            dim: u32_at(40),
            index_bits: u32_at(44),
        })
    }

    fn write(&self, record: &mut [u8]) {
        record[..8].copy_from_slice(&RECORD_MAGIC);
        record[8..12].copy_from_slice(&self.layer.to_le_bytes());
        record[12..16].copy_from_slice(&self.expert.to_le_bytes());
        for (i, s) in self.seeds.iter().enumerate() {
            record[16 + 8 * i..24 + 8 * i].copy_from_slice(&s.to_le_bytes());
        }
        record[40..44].copy_from_slice(&self.dim.to_le_bytes());
        record[44..48].copy_from_slice(&self.index_bits.to_le_bytes());
    }
}

/// The record of expert `expert` of decoder layer `layer`, whose projections are
/// `mats` (gate, up, down, encoded at `layout.rung`).
///
/// # Panics
/// If a matrix's shape or rung is not the layout's.
pub fn pack_record(
    layout: &VqLayout,
    layer: usize,
    expert: usize,
    mats: &[VqMatrix; 3],
) -> Vec<u8> {
    let mut out = vec![0u8; layout.record_size];
    RecordHeader {
        layer: layer as u32,
        expert: expert as u32,
        seeds: [mats[0].seed, mats[1].seed, mats[2].seed],
        dim: layout.rung.dim as u32,
        index_bits: layout.rung.index_bits,
    }
    .write(&mut out);
    for (m, l) in mats.iter().zip(&layout.matrices) {
        assert_eq!(
            (m.rows, m.cols, m.rung),
            (l.rows, l.cols, layout.rung),
            "a matrix of another shape or rung"
        );
        out[l.codes.range()].copy_from_slice(&m.codes);
        for (d, n) in out[l.norms.range()].chunks_exact_mut(2).zip(&m.norms) {
            d.copy_from_slice(&n.to_le_bytes());
        }
    }
    out
}

/// Gate, up and down of a record of `layout` held anywhere (mapped, or in a resident
/// slot), viewed in place. The seeds come from the record's header.
///
/// # Panics
/// If `bytes` is shorter than a record or not aligned to 2 bytes.
pub fn record_views<'a>(layout: &VqLayout, bytes: &'a [u8]) -> [VqView<'a>; 3] {
    assert!(
        bytes.len() >= layout.record_size,
        "a record is {} bytes",
        layout.record_size
    );
    let seed = |m: usize| u64::from_le_bytes(bytes[16 + 8 * m..24 + 8 * m].try_into().unwrap());
    [0, 1, 2].map(|m| {
        let l = &layout.matrices[m];
        VqView::from_parts(
            l.rows,
            l.cols,
            layout.rung,
            seed(m),
            cast_f16(&bytes[l.norms.range()]),
            &bytes[l.codes.range()],
        )
        .expect("the layout sizes every part")
    })
}

fn cast_f16(bytes: &[u8]) -> &[f16] {
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(align_of::<f16>())
            && bytes.len().is_multiple_of(2)
    );
    // SAFETY: f16 is a transparent wrapper of u16, valid for every bit pattern; the
    // pointer is aligned and the length a whole number of elements (checked above);
    // records are little-endian, as is every machine dynmoe runs on (see `reader`).
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f16>(), bytes.len() / 2) }
}

/// One MoE layer's records in a store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VqLayerEntry {
    /// Decoder layer.
    pub layer: usize,
    /// File offset of its first record (expert 0); expert `e` is `e × record_size`
    /// further.
    pub offset: u64,
    /// Per expert, FNV-1a 64 of its whole record (`fnv1a64:` and 16 hex digits).
    pub checksums: Vec<String>,
}

/// The contents of a VQ store's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VqManifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Record layout version, [`VERSION`].
    pub version: u32,
    /// Name of the data file.
    pub file: String,
    /// The rung's name, `vq1.5`.
    pub rung: String,
    /// Values per vector, `p`.
    pub dim: usize,
    /// Bits per index, `k`.
    pub index_bits: u32,
    /// FNV-1a 64 of the codebook file the codes index.
    pub codebook: String,
    /// Records start at multiples of this: 16384.
    pub page: usize,
    /// Bytes of each record's header: 64.
    pub header: usize,
    /// Residual width.
    pub hidden: usize,
    /// Expert width.
    pub intermediate: usize,
    /// Routed experts per MoE layer.
    pub experts_per_layer: usize,
    /// How rotation seeds are chosen: [`SEED_RULE`].
    pub seed: String,
    /// Bytes per record.
    pub record_size: u64,
    /// Records in the file: `layers.len() × experts_per_layer`.
    pub record_count: u64,
    /// Size of the data file: `record_count × record_size`.
    pub file_size: u64,
    /// The layers held, ascending, with their records' place and checksums.
    pub layers: Vec<VqLayerEntry>,
    /// The model the experts belong to.
    pub model: ModelInfo,
    /// The checkpoint they were encoded from.
    pub source: Source,
    /// Who built the store, and when.
    pub created: Created,
}

impl VqManifest {
    /// Reads a manifest, checking that it is JSON of the right structure, format and
    /// version; `check` compares its fields with what is expected.
    pub fn read(path: &Path) -> Result<VqManifest, Error> {
        let value = super::read_manifest_value(path)?;
        let field = |name: &str| value.get(name).cloned().unwrap_or_default();
        if field("format") != FORMAT {
            return Err(Error::manifest(
                path,
                "format",
                format!("is {}, expected {FORMAT:?}", field("format")),
            ));
        }
        if field("version") != VERSION {
            return Err(Error::manifest(
                path,
                "version",
                format!("is {}, this build reads {VERSION}", field("version")),
            ));
        }
        super::manifest_from_value(path, value)
    }

    /// Pretty JSON and a newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("a manifest serialises");
        bytes.push(b'\n');
        bytes
    }

    /// Checks every field against `rung`, the checkpoint `want` describes and each
    /// other, and returns the layout they describe. `path` names the manifest in errors.
    fn check(&self, path: &Path, rung: Rung, want: &Expected) -> Result<VqLayout, Error> {
        let bad = |field: &str, reason: String| Err(Error::manifest(path, field, reason));
        let differs = |field: &str, found: &dyn std::fmt::Debug, expected: &dyn std::fmt::Debug| {
            Err(Error::manifest(
                path,
                field,
                format!("is {found:?}, expected {expected:?}"),
            ))
        };
        if self.file != data_file_name(rung) {
            return differs("file", &self.file, &data_file_name(rung));
        }
        if self.rung != rung.name() {
            return differs("rung", &self.rung, &rung.name());
        }
        if (self.dim, self.index_bits) != (rung.dim, rung.index_bits) {
            return bad(
                "dim",
                format!(
                    "dim {} and index_bits {} are not {}'s {} and {}",
                    self.dim,
                    self.index_bits,
                    rung.name(),
                    rung.dim,
                    rung.index_bits
                ),
            );
        }
        let book = codebook_id(rung).map_err(|reason| Error::manifest(path, "codebook", reason))?;
        if self.codebook != book {
            return bad(
                "codebook",
                format!(
                    "is {}, the {} codebook of this build is {book}: the codes index another codebook",
                    self.codebook,
                    rung.name()
                ),
            );
        }
        if self.page != PAGE {
            return differs("page", &self.page, &PAGE);
        }
        if self.header != HEADER {
            return differs("header", &self.header, &HEADER);
        }
        if self.seed != SEED_RULE {
            return differs("seed", &self.seed, &SEED_RULE);
        }
        let s = &want.shape;
        for (field, found, expected) in [
            ("hidden", self.hidden, s.hidden),
            ("intermediate", self.intermediate, s.intermediate),
            ("experts_per_layer", self.experts_per_layer, s.experts),
        ] {
            if found != expected {
                return bad(
                    field,
                    format!("is {found}, the checkpoint's config.json says {expected}"),
                );
            }
        }
        if self.model.model_type != want.model_type {
            return differs("model.model_type", &self.model.model_type, &want.model_type);
        }
        if self.source.fingerprint != want.source.fingerprint {
            return bad(
                "source.fingerprint",
                format!(
                    "is {}, the directory's source (the checkpoint beside it, or the \
                     source_fingerprint of its compressed.json) is {}: the store was made from \
                     another checkpoint or generator (or the source changed)",
                    self.source.fingerprint, want.source.fingerprint
                ),
            );
        }
        let layout = VqLayout::new(rung, s.hidden, s.intermediate)?;
        if self.record_size != layout.record_size as u64 {
            return bad(
                "record_size",
                format!(
                    "is {}, {} records of experts {}×{} are {}",
                    self.record_size,
                    rung.name(),
                    s.hidden,
                    s.intermediate,
                    layout.record_size
                ),
            );
        }
        if self.layers.is_empty() {
            return bad("layers", "is empty".to_string());
        }
        for (i, entry) in self.layers.iter().enumerate() {
            if !want.moe_layers.contains(&entry.layer) {
                return bad(
                    &format!("layers[{i}].layer"),
                    format!(
                        "is {}, not a MoE layer of the checkpoint ({:?})",
                        entry.layer, want.moe_layers
                    ),
                );
            }
            if i > 0 && entry.layer <= self.layers[i - 1].layer {
                return bad("layers", "must be strictly ascending".to_string());
            }
            let offset = layout.record_offset(i * s.experts);
            if entry.offset != offset {
                return bad(
                    &format!("layers[{i}].offset"),
                    format!("is {}, expected {offset}", entry.offset),
                );
            }
            if entry.checksums.len() != s.experts {
                return bad(
                    &format!("layers[{i}].checksums"),
                    format!(
                        "has {} entries, one per expert makes {}",
                        entry.checksums.len(),
                        s.experts
                    ),
                );
            }
        }
        let count = self.layers.len() * s.experts;
        if self.record_count != count as u64 {
            return differs("record_count", &self.record_count, &count);
        }
        if self.file_size != layout.file_size(count) {
            return differs("file_size", &self.file_size, &layout.file_size(count));
        }
        Ok(layout)
    }
}

/// FNV-1a 64 of `rung`'s codebook file as this build ships it.
pub(crate) fn codebook_id(rung: Rung) -> Result<String, String> {
    let book = rung.codebook().map_err(|e| e.to_string())?;
    Ok(Fnv64::default().bytes(&book.to_bytes()).hex())
}

/// What a store in a directory must agree with: the checkpoint beside it.
struct Expected {
    shape: ExpertShape,
    moe_layers: Vec<usize>,
    model_type: String,
    name: String,
    source: Source,
}

impl Expected {
    fn of(dir: &Path, config: &Config, ckpt: &Checkpoint) -> Result<Expected, Error> {
        let (fingerprint, files) = tensors::fingerprint(ckpt, &dir.join("config.json"))?;
        Ok(Expected::with_source(dir, config, fingerprint, files))
    }

    fn with_source(
        dir: &Path,
        config: &Config,
        fingerprint: String,
        files: Vec<super::manifest::SourceFile>,
    ) -> Expected {
        Expected {
            shape: ExpertShape::of(config),
            moe_layers: config.moe_layers().collect(),
            model_type: config.arch.model_type().to_string(),
            name: dir
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_default(),
            source: Source {
                kind: "checkpoint".to_string(),
                fingerprint,
                files,
                generator: None,
            },
        }
    }
}

/// An opened VQ store: manifest checked against the checkpoint beside it, record
/// checksums verified, data mapped.
pub struct VqStore {
    path: PathBuf,
    manifest: VqManifest,
    layout: VqLayout,
    mmap: Mmap,
    file: std::fs::File,
    stamp: atomic::FileStamp,
    /// Per layer entry, whether all its records passed their checksums and headers.
    verified: Vec<AtomicBool>,
}

impl VqStore {
    /// Opens and checks `rung`'s store in the checkpoint directory `dir` (reading its
    /// `config.json` and shard headers to compare). Nothing is built here: see
    /// [`ensure`]. Every way the store can be unusable is an error naming the file and
    /// the field or record.
    pub fn open(dir: &Path, rung: Rung) -> Result<VqStore, Error> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        let want = Expected::of(dir, &config, &ckpt)?;
        let _lock = atomic::lock_shared(dir)?;
        open_checked(dir, rung, &want)
    }

    /// Opens and checks `rung`'s store in `dir` when the checkpoint it was encoded from
    /// is not beside it (a compressed model directory, [`super::compressed`]): the
    /// store must name `fingerprint`, which the directory's own manifest records.
    pub fn open_encoded_from(dir: &Path, rung: Rung, fingerprint: &str) -> Result<VqStore, Error> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let want = Expected::with_source(dir, &config, fingerprint.to_string(), Vec::new());
        let _lock = atomic::lock_shared(dir)?;
        open_checked(dir, rung, &want)
    }

    /// The rung.
    pub fn rung(&self) -> Rung {
        self.layout.rung
    }

    /// The record layout.
    pub fn layout(&self) -> &VqLayout {
        &self.layout
    }

    /// The manifest.
    pub fn manifest(&self) -> &VqManifest {
        &self.manifest
    }

    /// The data file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The layers held, ascending.
    pub fn layers(&self) -> Vec<usize> {
        self.manifest.layers.iter().map(|l| l.layer).collect()
    }

    /// The record index of `expert` of decoder layer `layer`, if the store holds it.
    pub fn record_index(&self, layer: usize, expert: usize) -> Option<usize> {
        let per_layer = self.manifest.experts_per_layer;
        let pos = self
            .manifest
            .layers
            .binary_search_by_key(&layer, |l| l.layer)
            .ok()?;
        (expert < per_layer).then_some(pos * per_layer + expert)
    }

    /// The bytes of record `index`.
    pub fn record_bytes(&self, index: usize) -> &[u8] {
        let start = self.layout.record_offset(index) as usize;
        &self.mmap[start..start + self.layout.record_size]
    }

    /// Gate, up and down of `expert` of decoder layer `layer`, in place.
    ///
    /// # Panics
    /// If the store does not hold the layer or `expert` is out of range.
    pub fn record(&self, layer: usize, expert: usize) -> [VqView<'_>; 3] {
        let index = self.record_index(layer, expert).unwrap_or_else(|| {
            panic!(
                "{}: no record for layer {layer} expert {expert} (layers {:?}, {} experts each)",
                self.path.display(),
                self.layers(),
                self.manifest.experts_per_layer
            )
        });
        record_views(&self.layout, self.record_bytes(index))
    }

    /// Where each expert of `layer` sits in the data file: what a reservoir reads.
    ///
    /// # Panics
    /// If the store does not hold the layer.
    pub fn layer_source(&self, layer: usize) -> LayerSource {
        let index = |e| {
            self.record_index(layer, e)
                .unwrap_or_else(|| panic!("{}: no layer {layer}", self.path.display()))
        };
        let experts = 0..self.manifest.experts_per_layer;
        LayerSource {
            format: RecordFormat::Vq(self.layout),
            experts: (experts.clone())
                .map(|e| {
                    let (offset, len) =
                        (self.layout.record_offset(index(e)), self.layout.record_size);
                    vec![Extent {
                        file: self.path.clone(),
                        offset,
                        len,
                    }]
                })
                .collect(),
            checksums: Some(
                experts
                    .map(|e| self.checksum(index(e)).to_string())
                    .collect(),
            ),
        }
    }

    /// Checks every record of decoder layer `layer` (checksum and header) the first time
    /// it is asked, in parallel; at once for a store small enough to have been checked
    /// whole when opened. The error names the first bad record.
    ///
    /// # Panics
    /// If the store does not hold the layer.
    pub fn verify_layer(&self, layer: usize) -> Result<(), Error> {
        let pos = self
            .manifest
            .layers
            .binary_search_by_key(&layer, |l| l.layer)
            .unwrap_or_else(|_| panic!("{}: no layer {layer}", self.path.display()));
        if self.verified[pos].load(Ordering::Acquire) {
            return Ok(());
        }
        let manifest_path = self
            .path
            .with_file_name(manifest_file_name(self.layout.rung));
        let per_layer = self.manifest.experts_per_layer;
        let first = pos * per_layer;
        let bad = (first..first + per_layer)
            .into_par_iter()
            .filter(|&i| self.verify(&manifest_path, i).is_err())
            .min();
        if let Some(i) = bad {
            return self.verify(&manifest_path, i);
        }
        self.verified[pos].store(true, Ordering::Release);
        Ok(())
    }

    /// [`Error::Changed`] if the data file was changed in place since it was mapped
    /// (see `ExpertStore::check_unchanged`).
    pub fn check_unchanged(&self) -> Result<(), Error> {
        self.stamp.check(&self.file, &self.path)
    }

    /// The checksum the manifest gives record `index`.
    fn checksum(&self, index: usize) -> &str {
        let per_layer = self.manifest.experts_per_layer;
        &self.manifest.layers[index / per_layer].checksums[index % per_layer]
    }

    /// Whether record `index` is what the manifest says: its checksum and its header.
    fn verify(&self, manifest_path: &Path, index: usize) -> Result<(), Error> {
        let per_layer = self.manifest.experts_per_layer;
        let (pos, e) = (index / per_layer, index % per_layer);
        let layer = self.manifest.layers[pos].layer;
        let bytes = self.record_bytes(index);
        let unusable = |reason: String| Error::Unusable {
            path: self.path.clone(),
            reason: format!("record {index} (layer {layer}, expert {e}): {reason}"),
        };
        let sum = record_checksum(bytes);
        if sum != self.checksum(index) {
            return Err(unusable(format!(
                "checksum {sum} differs from field layers[{pos}].checksums[{e}] of {} ({}): \
                 damaged on disk or overwritten",
                manifest_path.display(),
                self.checksum(index)
            )));
        }
        let rung = self.layout.rung;
        let expected = RecordHeader {
            layer: layer as u32,
            expert: e as u32,
            seeds: [0, 1, 2].map(|p| vq_seed(layer, per_layer, e, p)),
            dim: rung.dim as u32,
            index_bits: rung.index_bits,
        };
        match RecordHeader::read(bytes) {
            Some(h) if h == expected => Ok(()),
            Some(h) => Err(unusable(format!(
                "header {h:?}, expected {expected:?} (layer, expert, seeds and rung)"
            ))),
            None => Err(unusable("no record header (magic DMVQREC1)".to_string())),
        }
    }

    fn holds(&self, layers: &[usize]) -> bool {
        layers.iter().all(|&l| self.record_index(l, 0).is_some())
    }
}

/// Opens `rung`'s store in `dir` and checks it against `want`: manifest fields, the data
/// file's size, and record checksums and headers (all of them up to
/// [`FULL_CHECK_BYTES`], else a spot check). Takes no lock.
fn open_checked(dir: &Path, rung: Rung, want: &Expected) -> Result<VqStore, Error> {
    let manifest_path = dir.join(manifest_file_name(rung));
    let path = dir.join(data_file_name(rung));
    let manifest = VqManifest::read(&manifest_path)?;
    let layout = manifest.check(&manifest_path, rung, want)?;
    let io = |source| Error::Io {
        path: path.clone(),
        source,
    };
    let file = atomic::open_regular(&path)?;
    let stamp = atomic::FileStamp::of(&file, &path)?;
    let found = file.metadata().map_err(io)?.len();
    if found != manifest.file_size {
        return Err(Error::Size {
            path,
            expected: manifest.file_size,
            found,
        });
    }
    // SAFETY: read-only map. Writers never modify a committed file in place: they write
    // a new file and rename it over the old one, which leaves this mapping intact.
    let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
    if !(mmap.as_ptr() as usize).is_multiple_of(ALIGN) {
        return Err(Error::Unusable {
            path,
            reason: format!("mapped at an address not aligned to {ALIGN} bytes"),
        });
    }
    let store = VqStore {
        path,
        manifest,
        layout,
        mmap,
        file,
        stamp,
        verified: Vec::new(),
    };
    let count = store.manifest.record_count as usize;
    // A small store is checked whole now; a larger one spot-checked, and each layer in
    // full when a model first runs it (`verify_layer`).
    let whole = store.manifest.file_size <= FULL_CHECK_BYTES;
    let picks: Vec<usize> = if whole {
        (0..count).collect()
    } else {
        lowbit::spot_check_records(count, layout.record_size, layout.record_size)
    };
    for i in picks {
        store.verify(&manifest_path, i)?;
    }
    let layers = store.manifest.layers.len();
    let mut store = store;
    store.verified = (0..layers).map(|_| AtomicBool::new(whole)).collect();
    if store.manifest.source.kind == super::synth::SOURCE_KIND {
        // Random records: the manifest claims a generator and seed made them; a few are
        // made again to hold it to that.
        super::synth_vq::spot_check(&store).map_err(|reason| Error::Unusable {
            path: store.path.clone(),
            reason,
        })?;
    }
    Ok(store)
}

/// One store [`ensure`] wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Built {
    /// The rung.
    pub rung: String,
    /// The data file.
    pub path: PathBuf,
    /// Layers encoded from the checkpoint.
    pub encoded: Vec<usize>,
    /// Layers whose records were copied from the store it replaced.
    pub copied: Vec<usize>,
    /// Why the store was (re)written.
    pub reason: String,
    /// Wall time of the build.
    pub seconds: f64,
}

/// What [`ensure`] found and did.
pub struct Ensured {
    /// The store each requested layer reads, by decoder layer.
    pub stores: BTreeMap<usize, Arc<VqStore>>,
    /// The stores written (none when every one was already usable).
    pub built: Vec<Built>,
}

/// Makes sure that every layer of `rungs` (decoder layer → rung) has its routed experts
/// in a usable store of its rung in the checkpoint directory `dir`, and opens them. A
/// store that is missing, unusable (any check of [`VqStore::open`]), or lacks a layer is
/// (re)written under the directory's exclusive lock: the layers it validly held are
/// copied, the others encoded from `ckpt` (experts in parallel). `progress(done, total)`
/// counts the records written. A directory whose stores are all usable is only read.
pub fn ensure(
    dir: &Path,
    config: &Config,
    ckpt: &Checkpoint,
    rungs: &BTreeMap<usize, Rung>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Ensured, Error> {
    let want = Expected::of(dir, config, ckpt)?;
    let mut groups: BTreeMap<usize, (Rung, Vec<usize>)> = BTreeMap::new();
    for (&layer, &rung) in rungs {
        if !want.moe_layers.contains(&layer) {
            return Err(Error::BadShape {
                reason: format!(
                    "{}: layer {layer} is not a MoE layer (MoE layers: {:?})",
                    dir.join("config.json").display(),
                    want.moe_layers
                ),
            });
        }
        groups
            .entry(rung.position())
            .or_insert_with(|| (rung, Vec::new()))
            .1
            .push(layer);
    }
    let mut opened: BTreeMap<usize, Arc<VqStore>> = BTreeMap::new();
    let mut todo = Vec::new();
    {
        // Shared with other readers, exclusive of a writer mid-build.
        let _lock = atomic::lock_shared(dir)?;
        for (&pos, (rung, layers)) in &groups {
            match open_checked(dir, *rung, &want) {
                Ok(store) if store.holds(layers) => {
                    opened.insert(pos, Arc::new(store));
                }
                _ => todo.push(pos),
            }
        }
    }
    let mut built = Vec::new();
    if !todo.is_empty() {
        let _lock = atomic::lock_exclusive(dir)?;
        atomic::remove_stale_temps(dir)?;
        for pos in todo {
            let (rung, layers) = &groups[&pos];
            // Again under the lock: another process may have built it meanwhile.
            let (old, reason) = match open_checked(dir, *rung, &want) {
                Ok(store) if store.holds(layers) => {
                    opened.insert(pos, Arc::new(store));
                    continue;
                }
                Ok(store) => {
                    let reason = format!(
                        "holds layers {:?}, layers {layers:?} are asked for",
                        store.layers()
                    );
                    (Some(store), reason)
                }
                Err(e) => (None, e.to_string()),
            };
            let mut all = layers.clone();
            if let Some(old) = &old {
                all.extend(old.layers());
            }
            all.sort_unstable();
            all.dedup();
            let start = Instant::now();
            let (store, encoded, copied) = build(
                dir,
                *rung,
                &want,
                config,
                ckpt,
                &all,
                old.as_ref(),
                progress,
            )?;
            built.push(Built {
                rung: rung.name(),
                path: store.path.clone(),
                encoded,
                copied,
                reason,
                seconds: start.elapsed().as_secs_f64(),
            });
            opened.insert(pos, Arc::new(store));
        }
    }
    let stores = rungs
        .iter()
        .map(|(&layer, rung)| (layer, opened[&rung.position()].clone()))
        .collect();
    Ok(Ensured { stores, built })
}

/// Writes `rung`'s store holding `layers`: records of `old` copied where it holds the
/// layer and the record still matches its checksum, the rest encoded from the
/// checkpoint ([`write_store`]). Returns the opened store and the layers encoded and
/// copied.
#[allow(clippy::too_many_arguments)]
fn build(
    dir: &Path,
    rung: Rung,
    want: &Expected,
    config: &Config,
    ckpt: &Checkpoint,
    layers: &[usize],
    old: Option<&VqStore>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(VqStore, Vec<usize>, Vec<usize>), Error> {
    let layout = VqLayout::new(rung, want.shape.hidden, want.shape.intermediate)?;
    let experts = want.shape.experts;
    let total = layers.len() * experts;
    let batch = 2 * rayon::current_num_threads().max(1);
    let (mut encoded, mut copied) = (Vec::new(), Vec::new());
    let model = ModelInfo {
        model_type: want.model_type.clone(),
        name: want.name.clone(),
    };
    write_store(dir, &layout, experts, model, want.source.clone(), |sink| {
        progress(0, total);
        for (pos, &layer) in layers.iter().enumerate() {
            let reusable = old.filter(|s| {
                (0..experts).all(|e| {
                    let i = s.record_index(layer, e);
                    i.is_some_and(|i| record_checksum(s.record_bytes(i)) == s.checksum(i))
                })
            });
            let tensors = match reusable {
                Some(_) => None,
                None => Some(expert_tensors(config, ckpt, layer)?.0),
            };
            for first in (0..experts).step_by(batch) {
                let range = first..(first + batch).min(experts);
                let records: Vec<Vec<u8>> = match (reusable, &tensors) {
                    (Some(s), _) => range
                        .clone()
                        .map(|e| {
                            s.record_bytes(s.record_index(layer, e).expect("held"))
                                .to_vec()
                        })
                        .collect(),
                    (None, Some(t)) => range
                        .clone()
                        .into_par_iter()
                        .map(|e| {
                            let mats = encode_expert(config, ckpt, t, layer, e, [rung; 3])?;
                            Ok(pack_record(&layout, layer, e, &mats))
                        })
                        .collect::<Result<_, Error>>()?,
                    (None, None) => unreachable!("tensors are found for every layer not copied"),
                };
                for r in records {
                    sink.push(layer, &r, record_checksum(&r))?;
                }
                progress(pos * experts + range.end, total);
            }
            match reusable {
                Some(_) => copied.push(layer),
                None => encoded.push(layer),
            }
        }
        Ok(format!(
            "routed experts of layers {encoded:?} encoded at {} from the checkpoint{}",
            rung.name(),
            if copied.is_empty() {
                String::new()
            } else {
                format!("; layers {copied:?} copied from the previous store")
            }
        ))
    })?;
    Ok((open_checked(dir, rung, want)?, encoded, copied))
}

/// FNV-1a 64 of a whole record, padding included: what the manifest's
/// `layers[i].checksums` hold (the affine stores' checksums are the same function).
pub use super::manifest::record_checksum;

pub(crate) use super::vq_write::write_store;

#[cfg(test)]
mod tests {
    use super::*;

    /// The small fixture's experts (hidden 256, intermediate 80) at 2 bits, by hand:
    /// gate and up rows are one block of 256 (32 vectors of 8 × 16 bits = 64 bytes), down
    /// rows of 80 columns one block of 128 (16 vectors = 32 bytes); one norm per row.
    #[test]
    fn small_moe_record_layout_by_hand() {
        let l = VqLayout::new(Rung::parse("vq2").unwrap(), 256, 80).unwrap();
        let [g, u, d] = l.matrices;
        assert_eq!((g.codes.offset, g.codes.len), (64, 80 * 64));
        assert_eq!((u.codes.offset, u.codes.len), (5184, 80 * 64));
        assert_eq!((d.codes.offset, d.codes.len), (10304, 256 * 32));
        assert_eq!((g.norms.offset, g.norms.len), (18496, 160));
        assert_eq!((u.norms.offset, u.norms.len), (18688, 160));
        assert_eq!((d.norms.offset, d.norms.len), (18880, 512));
        assert_eq!((d.block, g.block), (128, 256));
        assert_eq!((l.data_end, l.record_size), (19392, 2 * PAGE));
        // Qwen3-30B-A3B (hidden 2048, intermediate 768): gate and up rows two blocks of
        // 1024 (512 bytes), down rows three blocks of 256 (192 bytes).
        let l = VqLayout::new(Rung::parse("vq2").unwrap(), 2048, 768).unwrap();
        let offsets = l
            .matrices
            .map(|m| (m.codes.offset, m.norms.offset, m.norms.len));
        assert_eq!(
            offsets,
            [
                (64, 1_179_712, 3072),
                (393_280, 1_182_784, 3072),
                (786_496, 1_185_856, 12_288)
            ]
        );
        assert_eq!((l.data_end, l.record_size), (1_198_144, 74 * PAGE));
    }

    #[test]
    fn headers_round_trip_and_views_see_the_parts() {
        let rung = Rung::parse("vq1.5").unwrap();
        let l = VqLayout::new(rung, 64, 48).unwrap();
        let mats = [0usize, 1, 2].map(|p| {
            let [rows, cols] = [[48, 64], [48, 64], [64, 48]][p];
            let w = crate::testing::fresh(rows * cols, 40 + p as u64);
            VqMatrix::encode(&w, rows, cols, rung, vq_seed(3, 8, 5, p)).unwrap()
        });
        let rec = pack_record(&l, 3, 5, &mats);
        assert_eq!(rec.len() % PAGE, 0);
        let h = RecordHeader::read(&rec).unwrap();
        assert_eq!((h.layer, h.expert, h.dim, h.index_bits), (3, 5, 8, 12));
        assert_eq!(h.seeds, [0, 1, 2].map(|p| vq_seed(3, 8, 5, p)));
        for (v, m) in record_views(&l, &rec).iter().zip(&mats) {
            assert_eq!(
                (v.codes, v.norms, v.seed),
                (&m.codes[..], &m.norms[..], m.seed)
            );
        }
        assert!(RecordHeader::read(&rec[1..]).is_none());
    }

    /// A store too large to check whole at open has each layer checked the first time a
    /// model runs it: damage in a record the spot check did not read is found then.
    #[test]
    fn a_layer_is_checked_whole_on_first_use() {
        use std::os::unix::fs::FileExt;
        let copy = crate::testing::fixture_copy("tiny-moe");
        let dir = copy.dir();
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let ckpt = Checkpoint::open(dir).unwrap();
        let rung = Rung::parse("vq2").unwrap();
        let rungs = config.moe_layers().map(|l| (l, rung)).collect();
        ensure(dir, &config, &ckpt, &rungs, &mut |_, _| {}).unwrap();
        let store = VqStore::open(dir, rung).unwrap();
        // As a store above FULL_CHECK_BYTES is left after its spot check.
        store
            .verified
            .iter()
            .for_each(|v| v.store(false, Ordering::Relaxed));
        let at = store
            .layout
            .record_offset(store.record_index(1, 3).unwrap())
            + 100;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&store.path)
            .unwrap();
        let mut byte = [0u8];
        std::fs::File::open(&store.path)
            .unwrap()
            .read_exact_at(&mut byte, at)
            .unwrap();
        file.write_all_at(&[byte[0] ^ 0x40], at).unwrap();
        store.verify_layer(0).unwrap();
        let err = store.verify_layer(1).unwrap_err().to_string();
        assert!(err.contains("record 11 (layer 1, expert 3)"), "{err}");
    }
}
