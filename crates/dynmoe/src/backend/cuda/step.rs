//! A decode step's recorded graphs, its queued reads of results, and the instruments
//! that time its launches.
//!
//! A decode step is the same chain of launches every token: recorded once as a CUDA graph
//! (under a key the caller gives), it replays as one launch. Reads of a step's results
//! land in page-locked buffers, so the copy is asynchronous and the host can queue the
//! next step before it waits. Built with `TIMELINE` or `PHASES` (kernels/common.cuh), the
//! kernels stamp the time each launch (or each phase of a routed block) starts.

use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, PinnedHostSlice};

use super::{driver, ok, Cuda, CudaError, PHASE_SLOTS};
use crate::backend::PendingRead;

/// A recorded step.
pub(super) struct Recorded(CudaGraph);

// SAFETY: a graph is only touched under the backend's `graphs` lock, which is the
// external synchronisation CUDA asks of graph objects used from several threads.
unsafe impl Send for Recorded {}

/// Recorded steps kept: one per live sequence is what replays; older ones are dropped.
const MAX_GRAPHS: usize = 8;

/// Read buffers kept for reuse: a decode loop that keeps one step queued ahead has two
/// reads under way at most; page-locking a buffer costs far more than a step.
const READ_SLOTS: usize = 3;

/// A page-locked buffer that a copy from the device lands in without a staging copy
/// (so the copy is asynchronous), and the event recorded after that copy.
pub(super) struct ReadSlot {
    buf: PinnedHostSlice<f32>,
    done: CudaEvent,
}

/// A [`Backend::read_async`](crate::backend::Backend::read_async) under way: its slot, and how many values it copies.
struct InFlight {
    slot: Option<ReadSlot>,
    len: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // An unfinished read: its copy may still be writing the buffer about to be freed.
        if let Some(s) = &self.slot {
            let _ = s.done.synchronize();
        }
    }
}

impl Cuda {
    /// [`Backend::read_async`](crate::backend::Backend::read_async).
    pub(super) fn queue_read(&self, t: &CudaSlice<f32>, len: usize) -> PendingRead {
        if len == 0 {
            return PendingRead::ready(Vec::new());
        }
        let reused = {
            let mut free = self.reads.lock().expect("read slots lock");
            free.iter()
                .position(|s| s.buf.len() >= len)
                .map(|i| free.swap_remove(i))
        };
        let mut slot = reused.unwrap_or_else(|| ReadSlot {
            // Flags 0, not cudarc's default write-combined memory, which the host reads
            // slowly. SAFETY: the buffer's contents are read only where a copy wrote them.
            buf: ok(
                unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len, 0) },
                "pinned alloc",
            ),
            done: ok(self.ctx.new_event(None), "event"),
        });
        let src = t.slice(..len);
        ok(self.stream.memcpy_dtoh(&src, &mut slot.buf), "download");
        // The context tracks no events (see `new`), so cudarc records none after the copy
        // on the buffer's own; this one is what `finish_read` waits on.
        ok(slot.done.record(&self.stream), "event record");
        PendingRead::queued(Box::new(InFlight {
            slot: Some(slot),
            len,
        }))
    }

    /// [`Backend::finish_read`](crate::backend::Backend::finish_read).
    pub(super) fn take_read(&self, read: PendingRead) -> Vec<f32> {
        let handle = match read.into_values() {
            Ok(values) => return values,
            Err(h) => h,
        };
        let Ok(mut read) = handle.downcast::<InFlight>() else {
            panic!("cuda: a read that was not started by this backend");
        };
        let slot = read.slot.take().expect("a read under way holds its slot");
        ok(slot.done.synchronize(), "event synchronize");
        let values = ok(slot.buf.as_slice(), "pinned read")[..read.len].to_vec();
        let mut free = self.reads.lock().expect("read slots lock");
        if free.len() < READ_SLOTS {
            free.push(slot);
        }
        values
    }

    /// [`Backend::replay_step`](crate::backend::Backend::replay_step): the step recorded
    /// under `key` replayed, else `body` recorded and launched (or, with graphs off or
    /// where recording fails, run as it is).
    pub(super) fn replay(&self, key: (usize, u64), body: &mut dyn FnMut() -> bool) -> bool {
        if !self.tuning.graphs {
            body();
            return false;
        }
        {
            let graphs = self.graphs.lock().expect("graphs lock");
            if let Some((_, g)) = graphs.iter().find(|(k, _)| *k == key) {
                ok(g.0.launch(), "graph launch");
                return true;
            }
        }
        let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if self.stream.begin_capture(mode).is_err() {
            body();
            return false;
        }
        let fit = body();
        let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
        match (fit, self.stream.end_capture(flags)) {
            (true, Ok(Some(g))) => {
                ok(g.launch(), "graph launch");
                let mut graphs = self.graphs.lock().expect("graphs lock");
                if graphs.len() == MAX_GRAPHS {
                    graphs.remove(0);
                }
                graphs.push((key, Recorded(g)));
                true
            }
            // Not recorded (or not fit to be): nothing of it ran, so run it as it is.
            _ => {
                body();
                false
            }
        }
    }

    /// Whether the kernels were built with `TIMELINE` (`DYNMOE_CUDA=define=TIMELINE=N`),
    /// so that [`timeline_take`](Self::timeline_take) can time each launch in the chain.
    pub fn timeline_on(&self) -> bool {
        self.timeline.is_some()
    }

    /// Starts a timeline: from here each launch's first block stamps the time its wait
    /// returned. Launch eagerly (graphs off) until [`timeline_take`](Self::timeline_take),
    /// so that every stamp has its kernel's name.
    pub fn timeline_start(&self) -> Result<(), CudaError> {
        let Some(names) = &self.timeline else {
            return Ok(());
        };
        driver(self.stream.synchronize())?;
        let mut count = driver(self.k.module.get_global("timeline_count", &self.stream))?;
        // SAFETY: the global is one `unsigned`.
        let mut count =
            unsafe { count.transmute_mut::<u32>(1) }.expect("timeline_count is 4 bytes");
        driver(self.stream.memcpy_htod(&[0u32], &mut count))?;
        driver(self.stream.synchronize())?;
        names.lock().expect("timeline lock").clear();
        Ok(())
    }

    /// Each launch since [`timeline_start`](Self::timeline_start): its kernel's name and
    /// the global timer (ns) when its wait returned. Fails if the stamps and the launches
    /// do not pair up (more launches than slots, or a kernel whose first thread skipped
    /// its wait).
    pub fn timeline_take(&self) -> Result<Vec<(&'static str, u64)>, CudaError> {
        let Some(names) = &self.timeline else {
            return Ok(Vec::new());
        };
        driver(self.stream.synchronize())?;
        let names = std::mem::take(&mut *names.lock().expect("timeline lock"));
        let count = driver(self.k.module.get_global("timeline_count", &self.stream))?;
        // SAFETY: the global is one `unsigned`.
        let count = unsafe { count.transmute::<u32>(1) }.expect("timeline_count is 4 bytes");
        let count = driver(self.stream.clone_dtoh(&count))?[0] as usize;
        let stamps = driver(self.k.module.get_global("timeline_stamps", &self.stream))?;
        let slots = stamps.len() / 8;
        // SAFETY: the global is `slots` u64s.
        let stamps = unsafe { stamps.transmute::<u64>(slots) }.expect("timeline_stamps");
        let stamps = driver(self.stream.clone_dtoh(&stamps))?;
        if count != names.len() || count > slots {
            return Err(CudaError::Driver(format!(
                "timeline: {count} stamps for {} launches ({slots} slots)",
                names.len()
            )));
        }
        Ok(names.into_iter().zip(stamps).collect())
    }

    /// With the kernels built with `PHASES=N` (kernels/common.cuh's `PHASE`), the last
    /// routed gate/up launch's stamps (`[0]`) and the last routed down launch's (`[1]`):
    /// for each of the first N blocks, the global timer (ns) at each of its
    /// `PHASE_SLOTS` phases, 0 where a block or phase has none. None without the define.
    pub fn phase_stamps(&self) -> Result<Option<[Vec<[u64; PHASE_SLOTS]>; 2]>, CudaError> {
        let Ok(stamps) = self.k.module.get_global("phase_stamps", &self.stream) else {
            return Ok(None);
        };
        driver(self.stream.synchronize())?;
        let n = stamps.len() / 8;
        // SAFETY: the global is `n` u64s, [2][blocks][PHASE_SLOTS].
        let stamps = unsafe { stamps.transmute::<u64>(n) }.expect("phase_stamps");
        let v = driver(self.stream.clone_dtoh(&stamps))?;
        let blocks = |k: usize| {
            v[k * n / 2..(k + 1) * n / 2]
                .chunks_exact(PHASE_SLOTS)
                .map(|c| c.try_into().expect("a block's slots"))
                .collect()
        };
        Ok(Some([blocks(0), blocks(1)]))
    }
}
