//! A resident set's expert slots in device memory (DESIGN.md §7 on the GPU).
//!
//! One allocation holds every slot of a MoE layer, each one affine expert record as
//! stored, so that a swap is one copy of the record's bytes. The routed kernels reach
//! an expert through a table of pointers indexed by expert id; a resident expert's
//! entries point into its slot, and a byte mask keeps routing off the others. Loads
//! run on a copy stream of their own, from page-locked host buffers, so a token never
//! waits for one; the table and mask change only when the resident set flushes them at
//! a token boundary, on the compute stream, so every launch sees one consistent set.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};

use super::{ok, RoutedShape, ROUTED_ENTRY};
use crate::backend::ExpertSlots;
use crate::store::Layout;

/// Slots of one MoE layer on the device, with their routing table and mask.
pub struct CudaSlots {
    /// The stream every op runs on: table flushes go there.
    stream: Arc<CudaStream>,
    /// The stream loads run on.
    copies: Arc<CudaStream>,
    pub(super) shape: RoutedShape,
    layout: Layout,
    // Owned here, addressed through `pool_at`.
    _pool: CudaSlice<u8>,
    pool_at: u64,
    count: usize,
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
}

// SAFETY: the raw host addresses in `pinned` are only handed back to the driver; every
// device object here is owned by this value and used from one thread at a time (the
// resident set's lock).
unsafe impl Send for CudaSlots {}

impl CudaSlots {
    /// `count` slots for records of `layout`, over `experts` experts.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        copies: &Arc<CudaStream>,
        shape: RoutedShape,
        layout: &Layout,
        experts: usize,
        count: usize,
    ) -> CudaSlots {
        let pool: CudaSlice<u8> = ok(
            stream.alloc_zeros(count.max(1) * layout.record_size),
            "slot pool",
        );
        let pool_at = pool.device_ptr(stream).0;
        let mut slots = CudaSlots {
            stream: stream.clone(),
            copies: copies.clone(),
            shape,
            layout: *layout,
            _pool: pool,
            pool_at,
            count,
            table_host: vec![0; experts * ROUTED_ENTRY],
            table: ok(stream.alloc_zeros(experts * ROUTED_ENTRY), "slot table"),
            keep_host: vec![0; experts],
            keep: ok(stream.alloc_zeros(experts), "slot mask"),
            dirty: true,
            loads: (0..count).map(|_| None).collect(),
            pinned: Vec::new(),
        };
        // Unrouted entries still point at a real record, so that no pointer in the
        // table is ever wild.
        for e in 0..experts {
            slots.point(e, 0);
        }
        slots
    }

    /// Device address of the routing table.
    pub(super) fn table_at(&self) -> u64 {
        self.table.device_ptr(&self.stream).0
    }

    /// Device address of the mask.
    pub(super) fn keep_at(&self) -> u64 {
        self.keep.device_ptr(&self.stream).0
    }

    /// Experts routed over.
    pub(super) fn experts(&self) -> usize {
        self.keep_host.len()
    }

    /// Points expert `e`'s table entries at slot `slot`'s gate, up and down parts.
    fn point(&mut self, e: usize, slot: usize) {
        let base = self.pool_at + (slot * self.layout.record_size) as u64;
        let entry = &mut self.table_host[e * ROUTED_ENTRY..(e + 1) * ROUTED_ENTRY];
        for (m, parts) in self.layout.matrices.iter().zip(entry.chunks_mut(3)) {
            parts[0] = base + m.codes.offset as u64;
            parts[1] = base + m.scales.offset as u64;
            parts[2] = base + m.biases.offset as u64;
        }
    }
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
        let bytes = std::mem::size_of_val(record).min(self.layout.record_size);
        // The copy starts only once the compute stream has passed this point: a slot
        // freed at this boundary may still be read by the step before it.
        let passed = ok(self.stream.record_event(None), "event");
        ok(self.copies.wait(&passed), "stream wait");
        let dst = self.pool_at + (slot * self.layout.record_size) as u64;
        // SAFETY: `dst` lies inside the pool (slot < count, bytes ≤ record size); the
        // caller keeps `record` unchanged until `loaded(slot)`.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, record.as_ptr().cast(), bytes, self.copies.cu_stream())
        };
        assert_eq!(
            r,
            sys::CUresult::CUDA_SUCCESS,
            "copying a record into slot {slot}"
        );
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
        self.count * self.layout.record_size + self.table_host.len() * 8 + self.keep_host.len()
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
