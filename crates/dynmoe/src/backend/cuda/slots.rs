//! A resident set's expert slots in device memory (the resident set of
//! docs/ARCHITECTURE.md, on the GPU).
//!
//! One allocation holds every slot of a MoE layer, each one expert record as stored
//! (affine or VQ), so that a swap is one copy of the record's bytes. The routed kernels
//! reach an expert through a table of pointers indexed by expert id; a resident expert's
//! entries point into its slot, and a byte mask keeps routing off the others. Loads
//! run on a copy stream of their own, from page-locked host buffers, so a token never
//! waits for one; the table and mask change only when the resident set flushes them at
//! a token boundary, on the compute stream, so every launch sees one consistent set.
//!
//! A VQ slot also holds its expert's rotation signs as bits after the record: the
//! kernels read them from the table, and a record carries only their seeds. They are
//! made on the host when the record is loaded and copied beside it.
//!
//! Affine slots hold their 4- and 2-bit experts in unit tiles where the tensor-core
//! routed kernels take them, as those read them: a record is copied as stored into one
//! staging buffer and `affine_tiles_from_rows` takes each matrix into the slot, both on
//! the copy stream, whose order keeps the next copy off the staging buffer until the
//! kernel has read it.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
};

use super::affine::{tile_lengths, tile_units, ROUTED_ENTRY};
use super::launch::{self, Ptr};
use super::ok;
use super::routed::{AffineTilesFromRows, RoutedKind};
use super::vq::{sign_bits, VQ_CODE_PADDING};
use crate::backend::ExpertSlots;
use crate::store::records::words_as_bytes;
use crate::store::records::RecordFormat;
use crate::store::vq::{record_views, VqLayout};
use crate::store::Layout;

/// Slots of one MoE layer on the device, with their routing table and mask.
pub struct CudaSlots {
    /// The stream every op runs on: table flushes go there.
    stream: Arc<CudaStream>,
    /// The stream loads run on.
    copies: Arc<CudaStream>,
    pub(super) kind: RoutedKind,
    format: RecordFormat,
    /// Bytes from one slot to the next: the record, then (VQ) its signs.
    stride: usize,
    // Owned here, addressed through `pool_at`.
    _pool: CudaSlice<u8>,
    pool_at: u64,
    count: usize,
    /// VQ: each slot's signs as last loaded (gate's, up's, then down's words, `signs`
    /// a slot), in page-locked memory, the source of their copies.
    signs_host: Option<PinnedHostSlice<u32>>,
    signs: usize,
    /// `[E, ROUTED_ENTRY]` pointers, host mirror and device copy.
    table_host: Vec<u64>,
    table: CudaSlice<u64>,
    /// `[E]` routable flags, host mirror and device copy.
    keep_host: Vec<u8>,
    keep: CudaSlice<u8>,
    dirty: bool,
    /// The last load into each slot.
    loads: Vec<Option<CudaEvent>>,
    /// Host ranges page-locked for these slots, unlocked when they go.
    pinned: Vec<usize>,
    /// Slots in unit tiles: where each matrix's tiles sit, the staging buffer and the
    /// kernel that takes a record from it.
    tiled: Option<TiledSlots>,
}

/// What slots in unit tiles need beside the pool.
struct TiledSlots {
    parts: [TiledPart; 3],
    // Owned here, addressed through `staging_at`.
    staging: CudaSlice<u8>,
    staging_at: u64,
    from_rows: CudaFunction,
}

/// Where one matrix of a tiled slot sits, in bytes from the slot's start: its tiles'
/// words, then their scales and biases (one buffer, as the tiled kernels read them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TiledPart {
    words: usize,
    sb: usize,
}

/// The parts of a tiled slot for records of `layout` (4 or 2 bits), gate, up and down
/// in turn, each 16-byte aligned, and the slot's bytes.
fn tiled_parts(layout: &Layout) -> ([TiledPart; 3], usize) {
    let mut at = 0;
    let parts = layout.matrices.map(|m| {
        let (words, sb) = tile_lengths(m.rows, m.cols, layout.bits);
        let part = TiledPart {
            words: at,
            sb: at + (4 * words).next_multiple_of(16),
        };
        at = part.sb + (2 * sb).next_multiple_of(16);
        part
    });
    (parts, at)
}

// SAFETY: the raw host addresses in `pinned` are only handed back to the driver; every
// device object here is owned by this value and used from one thread at a time (the
// resident set's lock).
unsafe impl Send for CudaSlots {}

/// Sign words of one VQ expert: gate's and up's rotation blocks, then down's.
fn sign_words(layout: &VqLayout) -> usize {
    layout.matrices.iter().map(|m| m.block.div_ceil(32)).sum()
}

impl CudaSlots {
    /// `count` slots for records of `format` (affine or VQ, routed as `kind`), over
    /// `experts` experts; with `from_rows` (affine records at 4 or 2 bits, `kind` tiled),
    /// in unit tiles, made by that kernel.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        copies: &Arc<CudaStream>,
        kind: RoutedKind,
        format: &RecordFormat,
        experts: usize,
        count: usize,
        from_rows: Option<CudaFunction>,
    ) -> CudaSlots {
        let signs = match format {
            RecordFormat::Vq(l) => sign_words(l),
            _ => 0,
        };
        let tiled = match (format, from_rows) {
            (RecordFormat::Affine(layout), Some(from_rows)) => {
                let (parts, bytes) = tiled_parts(layout);
                Some((parts, bytes, from_rows))
            }
            _ => None,
        };
        // Records are whole pages, so every part stays 16-byte aligned; the kernels copy
        // VQ codes in 16-byte chunks, up to 15 bytes past a part's end, hence the tail.
        let stride = match &tiled {
            Some((_, bytes, _)) => bytes.next_multiple_of(256),
            None => format.record_bytes() + (4 * signs).next_multiple_of(16),
        };
        let pool: CudaSlice<u8> = ok(
            stream.alloc_zeros(count.max(1) * stride + VQ_CODE_PADDING),
            "slot pool",
        );
        let pool_at = pool.device_ptr(stream).0;
        let mut slots = CudaSlots {
            stream: stream.clone(),
            copies: copies.clone(),
            kind,
            format: *format,
            stride,
            _pool: pool,
            pool_at,
            count,
            signs_host: (signs > 0).then(|| {
                // SAFETY: every word is written before it is read (zeroed here).
                let mut host = ok(
                    unsafe { stream.context().alloc_pinned::<u32>(count.max(1) * signs) },
                    "page-locked signs",
                );
                ok(host.as_mut_slice(), "page-locked signs").fill(0);
                host
            }),
            signs,
            table_host: vec![0; experts * ROUTED_ENTRY],
            table: ok(stream.alloc_zeros(experts * ROUTED_ENTRY), "slot table"),
            keep_host: vec![0; experts],
            keep: ok(stream.alloc_zeros(experts), "slot mask"),
            dirty: true,
            loads: (0..count).map(|_| None).collect(),
            pinned: Vec::new(),
            tiled: tiled.map(|(parts, _, from_rows)| {
                let staging: CudaSlice<u8> =
                    ok(stream.alloc_zeros(format.record_bytes()), "slot staging");
                let staging_at = staging.device_ptr(stream).0;
                TiledSlots {
                    parts,
                    staging,
                    staging_at,
                    from_rows,
                }
            }),
        };
        // Unrouted entries still point at a real record, so that no pointer in the
        // table is ever wild.
        for e in 0..experts {
            slots.point(e, 0);
        }
        slots
    }

    /// Device address of the routing table.
    pub(super) fn table_at(&self) -> Ptr {
        Ptr(self.table.device_ptr(&self.stream).0)
    }

    /// Device address of the mask.
    pub(super) fn keep_at(&self) -> Ptr {
        Ptr(self.keep.device_ptr(&self.stream).0)
    }

    /// Experts routed over.
    pub(super) fn experts(&self) -> usize {
        self.keep_host.len()
    }

    /// Points expert `e`'s table entries at slot `slot`'s gate, up and down parts: an
    /// affine matrix's codes, scales and biases, a VQ matrix's codes, norms and signs.
    fn point(&mut self, e: usize, slot: usize) {
        let base = self.pool_at + (slot * self.stride) as u64;
        let at = match &self.tiled {
            Some(t) => tiled_entry(&t.parts, base),
            None => slot_entry(&self.format, base),
        };
        self.table_host[e * ROUTED_ENTRY..(e + 1) * ROUTED_ENTRY].copy_from_slice(&at);
    }

    /// Takes the record in the staging buffer into slot `slot` in tiles, on the copy
    /// stream.
    fn tiles_from_staging(&self, tiled: &TiledSlots, layout: &Layout, slot: usize) {
        let staging = tiled.staging_at;
        let base = self.pool_at + (slot * self.stride) as u64;
        for (m, part) in layout.matrices.iter().zip(&tiled.parts) {
            let (words, scales, biases) = (
                staging + m.codes.offset as u64,
                staging + m.scales.offset as u64,
                staging + m.biases.offset as u64,
            );
            let args = AffineTilesFromRows {
                words: Ptr(words),
                scales: Ptr(scales),
                biases: Ptr(biases),
                rows: m.rows as i32,
                cols: m.cols as i32,
                bits: layout.bits as i32,
                tile_words: Ptr(base + part.words as u64),
                sb: Ptr(base + part.sb as u64),
            };
            // A thread per lane of each unit.
            let threads = tile_units(m.rows, m.cols) * 32;
            let cfg = LaunchConfig {
                grid_dim: (threads.div_ceil(256).min(4096) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the staging buffer holds a whole record of `layout`, and the slot
            // `tiled_parts`' bytes (within the stride); the arguments are the kernel's
            // (`affine_tiles_from_rows`, the one `from_rows` was loaded as). Not
            // programmatic: the copy stream's kernels wait for the copies before them.
            let launched =
                unsafe { launch::launch(&self.copies, &tiled.from_rows, false, cfg, &args) };
            ok(launched, "a record into tiles");
        }
    }
}

/// The table entry of an expert whose record sits at device address `base`: for each of
/// gate, up and down, an affine record's codes, scales and biases, or a VQ record's
/// codes and norms and the address of its signs after the record ([`CudaSlots::new`]).
fn slot_entry(format: &RecordFormat, base: u64) -> [u64; ROUTED_ENTRY] {
    let mut entry = [0u64; ROUTED_ENTRY];
    match format {
        RecordFormat::Affine(layout) => {
            for (m, parts) in layout.matrices.iter().zip(entry.chunks_mut(3)) {
                parts[0] = base + m.codes.offset as u64;
                parts[1] = base + m.scales.offset as u64;
                parts[2] = base + m.biases.offset as u64;
            }
        }
        RecordFormat::Vq(layout) => {
            let mut signs = base + layout.record_size as u64;
            for (m, parts) in layout.matrices.iter().zip(entry.chunks_mut(3)) {
                parts[0] = base + m.codes.offset as u64;
                parts[1] = base + m.norms.offset as u64;
                parts[2] = signs;
                signs += 4 * m.block.div_ceil(32) as u64;
            }
        }
        RecordFormat::Dense { .. } => unreachable!("dense records take no device slots"),
    }
    entry
}

/// The table entry of an expert whose tiled slot starts at device address `base`: for
/// each of gate, up and down, its tiles' words and their scales and biases twice (the
/// tiled kernels read both from one buffer).
fn tiled_entry(parts: &[TiledPart; 3], base: u64) -> [u64; ROUTED_ENTRY] {
    let mut entry = [0u64; ROUTED_ENTRY];
    for (p, at) in parts.iter().zip(entry.chunks_mut(3)) {
        let sb = base + p.sb as u64;
        at.copy_from_slice(&[base + p.words as u64, sb, sb]);
    }
    entry
}

/// A VQ record's rotation signs as the kernels read them, gate's, up's and down's words
/// in turn ([`slot_entry`] points at each).
fn record_signs(layout: &VqLayout, record: &[u8]) -> Vec<u32> {
    record_views(layout, record)
        .iter()
        .flat_map(|m| sign_bits(m.seed, m.block))
        .collect()
}

impl ExpertSlots for CudaSlots {
    fn pin(&mut self, buf: &mut [u32]) {
        let bytes = std::mem::size_of_val(buf);
        if bytes == 0 {
            return;
        }
        let at = buf.as_mut_ptr();
        // SAFETY: `buf` is valid for `bytes` bytes; the caller keeps it alive and in place
        // for as long as these slots live, and `Drop` unregisters it.
        let r = unsafe { sys::cuMemHostRegister_v2(at.cast(), bytes, 0) };
        // Page-locking may be refused (limits); the copies then run from pageable memory,
        // which is slower for the host but still correct.
        if r == sys::CUresult::CUDA_SUCCESS {
            self.pinned.push(at as usize);
        }
    }

    fn load(&mut self, slot: usize, record: &[u32]) {
        assert!(slot < self.count, "slot {slot} of {}", self.count);
        let size = self.format.record_bytes();
        let bytes = std::mem::size_of_val(record).min(size);
        // The copy starts only once the compute stream has passed this point: a slot
        // freed at this boundary may still be read by the step before it.
        let passed = ok(self.stream.record_event(None), "event");
        ok(self.copies.wait(&passed), "stream wait");
        let dst = self.pool_at + (slot * self.stride) as u64;
        let copy = |dst: u64, src: *const u32, bytes: usize| {
            // SAFETY: `dst .. dst + bytes` lies inside the pool (slot < count, the
            // record and its signs within the stride) or is the staging buffer (a whole
            // record); the caller keeps `record` unchanged until `loaded(slot)`, and
            // `signs_host` is only rewritten after the slot's previous load has landed
            // (below).
            let r = unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, self.copies.cu_stream())
            };
            assert_eq!(
                r,
                sys::CUresult::CUDA_SUCCESS,
                "copying a record into slot {slot}"
            );
        };
        if let (Some(tiled), RecordFormat::Affine(layout)) = (&self.tiled, self.format) {
            copy(tiled.staging_at, record.as_ptr(), bytes);
            self.tiles_from_staging(tiled, &layout, slot);
        } else {
            copy(dst, record.as_ptr(), bytes);
        }
        if let (RecordFormat::Vq(layout), Some(host)) = (self.format, self.signs_host.as_mut()) {
            // The slot's previous signs may still be on their way.
            if let Some(previous) = &self.loads[slot] {
                ok(previous.synchronize(), "event");
            }
            let at = &mut ok(host.as_mut_slice(), "page-locked signs")
                [slot * self.signs..(slot + 1) * self.signs];
            at.copy_from_slice(&record_signs(&layout, words_as_bytes(record)));
            copy(dst + size as u64, at.as_ptr(), 4 * self.signs);
        }
        self.loads[slot] = Some(ok(self.copies.record_event(None), "event"));
    }

    fn loaded(&self, slot: usize) -> bool {
        self.loads[slot]
            .as_ref()
            .is_none_or(|e| ok(e.try_is_complete(), "event query"))
    }

    fn wait(&self) {
        ok(self.copies.synchronize(), "copy stream");
    }

    fn assign(&mut self, expert: usize, slot: Option<usize>) {
        match slot {
            Some(s) => {
                assert!(s < self.count, "slot {s} of {}", self.count);
                self.point(expert, s);
                self.keep_host[expert] = 1;
            }
            None => self.keep_host[expert] = 0,
        }
        self.dirty = true;
    }

    fn flush(&mut self) {
        if !self.dirty {
            return;
        }
        ok(
            self.stream.memcpy_htod(&self.table_host, &mut self.table),
            "slot table",
        );
        ok(
            self.stream.memcpy_htod(&self.keep_host, &mut self.keep),
            "slot mask",
        );
        self.dirty = false;
    }

    fn bytes(&self) -> usize {
        let staging = self.tiled.as_ref().map_or(0, |t| t.staging.len());
        self.count * self.stride + staging + self.table_host.len() * 8 + self.keep_host.len()
    }
}

impl Drop for CudaSlots {
    fn drop(&mut self) {
        // Loads in flight read the host buffers about to be unlocked.
        let _ = self.copies.synchronize();
        for &at in &self.pinned {
            // SAFETY: each address was registered by `pin` and not since unregistered.
            unsafe { sys::cuMemHostUnregister(at as *mut std::ffi::c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{record_signs, sign_words, slot_entry, tiled_entry, tiled_parts};
    use crate::backend::cuda::affine::tile_lengths;
    use crate::codec::vq::{rotation, Rung, VqMatrix};
    use crate::store::records::RecordFormat;
    use crate::store::vq::{pack_record, VqLayout};
    use crate::store::Layout;
    use crate::testing::fresh;

    /// The small fixture's experts: gate/up rows of 256 (one rotation block) and down
    /// rows of 80 (one padded block of 128).
    fn layout() -> VqLayout {
        VqLayout::new(Rung::parse("1.5").unwrap(), 256, 80).unwrap()
    }

    #[test]
    fn a_vq_slot_entry_points_at_the_record_parts_and_the_signs_after_it() {
        let l = layout();
        let base = 1 << 20;
        let entry = slot_entry(&RecordFormat::Vq(l), base);
        let mut signs = base + l.record_size as u64;
        for (m, parts) in l.matrices.iter().zip(entry.chunks(3)) {
            assert_eq!(parts[0], base + m.codes.offset as u64);
            assert_eq!(parts[1], base + m.norms.offset as u64);
            // The kernels copy codes and norms in 16-byte chunks from aligned sources.
            assert!(parts[0] % 16 == 0 && parts[1] % 16 == 0);
            assert!(parts[1] + m.norms.len as u64 <= base + l.record_size as u64);
            assert_eq!(parts[2], signs);
            signs += 4 * m.block.div_ceil(32) as u64;
        }
        // Gate's and up's 256-value blocks take 8 words each, down's 128 four.
        assert_eq!(sign_words(&l), 8 + 8 + 4);
        assert_eq!(
            signs,
            base + l.record_size as u64 + 4 * sign_words(&l) as u64
        );
    }

    #[test]
    fn a_tiled_slot_holds_each_matrix_tiles_apart_and_the_entry_points_at_them() {
        // The small fixture's experts (80 rows pad to 96, down's 80 columns are stored
        // as 128) and Qwen3-30B-A3B's, at both tiled widths.
        for (bits, hidden, inter) in [(4, 256, 80), (2, 256, 80), (4, 2048, 768), (2, 2048, 768)] {
            let layout = Layout::new(bits, hidden, inter).unwrap();
            let (parts, bytes) = tiled_parts(&layout);
            let mut end = 0;
            for (m, p) in layout.matrices.iter().zip(&parts) {
                let (words, sb) = tile_lengths(m.rows, m.cols, bits);
                assert!(
                    p.words % 16 == 0 && p.sb % 16 == 0,
                    "{bits} bits: unaligned part"
                );
                assert!(
                    p.words >= end && p.sb >= p.words + 4 * words,
                    "{bits} bits: overlap"
                );
                end = p.sb + 2 * sb;
                // Whole tiles of 16 rows, 64-column units, 32 lanes.
                let units = m.rows.div_ceil(16) * m.cols / 64;
                assert_eq!(words, units * 32 * bits as usize);
                assert_eq!(sb, units * 32);
            }
            assert!(
                bytes >= end && bytes - end < 16,
                "{bits} bits: {bytes} bytes for {end}"
            );
            let base = 1 << 30;
            let entry = tiled_entry(&parts, base);
            for (p, at) in parts.iter().zip(entry.chunks(3)) {
                let sb = base + p.sb as u64;
                assert_eq!(at, [base + p.words as u64, sb, sb]);
            }
        }
    }

    #[test]
    fn a_vq_records_signs_are_its_seeds_rotations_as_bits() {
        let l = layout();
        let seeds = [11u64, 22, 33];
        let mats = [0, 1, 2].map(|i| {
            let m = &l.matrices[i];
            let w = fresh(m.rows * m.cols, seeds[i]);
            VqMatrix::encode(&w, m.rows, m.cols, l.rung, seeds[i]).unwrap()
        });
        let record = pack_record(&l, 3, 5, &mats);
        let bits = record_signs(&l, &record);
        assert_eq!(bits.len(), sign_words(&l));
        let mut at = 0;
        for (m, &seed) in l.matrices.iter().zip(&seeds) {
            let signs = rotation::signs(seed, m.block);
            for (i, s) in signs.iter().enumerate() {
                let bit = bits[at + i / 32] >> (i % 32) & 1;
                assert_eq!(bit == 1, *s < 0.0, "seed {seed}, entry {i}");
            }
            at += m.block.div_ceil(32);
        }
        // Some of each sign: a stuck word would fail above only by chance.
        assert!(bits.iter().any(|&w| w != 0) && bits.iter().any(|&w| w != u32::MAX));
    }
}
