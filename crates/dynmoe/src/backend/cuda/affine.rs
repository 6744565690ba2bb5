//! Affine matrices on the device (kernels/affine.cu): their device copies, as stored and
//! in unit tiles, and the products that read them on CUDA cores — the matrix-vector
//! kernel, expand-then-GEMM, a decode step's grouped expert products and the routed
//! experts' row-major kernels.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, LaunchConfig};
use half::slice::HalfFloatSliceExt;

use super::affine_mma::RMMA_ROWS;
use super::expert_gemm::{PairTiles, EXPERT_TILE_ROWS};
use super::launch::{kernel_args, kernel_params, Ptr};
use super::norm::{ScatterAddRows, SiluMul, SCATTER_ADD_ROWS, SILU_MUL};
use super::program::{bits, Builds};
use super::routed::{Routed, RoutedRows, RoutedShape};
use super::{blocks, cfg, ok, Cuda, DeviceMatrix, SHARED_LIMIT};
use crate::backend::{SwiGluGroup, Weight};
use crate::codec::affine::kernels::AffineView;
use crate::codec::affine::lowbit::words_per_row;
use crate::codec::affine::GROUP_SIZE;

/// Rows of `x` one affine matrix-vector launch takes (the kernel's `AFF_MAXB`).
pub(super) const AFFINE_MAX_BATCH: usize = 4;
/// Output rows per affine matrix-vector block (the kernel's `AFF_WARPS`).
pub(super) const AFFINE_WARPS: usize = 8;
/// Above this many rows an affine product expands the matrix to f32 and runs one GEMM:
/// the matrix-vector kernel would read the weights once per 4 rows.
pub const AFFINE_GEMM_ROWS: usize = 8;
/// u64 words per group in the grouped kernels' table (the kernel's `GROUP_ENTRY`).
pub(super) const GROUP_ENTRY: usize = 11;
/// u64 words per expert in a routed block's table (the kernel's `ROUTED_ENTRY`).
pub(super) const ROUTED_ENTRY: usize = 9;
/// Output rows per warp of the routed expert kernels (the kernel's `ROUTED_ROWS`).
pub(super) const ROUTED_ROWS: usize = 4;

kernel_params! {
    /// A product's shape: output rows, the matrix's stored columns and the input's width
    /// (read as zeros up to `cols`).
    MatShape => { rows: i32, cols: i32, in_dim: i32 }
}

kernel_params! {
    /// A route's pairs as the routed kernels read them: the expert table, each pair's
    /// expert id, and the pairs a row.
    RoutePairs => { table: Ptr, ids: Ptr, top_k: i32 }
}

kernel_params! {
    /// An affine matrix as stored: codes, scales and biases.
    Codes => { w: Ptr, s: Ptr, bi: Ptr }
}

pub(super) const AFFINE_MATVEC: Builds<3> = bits!("affine_matvec");
kernel_args! {
    /// `out[b] = W · x[b]` for `batch` rows of `x`.
    AffineMatvec for &AFFINE_MATVEC.names => {
        w: Codes, x: Ptr, out: Ptr, shape: MatShape, batch: i32,
    }
}

pub(super) const AFFINE_DEQUANT: Builds<3> = bits!("affine_dequant");
kernel_args! {
    /// `out = W` expanded to f32, `rows × cols`.
    AffineDequant for &AFFINE_DEQUANT.names => { w: Codes, out: Ptr, rows: i32, cols: i32 }
}

pub(super) const AFFINE_GATHER: Builds<3> = bits!("affine_gather");
kernel_args! {
    /// `out[r] = W[ids[r]]` expanded to f32 for `n` ids (u32 bits), rows of `cols`; an id
    /// of `rows` or more gives a row of NaN.
    AffineGather for &AFFINE_GATHER.names => {
        w: Codes, ids: Ptr, out: Ptr, n: i32, cols: i32, rows: u32,
    }
}

pub(super) const AFFINE_GATE_UP: Builds<3> = bits!("affine_gate_up");
kernel_args! {
    /// Each group's gate and up products of its rows (`x_rows`) of `x`, by the group
    /// `table`; blocks stage `tile` rows of x at once.
    AffineGateUp for &AFFINE_GATE_UP.names => {
        table: Ptr, x_rows: Ptr, x: Ptr, gate: Ptr, up: Ptr, shape: MatShape, tile: i32,
    }
}

pub(super) const AFFINE_DOWN: Builds<3> = bits!("affine_down");
kernel_args! {
    /// Each group's down products of its rows of `x` (the SiLU outputs, in group order).
    AffineDown for &AFFINE_DOWN.names => {
        table: Ptr, x: Ptr, out: Ptr, shape: MatShape, tile: i32,
    }
}

pub(super) const AFFINE_ROUTED_GATE_UP: Builds<3> = bits!("affine_routed_gate_up");
kernel_args! {
    /// Gate and up of each (row, expert) pair of a route.
    AffineRoutedGateUp for &AFFINE_ROUTED_GATE_UP.names => {
        pairs: RoutePairs, x: Ptr, gate: Ptr, up: Ptr, shape: MatShape,
    }
}

pub(super) const AFFINE_ROUTED_DOWN: Builds<3> = bits!("affine_routed_down");
kernel_args! {
    /// Down of each pair's `silu(gate) ⊙ up`.
    AffineRoutedDown for &AFFINE_ROUTED_DOWN.names => {
        pairs: RoutePairs, gate: Ptr, up: Ptr, out: Ptr, shape: MatShape,
    }
}

pub(super) const MOE_COMBINE: &str = "moe_combine";
kernel_args! {
    /// `out[r] = Σ_j weights[r, j] · down[r, j]` over a row's `top_k` pairs.
    MoeCombine for &[MOE_COMBINE] => {
        down: Ptr, weights: Ptr, out: Ptr, top_k: i32, width: i32, n: i64,
    }
}

impl MatShape {
    pub fn new(rows: usize, cols: usize, in_dim: usize) -> MatShape {
        MatShape {
            rows: rows as i32,
            cols: cols as i32,
            in_dim: in_dim as i32,
        }
    }
}

/// A device copy of an affine matrix.
pub(super) struct DeviceAffine {
    /// The matrix as stored, row by row.
    pub rows: AffineRows,
    /// Host words sampled when it was copied (first, middle, last).
    fingerprint: [u32; 3],
    /// The same matrix in unit tiles ([`unit_tiles`]), made with the device copy where
    /// one-row products read it so ([`Cuda::tiles_take`]).
    pub tiles: Option<DeviceTiles>,
}

/// An affine matrix on the device as stored: codes row by row, scales and biases.
pub(super) struct AffineRows {
    pub words: CudaSlice<u32>,
    pub scales: CudaSlice<u16>,
    pub biases: CudaSlice<u16>,
}

impl AffineRows {
    /// The three parts' device addresses, as a routing or group table holds them.
    pub fn addresses(&self, stream: &CudaStream) -> [u64; 3] {
        let c = self.codes(stream);
        [c.w.0, c.s.0, c.bi.0]
    }

    /// The three parts as a kernel takes them.
    pub fn codes(&self, stream: &CudaStream) -> Codes {
        Codes {
            w: Ptr(self.words.device_ptr(stream).0),
            s: Ptr(self.scales.device_ptr(stream).0),
            bi: Ptr(self.biases.device_ptr(stream).0),
        }
    }
}

impl DeviceAffine {
    /// Bytes on the device, both copies.
    pub fn bytes(&self) -> usize {
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
pub(super) struct DeviceTiles {
    pub words: CudaSlice<u32>,
    /// Each unit's scales and biases, row by row.
    pub sb: CudaSlice<u16>,
}

/// A 4- or 2-bit affine matrix in unit tiles (kernels/affine_mma.cu, `load_unit_tiled`):
/// for each tile of [`RMMA_ROWS`] rows and 64-column group (a unit), its 32 lanes' words
/// one lane after another, lane 4g + q holding row g's words of its quarter of the unit,
/// then row g + 8's (two words each at 4 bits, one at 2); then, apart, each unit's scale
/// and bias row by row. Rows past the matrix are zeros. A warp reads a unit as whole
/// cache lines where the row-major layout spreads it over 16 rows' lines: the LM head,
/// which the one-row kernel streams round after round, reads ~16% faster
/// (`tools/gpu-microbench`, bench/results/gpu/weight_stream.log).
pub(super) fn unit_tiles(w: &AffineView<'_>) -> (Vec<u32>, Vec<u16>) {
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
pub(super) fn tile_units(rows: usize, cols: usize) -> usize {
    rows.div_ceil(RMMA_ROWS) * (cols / GROUP_SIZE)
}

/// The u32 words and u16 scales-and-biases of a `rows × cols` matrix at `bits` (4 or 2)
/// in unit tiles ([`unit_tiles`]).
pub(super) fn tile_lengths(rows: usize, cols: usize, bits: u32) -> (usize, usize) {
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
pub(super) type AffineKey = (usize, usize, usize, usize, u32);

pub(super) fn affine_key(w: &AffineView<'_>) -> AffineKey {
    (
        w.words.as_ptr() as usize,
        w.words.len(),
        w.scales.as_ptr() as usize,
        w.biases.as_ptr() as usize,
        w.bits,
    )
}

pub(super) fn fingerprint(w: &AffineView<'_>) -> [u32; 3] {
    let n = w.words.len();
    if n == 0 {
        return [0; 3];
    }
    [w.words[0], w.words[n / 2], w.words[n - 1]]
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
pub(super) fn routed_shared(cols: usize) -> usize {
    affine_tile(cols).1 + (cols / 32) * 4
}

impl Cuda {
    /// `out[r] = w[ids[r]]` expanded to f32 for `n` ids in device memory (`u32` bits):
    /// an embedding lookup of an affine-coded table.
    pub(super) fn gather_affine<I: DevicePtr<T>, T>(
        &self,
        w: &AffineView<'_>,
        ids: &I,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if n == 0 {
            return;
        }
        let d = self.device_affine(w, false);
        let args = AffineGather {
            w: d.rows.codes(&self.stream),
            ids: self.ptr(ids),
            out: self.ptr_mut(out),
            n: n as i32,
            cols: w.cols as i32,
            rows: w.rows.min(u32::MAX as usize) as u32,
        };
        let chunks = n * w.cols / 32;
        self.launch(
            AFFINE_GATHER.of(w.bits),
            cfg(blocks(chunks, 256) as usize, 256, 0),
            args,
        );
    }

    /// The device copy of `w`, made on first use; with `dense` (a dense layer's matrix,
    /// not an expert's), also in unit tiles where [`tiles_take`](Self::tiles_take) it.
    pub(super) fn device_affine(&self, w: &AffineView<'_>, dense: bool) -> Arc<DeviceAffine> {
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

    /// `w` in unit tiles on the device.
    pub(super) fn upload_tiles(&self, w: &AffineView<'_>) -> DeviceTiles {
        let (words, sb) = unit_tiles(w);
        DeviceTiles {
            words: self.upload_u32(&words),
            sb: ok(self.stream.clone_htod(&sb), "upload"),
        }
    }

    /// Whether one-row products of the dense matrix `w` read it in unit tiles: at 4 or 2
    /// bits, every such matrix's (the LM head's streamed ~16% faster in tiles, and every
    /// dense matrix in tiles measured +4.8% decode at 4 bits, +3.7% at 2: thirteenth
    /// round, docs/notes/gpu-05-2026-12-02-rounds-12-15.md), at the cost of the matrix's
    /// bytes again in device memory.
    fn tiles_take(&self, w: &AffineView<'_>) -> bool {
        matches!(w.bits, 4 | 2)
    }

    /// `d` (the device copy of `w`) in unit tiles, for a one-row product of it alone:
    /// where [`tiles_take`](Self::tiles_take) it and the copy was made with `d` (never
    /// later: a first use may come while a step is being recorded, where no upload may
    /// run).
    pub(super) fn tiles_of<'d>(
        &self,
        w: &AffineView<'_>,
        d: &'d DeviceAffine,
    ) -> Option<&'d DeviceTiles> {
        d.tiles.as_ref().filter(|_| self.tiles_take(w))
    }

    /// [`Backend::matmul_affine`](crate::backend::Backend::matmul_affine) on a device
    /// copy, with the row count deciding between the one-row tensor-core kernel, the
    /// matrix-vector kernel, the grouped GEMM on tensor cores and expand-then-GEMM.
    pub(super) fn affine_product(
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
        if self.dense_mma_takes(&[Weight::Affine(*w)], rows, in_dim) {
            let o = self.ptr_mut(out);
            let tiled = self.tiles_of(w, d).is_some();
            let shape = [rows, w.cols, in_dim];
            self.launch_dense_mma(w.bits, &[(d, w.rows, o)], x, shape, None, tiled);
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
            let chunks = w.rows * w.cols / 32;
            let args = AffineDequant {
                w: d.codes(&self.stream),
                out: self.ptr_mut(&mut dense),
                rows: w.rows as i32,
                cols: w.cols as i32,
            };
            let launch = cfg(blocks(chunks, 256) as usize, 256, 0);
            self.launch(AFFINE_DEQUANT.of(w.bits), launch, args);
            self.gemm_xwt(x, &dense, rows, in_dim, w.cols, w.rows, out);
            return;
        }
        let name = AFFINE_MATVEC.of(w.bits);
        let (tile, chunk_bytes) = affine_tile(w.cols);
        let grid = w.rows.div_ceil(AFFINE_WARPS);
        let mut t0 = 0;
        while t0 < rows {
            let nb = tile.min(rows - t0);
            let args = AffineMatvec {
                w: d.codes(&self.stream),
                x: self.ptr(&x.slice(t0 * in_dim..(t0 + nb) * in_dim)),
                out: self.ptr_mut(&mut out.slice_mut(t0 * w.rows..(t0 + nb) * w.rows)),
                shape: MatShape::new(w.rows, w.cols, in_dim),
                batch: nb as i32,
            };
            let launch = cfg(grid, (AFFINE_WARPS * 32) as u32, nb * chunk_bytes);
            self.launch(name, launch, args);
            t0 += nb;
        }
    }

    /// The MoE dispatch of [`Backend::swiglu_groups`](crate::backend::Backend::swiglu_groups)
    /// for affine groups sharing one shape: one upload of the group table, then either
    /// (every group of at most [`AFFINE_GEMM_ROWS`] rows, as in a decode step) one
    /// matrix-vector launch for every gate and up product, one SiLU, one launch for every
    /// down product and one scatter, or (a prompt, on tensor cores) the grouped GEMMs
    /// `expert_mma_gate_up` (SiLU inside) and `expert_mma_down` (scatter inside). Without
    /// tensor cores groups of more rows are left out. Returns the groups it did not take.
    pub(super) fn swiglu_grouped<'g, 'a>(
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
        // The grouped GEMMs read the experts as stored.
        let experts = RoutedShape {
            bits,
            tiled: false,
            inter,
            up_cols,
            down_cols,
        };
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
        let at = |v: &CudaView<'_, u32>| self.ptr(v);
        let table_v = at(&meta.slice(..rows_at));
        let rows_v = at(&meta.slice(rows_at..rows_at + pairs));
        let scales_v = at(&meta.slice(rows_at + pairs..tiles_at));
        let raw = |n: usize| ok(unsafe { self.stream.alloc::<f32>(n.max(1)) }, "alloc");

        if gemm {
            let h = raw(pairs * inter);
            let tiles = (words.len() - tiles_at) / 2;
            // A grid's y extent is at most 65 535 tiles; longer prompts take several.
            for t0 in (0..tiles).step_by(65_535) {
                let pair_tiles = PairTiles {
                    table: table_v,
                    tiles: at(&meta.slice(tiles_at + 2 * t0..)),
                    tiles_n: Ptr::NULL,
                    x_rows: rows_v,
                };
                let io = [self.ptr(x), self.ptr(&h), self.ptr_mut(out)];
                let grid_tiles = (tiles - t0).min(65_535);
                self.launch_expert_gemms(experts, hidden, pair_tiles, grid_tiles, scales_v, io);
            }
            drop(keep);
            return rest;
        }

        let (mut gate, mut up, mut down) =
            (raw(pairs * inter), raw(pairs * inter), raw(pairs * hidden));
        let (tile, row_bytes) = affine_tile(up_cols);
        let args = AffineGateUp {
            table: table_v,
            x_rows: rows_v,
            x: self.ptr(x),
            gate: self.ptr_mut(&mut gate),
            up: self.ptr_mut(&mut up),
            shape: MatShape::new(inter, up_cols, hidden),
            tile: tile as i32,
        };
        let grid = LaunchConfig {
            grid_dim: (inter.div_ceil(AFFINE_WARPS) as u32, n_groups as u32, 2),
            block_dim: ((AFFINE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (tile * row_bytes) as u32,
        };
        self.launch(AFFINE_GATE_UP.of(bits), grid, args);

        let n = pairs * inter;
        let args = SiluMul {
            gate: self.ptr_mut(&mut gate),
            up: self.ptr(&up),
            n: n as i64,
        };
        self.launch_each(SILU_MUL, n, args);

        let (tile, row_bytes) = affine_tile(down_cols);
        let args = AffineDown {
            table: table_v,
            x: self.ptr(&gate),
            out: self.ptr_mut(&mut down),
            shape: MatShape::new(hidden, down_cols, inter),
            tile: tile as i32,
        };
        let grid = LaunchConfig {
            grid_dim: (hidden.div_ceil(AFFINE_WARPS) as u32, n_groups as u32, 1),
            block_dim: ((AFFINE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (tile * row_bytes) as u32,
        };
        self.launch(AFFINE_DOWN.of(bits), grid, args);

        let args = ScatterAddRows {
            src: self.ptr(&down),
            rows: rows_v,
            scales: scales_v,
            dst: self.ptr_mut(out),
            width: hidden as i32,
        };
        self.launch_rows(SCATTER_ADD_ROWS, pairs, hidden, args);
        drop(keep);
        rest
    }

    /// A decode step's routed affine experts on CUDA cores, reading them as stored: the
    /// route kernel, gate and up of each pair into `gate` and `up`, down into `d`, and the
    /// weighted combine into `out` (the scratch of [`Cuda::routed_scratch_at`]).
    pub(super) fn launch_routed_rows(
        &self,
        r: &Routed<'_>,
        shape: RoutedShape,
        [ids, weights, gate, up, d]: [Ptr; 5],
        io: RoutedRows,
    ) {
        let (x, rows, hidden, probs, out) = (io.x, io.rows, io.hidden, io.probs, io.out);
        let k = r.route.top_k;
        let (inter, pairs) = (shape.inter, rows * k);
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
        let pairs = RoutePairs {
            table: r.table,
            ids,
            top_k: k as i32,
        };
        // Gate and up of each pair into `gate` and `up`, down of `silu(gate) ⊙ up` into
        // `d`, each pair's row apart; the combine adds each row's pairs, weighted.
        let up_shape = MatShape::new(inter, shape.up_cols, hidden);
        let args = AffineRoutedGateUp {
            pairs,
            x,
            gate,
            up,
            shape: up_shape,
        };
        let launch = grid(inter, shape.up_cols, 2);
        self.launch(AFFINE_ROUTED_GATE_UP.of(shape.bits), launch, args);
        let down_shape = MatShape::new(hidden, shape.down_cols, inter);
        let args = AffineRoutedDown {
            pairs,
            gate,
            up,
            out: d,
            shape: down_shape,
        };
        let launch = grid(hidden, shape.down_cols, 1);
        self.launch(AFFINE_ROUTED_DOWN.of(shape.bits), launch, args);

        let args = MoeCombine {
            down: d,
            weights,
            out,
            top_k: k as i32,
            width: hidden as i32,
            n: (rows * hidden) as i64,
        };
        self.launch_each(MOE_COMBINE, rows * hidden, args);
    }
}

#[cfg(test)]
mod tests {
    use super::{unit_tiles, words_per_row};
    use crate::codec::affine::AffineMatrix;
    use crate::testing::fresh;

    #[test]
    fn unit_tiles_give_each_lane_the_words_and_scales_its_rows_hold() {
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
}
