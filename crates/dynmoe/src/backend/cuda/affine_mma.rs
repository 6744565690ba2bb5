//! One-row products of dense affine matrices on tensor cores (kernels/affine_mma.cu,
//! `dense_mma_*`): up to three matrices of the same input in one launch, optionally
//! reading the input through the residual add and norm before them. The fragment
//! layout and the staged 64-column units are shared with the routed experts' kernels
//! (kernels/routed.cu), whose shared memory is sized here too.

use cudarc::driver::CudaSlice;

use super::affine::DeviceAffine;
use super::launch::{kernel_args, Ptr};
use super::program::{bits, tiled, Builds};
use super::{cfg, Cuda, DeviceMatrix, SHARED_LIMIT};
use crate::backend::{AddNorm, Weight};
use crate::codec::affine::kernels::AffineView;
use crate::codec::affine::GROUP_SIZE;

/// Output rows of a `routed_mma_*` or `dense_mma_*` block (the kernels' `RMMA_ROWS`),
/// and its warps (`RMMA_WARPS`; `RMMA_DOWN_WARPS` for the routed down kernel, whose
/// partial sums of one matrix fill the two-matrix space of [`routed_mma_shared`]).
pub(super) const RMMA_ROWS: usize = 16;
pub(super) const RMMA_WARPS: usize = 8;
pub(super) const RMMA_DOWN_WARPS: usize = 16;
/// Blocks a multiprocessor of the one-row dense kernels' launch bound (their default
/// `DMMA_BLOCKS`).
pub(super) const DMMA_BLOCKS: usize = 3;
/// Shared memory of a staged 64-column unit of a `routed_mma_*` block: its f16 hi and lo
/// fragments (`RMMA_UNIT` words) and its sum.
pub(super) const RMMA_UNIT: usize = 80;
const RMMA_UNIT_BYTES: usize = RMMA_UNIT * 4 + 4;

pub(super) const DENSE_MMA: Builds<3> = bits!("dense_mma");
pub(super) const DENSE_MMA_TILED: Builds<2> = tiled!("dense_mma");
kernel_args! {
    /// `out_i = W_i · x` for the first `mats` of three matrices (codes, scales and biases;
    /// in tiles, the words, then the tiles' scales and biases twice; `rows_i` rows), `x`
    /// `in_dim` wide and read as zeros up to `cols`; a job split over `parts` warps.
    DenseMma for &DENSE_MMA.and(&DENSE_MMA_TILED) => {
        w0: Ptr, s0: Ptr, b0: Ptr, out0: Ptr, rows0: i32,
        w1: Ptr, s1: Ptr, b1: Ptr, out1: Ptr, rows1: i32,
        w2: Ptr, s2: Ptr, b2: Ptr, out2: Ptr, rows2: i32,
        mats: i32, x: Ptr, cols: i32, in_dim: i32, parts: i32,
    }
}

/// Input rows a `dense_mma_rows_*` launch takes at most (the kernels' `DMMA_ROWS`: two
/// columns of the B fragments a row).
pub(super) const DMMA_ROWS: usize = 4;
/// Most input rows a product takes through `dense_mma_rows_*`, [`DMMA_ROWS`] a launch
/// (several sequences' decode rows); more go to the grouped GEMM.
pub(super) const DMMA_ROWS_MAX: usize = 16;

pub(super) const DENSE_MMA_ROWS: Builds<3> = bits!("dense_mma_rows");
pub(super) const DENSE_MMA_ROWS_TILED: Builds<2> = tiled!("dense_mma_rows");
kernel_args! {
    /// [`DenseMma`] of `nrows` (up to [`DMMA_ROWS`]) input rows at once, `x` `[nrows,
    /// in_dim]` and each output `[nrows, rows_i]`.
    DenseMmaRows for &DENSE_MMA_ROWS.and(&DENSE_MMA_ROWS_TILED) => { mma: DenseMma, nrows: i32 }
}

pub(super) const DENSE_MMA_NORM: Builds<3> = bits!("dense_mma_norm");
pub(super) const DENSE_MMA_NORM_TILED: Builds<2> = tiled!("dense_mma_norm");
kernel_args! {
    /// [`DenseMma`] of `RMSNorm(x + delta)·norm_w`, `sum = x + delta` (where `delta` is
    /// non-null).
    DenseMmaNorm for &DENSE_MMA_NORM.and(&DENSE_MMA_NORM_TILED) => {
        mma: DenseMma, delta: Ptr, norm_w: Ptr, eps: f32, sum: Ptr,
    }
}

/// The residual add and norm a kernel applies to its input row (the kernels' `delta,
/// norm_w, eps, sum` arguments): a null `delta` or `sum` is not read or not written.
#[derive(Debug, Clone, Copy)]
pub(super) struct InputNorm {
    pub delta: Ptr,
    pub w: Ptr,
    pub eps: f32,
    pub sum: Ptr,
}

/// Dynamic shared memory of a `routed_mma_*` block staging `units` 64-column units, with
/// its partial sums of two matrices per warp.
pub(super) fn routed_mma_shared(units: usize) -> usize {
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

/// Dynamic shared memory of a `dense_mma_rows_*` block staging `nrows` rows of `groups`
/// groups: their units and sums, then the partial sums of [`DMMA_ROWS`] rows per warp.
fn dense_mma_rows_shared(groups: usize, nrows: usize) -> usize {
    nrows * groups * RMMA_UNIT_BYTES + RMMA_WARPS * DMMA_ROWS * RMMA_ROWS * 4
}

/// Input rows one `dense_mma_rows_*` launch over `groups` groups takes: as many as its
/// shared memory holds, at most [`DMMA_ROWS`] (0: not even one).
fn dense_rows_per_launch(groups: usize) -> usize {
    (1..=DMMA_ROWS)
        .rev()
        .find(|&n| dense_mma_rows_shared(groups, n) <= SHARED_LIMIT)
        .unwrap_or(0)
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

impl Cuda {
    /// `rows` input rows times up to three affine matrices of `cols` columns and the
    /// same bits (`mats`: device copy, rows, output address) on tensor cores: one row in
    /// one `dense_mma` launch, several [`DMMA_ROWS`] at a time by `dense_mma_rows`. `x`
    /// is `[rows, in_dim]`, read as zeros up to `cols`, each output `[rows, its rows]`;
    /// with `norm` (one row), the kernel reads it through that residual add and norm.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_dense_mma(
        &self,
        bits: u32,
        mats: &[(&DeviceAffine, usize, Ptr)],
        x: &CudaSlice<f32>,
        [rows, cols, in_dim]: [usize; 3],
        norm: Option<&InputNorm>,
        tiled: bool,
    ) {
        debug_assert!((1..=3).contains(&mats.len()));
        debug_assert!(rows == 1 || norm.is_none());
        let groups = cols / GROUP_SIZE;
        let tiles: usize = mats.iter().map(|m| m.1.div_ceil(RMMA_ROWS)).sum();
        let (parts, blocks) = dense_mma_layout(tiles, groups, self.sms, self.dmma_blocks);
        let shared = dense_mma_shared(groups, norm.is_some());
        let m = [0, 1, 2].map(|i| {
            // Unused slots repeat the first matrix with no rows.
            let (d, rows, out) = mats.get(i).copied().unwrap_or((mats[0].0, 0, mats[0].2));
            let (w, s, b) = match d.tiles.as_ref().filter(|_| tiled) {
                // The tiled kernels read scales and biases from one buffer.
                Some(t) => (self.ptr(&t.words), self.ptr(&t.sb), self.ptr(&t.sb)),
                None => {
                    let r = &d.rows;
                    (self.ptr(&r.words), self.ptr(&r.scales), self.ptr(&r.biases))
                }
            };
            (w, s, b, out, rows as i32)
        });
        let mma = DenseMma {
            w0: m[0].0,
            s0: m[0].1,
            b0: m[0].2,
            out0: m[0].3,
            rows0: m[0].4,
            w1: m[1].0,
            s1: m[1].1,
            b1: m[1].2,
            out1: m[1].3,
            rows1: m[1].4,
            w2: m[2].0,
            s2: m[2].1,
            b2: m[2].2,
            out2: m[2].3,
            rows2: m[2].4,
            mats: mats.len() as i32,
            x: self.ptr(x),
            cols: cols as i32,
            in_dim: in_dim as i32,
            parts: parts as i32,
        };
        if rows > 1 {
            let per = dense_rows_per_launch(groups);
            assert!(
                per > 0,
                "{cols} columns over the rows kernel's shared memory"
            );
            let name = match tiled {
                true => DENSE_MMA_ROWS_TILED.of(bits),
                false => DENSE_MMA_ROWS.of(bits),
            };
            for r0 in (0..rows).step_by(per) {
                let nrows = per.min(rows - r0);
                let at = |out: Ptr, n: i32| out.floats(r0 * n as usize);
                let args = DenseMmaRows {
                    mma: DenseMma {
                        out0: at(mma.out0, mma.rows0),
                        out1: at(mma.out1, mma.rows1),
                        out2: at(mma.out2, mma.rows2),
                        x: mma.x.floats(r0 * in_dim),
                        ..mma
                    },
                    nrows: nrows as i32,
                };
                let shared = dense_mma_rows_shared(groups, nrows);
                self.launch(name, cfg(blocks, (RMMA_WARPS * 32) as u32, shared), args);
            }
            return;
        }
        let launch = cfg(blocks, (RMMA_WARPS * 32) as u32, shared);
        let (plain, normed) = if tiled {
            (DENSE_MMA_TILED.of(bits), DENSE_MMA_NORM_TILED.of(bits))
        } else {
            (DENSE_MMA.of(bits), DENSE_MMA_NORM.of(bits))
        };
        match norm {
            None => self.launch(plain, launch, mma),
            Some(n) => {
                let args = DenseMmaNorm {
                    mma,
                    delta: n.delta,
                    norm_w: n.w,
                    eps: n.eps,
                    sum: n.sum,
                };
                self.launch(normed, launch, args);
            }
        }
    }

    /// Whether `dense_mma` takes the products of one row with `ws` in one launch:
    /// affine matrices of the same bits and columns, `in_dim` within them, on tensor cores.
    pub(super) fn dense_mma_takes(
        &self,
        ws: &[Weight<'_, DeviceMatrix>],
        rows: usize,
        in_dim: usize,
    ) -> bool {
        let Some(Weight::Affine(a)) = ws.first() else {
            return false;
        };
        let groups = a.cols / GROUP_SIZE;
        let fits = match rows {
            1 => dense_mma_shared(groups, false) <= SHARED_LIMIT,
            2..=DMMA_ROWS_MAX => dense_rows_per_launch(groups) > 0,
            _ => false,
        };
        fits && self.tensor_cores()
            && in_dim <= a.cols
            && ws
                .iter()
                .all(|w| matches!(w, Weight::Affine(b) if b.bits == a.bits && b.cols == a.cols))
    }

    /// Whether `dense_mma_norm` takes the products of one row with `ws` through the
    /// residual add and norm before them: `dense_mma` takes them, and the row through the
    /// norm fits beside its staged units.
    pub(super) fn dense_mma_folds_norm(
        &self,
        ws: &[Weight<'_, DeviceMatrix>],
        rows: usize,
        in_dim: usize,
    ) -> bool {
        let Some(Weight::Affine(a)) = ws.first() else {
            return false;
        };
        rows == 1
            && self.dense_mma_takes(ws, rows, in_dim)
            && dense_mma_shared(a.cols / GROUP_SIZE, true) <= SHARED_LIMIT
    }

    /// The products [`dense_mma_takes`](Self::dense_mma_takes) took, into `outs`.
    pub(super) fn dense_mma_product(
        &self,
        x: &CudaSlice<f32>,
        ws: &[Weight<'_, DeviceMatrix>],
        [rows, in_dim]: [usize; 2],
        outs: &[Ptr],
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
        let shape = [rows, views[0].cols, in_dim];
        self.launch_dense_mma(views[0].bits, &mats, x, shape, norm, tiled);
    }

    /// The [`InputNorm`] of `n` for a kernel that folds it in: `sum` gets `x + delta` (with
    /// a delta); nothing gets the normed row.
    pub(super) fn input_norm(
        &self,
        n: AddNorm<'_, CudaSlice<f32>>,
        sum: &mut CudaSlice<f32>,
    ) -> InputNorm {
        let delta = n.delta.map_or(Ptr::NULL, |d| self.ptr(d));
        InputNorm {
            delta,
            w: self.ptr(n.w),
            eps: n.eps,
            sum: if delta.is_null() {
                Ptr::NULL
            } else {
                self.ptr_mut(sum)
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::dense_mma_layout;

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
}
