//! A prompt's affine experts on tensor cores (kernels/expert_gemm.cu): the (row, expert)
//! pairs grouped by expert, on the device where the route is (`moe_group_pairs`), then
//! two grouped GEMMs, gate and up with the SiLU inside, down with the weighted scatter
//! inside. A prompt's dense affine products run on the down GEMM too, as one group.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::affine::MatShape;
use super::affine::{DeviceAffine, GROUP_ENTRY};
use super::launch::{kernel_args, kernel_params, Ptr};
use super::program::{bits, tiled, Builds};
use super::routed::{Routed, RoutedRows, RoutedShape};
use super::{cfg, ok, Cuda};
use crate::backend::Backend;
use crate::codec::affine::kernels::AffineView;

/// (Row, expert) pairs per block of the grouped expert GEMMs (the kernels' `MMA_BM`).
pub(super) const EXPERT_TILE_ROWS: usize = 32;
/// Output rows per block of the grouped expert GEMMs (the kernels' `MMA_BN`).
pub(super) const EXPERT_TILE_OUTPUTS: usize = 64;

kernel_params! {
    /// The pairs a grouped GEMM takes: the group `table` (GROUP_ENTRY words a group), the
    /// (group, first pair) `tiles` (`tiles_n` of them, or the grid's where null) and each
    /// grouped pair's row of the input or output, `x_rows`.
    PairTiles => { table: Ptr, tiles: Ptr, tiles_n: Ptr, x_rows: Ptr }
}

pub(super) const EXPERT_MMA_GATE_UP: Builds<3> = bits!("expert_mma_gate_up");
pub(super) const EXPERT_MMA_GATE_UP_TILED: Builds<2> = tiled!("expert_mma_gate_up");
kernel_args! {
    /// Over the tiles: `h[pair] = silu(gate · x[x_rows[pair]]) ⊙ (up · x[x_rows[pair]])`.
    ExpertMmaGateUp for &EXPERT_MMA_GATE_UP.and(&EXPERT_MMA_GATE_UP_TILED) => {
        tiles: PairTiles, x: Ptr, h: Ptr, shape: MatShape,
    }
}

pub(super) const EXPERT_MMA_DOWN: Builds<3> = bits!("expert_mma_down");
pub(super) const EXPERT_MMA_DOWN_TILED: Builds<2> = tiled!("expert_mma_down");
kernel_args! {
    /// Over the tiles: `out[x_rows[pair]] += pair_scales[pair] · down · h[pair]`.
    ExpertMmaDown for &EXPERT_MMA_DOWN.and(&EXPERT_MMA_DOWN_TILED) => {
        tiles: PairTiles, pair_scales: Ptr, h: Ptr, out: Ptr, shape: MatShape,
    }
}

pub(super) const MOE_GROUP_PAIRS: &str = "moe_group_pairs";
kernel_args! {
    /// A route's pairs (`ids`, `weights`) grouped by expert: the group table (`groups`,
    /// from the expert `table`), each grouped pair's row, weight and (non-null) index, and
    /// the tiles with their count.
    MoeGroupPairs for &[MOE_GROUP_PAIRS] => {
        ids: Ptr, weights: Ptr, pairs: i32, top_k: i32, experts: i32, table: Ptr, groups: Ptr,
        pair_rows: Ptr, pair_weights: Ptr, pair_ids: Ptr, tiles: Ptr, tiles_n: Ptr,
    }
}

/// A prompt's routed pairs grouped by expert on the device ([`Cuda::group_pairs`]):
/// the route (ids and weights a pair), the group table (GROUP_ENTRY words an expert),
/// each grouped pair's row, weight and (when asked for) own index, and the (group, first
/// pair) tiles with their count. Kept until the launches that read them are queued.
pub(super) struct PairGroups {
    pub ids: CudaSlice<u32>,
    pub weights: CudaSlice<u32>,
    pub table: CudaSlice<u64>,
    pub pair_rows: CudaSlice<u32>,
    pub pair_weights: CudaSlice<u32>,
    pub pair_ids: Option<CudaSlice<u32>>,
    pub tiles: CudaSlice<u32>,
    pub tiles_n: CudaSlice<u32>,
    /// The most tiles there could be, which the GEMM grids are sized for.
    pub most_tiles: usize,
}

/// Whether the grouped GEMMs' grid, sized for the most tiles `pairs` pairs over
/// `experts` experts could need, fits a grid's y extent.
pub(super) fn gemm_grid_fits(pairs: usize, experts: usize) -> bool {
    pairs / EXPERT_TILE_ROWS + experts <= 65_535
}

impl Cuda {
    /// `rows` input rows times an affine matrix on tensor cores: the grouped expert GEMM
    /// (`expert_mma_down_*`) over one group that holds every row, with unit weights, so a
    /// prompt's dense products read the codes as the experts' do and keep f32 precision.
    pub(super) fn affine_gemm(
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
        entry[10] = rows as u64;
        let table = ok(self.stream.clone_htod(&entry), "upload");
        let tiles: Vec<u32> = (0..rows.div_ceil(EXPERT_TILE_ROWS))
            .flat_map(|t| [0, (t * EXPERT_TILE_ROWS) as u32])
            .collect();
        let tiles = self.upload_u32(&tiles);
        let pair_rows = self.upload_u32(&(0..rows as u32).collect::<Vec<_>>());
        let ones = self.upload(&vec![1.0f32; rows]);
        self.fill(out, 0.0, rows * w.rows);
        let tiles = PairTiles {
            table: self.ptr(&table),
            tiles: self.ptr(&tiles),
            tiles_n: Ptr::NULL,
            x_rows: self.ptr(&pair_rows),
        };
        let args = ExpertMmaDown {
            tiles,
            pair_scales: self.ptr(&ones),
            h: self.ptr(x),
            out: self.ptr_mut(out),
            shape: MatShape::new(w.rows, w.cols, in_dim),
        };
        let launch = LaunchConfig {
            grid_dim: (
                w.rows.div_ceil(EXPERT_TILE_OUTPUTS) as u32,
                rows.div_ceil(EXPERT_TILE_ROWS) as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(EXPERT_MMA_DOWN.of(w.bits), launch, args);
    }

    /// [`launch_routed`](Self::launch_routed) for a prompt, on tensor cores and with no
    /// host round trip: the route and the pairs grouped by expert on the device
    /// ([`group_pairs`](Self::group_pairs)), then the grouped GEMMs over a grid sized for
    /// the most tiles there could be (the kernels read the count). `out` is zeroed and the
    /// down GEMM adds each pair's weighted output into its row.
    pub(super) fn launch_routed_gemm(&self, r: &Routed<'_>, shape: RoutedShape, io: RoutedRows) {
        let (x, rows, hidden, probs, out) = (io.x, io.rows, io.hidden, io.probs, io.out);
        let pairs = rows * r.route.top_k;
        let groups = self.group_pairs(r, rows, probs, false);
        let h = ok(
            unsafe { self.stream.alloc::<f32>(pairs * shape.inter) },
            "alloc",
        );
        self.fill_at(out, 0.0, rows * hidden);
        let tiles = PairTiles {
            table: self.ptr(&groups.table),
            tiles: self.ptr(&groups.tiles),
            tiles_n: self.ptr(&groups.tiles_n),
            x_rows: self.ptr(&groups.pair_rows),
        };
        let pair_weights = self.ptr(&groups.pair_weights);
        let (h, grid_tiles) = (self.ptr(&h), groups.most_tiles);
        self.launch_expert_gemms(shape, hidden, tiles, grid_tiles, pair_weights, [x, h, out]);
    }

    /// Routes `rows` rows (`moe_route`) and groups their pairs by expert on the device
    /// (`moe_group_pairs`), with each grouped pair's own index when `with_ids`.
    pub(super) fn group_pairs(
        &self,
        r: &Routed<'_>,
        rows: usize,
        probs: Ptr,
        with_ids: bool,
    ) -> PairGroups {
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
        let (ids, weights) = (self.ptr(&g.ids), self.ptr(&g.weights));
        self.launch_route(r, rows, probs, ids, weights);
        let args = MoeGroupPairs {
            ids,
            weights,
            pairs: pairs as i32,
            top_k: k as i32,
            experts: e as i32,
            table: r.table,
            groups: self.ptr(&g.table),
            pair_rows: self.ptr(&g.pair_rows),
            pair_weights: self.ptr(&g.pair_weights),
            pair_ids: g.pair_ids.as_ref().map_or(Ptr::NULL, |p| self.ptr(p)),
            tiles: self.ptr(&g.tiles),
            tiles_n: self.ptr(&g.tiles_n),
        };
        self.launch(MOE_GROUP_PAIRS, cfg(1, 1024, 3 * 4 * e), args);
        g
    }

    /// The two grouped expert GEMMs of experts of `shape` over `grid_tiles` pair tiles
    /// (`tiles`), for a residual stream of `hidden`: gate and up of the rows of `x` with
    /// the SiLU into `h` (`[pairs, inter]`), then down with each pair's output, weighted
    /// by `pair_weights`, added into its row of `out`.
    pub(super) fn launch_expert_gemms(
        &self,
        shape: RoutedShape,
        hidden: usize,
        tiles: PairTiles,
        grid_tiles: usize,
        pair_weights: Ptr,
        [x, h, out]: [Ptr; 3],
    ) {
        let grid = |outputs: usize| LaunchConfig {
            grid_dim: (
                outputs.div_ceil(EXPERT_TILE_OUTPUTS) as u32,
                grid_tiles as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (bits, inter) = (shape.bits, shape.inter);
        let (gate_up, down) = if shape.tiled {
            (
                EXPERT_MMA_GATE_UP_TILED.of(bits),
                EXPERT_MMA_DOWN_TILED.of(bits),
            )
        } else {
            (EXPERT_MMA_GATE_UP.of(bits), EXPERT_MMA_DOWN.of(bits))
        };
        let args = ExpertMmaGateUp {
            tiles,
            x,
            h,
            shape: MatShape::new(inter, shape.up_cols, hidden),
        };
        self.launch(gate_up, grid(inter), args);
        let args = ExpertMmaDown {
            tiles,
            pair_scales: pair_weights,
            h,
            out,
            shape: MatShape::new(hidden, shape.down_cols, inter),
        };
        self.launch(down, grid(hidden), args);
    }
}
