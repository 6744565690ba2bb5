//! The CUDA backend: tensors in device memory, kernels compiled by NVRTC for the
//! device's architecture when the backend is made, cuBLAS for dense products.
//!
//! Nothing of CUDA is linked: the driver, NVRTC and cuBLAS are loaded when
//! [`Cuda::new`] runs, which probes for each library first and returns
//! [`CudaError::Unavailable`] on a machine without them (cudarc itself would panic).
//!
//! Affine expert weights arrive as [`AffineView`]s over host memory (an expert
//! store's mapping). The first product with a matrix copies its words, scales and
//! biases to the device; later products find the copy by the view's host addresses,
//! confirmed against a few of its words so that a store mapped again at the same
//! address is never served stale weights. A model therefore reads each expert from host
//! memory once; [`Cuda::clear_weight_cache`] drops the copies.
//!
//! VQ-ladder matrices ([`VqView`]) are copied the same way (codes and block norms, as
//! stored) and multiplied straight from the codes: each activation row is rotated once
//! per product (`vq_rotate`), then a warp per output row looks up each vector's codeword
//! in the rung's codebook (expanded to all `2^k` codewords in fp16, one device copy per
//! rung; in shared memory when it fits beside the activations) and scales the block
//! sums by the norms. Above a few rows (`MATVEC_MAX_BATCH`) the matrix is decoded in the
//! rotated domain into a scratch buffer and multiplied by cuBLAS with the rotated rows.
//! A MoE block's VQ experts are routed on the device like affine ones; at rungs of 4- to
//! 16-value vectors their products run on tensor cores, each codeword looked up from the
//! book straight into an `mma.sync` fragment (a prompt's pairs grouped by expert for two
//! grouped GEMMs, a decode step's through `routed_vq_*_mma`).
//!
//! Dense weight matrices ([`DeviceMatrix`]) are kept in bf16 when every value is one
//! (checkpoint weights are), else in f32: decode reads the LM head and the attention
//! projections whole every token, and bf16 halves those bytes without changing a value.
//!
//! Ops have no error path in [`Backend`]; a failing CUDA call after the backend was
//! made (out of memory, a kernel fault) panics with the call's error.
//!
//! The code is kept one op family a file, as the kernels are (`kernels/*.cu`): each
//! family's file names its kernels, writes their parameter lists once (launch.rs) and
//! decides their launches; this file holds the backend's state and a [`Backend`] impl
//! that hands each op to its family. How it runs is one [`Tuning`], chosen when it is
//! made; every other choice follows from the device and the shapes, as measured
//! (the GPU rounds in docs/notes/).

mod affine;
mod affine_mma;
mod attention;
mod expert_gemm;
mod launch;
mod matvec;
mod norm;
mod open;
mod program;
mod route;
mod routed;
mod sample;
mod slots;
mod step;
mod tuning;
mod vq;
mod vq_mma;

pub use affine::AFFINE_GEMM_ROWS;
pub use matvec::DeviceMatrix;
pub use open::{probe, CudaError};
pub use program::{source, SOURCES};
pub use routed::ROUTED_MAX_ROWS;
pub use slots::CudaSlots;
pub use tuning::Tuning;

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    LaunchConfig,
};

use super::{
    sample::Sampling, swiglu_groups_one_by_one, AddNorm, AttentionShape, Backend, DeviceRoute,
    HeadNorm, MoeInput, PendingRead, RoutedExperts, SwiGluGroup, Weight,
};
use crate::codec::affine::kernels::AffineView;
use crate::codec::vq::VqView;
use crate::store::records::RecordFormat;
use affine::{AffineKey, DeviceAffine};
use launch::{Args, Ptr};
use matvec::is_bf16_exact;
use norm::{
    Add, AddBias, AddRmsNorm, AddRmsNormTo, ClampValues, GatherRows, NormRows, RmsNorm,
    RmsNormInplace, Rope, ScatterAddRows, SiluMul,
};
use program::Kernels;
use routed::RoutedBlock;
use step::{ReadSlot, Recorded};
use vq::{DeviceVq, VqKey};

/// Dynamic shared memory a block may take without opting in.
const SHARED_LIMIT: usize = 48 << 10;

/// Phases a block of the routed kernels stamps with `PHASES` (the kernels' `PHASE_SLOTS`).
pub const PHASE_SLOTS: usize = 8;

/// The CUDA backend on one device.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Loads into resident-set slots ([`CudaSlots`]) run here, beside the compute.
    copies: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    arch: String,
    device_name: String,
    affine: Mutex<HashMap<AffineKey, Arc<DeviceAffine>>>,
    /// Device copies of VQ matrices' codes and norms, by host address of their codes.
    vq: Mutex<HashMap<VqKey, Arc<DeviceVq>>>,
    /// Each rung's codebook expanded to all `2^k` codewords in fp16, by ladder position.
    vq_books: Mutex<HashMap<usize, Arc<CudaSlice<u16>>>>,
    /// Activations in a VQ matrix's rotated domain, grown as needed.
    vq_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Small host arrays passed to every call of an op (RoPE frequencies), uploaded once.
    constants: Mutex<Vec<Constant>>,
    /// MoE blocks routed on the device, by [`RoutedExperts::id`].
    routed: Mutex<HashMap<usize, RoutedBlock>>,
    /// Intermediates of [`Backend::routed_moe`], grown as needed; reused by every call,
    /// which the single stream orders.
    routed_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Recorded decode steps, by key, most recent last; each holds device addresses of
    /// buffers it read, so whatever frees or replaces one of those drops them all.
    graphs: Mutex<Vec<((usize, u64), Recorded)>>,
    /// How the backend was asked to run.
    tuning: Tuning,
    /// Page-locked buffers of [`Backend::read_async`] not in use, at most `READ_SLOTS`.
    reads: Mutex<Vec<ReadSlot>>,
    /// Partial results of one-row attention split over the keys, grown as needed.
    attn_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// `argmax_rows`' per-row block counts (zero between launches: the last block of a
    /// row resets its count) and partial maxima, grown as needed.
    argmax_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// A bf16 matrix widened to f32 (or a VQ matrix decoded) for a cuBLAS product of more
    /// rows than the matrix-vector kernels take; grown to the largest matrix seen, never
    /// inside a recorded step (those are one row).
    dense_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Activations split into two bf16 parts for tensor-core products, grown as needed.
    split_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// The sampler's scaled logits, histogram, cut and partials (`sample::Layout`), grown
    /// as needed; its histogram and counts zero between launches.
    sample_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Whether the sampler's kernels were granted their shared memory, so that a step
    /// picks its token on the device whatever the settings.
    samples: bool,
    /// Whether products run on tensor cores ([`Tuning::tensor_cores`] on sm_80 and later).
    tensor_cores: bool,
    /// The flag gate/up raises once the route is written and the count of down blocks
    /// that saw it (the down kernel's early start): both zero between launches.
    down_ready: CudaSlice<u32>,
    /// The routed down kernels on tensor cores whose blocks ask for at least so many
    /// bytes of shared memory, so that two never share an SM (`routed::down_alone`).
    down_alone: Vec<routed::PaddedDown>,
    /// Whether a dense product has run on a one-row bf16 kernel
    /// ([`dense_bf16_matvec`](Cuda::dense_bf16_matvec)); [`Cuda::down_padding`] reads it.
    bf16_one_row_dense: AtomicBool,
    /// The widest head the tiled prefill kernels were given their shared memory for (0:
    /// none; the device's per-block limit decides).
    tiled_head_dim: usize,
    /// Dynamic shared memory the routed VQ kernels may take (their book beside their
    /// activations).
    vq_routed_shared: usize,
    /// Streaming multiprocessors of the device: what a launch needs blocks enough to fill.
    sms: usize,
    /// Whether kernels launch with programmatic dependent launch (the `launch` module):
    /// [`Tuning::pdl`] on sm_90 and later.
    programmatic: bool,
    /// Blocks a multiprocessor of the one-row dense kernels' launch bound (their
    /// `DMMA_BLOCKS`, which [`Tuning::defines`] may set), which their grids are sized by.
    dmma_blocks: usize,
    /// With the kernels built with `TIMELINE` (kernels/common.cuh), the name of each kernel
    /// launched since [`timeline_start`](Cuda::timeline_start), in launch order.
    timeline: Option<Mutex<Vec<&'static str>>>,
}

fn blocks(n: usize, threads: usize) -> u32 {
    n.div_ceil(threads).max(1) as u32
}

fn cfg(grid: usize, threads: u32, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// A thread per element of `n` (nothing for none).
fn one_d(n: usize) -> Option<LaunchConfig> {
    (n > 0).then(|| cfg(blocks(n, 256) as usize, 256, 0))
}

/// Threads for a kernel that loops over a row of `width`.
fn row_threads(width: usize) -> u32 {
    (width.next_power_of_two().clamp(32, 256)) as u32
}

/// A host array passed to every call of an op and its device copy.
type Constant = (Vec<f32>, Arc<CudaSlice<f32>>);

fn driver<T>(r: Result<T, cudarc::driver::DriverError>) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::Driver(format!("{e:?}")))
}

/// Unwraps a CUDA result inside an op, which has no error path.
fn ok<T, E: std::fmt::Debug>(r: Result<T, E>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("CUDA {what} failed: {e:?}"),
    }
}

impl Cuda {
    /// The device's name, as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The architecture the kernels were compiled for (`sm_90`, ...).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Waits for every queued op.
    pub fn synchronize(&self) {
        ok(self.stream.synchronize(), "stream synchronize");
    }

    /// The stream every op runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context (for memory queries).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Milliseconds the device spent on the work `f` queues, between two timing events
    /// on the stream; waits for it to finish.
    pub fn time_ms(&self, f: impl FnOnce()) -> f64 {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = ok(self.ctx.new_event(flags), "event");
        let b = ok(self.ctx.new_event(flags), "event");
        ok(a.record(&self.stream), "event record");
        f();
        ok(b.record(&self.stream), "event record");
        ok(b.synchronize(), "event synchronize");
        ok(a.elapsed_ms(&b), "event elapsed") as f64
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus bytes written), the
    /// median of 15 passes of the copy kernel over 2 × 1 GiB.
    pub fn copy_bandwidth(&self) -> f64 {
        let n = 256 << 20;
        let src = self.alloc(n);
        let mut dst = self.alloc(n);
        self.copy_kernel(&src, &mut dst, n);
        let mut ts: Vec<f64> = (0..15)
            .map(|_| self.time_ms(|| self.copy_kernel(&src, &mut dst, n)))
            .collect();
        ts.sort_by(f64::total_cmp);
        (2 * n * 4) as f64 / (ts[7] * 1e-3) / 1e9
    }

    /// How the backend was asked to run.
    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    /// Whether products run on tensor cores: [`Tuning::tensor_cores`] where the device has
    /// them (sm_80 and later).
    pub fn tensor_cores(&self) -> bool {
        self.tensor_cores
    }

    /// Decode steps recorded as graphs and kept for replay.
    pub fn recorded_steps(&self) -> usize {
        self.graphs.lock().expect("graphs lock").len()
    }

    /// Forgets every recorded step (a buffer one may read is about to go).
    fn drop_graphs(&self) {
        self.graphs.lock().expect("graphs lock").clear();
    }

    /// Drops every device copy of quantized weights.
    pub fn clear_weight_cache(&self) {
        self.drop_graphs();
        self.routed.lock().expect("weight cache lock").clear();
        self.affine.lock().expect("weight cache lock").clear();
        self.vq.lock().expect("weight cache lock").clear();
    }

    /// The buffer in `slot`, replaced by one of at least `n` floats when it is smaller.
    /// Recorded steps may read the old one, so growing drops them; a step of the sizes
    /// seen before allocates nothing.
    fn grown<'s>(
        &self,
        slot: &'s Mutex<Option<CudaSlice<f32>>>,
        n: usize,
    ) -> MutexGuard<'s, Option<CudaSlice<f32>>> {
        self.grown_with(slot, n, false)
    }

    /// [`grown`](Self::grown), a new buffer zeroed when `zero` (for kernels that keep
    /// counters in it).
    fn grown_with<'s>(
        &self,
        slot: &'s Mutex<Option<CudaSlice<f32>>>,
        n: usize,
        zero: bool,
    ) -> MutexGuard<'s, Option<CudaSlice<f32>>> {
        let mut s = slot.lock().expect("scratch lock");
        if s.as_ref().is_none_or(|s| s.len() < n) {
            self.drop_graphs();
            // The old buffer goes first, so the two never take device memory together.
            *s = None;
            *s = Some(if zero {
                ok(self.stream.alloc_zeros::<f32>(n.max(1)), "alloc")
            } else {
                ok(unsafe { self.stream.alloc::<f32>(n.max(1)) }, "alloc")
            });
        }
        s
    }

    /// Bytes of affine weights held on the device.
    pub fn weight_cache_bytes(&self) -> usize {
        self.affine
            .lock()
            .expect("weight cache lock")
            .values()
            .map(|a| a.bytes())
            .sum()
    }

    /// A device copy of `v`, uploaded the first time these values are seen.
    fn constant(&self, v: &[f32]) -> Arc<CudaSlice<f32>> {
        let mut c = self.constants.lock().expect("constants lock");
        if let Some((_, d)) = c.iter().find(|(h, _)| h.as_slice() == v) {
            return d.clone();
        }
        let d = Arc::new(self.upload(v));
        c.push((v.to_vec(), d.clone()));
        d
    }

    fn upload_u32(&self, v: &[u32]) -> CudaSlice<u32> {
        ok(self.stream.clone_htod(v), "upload")
    }

    /// The device address of `b`, for a kernel that reads it.
    fn ptr<T>(&self, b: &impl DevicePtr<T>) -> Ptr {
        Ptr(b.device_ptr(&self.stream).0)
    }

    /// The device address of `b`, for a kernel that writes it.
    fn ptr_mut<T>(&self, b: &mut impl DevicePtrMut<T>) -> Ptr {
        Ptr(b.device_ptr_mut(&self.stream).0)
    }

    /// Queues kernel `name` (one of `A`'s) with `args` on the compute stream,
    /// programmatic where the device and the tuning allow.
    fn launch<A: Args>(&self, name: &'static str, cfg: LaunchConfig, args: A) {
        assert!(
            A::KERNELS.contains(&name),
            "{name} does not take these arguments"
        );
        if let Some(names) = &self.timeline {
            names.lock().expect("timeline lock").push(name);
        }
        // SAFETY: `args` is the parameter list the source declares for `name` (checked
        // against the source by program.rs' tests), and every buffer it points into is
        // kept by the caller or freed in stream order after the launch.
        let launched =
            unsafe { launch::launch(&self.stream, &self.k.f[name], self.programmatic, cfg, &args) };
        ok(launched, name);
    }
}

impl Backend for Cuda {
    type Tensor = CudaSlice<f32>;
    type Matrix = DeviceMatrix;
    type Slots = CudaSlots;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn memory_free(&self) -> Option<usize> {
        self.ctx.mem_get_info().ok().map(|(free, _total)| free)
    }

    fn upload(&self, data: &[f32]) -> CudaSlice<f32> {
        if data.is_empty() {
            return self.alloc(0);
        }
        ok(self.stream.clone_htod(data), "upload")
    }

    fn upload_matrix(&self, data: &[f32], out_dim: usize, in_dim: usize) -> DeviceMatrix {
        debug_assert_eq!(data.len(), out_dim * in_dim);
        if data.is_empty() || !data.iter().all(|&v| is_bf16_exact(v)) {
            return DeviceMatrix::F32(self.upload(data));
        }
        let bits: Vec<u16> = data.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        DeviceMatrix::Bf16(ok(self.stream.clone_htod(&bits), "upload"))
    }

    fn alloc(&self, len: usize) -> CudaSlice<f32> {
        // NaN, as on the CPU: a read of something no op wrote shows up in the output.
        let mut t = ok(unsafe { self.stream.alloc::<f32>(len.max(1)) }, "alloc");
        self.fill(&mut t, f32::NAN, len);
        t
    }

    fn zeros(&self, len: usize) -> CudaSlice<f32> {
        ok(self.stream.alloc_zeros::<f32>(len.max(1)), "alloc")
    }

    fn download(&self, t: &CudaSlice<f32>, out: &mut [f32]) {
        if out.is_empty() {
            return;
        }
        let src: CudaView<'_, f32> = t.slice(..out.len());
        ok(self.stream.memcpy_dtoh(&src, out), "download");
        self.synchronize();
    }

    fn embed(
        &self,
        table: Weight<'_, DeviceMatrix>,
        dim: usize,
        ids: &[u32],
        out: &mut CudaSlice<f32>,
    ) {
        if ids.is_empty() {
            return;
        }
        let ids = self.upload_u32(ids);
        self.embed_rows(table, dim, &ids, ids.len(), out);
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) {
        let rows = NormRows::new(rows, dim, eps);
        let args = RmsNorm {
            x: self.ptr(x),
            w: self.ptr(w),
            out: self.ptr_mut(out),
            rows,
        };
        self.launch_norm(norm::RMS_NORM, rows, args);
    }

    fn rms_norm_inplace(
        &self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) {
        let rows = NormRows::new(rows, dim, eps);
        let (x, w) = (self.ptr_mut(x), self.ptr(w));
        self.launch_norm(norm::RMS_NORM_INPLACE, rows, RmsNormInplace { x, w, rows });
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        delta: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) {
        let rows = NormRows::new(rows, dim, eps);
        let args = AddRmsNorm {
            x: self.ptr_mut(x),
            delta: self.ptr(delta),
            w: self.ptr(w),
            out: self.ptr_mut(out),
            rows,
        };
        self.launch_norm(norm::ADD_RMS_NORM, rows, args);
    }

    fn add_rms_norm_to(
        &self,
        n: AddNorm<'_, CudaSlice<f32>>,
        rows: usize,
        dim: usize,
        sum: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) {
        let Some(delta) = n.delta else {
            return self.rms_norm(n.x, n.w, rows, dim, n.eps, out);
        };
        let rows = NormRows::new(rows, dim, n.eps);
        let args = AddRmsNormTo {
            x: self.ptr(n.x),
            delta: self.ptr(delta),
            w: self.ptr(n.w),
            sum: self.ptr_mut(sum),
            out: self.ptr_mut(out),
            rows,
        };
        self.launch_norm(norm::ADD_RMS_NORM_TO, rows, args);
    }

    fn add_rms_norm_linear3(
        &self,
        n: AddNorm<'_, CudaSlice<f32>>,
        sum: &mut CudaSlice<f32>,
        xn: &mut CudaSlice<f32>,
        ws: [Weight<'_, DeviceMatrix>; 3],
        rows: usize,
        in_dim: usize,
        out_dims: [usize; 3],
        outs: [&mut CudaSlice<f32>; 3],
    ) {
        if !self.dense_mma_folds_norm(&ws, rows, in_dim) {
            self.add_rms_norm_to(n, rows, in_dim, sum, xn);
            return self.linear3(xn, ws, rows, in_dim, out_dims, outs);
        }
        let norm = self.input_norm(n, sum);
        let outs = outs.map(|o| self.ptr_mut(o));
        self.dense_mma_product(n.x, &ws, [rows, in_dim], &outs, Some(&norm));
    }

    fn add_rms_norm_linear(
        &self,
        n: AddNorm<'_, CudaSlice<f32>>,
        sum: &mut CudaSlice<f32>,
        xn: &mut CudaSlice<f32>,
        w: Weight<'_, DeviceMatrix>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let ws = [w];
        if out_dim == 0 || !self.dense_mma_folds_norm(&ws, rows, in_dim) {
            self.add_rms_norm_to(n, rows, in_dim, sum, xn);
            let [w] = ws;
            return self.linear(xn, w, rows, in_dim, out_dim, out);
        }
        let norm = self.input_norm(n, sum);
        let out = self.ptr_mut(out);
        self.dense_mma_product(n.x, &ws, [rows, in_dim], &[out], Some(&norm));
    }

    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &DeviceMatrix,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        self.dense_product(x, w, rows, in_dim, out_dim, out);
    }

    fn matmul_affine(
        &self,
        x: &CudaSlice<f32>,
        w: &AffineView<'_>,
        rows: usize,
        in_dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if rows == 0 || w.rows == 0 {
            return;
        }
        let d = self.device_affine(w, true);
        self.affine_product(x, w, &d, rows, in_dim, out);
    }

    fn matmul_vq(&self, x: &CudaSlice<f32>, w: &VqView<'_>, rows: usize, out: &mut CudaSlice<f32>) {
        if rows == 0 || w.rows == 0 {
            return;
        }
        let d = self.device_vq(w);
        self.vq_product(x, w, &d, rows, out);
    }

    fn linear3(
        &self,
        x: &CudaSlice<f32>,
        ws: [Weight<'_, DeviceMatrix>; 3],
        rows: usize,
        in_dim: usize,
        out_dims: [usize; 3],
        outs: [&mut CudaSlice<f32>; 3],
    ) {
        use DeviceMatrix::Bf16;
        use Weight::Dense;
        match ws {
            [Dense(Bf16(a)), Dense(Bf16(b)), Dense(Bf16(c))]
                if (1..=matvec::MATVEC_MAX_BATCH).contains(&rows) =>
            {
                self.launch_matvec_bf16_3(x, [a, b, c], rows, in_dim, out_dims, outs);
            }
            ref ws3 if self.dense_mma_takes(ws3, rows, in_dim) => {
                let outs = outs.map(|o| self.ptr_mut(o));
                self.dense_mma_product(x, ws3, [rows, in_dim], &outs, None);
            }
            _ => {
                for ((w, d), out) in ws.into_iter().zip(out_dims).zip(outs) {
                    self.linear(x, w, rows, in_dim, d, out);
                }
            }
        }
    }

    fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, rows: usize) {
        let n = rows * bias.len();
        let args = AddBias {
            x: self.ptr_mut(x),
            bias: self.ptr(bias),
            dim: bias.len() as i32,
            n: n as i64,
        };
        self.launch_each(norm::ADD_BIAS, n, args);
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) {
        let (x, y) = (self.ptr_mut(x), self.ptr(y));
        self.launch_each(norm::ADD, n, Add { x, y, n: n as i64 });
    }

    fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: usize) {
        let (gate, up) = (self.ptr_mut(gate), self.ptr(up));
        self.launch_each(
            norm::SILU_MUL,
            n,
            SiluMul {
                gate,
                up,
                n: n as i64,
            },
        );
    }

    fn clamp(&self, x: &mut CudaSlice<f32>, limit: f32, n: usize) {
        let x = self.ptr_mut(x);
        self.launch_each(
            norm::CLAMP_VALUES,
            n,
            ClampValues {
                x,
                limit,
                n: n as i64,
            },
        );
    }

    fn softmax_rows(&self, x: &mut CudaSlice<f32>, rows: usize, dim: usize) {
        self.launch_softmax_rows(self.ptr_mut(x), rows, dim);
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[usize],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
    ) {
        if positions.is_empty() {
            return;
        }
        // The forward pass always asks for consecutive positions: no upload then.
        let p0 = positions[0];
        let consecutive = positions.iter().enumerate().all(|(i, &p)| p == p0 + i);
        let pos = (!consecutive).then(|| {
            let v: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
            self.upload_u32(&v)
        });
        let freq = self.constant(inv_freq);
        let args = Rope {
            x: self.ptr_mut(x),
            positions: pos.as_ref().map_or(Ptr::NULL, |p| self.ptr(p)),
            pos0: p0 as u32,
            inv_freq: self.ptr(&*freq),
            heads: heads as i32,
            head_dim: head_dim as i32,
        };
        self.launch_rope(args, positions.len(), heads, head_dim);
    }

    fn write_rows(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        dst_row: usize,
        rows: usize,
        width: usize,
    ) {
        let n = rows * width;
        if n == 0 {
            return;
        }
        let s = src.slice(..n);
        let mut d: CudaViewMut<'_, f32> = dst.slice_mut(dst_row * width..dst_row * width + n);
        ok(self.stream.memcpy_dtod(&s, &mut d), "copy");
    }

    fn attention_rows(
        &self,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        positions: &[usize],
        k_caches: &mut [&mut CudaSlice<f32>],
        v_caches: &mut [&mut CudaSlice<f32>],
        shape: AttentionShape,
        out: &mut CudaSlice<f32>,
    ) {
        self.attention_of_rows([q, k, v], positions, k_caches, v_caches, shape, out);
    }

    fn attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        shape: AttentionShape,
        out: &mut CudaSlice<f32>,
    ) {
        self.launch_attention([q, k_cache, v_cache], shape, out);
    }

    fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        rows: &[u32],
        width: usize,
        dst: &mut CudaSlice<f32>,
    ) {
        if rows.is_empty() {
            return;
        }
        let r = self.upload_u32(rows);
        let args = GatherRows {
            src: self.ptr(src),
            rows: self.ptr(&r),
            dst: self.ptr_mut(dst),
            width: width as i32,
        };
        self.launch_rows(norm::GATHER_ROWS, rows.len(), width, args);
    }

    fn scatter_add_rows(
        &self,
        src: &CudaSlice<f32>,
        rows: &[u32],
        scales: &[f32],
        width: usize,
        dst: &mut CudaSlice<f32>,
    ) {
        if rows.is_empty() {
            return;
        }
        let r = self.upload_u32(rows);
        let s = ok(self.stream.clone_htod(scales), "upload");
        let args = ScatterAddRows {
            src: self.ptr(src),
            rows: self.ptr(&r),
            scales: self.ptr(&s),
            dst: self.ptr_mut(dst),
            width: width as i32,
        };
        self.launch_rows(norm::SCATTER_ADD_ROWS, rows.len(), width, args);
    }

    fn upload_into(&self, data: &[f32], t: &mut CudaSlice<f32>) {
        if data.is_empty() {
            return;
        }
        assert!(
            data.len() <= t.len(),
            "{} values into a tensor of {}",
            data.len(),
            t.len()
        );
        let mut dst = t.slice_mut(..data.len());
        ok(self.stream.memcpy_htod(data, &mut dst), "upload");
    }

    fn embed_at(
        &self,
        table: Weight<'_, DeviceMatrix>,
        dim: usize,
        step: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) {
        // The token id is step[0]'s bits: the step tensor serves as a one-id list.
        self.embed_rows(table, dim, step, 1, out);
    }

    fn rope_at(
        &self,
        x: &mut CudaSlice<f32>,
        step: &CudaSlice<f32>,
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
    ) {
        let freq = self.constant(inv_freq);
        let args = Rope {
            x: self.ptr_mut(x),
            positions: self.ptr(&step.slice(1..2)),
            pos0: 0,
            inv_freq: self.ptr(&*freq),
            heads: heads as i32,
            head_dim: head_dim as i32,
        };
        self.launch_rope(args, 1, heads, head_dim);
    }

    fn write_row_at(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        step: &CudaSlice<f32>,
        width: usize,
    ) {
        let pos = self.ptr(&step.slice(1..2));
        self.launch_write_row_at(self.ptr(src), self.ptr_mut(dst), pos, width);
    }

    fn attention_preamble_at(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        norm: Option<HeadNorm<'_, CudaSlice<f32>>>,
        shape: AttentionShape,
        inv_freq: &[f32],
        step: &CudaSlice<f32>,
        k_cache: &mut CudaSlice<f32>,
        v_cache: &mut CudaSlice<f32>,
    ) {
        let late = false;
        self.preamble_at(q, k, v, norm, shape, inv_freq, step, k_cache, v_cache, late);
    }

    fn attention_at(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        shape: AttentionShape,
        step: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) {
        self.attention_row_at([q, k_cache, v_cache], shape, step, out, false);
    }

    fn attention_step_at(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        norm: Option<HeadNorm<'_, CudaSlice<f32>>>,
        shape: AttentionShape,
        inv_freq: &[f32],
        step: &CudaSlice<f32>,
        k_cache: &mut CudaSlice<f32>,
        v_cache: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) {
        // The grouped kernel loads its keys and values early when the preamble before
        // it is the kernel that lets it start only after its own wait.
        let late = attention::for_heads(&attention::ATTENTION_GROUP, shape.head_dim).is_some();
        let early =
            self.preamble_at(q, k, v, norm, shape, inv_freq, step, k_cache, v_cache, late) && late;
        self.attention_row_at([q, k_cache, v_cache], shape, step, out, early);
    }

    fn argmax_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
        at: usize,
    ) {
        assert!(
            rows == 0 || (x.len() >= rows * dim && out.len() >= at + rows),
            "argmax of {rows} rows of {dim} into {} values from {at}",
            out.len()
        );
        let out = self.ptr_mut(out).floats(at);
        self.launch_argmax_rows(self.ptr(x), rows, dim, out);
    }

    fn sample_at(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        s: &Sampling,
        counts: Option<&CudaSlice<f32>>,
        step: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        at: usize,
    ) {
        assert!(
            logits.len() >= vocab && out.len() > at && counts.is_none_or(|c| c.len() >= vocab),
            "sampling {vocab} logits into {} values at {at}",
            out.len()
        );
        let counts = counts.map_or(Ptr::NULL, |c| self.ptr(c));
        let out = self.ptr_mut(out).floats(at);
        self.launch_sample(self.ptr(logits), vocab, s, counts, self.ptr(step), out);
    }

    fn samples_on_device(&self) -> bool {
        self.samples
    }

    fn sample_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        sampling: &[Sampling],
        positions: &[usize],
        held: &[&[u32]],
    ) -> Vec<u32> {
        assert!(
            logits.len() >= sampling.len() * vocab,
            "sampling {} rows of {vocab} logits from {}",
            sampling.len(),
            logits.len()
        );
        // Penalties need each sequence's counts on the device, which only a sequence
        // decoded alone keeps; such rows are picked on the host.
        if !self.samples || sampling.iter().any(Sampling::penalizes) {
            let mut l = vec![0.0f32; sampling.len() * vocab];
            self.download(logits, &mut l);
            return crate::backend::sample::sample_rows(&l, vocab, sampling, positions, held);
        }
        self.sample_rows_on_device(logits, vocab, sampling, positions)
    }

    fn count_token(
        &self,
        counts: &mut CudaSlice<f32>,
        vocab: usize,
        chosen: &CudaSlice<f32>,
        at: usize,
    ) {
        let chosen = self.ptr(&chosen.slice(at..at + 1));
        self.launch_count_token(self.ptr_mut(counts), vocab, chosen);
    }

    fn advance_step(&self, step: &mut CudaSlice<f32>, chosen: &CudaSlice<f32>, at: usize) {
        let chosen = self.ptr(&chosen.slice(at..at + 1));
        self.launch_advance_step(self.ptr_mut(step), chosen);
    }

    fn read_async(&self, t: &CudaSlice<f32>, len: usize) -> PendingRead {
        self.queue_read(t, len)
    }

    fn finish_read(&self, read: PendingRead) -> Vec<f32> {
        self.take_read(read)
    }

    fn replay_step(&self, key: (usize, u64), body: &mut dyn FnMut() -> bool) -> bool {
        self.replay(key, body)
    }

    fn routed_moe(
        &self,
        x: MoeInput<'_, CudaSlice<f32>>,
        rows: usize,
        hidden: usize,
        gate: &DeviceMatrix,
        experts: &RoutedExperts<'_, DeviceMatrix>,
        route: DeviceRoute<'_>,
        probs: &mut CudaSlice<f32>,
        probs_at: usize,
        out: &mut CudaSlice<f32>,
    ) -> bool {
        let io = [probs, out];
        self.launch_routed_moe(x, [rows, hidden], gate, experts, route, io, probs_at)
    }

    fn new_slots(
        &self,
        format: &RecordFormat,
        experts: usize,
        top_k: usize,
        count: usize,
    ) -> Option<CudaSlots> {
        self.make_slots(format, [experts, top_k, count])
    }

    fn routed_moe_slots(
        &self,
        x: MoeInput<'_, CudaSlice<f32>>,
        rows: usize,
        hidden: usize,
        gate: &DeviceMatrix,
        slots: &CudaSlots,
        route: DeviceRoute<'_>,
        probs: &mut CudaSlice<f32>,
        probs_at: usize,
        out: &mut CudaSlice<f32>,
    ) -> bool {
        let io = [probs, out];
        self.launch_routed_moe_slots(x, [rows, hidden], gate, slots, route, io, probs_at)
    }

    fn swiglu_groups(
        &self,
        x: &CudaSlice<f32>,
        hidden: usize,
        groups: &[SwiGluGroup<'_, DeviceMatrix>],
        out: &mut CudaSlice<f32>,
    ) {
        let rest = self.swiglu_grouped(x, hidden, groups, out);
        if rest.is_empty() {
            return;
        }
        let rest: Vec<SwiGluGroup<'_, DeviceMatrix>> = rest
            .into_iter()
            .map(|g| SwiGluGroup {
                gate: g.gate,
                up: g.up,
                down: g.down,
                intermediate: g.intermediate,
                rows: g.rows,
                scales: g.scales,
            })
            .collect();
        swiglu_groups_one_by_one(self, x, hidden, &rest, out);
    }
}
