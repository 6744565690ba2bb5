//! VQ-ladder matrices on the device (kernels/vq.cu): their codes and norms copied as
//! stored, products straight from the codes on CUDA cores — activations rotated once, a
//! warp per output row looking each vector's codeword up in the rung's book (or, for
//! many rows, the matrix decoded in the rotated domain for one GEMM) — and a MoE block's
//! VQ experts routed on the device, the tensor-core kernels in vq_mma.rs.

use std::sync::{Arc, MutexGuard};

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::slice::HalfFloatSliceExt;

use super::affine::RoutePairs;
use super::expert_gemm::gemm_grid_fits;
use super::launch::{kernel_args, kernel_params, Ptr};
use super::matvec::MATVEC_MAX_BATCH;
use super::program::{dims, Builds};
use super::routed::{Routed, RoutedRows, ROUTED_MAX_ROWS};
use super::vq_mma::{
    RoutedVqDownMma, RoutedVqGateUpMma, ROUTED_VQ_DOWN_MMA, ROUTED_VQ_GATE_UP_MMA, VQM_TILES,
};
use super::{blocks, cfg, ok, Cuda, SHARED_LIMIT};
use crate::codec::vq::{rotation, row_bytes, Rung, VqView};
use crate::store::vq::VqLayout;

/// Output rows per VQ matrix-vector block, a warp each (the kernel's `VQ_WARPS`).
pub(super) const VQ_WARPS: usize = 8;
/// Most blocks of a VQ matrix-vector launch that stages the codebook in shared memory:
/// each block copies the whole book from L2, so the blocks loop over the rows instead
/// of the grid growing with them (two per SM of an H200).
const VQ_SHARED_BOOK_BLOCKS: usize = 264;
/// Bytes of zeros after a VQ matrix's device codes and after its norms: the
/// matrix-vector kernels read an index as the 3 bytes from its first, the routed ones as
/// the two aligned 32-bit words from the one it starts in (up to 7 bytes past its last),
/// and the tensor-core ones copy rows in whole 16-byte chunks (up to 15 bytes past).
pub(super) const VQ_CODE_PADDING: usize = 16;
/// Warps of a `routed_vq_*` block, and the output rows each takes at once in gate/up and
/// in down (the kernels' `VQR_WARPS`, `VQR_GATE_UP_ROWS`, `VQR_DOWN_ROWS`).
pub(super) const VQR_WARPS: usize = 16;
pub(super) const VQR_GATE_UP_ROWS: usize = 2;
pub(super) const VQR_DOWN_ROWS: usize = 1;
/// Largest book the routed VQ kernels copy into shared memory (vq1.5's and vq0.7's; the
/// kernels' `VQR_PREFETCH_BOOK` too).
pub(super) const VQR_SHARED_BOOK: usize = 64 << 10;

pub(super) const VQ_ROTATE: &str = "vq_rotate";
pub(super) const VQ_MATVEC: Builds<4> = dims!("vq_matvec");
pub(super) const VQ_DECODE: Builds<4> = dims!("vq_decode");
pub(super) const VQ_GATHER: Builds<4> = dims!("vq_gather");
pub(super) const ROUTED_VQ_ROTATE: &str = "routed_vq_rotate";
pub(super) const ROUTED_VQ_GATE_UP: Builds<4> = dims!("routed_vq_gate_up");
pub(super) const ROUTED_VQ_DOWN: Builds<4> = dims!("routed_vq_down");

kernel_params! {
    /// A VQ matrix on the device: its codes, block norms and the rung's book.
    VqCodes => { codes: Ptr, norms: Ptr, book: Ptr }
}

kernel_params! {
    /// A VQ matrix's layout: `rows` rows of `blocks` rotation blocks of `block` values,
    /// `k`-bit indices in `row_bytes` a row; `inv_root` scales a block's sum.
    VqRows => { rows: i32, k: i32, block: i32, blocks: i32, row_bytes: u64, inv_root: f32 }
}

kernel_params! {
    /// The book the routed VQ kernels look codewords up in, with the experts' `k`-bit
    /// indices in `row_bytes` a row, rotation blocks of `block`, and whether a block copies
    /// the book into shared memory (`book_shared`).
    VqBook => { book: Ptr, k: i32, block: i32, row_bytes: u64, book_shared: i32 }
}

kernel_params! {
    /// Where routed gate/up writes: `h` (`[pairs, inter]`) from inputs `hidden` wide.
    VqGateUpOut => { h: Ptr, inter: i32, hidden: i32, book: VqBook }
}

kernel_params! {
    /// What routed down reads: each pair's expert, weight and `h` row.
    VqDownIn => { table: Ptr, ids: Ptr, weights: Ptr, top_k: i32, h: Ptr }
}

kernel_params! {
    /// Where routed down adds: `out` (`[rows, hidden]`) from `h` rows `inter` wide.
    VqDownOut => { out: Ptr, hidden: i32, inter: i32, book: VqBook }
}

kernel_args! {
    /// `xr[r] = H D x[r]` per block of `block` values, rows of `cols`.
    VqRotate for &[VQ_ROTATE] => { x: Ptr, seed: u64, xr: Ptr, cols: i32, block: i32 }
}

kernel_args! {
    /// `out[b] = W · xr[b]` for `batch` rotated rows; the book in shared memory with
    /// `book_shared`.
    VqMatvec for &VQ_MATVEC.names => {
        w: VqCodes, xr: Ptr, out: Ptr, layout: VqRows, batch: i32, book_shared: i32,
    }
}

kernel_args! {
    /// The matrix decoded in the rotated domain into `out`.
    VqDecode for &VQ_DECODE.names => { w: VqCodes, out: Ptr, layout: VqRows }
}

kernel_args! {
    /// `out[r] = W[ids[r]]` decoded to f32 for the ids (u32 bits) of the grid's rows,
    /// `cols` a row, with the matrix's `rows`, index bits `k`, rotation `block`s,
    /// `row_bytes`, `inv_root` = 1/√block and rotation `seed`.
    VqGather for &VQ_GATHER.names => {
        w: VqCodes, ids: Ptr, out: Ptr, cols: i32, rows: i32, k: i32, block: i32, blocks: i32,
        row_bytes: u64, inv_root: f32, seed: u64,
    }
}

kernel_args! {
    /// Each pair's row of `src` rotated with its expert's signs (from matrix `first` of
    /// the table entry, `mats` of them) into `dst`.
    RoutedVqRotate for &[ROUTED_VQ_ROTATE] => {
        pairs: RoutePairs, src: Ptr, by_pair: i32, dst: Ptr, cols: i32, block: i32, mats: i32,
        first: i32,
    }
}

kernel_args! {
    /// Gate and up of each pair with the SiLU; each block rotates its row itself where
    /// `xr` is null.
    RoutedVqGateUp for &ROUTED_VQ_GATE_UP.names => {
        pairs: RoutePairs, x: Ptr, xr: Ptr, out: VqGateUpOut,
    }
}

kernel_args! {
    /// Down of each row's pairs, weighted and added in order; each block rotates its rows
    /// itself where `hr` is null.
    RoutedVqDown for &ROUTED_VQ_DOWN.names => { input: VqDownIn, hr: Ptr, out: VqDownOut }
}

/// A VQ matrix's codes and block norms on the device, as stored.
pub(super) struct DeviceVq {
    /// `rows · row_bytes` bytes of codes, then [`VQ_CODE_PADDING`] zeros.
    pub codes: CudaSlice<u8>,
    /// `[rows, blocks]` fp16 norms, their raw bits, then [`VQ_CODE_PADDING`] bytes of zeros.
    pub norms: CudaSlice<u16>,
    /// The rotation's signs as bits (bit i of word w set where entry 32w + i is −1), for
    /// the routed kernels.
    pub signs: CudaSlice<u32>,
    /// The rotation seed (one per matrix of a model, so a slot refilled with another
    /// expert differs here), host code bytes sampled when it was copied (first, middle,
    /// last) and the norms' first bits: a re-mapped record is never served stale weights.
    fingerprint: VqFingerprint,
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
pub(super) fn vq_book_bytes(rung: Rung) -> usize {
    rung.codewords() * rung.dim * 2
}

/// Host address and length of a VQ view's codes: what the weight cache is keyed by.
pub(super) type VqKey = (usize, usize);

/// A VQ view's rotation seed and sampled code bytes and norm bits.
pub(super) type VqFingerprint = (u64, [u16; 4]);

pub(super) fn vq_key(w: &VqView<'_>) -> VqKey {
    (w.codes.as_ptr() as usize, w.codes.len())
}

pub(super) fn vq_fingerprint(w: &VqView<'_>) -> VqFingerprint {
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

/// The signs of a rotation of `block` values from `seed` as the routed VQ kernels read
/// them: bit i of word w set where entry 32w + i is −1.
pub(super) fn sign_bits(seed: u64, block: usize) -> Vec<u32> {
    let mut bits = vec![0u32; block.div_ceil(32)];
    for (i, s) in rotation::signs(seed, block).iter().enumerate() {
        if *s < 0.0 {
            bits[i / 32] |= 1 << (i % 32);
        }
    }
    bits
}

/// The VQ rung and shapes every expert of a block routed on the device shares: gate and
/// up are `inter × hidden`, down `hidden × inter`, rotated in blocks of `up_block` and
/// `down_block` values.
#[derive(Debug, Clone, Copy)]
pub(super) struct VqRoutedShape {
    pub rung: Rung,
    pub hidden: usize,
    pub inter: usize,
    pub up_block: usize,
    pub down_block: usize,
}

impl VqRoutedShape {
    /// The shape of an expert's gate and down, if the routed VQ kernels take it for a
    /// residual stream of `hidden` with `shared` bytes of shared memory ([`fits`]).
    ///
    /// [`fits`]: Self::fits
    pub fn of(gate: &VqView<'_>, down: &VqView<'_>, hidden: usize, shared: usize) -> Option<Self> {
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
    pub fn of_layout(layout: &VqLayout, shared: usize) -> Option<Self> {
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
    pub fn on_tensor_cores(&self) -> bool {
        self.rung.dim >= 4 && self.up_block >= 64 && self.down_block >= 64
    }

    /// Rotation blocks of a gate/up input row and of a down input row.
    pub fn up_blocks(&self) -> usize {
        self.up_width() / self.up_block
    }

    pub fn down_blocks(&self) -> usize {
        self.down_width() / self.down_block
    }

    /// Rotated widths of a gate/up input row and of a down input row: whole blocks.
    pub fn up_width(&self) -> usize {
        self.hidden.next_multiple_of(self.up_block)
    }

    pub fn down_width(&self) -> usize {
        self.inter.next_multiple_of(self.down_block)
    }

    /// The book and layout of the experts' gate and up (or with `down`, their down) as the
    /// routed kernels take them; `book_shared` (0 or 1): whether a block copies the book
    /// into shared memory.
    pub fn book(&self, book: Ptr, down: bool, book_shared: i32) -> VqBook {
        let (block, cols) = if down {
            (self.down_block, self.inter)
        } else {
            (self.up_block, self.hidden)
        };
        VqBook {
            book,
            k: self.rung.index_bits as i32,
            block: block as i32,
            row_bytes: row_bytes(self.rung, cols) as u64,
            book_shared,
        }
    }

    /// Dynamic shared memory of the gate/up kernel: the row rotated for gate and for up.
    fn gate_up_shared(&self) -> usize {
        2 * self.up_width() * 4
    }

    /// Dynamic shared memory of the down kernel: each of a token's `top_k` rows of
    /// SiLU outputs, rotated.
    pub fn down_shared(&self, top_k: usize) -> usize {
        top_k * self.down_width() * 4
    }
}

impl Cuda {
    /// `out[r] = w[ids[r]]` decoded to f32 for `n` ids in device memory (`u32` bits): an
    /// embedding lookup of a VQ-coded table.
    pub(super) fn gather_vq<I: DevicePtr<T>, T>(
        &self,
        w: &VqView<'_>,
        ids: &I,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if n == 0 {
            return;
        }
        assert!(
            w.block <= 1024 && w.block.is_multiple_of(w.rung.dim),
            "rotation block of {} values (at most 1024, whole vectors)",
            w.block
        );
        let d = self.device_vq(w);
        let book = self.vq_book(w.rung);
        let args = VqGather {
            w: VqCodes {
                codes: self.ptr(&d.codes),
                norms: self.ptr(&d.norms),
                book: self.ptr(&*book),
            },
            ids: self.ptr(ids),
            out: self.ptr_mut(out),
            cols: w.cols as i32,
            rows: w.rows as i32,
            k: w.rung.index_bits as i32,
            block: w.block as i32,
            blocks: w.blocks() as i32,
            row_bytes: row_bytes(w.rung, w.cols) as u64,
            inv_root: 1.0 / (w.block as f32).sqrt(),
            seed: w.seed,
        };
        let grid = LaunchConfig {
            grid_dim: (w.blocks() as u32, n as u32, 1),
            block_dim: ((w.block / 2).clamp(32, 512) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(VQ_GATHER.of(w.rung.dim as u32), grid, args);
    }

    /// The device copy of a VQ matrix's codes and norms, made the first time it is seen.
    pub(super) fn device_vq(&self, w: &VqView<'_>) -> Arc<DeviceVq> {
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
    pub(super) fn vq_book(&self, rung: Rung) -> Arc<CudaSlice<u16>> {
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
        let args = VqRotate {
            x: self.ptr(x),
            seed,
            xr: self.ptr_mut(xr),
            cols: cols as i32,
            block: block as i32,
        };
        let grid = LaunchConfig {
            grid_dim: (cols.div_ceil(block) as u32, rows as u32, 1),
            block_dim: ((block / 2).clamp(32, 512) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(VQ_ROTATE, grid, args);
    }

    /// [`Backend::matmul_vq`](crate::backend::Backend::matmul_vq) on a device copy: the
    /// activations rotated once, then the matrix-vector kernel reading the codes for up
    /// to [`MATVEC_MAX_BATCH`] rows, or the matrix decoded (in the rotated domain) into a
    /// scratch buffer and one GEMM.
    pub(super) fn vq_product(
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
        let rb = row_bytes(w.rung, w.cols) as u64;
        // As the CPU kernels scale a block's sum.
        let inv_root = 1.0 / (block as f32).sqrt();
        let tile = vq_tile(w.rung, width, rows);
        let codes = VqCodes {
            codes: self.ptr(&d.codes),
            norms: self.ptr(&d.norms),
            book: self.ptr(&*book),
        };
        let layout = VqRows {
            rows: w.rows as i32,
            k: w.rung.index_bits as i32,
            block: block as i32,
            blocks: row_blocks as i32,
            row_bytes: rb,
            inv_root,
        };
        if rows > MATVEC_MAX_BATCH || tile.is_none() {
            let mut dense = self.grown(&self.dense_scratch, w.rows * width);
            let dense = dense.as_mut().expect("grown");
            let vectors = w.rows * width / w.rung.dim;
            let args = VqDecode {
                w: codes,
                out: self.ptr_mut(dense),
                layout,
            };
            let launch = cfg(blocks(vectors, 256) as usize, 256, 0);
            self.launch(VQ_DECODE.of(w.rung.dim as u32), launch, args);
            self.gemm_xwt(xr, &*dense, rows, width, width, w.rows, out);
            return;
        }
        let name = VQ_MATVEC.of(w.rung.dim as u32);
        let mut t0 = 0;
        while t0 < rows {
            let tile = vq_tile(w.rung, width, rows - t0).expect("fits: checked above");
            let nb = tile.rows;
            let args = VqMatvec {
                w: codes,
                xr: self.ptr(&xr.slice(t0 * width..(t0 + nb) * width)),
                out: self.ptr_mut(&mut out.slice_mut(t0 * w.rows..(t0 + nb) * w.rows)),
                layout,
                batch: nb as i32,
                book_shared: tile.book_shared as i32,
            };
            let mut grid = w.rows.div_ceil(VQ_WARPS);
            let mut bytes = nb * width * 4;
            if tile.book_shared {
                grid = grid.min(VQ_SHARED_BOOK_BLOCKS);
                bytes += vq_book_bytes(w.rung);
            }
            self.launch(name, cfg(grid, (VQ_WARPS * 32) as u32, bytes), args);
            t0 += nb;
        }
    }

    /// [`launch_routed`](Self::launch_routed) for experts at a VQ rung: the route kernel,
    /// then gate and up with the SiLU into the scratch, then down with each row's pairs
    /// added, weighted, in order, into `out`. Every matrix has its own rotation seed: in a
    /// decode step each block rotates the activations it reads itself (a launch fewer);
    /// for a prompt `routed_vq_rotate` rotates each pair's once, for every block of its
    /// products to read. A decode step's products run on tensor cores where the
    /// codewords make whole fragments (`routed_vq_*_mma`); a prompt whose codewords do
    /// takes the grouped GEMMs instead
    /// ([`launch_routed_vq_gemm`](Self::launch_routed_vq_gemm)). At most 65 535 pairs (the
    /// grid's second dimension): callers go through `launch_routed_chunks`.
    pub(super) fn launch_routed_vq(&self, r: &Routed<'_>, shape: VqRoutedShape, io: RoutedRows) {
        let (x, rows, hidden, probs, out) = (io.x, io.rows, io.hidden, io.probs, io.out);
        let k = r.route.top_k;
        let (inter, pairs) = (shape.inter, rows * k);
        if rows > ROUTED_MAX_ROWS
            && self.tensor_cores()
            && shape.on_tensor_cores()
            && gemm_grid_fits(pairs, r.experts)
        {
            self.launch_routed_vq_gemm(r, shape, io);
            return;
        }
        let [ids, weights, h, ..] = self.routed_scratch_at(pairs, k, inter, hidden);
        self.launch_route(r, rows, probs, ids, weights);
        let book = self.vq_book(shape.rung);
        let book_at = self.ptr(&*book);
        let block = ((VQR_WARPS * 32) as u32, 1, 1);
        // The CUDA-core kernels (`routed_vq_*`) also take a prompt's pairs at rungs the
        // grouped GEMMs do not.
        let decode = rows <= ROUTED_MAX_ROWS;
        let mma = decode
            && self.tensor_cores()
            && shape.on_tensor_cores()
            && shape.mma_gate_up_shared().max(shape.mma_down_shared(k)) <= self.vq_routed_shared;
        // A prompt's pairs rotated: [pairs, 2, up_width] for gate and up, then
        // [pairs, down_width] for down. Null in a decode step.
        let mut rotated = (!decode).then(|| self.rotated_pairs(shape, pairs));
        let (xr, hr) = match rotated.as_mut() {
            Some(buf) => self.rotated_at(buf, shape, pairs),
            None => (Ptr::NULL, Ptr::NULL),
        };
        if !xr.is_null() {
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
        let pairs_of = RoutePairs {
            table: r.table,
            ids,
            top_k: k as i32,
        };
        let dim = shape.rung.dim as u32;
        let (book_shared, bytes) = with_book(up_shared);
        let gate_up = LaunchConfig {
            grid_dim: (inter.div_ceil(up_rows) as u32, pairs as u32, 1),
            block_dim: block,
            shared_mem_bytes: bytes as u32,
        };
        let up_book = shape.book(book_at, false, book_shared);
        let up_out = VqGateUpOut {
            h,
            inter: inter as i32,
            hidden: hidden as i32,
            book: up_book,
        };
        if mma {
            let args = RoutedVqGateUpMma {
                pairs: pairs_of,
                x,
                out: up_out,
            };
            self.launch(ROUTED_VQ_GATE_UP_MMA.of(dim), gate_up, args);
        } else {
            let args = RoutedVqGateUp {
                pairs: pairs_of,
                x,
                xr,
                out: up_out,
            };
            self.launch(ROUTED_VQ_GATE_UP.of(dim), gate_up, args);
        }

        if !hr.is_null() {
            self.launch_pair_rotation(r, ids, pairs, h, true, hr, inter, shape.down_block);
        }
        let (book_shared, bytes) = with_book(down_shared);
        let down = LaunchConfig {
            grid_dim: (hidden.div_ceil(down_rows) as u32, rows as u32, 1),
            block_dim: block,
            shared_mem_bytes: bytes as u32,
        };
        let input = VqDownIn {
            table: r.table,
            ids,
            weights,
            top_k: k as i32,
            h,
        };
        let down_book = shape.book(book_at, true, book_shared);
        let down_out = VqDownOut {
            out,
            hidden: hidden as i32,
            inter: inter as i32,
            book: down_book,
        };
        if mma {
            let args = RoutedVqDownMma {
                input,
                out: down_out,
            };
            self.launch(ROUTED_VQ_DOWN_MMA.of(dim), down, args);
        } else {
            let args = RoutedVqDown {
                input,
                hr,
                out: down_out,
            };
            self.launch(ROUTED_VQ_DOWN.of(dim), down, args);
        }
    }

    /// The buffer for a prompt's `pairs` pairs rotated for gate and up, then for down.
    pub(super) fn rotated_pairs(
        &self,
        shape: VqRoutedShape,
        pairs: usize,
    ) -> MutexGuard<'_, Option<CudaSlice<f32>>> {
        let n = pairs * (2 * shape.up_width() + shape.down_width());
        self.grown(&self.vq_scratch, n)
    }

    /// The gate/up inputs (`[pairs, 2, up_width]`) and the down inputs
    /// (`[pairs, down_width]`) in a [`rotated_pairs`](Self::rotated_pairs) buffer.
    pub(super) fn rotated_at(
        &self,
        buf: &mut Option<CudaSlice<f32>>,
        shape: VqRoutedShape,
        pairs: usize,
    ) -> (Ptr, Ptr) {
        let at = self.ptr_mut(buf.as_mut().expect("grown"));
        (at, at.floats(pairs * 2 * shape.up_width()))
    }

    /// Rotates each of `pairs` pairs' row of `src` (row pair / top_k, or row pair with
    /// `by_pair`) with its expert's seeds (`ids` a pair) into `dst`: for gate and up,
    /// `[pairs, 2, width]`, or with `by_pair` for down, `[pairs, width]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_pair_rotation(
        &self,
        r: &Routed<'_>,
        ids: Ptr,
        pairs: usize,
        src: Ptr,
        by_pair: bool,
        dst: Ptr,
        cols: usize,
        block: usize,
    ) {
        let mats = if by_pair { 1 } else { 2 };
        let chunks = mats * cols.div_ceil(block);
        let (first, by) = if by_pair { (2i32, 1i32) } else { (0, 0) };
        let pairs_of = RoutePairs {
            table: r.table,
            ids,
            top_k: r.route.top_k as i32,
        };
        let args = RoutedVqRotate {
            pairs: pairs_of,
            src,
            by_pair: by,
            dst,
            cols: cols as i32,
            block: block as i32,
            mats: mats as i32,
            first,
        };
        let launch = LaunchConfig {
            grid_dim: (chunks.div_ceil(VQR_WARPS) as u32, pairs as u32, 1),
            block_dim: ((VQR_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(ROUTED_VQ_ROTATE, launch, args);
    }
}

#[cfg(test)]
mod tests {
    use super::{vq_book_bytes, vq_tile, VqTile, SHARED_LIMIT, VQ_MATVEC};
    use crate::codec::vq::{Rung, LADDER};

    #[test]
    fn every_rung_has_a_vq_kernel_and_a_book_of_whole_16_byte_units() {
        for rung in LADDER {
            VQ_MATVEC.of(rung.dim as u32);
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
}
