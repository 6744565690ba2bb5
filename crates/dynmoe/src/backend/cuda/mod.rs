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
//! sums by the norms. Above [`MATVEC_MAX_BATCH`] rows the matrix is decoded in the
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

// A launch argument passed as `&mut` marks a buffer the kernel writes.
#![allow(clippy::unnecessary_mut_passed)]

mod launch;
mod slots;
mod tuning;

use launch::Launch;
pub use slots::CudaSlots;
pub use tuning::Tuning;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, CudaView,
    CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, PinnedHostSlice,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use half::slice::HalfFloatSliceExt;

use super::{
    attention_preamble_one_by_one, swiglu_groups_one_by_one, AddNorm, AttentionShape, Backend,
    DeviceRoute, HeadNorm, MoeInput, PendingRead, RoutedExperts, SwiGluGroup, Weight,
};
use crate::codec::affine::kernels::AffineView;
use crate::codec::affine::lowbit::words_per_row;
use crate::codec::affine::GROUP_SIZE;
use crate::codec::vq::{rotation, row_bytes, Rung, VqView};
use crate::residency::RecordFormat;
use crate::store::vq::VqLayout;

/// The kernel sources by file, in the order `kernels/program.cu` includes them: joined,
/// they are one NVRTC program ([`source`]).
pub const SOURCES: [(&str, &str); 11] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("matvec.cu", include_str!("kernels/matvec.cu")),
    ("affine.cu", include_str!("kernels/affine.cu")),
    ("affine_mma.cu", include_str!("kernels/affine_mma.cu")),
    ("expert_gemm.cu", include_str!("kernels/expert_gemm.cu")),
    ("route.cu", include_str!("kernels/route.cu")),
    ("routed.cu", include_str!("kernels/routed.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("vq.cu", include_str!("kernels/vq.cu")),
    ("vq_mma.cu", include_str!("kernels/vq_mma.cu")),
];

/// The kernels' CUDA C source: [`SOURCES`] one after another, as `kernels/program.cu`
/// includes them.
pub fn source() -> &'static str {
    static SOURCE: OnceLock<String> = OnceLock::new();
    SOURCE.get_or_init(|| SOURCES.iter().map(|(_, s)| *s).collect())
}

/// Rows of `x` up to which a dense product runs as the matrix-vector kernel (its
/// `MV_MAXB`) rather than cuBLAS; also what one VQ matrix-vector launch takes (`VQ_MAXB`).
const MATVEC_MAX_BATCH: usize = 4;
/// Output rows per VQ matrix-vector block, a warp each (the kernel's `VQ_WARPS`).
const VQ_WARPS: usize = 8;
/// Most blocks of a VQ matrix-vector launch that stages the codebook in shared memory:
/// each block copies the whole book from L2, so the blocks loop over the rows instead
/// of the grid growing with them (two per SM of an H200).
const VQ_SHARED_BOOK_BLOCKS: usize = 264;
/// Bytes of zeros after a VQ matrix's device codes and after its norms: the
/// matrix-vector kernels read an index as the 3 bytes from its first, the routed ones as
/// the two aligned 32-bit words from the one it starts in (up to 7 bytes past its last),
/// and the tensor-core ones copy rows in whole 16-byte chunks (up to 15 bytes past).
const VQ_CODE_PADDING: usize = 16;
/// Rows of `x` one affine matrix-vector launch takes (the kernel's `AFF_MAXB`).
const AFFINE_MAX_BATCH: usize = 4;
/// Output rows per affine matrix-vector block (the kernel's `AFF_WARPS`).
const AFFINE_WARPS: usize = 8;
/// Above this many rows an affine product expands the matrix to f32 and runs one GEMM:
/// the matrix-vector kernel would read the weights once per 4 rows.
pub const AFFINE_GEMM_ROWS: usize = 8;
/// (Row, expert) pairs per block of the grouped expert GEMMs (the kernels' `MMA_BM`).
const EXPERT_TILE_ROWS: usize = 32;
/// Output rows per block of the grouped expert GEMMs (the kernels' `MMA_BN`).
const EXPERT_TILE_OUTPUTS: usize = 64;
/// A null device pointer: the grouped GEMMs' tile count when the grid is exact.
const NO_COUNT: u64 = 0;
/// Dynamic shared memory a block may take without opting in.
const SHARED_LIMIT: usize = 48 << 10;
/// u64 words per group in the grouped kernels' table (the kernel's `GROUP_ENTRY`).
const GROUP_ENTRY: usize = 11;
/// u64 words per expert in a routed block's table (the kernel's `ROUTED_ENTRY`).
const ROUTED_ENTRY: usize = 9;
/// The gate and up pointers of an entry a routed gate/up block copies with `early` (the
/// kernel's `GATE_UP_POINTERS`).
const GATE_UP_POINTERS: usize = 6;
/// Output rows per warp of the routed expert kernels (the kernel's `ROUTED_ROWS`).
const ROUTED_ROWS: usize = 4;
/// Columns of a row one warp of the one-row bf16 kernels takes (their `MV_ONE_COLS`).
const MV_ONE_COLS: usize = 2048;
/// Output rows of a `routed_mma_*` block (the kernels' `RMMA_ROWS`), and its warps
/// (`RMMA_WARPS`; `RMMA_DOWN_WARPS` for the down kernel, whose partial sums of one matrix
/// fill the two-matrix space of `routed_mma_shared`).
const RMMA_ROWS: usize = 16;
const RMMA_WARPS: usize = 8;
const RMMA_DOWN_WARPS: usize = 16;
/// Blocks a multiprocessor of the one-row dense kernels' launch bound (their default
/// `DMMA_BLOCKS`).
const DMMA_BLOCKS: usize = 3;

/// The `routed_mma_down_*` kernels that ask for shared memory they do not use, so that a
/// second down block cannot land on an SM: those whose registers let two blocks share
/// an SM.
///
/// At 2 bits a 16-warp down block takes 64 registers a thread, so two fit an SM's
/// registers where at 4 bits (76) only one does; two on one SM take twice as long over
/// the products after their wait, and the layer waits for the last (docs/GPU_NOTES.md).
/// A padded block asks for half of what an SM holds (each block also takes a reserve of
/// about 1 KB). Returns each padded kernel's name and bytes (none where the device
/// grants less). The padded kernels and the gate/up kernels of the same experts prefer
/// all of the unified L1 and shared memory as shared memory: an SM changes its split
/// only while idle, so a padded block must find the split it needs already there,
/// beside gate/up's blocks. Measured on the H200 (12-layer Qwen3-30B-A3B shape, q4 dense
/// layers, median of three): 2 bits 1 671.9 tok/s padded against 1 637.8, 4 bits
/// (nothing padded) unchanged; padding every down kernel cost 4 bits 3%, the carveout on
/// every kernel 1.3–1.6% (sixteenth round). With bf16 dense layers the blocks go
/// unpadded at launch ([`Cuda::down_padding`]).
fn down_alone(
    ctx: &CudaContext,
    f: &HashMap<&'static str, CudaFunction>,
    optin: usize,
) -> Result<Vec<(&'static str, usize)>, CudaError> {
    use cudarc::driver::sys::CUdevice_attribute;
    let per_sm = driver(
        ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
    )? as usize;
    let bytes = per_sm / 2;
    let mut padded = Vec::new();
    for name in KERNEL_NAMES {
        if !name.starts_with("routed_mma_down_") {
            continue;
        }
        let blocks = driver(f[name].occupancy_max_active_blocks_per_multiprocessor(
            (RMMA_DOWN_WARPS * 32) as u32,
            0,
            None,
        ))?;
        if blocks < 2 || !grant_shared(f, &[name], bytes, optin) {
            continue;
        }
        for n in split_pair(name) {
            prefer_shared(&f[n.as_str()], 100)?;
        }
        padded.push((name, bytes));
    }
    Ok(padded)
}

/// The routed down kernel `down` and the gate/up kernel of the same experts, whose split
/// of L1 and shared memory [`down_alone`] sets together.
fn split_pair(down: &str) -> [String; 2] {
    [
        down.to_string(),
        down.replace("routed_mma_down_", "routed_mma_gate_up_"),
    ]
}

/// Asks for `bytes` of dynamic shared memory a block for each kernel of `names`: whether
/// every one was granted it (never more than the device's opt-in, `optin`).
fn grant_shared(
    f: &HashMap<&'static str, CudaFunction>,
    names: &[&str],
    bytes: usize,
    optin: usize,
) -> bool {
    let attr =
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    bytes <= optin
        && names
            .iter()
            .all(|n| f[n].set_attribute(attr, bytes as i32).is_ok())
}

/// Has `func` prefer `percent`% of the unified L1 and shared memory as shared memory.
fn prefer_shared(func: &CudaFunction, percent: usize) -> Result<(), CudaError> {
    set_carveout(func, percent as i32)
}

/// Takes back a preference of [`prefer_shared`]: the driver picks `func`'s split again.
fn leave_split_to_driver(func: &CudaFunction) -> Result<(), CudaError> {
    set_carveout(
        func,
        cudarc::driver::sys::CUshared_carveout::CU_SHAREDMEM_CARVEOUT_DEFAULT as i32,
    )
}

fn set_carveout(func: &CudaFunction, value: i32) -> Result<(), CudaError> {
    let attr =
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
    driver(func.set_attribute(attr, value))
}

/// Phases a block of the routed kernels stamps with `PHASES` (the kernels' `PHASE_SLOTS`).
pub const PHASE_SLOTS: usize = 8;
/// Shared memory of a staged 64-column unit of a `routed_mma_*` block: its f16 hi and lo
/// fragments (`RMMA_UNIT` words) and its sum.
const RMMA_UNIT: usize = 80;
const RMMA_UNIT_BYTES: usize = RMMA_UNIT * 4 + 4;
/// Warps of a `routed_vq_*` block, and the output rows each takes at once in gate/up and
/// in down (the kernels' `VQR_WARPS`, `VQR_GATE_UP_ROWS`, `VQR_DOWN_ROWS`).
const VQR_WARPS: usize = 16;
const VQR_GATE_UP_ROWS: usize = 2;
const VQR_DOWN_ROWS: usize = 1;
/// 16-row tiles of gate and up a `routed_vq_gate_up_mma_*` block takes (its `VQM_TILES`).
const VQM_TILES: usize = 2;
/// Warps of a `vq_expert_mma_*` block, and its output rows in gate/up (64 a matrix,
/// four warps each) and in down (the kernels' `VQG_WARPS`).
const VQG_WARPS: usize = 8;
const VQG_GATE_UP_OUTPUTS: usize = 64;
const VQG_DOWN_OUTPUTS: usize = 128;
/// Largest book the routed VQ kernels copy into shared memory (vq1.5's and vq0.7's; the
/// kernels' `VQR_PREFETCH_BOOK` too).
const VQR_SHARED_BOOK: usize = 64 << 10;
/// Widest row a warp normalises alone (the kernels' `NORM_WARP_DIM`); wider rows take a
/// block each.
const NORM_WARP_DIM: usize = 512;
/// Most experts a routed expert kernel routes itself (the kernels' `ROUTE_SHARED_MAX`:
/// their candidates in static shared memory); more are routed by `moe_route` first.
const ROUTE_SHARED_MAX: usize = 256;
/// Threads of an `argmax_rows` block (its `ARGMAX_THREADS`); a block takes a multiple of
/// four times this many values of a row.
const ARGMAX_THREADS: usize = 256;
/// Rows one `argmax_rows` launch takes: its counts sit in the first this many floats of
/// the scratch buffer.
const ARGMAX_MAX_ROWS: usize = 1024;
/// Pairs of a head one thread of `attn_preamble_at` rotates (its `PRE_PAIRS`).
const PRE_PAIRS: usize = 4;
/// Most rows the routed matrix-vector kernels take: beyond, each expert's weights would
/// be read once per row, so more rows take the grouped GEMMs on tensor cores (without
/// tensor cores, the host path).
pub const ROUTED_MAX_ROWS: usize = AFFINE_GEMM_ROWS;
/// Most (row, expert) pairs one routed launch takes (a grid dimension holds 65 535).
const ROUTED_CHUNK_PAIRS: usize = 4096;
/// Query heads one block of `attention_group_*` takes (its `ATT_GROUP`).
const ATT_GROUP: usize = 8;
/// Threads of an `attention_group_*` block (its `ATT_THREADS`).
const ATT_THREADS: u32 = 128;
/// Keys one step of `attention_group_*`'s score pass takes per load (a block's 16 lane
/// groups): chunks are whole multiples of it.
const ATT_STEP: usize = 16;
/// Most keys an `attention_group_*` block takes (its `ATT_CHUNK_MAX`).
const ATT_CHUNK_MAX: usize = 256;
/// Threads of an `attention_combine` block (its `COMBINE_THREADS`).
const COMBINE_THREADS: u32 = 512;
/// Query slots (a row and a head of a GQA group each) of an `attention_tiled_*` block
/// (its `PA_BM`).
const PA_BM: usize = 64;
/// Keys of one tile an `attention_tiled_*` block stages (its `PA_BN`).
const PA_BN: usize = 32;
/// Threads of an `attention_tiled_*` block (its `PA_THREADS`).
const PA_THREADS: u32 = 256;

/// Why the CUDA backend could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library is not installed or not on the loader's path.
    #[error("CUDA is not available: {library} could not be loaded ({hint})")]
    Unavailable {
        /// The library looked for.
        library: &'static str,
        /// What to check.
        hint: &'static str,
    },
    /// The driver refused a call (no device, a device fault).
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// NVRTC rejected the kernels.
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile {
        /// Target architecture.
        arch: String,
        /// Compiler output.
        log: String,
    },
    /// cuBLAS could not be set up.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// `DYNMOE_CUDA` holds an item [`Tuning::parse`] does not take.
    #[error("DYNMOE_CUDA: `{item}`: {expected}")]
    Tuning {
        /// The item.
        item: String,
        /// What it should be.
        expected: String,
    },
}

/// Whether the driver, NVRTC and cuBLAS libraries can be loaded, without touching a
/// device. `Err` names the first one missing.
pub fn probe() -> Result<(), CudaError> {
    // SAFETY: each call only tries to open the shared library by its usual names.
    let present = unsafe {
        [
            (
                cudarc::driver::sys::is_culib_present(),
                "libcuda (the NVIDIA driver)",
            ),
            (cudarc::nvrtc::sys::is_culib_present(), "libnvrtc"),
            (cudarc::cublas::sys::is_culib_present(), "libcublas"),
        ]
    };
    for (ok, library) in present {
        if !ok {
            return Err(CudaError::Unavailable {
                library,
                hint: "install the CUDA 13 runtime or add its lib directory to LD_LIBRARY_PATH",
            });
        }
    }
    Ok(())
}

/// A dense weight matrix (or embedding table) in device memory, as
/// [`Backend::upload_matrix`] made it.
pub enum DeviceMatrix {
    /// Every value was a bf16 (an f32 whose lower 16 bits are zero): their upper 16 bits.
    Bf16(CudaSlice<u16>),
    /// Values bf16 would have rounded, kept whole.
    F32(CudaSlice<f32>),
}

impl DeviceMatrix {
    /// Whether the values are held in bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self, DeviceMatrix::Bf16(_))
    }

    /// Bytes of device memory the values take (what a product reads).
    pub fn bytes(&self) -> usize {
        match self {
            DeviceMatrix::Bf16(v) => v.len() * 2,
            DeviceMatrix::F32(v) => v.len() * 4,
        }
    }
}

/// Whether `v` converts to bf16 and back unchanged: bf16 is an f32's upper half.
fn is_bf16_exact(v: f32) -> bool {
    v.to_bits() & 0xffff == 0
}

/// A VQ matrix's codes and block norms on the device, as stored.
struct DeviceVq {
    /// `rows · row_bytes` bytes of codes, then [`VQ_CODE_PADDING`] zeros.
    codes: CudaSlice<u8>,
    /// `[rows, blocks]` fp16 norms, their raw bits, then [`VQ_CODE_PADDING`] bytes of zeros.
    norms: CudaSlice<u16>,
    /// The rotation's signs as bits (bit i of word w set where entry 32w + i is −1), for
    /// the routed kernels.
    signs: CudaSlice<u32>,
    /// The rotation seed (one per matrix of a model, so a slot refilled with another
    /// expert differs here), host code bytes sampled when it was copied (first, middle,
    /// last) and the norms' first bits: a re-mapped record is never served stale weights.
    fingerprint: VqFingerprint,
}

/// The kernels' name suffix for vectors of `p` values.
fn vq_suffix(p: usize) -> &'static str {
    match p {
        2 => "p2",
        4 => "p4",
        8 => "p8",
        16 => "p16",
        _ => panic!("no VQ kernel for vectors of {p} values (2, 4, 8, 16)"),
    }
}

/// How a VQ matrix-vector launch is laid out: activation rows per launch, and whether
/// the codebook is staged in shared memory beside them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct VqTile {
    rows: usize,
    book_shared: bool,
}

/// The launch layout for `batch` (≤ [`MATVEC_MAX_BATCH`]) activation rows of a matrix in
/// `rung` whose rotated rows are `width` wide, or `None` when not even one row fits in
/// shared memory (the product then decodes and runs a GEMM). The rows come first: a book
/// that does not fit beside them is read from global memory through the caches.
fn vq_tile(rung: Rung, width: usize, batch: usize) -> Option<VqTile> {
    let row = width * 4;
    let rows = (SHARED_LIMIT / row).min(MATVEC_MAX_BATCH).min(batch);
    (rows > 0).then(|| VqTile {
        rows,
        book_shared: vq_book_bytes(rung) + rows * row <= SHARED_LIMIT,
    })
}

/// Bytes of a rung's codebook on the device: every codeword in fp16.
fn vq_book_bytes(rung: Rung) -> usize {
    rung.codewords() * rung.dim * 2
}

/// Host address and length of a VQ view's codes: what the weight cache is keyed by.
type VqKey = (usize, usize);

/// A VQ view's rotation seed and sampled code bytes and norm bits.
type VqFingerprint = (u64, [u16; 4]);

fn vq_key(w: &VqView<'_>) -> VqKey {
    (w.codes.as_ptr() as usize, w.codes.len())
}

fn vq_fingerprint(w: &VqView<'_>) -> VqFingerprint {
    let c = w.codes;
    let at = |i: usize| c.get(i).copied().unwrap_or(0) as u16;
    (
        w.seed,
        [
            at(0),
            at(c.len() / 2),
            at(c.len().saturating_sub(1)),
            w.norms.first().map(|n| n.to_bits()).unwrap_or(0),
        ],
    )
}

/// A device copy of an affine matrix.
struct DeviceAffine {
    /// The matrix as stored, row by row.
    rows: AffineRows,
    /// Host words sampled when it was copied (first, middle, last).
    fingerprint: [u32; 3],
    /// The same matrix in unit tiles ([`unit_tiles`]), made with the device copy where
    /// one-row products read it so ([`Cuda::tiles_take`]).
    tiles: Option<DeviceTiles>,
}

/// An affine matrix on the device as stored: codes row by row, scales and biases.
struct AffineRows {
    words: CudaSlice<u32>,
    scales: CudaSlice<u16>,
    biases: CudaSlice<u16>,
}

impl AffineRows {
    /// The three parts' device addresses, as a routing or group table holds them.
    fn addresses(&self, stream: &CudaStream) -> [u64; 3] {
        [
            self.words.device_ptr(stream).0,
            self.scales.device_ptr(stream).0,
            self.biases.device_ptr(stream).0,
        ]
    }
}

impl DeviceAffine {
    /// Bytes on the device, both copies.
    fn bytes(&self) -> usize {
        let r = &self.rows;
        let rows = r.words.len() * 4 + (r.scales.len() + r.biases.len()) * 2;
        let tiles = self
            .tiles
            .as_ref()
            .map_or(0, |t| t.words.len() * 4 + t.sb.len() * 2);
        rows + tiles
    }
}

/// An affine matrix on the device in unit tiles, as the `*_tiled_q*` kernels read it.
struct DeviceTiles {
    words: CudaSlice<u32>,
    /// Each unit's scales and biases, row by row.
    sb: CudaSlice<u16>,
}

/// A 4- or 2-bit affine matrix in unit tiles (kernels/affine_mma.cu, `load_unit_tiled`): for each
/// tile of [`RMMA_ROWS`] rows and 64-column group (a unit), its 32 lanes' words one lane
/// after another, lane 4g + q holding row g's words of its quarter of the unit, then
/// row g + 8's (two words each at 4 bits, one at 2); then, apart, each unit's scale and
/// bias row by row. Rows past the matrix are zeros. A warp reads a unit as whole cache
/// lines where the row-major layout spreads it over 16 rows' lines: the LM head, which
/// the one-row kernel streams round after round, reads ~16% faster
/// (`tools/gpu-microbench`, bench/results/gpu/weight_stream.log).
fn unit_tiles(w: &AffineView<'_>) -> (Vec<u32>, Vec<u16>) {
    assert!(matches!(w.bits, 4 | 2), "unit tiles of 4- and 2-bit words");
    let groups = w.cols / GROUP_SIZE;
    let tiles = w.rows.div_ceil(RMMA_ROWS);
    let row_words = words_per_row(w.cols, w.bits);
    let per_lane = tile_lane_words(w.bits);
    let lane_words = per_lane / 2;
    let per_unit_row = 4 * lane_words;
    let (word_count, sb_count) = tile_lengths(w.rows, w.cols, w.bits);
    let mut words = vec![0u32; word_count];
    let mut sb = vec![0u16; sb_count];
    for t in 0..tiles {
        for gi in 0..groups {
            let unit = t * groups + gi;
            for lane in 0..32 {
                let (g, q) = (lane / 4, lane % 4);
                for half in 0..2 {
                    let r = t * RMMA_ROWS + g + 8 * half;
                    if r >= w.rows {
                        continue;
                    }
                    let src = r * row_words + gi * per_unit_row + q * lane_words;
                    let dst = (unit * 32 + lane) * per_lane + half * lane_words;
                    words[dst..dst + lane_words].copy_from_slice(&w.words[src..src + lane_words]);
                }
            }
            for r in 0..RMMA_ROWS.min(w.rows.saturating_sub(t * RMMA_ROWS)) {
                let g = (t * RMMA_ROWS + r) * groups + gi;
                sb[(unit * RMMA_ROWS + r) * 2] = w.scales[g].to_bits();
                sb[(unit * RMMA_ROWS + r) * 2 + 1] = w.biases[g].to_bits();
            }
        }
    }
    (words, sb)
}

/// The units (16 rows by one 64-column group) of a `rows × cols` matrix in unit tiles.
fn tile_units(rows: usize, cols: usize) -> usize {
    rows.div_ceil(RMMA_ROWS) * (cols / GROUP_SIZE)
}

/// The u32 words and u16 scales-and-biases of a `rows × cols` matrix at `bits` (4 or 2)
/// in unit tiles ([`unit_tiles`]).
fn tile_lengths(rows: usize, cols: usize, bits: u32) -> (usize, usize) {
    let units = tile_units(rows, cols);
    (units * 32 * tile_lane_words(bits), units * RMMA_ROWS * 2)
}

/// The words a lane holds of one unit in tiles: a quarter of a 64-column group of each of
/// its two rows, two words a row at 4 bits and one at 2.
fn tile_lane_words(bits: u32) -> usize {
    if bits == 4 {
        4
    } else {
        2
    }
}

/// Host addresses and lengths of a view: what the weight cache is keyed by.
type AffineKey = (usize, usize, usize, usize, u32);

fn affine_key(w: &AffineView<'_>) -> AffineKey {
    (
        w.words.as_ptr() as usize,
        w.words.len(),
        w.scales.as_ptr() as usize,
        w.biases.as_ptr() as usize,
        w.bits,
    )
}

fn fingerprint(w: &AffineView<'_>) -> [u32; 3] {
    let n = w.words.len();
    if n == 0 {
        return [0; 3];
    }
    [w.words[0], w.words[n / 2], w.words[n - 1]]
}

/// The kernels of [`source`], by name.
struct Kernels {
    _module: Arc<CudaModule>,
    f: HashMap<&'static str, CudaFunction>,
}

const KERNEL_NAMES: [&str; 116] = [
    "fill",
    "embed",
    "embed_bf16",
    "bf16_to_f32",
    "split_bf16",
    "matvec_bf16",
    "matvec_bf16_3",
    "matvec_bf16_one",
    "matvec_bf16_one_late",
    "matvec_bf16_norm_one_late",
    "matvec_bf16_3_one",
    "rms_norm",
    "rms_norm_inplace",
    "add_rms_norm",
    "add_rms_norm_to",
    "add_bias",
    "add",
    "silu_mul",
    "clamp_values",
    "softmax_rows",
    "rope",
    "gather_rows",
    "scatter_add_rows",
    "attention",
    "affine_matvec_q4",
    "affine_matvec_q3",
    "affine_matvec_q2",
    "affine_dequant_q4",
    "affine_dequant_q3",
    "affine_dequant_q2",
    "affine_gate_up_q4",
    "affine_gate_up_q3",
    "affine_gate_up_q2",
    "affine_down_q4",
    "affine_down_q3",
    "affine_down_q2",
    "expert_mma_gate_up_q4",
    "expert_mma_gate_up_q3",
    "expert_mma_gate_up_q2",
    "expert_mma_gate_up_tiled_q4",
    "expert_mma_gate_up_tiled_q2",
    "expert_mma_down_q4",
    "expert_mma_down_q3",
    "expert_mma_down_q2",
    "expert_mma_down_tiled_q4",
    "expert_mma_down_tiled_q2",
    "affine_tiles_from_rows",
    "copy_f4",
    "moe_route",
    "moe_combine",
    "moe_group_pairs",
    "affine_routed_gate_up_q4",
    "affine_routed_gate_up_q3",
    "affine_routed_gate_up_q2",
    "affine_routed_down_q4",
    "affine_routed_down_q3",
    "affine_routed_down_q2",
    "routed_mma_gate_up_q3",
    "routed_mma_down_q3",
    "routed_mma_gate_up_tiled_q4",
    "routed_mma_gate_up_tiled_q2",
    "routed_mma_down_tiled_q4",
    "routed_mma_down_tiled_q2",
    "dense_mma_q4",
    "dense_mma_q3",
    "dense_mma_q2",
    "dense_mma_norm_q4",
    "dense_mma_norm_q3",
    "dense_mma_norm_q2",
    "dense_mma_tiled_q4",
    "dense_mma_tiled_q2",
    "dense_mma_norm_tiled_q4",
    "dense_mma_norm_tiled_q2",
    "write_row_at",
    "attn_preamble_at",
    "argmax_rows",
    "advance_step",
    "matvec_f32",
    "attention_split",
    "attention_group_64",
    "attention_group_128",
    "attention_group_256",
    "attention_combine",
    "attention_tiled_64",
    "attention_tiled_128",
    "attention_tiled_256",
    "vq_rotate",
    "vq_matvec_p2",
    "vq_matvec_p4",
    "vq_matvec_p8",
    "vq_matvec_p16",
    "vq_decode_p2",
    "vq_decode_p4",
    "vq_decode_p8",
    "vq_decode_p16",
    "routed_vq_gate_up_p2",
    "routed_vq_gate_up_p4",
    "routed_vq_gate_up_p8",
    "routed_vq_gate_up_p16",
    "routed_vq_down_p2",
    "routed_vq_down_p4",
    "routed_vq_down_p8",
    "routed_vq_down_p16",
    "routed_vq_rotate",
    "routed_vq_gate_up_mma_p4",
    "routed_vq_gate_up_mma_p8",
    "routed_vq_gate_up_mma_p16",
    "routed_vq_down_mma_p4",
    "routed_vq_down_mma_p8",
    "routed_vq_down_mma_p16",
    "vq_expert_mma_gate_up_p4",
    "vq_expert_mma_gate_up_p8",
    "vq_expert_mma_gate_up_p16",
    "vq_expert_mma_down_p4",
    "vq_expert_mma_down_p8",
    "vq_expert_mma_down_p16",
];

/// The kernel constants [`Tuning::defines`] may set: those the source leaves to be
/// defined first (`#ifndef NAME`) and the instruments it builds only when asked
/// (`#ifdef NAME`).
fn tunables() -> Vec<&'static str> {
    let mut names: Vec<&str> = source()
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            l.strip_prefix("#ifndef ")
                .or_else(|| l.strip_prefix("#ifdef "))
        })
        .map(str::trim)
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// PTX of [`source`] per architecture and kernel constants ([`Tuning::defines`]),
/// compiled once per process.
fn ptx_for(arch: &str, defines: &[(String, String)]) -> Result<cudarc::nvrtc::Ptx, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<Vec<String>, String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut cache = cache.lock().expect("PTX cache lock");
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    options.extend(defines.iter().map(|(n, v)| format!("-D{n}={v}")));
    if let Some(src) = cache.get(&options) {
        return Ok(cudarc::nvrtc::Ptx::from_src(src.clone()));
    }
    let opts = CompileOptions {
        options: options.clone(),
        ..CompileOptions::default()
    };
    let ptx = compile_ptx_with_opts(source(), opts).map_err(|e| CudaError::Compile {
        arch: arch.to_string(),
        log: match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        },
    })?;
    cache.insert(options, ptx.to_src());
    Ok(ptx)
}

/// Host values and their device copy.
type Constant = (Vec<f32>, Arc<CudaSlice<f32>>);

/// A MoE block's experts on the device, for routing there: every expert's gate, up and
/// down pointers in one table indexed by expert id.
struct RoutedBlock {
    table: CudaSlice<u64>,
    /// The copies the table points into, kept alive with it.
    _weights: Vec<Arc<dyn Send + Sync>>,
    /// What confirms the block's id: it is trusted only while this still matches.
    check: RoutedCheck,
    kind: RoutedKind,
    /// The expert mask last used with the block, and its device copy.
    keep: Option<(Vec<bool>, CudaSlice<u8>)>,
}

/// The shapes every expert of a block routed on the device shares.
#[derive(Debug, Clone, Copy)]
struct RoutedShape {
    bits: u32,
    /// Whether the experts' only device copy is in unit tiles ([`unit_tiles`],
    /// [`Cuda::experts_tiled`]), which the kernels named `*_tiled_q*` read; otherwise
    /// rows, as a record stores them.
    tiled: bool,
    /// Expert width (rows of gate and up).
    inter: usize,
    /// Stored columns of gate and up, and of down.
    up_cols: usize,
    down_cols: usize,
}

impl RoutedShape {
    /// The shape of `layout`'s records, if the routed kernels take it for a residual
    /// stream of `hidden`.
    fn of(
        bits: u32,
        inter: usize,
        up_cols: usize,
        down_cols: usize,
        hidden: usize,
    ) -> Option<Self> {
        let fits = |cols: usize| routed_shared(cols) <= SHARED_LIMIT;
        (matches!(bits, 2..=4)
            && up_cols >= hidden
            && down_cols >= inter
            && fits(up_cols)
            && fits(down_cols))
        .then_some(RoutedShape {
            bits,
            tiled: false,
            inter,
            up_cols,
            down_cols,
        })
    }

    /// The suffix of the affine kernels that read these experts: `q4`, or `tiled_q4`.
    fn kernels(&self) -> String {
        let bits = bits_suffix(self.bits);
        if self.tiled {
            format!("tiled_{bits}")
        } else {
            bits.to_string()
        }
    }
}

/// The VQ rung and shapes every expert of a block routed on the device shares: gate and
/// up are `inter × hidden`, down `hidden × inter`, rotated in blocks of `up_block` and
/// `down_block` values.
#[derive(Debug, Clone, Copy)]
struct VqRoutedShape {
    rung: Rung,
    hidden: usize,
    inter: usize,
    up_block: usize,
    down_block: usize,
}

impl VqRoutedShape {
    /// The shape of an expert's gate and down, if the routed VQ kernels take it for a
    /// residual stream of `hidden` with `shared` bytes of shared memory ([`fits`]).
    ///
    /// [`fits`]: Self::fits
    fn of(gate: &VqView<'_>, down: &VqView<'_>, hidden: usize, shared: usize) -> Option<Self> {
        let shape = VqRoutedShape {
            rung: gate.rung,
            hidden,
            inter: gate.rows,
            up_block: gate.block,
            down_block: down.block,
        };
        (gate.cols == hidden
            && down.rows == hidden
            && down.cols == gate.rows
            && down.rung == gate.rung
            && shape.fits(shared))
        .then_some(shape)
    }

    /// The shape of a VQ store's records ([`of`](Self::of) for every expert alike).
    fn of_layout(layout: &VqLayout, shared: usize) -> Option<Self> {
        let shape = VqRoutedShape {
            rung: layout.rung,
            hidden: layout.hidden,
            inter: layout.intermediate,
            up_block: rotation::block_size(layout.hidden),
            down_block: rotation::block_size(layout.intermediate),
        };
        shape.fits(shared).then_some(shape)
    }

    /// Whether the routed kernels take this shape with `shared` bytes of shared memory: a
    /// warp rotates one block (32 to 1024 values), and a gate/up block holds the row
    /// rotated twice.
    fn fits(&self, shared: usize) -> bool {
        let warp_block = |b: usize| (32..=1024).contains(&b);
        warp_block(self.up_block) && warp_block(self.down_block) && self.gate_up_shared() <= shared
    }

    /// Whether the tensor-core kernels (a prompt's grouped GEMMs, a decode step's
    /// `routed_vq_*_mma`) take these experts: their weight fragments are whole codewords
    /// of 4, 8 or 16 values, and a norm covers whole 64-column units.
    fn on_tensor_cores(&self) -> bool {
        self.rung.dim >= 4 && self.up_block >= 64 && self.down_block >= 64
    }

    /// Dynamic shared memory of `routed_vq_gate_up_mma_*`, less the book: the row
    /// rotated for gate and for up as f16 hi and lo halves (with 8 words of padding
    /// each), the block's rows of each matrix's codes and norms, and each warp's partial
    /// sums of 16 rows.
    fn mma_gate_up_shared(&self) -> usize {
        let rows = VQM_TILES * 16;
        let staged = staged_rows(rows, row_bytes(self.rung, self.hidden), self.up_blocks());
        2 * ((self.up_width() + 8) * 4 + staged) + VQR_WARPS * 16 * 4
    }

    /// Dynamic shared memory of `routed_vq_down_mma_*`, less the book: each of a
    /// token's `top_k` rows rotated as f16 halves, the block's 16 rows of each pair's
    /// codes and norms, and the partial sums of 16 rows of each pair's part (the warps
    /// split a pair's units `VQR_WARPS / top_k` ways).
    fn mma_down_shared(&self, top_k: usize) -> usize {
        let parts = (VQR_WARPS / top_k).max(1);
        let staged = staged_rows(16, row_bytes(self.rung, self.inter), self.down_blocks());
        top_k * ((self.down_width() + 8) * 4 + staged + parts * 16 * 4)
    }

    /// Rotation blocks of a gate/up input row and of a down input row.
    fn up_blocks(&self) -> usize {
        self.up_width() / self.up_block
    }

    fn down_blocks(&self) -> usize {
        self.down_width() / self.down_block
    }

    /// Rotated widths of a gate/up input row and of a down input row: whole blocks.
    fn up_width(&self) -> usize {
        self.hidden.next_multiple_of(self.up_block)
    }

    fn down_width(&self) -> usize {
        self.inter.next_multiple_of(self.down_block)
    }

    /// Dynamic shared memory of the gate/up kernel: the row rotated for gate and for up.
    fn gate_up_shared(&self) -> usize {
        2 * self.up_width() * 4
    }

    /// Dynamic shared memory of the down kernel: each of a token's `top_k` rows of
    /// SiLU outputs, rotated.
    fn down_shared(&self, top_k: usize) -> usize {
        top_k * self.down_width() * 4
    }
}

/// The codes of a block routed on the device.
#[derive(Debug, Clone, Copy)]
enum RoutedKind {
    Affine(RoutedShape),
    Vq(VqRoutedShape),
}

/// What confirms that a block's id still names the same weights: cache key and sampled
/// words of the first and last experts' gate projections.
#[derive(Debug, Clone, PartialEq)]
enum RoutedCheck {
    Affine([(AffineKey, [u32; 3]); 2]),
    Vq([(VqKey, VqFingerprint); 2]),
}

/// One routed launch sequence: where the expert table and the mask are, and how to route.
struct Routed<'a> {
    kind: RoutedKind,
    /// Device address of the `[E, ROUTED_ENTRY]` pointer table.
    table: u64,
    /// Device address of the `[E]` byte mask (0: every expert may be chosen).
    keep: u64,
    experts: usize,
    route: DeviceRoute<'a>,
    /// Whether the router was `matvec_bf16_one_late`, so the routed gate/up kernel right
    /// after it may stage x and read the table before its launch wait.
    router_late: bool,
    /// The residual (its device address) and the norm the router folded in
    /// (`matvec_bf16_norm_one_late`, which is late too): the routed gate/up kernel reads
    /// its row through them, and nothing writes the normed row.
    norm: Option<(u64, InputNorm)>,
}

/// One launch pair of the grouped expert GEMMs ([`Cuda::launch_expert_gemms`]): device
/// addresses of the group table (GROUP_ENTRY words a group), the (group, first pair)
/// tiles, their count (or [`NO_COUNT`] when `grid_tiles` is exact), each pair's row and
/// weight, the input rows, the SiLU outputs `[pairs, inter]` and the rows the down
/// products add into; and the shapes.
struct ExpertGemms {
    /// The kernels' suffix ([`RoutedShape::kernels`]).
    kernels: String,
    table: u64,
    tiles: u64,
    grid_tiles: usize,
    tiles_n: u64,
    pair_rows: u64,
    pair_weights: u64,
    x: u64,
    h: u64,
    out: u64,
    hidden: usize,
    inter: usize,
    up_cols: usize,
    down_cols: usize,
}

/// A prompt's routed pairs grouped by expert on the device ([`Cuda::group_pairs`]):
/// the route (ids and weights a pair), the group table (GROUP_ENTRY words an expert),
/// each grouped pair's row, weight and (when asked for) own index, and the (group, first
/// pair) tiles with their count. Kept until the launches that read them are queued.
struct PairGroups {
    ids: CudaSlice<u32>,
    weights: CudaSlice<u32>,
    table: CudaSlice<u64>,
    pair_rows: CudaSlice<u32>,
    pair_weights: CudaSlice<u32>,
    pair_ids: Option<CudaSlice<u32>>,
    tiles: CudaSlice<u32>,
    tiles_n: CudaSlice<u32>,
    /// The most tiles there could be, which the GEMM grids are sized for.
    most_tiles: usize,
}

/// The residual add and norm a kernel applies to its input row (device addresses of
/// the kernels' `delta, norm_w, eps, sum` arguments): `delta` or `sum` 0 is not read or
/// not written.
#[derive(Debug, Clone, Copy)]
struct InputNorm {
    delta: u64,
    w: u64,
    eps: f32,
    sum: u64,
}

/// What confirms that a block's id still names the same weights.
fn routed_check(experts: &RoutedExperts<'_, DeviceMatrix>) -> Option<RoutedCheck> {
    let gate = |e: usize| (experts.weights)(e)[0];
    match (gate(0), gate(experts.count - 1)) {
        (Weight::Affine(a), Weight::Affine(b)) => Some(RoutedCheck::Affine([
            (affine_key(&a), fingerprint(&a)),
            (affine_key(&b), fingerprint(&b)),
        ])),
        (Weight::Vq(a), Weight::Vq(b)) => Some(RoutedCheck::Vq([
            (vq_key(&a), vq_fingerprint(&a)),
            (vq_key(&b), vq_fingerprint(&b)),
        ])),
        _ => None,
    }
}

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
    /// Page-locked buffers of [`Backend::read_async`] not in use, at most [`READ_SLOTS`].
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
    /// Whether products run on tensor cores ([`Tuning::tensor_cores`] on sm_80 and later).
    tensor_cores: bool,
    /// The flag gate/up raises once the route is written and the count of down blocks
    /// that saw it (the down kernel's early start): both zero between launches.
    down_ready: CudaSlice<u32>,
    /// The routed down kernels on tensor cores whose blocks ask for at least so many
    /// bytes of shared memory, so that two never share an SM ([`down_alone`]).
    down_alone: Vec<(&'static str, usize)>,
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

/// Keys per block of the grouped decode attention over a cache of `capacity` positions
/// with `units` blocks per chunk (KV heads times head tiles) on `sms` multiprocessors:
/// about two blocks per multiprocessor, so a short context still fills the device and a
/// long one is not cut finer than that, in whole score steps, at most `ATT_CHUNK_MAX`.
/// It follows the capacity, not the position, so a recorded step stays valid.
fn group_chunk(capacity: usize, units: usize, sms: usize) -> usize {
    let even = (capacity * units) as f64 / (2 * sms.max(1)) as f64;
    let steps = (even / ATT_STEP as f64).round() as usize;
    (steps * ATT_STEP).clamp(ATT_STEP, ATT_CHUNK_MAX)
}

/// Which of a kernel's 64-, 128- and 256-wide builds takes heads of `head_dim` (0, 1 or
/// 2), if any does: float4 rows up to 256.
fn head_width_class(head_dim: usize) -> Option<usize> {
    if head_dim == 0 || !head_dim.is_multiple_of(4) {
        return None;
    }
    match head_dim {
        1..=64 => Some(0),
        65..=128 => Some(1),
        129..=256 => Some(2),
        _ => None,
    }
}

/// The grouped kernel for heads of `head_dim`, if it takes them (float4 rows up to 256).
fn group_kernel(head_dim: usize) -> Option<&'static str> {
    head_width_class(head_dim).map(|c| {
        [
            "attention_group_64",
            "attention_group_128",
            "attention_group_256",
        ][c]
    })
}

/// The tiled prefill kernel for heads of `head_dim`, if it takes them (as
/// [`group_kernel`]).
fn tiled_kernel(head_dim: usize) -> Option<&'static str> {
    head_width_class(head_dim).map(|c| {
        [
            "attention_tiled_64",
            "attention_tiled_128",
            "attention_tiled_256",
        ][c]
    })
}

/// Dynamic shared memory of an `attention_tiled_*` block for heads of `head_dim`: the Q
/// tile and two K tiles with rows padded by a float4, two V tiles, P
/// (`[PA_BN][PA_BM + 4]`) and two floats per slot.
fn tiled_shared(head_dim: usize) -> usize {
    let f4 = head_dim / 4;
    ((PA_BM + 2 * PA_BN) * (f4 + 1) + 2 * PA_BN * f4) * 16 + (PA_BN * (PA_BM + 4) + 2 * PA_BM) * 4
}

/// A recorded step.
struct Recorded(CudaGraph);

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
struct ReadSlot {
    buf: PinnedHostSlice<f32>,
    done: CudaEvent,
}

/// A [`Backend::read_async`] under way: its slot, and how many values it copies.
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

/// The three matrices of a group whose weights are all affine.
fn affine_of<'a>(g: &SwiGluGroup<'a, DeviceMatrix>) -> Option<[AffineView<'a>; 3]> {
    match (g.gate, g.up, g.down) {
        (Weight::Affine(a), Weight::Affine(b), Weight::Affine(c)) => Some([a, b, c]),
        _ => None,
    }
}

/// Rows of x a matrix-vector block stages at once for a matrix of `cols` columns, and
/// the shared memory one row takes.
fn affine_tile(cols: usize) -> (usize, usize) {
    let row_bytes = (cols / 32) * 33 * 4;
    (
        (SHARED_LIMIT / row_bytes).clamp(1, AFFINE_MAX_BATCH),
        row_bytes,
    )
}

/// Shared memory of a routed expert block: one staged row and a sum per 32 columns.
fn routed_shared(cols: usize) -> usize {
    affine_tile(cols).1 + (cols / 32) * 4
}

/// The bf16 matrix-vector kernel of one matrix or of three for `rows` rows of x, `cols`
/// wide, and its launch for `out_rows` output rows: the one-row versions (a decode step,
/// rows of whole 8s) keep each lane's loads in flight at once, a warp per part of a row
/// ([`one_row_parts`]); the others take a warp per row.
fn bf16_matvec(
    three: bool,
    rows: usize,
    cols: usize,
    out_rows: usize,
) -> (&'static str, LaunchConfig) {
    let one = rows == 1 && cols.is_multiple_of(8);
    let rows_per_block = if one { 8 / one_row_parts(cols) } else { 8 };
    let name = match (three, one) {
        (false, false) => "matvec_bf16",
        (false, true) => "matvec_bf16_one",
        (true, false) => "matvec_bf16_3",
        (true, true) => "matvec_bf16_3_one",
    };
    (name, cfg(out_rows.div_ceil(rows_per_block).max(1), 256, 0))
}

/// Warps a row of `cols` columns is cut into by the one-row bf16 kernels (their
/// `mv_one_parts`): a power of two, at most 8, each taking up to [`MV_ONE_COLS`].
fn one_row_parts(cols: usize) -> usize {
    let mut parts = 1;
    while parts < 8 && parts * MV_ONE_COLS < cols {
        parts *= 2;
    }
    parts
}

/// Whether the one-row bf16 kernels take a row of `cols`: whole 8s, and at most their
/// parts' reach.
fn one_row_takes(cols: usize) -> bool {
    cols.is_multiple_of(8) && one_row_parts(cols) * MV_ONE_COLS >= cols
}

/// Dynamic shared memory of a `routed_mma_*` block staging `units` 64-column units, with
/// its partial sums of two matrices per warp.
fn routed_mma_shared(units: usize) -> usize {
    const _: () = assert!(RMMA_DOWN_WARPS <= 2 * RMMA_WARPS);
    units * RMMA_UNIT_BYTES + RMMA_WARPS * 2 * RMMA_ROWS * 4
}

/// Dynamic shared memory of a `dense_mma_*` block over `groups` groups: the routed
/// kernels' layout, then with the norm (`dense_mma_norm_*`) each group's scale and the
/// row through the norm, from the next 16-byte boundary.
fn dense_mma_shared(groups: usize, norm: bool) -> usize {
    routed_mma_shared(groups)
        + if norm {
            (groups + groups * GROUP_SIZE) * 4 + 16
        } else {
            0
        }
}

/// Dynamic shared memory of a `routed_mma_gate_up_*` block with `early`: the staged units
/// and partial sums, then, 8-byte aligned, six pointers for each of `experts`, then with
/// the norm folded in (`normed` the row's width, else 0) the row through it from the next
/// 16-byte boundary.
fn routed_mma_gate_up_shared(units: usize, experts: usize, normed: usize) -> usize {
    routed_mma_shared(units).next_multiple_of(8)
        + experts * GATE_UP_POINTERS * 8
        + if normed > 0 { normed * 4 + 16 } else { 0 }
}

/// The warps that split a job of the one-row dense kernels (`dense_mma`'s `parts`, a
/// power of two up to [`RMMA_WARPS`]) and the blocks of the launch, for `tiles` tiles of
/// [`RMMA_ROWS`] rows of `groups` 64-column groups on `sms` multiprocessors that each
/// hold `per_sm` blocks (the kernels' launch bound, `DMMA_BLOCKS`). A job of one warp
/// keeps the most bytes a warp in flight, so as few parts as give every multiprocessor
/// two blocks' worth of warps; at most `per_sm` blocks a multiprocessor, which loop over
/// the remaining jobs.
fn dense_mma_layout(tiles: usize, groups: usize, sms: usize, per_sm: usize) -> (usize, usize) {
    let mut parts = 1;
    while parts < RMMA_WARPS && 2 * parts <= groups && tiles * parts < 2 * RMMA_WARPS * sms {
        parts *= 2;
    }
    let blocks = tiles
        .div_ceil(RMMA_WARPS / parts)
        .clamp(1, per_sm * sms.max(1));
    (parts, blocks)
}

/// Shared memory a `routed_vq_*_mma` block stages `rows` rows of a matrix's codes
/// (`row_bytes` each) and norms (`blocks` fp16 each) in: each code row in an odd number
/// of 16-byte chunks, one more than it may touch (the kernels' `vqm_code_stride`), and
/// the norms in whole chunks from the one holding the first (`staged_bytes`).
fn staged_rows(rows: usize, row_bytes: usize, blocks: usize) -> usize {
    let code_stride = 16 * ((row_bytes.div_ceil(16) + 1) | 1);
    rows * code_stride + (rows * blocks * 2).next_multiple_of(16) + 16
}

/// The signs of a rotation of `block` values from `seed` as the routed VQ kernels read
/// them: bit i of word w set where entry 32w + i is −1.
fn sign_bits(seed: u64, block: usize) -> Vec<u32> {
    let mut bits = vec![0u32; block.div_ceil(32)];
    for (i, s) in rotation::signs(seed, block).iter().enumerate() {
        if *s < 0.0 {
            bits[i / 32] |= 1 << (i % 32);
        }
    }
    bits
}

/// Dynamic shared memory of a `vq_expert_mma_*` block of `mats` matrices, less the
/// book: each matrix's tile of EXPERT_TILE_ROWS inputs staged as f16 hi and lo parts
/// (rows of 9 16-byte units, the kernels' `VQG_LDU`), and a norm for each warp's rows.
fn vq_gemm_shared(mats: usize) -> usize {
    mats * 2 * EXPERT_TILE_ROWS * 9 * 16 + VQG_WARPS * 16 * 4
}

/// Whether the grouped GEMMs' grid, sized for the most tiles `pairs` pairs over
/// `experts` experts could need, fits a grid's y extent.
fn gemm_grid_fits(pairs: usize, experts: usize) -> bool {
    pairs / EXPERT_TILE_ROWS + experts <= 65_535
}

/// The kernel-name suffix of affine words of `bits` bits.
fn bits_suffix(bits: u32) -> &'static str {
    match bits {
        4 => "q4",
        3 => "q3",
        2 => "q2",
        b => panic!("no affine kernel for {b}-bit words (2, 3, 4)"),
    }
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

/// The launch of the RMSNorm kernels for `rows` rows of `dim`: a warp per row for narrow
/// rows (up to 8 a block), else a block per row with a thread per 4 values (at most
/// 1024; at least 64, so the block sum has whole warps).
fn norm_cfg(rows: usize, dim: usize) -> LaunchConfig {
    if dim <= NORM_WARP_DIM {
        let per_block = rows.min(8);
        cfg(rows.div_ceil(per_block), (per_block * 32) as u32, 0)
    } else {
        let threads = dim.div_ceil(4).next_power_of_two().clamp(64, 1024);
        cfg(rows, threads as u32, 0)
    }
}

/// Threads for a kernel that loops over a row of `width`.
fn row_threads(width: usize) -> u32 {
    (width.next_power_of_two().clamp(32, 256)) as u32
}

impl Cuda {
    /// The backend on device `ordinal`, tuned as `DYNMOE_CUDA` says ([`Tuning::from_env`]).
    pub fn new(ordinal: usize) -> Result<Cuda, CudaError> {
        Self::with_tuning(ordinal, Tuning::from_env()?)
    }

    /// The backend on device `ordinal`, run as `tuning` says: probes for the libraries,
    /// makes the context, compiles the kernels for the device's compute capability (with
    /// the tuning's constants) and loads them.
    pub fn with_tuning(ordinal: usize, tuning: Tuning) -> Result<Cuda, CudaError> {
        probe()?;
        let ctx = driver(CudaContext::new(ordinal))?;
        // One stream carries every op in order; per-buffer events would only add work.
        // SAFETY: no buffer of this context is ever used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = driver(ctx.compute_capability())?;
        let arch = format!("sm_{major}{minor}");
        let device_name = driver(ctx.name())?;
        let sms = driver(ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        ))? as usize;
        let ptx = ptx_for(&arch, &tuning.defines)?;
        let dmma_blocks = match tuning.define("DMMA_BLOCKS") {
            Some(v) => v.parse().map_err(|_| CudaError::Tuning {
                item: format!("define=DMMA_BLOCKS={v}"),
                expected: "a count of blocks".into(),
            })?,
            None => DMMA_BLOCKS,
        };
        let module = driver(ctx.load_module(ptx))?;
        let mut f = HashMap::new();
        for name in KERNEL_NAMES {
            f.insert(name, driver(module.load_function(name))?);
        }
        // The tiled prefill kernels take more than the 48 KB of shared memory a block gets
        // without asking (107 KB at a head of 128); a device that allows less keeps the
        // per-row kernel for those widths.
        let optin = driver(ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        ))? as usize;
        let mut tiled_head_dim = 0;
        for width in [64, 128, 256] {
            let bytes = tiled_shared(width);
            let name = tiled_kernel(width).expect("a tiled width");
            if !grant_shared(&f, &[name], bytes, optin) {
                break;
            }
            tiled_head_dim = width;
        }
        // Shared memory each of `names` may take: the device's opt-in where every one of
        // them was granted it, else what a block gets without asking.
        let granted = |names: &[&str]| {
            if grant_shared(&f, names, optin, optin) {
                optin
            } else {
                SHARED_LIMIT
            }
        };
        // The routed VQ kernels and the VQ GEMMs copy a book into shared memory beside
        // their activations; without the opt-in they read it through L1.
        let vq_kernels: Vec<&str> = KERNEL_NAMES
            .into_iter()
            .filter(|n| {
                ["routed_vq_gate_up", "routed_vq_down", "vq_expert_mma"]
                    .iter()
                    .any(|p| n.starts_with(p))
            })
            .collect();
        let vq_routed_shared = granted(&vq_kernels);
        let down_alone = down_alone(&ctx, &f, optin)?;
        // A stream of its own: the legacy default stream cannot be recorded into a graph.
        let stream = driver(ctx.new_stream())?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        let copies = driver(ctx.new_stream())?;
        let down_ready = driver(stream.alloc_zeros::<u32>(2))?;
        let timeline = module
            .get_global("timeline_count", &stream)
            .is_ok()
            .then(|| Mutex::new(Vec::new()));
        Ok(Cuda {
            ctx,
            stream,
            copies,
            blas,
            k: Kernels { _module: module, f },
            arch,
            device_name,
            affine: Mutex::new(HashMap::new()),
            vq: Mutex::new(HashMap::new()),
            vq_books: Mutex::new(HashMap::new()),
            vq_scratch: Mutex::new(None),
            constants: Mutex::new(Vec::new()),
            routed: Mutex::new(HashMap::new()),
            routed_scratch: Mutex::new(None),
            graphs: Mutex::new(Vec::new()),
            reads: Mutex::new(Vec::new()),
            attn_scratch: Mutex::new(None),
            argmax_scratch: Mutex::new(None),
            dense_scratch: Mutex::new(None),
            split_scratch: Mutex::new(None),
            tensor_cores: major >= 8 && tuning.tensor_cores,
            down_ready,
            down_alone,
            bf16_one_row_dense: AtomicBool::new(false),
            programmatic: major >= 9 && tuning.pdl,
            dmma_blocks,
            tuning,
            timeline,
            tiled_head_dim,
            vq_routed_shared,
            sms,
        })
    }

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

    /// Whether the routed gate/up of `rows` rows behind router `gate` (the launch
    /// [`launch_routed`](Self::launch_routed) makes next) takes the early start: one row
    /// through a bf16 router of the one-row kernel, affine experts on tensor cores that
    /// route themselves, and the expert table in shared memory beside the staged units.
    fn routes_gate_up_early(
        &self,
        r: &Routed<'_>,
        gate: &DeviceMatrix,
        rows: usize,
        hidden: usize,
    ) -> bool {
        let RoutedKind::Affine(shape) = r.kind else {
            return false;
        };
        rows == 1
            && matches!(gate, DeviceMatrix::Bf16(_))
            && one_row_takes(hidden)
            && r.experts <= ROUTE_SHARED_MAX
            && self.routed_mma_takes(shape, r.route.top_k)
            && routed_mma_gate_up_shared(shape.up_cols / 64, r.experts, 0) <= SHARED_LIMIT
    }

    /// Whether a decode step's affine experts of `shape`, `top_k` a row, run on tensor
    /// cores (`routed_mma_*`): tensor cores on, and their staged units within the shared
    /// memory a block takes without opting in.
    fn routed_mma_takes(&self, shape: RoutedShape, top_k: usize) -> bool {
        let units = (shape.up_cols / 64).max(top_k * (shape.down_cols / 64));
        self.tensor_cores() && routed_mma_shared(units) <= SHARED_LIMIT
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

    /// The device copy of a VQ matrix's codes and norms, made the first time it is seen.
    fn device_vq(&self, w: &VqView<'_>) -> Arc<DeviceVq> {
        let key = vq_key(w);
        let print = vq_fingerprint(w);
        let mut cache = self.vq.lock().expect("weight cache lock");
        if let Some(d) = cache.get(&key) {
            if d.fingerprint == print {
                return d.clone();
            }
        }
        let n = w.rows * row_bytes(w.rung, w.cols);
        assert!(
            w.codes.len() >= n && w.norms.len() >= w.rows * w.blocks(),
            "VQ matrix of {} x {} at {}: {} code bytes and {} norms are too few",
            w.rows,
            w.cols,
            w.rung.name(),
            w.codes.len(),
            w.norms.len()
        );
        let mut codes = ok(self.stream.alloc_zeros::<u8>(n + VQ_CODE_PADDING), "alloc");
        let mut head = codes.slice_mut(..n);
        ok(self.stream.memcpy_htod(&w.codes[..n], &mut head), "upload");
        let norms = &w.norms[..w.rows * w.blocks()];
        let signs = sign_bits(w.seed, w.block);
        let mut padded_norms = ok(
            self.stream
                .alloc_zeros::<u16>(norms.len() + VQ_CODE_PADDING / 2),
            "alloc",
        );
        let mut head = padded_norms.slice_mut(..norms.len());
        ok(
            self.stream.memcpy_htod(norms.reinterpret_cast(), &mut head),
            "upload",
        );
        let d = Arc::new(DeviceVq {
            codes,
            norms: padded_norms,
            signs: ok(self.stream.clone_htod(&signs), "upload"),
            fingerprint: print,
        });
        cache.insert(key, d.clone());
        d
    }

    /// The device copy of a rung's codebook, every codeword expanded, made once.
    fn vq_book(&self, rung: Rung) -> Arc<CudaSlice<u16>> {
        let mut books = self.vq_books.lock().expect("codebook lock");
        books
            .entry(rung.position())
            .or_insert_with(|| {
                // The embedded codebooks are checked by the test suite; one failing to
                // load is a broken build, not bad input.
                let book = rung
                    .codebook()
                    .unwrap_or_else(|e| panic!("{}: {e}", rung.name()));
                let half = book.values_f16();
                debug_assert_eq!(half.len() * 2, vq_book_bytes(rung));
                Arc::new(ok(
                    self.stream.clone_htod(half.reinterpret_cast()),
                    "upload",
                ))
            })
            .clone()
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

    /// `xr[r] = H D x[r]` per block of `block` for `rows` rows of `cols` values: the
    /// activations in the rotated domain of a VQ matrix with that rotation seed and
    /// block size (`[rows, blocks · block]`, the ragged tail block zero-padded), as
    /// [`crate::codec::vq::kernels`] prepares them on the CPU.
    pub fn vq_rotate<O: DevicePtrMut<f32>>(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        seed: u64,
        block: usize,
        xr: &mut O,
    ) {
        assert!(
            block.is_power_of_two() && block <= 1024,
            "rotation block of {block} values (a power of two, at most 1024)"
        );
        if rows == 0 || cols == 0 {
            return;
        }
        let (c, b) = (cols as i32, block as i32);
        let o = xr.device_ptr_mut(&self.stream).0;
        let mut l = self.launcher(self.func("vq_rotate"));
        l.arg(x).arg(&seed).arg(&o).arg(&c).arg(&b);
        let grid = LaunchConfig {
            grid_dim: (cols.div_ceil(block) as u32, rows as u32, 1),
            block_dim: ((block / 2).clamp(32, 512) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        ok(unsafe { l.launch(grid) }, "vq_rotate");
    }

    /// [`Backend::matmul_vq`] on a device copy: the activations rotated once, then the
    /// matrix-vector kernel reading the codes for up to [`MATVEC_MAX_BATCH`] rows, or
    /// the matrix decoded (in the rotated domain) into a scratch buffer and one GEMM.
    fn vq_product(
        &self,
        x: &CudaSlice<f32>,
        w: &VqView<'_>,
        d: &DeviceVq,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let (block, row_blocks) = (w.block, w.blocks());
        let width = row_blocks * block;
        let mut rotated = self.grown(&self.vq_scratch, rows * width);
        let xr = rotated.as_mut().expect("grown");
        self.vq_rotate(x, rows, w.cols, w.seed, block, xr);
        let book = self.vq_book(w.rung);
        let suffix = vq_suffix(w.rung.dim);
        let (r, k, b, nblocks) = (
            w.rows as i32,
            w.rung.index_bits as i32,
            block as i32,
            row_blocks as i32,
        );
        let rb = row_bytes(w.rung, w.cols) as u64;
        // As the CPU kernels scale a block's sum.
        let inv_root = 1.0 / (block as f32).sqrt();
        let tile = vq_tile(w.rung, width, rows);
        if rows > MATVEC_MAX_BATCH || tile.is_none() {
            let mut dense = self.grown(&self.dense_scratch, w.rows * width);
            let dense = dense.as_mut().expect("grown");
            let vectors = w.rows * width / w.rung.dim;
            let mut l = self.launcher(self.func(&format!("vq_decode_{suffix}")));
            l.arg(&d.codes)
                .arg(&d.norms)
                .arg(&*book)
                .arg(&mut *dense)
                .arg(&r)
                .arg(&k)
                .arg(&b)
                .arg(&nblocks)
                .arg(&rb)
                .arg(&inv_root);
            ok(
                unsafe { l.launch(cfg(blocks(vectors, 256) as usize, 256, 0)) },
                "vq decode",
            );
            self.gemm_xwt(xr, &*dense, rows, width, width, w.rows, out);
            return;
        }
        let f = self.func(&format!("vq_matvec_{suffix}"));
        let mut t0 = 0;
        while t0 < rows {
            let tile = vq_tile(w.rung, width, rows - t0).expect("fits: checked above");
            let nb = tile.rows;
            let xs = xr.slice(t0 * width..(t0 + nb) * width);
            let mut os = out.slice_mut(t0 * w.rows..(t0 + nb) * w.rows);
            let (nbi, shared) = (nb as i32, tile.book_shared as i32);
            let mut l = self.launcher(f);
            l.arg(&d.codes)
                .arg(&d.norms)
                .arg(&*book)
                .arg(&xs)
                .arg(&mut os)
                .arg(&r)
                .arg(&k)
                .arg(&b)
                .arg(&nblocks)
                .arg(&rb)
                .arg(&inv_root)
                .arg(&nbi)
                .arg(&shared);
            let mut grid = w.rows.div_ceil(VQ_WARPS);
            let mut bytes = nb * width * 4;
            if tile.book_shared {
                grid = grid.min(VQ_SHARED_BOOK_BLOCKS);
                bytes += vq_book_bytes(w.rung);
            }
            ok(
                unsafe { l.launch(cfg(grid, (VQ_WARPS * 32) as u32, bytes)) },
                "vq matvec",
            );
            t0 += nb;
        }
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

    /// A launch of `f` on the compute stream, programmatic where the device allows.
    fn launcher<'s>(&'s self, f: &'s CudaFunction) -> Launch<'s> {
        if let Some(names) = &self.timeline {
            let name = self
                .k
                .f
                .iter()
                .find(|(_, g)| g.cu_function() == f.cu_function());
            let name = name.map_or("(unnamed)", |(n, _)| *n);
            names.lock().expect("timeline lock").push(name);
        }
        Launch::new(&self.stream, f, self.programmatic)
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
        let mut count = driver(self.k._module.get_global("timeline_count", &self.stream))?;
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
        let count = driver(self.k._module.get_global("timeline_count", &self.stream))?;
        // SAFETY: the global is one `unsigned`.
        let count = unsafe { count.transmute::<u32>(1) }.expect("timeline_count is 4 bytes");
        let count = driver(self.stream.clone_dtoh(&count))?[0] as usize;
        let stamps = driver(self.k._module.get_global("timeline_stamps", &self.stream))?;
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

    /// With the kernels built with `PHASES=<blocks>` (kernels/common.cuh's `PHASE`), the last
    /// routed gate/up launch's stamps (`[0]`) and the last routed down launch's (`[1]`):
    /// for each of the first <blocks> blocks, the global timer (ns) at each of its
    /// `PHASE_SLOTS` phases, 0 where a block or phase has none. None without the define.
    pub fn phase_stamps(&self) -> Result<Option<[Vec<[u64; PHASE_SLOTS]>; 2]>, CudaError> {
        let Ok(stamps) = self.k._module.get_global("phase_stamps", &self.stream) else {
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

    fn func(&self, name: &str) -> &CudaFunction {
        &self.k.f[name]
    }

    fn upload_u32(&self, v: &[u32]) -> CudaSlice<u32> {
        ok(self.stream.clone_htod(v), "upload")
    }

    /// `x[..n] = v` on the device.
    pub fn fill(&self, x: &mut CudaSlice<f32>, v: f32, n: usize) {
        self.fill_at(x.device_ptr_mut(&self.stream).0, v, n);
    }

    /// [`fill`](Self::fill) of the `n` floats at device address `at`.
    fn fill_at(&self, at: u64, v: f32, n: usize) {
        if n == 0 {
            return;
        }
        let n64 = n as i64;
        let mut l = self.launcher(self.func("fill"));
        l.arg(&at).arg(&v).arg(&n64);
        ok(
            unsafe { l.launch(cfg(blocks(n, 256).min(4096) as usize, 256, 0)) },
            "fill",
        );
    }

    /// `dst[..n] = src[..n]` through the copy kernel (16-byte accesses), the reference
    /// bandwidth quantized kernels are measured against. `n` must be a multiple of 4.
    pub fn copy_kernel(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>, n: usize) {
        assert!(
            n.is_multiple_of(4),
            "copy of {n} floats is not whole float4s"
        );
        let n4 = (n / 4) as i64;
        let mut l = self.launcher(self.func("copy_f4"));
        l.arg(src).arg(dst).arg(&n4);
        ok(
            unsafe { l.launch(cfg(blocks(n / 4, 256).min(132 * 16) as usize, 256, 0)) },
            "copy",
        );
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

    /// The device copy of `w`, made on first use; with `dense` (a dense layer's matrix,
    /// not an expert's), also in unit tiles where [`tiles_take`](Self::tiles_take) it.
    fn device_affine(&self, w: &AffineView<'_>, dense: bool) -> Arc<DeviceAffine> {
        let key = affine_key(w);
        let print = fingerprint(w);
        let mut cache = self.affine.lock().expect("weight cache lock");
        if let Some(d) = cache.get(&key) {
            if d.fingerprint == print {
                return d.clone();
            }
        }
        let tiled = dense && self.tiles_take(w);
        let groups = w.rows * (w.cols / GROUP_SIZE);
        let words = &w.words[..w.rows * words_per_row(w.cols, w.bits)];
        let d = Arc::new(DeviceAffine {
            rows: AffineRows {
                words: self.upload_u32(words),
                scales: ok(
                    self.stream
                        .clone_htod(w.scales[..groups].reinterpret_cast()),
                    "upload",
                ),
                biases: ok(
                    self.stream
                        .clone_htod(w.biases[..groups].reinterpret_cast()),
                    "upload",
                ),
            },
            fingerprint: print,
            tiles: tiled.then(|| self.upload_tiles(w)),
        });
        cache.insert(key, d.clone());
        d
    }

    /// [`Backend::matmul_affine`] on a device copy, with the row count deciding between
    /// the matrix-vector kernel and expand-then-GEMM.
    fn affine_product(
        &self,
        x: &CudaSlice<f32>,
        w: &AffineView<'_>,
        d: &DeviceAffine,
        rows: usize,
        in_dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        assert!(
            in_dim <= w.cols && w.cols.is_multiple_of(GROUP_SIZE),
            "input of {in_dim} columns for a matrix of {}",
            w.cols
        );
        let groups = w.cols / GROUP_SIZE;
        let one_row = rows == 1 && routed_mma_shared(groups) <= SHARED_LIMIT;
        if one_row && self.tensor_cores() {
            let o = out.device_ptr_mut(&self.stream).0;
            let tiled = self.tiles_of(w, d).is_some();
            self.launch_dense_mma(w.bits, &[(d, w.rows, o)], x, w.cols, in_dim, None, tiled);
            return;
        }
        if rows > AFFINE_GEMM_ROWS && self.tensor_cores() {
            self.affine_gemm(x, w, d, rows, in_dim, out);
            return;
        }
        let d = &d.rows;
        if rows > AFFINE_GEMM_ROWS {
            let mut dense = ok(
                unsafe { self.stream.alloc::<f32>(w.rows * w.cols) },
                "alloc",
            );
            let name = format!("affine_dequant_{}", bits_suffix(w.bits));
            let (r, c) = (w.rows as i32, w.cols as i32);
            let chunks = w.rows * w.cols / 32;
            let mut l = self.launcher(self.func(&name));
            l.arg(&d.words)
                .arg(&d.scales)
                .arg(&d.biases)
                .arg(&mut dense)
                .arg(&r)
                .arg(&c);
            ok(
                unsafe { l.launch(cfg(blocks(chunks, 256) as usize, 256, 0)) },
                "affine dequant",
            );
            self.gemm_xwt(x, &dense, rows, in_dim, w.cols, w.rows, out);
            return;
        }
        let name = format!("affine_matvec_{}", bits_suffix(w.bits));
        let (tile, chunk_bytes) = affine_tile(w.cols);
        let grid = w.rows.div_ceil(AFFINE_WARPS);
        let (r, c, i) = (w.rows as i32, w.cols as i32, in_dim as i32);
        let mut t0 = 0;
        while t0 < rows {
            let nb = tile.min(rows - t0);
            let b = nb as i32;
            let xs = x.slice(t0 * in_dim..(t0 + nb) * in_dim);
            let mut os = out.slice_mut(t0 * w.rows..(t0 + nb) * w.rows);
            let mut l = self.launcher(self.func(&name));
            l.arg(&d.words)
                .arg(&d.scales)
                .arg(&d.biases)
                .arg(&xs)
                .arg(&mut os)
                .arg(&r)
                .arg(&c)
                .arg(&i)
                .arg(&b);
            ok(
                unsafe { l.launch(cfg(grid, (AFFINE_WARPS * 32) as u32, nb * chunk_bytes)) },
                "affine matvec",
            );
            t0 += nb;
        }
    }

    /// One input row times up to three affine matrices of `cols` columns and the same
    /// bits (`mats`: device copy, rows, output address) in one `dense_mma` launch, on
    /// tensor cores. `x` is `in_dim` wide, read as zeros up to `cols`; with `norm`, the
    /// kernel reads it through that residual add and norm.
    fn launch_dense_mma(
        &self,
        bits: u32,
        mats: &[(&DeviceAffine, usize, u64)],
        x: &CudaSlice<f32>,
        cols: usize,
        in_dim: usize,
        norm: Option<&InputNorm>,
        tiled: bool,
    ) {
        debug_assert!((1..=3).contains(&mats.len()));
        let groups = cols / GROUP_SIZE;
        let tiles: usize = mats.iter().map(|m| m.1.div_ceil(RMMA_ROWS)).sum();
        let (parts, blocks) = dense_mma_layout(tiles, groups, self.sms, self.dmma_blocks);
        let kernel = match (norm.is_some(), tiled) {
            (true, true) => "dense_mma_norm_tiled",
            (true, false) => "dense_mma_norm",
            (false, true) => "dense_mma_tiled",
            (false, false) => "dense_mma",
        };
        let shared = dense_mma_shared(groups, norm.is_some());
        let name = format!("{kernel}_{}", bits_suffix(bits));
        let mut l = self.launcher(self.func(&name));
        for i in 0..3 {
            // Unused slots repeat the first matrix with no rows.
            let (d, rows, o) = mats.get(i).copied().unwrap_or((mats[0].0, 0, mats[0].2));
            let r = rows as i32;
            match d.tiles.as_ref().filter(|_| tiled) {
                // The tiled kernels read scales and biases from one buffer.
                Some(t) => l.arg(&t.words).arg(&t.sb).arg(&t.sb),
                None => {
                    let r = &d.rows;
                    l.arg(&r.words).arg(&r.scales).arg(&r.biases)
                }
            };
            l.arg(&o).arg(&r);
        }
        let (n, c, i, p) = (mats.len() as i32, cols as i32, in_dim as i32, parts as i32);
        l.arg(&n).arg(x).arg(&c).arg(&i).arg(&p);
        if let Some(norm) = norm {
            l.arg(&norm.delta)
                .arg(&norm.w)
                .arg(&norm.eps)
                .arg(&norm.sum);
        }
        let launch = cfg(blocks, (RMMA_WARPS * 32) as u32, shared);
        ok(unsafe { l.launch(launch) }, "dense_mma");
    }

    /// Whether `dense_mma` takes the products of one row with `ws` in one launch:
    /// affine matrices of the same bits and columns, `in_dim` within them, on tensor cores.
    fn dense_mma_takes(&self, ws: &[Weight<'_, DeviceMatrix>], rows: usize, in_dim: usize) -> bool {
        let Some(Weight::Affine(a)) = ws.first() else {
            return false;
        };
        rows == 1
            && self.tensor_cores()
            && in_dim <= a.cols
            && dense_mma_shared(a.cols / GROUP_SIZE, false) <= SHARED_LIMIT
            && ws
                .iter()
                .all(|w| matches!(w, Weight::Affine(b) if b.bits == a.bits && b.cols == a.cols))
    }

    /// Whether `dense_mma_norm` takes the products of one row with `ws` through the
    /// residual add and norm before them: `dense_mma` takes them, and the row through the
    /// norm fits beside its staged units.
    fn dense_mma_folds_norm(
        &self,
        ws: &[Weight<'_, DeviceMatrix>],
        rows: usize,
        in_dim: usize,
    ) -> bool {
        let Some(Weight::Affine(a)) = ws.first() else {
            return false;
        };
        self.dense_mma_takes(ws, rows, in_dim)
            && dense_mma_shared(a.cols / GROUP_SIZE, true) <= SHARED_LIMIT
    }

    /// `w` in unit tiles on the device.
    fn upload_tiles(&self, w: &AffineView<'_>) -> DeviceTiles {
        let (words, sb) = unit_tiles(w);
        DeviceTiles {
            words: self.upload_u32(&words),
            sb: ok(self.stream.clone_htod(&sb), "upload"),
        }
    }

    /// Whether one-row products of the dense matrix `w` read it in unit tiles: at 4 or 2
    /// bits, every such matrix's (the LM head's streamed ~16% faster in tiles, and every
    /// dense matrix in tiles measured +4.8% decode at 4 bits, +3.7% at 2: docs/GPU_NOTES.md,
    /// thirteenth round), at the cost of the matrix's bytes again in device memory.
    fn tiles_take(&self, w: &AffineView<'_>) -> bool {
        matches!(w.bits, 4 | 2)
    }

    /// `d` (the device copy of `w`) in unit tiles, for a one-row product of it alone:
    /// where [`tiles_take`](Self::tiles_take) it and the copy was made with `d` (never
    /// later: a first use may come while a step is being recorded, where no upload may
    /// run).
    fn tiles_of<'d>(&self, w: &AffineView<'_>, d: &'d DeviceAffine) -> Option<&'d DeviceTiles> {
        d.tiles.as_ref().filter(|_| self.tiles_take(w))
    }

    /// The products [`dense_mma_takes`](Self::dense_mma_takes) took, into `outs`.
    fn dense_mma_product(
        &self,
        x: &CudaSlice<f32>,
        ws: &[Weight<'_, DeviceMatrix>],
        in_dim: usize,
        outs: &[u64],
        norm: Option<&InputNorm>,
    ) {
        let views: Vec<&AffineView<'_>> = ws
            .iter()
            .map(|w| match w {
                Weight::Affine(a) => a,
                _ => unreachable!("dense_mma_takes checked"),
            })
            .collect();
        let devs: Vec<_> = views.iter().map(|w| self.device_affine(w, true)).collect();
        let mats: Vec<_> = views
            .iter()
            .zip(&devs)
            .zip(outs)
            .map(|((w, d), &o)| (&**d, w.rows, o))
            .collect();
        // Tiles for all or for none: one kernel reads the launch's matrices.
        let tiled = views
            .iter()
            .zip(&devs)
            .all(|(w, d)| self.tiles_of(w, d).is_some());
        self.launch_dense_mma(views[0].bits, &mats, x, views[0].cols, in_dim, norm, tiled);
    }

    /// The [`InputNorm`] of `n` for a kernel that folds it in: `sum` gets `x + delta` (with
    /// a delta); nothing gets the normed row.
    fn input_norm(&self, n: AddNorm<'_, CudaSlice<f32>>, sum: &mut CudaSlice<f32>) -> InputNorm {
        let delta = n.delta.map_or(0, |d| d.device_ptr(&self.stream).0);
        InputNorm {
            delta,
            w: n.w.device_ptr(&self.stream).0,
            eps: n.eps,
            sum: if delta == 0 {
                0
            } else {
                sum.device_ptr_mut(&self.stream).0
            },
        }
    }

    /// `rows` input rows times an affine matrix on tensor cores: the grouped expert GEMM
    /// (`expert_mma_down_*`) over one group that holds every row, with unit weights, so a
    /// prompt's dense products read the codes as the experts' do and keep f32 precision.
    fn affine_gemm(
        &self,
        x: &CudaSlice<f32>,
        w: &AffineView<'_>,
        d: &DeviceAffine,
        rows: usize,
        in_dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let mut entry = [0u64; GROUP_ENTRY];
        entry[6..9].copy_from_slice(&d.rows.addresses(&self.stream));
        let kernels = bits_suffix(w.bits);
        entry[10] = rows as u64;
        let table = ok(self.stream.clone_htod(&entry), "upload");
        let tiles: Vec<u32> = (0..rows.div_ceil(EXPERT_TILE_ROWS))
            .flat_map(|t| [0, (t * EXPERT_TILE_ROWS) as u32])
            .collect();
        let tiles = self.upload_u32(&tiles);
        let pair_rows = self.upload_u32(&(0..rows as u32).collect::<Vec<_>>());
        let ones = self.upload(&vec![1.0f32; rows]);
        self.fill(out, 0.0, rows * w.rows);
        let (r, c, i) = (w.rows as i32, w.cols as i32, in_dim as i32);
        let mut l = self.launcher(self.func(&format!("expert_mma_down_{kernels}")));
        l.arg(&table)
            .arg(&tiles)
            .arg(&0u64)
            .arg(&pair_rows)
            .arg(&ones);
        l.arg(x).arg(out).arg(&r).arg(&c).arg(&i);
        let launch = LaunchConfig {
            grid_dim: (
                w.rows.div_ceil(EXPERT_TILE_OUTPUTS) as u32,
                rows.div_ceil(EXPERT_TILE_ROWS) as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        ok(unsafe { l.launch(launch) }, "affine GEMM");
    }

    /// The MoE dispatch of [`Backend::swiglu_groups`] for affine groups sharing one
    /// shape: one upload of the group table, then either (every group of at most
    /// [`AFFINE_GEMM_ROWS`] rows, as in a decode step) one matrix-vector launch for every
    /// gate and up product, one SiLU, one launch for every down product and one scatter,
    /// or (a prompt, on tensor cores) the grouped GEMMs `expert_mma_gate_up` (SiLU
    /// inside) and `expert_mma_down` (scatter inside). Without tensor cores groups of
    /// more rows are left out. Returns the groups it did not take.
    fn swiglu_grouped<'g, 'a>(
        &self,
        x: &CudaSlice<f32>,
        hidden: usize,
        groups: &'g [SwiGluGroup<'a, DeviceMatrix>],
        out: &mut CudaSlice<f32>,
    ) -> Vec<&'g SwiGluGroup<'a, DeviceMatrix>> {
        let key = |m: &[AffineView<'_>; 3]| (m[0].bits, m[0].rows, m[0].cols, m[2].rows, m[2].cols);
        let gemm = self.tensor_cores();
        let mut shape = None;
        let (mut take, mut rest) = (Vec::new(), Vec::new());
        for g in groups.iter().filter(|g| !g.rows.is_empty()) {
            match affine_of(g) {
                Some(m)
                    if (gemm || g.rows.len() <= AFFINE_GEMM_ROWS)
                        && m[1].rows == m[0].rows
                        && m[1].cols == m[0].cols
                        && m[0].cols >= hidden
                        && m[2].rows == hidden
                        && m[2].cols >= g.intermediate
                        && *shape.get_or_insert(key(&m)) == key(&m) =>
                {
                    take.push((g, m))
                }
                _ => rest.push(g),
            }
        }
        if take.is_empty() {
            return rest;
        }
        let (bits, inter, up_cols, _, down_cols) = shape.expect("set with the first group");
        let n_groups = take.len();
        let pairs: usize = take.iter().map(|(g, _)| g.rows.len()).sum();
        let gemm = gemm && take.iter().any(|(g, _)| g.rows.len() > AFFINE_GEMM_ROWS);
        // One u64 buffer: the table, then row ids and scales two to a word.
        let mut table: Vec<u64> = Vec::with_capacity(n_groups * GROUP_ENTRY + pairs);
        let mut row_ids: Vec<u32> = Vec::with_capacity(pairs);
        let mut scales: Vec<f32> = Vec::with_capacity(pairs);
        let mut keep = Vec::with_capacity(n_groups);
        for (g, m) in &take {
            for w in m {
                let d = self.device_affine(w, false);
                table.extend(d.rows.addresses(&self.stream));
                keep.push(d);
            }
            table.push(row_ids.len() as u64);
            table.push(g.rows.len() as u64);
            row_ids.extend_from_slice(g.rows);
            scales.extend_from_slice(g.scales);
        }
        let rows_at = table.len() * 2;
        let mut words: Vec<u32> = table
            .iter()
            .flat_map(|&v| [v as u32, (v >> 32) as u32])
            .collect();
        words.extend_from_slice(&row_ids);
        words.extend(scales.iter().map(|s| s.to_bits()));
        let tiles_at = words.len();
        if gemm {
            // The GEMM's pair tiles: (group, first row) for every EXPERT_TILE_ROWS rows.
            for (i, (g, _)) in take.iter().enumerate() {
                for first in (0..g.rows.len()).step_by(EXPERT_TILE_ROWS) {
                    words.extend([i as u32, first as u32]);
                }
            }
        }
        let meta = self.upload_u32(&words);
        let table_v = meta.slice(..rows_at);
        let rows_v = meta.slice(rows_at..rows_at + pairs);
        let scales_v = meta.slice(rows_at + pairs..tiles_at);
        let suffix = bits_suffix(bits);
        let raw = |n: usize| ok(unsafe { self.stream.alloc::<f32>(n.max(1)) }, "alloc");

        if gemm {
            let h = raw(pairs * inter);
            let tiles = (words.len() - tiles_at) / 2;
            let at = |v: &CudaView<'_, u32>| v.device_ptr(&self.stream).0;
            // A grid's y extent is at most 65 535 tiles; longer prompts take several.
            for t0 in (0..tiles).step_by(65_535) {
                self.launch_expert_gemms(&ExpertGemms {
                    kernels: suffix.to_string(),
                    table: at(&table_v),
                    tiles: at(&meta.slice(tiles_at + 2 * t0..)),
                    grid_tiles: (tiles - t0).min(65_535),
                    tiles_n: NO_COUNT,
                    pair_rows: at(&rows_v),
                    pair_weights: at(&scales_v),
                    x: x.device_ptr(&self.stream).0,
                    h: h.device_ptr(&self.stream).0,
                    out: out.device_ptr_mut(&self.stream).0,
                    hidden,
                    inter,
                    up_cols,
                    down_cols,
                });
            }
            drop(keep);
            return rest;
        }

        let (mut gate, mut up, mut down) =
            (raw(pairs * inter), raw(pairs * inter), raw(pairs * hidden));
        let (tile, row_bytes) = affine_tile(up_cols);
        let (r, c, i, t) = (inter as i32, up_cols as i32, hidden as i32, tile as i32);
        let f = self.func(&format!("affine_gate_up_{suffix}"));
        let mut l = self.launcher(f);
        l.arg(&table_v)
            .arg(&rows_v)
            .arg(x)
            .arg(&mut gate)
            .arg(&mut up);
        l.arg(&r).arg(&c).arg(&i).arg(&t);
        let grid = LaunchConfig {
            grid_dim: (inter.div_ceil(AFFINE_WARPS) as u32, n_groups as u32, 2),
            block_dim: ((AFFINE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (tile * row_bytes) as u32,
        };
        ok(unsafe { l.launch(grid) }, "affine gate/up");

        let n = pairs * inter;
        let n64 = n as i64;
        let mut l = self.launcher(self.func("silu_mul"));
        l.arg(&mut gate).arg(&up).arg(&n64);
        self.launch_1d(l, n, "silu_mul");

        let (tile, row_bytes) = affine_tile(down_cols);
        let (r, c, i, t) = (hidden as i32, down_cols as i32, inter as i32, tile as i32);
        let f = self.func(&format!("affine_down_{suffix}"));
        let mut l = self.launcher(f);
        l.arg(&table_v).arg(&gate).arg(&mut down);
        l.arg(&r).arg(&c).arg(&i).arg(&t);
        let grid = LaunchConfig {
            grid_dim: (hidden.div_ceil(AFFINE_WARPS) as u32, n_groups as u32, 1),
            block_dim: ((AFFINE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (tile * row_bytes) as u32,
        };
        ok(unsafe { l.launch(grid) }, "affine down");

        let w = hidden as i32;
        let mut l = self.launcher(self.func("scatter_add_rows"));
        l.arg(&down).arg(&rows_v).arg(&scales_v).arg(out).arg(&w);
        ok(
            unsafe { l.launch(cfg(pairs, row_threads(hidden), 0)) },
            "scatter_add_rows",
        );
        drop(keep);
        rest
    }

    /// `out[rows, n] = x[rows, k] · w[n, k]ᵀ` for a bf16 `w` on tensor cores: x is split
    /// into bf16 hi and lo parts (`split_bf16`) and cuBLAS adds `w·hiᵀ` and `w·loᵀ` in
    /// f32, so x keeps about 16 bits where one bf16 rounding would keep 8; every product
    /// of a bf16 weight and a bf16 part is exact in f32.
    #[allow(clippy::too_many_arguments)]
    fn gemm_bf16_split<O: DevicePtrMut<f32>>(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u16>,
        rows: usize,
        k: usize,
        n: usize,
        out: &mut O,
    ) {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
        let len = rows * k;
        // Both parts in one f32 scratch, the lo part 256-byte aligned as cuBLAS prefers.
        let lo_at = (2 * len).next_multiple_of(256);
        let mut scratch = self.grown(&self.split_scratch, (lo_at + 2 * len).div_ceil(4));
        let base = scratch
            .as_mut()
            .expect("grown")
            .device_ptr_mut(&self.stream)
            .0;
        let (hi, lo) = (base, base + lo_at as u64);
        let n64 = len as i64;
        let mut l = self.launcher(self.func("split_bf16"));
        l.arg(x).arg(&hi).arg(&lo).arg(&n64);
        ok(
            unsafe { l.launch(cfg(blocks(len, 256).min(132 * 16) as usize, 256, 0)) },
            "split_bf16",
        );
        let wp = w.device_ptr(&self.stream).0;
        let op = out.device_ptr_mut(&self.stream).0;
        for (part, beta) in [(hi, 0.0f32), (lo, 1.0f32)] {
            let alpha = 1.0f32;
            // Column-major, as `gemm_xwt`: outᵀ (n × rows) = w (k × n, transposed) · part (k × rows).
            let r = unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    rows as i32,
                    k as i32,
                    (&alpha as *const f32).cast(),
                    wp as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_16BF,
                    k as i32,
                    part as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_16BF,
                    k as i32,
                    (&beta as *const f32).cast(),
                    op as *mut std::ffi::c_void,
                    cudaDataType::CUDA_R_32F,
                    n as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            ok(r, "cuBLAS bf16 GEMM");
        }
    }

    /// `out[rows, n] = x[rows, k] · w[n, :k]ᵀ` with `w` row-major of row stride `ldw`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_xwt<W: DevicePtr<f32>, O: DevicePtrMut<f32>>(
        &self,
        x: &CudaSlice<f32>,
        w: &W,
        rows: usize,
        k: usize,
        ldw: usize,
        n: usize,
        out: &mut O,
    ) {
        if rows == 0 || n == 0 {
            return;
        }
        // Column-major view: outᵀ (n × rows) = wᵀᵀ (n × k, from w seen as k × n with
        // leading dimension ldw, transposed) · xᵀ (k × rows).
        let g = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: rows as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: ldw as i32,
            ldb: k as i32,
            beta: 0.0f32,
            ldc: n as i32,
        };
        ok(unsafe { self.blas.gemm(g, w, x, out) }, "cuBLAS sgemm");
    }

    /// The device table of a block's experts, built (every expert copied to the device)
    /// the first time the block is routed here, with `top_k` experts a row, and again
    /// when its experts' layout does not suit the kernels that read a route of another
    /// `top_k` ([`experts_tiled`](Self::experts_tiled)); `None` when its experts are not affine
    /// matrices of one shape the routed kernels take.
    fn routed_block<'m>(
        &self,
        map: &'m mut HashMap<usize, RoutedBlock>,
        experts: &RoutedExperts<'_, DeviceMatrix>,
        hidden: usize,
        top_k: usize,
    ) -> Option<&'m mut RoutedBlock> {
        let check = routed_check(experts)?;
        let stale = |b: &RoutedBlock| {
            b.check != check
                || matches!(b.kind, RoutedKind::Affine(s) if s.tiled != self.experts_tiled(s, top_k))
        };
        if map.get(&experts.id).is_some_and(stale) {
            self.drop_graphs();
            map.remove(&experts.id);
        }
        match map.entry(experts.id) {
            std::collections::hash_map::Entry::Occupied(o) => Some(o.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => {
                Some(v.insert(self.build_routed(experts, hidden, top_k, check)?))
            }
        }
    }

    /// Whether a block of experts of `shape` (4 or 2 bits), `top_k` a row, is held in
    /// unit tiles, its only device copy: where every launch that may read it takes tiles
    /// — one to [`ROUTED_MAX_ROWS`] rows on the tensor-core routed kernels, more through
    /// the grouped GEMMs (the other routed kernels read rows). Measured +2.5% decode at 4
    /// bits and, at two units a round, +4.4% at 2 (docs/GPU_NOTES.md, fourteenth round).
    fn experts_tiled(&self, shape: RoutedShape, top_k: usize) -> bool {
        self.tiled_kernels_take(shape, top_k)
    }

    /// Whether every launch that may read experts of `shape`, `top_k` a row, has a tiled
    /// kernel: 4 or 2 bits, the tensor-core routed kernels and the grouped GEMMs.
    fn tiled_kernels_take(&self, shape: RoutedShape, top_k: usize) -> bool {
        matches!(shape.bits, 4 | 2) && self.tensor_cores() && self.routed_mma_takes(shape, top_k)
    }

    /// Copies every expert of a block to the device and tables their pointers: gate, up
    /// and down in turn, each as its codes, then its scales and biases (affine: in tiles,
    /// the tiles' scales and biases twice) or its norms and rotation sign bits (VQ).
    fn build_routed(
        &self,
        experts: &RoutedExperts<'_, DeviceMatrix>,
        hidden: usize,
        top_k: usize,
        check: RoutedCheck,
    ) -> Option<RoutedBlock> {
        let mut table = Vec::with_capacity(experts.count * ROUTED_ENTRY);
        let mut weights: Vec<Arc<dyn Send + Sync>> = Vec::with_capacity(experts.count * 3);
        let kind = match (experts.weights)(0) {
            [Weight::Affine(g), Weight::Affine(_), Weight::Affine(d)] => {
                let (bits, inter, up_cols, down_cols) = (g.bits, g.rows, g.cols, d.cols);
                let mut shape = RoutedShape::of(bits, inter, up_cols, down_cols, hidden)?;
                shape.tiled = self.experts_tiled(shape, top_k);
                for e in 0..experts.count {
                    let [Weight::Affine(g), Weight::Affine(u), Weight::Affine(d)] =
                        (experts.weights)(e)
                    else {
                        return None;
                    };
                    let same = |m: &AffineView<'_>, rows: usize, cols: usize| {
                        m.bits == bits && m.rows == rows && m.cols == cols
                    };
                    if !(same(&g, inter, up_cols)
                        && same(&u, inter, up_cols)
                        && same(&d, hidden, down_cols))
                    {
                        return None;
                    }
                    for m in [g, u, d] {
                        if shape.tiled {
                            let t = self.upload_tiles(&m);
                            let sb = t.sb.device_ptr(&self.stream).0;
                            table.extend([t.words.device_ptr(&self.stream).0, sb, sb]);
                            weights.push(Arc::new(t));
                        } else {
                            let dev = self.device_affine(&m, false);
                            table.extend(dev.rows.addresses(&self.stream));
                            weights.push(dev);
                        }
                    }
                }
                RoutedKind::Affine(shape)
            }
            [Weight::Vq(g), Weight::Vq(_), Weight::Vq(d)] => {
                let shape = VqRoutedShape::of(&g, &d, hidden, self.vq_routed_shared)?;
                let like = |m: &VqView<'_>, n: &VqView<'_>| {
                    (m.rung, m.rows, m.cols, m.block) == (n.rung, n.rows, n.cols, n.block)
                };
                for e in 0..experts.count {
                    let [Weight::Vq(eg), Weight::Vq(eu), Weight::Vq(ed)] = (experts.weights)(e)
                    else {
                        return None;
                    };
                    if !(like(&eg, &g) && like(&eu, &g) && like(&ed, &d)) {
                        return None;
                    }
                    for m in [eg, eu, ed] {
                        let dev = self.device_vq(&m);
                        table.push(dev.codes.device_ptr(&self.stream).0);
                        table.push(dev.norms.device_ptr(&self.stream).0);
                        table.push(dev.signs.device_ptr(&self.stream).0);
                        weights.push(dev);
                    }
                }
                RoutedKind::Vq(shape)
            }
            _ => return None,
        };
        Some(RoutedBlock {
            table: ok(self.stream.clone_htod(&table), "upload"),
            _weights: weights,
            check,
            kind,
            keep: None,
        })
    }

    /// Routes `rows` rows whose router logits are at device address `probs` (turned into
    /// probabilities there) and runs their experts: the route kernel, the gate/up and down
    /// launches reading the chosen experts through `r.table`, and the weighted combine into
    /// `out`. `x`, `probs` and `out` are device addresses of `[rows, …]` buffers.
    fn launch_routed(
        &self,
        r: &Routed<'_>,
        x: u64,
        rows: usize,
        hidden: usize,
        probs: u64,
        out: u64,
    ) {
        let shape = match r.kind {
            RoutedKind::Affine(shape) => shape,
            RoutedKind::Vq(shape) => {
                return self.launch_routed_vq(r, shape, x, rows, hidden, probs, out);
            }
        };
        if rows > ROUTED_MAX_ROWS
            && self.tensor_cores()
            && gemm_grid_fits(rows * r.route.top_k, r.experts)
        {
            self.launch_routed_gemm(r, shape, x, rows, hidden, probs, out);
            return;
        }
        let k = r.route.top_k;
        let (inter, pairs) = (shape.inter, rows * k);
        let [ids, weights, g, u, d] = self.routed_scratch_at(pairs, k, inter, hidden);

        let ki = k as i32;
        let suffix = bits_suffix(shape.bits);
        let up_units = shape.up_cols / 64;
        let down_units = k * (shape.down_cols / 64);
        if self.routed_mma_takes(shape, k) {
            // Up to ROUTE_SHARED_MAX experts each gate/up block routes its row itself, and
            // the down kernel writes the probabilities; beyond, the route kernel runs
            // first and `logits` is null.
            let logits = if r.experts <= ROUTE_SHARED_MAX {
                probs
            } else {
                self.launch_route(r, rows, probs, ids, weights);
                0u64
            };
            // Only right after the late router (no route kernel in between).
            let early = r.router_late && logits != 0;
            let (ei, rn) = (r.experts as i32, r.route.renormalize as i32);
            // With the router's fold, gate/up reads the residual through the same norm.
            let (x, delta, norm_w, eps) = match r.norm {
                Some((residual, n)) => (residual, n.delta, n.w, n.eps),
                None => (x, 0, 0, 0.0f32),
            };
            debug_assert!(r.norm.is_none() || (early && rows == 1));
            // Gate and up write silu(gate) ⊙ up per pair into `g`; down adds each row's
            // pairs, weighted, straight into `out`.
            let block = ((RMMA_WARPS * 32) as u32, 1, 1);
            let (ri, c, i) = (inter as i32, shape.up_cols as i32, hidden as i32);
            // The experts in unit tiles where the block has them.
            let (table, suffix) = (r.table, shape.kernels());
            let mut l = self.launcher(self.func(&format!("routed_mma_gate_up_{suffix}")));
            l.arg(&table).arg(&logits).arg(&r.keep).arg(&ei).arg(&rn);
            l.arg(&ids).arg(&weights).arg(&ki).arg(&x).arg(&g);
            l.arg(&ri).arg(&c).arg(&i).arg(&(early as i32));
            l.arg(&delta).arg(&norm_w).arg(&eps);
            // The flag only where a gate/up block writes the one row's route.
            let ready = if logits != 0 && rows == 1 {
                self.down_ready.device_ptr(&self.stream).0
            } else {
                0u64
            };
            l.arg(&ready);
            // With the norm, the row through it after the experts' pointers.
            let shared = if early {
                routed_mma_gate_up_shared(up_units, r.experts, r.norm.map_or(0, |_| hidden))
            } else {
                routed_mma_shared(up_units)
            };
            let gate_up = LaunchConfig {
                grid_dim: (inter.div_ceil(RMMA_ROWS) as u32, pairs as u32, 1),
                block_dim: block,
                shared_mem_bytes: shared as u32,
            };
            ok(
                unsafe { l.launch(gate_up) },
                "routed gate/up on tensor cores",
            );

            let (ri, c, i) = (hidden as i32, shape.down_cols as i32, inter as i32);
            let down_name = format!("routed_mma_down_{suffix}");
            let padding = self.down_padding(&down_name);
            let mut l = self.launcher(self.func(&down_name));
            l.arg(&table)
                .arg(&ids)
                .arg(&weights)
                .arg(&ki)
                .arg(&g)
                .arg(&out);
            l.arg(&ri).arg(&c).arg(&i).arg(&logits).arg(&ei).arg(&ready);
            let down = LaunchConfig {
                grid_dim: (hidden.div_ceil(RMMA_ROWS) as u32, rows as u32, 1),
                block_dim: ((RMMA_DOWN_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: routed_mma_shared(down_units).max(padding) as u32,
            };
            ok(unsafe { l.launch(down) }, "routed down on tensor cores");
            return;
        }
        // Experts in tiles are held so only where routed_mma_takes them (experts_tiled).
        assert!(
            !shape.tiled,
            "experts in tiles reached the row-major routed kernels"
        );
        self.launch_route(r, rows, probs, ids, weights);
        // A block per ROUTED_ROWS rows of each warp and per pair; `projections` in z.
        let grid = |out_rows: usize, cols: usize, projections: u32| LaunchConfig {
            grid_dim: (
                out_rows.div_ceil(AFFINE_WARPS * ROUTED_ROWS) as u32,
                pairs as u32,
                projections,
            ),
            block_dim: ((AFFINE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: routed_shared(cols) as u32,
        };
        let (ri, c, i) = (inter as i32, shape.up_cols as i32, hidden as i32);
        let f = self.func(&format!("affine_routed_gate_up_{suffix}"));
        let mut l = self.launcher(f);
        l.arg(&r.table).arg(&ids).arg(&ki).arg(&x).arg(&g).arg(&u);
        l.arg(&ri).arg(&c).arg(&i);
        let gate_up = grid(inter, shape.up_cols, 2);
        ok(unsafe { l.launch(gate_up) }, "routed gate/up");

        let (ri, c, i) = (hidden as i32, shape.down_cols as i32, inter as i32);
        let f = self.func(&format!("affine_routed_down_{suffix}"));
        let mut l = self.launcher(f);
        l.arg(&r.table).arg(&ids).arg(&ki).arg(&g).arg(&u).arg(&d);
        l.arg(&ri).arg(&c).arg(&i);
        let down = grid(hidden, shape.down_cols, 1);
        ok(unsafe { l.launch(down) }, "routed down");

        let (w, n) = (hidden as i32, (rows * hidden) as i64);
        let mut l = self.launcher(self.func("moe_combine"));
        l.arg(&d).arg(&weights).arg(&out).arg(&ki).arg(&w).arg(&n);
        self.launch_1d(l, rows * hidden, "moe_combine");
    }

    /// Device addresses of the intermediates of routing `pairs` pairs (`top_k` a row):
    /// expert ids, weights, then gate, up and down outputs, carved from one scratch
    /// buffer, each on 16 bytes for the kernels' float4 loads. The buffer is sized for at
    /// least the most rows a decode step routes, so that it is not replaced (under a
    /// recorded step) when a call with more rows follows; a larger call replaces it, which
    /// the single stream orders after every launch that read the old one.
    fn routed_scratch_at(
        &self,
        pairs: usize,
        top_k: usize,
        inter: usize,
        hidden: usize,
    ) -> [u64; 5] {
        let pad = |n: usize| n.next_multiple_of(4);
        let size = |pairs: usize| 2 * pad(pairs) + 2 * pad(pairs * inter) + pairs * hidden;
        let mut scratch = self.routed_scratch.lock().expect("scratch lock");
        if scratch.as_ref().is_none_or(|s| s.len() < size(pairs)) {
            self.drop_graphs();
            let n = size(pairs.max(ROUTED_MAX_ROWS * top_k));
            *scratch = Some(ok(unsafe { self.stream.alloc::<f32>(n) }, "alloc"));
        }
        let base = scratch
            .as_ref()
            .expect("set above")
            .device_ptr(&self.stream)
            .0;
        let at = |floats: usize| base + 4 * floats as u64;
        let h = 2 * pad(pairs);
        [
            at(0),
            at(pad(pairs)),
            at(h),
            at(h + pad(pairs * inter)),
            at(h + 2 * pad(pairs * inter)),
        ]
    }

    /// [`launch_routed`](Self::launch_routed) for experts at a VQ rung: the route kernel,
    /// then gate and up with the SiLU into the scratch, then down with each row's pairs
    /// added, weighted, in order, into `out`. Every matrix has its own rotation seed: in a
    /// decode step each block rotates the activations it reads itself (a launch fewer);
    /// for a prompt `routed_vq_rotate` rotates each pair's once, for every block of its
    /// products to read. A prompt whose codewords make whole tensor-core fragments takes
    /// the grouped GEMMs instead ([`launch_routed_vq_gemm`](Self::launch_routed_vq_gemm)).
    /// At most 65 535 pairs (the grid's second dimension): callers go through
    /// [`launch_routed_chunks`](Self::launch_routed_chunks).
    #[allow(clippy::too_many_arguments)]
    fn launch_routed_vq(
        &self,
        r: &Routed<'_>,
        shape: VqRoutedShape,
        x: u64,
        rows: usize,
        hidden: usize,
        probs: u64,
        out: u64,
    ) {
        let k = r.route.top_k;
        let (inter, pairs) = (shape.inter, rows * k);
        if rows > ROUTED_MAX_ROWS
            && self.tensor_cores()
            && shape.on_tensor_cores()
            && gemm_grid_fits(pairs, r.experts)
        {
            self.launch_routed_vq_gemm(r, shape, x, rows, hidden, probs, out);
            return;
        }
        let [ids, weights, h, ..] = self.routed_scratch_at(pairs, k, inter, hidden);
        self.launch_route(r, rows, probs, ids, weights);
        let book = self.vq_book(shape.rung);
        let (ki, ri, hi) = (k as i32, inter as i32, hidden as i32);
        let bits = shape.rung.index_bits as i32;
        let block = ((VQR_WARPS * 32) as u32, 1, 1);
        // A decode step's products run on tensor cores where the codewords make whole
        // fragments (`routed_vq_*_mma`), else on CUDA cores (`routed_vq_*`, which also
        // take a prompt's pairs at rungs the grouped GEMMs do not).
        let decode = rows <= ROUTED_MAX_ROWS;
        let mma = decode
            && self.tensor_cores()
            && shape.on_tensor_cores()
            && shape.mma_gate_up_shared().max(shape.mma_down_shared(k)) <= self.vq_routed_shared;
        let suffix = format!(
            "{}{}",
            if mma { "mma_" } else { "" },
            vq_suffix(shape.rung.dim)
        );
        // A prompt's pairs rotated: [pairs, 2, up_width] for gate and up, then
        // [pairs, down_width] for down. Null in a decode step.
        let mut rotated = (!decode).then(|| self.rotated_pairs(shape, pairs));
        let (xr, hr) = match rotated.as_mut() {
            Some(buf) => self.rotated_at(buf, shape, pairs),
            None => (0u64, 0u64),
        };
        if xr != 0 {
            self.launch_pair_rotation(r, ids, pairs, x, false, xr, hidden, shape.up_block);
        }
        // In a decode step the book goes into shared memory beside the activations when
        // both fit. Not for a prompt: its thousands of blocks would each copy it (at 512
        // rows that took 14.9 ms a layer against 9.3 through L1).
        let book_bytes = vq_book_bytes(shape.rung);
        let with_book = |activations: usize| {
            let shared = decode
                && book_bytes <= VQR_SHARED_BOOK
                && book_bytes + activations <= self.vq_routed_shared;
            (
                shared as i32,
                activations + if shared { book_bytes } else { 0 },
            )
        };
        let (up_rows, up_shared, down_rows, down_shared) = if mma {
            let (up, down) = (shape.mma_gate_up_shared(), shape.mma_down_shared(k));
            (VQM_TILES * 16, up, 16, down)
        } else {
            let (up, down) = (shape.gate_up_shared(), shape.down_shared(k));
            (
                VQR_WARPS * VQR_GATE_UP_ROWS,
                up,
                VQR_WARPS * VQR_DOWN_ROWS,
                down,
            )
        };
        let (b, rb) = (shape.up_block as i32, row_bytes(shape.rung, hidden) as u64);
        let (book_shared, bytes) = with_book(up_shared);
        let mut l = self.launcher(self.func(&format!("routed_vq_gate_up_{suffix}")));
        l.arg(&r.table).arg(&ids).arg(&ki).arg(&x);
        if !mma {
            l.arg(&xr);
        }
        l.arg(&h);
        l.arg(&ri).arg(&hi).arg(&*book).arg(&bits).arg(&b).arg(&rb);
        l.arg(&book_shared);
        let gate_up = LaunchConfig {
            grid_dim: (inter.div_ceil(up_rows) as u32, pairs as u32, 1),
            block_dim: block,
            shared_mem_bytes: bytes as u32,
        };
        ok(unsafe { l.launch(gate_up) }, "routed VQ gate/up");

        if hr != 0 {
            self.launch_pair_rotation(r, ids, pairs, h, true, hr, inter, shape.down_block);
        }
        let (b, rb) = (shape.down_block as i32, row_bytes(shape.rung, inter) as u64);
        let mut l = self.launcher(self.func(&format!("routed_vq_down_{suffix}")));
        l.arg(&r.table).arg(&ids).arg(&weights).arg(&ki).arg(&h);
        if !mma {
            l.arg(&hr);
        }
        l.arg(&out);
        l.arg(&hi).arg(&ri).arg(&*book).arg(&bits).arg(&b).arg(&rb);
        let (book_shared, bytes) = with_book(down_shared);
        l.arg(&book_shared);
        let down = LaunchConfig {
            grid_dim: (hidden.div_ceil(down_rows) as u32, rows as u32, 1),
            block_dim: block,
            shared_mem_bytes: bytes as u32,
        };
        ok(unsafe { l.launch(down) }, "routed VQ down");
    }

    /// The buffer for a prompt's `pairs` pairs rotated for gate and up, then for down.
    fn rotated_pairs(
        &self,
        shape: VqRoutedShape,
        pairs: usize,
    ) -> MutexGuard<'_, Option<CudaSlice<f32>>> {
        let n = pairs * (2 * shape.up_width() + shape.down_width());
        self.grown(&self.vq_scratch, n)
    }

    /// Device addresses of the gate/up inputs (`[pairs, 2, up_width]`) and the down
    /// inputs (`[pairs, down_width]`) in a [`rotated_pairs`](Self::rotated_pairs) buffer.
    fn rotated_at(
        &self,
        buf: &mut Option<CudaSlice<f32>>,
        shape: VqRoutedShape,
        pairs: usize,
    ) -> (u64, u64) {
        let at = buf.as_mut().expect("grown").device_ptr_mut(&self.stream).0;
        (at, at + 4 * (pairs * 2 * shape.up_width()) as u64)
    }

    /// Rotates each of `pairs` pairs' row of `src` (row pair / top_k, or row pair with
    /// `by_pair`) with its expert's seeds (`ids` a pair) into `dst`: for gate and up,
    /// `[pairs, 2, width]`, or with `by_pair` for down, `[pairs, width]`.
    #[allow(clippy::too_many_arguments)]
    fn launch_pair_rotation(
        &self,
        r: &Routed<'_>,
        ids: u64,
        pairs: usize,
        src: u64,
        by_pair: bool,
        dst: u64,
        cols: usize,
        block: usize,
    ) {
        let mats = if by_pair { 1 } else { 2 };
        let chunks = mats * cols.div_ceil(block);
        let (first, by) = if by_pair { (2i32, 1i32) } else { (0, 0) };
        let (ki, ci, bi, mi) = (r.route.top_k as i32, cols as i32, block as i32, mats as i32);
        let mut l = self.launcher(self.func("routed_vq_rotate"));
        l.arg(&r.table)
            .arg(&ids)
            .arg(&ki)
            .arg(&src)
            .arg(&by)
            .arg(&dst);
        l.arg(&ci).arg(&bi).arg(&mi).arg(&first);
        let launch = LaunchConfig {
            grid_dim: (chunks.div_ceil(VQR_WARPS) as u32, pairs as u32, 1),
            block_dim: ((VQR_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        ok(unsafe { l.launch(launch) }, "routed VQ rotation");
    }

    /// [`launch_routed_vq`](Self::launch_routed_vq) for a prompt, on tensor cores: the
    /// pairs grouped by expert ([`group_pairs`](Self::group_pairs)), each pair's row
    /// rotated for gate and up, the grouped gate/up GEMM with the SiLU into `h` (pair
    /// order), `h` rotated for down, and the grouped down GEMM adding each pair's weighted
    /// output into its row of `out` (zeroed first).
    #[allow(clippy::too_many_arguments)]
    fn launch_routed_vq_gemm(
        &self,
        r: &Routed<'_>,
        shape: VqRoutedShape,
        x: u64,
        rows: usize,
        hidden: usize,
        probs: u64,
        out: u64,
    ) {
        let inter = shape.inter;
        let pairs = rows * r.route.top_k;
        let groups = self.group_pairs(r, rows, probs, true);
        let at = |b: &CudaSlice<u32>| b.device_ptr(&self.stream).0;
        let (ids, pair_ids) = (at(&groups.ids), groups.pair_ids.as_ref().map_or(0, at));
        let (table, tiles, tiles_n) = (
            groups.table.device_ptr(&self.stream).0,
            at(&groups.tiles),
            at(&groups.tiles_n),
        );
        let mut rotated = self.rotated_pairs(shape, pairs);
        let (xr, hr) = self.rotated_at(&mut rotated, shape, pairs);
        let h = ok(unsafe { self.stream.alloc::<f32>(pairs * inter) }, "alloc");
        let h_at = h.device_ptr(&self.stream).0;

        let book = self.vq_book(shape.rung);
        let book_bytes = vq_book_bytes(shape.rung);
        let suffix = vq_suffix(shape.rung.dim);
        let bits = shape.rung.index_bits as i32;
        // The book goes into shared memory beside the staged tiles when both fit.
        let with_book = |tiles: usize| {
            let shared = book_bytes + tiles <= self.vq_routed_shared;
            (shared as i32, tiles + if shared { book_bytes } else { 0 })
        };
        let launch = |outputs: usize, per_block: usize, shared: usize| LaunchConfig {
            grid_dim: (
                outputs.div_ceil(per_block) as u32,
                groups.most_tiles as u32,
                1,
            ),
            block_dim: ((VQG_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };

        self.launch_pair_rotation(r, ids, pairs, x, false, xr, hidden, shape.up_block);
        let (ri, wi, bi) = (inter as i32, shape.up_width() as i32, shape.up_block as i32);
        let rb = row_bytes(shape.rung, hidden) as u64;
        let (book_shared, bytes) = with_book(vq_gemm_shared(2));
        let mut l = self.launcher(self.func(&format!("vq_expert_mma_gate_up_{suffix}")));
        l.arg(&table).arg(&tiles).arg(&tiles_n).arg(&pair_ids);
        l.arg(&xr).arg(&h_at).arg(&ri).arg(&wi);
        l.arg(&*book).arg(&bits).arg(&bi).arg(&rb).arg(&book_shared);
        ok(
            unsafe { l.launch(launch(inter, VQG_GATE_UP_OUTPUTS, bytes)) },
            "VQ expert gate/up GEMM",
        );

        self.launch_pair_rotation(r, ids, pairs, h_at, true, hr, inter, shape.down_block);
        self.fill_at(out, 0.0, rows * hidden);
        let (ri, wi, bi) = (
            hidden as i32,
            shape.down_width() as i32,
            shape.down_block as i32,
        );
        let rb = row_bytes(shape.rung, inter) as u64;
        let (book_shared, bytes) = with_book(vq_gemm_shared(1));
        let (pair_rows, pair_weights) = (at(&groups.pair_rows), at(&groups.pair_weights));
        let mut l = self.launcher(self.func(&format!("vq_expert_mma_down_{suffix}")));
        l.arg(&table).arg(&tiles).arg(&tiles_n).arg(&pair_ids);
        l.arg(&pair_rows).arg(&pair_weights).arg(&hr).arg(&out);
        l.arg(&ri).arg(&wi);
        l.arg(&*book).arg(&bits).arg(&bi).arg(&rb).arg(&book_shared);
        ok(
            unsafe { l.launch(launch(hidden, VQG_DOWN_OUTPUTS, bytes)) },
            "VQ expert down GEMM",
        );
    }

    /// [`launch_routed`](Self::launch_routed) over `rows` rows in chunks that keep the
    /// grid (a block row per pair) within bounds; `probs` holds `experts` values a row.
    #[allow(clippy::too_many_arguments)]
    fn launch_routed_chunks(
        &self,
        r: &Routed<'_>,
        x: u64,
        rows: usize,
        hidden: usize,
        probs: u64,
        out: u64,
    ) {
        let chunk = (ROUTED_CHUNK_PAIRS / r.route.top_k).max(1);
        for r0 in (0..rows).step_by(chunk) {
            let n = chunk.min(rows - r0);
            let f = |at: u64, width: usize| at + 4 * (r0 * width) as u64;
            self.launch_routed(
                r,
                f(x, hidden),
                n,
                hidden,
                f(probs, r.experts),
                f(out, hidden),
            );
        }
    }

    /// Whether the router of `r` folds in the norm of its input row and the routed
    /// gate/up after it reads the row through the same norm (`matvec_bf16_norm_one_late`,
    /// then the early gate/up): where the gate/up kernel starts early (so the row is whole
    /// 8s) and gate/up's shared memory holds the row too (then so does the router's).
    fn router_folds_norm(
        &self,
        r: &Routed<'_>,
        gate: &DeviceMatrix,
        rows: usize,
        hidden: usize,
    ) -> bool {
        let RoutedKind::Affine(shape) = r.kind else {
            return false;
        };
        self.routes_gate_up_early(r, gate, rows, hidden)
            && routed_mma_gate_up_shared(shape.up_cols / 64, r.experts, hidden) <= SHARED_LIMIT
    }

    /// The row a routed block reads for `input` (with the fold, the normed row is not
    /// written: the router and gate/up read the residual through the norm in `r.norm`);
    /// otherwise the norm runs here first.
    fn moe_input<'x, 'r>(
        &self,
        input: MoeInput<'x, CudaSlice<f32>>,
        r: Routed<'r>,
        rows: usize,
        hidden: usize,
        gate: &DeviceMatrix,
    ) -> (&'x CudaSlice<f32>, Routed<'r>) {
        match input {
            MoeInput::Rows(x) => (x, r),
            MoeInput::AddNorm { n, sum, xn } if self.router_folds_norm(&r, gate, rows, hidden) => {
                let norm = self.input_norm(n, sum);
                let residual = n.x.device_ptr(&self.stream).0;
                (
                    xn,
                    Routed {
                        norm: Some((residual, norm)),
                        ..r
                    },
                )
            }
            MoeInput::AddNorm { n, sum, xn } => {
                self.add_rms_norm_to(n, rows, hidden, sum, xn);
                (xn, r)
            }
        }
    }

    /// The router's logits of `x` (`rows` rows of `hidden`) into `logits` (the
    /// probabilities' slot); with `r.norm` (from [`moe_input`](Self::moe_input)), of the
    /// residual through the norm it folds in. The returned `Routed` says whether the router
    /// was a late kernel, after which the routed gate/up may start early.
    #[allow(clippy::too_many_arguments)]
    fn launch_router<'r>(
        &self,
        r: Routed<'r>,
        gate: &DeviceMatrix,
        x: &CudaSlice<f32>,
        rows: usize,
        hidden: usize,
        logits: &mut CudaViewMut<'_, f32>,
    ) -> Routed<'r> {
        let e = r.experts;
        if let (Some((residual, n)), DeviceMatrix::Bf16(w)) = (r.norm, gate) {
            // The row through the norm, staged in shared memory.
            let (_, launch) = bf16_matvec(false, 1, hidden, e);
            let launch = LaunchConfig {
                shared_mem_bytes: (hidden * 4) as u32,
                ..launch
            };
            let (ei, ci) = (e as i32, hidden as i32);
            let mut l = self.launcher(self.func("matvec_bf16_norm_one_late"));
            l.arg(w).arg(&residual).arg(&n.delta).arg(&n.w).arg(&n.eps);
            l.arg(&n.sum).arg(logits).arg(&ei).arg(&ci);
            ok(unsafe { l.launch(launch) }, "matvec_bf16_norm_one_late");
            return Routed {
                router_late: true,
                ..r
            };
        }
        if let DeviceMatrix::Bf16(w) = gate {
            if self.routes_gate_up_early(&r, gate, rows, hidden) {
                let (_, launch) = bf16_matvec(false, 1, hidden, e);
                let (ei, ci, one) = (e as i32, hidden as i32, 1i32);
                let mut l = self.launcher(self.func("matvec_bf16_one_late"));
                l.arg(w).arg(x).arg(logits).arg(&ei).arg(&ci).arg(&one);
                ok(unsafe { l.launch(launch) }, "matvec_bf16_one_late");
                return Routed {
                    router_late: true,
                    ..r
                };
            }
        }
        self.dense_product(x, gate, rows, hidden, e, logits);
        r
    }

    /// The route of `rows` rows: router probabilities (in place of the logits at `probs`)
    /// and each row's top-k expert ids and weights.
    fn launch_route(&self, r: &Routed<'_>, rows: usize, probs: u64, ids: u64, weights: u64) {
        let e = r.experts;
        let (ei, ki, rn) = (e as i32, r.route.top_k as i32, r.route.renormalize as i32);
        // A block a row, a thread per expert up to 256 of them.
        let launch = cfg(rows, row_threads(e), e * 4);
        let mut l = self.launcher(self.func("moe_route"));
        l.arg(&probs)
            .arg(&r.keep)
            .arg(&ids)
            .arg(&weights)
            .arg(&ei)
            .arg(&ki)
            .arg(&rn);
        ok(unsafe { l.launch(launch) }, "moe_route");
    }

    /// [`launch_routed`](Self::launch_routed) for a prompt, on tensor cores and with no
    /// host round trip: the route and the pairs grouped by expert on the device
    /// ([`group_pairs`](Self::group_pairs)), then the grouped GEMMs over a grid sized for
    /// the most tiles there could be (the kernels read the count). `out` is zeroed and the
    /// down GEMM adds each pair's weighted output into its row.
    #[allow(clippy::too_many_arguments)]
    fn launch_routed_gemm(
        &self,
        r: &Routed<'_>,
        shape: RoutedShape,
        x: u64,
        rows: usize,
        hidden: usize,
        probs: u64,
        out: u64,
    ) {
        let pairs = rows * r.route.top_k;
        let groups = self.group_pairs(r, rows, probs, false);
        let h = ok(
            unsafe { self.stream.alloc::<f32>(pairs * shape.inter) },
            "alloc",
        );
        let at = |b: &CudaSlice<u32>| b.device_ptr(&self.stream).0;
        self.fill_at(out, 0.0, rows * hidden);
        self.launch_expert_gemms(&ExpertGemms {
            kernels: shape.kernels(),
            table: groups.table.device_ptr(&self.stream).0,
            tiles: at(&groups.tiles),
            grid_tiles: groups.most_tiles,
            tiles_n: at(&groups.tiles_n),
            pair_rows: at(&groups.pair_rows),
            pair_weights: at(&groups.pair_weights),
            x,
            h: h.device_ptr(&self.stream).0,
            out,
            hidden,
            inter: shape.inter,
            up_cols: shape.up_cols,
            down_cols: shape.down_cols,
        });
    }

    /// Routes `rows` rows (`moe_route`) and groups their pairs by expert on the device
    /// (`moe_group_pairs`), with each grouped pair's own index when `with_ids`.
    fn group_pairs(&self, r: &Routed<'_>, rows: usize, probs: u64, with_ids: bool) -> PairGroups {
        let (e, k) = (r.experts, r.route.top_k);
        let pairs = rows * k;
        let most_tiles = pairs / EXPERT_TILE_ROWS + e;
        let words = |n: usize| ok(unsafe { self.stream.alloc::<u32>(n.max(1)) }, "alloc");
        let g = PairGroups {
            ids: words(pairs),
            weights: words(pairs),
            table: ok(
                unsafe { self.stream.alloc::<u64>(e * GROUP_ENTRY) },
                "alloc",
            ),
            pair_rows: words(pairs),
            pair_weights: words(pairs),
            pair_ids: with_ids.then(|| words(pairs)),
            tiles: words(2 * most_tiles),
            tiles_n: words(1),
            most_tiles,
        };
        let at = |b: &CudaSlice<u32>| b.device_ptr(&self.stream).0;
        self.launch_route(r, rows, probs, at(&g.ids), at(&g.weights));
        let (pi, ki, ei) = (pairs as i32, k as i32, e as i32);
        let pair_ids = g.pair_ids.as_ref().map_or(0u64, at);
        let mut l = self.launcher(self.func("moe_group_pairs"));
        l.arg(&g.ids).arg(&g.weights).arg(&pi).arg(&ki).arg(&ei);
        l.arg(&r.table)
            .arg(&g.table)
            .arg(&g.pair_rows)
            .arg(&g.pair_weights)
            .arg(&pair_ids);
        l.arg(&g.tiles).arg(&g.tiles_n);
        ok(
            unsafe { l.launch(cfg(1, 1024, 3 * 4 * e)) },
            "moe_group_pairs",
        );
        g
    }

    /// The two grouped expert GEMMs over `g.grid_tiles` pair tiles: gate and up with the
    /// SiLU into `h`, then down with each pair's weighted output added into its row of
    /// `out`.
    fn launch_expert_gemms(&self, g: &ExpertGemms) {
        let suffix = &g.kernels;
        let grid = |outputs: usize| LaunchConfig {
            grid_dim: (
                outputs.div_ceil(EXPERT_TILE_OUTPUTS) as u32,
                g.grid_tiles as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ri, c, i) = (g.inter as i32, g.up_cols as i32, g.hidden as i32);
        let mut l = self.launcher(self.func(&format!("expert_mma_gate_up_{suffix}")));
        l.arg(&g.table)
            .arg(&g.tiles)
            .arg(&g.tiles_n)
            .arg(&g.pair_rows)
            .arg(&g.x)
            .arg(&g.h);
        l.arg(&ri).arg(&c).arg(&i);
        ok(unsafe { l.launch(grid(g.inter)) }, "expert gate/up GEMM");
        let (ri, c, i) = (g.hidden as i32, g.down_cols as i32, g.inter as i32);
        let mut l = self.launcher(self.func(&format!("expert_mma_down_{suffix}")));
        l.arg(&g.table)
            .arg(&g.tiles)
            .arg(&g.tiles_n)
            .arg(&g.pair_rows)
            .arg(&g.pair_weights);
        l.arg(&g.h).arg(&g.out);
        l.arg(&ri).arg(&c).arg(&i);
        ok(unsafe { l.launch(grid(g.hidden)) }, "expert down GEMM");
    }

    /// [`bf16_matvec`] for a dense layer's product; a one-row kernel is noted for
    /// [`down_padding`](Cuda::down_padding).
    fn dense_bf16_matvec(
        &self,
        three: bool,
        rows: usize,
        cols: usize,
        out_rows: usize,
    ) -> (&'static str, LaunchConfig) {
        let (name, launch) = bf16_matvec(three, rows, cols, out_rows);
        if name.ends_with("_one") && !self.bf16_one_row_dense.swap(true, Ordering::Relaxed) {
            self.unpad_down_blocks();
        }
        (name, launch)
    }

    /// Once a one-row bf16 dense product has run ([`Cuda::down_padding`]): the routed
    /// kernels that [`down_alone`] had prefer all shared memory leave the split to the
    /// driver again, as they would had they never been padded. Set on the functions, so
    /// every later launch and recorded graph takes it.
    fn unpad_down_blocks(&self) {
        for (down, _) in &self.down_alone {
            for n in split_pair(down) {
                ok(leave_split_to_driver(self.func(&n)), "a kernel's carveout");
            }
        }
    }

    /// The shared memory a routed down block of kernel `name` asks for beyond its own
    /// ([`down_alone`]). None once a dense product has run on a one-row bf16 kernel: those prefer L1 to shared memory, an SM changes its split only while idle,
    /// and a padded block then waits for its SM to empty. Measured on the H200 (12-layer
    /// Qwen3-30B-A3B shape, bf16 dense layers, 2 bits): 1 205.6 tok/s padded against
    /// 1 240.1 unpadded; padded with every kernel preferring all shared memory, 1 180.8.
    /// Dense layers in tiles run on kernels that leave the split alone, and the padding
    /// pays there. A decode step runs its attention products before its first MoE block,
    /// so the graph it records has the choice made. The preference for shared memory that
    /// the padded kernels were given at load goes at the same time
    /// ([`Cuda::unpad_down_blocks`]): kept, it left 2 bits 1.8% below no padding at all
    /// there, in one run; given up, level (1 331.4 against 1 330.8 tok/s). A bf16 LM head counts as a dense product too, so q4 dense layers
    /// under a bf16 head run unpadded once it has run.
    fn down_padding(&self, name: &str) -> usize {
        if self.bf16_one_row_dense.load(Ordering::Relaxed) {
            return 0;
        }
        self.down_alone
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |p| p.1)
    }

    /// [`Backend::matmul`] into any device buffer: the matrix-vector kernel for a few
    /// rows (cuBLAS' GEMM runs far under bandwidth there, and keeps cuBLAS out of a
    /// recorded decode step), cuBLAS otherwise, a bf16 matrix widened to f32 first.
    fn dense_product<O: DevicePtrMut<f32>>(
        &self,
        x: &CudaSlice<f32>,
        w: &DeviceMatrix,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: &mut O,
    ) {
        if rows == 0 || out_dim == 0 {
            return;
        }
        let (r, c, b) = (out_dim as i32, in_dim as i32, rows as i32);
        let matvec = cfg(out_dim.div_ceil(8), 256, 0);
        match w {
            DeviceMatrix::F32(w) if rows <= MATVEC_MAX_BATCH && in_dim.is_multiple_of(4) => {
                let o = out.device_ptr_mut(&self.stream).0;
                let mut l = self.launcher(self.func("matvec_f32"));
                l.arg(w).arg(x).arg(&o).arg(&r).arg(&c).arg(&b);
                ok(unsafe { l.launch(matvec) }, "matvec_f32");
            }
            DeviceMatrix::F32(w) => self.gemm_xwt(x, w, rows, in_dim, in_dim, out_dim, out),
            // Any width: the kernel falls back to one value per lane off whole 8s.
            DeviceMatrix::Bf16(w) if rows <= MATVEC_MAX_BATCH => {
                let o = out.device_ptr_mut(&self.stream).0;
                let (name, launch) = self.dense_bf16_matvec(false, rows, in_dim, out_dim);
                let mut l = self.launcher(self.func(name));
                l.arg(w).arg(x).arg(&o).arg(&r).arg(&c).arg(&b);
                ok(unsafe { l.launch(launch) }, "matvec_bf16");
            }
            DeviceMatrix::Bf16(w) if self.tensor_cores() => {
                self.gemm_bf16_split(x, w, rows, in_dim, out_dim, out)
            }
            DeviceMatrix::Bf16(w) => {
                let n = out_dim * in_dim;
                let mut scratch = self.grown(&self.dense_scratch, n);
                let wide = scratch.as_mut().expect("grown");
                let n64 = n as i64;
                let mut l = self.launcher(self.func("bf16_to_f32"));
                l.arg(w).arg(&mut *wide).arg(&n64);
                ok(
                    unsafe { l.launch(cfg(blocks(n, 256).min(132 * 16) as usize, 256, 0)) },
                    "bf16_to_f32",
                );
                self.gemm_xwt(x, &*wide, rows, in_dim, in_dim, out_dim, out);
            }
        }
    }

    /// The preamble of a one-row decode step; with `late`, the kernel lets the next one
    /// start only after its own wait (see `attn_preamble_at`). False when it went through
    /// the single ops instead (no kernel of its own, so nothing for `late` to promise).
    #[allow(clippy::too_many_arguments)]
    fn preamble_at(
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
        late: bool,
    ) -> bool {
        let (heads, kv_heads, d) = (shape.heads, shape.kv_heads, shape.head_dim);
        let half = d / 2;
        let threads = half.next_multiple_of(32).clamp(32, 256);
        // A head the kernel's registers cannot hold (or an odd width, whose last value
        // RoPE leaves alone) goes through the single ops.
        if d % 2 != 0 || half > PRE_PAIRS * threads || heads == 0 || kv_heads == 0 {
            attention_preamble_one_by_one(
                self, q, k, v, norm, shape, inv_freq, step, k_cache, v_cache,
            );
            return false;
        }
        let freq = self.constant(inv_freq);
        let pos = step.slice(1..2);
        let null = 0u64;
        let eps = norm.map_or(0.0, |n| n.eps);
        let (h, kvh, hd) = (heads as i32, kv_heads as i32, d as i32);
        let mut l = self.launcher(self.func("attn_preamble_at"));
        l.arg(q).arg(k).arg(v);
        match &norm {
            Some(n) => l.arg(n.q).arg(n.k),
            None => l.arg(&null).arg(&null),
        };
        l.arg(&eps)
            .arg(&pos)
            .arg(&*freq)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&h)
            .arg(&kvh)
            .arg(&hd)
            .arg(&(late as i32));
        ok(
            unsafe { l.launch(cfg(heads + 2 * kv_heads, threads as u32, 0)) },
            "attn_preamble_at",
        );
        true
    }

    /// Attention of a decode step's one row at the position in `step`; `early`: the
    /// kernel before is the preamble with `late` (see `attention_group`).
    #[allow(clippy::too_many_arguments)]
    fn attention_row_at(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        shape: AttentionShape,
        step: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        early: bool,
    ) {
        assert!(
            shape.head_dim <= 256,
            "head_dim {} over the attention kernel's 256",
            shape.head_dim
        );
        let at = step.slice(1..2).device_ptr(&self.stream).0;
        self.attention_one_row(q, k_cache, v_cache, shape, at, out, early);
    }

    /// Attention of one query row (position `pos0`, or the `u32` at device address
    /// `pos_at` when non-zero) with the keys cut into chunks, then merged: one block per
    /// head would walk the whole context alone. A block per (KV head, chunk) where the head
    /// width allows (it reads each K and V row once for the heads that share it: 14% faster
    /// decode than a block per query head, docs/GPU_NOTES.md), else a block per (head,
    /// chunk). The chunks follow the cache's capacity, not the position, so a recorded step
    /// stays valid.
    fn attention_one_row(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        shape: AttentionShape,
        pos_at: u64,
        out: &mut CudaSlice<f32>,
        early: bool,
    ) {
        let kvw = shape.kv_heads * shape.head_dim;
        let capacity = (k_cache.len() / kvw).max(1);
        let group = shape.heads / shape.kv_heads;
        let tiles = group.div_ceil(ATT_GROUP);
        // The grouped kernel's float4 rows need 16-byte addresses: q and the caches are
        // whole allocations (256-byte aligned), so a head width of 4s gives them.
        let grouped = group_kernel(shape.head_dim);
        let (chunk, blocks_x, name, threads) = match grouped {
            Some(name) => (
                group_chunk(capacity, shape.kv_heads * tiles, self.sms),
                shape.kv_heads * tiles,
                name,
                ATT_THREADS,
            ),
            None => (
                capacity.div_ceil(128).clamp(64, 1024),
                shape.heads,
                "attention_split",
                128,
            ),
        };
        let splits = capacity.div_ceil(chunk);
        // The merge reads the outputs ([heads, splits, head_dim]) and then (max, sum)
        // ([heads, splits, 2]) from one buffer.
        let outputs = shape.heads * splits * shape.head_dim;
        let mut scratch = self.grown(&self.attn_scratch, outputs + shape.heads * splits * 2);
        let part = scratch.as_mut().expect("grown");
        let (mut acc, mut ml) = part.split_at_mut(outputs);
        let (p0, h, kvh, d) = (
            shape.pos0 as i32,
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
        );
        let window = shape.window.map_or(0, |w| w as i32);
        let c = chunk as i32;
        let grid = LaunchConfig {
            grid_dim: (blocks_x as u32, splits as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // The grouped kernel ends with whether it may load early.
        let early = grouped.map(|_| early as i32);
        let mut l = self.launcher(self.func(name));
        l.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&mut acc)
            .arg(&mut ml)
            .arg(&p0)
            .arg(&h)
            .arg(&kvh)
            .arg(&d)
            .arg(&window)
            .arg(&pos_at)
            .arg(&c);
        if let Some(e) = &early {
            l.arg(e);
        }
        ok(unsafe { l.launch(grid) }, name);
        drop(l);
        let n = splits as i32;
        let mut l = self.launcher(self.func("attention_combine"));
        l.arg(&mut acc).arg(&mut ml).arg(out).arg(&n).arg(&d);
        ok(
            unsafe { l.launch(cfg(shape.heads, COMBINE_THREADS, 0)) },
            "attention_combine",
        );
    }

    /// Attention of several rows by `attention_tiled_*` (`name`): a block per KV head and
    /// pair of tiles of 64 query slots, one from each end (see the kernel). q, the caches
    /// and out are whole allocations (256-byte aligned) and the head width a multiple of 4,
    /// so their rows are float4s.
    fn attention_tiled(
        &self,
        name: &str,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        shape: AttentionShape,
        out: &mut CudaSlice<f32>,
    ) {
        let slots = shape.rows * (shape.heads / shape.kv_heads);
        let grid = slots.div_ceil(PA_BM).div_ceil(2) * shape.kv_heads;
        let (rows, p0, h, kvh, d) = (
            shape.rows as i32,
            shape.pos0 as i32,
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
        );
        let window = shape.window.map_or(0, |w| w as i32);
        let mut l = self.launcher(self.func(name));
        l.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(out)
            .arg(&rows)
            .arg(&p0)
            .arg(&h)
            .arg(&kvh)
            .arg(&d)
            .arg(&window);
        let shared = tiled_shared(shape.head_dim);
        ok(unsafe { l.launch(cfg(grid, PA_THREADS, shared)) }, name);
    }

    /// `out[r] = table[ids[r]]` for `n` ids in device memory (`u32` bits, whatever the
    /// buffer's element type).
    fn embed_rows<I: DevicePtr<T>, T>(
        &self,
        table: &DeviceMatrix,
        dim: usize,
        ids: &I,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let d = dim as i32;
        let ids = ids.device_ptr(&self.stream).0;
        let mut l = match table {
            DeviceMatrix::Bf16(t) => {
                let mut l = self.launcher(self.func("embed_bf16"));
                l.arg(t);
                l
            }
            DeviceMatrix::F32(t) => {
                let mut l = self.launcher(self.func("embed"));
                l.arg(t);
                l
            }
        };
        l.arg(&ids).arg(out).arg(&d);
        // Up to a thread per value: a decode step's one row is a single block, whose
        // threads would otherwise each wait on several loads in turn.
        let threads = dim.next_power_of_two().clamp(32, 1024) as u32;
        ok(unsafe { l.launch(cfg(n, threads, 0)) }, "embed");
    }

    /// Launches `l` with a thread per element of `n`.
    fn launch_1d(&self, mut l: Launch<'_>, n: usize, what: &str) {
        if n == 0 {
            return;
        }
        ok(
            unsafe { l.launch(cfg(blocks(n, 256) as usize, 256, 0)) },
            what,
        );
    }
}

impl Backend for Cuda {
    type Tensor = CudaSlice<f32>;
    type Matrix = DeviceMatrix;
    type Slots = CudaSlots;

    fn name(&self) -> &'static str {
        "cuda"
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

    fn embed(&self, table: &DeviceMatrix, dim: usize, ids: &[u32], out: &mut CudaSlice<f32>) {
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
        if rows == 0 {
            return;
        }
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.launcher(self.func("rms_norm"));
        l.arg(x).arg(w).arg(out).arg(&r).arg(&d).arg(&eps);
        ok(unsafe { l.launch(norm_cfg(rows, dim)) }, "rms_norm");
    }

    fn rms_norm_inplace(
        &self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) {
        if rows == 0 {
            return;
        }
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.launcher(self.func("rms_norm_inplace"));
        l.arg(x).arg(w).arg(&r).arg(&d).arg(&eps);
        ok(unsafe { l.launch(norm_cfg(rows, dim)) }, "rms_norm_inplace");
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
        if rows == 0 {
            return;
        }
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.launcher(self.func("add_rms_norm"));
        l.arg(x)
            .arg(delta)
            .arg(w)
            .arg(out)
            .arg(&r)
            .arg(&d)
            .arg(&eps);
        ok(unsafe { l.launch(norm_cfg(rows, dim)) }, "add_rms_norm");
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
        if rows == 0 {
            return;
        }
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.launcher(self.func("add_rms_norm_to"));
        l.arg(n.x).arg(delta).arg(n.w).arg(sum).arg(out);
        l.arg(&r).arg(&d).arg(&n.eps);
        ok(unsafe { l.launch(norm_cfg(rows, dim)) }, "add_rms_norm_to");
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
        let outs = outs.map(|o| o.device_ptr_mut(&self.stream).0);
        self.dense_mma_product(n.x, &ws, in_dim, &outs, Some(&norm));
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
        let out = out.device_ptr_mut(&self.stream).0;
        self.dense_mma_product(n.x, &ws, in_dim, &[out], Some(&norm));
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
                if (1..=MATVEC_MAX_BATCH).contains(&rows) =>
            {
                let [o0, o1, o2] = outs;
                let [r0, r1, r2] = out_dims.map(|d| d as i32);
                let (cols, batch) = (in_dim as i32, rows as i32);
                let total: usize = out_dims.iter().sum();
                let (name, launch) = self.dense_bf16_matvec(true, rows, in_dim, total);
                let mut l = self.launcher(self.func(name));
                l.arg(a).arg(b).arg(c).arg(x).arg(o0).arg(o1).arg(o2);
                l.arg(&r0).arg(&r1).arg(&r2).arg(&cols).arg(&batch);
                ok(unsafe { l.launch(launch) }, "matvec_bf16_3");
            }
            ref ws3 if self.dense_mma_takes(ws3, rows, in_dim) => {
                self.dense_mma_product(
                    x,
                    ws3,
                    in_dim,
                    &outs.map(|o| o.device_ptr_mut(&self.stream).0),
                    None,
                );
            }
            _ => {
                for ((w, d), out) in ws.into_iter().zip(out_dims).zip(outs) {
                    self.linear(x, w, rows, in_dim, d, out);
                }
            }
        }
    }

    fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, rows: usize) {
        let dim = bias.len();
        let n = rows * dim;
        let (d, n64) = (dim as i32, n as i64);
        let mut l = self.launcher(self.func("add_bias"));
        l.arg(x).arg(bias).arg(&d).arg(&n64);
        self.launch_1d(l, n, "add_bias");
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) {
        let n64 = n as i64;
        let mut l = self.launcher(self.func("add"));
        l.arg(x).arg(y).arg(&n64);
        self.launch_1d(l, n, "add");
    }

    fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: usize) {
        let n64 = n as i64;
        let mut l = self.launcher(self.func("silu_mul"));
        l.arg(gate).arg(up).arg(&n64);
        self.launch_1d(l, n, "silu_mul");
    }

    fn clamp(&self, x: &mut CudaSlice<f32>, limit: f32, n: usize) {
        let n64 = n as i64;
        let mut l = self.launcher(self.func("clamp_values"));
        l.arg(x).arg(&limit).arg(&n64);
        self.launch_1d(l, n, "clamp_values");
    }

    fn softmax_rows(&self, x: &mut CudaSlice<f32>, rows: usize, dim: usize) {
        if rows == 0 {
            return;
        }
        let d = dim as i32;
        let mut l = self.launcher(self.func("softmax_rows"));
        l.arg(x).arg(&d);
        ok(
            unsafe { l.launch(cfg(rows, row_threads(dim), 0)) },
            "softmax_rows",
        );
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
        let (h, d, p0) = (heads as i32, head_dim as i32, p0 as u32);
        let null = 0u64;
        let mut l = self.launcher(self.func("rope"));
        l.arg(x);
        match &pos {
            Some(p) => l.arg(p),
            None => l.arg(&null),
        };
        l.arg(&p0).arg(&*freq).arg(&h).arg(&d);
        ok(
            unsafe { l.launch(cfg(positions.len() * heads, row_threads(head_dim / 2), 0)) },
            "rope",
        );
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

    fn attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        shape: AttentionShape,
        out: &mut CudaSlice<f32>,
    ) {
        assert!(
            shape.head_dim <= 256,
            "head_dim {} over the attention kernel's 256",
            shape.head_dim
        );
        if shape.rows == 0 {
            return;
        }
        if shape.rows == 1 {
            self.attention_one_row(q, k_cache, v_cache, shape, 0, out, false);
            return;
        }
        // Several rows: the tiled kernel where the head width and the shared memory the
        // device granted allow, else a block per (row, head).
        if let Some(name) =
            tiled_kernel(shape.head_dim).filter(|_| shape.head_dim <= self.tiled_head_dim)
        {
            self.attention_tiled(name, q, k_cache, v_cache, shape, out);
            return;
        }
        let (p0, h, kvh, d) = (
            shape.pos0 as i32,
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
        );
        let window = shape.window.map_or(0, |w| w as i32);
        let mut l = self.launcher(self.func("attention"));
        l.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(out)
            .arg(&p0)
            .arg(&h)
            .arg(&kvh)
            .arg(&d)
            .arg(&window);
        ok(
            unsafe { l.launch(cfg(shape.rows * shape.heads, 128, 0)) },
            "attention",
        );
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
        let w = width as i32;
        let mut l = self.launcher(self.func("gather_rows"));
        l.arg(src).arg(&r).arg(dst).arg(&w);
        ok(
            unsafe { l.launch(cfg(rows.len(), row_threads(width), 0)) },
            "gather_rows",
        );
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
        let w = width as i32;
        let mut l = self.launcher(self.func("scatter_add_rows"));
        l.arg(src).arg(&r).arg(&s).arg(dst).arg(&w);
        ok(
            unsafe { l.launch(cfg(rows.len(), row_threads(width), 0)) },
            "scatter_add_rows",
        );
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
        table: &DeviceMatrix,
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
        let pos = step.slice(1..2);
        let (h, d, p0) = (heads as i32, head_dim as i32, 0u32);
        let mut l = self.launcher(self.func("rope"));
        l.arg(x).arg(&pos).arg(&p0).arg(&*freq).arg(&h).arg(&d);
        ok(
            unsafe { l.launch(cfg(heads, row_threads(head_dim / 2), 0)) },
            "rope",
        );
    }

    fn write_row_at(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        step: &CudaSlice<f32>,
        width: usize,
    ) {
        let pos = step.slice(1..2);
        let w = width as i32;
        let mut l = self.launcher(self.func("write_row_at"));
        l.arg(src).arg(dst).arg(&pos).arg(&w);
        ok(
            unsafe { l.launch(cfg(blocks(width, 256) as usize, 256, 0)) },
            "write_row_at",
        );
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
        self.attention_row_at(q, k_cache, v_cache, shape, step, out, false);
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
        let late = group_kernel(shape.head_dim).is_some();
        let early =
            self.preamble_at(q, k, v, norm, shape, inv_freq, step, k_cache, v_cache, late) && late;
        self.attention_row_at(q, k_cache, v_cache, shape, step, out, early);
    }

    fn argmax_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
        at: usize,
    ) {
        if rows == 0 {
            return;
        }
        // Chunks of whole passes of the block (4 values a thread), few enough that the
        // last block's merge of a row's partials is one short loop.
        let pass = 4 * ARGMAX_THREADS;
        let chunk = dim.div_ceil(1024).div_ceil(pass).max(1) * pass;
        let splits = dim.div_ceil(chunk).max(1);
        let per_launch = rows.min(ARGMAX_MAX_ROWS);
        // ARGMAX_MAX_ROWS counts at a fixed place (so a count is never a former partial),
        // then partial values and indices.
        let need = ARGMAX_MAX_ROWS + 2 * per_launch * splits;
        let mut scratch = self.grown_with(&self.argmax_scratch, need, true);
        let base = scratch.as_mut().expect("grown").device_ptr(&self.stream).0;
        let (count, part, part_i) = (
            base,
            base + 4 * ARGMAX_MAX_ROWS as u64,
            base + 4 * (ARGMAX_MAX_ROWS + per_launch * splits) as u64,
        );
        let (d, c) = (dim as i32, chunk as i32);
        for r0 in (0..rows).step_by(per_launch) {
            let n = per_launch.min(rows - r0);
            let xs = x.slice(r0 * dim..(r0 + n) * dim);
            let mut o = out.slice_mut(at + r0..at + r0 + n);
            let mut l = self.launcher(self.func("argmax_rows"));
            l.arg(&xs)
                .arg(&mut o)
                .arg(&d)
                .arg(&c)
                .arg(&count)
                .arg(&part)
                .arg(&part_i);
            let grid = LaunchConfig {
                grid_dim: (splits as u32, n as u32, 1),
                block_dim: (ARGMAX_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            ok(unsafe { l.launch(grid) }, "argmax_rows");
        }
    }

    fn advance_step(&self, step: &mut CudaSlice<f32>, chosen: &CudaSlice<f32>, at: usize) {
        let chosen = chosen.slice(at..at + 1);
        let mut l = self.launcher(self.func("advance_step"));
        l.arg(step).arg(&chosen);
        ok(unsafe { l.launch(cfg(1, 1, 0)) }, "advance_step");
    }

    fn read_async(&self, t: &CudaSlice<f32>, len: usize) -> PendingRead {
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

    fn finish_read(&self, read: PendingRead) -> Vec<f32> {
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

    fn replay_step(&self, key: (usize, u64), body: &mut dyn FnMut() -> bool) -> bool {
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
        let (e, k) = (experts.count, route.top_k);
        if rows == 0 || e == 0 || k == 0 || k > e || e > 4096 {
            return false;
        }
        if route.keep.is_some_and(|m| m.len() != e) {
            return false;
        }
        let mut map = self.routed.lock().expect("routed blocks lock");
        let Some(block) = self.routed_block(&mut map, experts, hidden, k) else {
            return false;
        };
        match block.kind {
            // Affine prompts take the grouped GEMMs, on tensor cores; without them each
            // expert would be read once per row, and the host path's grouped products win.
            RoutedKind::Affine(_)
                if rows > ROUTED_MAX_ROWS
                    && !(self.tensor_cores() && gemm_grid_fits(rows * k, e)) =>
            {
                return false
            }
            // VQ experts of any number of rows take the routed kernels, each pair reading
            // its expert: the host path would decode every expert to f32 for a GEMM. The
            // CUDA-core down kernel, which every shape may fall back to, holds a token's
            // top_k rows: on an H200 that is 8 rows up to 7 264 wide, not 1 536 as
            // without the opt-in (Qwen3-Coder-480B's 2 560 needs it).
            RoutedKind::Vq(shape) if shape.down_shared(k) > self.vq_routed_shared => return false,
            _ => {}
        }
        let keep = match route.keep {
            None => 0u64,
            Some(mask) => {
                if block
                    .keep
                    .as_ref()
                    .is_none_or(|(m, _)| m.as_slice() != mask)
                {
                    self.drop_graphs();
                    let bytes: Vec<u8> = mask.iter().map(|&b| b as u8).collect();
                    block.keep =
                        Some((mask.to_vec(), ok(self.stream.clone_htod(&bytes), "upload")));
                }
                let (_, dev) = block.keep.as_ref().expect("set above");
                dev.device_ptr(&self.stream).0
            }
        };
        let kind = block.kind;
        let table = block.table.device_ptr(&self.stream).0;
        let routed = Routed {
            kind,
            table,
            keep,
            experts: e,
            route,
            router_late: false,
            norm: None,
        };
        let (x, routed) = self.moe_input(x, routed, rows, hidden, gate);
        let mut logits = probs.slice_mut(probs_at..probs_at + rows * e);
        let probs_ptr = logits.device_ptr_mut(&self.stream).0;
        let x_ptr = x.device_ptr(&self.stream).0;
        let out_ptr = out.device_ptr_mut(&self.stream).0;
        let routed = self.launch_router(routed, gate, x, rows, hidden, &mut logits);
        match kind {
            RoutedKind::Affine(_) => {
                self.launch_routed(&routed, x_ptr, rows, hidden, probs_ptr, out_ptr)
            }
            RoutedKind::Vq(_) => {
                self.launch_routed_chunks(&routed, x_ptr, rows, hidden, probs_ptr, out_ptr)
            }
        }
        true
    }

    fn new_slots(
        &self,
        format: &RecordFormat,
        experts: usize,
        top_k: usize,
        count: usize,
    ) -> Option<CudaSlots> {
        if experts == 0 || experts > 4096 || top_k == 0 || top_k > experts {
            return None;
        }
        let kind = match format {
            RecordFormat::Affine(layout) => {
                let [gate, _, down] = layout.matrices;
                let mut shape =
                    RoutedShape::of(layout.bits, gate.rows, gate.cols, down.cols, layout.hidden)?;
                shape.tiled = self.tiled_kernels_take(shape, top_k);
                RoutedKind::Affine(shape)
            }
            // As in `routed_moe`: the CUDA-core down kernel, which every shape may fall
            // back to, holds a token's top_k rows.
            RecordFormat::Vq(layout) => {
                let shape = VqRoutedShape::of_layout(layout, self.vq_routed_shared)?;
                if shape.down_shared(top_k) > self.vq_routed_shared {
                    return None;
                }
                RoutedKind::Vq(shape)
            }
            _ => return None,
        };
        let from_rows = matches!(kind, RoutedKind::Affine(s) if s.tiled)
            .then(|| self.func("affine_tiles_from_rows").clone());
        Some(CudaSlots::new(
            &self.stream,
            &self.copies,
            kind,
            format,
            experts,
            count,
            from_rows,
        ))
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
        let (e, k) = (slots.experts(), route.top_k);
        if rows == 0 || k == 0 || k > e || e > 4096 {
            return false;
        }
        // Slots made for a route of another top_k, in tiles where the tiled kernels do not
        // take this one or in rows where they would: the routed kernels on tensor cores
        // read 4- and 2-bit experts only in tiles.
        if matches!(slots.kind, RoutedKind::Affine(s) if s.tiled != self.tiled_kernels_take(s, k)) {
            return false;
        }
        let routed = Routed {
            kind: slots.kind,
            table: slots.table_at(),
            keep: slots.keep_at(),
            experts: e,
            route,
            router_late: false,
            norm: None,
        };
        let (x, routed) = self.moe_input(x, routed, rows, hidden, gate);
        let mut logits = probs.slice_mut(probs_at..probs_at + rows * e);
        let probs_at = logits.device_ptr_mut(&self.stream).0;
        let (x_at, out_at) = (
            x.device_ptr(&self.stream).0,
            out.device_ptr_mut(&self.stream).0,
        );
        let routed = self.launch_router(routed, gate, x, rows, hidden, &mut logits);
        // The routed kernels read each chosen expert once per row: fine for a decode step,
        // and for a prompt the only path that reads device slots.
        self.launch_routed_chunks(&routed, x_at, rows, hidden, probs_at, out_at);
        true
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

#[cfg(test)]
mod tests {
    use super::{
        dense_mma_layout, group_chunk, group_kernel, is_bf16_exact, staged_rows, tiled_kernel,
        tiled_shared, unit_tiles, vq_book_bytes, vq_suffix, vq_tile, VqRoutedShape, VqTile,
        ATT_CHUNK_MAX, ATT_STEP, SHARED_LIMIT, VQR_SHARED_BOOK,
    };
    use crate::codec::vq::{Rung, LADDER};
    use crate::testing::fresh;
    use half::bf16;

    #[test]
    fn unit_tiles_give_each_lane_the_words_and_scales_its_rows_hold() {
        use super::words_per_row;
        use crate::codec::affine::AffineMatrix;
        // A ragged last tile (37 rows), at both widths the tiled kernels read. Lane
        // 4g + q of unit (t, gi) holds rows 16t + g and 16t + g + 8 (load_unit_tiled):
        // at 4 bits words 8gi + 2q and 8gi + 2q + 1 of each, at 2 bits word 4gi + q;
        // rows past the matrix are zeros.
        let (rows, cols) = (37, 192);
        for bits in [4u32, 2] {
            let m = AffineMatrix::quantize(&fresh(rows * cols, 3), rows, cols, bits).unwrap();
            let w = m.view();
            let (words, sb) = unit_tiles(&w);
            let (groups, row_words) = (cols / 64, words_per_row(cols, bits));
            let (per_lane, lane_words) = if bits == 4 { (4, 2) } else { (2, 1) };
            assert_eq!(words.len(), 3 * groups * 32 * per_lane);
            assert_eq!(sb.len(), 3 * groups * 16 * 2);
            for t in 0..3 {
                for gi in 0..groups {
                    let unit = t * groups + gi;
                    for lane in 0..32 {
                        let (g, q) = (lane / 4, lane % 4);
                        for half in 0..2 {
                            let r = 16 * t + g + 8 * half;
                            for j in 0..lane_words {
                                let got =
                                    words[(unit * 32 + lane) * per_lane + half * lane_words + j];
                                let want = if r < rows {
                                    let k = if bits == 4 {
                                        gi * 8 + 2 * q + j
                                    } else {
                                        gi * 4 + q
                                    };
                                    w.words[r * row_words + k]
                                } else {
                                    0
                                };
                                assert_eq!(got, want, "q{bits} unit {unit} lane {lane} row {r}");
                            }
                        }
                    }
                    for r in 0..16 {
                        let row = 16 * t + r;
                        let (scale, bias) = if row < rows {
                            let g = row * groups + gi;
                            (w.scales[g].to_bits(), w.biases[g].to_bits())
                        } else {
                            (0, 0)
                        };
                        assert_eq!(sb[(unit * 16 + r) * 2], scale);
                        assert_eq!(sb[(unit * 16 + r) * 2 + 1], bias);
                    }
                }
            }
        }
    }

    #[test]
    fn every_rung_has_a_vq_kernel_and_a_book_of_whole_16_byte_units() {
        for rung in LADDER {
            vq_suffix(rung.dim);
            // The matrix-vector kernel stages the book in 16-byte copies and puts the
            // activations right after it, which float4 loads need aligned.
            assert_eq!(vq_book_bytes(rung) % 16, 0, "{}", rung.name());
        }
    }

    #[test]
    fn vq_launches_put_the_rows_first_and_the_book_beside_them_when_it_fits() {
        let r = |s: &str| Rung::parse(s).unwrap();
        let tile = |rows, book_shared| Some(VqTile { rows, book_shared });
        // vq3's book is 32 KiB: beside one 2048-wide row (8 KiB), not beside four.
        assert_eq!(vq_tile(r("3"), 2048, 1), tile(1, true));
        assert_eq!(vq_tile(r("3"), 2048, 4), tile(4, false));
        assert_eq!(vq_tile(r("3"), 768, 4), tile(4, true));
        // vq2's 1 MiB book and vq1.5's 64 KiB one never fit.
        assert_eq!(vq_tile(r("2"), 768, 1), tile(1, false));
        assert_eq!(vq_tile(r("1.5"), 256, 1), tile(1, false));
        assert_eq!(vq_tile(r("5"), 2048, 4), tile(4, true));
        // Rows as wide as 12 288 values still fit one at a time (vq1's 4 KiB book beside
        // 32 KiB of row, not beside 48); wider ones decode.
        assert_eq!(vq_tile(r("1"), 8192, 4), tile(1, true));
        assert_eq!(vq_tile(r("1"), 4096, 4), tile(3, false));
        assert_eq!(vq_tile(r("1"), 12288, 2), tile(1, false));
        assert_eq!(vq_tile(r("1"), 12288 + 1024, 1), None);
        for rung in LADDER {
            for width in [16, 128, 768, 2048, 4096] {
                for batch in 1..=4 {
                    let t = vq_tile(rung, width, batch).unwrap();
                    let bytes = t.rows * width * 4 + t.book_shared as usize * vq_book_bytes(rung);
                    assert!(t.rows <= batch && bytes <= SHARED_LIMIT);
                }
            }
        }
    }

    #[test]
    fn tensor_core_vq_kernels_take_whole_codewords_and_fit_an_h200_with_the_book() {
        use crate::codec::vq::rotation::block_size;
        let shape = |rung: &str, hidden: usize, inter: usize| VqRoutedShape {
            rung: Rung::parse(rung).unwrap(),
            hidden,
            inter,
            up_block: block_size(hidden),
            down_block: block_size(inter),
        };
        // 2-value vectors, and rotation blocks under 64 (a 32-wide expert), stay on CUDA
        // cores: a codeword would be part of a fragment, a norm change within a unit.
        assert!(!shape("5", 2048, 768).on_tensor_cores());
        assert!(!shape("1.5", 128, 32).on_tensor_cores());
        for rung in ["0.7", "1.5", "3", "4"] {
            assert!(shape(rung, 2048, 768).on_tensor_cores(), "{rung}");
        }
        // The shared memory the host asks for, book included where the kernels copy it,
        // fits the 227 KiB an H200 block may opt into, for Qwen3-30B-A3B's and
        // Qwen3-235B-A22B's experts at top-8. Code rows take an odd number of 16-byte
        // chunks, one more than they touch: 384-byte rows 400, 24-byte rows 48.
        assert_eq!(staged_rows(1, 384, 0) - staged_rows(0, 384, 0), 400);
        assert_eq!(staged_rows(1, 24, 0) - staged_rows(0, 24, 0), 48);
        let optin = 227 << 10;
        for (hidden, inter) in [(2048, 768), (4096, 1536)] {
            for rung in ["1.5", "0.7", "3", "2"] {
                let s = shape(rung, hidden, inter);
                let book = vq_book_bytes(s.rung);
                let book = if book <= VQR_SHARED_BOOK { book } else { 0 };
                let most = s.mma_gate_up_shared().max(s.mma_down_shared(8));
                assert!(
                    most + book <= optin,
                    "{rung} {hidden}x{inter}: {most} + {book}"
                );
            }
        }
        // Qwen3-Coder-480B-A35B's experts need the opt-in even on CUDA cores (a token's 8
        // rotated down inputs are 80 KiB), and take the tensor cores, at some rungs with
        // the book read through L1 (vq3's 32 KiB do not fit beside 205 KiB).
        for rung in ["1.5", "0.7", "3", "2"] {
            let s = shape(rung, 6144, 2560);
            assert!(s.down_shared(8) > SHARED_LIMIT && s.down_shared(8) <= optin);
            let most = s.mma_gate_up_shared().max(s.mma_down_shared(8));
            assert!(most <= optin, "{rung}: {most}");
        }
        // Two vq1.5 blocks of the 30B shape share an SM (228 KiB, 1 KiB a block kept).
        let s = shape("1.5", 2048, 768);
        let most = s.mma_gate_up_shared().max(s.mma_down_shared(8)) + vq_book_bytes(s.rung);
        assert!(2 * (most + 1024) <= 228 << 10, "{most}");
    }

    #[test]
    fn one_row_dense_products_split_narrow_matrices_and_loop_over_wide_ones() {
        // Qwen3-30B-A3B on an H200's 132 multiprocessors: the LM head's 9 496 tiles of 16
        // rows take a warp each on a grid of three blocks a multiprocessor, which loops;
        // q/k/v's 320 tiles and the attention output's 128 are split over all 8 warps.
        assert_eq!(dense_mma_layout(151936 / 16, 32, 132, 3), (1, 396));
        assert_eq!(dense_mma_layout(320, 32, 132, 3), (8, 320));
        assert_eq!(dense_mma_layout(128, 64, 132, 3), (8, 128));
        // A job never splits into more parts than it has 64-column groups.
        assert_eq!(dense_mma_layout(3, 2, 132, 3).0, 2);
        assert_eq!(dense_mma_layout(1, 1, 132, 3), (1, 1));
    }

    #[test]
    fn grouped_attention_chunks_fill_the_device_in_whole_steps() {
        // Qwen3-30B-A3B on an H200: 4 KV heads of 8 query heads, 132 multiprocessors.
        assert_eq!(group_chunk(640, 4, 132), 16);
        assert_eq!(group_chunk(4096, 4, 132), 64);
        assert_eq!(group_chunk(16, 4, 132), 16);
        assert_eq!(group_chunk(1 << 20, 4, 132), ATT_CHUNK_MAX);
        for sms in [1, 78, 132] {
            for units in [1, 2, 4, 8, 16, 64] {
                for capacity in (1..5000).step_by(7).chain([1 << 16, 1 << 20]) {
                    let chunk = group_chunk(capacity, units, sms);
                    assert!(chunk.is_multiple_of(ATT_STEP) && chunk <= ATT_CHUNK_MAX);
                    // Fewer blocks than multiprocessors only when no chunk could be smaller.
                    let blocks = units * capacity.div_ceil(chunk);
                    assert!(
                        blocks >= sms || chunk == ATT_STEP,
                        "{capacity} keys, {units} units, {sms} SMs: {blocks} blocks of {chunk}"
                    );
                }
            }
        }
    }

    #[test]
    fn grouped_attention_takes_head_widths_of_whole_float4s_up_to_256() {
        assert_eq!(group_kernel(64), Some("attention_group_64"));
        assert_eq!(group_kernel(4), Some("attention_group_64"));
        assert_eq!(group_kernel(96), Some("attention_group_128"));
        assert_eq!(group_kernel(128), Some("attention_group_128"));
        assert_eq!(group_kernel(132), Some("attention_group_256"));
        assert_eq!(group_kernel(256), Some("attention_group_256"));
        for d in [0, 2, 66, 130, 260] {
            assert_eq!(group_kernel(d), None, "{d}");
        }
    }

    #[test]
    fn tiled_attention_takes_the_grouped_widths_within_the_shared_memory_of_an_h200() {
        for d in [4, 36, 64, 96, 128, 200, 256] {
            let grouped = group_kernel(d).unwrap();
            assert_eq!(
                tiled_kernel(d).unwrap(),
                grouped.replace("group", "tiled"),
                "{d}"
            );
        }
        for d in [0, 2, 66, 130, 260] {
            assert_eq!(tiled_kernel(d), None, "{d}");
        }
        // 128 wide: two blocks an SM (228 KB, 1 KB reserved a block); 256: one, within
        // the 227 KB a block may opt in to.
        assert_eq!(tiled_shared(128), 109_568);
        assert!(2 * (tiled_shared(128) + 1024) <= 228 << 10);
        assert_eq!(tiled_shared(256), 207_872);
        assert!(tiled_shared(256) <= 227 << 10);
        assert!(
            tiled_shared(64) > SHARED_LIMIT,
            "every width asks for its shared memory"
        );
    }

    /// The names `__global__` entries take in `source`: a literal name as written, a
    /// macro's (`expert_mma_gate_up_##NAME`) once per top-level use of the macro, with
    /// each `##PARAM` replaced by that use's argument.
    fn kernel_entries(source: &str) -> Vec<String> {
        let name_after = |part: &str| {
            let mut rest = part.trim_start();
            if let Some(bounds) = rest.strip_prefix("__launch_bounds__") {
                // A macro's definition may go on past a line's backslash.
                rest = bounds
                    .split_once(')')
                    .map_or("", |(_, r)| r)
                    .trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
            }
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '#'))
                .unwrap_or(rest.len());
            rest[..end].to_string()
        };
        let mut names = Vec::new();
        let mut at = 0;
        while let Some(found) = source[at..].find("__global__ void") {
            let start = at + found;
            at = start + "__global__ void".len();
            let name = name_after(&source[at..]);
            if !name.contains("##") {
                names.push(name);
                continue;
            }
            // The macro that holds this entry: the last `#define M(params)` before it.
            let define = source[..start]
                .rfind("#define ")
                .expect("a macro entry's #define");
            let head = &source[define + "#define ".len()..];
            let (macro_name, rest) = head.split_once('(').expect("a macro with parameters");
            let params: Vec<&str> = rest
                .split_once(')')
                .expect("a parameter list")
                .0
                .split(',')
                .map(str::trim)
                .collect();
            let uses = source.lines().filter_map(|line| {
                line.strip_prefix(macro_name)?
                    .strip_prefix('(')?
                    .split_once(')')
                    .map(|(args, _)| args)
            });
            for args in uses {
                let args: Vec<&str> = args.split(',').map(str::trim).collect();
                let mut expanded = name.clone();
                for (param, arg) in params.iter().zip(&args) {
                    expanded = expanded.replace(&format!("##{param}"), arg);
                }
                names.push(expanded);
            }
        }
        names
    }

    #[test]
    fn every_kernel_the_source_defines_is_loaded() {
        // The host finds a function only by a name in KERNEL_NAMES, and a name there that
        // the source lacks fails the module's load.
        let entries = kernel_entries(super::source());
        assert!(
            entries.iter().any(|e| e == "expert_mma_down_tiled_q2"),
            "macro uses expand: {entries:?}"
        );
        let missing: Vec<_> = entries
            .iter()
            .filter(|e| !super::KERNEL_NAMES.contains(&e.as_str()))
            .collect();
        assert!(
            missing.is_empty(),
            "kernels not in KERNEL_NAMES: {missing:?}"
        );
        let unknown: Vec<_> = super::KERNEL_NAMES
            .iter()
            .filter(|k| !entries.iter().any(|e| e == *k))
            .collect();
        assert!(
            unknown.is_empty(),
            "KERNEL_NAMES the source does not define: {unknown:?}"
        );
    }

    #[test]
    fn the_sources_are_what_program_cu_includes_in_its_order() {
        let includes: Vec<&str> = include_str!("kernels/program.cu")
            .lines()
            .filter_map(|l| l.strip_prefix("#include \"")?.strip_suffix('"'))
            .collect();
        let names: Vec<&str> = super::SOURCES.iter().map(|(n, _)| *n).collect();
        assert_eq!(includes, names);
        // Every kernel file is one of them.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda/kernels");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f != "program.cu")
            .collect();
        files.sort();
        let mut names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        names.sort();
        assert_eq!(files, names);
    }

    #[test]
    fn bf16_exactness_is_a_round_trip() {
        let mut values = fresh(4096, 1);
        values.extend(values.clone().iter().map(|&v| bf16::from_f32(v).to_f32()));
        values.extend([0.0, -0.0, 1.0, f32::INFINITY, f32::MIN_POSITIVE, 1e-40]);
        for v in values {
            let round_trip = bf16::from_f32(v).to_f32().to_bits() == v.to_bits();
            assert_eq!(
                is_bf16_exact(v),
                round_trip,
                "{v:e} ({:#010x})",
                v.to_bits()
            );
        }
    }
}
