//! The low-bit expert stores, `experts2.bin` and `experts3.bin`, built from the 4-bit
//! one in process.
//!
//! A low-bit store keeps the 4-bit store's scales and biases and drops the bottom bits
//! of the codes: `q >> 2` at two bits, reconstructed at `(4q + 1.5) * scale + bias`, and
//! `q >> 1` at three bits, at `(2q + 0.5) * scale + bias` — the midpoints of the ranges
//! the new codes cover. The codes are laid out so that one masked cast
//! (`& 0x03030303`, `& 0x01010101`) yields four codes consecutive in the deinterleaved
//! input, as the 4-bit nibble trick does (see `codec::affine::lowbit` and
//! `docs/FORMAT.md`). A kernel that peels codes one at a time costs about 2.3× the
//! 4-bit kernel, which is why the older one-at-a-time layout (version 1) is never used
//! and always rebuilt.
//!
//! Both stores coexist beside `experts.bin`; building or rebuilding one precision never
//! touches the other's files.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use memmap2::Mmap;
use rayon::prelude::*;
use serde::Serialize;

use super::atomic::{self, TempOutput};
use super::layout::{get_u32s, put_u32s, Layout};
use super::manifest::{
    record_checksum, Created, Fnv64, Manifest, Source, SourceFile, VERSION, VERSION_SEQUENTIAL_Q2,
};
use super::{data_file_name, manifest_file_name, synth, Error, BASE_FILE};
use crate::codec::affine::lowbit;

/// Bytes of source and stored records a spot check reads at most (beyond its minimum
/// of [`SPOT_CHECK_MIN`] records): about 15 MB for a real model, milliseconds.
pub const SPOT_CHECK_BYTES: usize = 16 << 20;

/// Records a spot check compares at least: the first, one in the middle, the last.
pub const SPOT_CHECK_MIN: usize = 3;

/// Records a spot check compares at most.
pub const SPOT_CHECK_MAX: usize = 8;

/// How the codes of a store are arranged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Packing {
    /// The current layout (version 2): masked casts yield consecutive codes.
    Current,
    /// The older 2-bit layout (version 1): codes one after another in input order.
    SequentialQ2,
}

impl Packing {
    fn version(self) -> u32 {
        match self {
            Packing::Current => VERSION,
            Packing::SequentialQ2 => VERSION_SEQUENTIAL_Q2,
        }
    }
}

/// The files of a precision and of the base store in one directory.
struct Paths {
    data: PathBuf,
    manifest: PathBuf,
}

fn paths(dir: &Path, bits: u32) -> Paths {
    Paths {
        data: dir.join(data_file_name(bits)),
        manifest: dir.join(manifest_file_name(bits)),
    }
}

/// A store whose manifest and size have been checked, mapped.
pub(crate) struct Checked {
    /// The data file.
    pub path: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Its layout.
    pub layout: Layout,
    /// Its bytes.
    pub mmap: Mmap,
    /// The open data file, and what it was when mapped: a file changed in place later
    /// (truncated, copied over) is told apart by [`atomic::FileStamp`].
    pub file: std::fs::File,
    /// The data file's size and times when it was mapped.
    pub stamp: atomic::FileStamp,
}

impl Checked {
    /// Record `index`'s bytes.
    pub fn record(&self, index: usize) -> &[u8] {
        let start = self.layout.record_offset(index) as usize;
        &self.mmap[start..start + self.layout.record_size]
    }

    /// Whether record `index` matches its checksum in the manifest; an error naming the
    /// data file, the record and both checksums if not.
    pub fn verify(&self, index: usize) -> Result<(), Error> {
        verify_record(&self.path, &self.manifest, index, self.record(index))
    }

    /// Every record of `range` checked against its checksum, in parallel; the error is
    /// the first failing record's.
    pub fn verify_range(&self, range: std::ops::Range<usize>) -> Result<(), Error> {
        let bad = range
            .into_par_iter()
            .filter(|&i| self.verify(i).is_err())
            .min();
        match bad {
            Some(i) => self.verify(i),
            None => Ok(()),
        }
    }

    /// [`Checked::verify_range`] over every record.
    pub fn verify_all(&self) -> Result<(), Error> {
        self.verify_range(0..self.count())
    }

    fn count(&self) -> usize {
        self.manifest.record_count as usize
    }
}

/// Opens a store's manifest and maps its data file, checking that the manifest's
/// fields agree with each other and with the file's size.
fn open_checked(p: &Paths, bits: u32) -> Result<Checked, Error> {
    let manifest = Manifest::read(&p.manifest)?;
    let layout = manifest.layout(&p.manifest)?;
    if manifest.bits != bits {
        return Err(Error::manifest(
            &p.manifest,
            "bits",
            format!("is {}, expected {bits}", manifest.bits),
        ));
    }
    if manifest.file != data_file_name(bits) {
        return Err(Error::manifest(
            &p.manifest,
            "file",
            format!(
                "is {:?}, expected {:?}",
                manifest.file,
                data_file_name(bits)
            ),
        ));
    }
    let file = atomic::open_regular(&p.data)?;
    let found = file
        .metadata()
        .map_err(|source| Error::Io {
            path: p.data.clone(),
            source,
        })?
        .len();
    if found != manifest.file_size {
        return Err(Error::Size {
            path: p.data.clone(),
            expected: manifest.file_size,
            found,
        });
    }
    let stamp = atomic::FileStamp::of(&file, &p.data)?;
    // SAFETY: read-only map. Writers never modify a committed file in place: they write
    // a new file and rename it over the old one, which leaves this mapping intact. A
    // file changed in place by anything else is caught by its stamp before the records
    // are read again (`ExpertStore::check_unchanged`).
    let mmap = unsafe { Mmap::map(&file) }.map_err(|source| Error::Io {
        path: p.data.clone(),
        source,
    })?;
    Ok(Checked {
        path: p.data.clone(),
        manifest,
        layout,
        mmap,
        file,
        stamp,
    })
}

/// Record `index` of the store at `path` (`bytes`) against its checksum in `manifest`.
pub(crate) fn verify_record(
    path: &Path,
    manifest: &Manifest,
    index: usize,
    bytes: &[u8],
) -> Result<(), Error> {
    let found = record_checksum(bytes);
    let expected = &manifest.checksums[index];
    if &found == expected {
        return Ok(());
    }
    let per_layer = manifest.experts_per_layer;
    Err(Error::Damaged {
        path: path.to_path_buf(),
        record: index,
        layer: manifest.layers[index / per_layer],
        expert: index % per_layer,
        found,
        expected: expected.clone(),
    })
}

/// The 4-bit base store, checked and mapped; a missing one says how to make it. A
/// synthetic one is also spot-checked against its generator.
pub(crate) fn open_base(dir: &Path) -> Result<Checked, Error> {
    let base = open_checked(&paths(dir, 4), 4).map_err(|e| match e {
        Error::Missing { path } => Error::MissingBase { path },
        e => e,
    })?;
    check_synthetic(&base)?;
    Ok(base)
}

/// For a store of random records, the spot check of its bytes: a few records made
/// again from the manifest's generator and seed, compared byte for byte. Other stores
/// pass.
fn check_synthetic(store: &Checked) -> Result<(), Error> {
    if store.manifest.source.kind != synth::SOURCE_KIND {
        return Ok(());
    }
    synth::spot_check(store).map_err(|reason| Error::Unusable {
        path: store.path.clone(),
        reason,
    })
}

/// A low-bit store that stands alone: its manifest names random records as its source,
/// not `experts.bin` (a synthetic directory written without a 4-bit store). `None` for
/// any other store, or where the manifest cannot be read (the caller's checks say why).
fn standalone(p: &Paths, bits: u32) -> Option<Result<Checked, Error>> {
    let manifest = Manifest::read(&p.manifest).ok()?;
    (manifest.source.kind == synth::SOURCE_KIND).then(|| {
        let store = open_checked(p, bits)?;
        check_synthetic(&store)?;
        Ok(store)
    })
}

/// The `bits`-bit store of `dir`, checked and mapped: the base store, a low-bit store
/// spot-checked against `experts.bin`, or a synthetic low-bit store standing alone,
/// spot-checked against its generator. Read-only; takes no lock.
pub(crate) fn open_usable(dir: &Path, bits: u32) -> Result<Checked, Error> {
    if bits == 4 {
        return open_base(dir);
    }
    if !super::layout::SUPPORTED_BITS.contains(&bits) {
        return Err(Error::UnsupportedBits { bits });
    }
    if let Some(store) = standalone(&paths(dir, bits), bits) {
        return store;
    }
    let base = open_base(dir)?;
    is_usable(dir, &base, bits)
}

/// [`open_usable`], and every record of the store checked against its checksum: what
/// `store ensure` and `store verify` hold a store to. Loading checks a layer's records
/// when the model first runs them instead (`ExpertStore::verify_layer`).
pub(crate) fn open_verified(dir: &Path, bits: u32) -> Result<Checked, Error> {
    let store = open_usable(dir, bits)?;
    store.verify_all()?;
    Ok(store)
}

/// What [`ensure_with_policy`] did for one precision.
#[derive(Debug, Clone, Serialize)]
pub struct Ensured {
    /// Bits per code.
    pub bits: u32,
    /// The data file.
    pub path: PathBuf,
    /// Whether it was (re)built; false when a usable store was kept.
    pub built: bool,
    /// Why it was built, when it was.
    pub reason: Option<String>,
    /// Size of the data file.
    pub bytes: u64,
    /// Bytes per record.
    pub record_size: usize,
    /// Wall time spent on this call, shared by the precisions built together.
    pub seconds: f64,
    /// Its layout.
    #[serde(skip)]
    pub layout: Layout,
}

/// How [`ensure_with_policy`] builds.
pub struct Policy<'a> {
    /// Rebuild even a usable store.
    pub force: bool,
    /// Called with (records done, records total) while building.
    pub progress: &'a mut dyn FnMut(usize, usize),
    /// Called with one line saying what is about to be built and why.
    pub notice: &'a mut dyn FnMut(&str),
}

/// Make sure the `bits`-bit store exists next to `experts.bin`, building it from the
/// 4-bit records if it is missing, the wrong size, in the older code-at-a-time layout,
/// or otherwise not usable. Returns the layout either way.
pub fn ensure(dir: &Path, bits: u32) -> Result<Layout, Error> {
    let done = ensure_many(dir, &[bits])?;
    Ok(done[0].layout)
}

/// Build missing targets together, reading each 4-bit source record once. Duplicate
/// precisions are ignored; valid cached stores are left untouched.
pub fn ensure_many(dir: &Path, bits: &[u32]) -> Result<Vec<Ensured>, Error> {
    ensure_with_policy(
        dir,
        bits,
        &mut Policy {
            force: false,
            progress: &mut |_, _| {},
            notice: &mut |_| {},
        },
    )
}

/// [`ensure_many`] with progress, notices, and optionally a forced rebuild. Returns one
/// entry per distinct precision, in the order first asked for. `bits` may include 4,
/// the base store, which is checked but never built here (conversion writes it).
pub fn ensure_with_policy(
    dir: &Path,
    bits: &[u32],
    policy: &mut Policy,
) -> Result<Vec<Ensured>, Error> {
    let start = Instant::now();
    let mut targets: Vec<u32> = Vec::new();
    for &b in bits {
        if !super::layout::SUPPORTED_BITS.contains(&b) {
            return Err(Error::UnsupportedBits { bits: b });
        }
        if !targets.contains(&b) {
            targets.push(b);
        }
    }
    // Without the lock first: a directory whose stores are all usable needs no write
    // access, so this works on read-only media too.
    if !policy.force {
        let kept: Option<Vec<Ensured>> = targets
            .iter()
            .map(|&b| open_verified(dir, b).ok().map(|c| kept(&c, b, start)))
            .collect();
        if let Some(kept) = kept {
            return Ok(kept);
        }
    }
    // Nothing is built without a base store. A synthetic store standing alone that
    // fails its check is named with its own reason; otherwise the base is what is
    // missing.
    if let Err(missing) = open_base(dir) {
        for &b in &targets {
            if let Some(Err(e)) = standalone(&paths(dir, b), b) {
                return Err(e);
            }
        }
        return Err(missing);
    }
    let _lock = atomic::lock_exclusive(dir)?;
    atomic::remove_stale_temps(dir)?;
    ensure_selected(dir, &targets, policy, start)
}

/// A store [`verify`] read through.
#[derive(Debug, Clone, Serialize)]
pub struct Verified {
    /// Bits per code.
    pub bits: u32,
    /// The data file.
    pub path: PathBuf,
    /// Records checked against their checksums: all of them.
    pub records: usize,
    /// Size of the data file.
    pub bytes: u64,
}

/// Checks the affine stores of `dir` at `bits` (every precision whose manifest is there
/// when `bits` is empty) in full: manifest, size, the spot check against `experts.bin`
/// or the generator, and every record against its checksum. Read-only; takes the shared
/// lock. The first store that fails is the error, naming its file and record.
pub fn verify(dir: &Path, bits: &[u32]) -> Result<Vec<Verified>, Error> {
    let bits: Vec<u32> = if bits.is_empty() {
        super::layout::SUPPORTED_BITS
            .iter()
            .rev()
            .copied()
            .filter(|&b| dir.join(manifest_file_name(b)).exists())
            .collect()
    } else {
        bits.to_vec()
    };
    if bits.is_empty() {
        return Err(Error::MissingBase {
            path: dir.join(manifest_file_name(4)),
        });
    }
    let _lock = atomic::lock_shared(dir)?;
    bits.iter()
        .map(|&b| {
            let store = open_verified(dir, b)?;
            Ok(Verified {
                bits: b,
                path: store.path.clone(),
                records: store.count(),
                bytes: store.manifest.file_size,
            })
        })
        .collect()
}

fn kept(c: &Checked, bits: u32, start: Instant) -> Ensured {
    Ensured {
        bits,
        path: c.path.clone(),
        built: false,
        reason: None,
        bytes: c.manifest.file_size,
        record_size: c.layout.record_size,
        seconds: start.elapsed().as_secs_f64(),
        layout: c.layout,
    }
}

/// Under the exclusive lock: checks each target again (another process may have built
/// it while this one waited) and builds those that are still not usable, together.
fn ensure_selected(
    dir: &Path,
    targets: &[u32],
    policy: &mut Policy,
    start: Instant,
) -> Result<Vec<Ensured>, Error> {
    let base = open_base(dir)?;
    let mut build_list = Vec::new();
    for &bits in targets {
        if bits == 4 {
            // Checked, never built here: a damaged base store is an error.
            base.verify_all()?;
            continue;
        }
        let reason = match is_usable(dir, &base, bits).and_then(|s| s.verify_all()) {
            Ok(_) if !policy.force => continue,
            Ok(_) => "rebuild requested".to_string(),
            Err(e) => e.to_string(),
        };
        announce_build(policy, &paths(dir, bits).data, &reason);
        build_list.push((bits, reason));
    }
    let bits: Vec<u32> = build_list.iter().map(|(b, _)| *b).collect();
    if !bits.is_empty() {
        build(dir, &base, &bits, Packing::Current, policy.progress)?;
    }
    targets
        .iter()
        .map(|&b| {
            let checked = match b {
                4 => open_base(dir)?,
                _ => open_checked(&paths(dir, b), b)?,
            };
            let mut e = kept(&checked, b, start);
            if let Some((_, reason)) = build_list.iter().find(|(x, _)| *x == b) {
                e.built = true;
                e.reason = Some(reason.clone());
            }
            Ok(e)
        })
        .collect()
}

fn announce_build(policy: &mut Policy, data: &Path, reason: &str) {
    (policy.notice)(&format!("building {}: {reason}", data.display()));
}

/// Whether a usable store of this precision is already on disk: its manifest agrees
/// with the base store's, its size with its manifest, and a spot check of its records
/// against fresh re-packs of `experts.bin` passes. Read-only; takes no lock. The 4-bit
/// store is usable when its manifest and size agree. A synthetic store (`store::synth`)
/// is spot-checked against records made again from its generator and seed instead, and
/// a low-bit one needs no `experts.bin`.
pub fn usable(dir: &Path, bits: u32) -> bool {
    check(dir, bits).is_ok()
}

/// [`usable`], saying why not.
pub fn check(dir: &Path, bits: u32) -> Result<Layout, Error> {
    open_usable(dir, bits).map(|c| c.layout)
}

/// Read-only readiness check shared by preparation and the runtime. The manifest is
/// only a claim, so a few records are re-packed and compared byte for byte: that is what
/// catches a store written by an older packing, which the kernels would read as noise,
/// or a damaged one.
pub(crate) fn is_usable(dir: &Path, base: &Checked, bits: u32) -> Result<Checked, Error> {
    match bits {
        4 => return open_base(dir),
        2 | 3 => {}
        _ => return Err(Error::UnsupportedBits { bits }),
    }
    let p = paths(dir, bits);
    if let Some(store) = standalone(&p, bits) {
        return store;
    }
    let store = open_checked(&p, bits)?;
    let unusable = |reason: String| Error::Unusable {
        path: p.data.clone(),
        reason,
    };
    if !store.manifest.same_experts(&base.manifest) {
        return Err(unusable(format!(
            "{} describes other experts than {}",
            p.manifest.display(),
            BASE_FILE
        )));
    }
    if store.manifest.source != source_of(&base.manifest) {
        return Err(unusable(format!(
            "built from another {BASE_FILE} (its manifest's source differs)"
        )));
    }
    spot_check(base, &store)?;
    Ok(store)
}

/// What a store derived from `base` names as its source.
fn source_of(base: &Manifest) -> Source {
    Source {
        kind: "store".to_string(),
        fingerprint: base.fingerprint.clone(),
        files: vec![SourceFile {
            name: BASE_FILE.to_string(),
            size: base.file_size,
        }],
        generator: None,
    }
}

/// The records a spot check compares: the first, the last, and evenly spread ones
/// between, as many as [`SPOT_CHECK_BYTES`] of source and stored records allow (at least
/// [`SPOT_CHECK_MIN`], at most [`SPOT_CHECK_MAX`], never more than there are).
pub fn spot_check_records(count: usize, source_record: usize, stored_record: usize) -> Vec<usize> {
    let affordable = SPOT_CHECK_BYTES / (source_record + stored_record).max(1);
    let n = affordable.clamp(SPOT_CHECK_MIN, SPOT_CHECK_MAX).min(count);
    if n <= 1 {
        return (0..count).collect();
    }
    let mut picks: Vec<usize> = (0..n).map(|k| k * (count - 1) / (n - 1)).collect();
    picks.dedup();
    picks
}

/// Re-packs a handful of records spread through the file and compares them with what
/// is stored, byte for byte (padding included). Each base record compared is checked
/// against its checksum first, and each stored one too.
fn spot_check(base: &Checked, store: &Checked) -> Result<(), Error> {
    let picks = spot_check_records(
        store.count(),
        base.layout.record_size,
        store.layout.record_size,
    );
    for i in picks {
        base.verify(i)?;
        store.verify(i)?;
        let expected = pack_record(
            base.record(i),
            &base.layout,
            &store.layout,
            Packing::Current,
        );
        let stored = store.record(i);
        if let Some(at) = expected.iter().zip(stored).position(|(a, b)| a != b) {
            let per_layer = store.manifest.experts_per_layer;
            return Err(Error::Unusable {
                path: store.path.clone(),
                reason: format!(
                    "record {i} (layer {}, expert {}) differs from a re-pack of {BASE_FILE} at byte {at} of the record: an older layout or damage",
                    store.manifest.layers[i / per_layer],
                    i % per_layer
                ),
            });
        }
    }
    Ok(())
}

/// Writes the stores of `targets` from the base store's records, reading each source
/// record once for all of them. Each target's manifest is removed first and written
/// after its data file is in place.
fn build(
    dir: &Path,
    base: &Checked,
    targets: &[u32],
    packing: Packing,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), Error> {
    let layouts = targets
        .iter()
        .map(|&b| base.layout.with_bits(b))
        .collect::<Result<Vec<_>, _>>()?;
    for &b in targets {
        atomic::remove_committed(&paths(dir, b).manifest)?;
    }
    let mut outs = targets
        .iter()
        .map(|&b| create_output(&paths(dir, b).data))
        .collect::<Result<Vec<_>, _>>()?;
    let total = base.count();
    let batch = 2 * rayon::current_num_threads().max(1);
    let mut checksums = vec![Vec::with_capacity(total); targets.len()];
    progress(0, total);
    for first in (0..total).step_by(batch) {
        let last = (first + batch).min(total);
        let packed = pack_records(base, first..last, &layouts, packing)?;
        for record in packed {
            for (k, (out, (bytes, sum))) in outs.iter_mut().zip(record).enumerate() {
                write(out, &bytes)?;
                checksums[k].push(sum);
            }
        }
        progress(last, total);
    }
    for ((out, sums), (&bits, layout)) in outs
        .into_iter()
        .zip(checksums)
        .zip(targets.iter().zip(&layouts))
    {
        atomic::commit_buffered(out)?;
        let manifest = derived_manifest(&base.manifest, layout, packing, sums);
        atomic::write_file(&paths(dir, bits).manifest, &manifest.to_bytes())?;
    }
    Ok(())
}

/// A temporary output for a store's data file, buffered.
fn create_output(path: &Path) -> Result<BufWriter<TempOutput>, Error> {
    Ok(BufWriter::with_capacity(4 << 20, TempOutput::create(path)?))
}

fn write(out: &mut BufWriter<TempOutput>, bytes: &[u8]) -> Result<(), Error> {
    out.write_all(bytes).map_err(|source| Error::Io {
        path: out.get_ref().path().to_path_buf(),
        source,
    })
}

/// The manifest of a store derived from `base` with this layout and packing, whose
/// records have `checksums`.
pub(crate) fn derived_manifest(
    base: &Manifest,
    layout: &Layout,
    packing: Packing,
    checksums: Vec<String>,
) -> Manifest {
    let bits = layout.bits;
    let version = packing.version();
    let note = match packing {
        Packing::Current => {
            format!("{bits}-bit codes re-packed from {BASE_FILE}; scales and biases copied")
        }
        Packing::SequentialQ2 => {
            format!("older layout: {bits}-bit codes one at a time, re-packed from {BASE_FILE}")
        }
    };
    Manifest {
        version,
        file: data_file_name(bits),
        bits,
        record_size: layout.record_size as u64,
        file_size: layout.file_size(base.record_count as usize),
        checksums,
        fingerprint: Fnv64::default()
            .field(base.fingerprint.as_bytes())
            .u64(bits as u64)
            .u64(version as u64)
            .hex(),
        source: source_of(base),
        created: Created::now(&note),
        ..base.clone()
    }
}

/// A record's bytes and its checksum.
type Summed = (Vec<u8>, String);

/// Packs records `range` of the base store into every target layout, each with its
/// checksum: one task per record, so each source record is read once however many
/// targets there are. A base record that fails its checksum stops the build: nothing is
/// derived from damaged records.
fn pack_records(
    base: &Checked,
    range: std::ops::Range<usize>,
    layouts: &[Layout],
    packing: Packing,
) -> Result<Vec<Vec<Summed>>, Error> {
    range
        .into_par_iter()
        .map(|i| {
            base.verify(i)?;
            Ok(pack_into(base.record(i), &base.layout, layouts, packing)
                .into_iter()
                .map(|r| {
                    let sum = record_checksum(&r);
                    (r, sum)
                })
                .collect())
        })
        .collect()
}

/// Re-packs one 4-bit record into one target layout: three matrices of codes re-packed,
/// six scale/bias blocks copied verbatim, padding zero.
fn pack_record(src: &[u8], src_layout: &Layout, dst_layout: &Layout, packing: Packing) -> Vec<u8> {
    pack_into(src, src_layout, std::slice::from_ref(dst_layout), packing)
        .pop()
        .expect("one target")
}

/// One 4-bit record re-packed into each of `layouts`.
pub(crate) fn pack_into(
    src: &[u8],
    src_layout: &Layout,
    layouts: &[Layout],
    packing: Packing,
) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = layouts.iter().map(|l| vec![0u8; l.record_size]).collect();
    for (m, src_m) in src_layout.matrices.iter().enumerate() {
        let q4 = get_u32s(&src[src_m.codes.range()]);
        for (dst, layout) in out.iter_mut().zip(layouts) {
            let dst_m = &layout.matrices[m];
            let mut words = vec![0u32; dst_m.codes.len / 4];
            pack_matrix(
                &q4,
                src_m.rows,
                src_m.cols,
                layout.bits,
                packing,
                &mut words,
            );
            put_u32s(&mut dst[dst_m.codes.range()], &words);
        }
    }
    for (dst, layout) in out.iter_mut().zip(layouts) {
        for (s, d) in src_layout.scale_blocks().iter().zip(layout.scale_blocks()) {
            dst[d.range()].copy_from_slice(&src[s.range()]);
        }
    }
    out
}

/// Repack one matrix of 4-bit codes (as u32 words of 8 nibbles) into `dst`.
fn pack_matrix(q4: &[u32], rows: usize, cols: usize, bits: u32, packing: Packing, dst: &mut [u32]) {
    match packing {
        Packing::Current => lowbit::pack_matrix(q4, rows, cols, bits, dst),
        Packing::SequentialQ2 => lowbit::pack_matrix_naive_q2(q4, rows, cols, dst),
    }
}

/// Writes `experts2.bin` in the older layout (version 1: 2-bit codes one at a time in
/// input order) with a version-1 manifest, replacing any 2-bit store. Current builds
/// never read such a store; this exists to test that they detect and rebuild it.
pub fn write_older_layout_q2(dir: &Path) -> Result<Layout, Error> {
    let _lock = atomic::lock_exclusive(dir)?;
    let base = open_base(dir)?;
    build(dir, &base, &[2], Packing::SequentialQ2, &mut |_, _| {})?;
    base.layout.with_bits(2)
}
