//! VQ experts on tensor cores (kernels/vq_mma.cu): each codeword looked up from the book
//! straight into an `mma.sync` fragment, for rungs of 4- to 16-value vectors. A prompt's
//! pairs are grouped by expert for two grouped GEMMs (`vq_expert_mma_*`); a decode
//! step's run on `routed_vq_*_mma`, whose launches vq.rs makes.

use cudarc::driver::LaunchConfig;

use super::affine::RoutePairs;
use super::launch::{kernel_args, kernel_params, Ptr};
use super::program::{dims, Builds};
use super::routed::{Routed, RoutedRows};
use super::vq::{
    vq_book_bytes, VqBook, VqDownIn, VqDownOut, VqGateUpOut, VqRoutedShape, VQR_WARPS,
};
use super::{ok, Cuda};
use crate::codec::vq::row_bytes;

/// 16-row tiles of gate and up a `routed_vq_gate_up_mma_*` block takes (its `VQM_TILES`).
pub(super) const VQM_TILES: usize = 2;
/// Warps of a `vq_expert_mma_*` block, and its output rows in gate/up (64 a matrix,
/// four warps each) and in down (the kernels' `VQG_WARPS`).
pub(super) const VQG_WARPS: usize = 8;
const VQG_GATE_UP_OUTPUTS: usize = 64;
const VQG_DOWN_OUTPUTS: usize = 128;
/// 16-byte units of a staged input row of a `vq_expert_mma_*` block (its `VQG_LDU`).
pub(super) const VQG_LDU: usize = 9;
/// (Row, expert) pairs of a `vq_expert_mma_*` tile, as the affine grouped GEMMs'.
const VQG_TILE_ROWS: usize = super::expert_gemm::EXPERT_TILE_ROWS;

pub(super) const VQ_EXPERT_MMA_GATE_UP: Builds<3> = dims!(mma "vq_expert_mma_gate_up");
pub(super) const VQ_EXPERT_MMA_DOWN: Builds<3> = dims!(mma "vq_expert_mma_down");
pub(super) const ROUTED_VQ_GATE_UP_MMA: Builds<3> = dims!(mma "routed_vq_gate_up_mma");
pub(super) const ROUTED_VQ_DOWN_MMA: Builds<3> = dims!(mma "routed_vq_down_mma");

kernel_params! {
    /// The pairs a VQ grouped GEMM takes: the group table, the (group, first pair)
    /// `tiles` and their count, and each grouped pair's own index.
    VqTiles => { groups: Ptr, tiles: Ptr, tiles_n: Ptr, pair_ids: Ptr }
}

kernel_args! {
    /// Over the tiles: gate and up of each pair's rotated row (`xr`, `width` wide) with
    /// the SiLU into `h`.
    VqExpertMmaGateUp for &VQ_EXPERT_MMA_GATE_UP.names => {
        tiles: VqTiles, xr: Ptr, h: Ptr, rows: i32, width: i32, book: VqBook,
    }
}

kernel_args! {
    /// Over the tiles: `out[x_rows[..]] += pair_scales[..] · down · hr[..]`.
    VqExpertMmaDown for &VQ_EXPERT_MMA_DOWN.names => {
        tiles: VqTiles, x_rows: Ptr, pair_scales: Ptr, hr: Ptr, out: Ptr, rows: i32,
        width: i32, book: VqBook,
    }
}

kernel_args! {
    /// A decode step's gate and up of each pair on tensor cores, each block rotating its
    /// row itself, with the SiLU into `h`.
    RoutedVqGateUpMma for &ROUTED_VQ_GATE_UP_MMA.names => {
        pairs: RoutePairs, x: Ptr, out: VqGateUpOut,
    }
}

kernel_args! {
    /// A decode step's down of each row's pairs on tensor cores, weighted and added in
    /// order.
    RoutedVqDownMma for &ROUTED_VQ_DOWN_MMA.names => { input: VqDownIn, out: VqDownOut }
}

/// Shared memory a `routed_vq_*_mma` block stages `rows` rows of a matrix's codes
/// (`row_bytes` each) and norms (`blocks` fp16 each) in: each code row in an odd number
/// of 16-byte chunks, one more than it may touch (the kernels' `vqm_code_stride`), and
/// the norms in whole chunks from the one holding the first (`staged_bytes`).
fn staged_rows(rows: usize, row_bytes: usize, blocks: usize) -> usize {
    let code_stride = 16 * ((row_bytes.div_ceil(16) + 1) | 1);
    rows * code_stride + (rows * blocks * 2).next_multiple_of(16) + 16
}

/// Dynamic shared memory of a `vq_expert_mma_*` block of `mats` matrices, less the
/// book: each matrix's tile of inputs staged as f16 hi and lo parts (rows of `VQG_LDU`
/// 16-byte units), and a norm for each warp's rows.
fn vq_gemm_shared(mats: usize) -> usize {
    mats * 2 * VQG_TILE_ROWS * VQG_LDU * 16 + VQG_WARPS * 16 * 4
}

impl VqRoutedShape {
    /// Dynamic shared memory of `routed_vq_gate_up_mma_*`, less the book: the row
    /// rotated for gate and for up as f16 hi and lo halves (with 8 words of padding
    /// each), the block's rows of each matrix's codes and norms, and each warp's partial
    /// sums of 16 rows.
    pub fn mma_gate_up_shared(&self) -> usize {
        let rows = VQM_TILES * 16;
        let staged = staged_rows(rows, row_bytes(self.rung, self.hidden), self.up_blocks());
        2 * ((self.up_width() + 8) * 4 + staged) + VQR_WARPS * 16 * 4
    }

    /// Dynamic shared memory of `routed_vq_down_mma_*`, less the book: each of a
    /// token's `top_k` rows rotated as f16 halves, the block's 16 rows of each pair's
    /// codes and norms, and the partial sums of 16 rows of each pair's part (the warps
    /// split a pair's units `VQR_WARPS / top_k` ways).
    pub fn mma_down_shared(&self, top_k: usize) -> usize {
        let parts = (VQR_WARPS / top_k).max(1);
        let staged = staged_rows(16, row_bytes(self.rung, self.inter), self.down_blocks());
        top_k * ((self.down_width() + 8) * 4 + staged + parts * 16 * 4)
    }
}

impl Cuda {
    /// [`launch_routed_vq`](Self::launch_routed_vq) for a prompt, on tensor cores: the
    /// pairs grouped by expert ([`group_pairs`](Self::group_pairs)), each pair's row
    /// rotated for gate and up, the grouped gate/up GEMM with the SiLU into `h` (pair
    /// order), `h` rotated for down, and the grouped down GEMM adding each pair's weighted
    /// output into its row of `out` (zeroed first).
    pub(super) fn launch_routed_vq_gemm(
        &self,
        r: &Routed<'_>,
        shape: VqRoutedShape,
        io: RoutedRows,
    ) {
        let (x, rows, hidden, probs, out) = (io.x, io.rows, io.hidden, io.probs, io.out);
        let inter = shape.inter;
        let pairs = rows * r.route.top_k;
        let groups = self.group_pairs(r, rows, probs, true);
        let ids = self.ptr(&groups.ids);
        let pair_ids = groups.pair_ids.as_ref().map_or(Ptr::NULL, |p| self.ptr(p));
        let (table, tiles, tiles_n) = (
            self.ptr(&groups.table),
            self.ptr(&groups.tiles),
            self.ptr(&groups.tiles_n),
        );
        let mut rotated = self.rotated_pairs(shape, pairs);
        let (xr, hr) = self.rotated_at(&mut rotated, shape, pairs);
        let h = ok(unsafe { self.stream.alloc::<f32>(pairs * inter) }, "alloc");
        let h_at = self.ptr(&h);

        let book = self.vq_book(shape.rung);
        let book_bytes = vq_book_bytes(shape.rung);
        let dim = shape.rung.dim as u32;
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
        let (book_shared, bytes) = with_book(vq_gemm_shared(2));
        let pair_tiles = VqTiles {
            groups: table,
            tiles,
            tiles_n,
            pair_ids,
        };
        let up_book = shape.book(self.ptr(&*book), false, book_shared);
        let args = VqExpertMmaGateUp {
            tiles: pair_tiles,
            xr,
            h: h_at,
            rows: inter as i32,
            width: shape.up_width() as i32,
            book: up_book,
        };
        let gate_up = launch(inter, VQG_GATE_UP_OUTPUTS, bytes);
        self.launch(VQ_EXPERT_MMA_GATE_UP.of(dim), gate_up, args);

        self.launch_pair_rotation(r, ids, pairs, h_at, true, hr, inter, shape.down_block);
        self.fill_at(out, 0.0, rows * hidden);
        let (book_shared, bytes) = with_book(vq_gemm_shared(1));
        let down_book = shape.book(self.ptr(&*book), true, book_shared);
        let args = VqExpertMmaDown {
            tiles: pair_tiles,
            x_rows: self.ptr(&groups.pair_rows),
            pair_scales: self.ptr(&groups.pair_weights),
            hr,
            out,
            rows: hidden as i32,
            width: shape.down_width() as i32,
            book: down_book,
        };
        let down = launch(hidden, VQG_DOWN_OUTPUTS, bytes);
        self.launch(VQ_EXPERT_MMA_DOWN.of(dim), down, args);
    }
}

#[cfg(test)]
mod tests {
    use super::staged_rows;
    use crate::backend::cuda::vq::{vq_book_bytes, VqRoutedShape, VQR_SHARED_BOOK};
    use crate::backend::cuda::SHARED_LIMIT;
    use crate::codec::vq::Rung;

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
}
