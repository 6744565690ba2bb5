//! Memory-mapped reading of a checked store: each expert's three projections as
//! [`AffineView`]s straight over the mapped file, no copies.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use half::bf16;
use memmap2::Mmap;
use rayon::prelude::*;

use super::atomic;
use super::layout::{Layout, MatrixLayout, ALIGN};
use super::lowbit::{self, Checked};
use super::manifest::Manifest;
use super::Error;
use crate::codec::affine::kernels::AffineView;

// Records are little-endian; viewing them in place as u32 and bf16 needs a
// little-endian machine (every platform dynmoe targets).
#[cfg(target_endian = "big")]
compile_error!("expert stores are read in place and are little-endian");

/// An opened store: a usable `experts.bin`, `experts2.bin` or `experts3.bin`, mapped.
///
/// Opening checks the manifest, the size and a spot check of records; each MoE layer's
/// records are checked against their checksums once, when the layer is first run from
/// the mapping ([`ExpertStore::verify_layer`]), not on every token.
pub struct ExpertStore {
    path: PathBuf,
    manifest: Manifest,
    layout: Layout,
    mmap: Mmap,
    file: std::fs::File,
    stamp: atomic::FileStamp,
    /// Per MoE layer (by position in `layers`), whether its records passed their
    /// checksums.
    verified: Vec<AtomicBool>,
}

/// One expert's projections, viewed in place.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRecord<'a> {
    /// `[intermediate, hidden]` (columns padded to whole groups: see [`Layout`]).
    pub gate: AffineView<'a>,
    /// `[intermediate, hidden]`.
    pub up: AffineView<'a>,
    /// `[hidden, intermediate]`.
    pub down: AffineView<'a>,
}

impl ExpertStore {
    /// Maps the `bits`-bit store of `dir` after checking it as `lowbit::usable` does
    /// (manifest, size, and for 2 and 3 bits a spot check against `experts.bin`, or for
    /// a synthetic store against its generator). An
    /// unusable store is refused with an error naming the file and the reason; nothing
    /// is built here (see `lowbit::ensure`).
    pub fn open(dir: &Path, bits: u32) -> Result<ExpertStore, Error> {
        // Shared with other readers, exclusive of a writer mid-build, so the manifest
        // and the data file read here belong together.
        let _lock = atomic::lock_shared(dir)?;
        let Checked {
            path,
            manifest,
            layout,
            mmap,
            file,
            stamp,
        } = lowbit::open_usable(dir, bits)?;
        if !(mmap.as_ptr() as usize).is_multiple_of(ALIGN) {
            return Err(Error::Unusable {
                path,
                reason: format!("mapped at an address not aligned to {ALIGN} bytes"),
            });
        }
        let verified = manifest
            .layers
            .iter()
            .map(|_| AtomicBool::new(false))
            .collect();
        Ok(ExpertStore {
            path,
            manifest,
            layout,
            mmap,
            file,
            stamp,
            verified,
        })
    }

    /// Checks every record of MoE layer `layer` against its checksum, in parallel, the
    /// first time it is asked; later calls return at once. An error names the data file
    /// and the first damaged record.
    ///
    /// # Panics
    /// If `layer` is not a MoE layer of the store.
    pub fn verify_layer(&self, layer: usize) -> Result<(), Error> {
        let pos = self
            .manifest
            .layers
            .binary_search(&layer)
            .unwrap_or_else(|_| panic!("{}: no layer {layer}", self.path.display()));
        if self.verified[pos].load(Ordering::Acquire) {
            return Ok(());
        }
        let per_layer = self.manifest.experts_per_layer;
        let first = pos * per_layer;
        let bad = (first..first + per_layer)
            .into_par_iter()
            .filter(|&i| self.verify_record(i).is_err())
            .min();
        if let Some(i) = bad {
            return self.verify_record(i);
        }
        self.verified[pos].store(true, Ordering::Release);
        Ok(())
    }

    /// Checks record `index` against its checksum.
    pub fn verify_record(&self, index: usize) -> Result<(), Error> {
        lowbit::verify_record(&self.path, &self.manifest, index, self.record_bytes(index))
    }

    /// The checksum the manifest gives record `index`.
    pub fn checksum(&self, index: usize) -> &str {
        &self.manifest.checksums[index]
    }

    /// [`Error::Changed`] if the data file was changed in place (truncated, copied
    /// over) since it was mapped: a mapping of such a file reads garbage, or dies of
    /// SIGBUS past a truncation, so callers check before running from it.
    pub fn check_unchanged(&self) -> Result<(), Error> {
        self.stamp.check(&self.file, &self.path)
    }

    /// Bits per code.
    pub fn bits(&self) -> u32 {
        self.layout.bits
    }

    /// The record layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The data file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records in the store.
    pub fn num_records(&self) -> usize {
        self.manifest.record_count as usize
    }

    /// The MoE layers, ascending.
    pub fn layers(&self) -> &[usize] {
        &self.manifest.layers
    }

    /// Experts per MoE layer.
    pub fn experts_per_layer(&self) -> usize {
        self.manifest.experts_per_layer
    }

    /// The record index of `expert` of MoE layer `layer`, if the store holds it.
    pub fn record_index(&self, layer: usize, expert: usize) -> Option<usize> {
        let per_layer = self.manifest.experts_per_layer;
        let pos = self.manifest.layers.binary_search(&layer).ok()?;
        (expert < per_layer).then_some(pos * per_layer + expert)
    }

    /// The bytes of record `index`, for copying a whole record (e.g. into a resident
    /// slot).
    pub fn record_bytes(&self, index: usize) -> &[u8] {
        let start = self.layout.record_offset(index) as usize;
        &self.mmap[start..start + self.layout.record_size]
    }

    /// `expert` of MoE layer `layer`.
    ///
    /// # Panics
    /// If `layer` is not a MoE layer of the store or `expert` is out of range.
    pub fn record(&self, layer: usize, expert: usize) -> ExpertRecord<'_> {
        let index = self.record_index(layer, expert).unwrap_or_else(|| {
            panic!(
                "{}: no record for layer {layer} expert {expert} (MoE layers {:?}, {} experts each)",
                self.path.display(),
                self.manifest.layers,
                self.manifest.experts_per_layer
            )
        });
        self.record_at(index)
    }

    /// Record `index` (layers ascending, experts ascending).
    ///
    /// # Panics
    /// If `index` is not below [`num_records`](Self::num_records).
    pub fn record_at(&self, index: usize) -> ExpertRecord<'_> {
        assert!(
            index < self.num_records(),
            "record {index} of {}",
            self.num_records()
        );
        record_view(&self.layout, self.record_bytes(index))
    }
}

/// A record of `layout` held anywhere (a resident slot, say), viewed in place.
///
/// # Panics
/// If `bytes` is shorter than a record or not aligned to 4 bytes.
pub fn record_view<'a>(layout: &Layout, bytes: &'a [u8]) -> ExpertRecord<'a> {
    assert!(
        bytes.len() >= layout.record_size,
        "a record is {} bytes",
        layout.record_size
    );
    let [gate, up, down] = layout.matrices.map(|m| view(bytes, &m, layout.bits));
    ExpertRecord { gate, up, down }
}

/// One projection of a record, in place.
fn view<'a>(record: &'a [u8], m: &MatrixLayout, bits: u32) -> AffineView<'a> {
    AffineView {
        bits,
        rows: m.rows,
        cols: m.cols,
        words: cast_u32(&record[m.codes.range()]),
        scales: cast_bf16(&record[m.scales.range()]),
        biases: cast_bf16(&record[m.biases.range()]),
    }
}

fn cast_u32(bytes: &[u8]) -> &[u32] {
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(align_of::<u32>())
            && bytes.len().is_multiple_of(4)
    );
    // SAFETY: the pointer is aligned for u32 and the length a whole number of u32s
    // (checked above); every bit pattern is a valid u32; the store is little-endian
    // and so is the machine (see the compile-time check above).
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<u32>(), bytes.len() / 4) }
}

fn cast_bf16(bytes: &[u8]) -> &[bf16] {
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(align_of::<bf16>())
            && bytes.len().is_multiple_of(2)
    );
    // SAFETY: bf16 is a transparent wrapper of u16, valid for every bit pattern; the
    // pointer is aligned and the length a whole number of elements (checked above).
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<bf16>(), bytes.len() / 2) }
}
