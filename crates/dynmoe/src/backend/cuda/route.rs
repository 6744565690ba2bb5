//! Routing on the device (kernels/route.cu): the router's product, the top-k of its
//! softmax (`moe_route`), and the argmax of a decode step's logits.

use cudarc::driver::{CudaSlice, CudaViewMut, LaunchConfig};

use super::affine_mma::InputNorm;
use super::launch::{kernel_args, Ptr};
use super::matvec::{
    bf16_matvec, one_row_takes, Matvec, MatvecNormOneLate, MATVEC_BF16_NORM_ONE_LATE,
    MATVEC_BF16_ONE_LATE,
};
use super::routed::{routed_mma_gate_up_shared, Routed, RoutedKind};
use super::{cfg, row_threads, Cuda, DeviceMatrix, SHARED_LIMIT};
use crate::backend::{Backend, MoeInput};

/// Most experts a routed expert kernel routes itself (the kernels' `ROUTE_SHARED_MAX`:
/// their candidates in static shared memory); more are routed by `moe_route` first.
pub(super) const ROUTE_SHARED_MAX: usize = 256;
/// Threads of an `argmax_rows` block (its `ARGMAX_THREADS`); a block takes a multiple of
/// four times this many values of a row.
pub(super) const ARGMAX_THREADS: usize = 256;
/// Rows one `argmax_rows` launch takes: its counts sit in the first this many floats of
/// the scratch buffer.
const ARGMAX_MAX_ROWS: usize = 1024;

pub(super) const MOE_ROUTE: &str = "moe_route";
kernel_args! {
    /// Each row's logits `probs` (`experts` a row) replaced by their softmax, and its
    /// `top_k` experts (those `keep` allows, where non-null) and weights (renormalized
    /// over the chosen where asked).
    MoeRoute for &[MOE_ROUTE] => {
        probs: Ptr, keep: Ptr, ids: Ptr, weights: Ptr, experts: i32, top_k: i32,
        renormalize: i32,
    }
}

pub(super) const ARGMAX_ROWS: &str = "argmax_rows";
kernel_args! {
    /// `out[r]` = the index of row r's largest value (as u32 bits): blocks of `chunk`
    /// values each, the last block of a row (by `count`) merging the partials.
    ArgmaxRows for &[ARGMAX_ROWS] => {
        x: Ptr, out: Ptr, dim: i32, chunk: i32, count: Ptr, part: Ptr, part_i: Ptr,
    }
}

impl Cuda {
    /// Whether the routed gate/up of `rows` rows behind router `gate` (the launch
    /// [`launch_routed`](Self::launch_routed) makes next) takes the early start: one row
    /// through a bf16 router of the one-row kernel, affine experts on tensor cores that
    /// route themselves, and the expert table in shared memory beside the staged units.
    pub(super) fn routes_gate_up_early(
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
    pub(super) fn moe_input<'x, 'r>(
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
                let residual = self.ptr(n.x);
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
    pub(super) fn launch_router<'r>(
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
            let InputNorm {
                delta,
                w: norm_w,
                eps,
                sum,
            } = n;
            let args = MatvecNormOneLate {
                w: self.ptr(w),
                x: residual,
                delta,
                norm_w,
                eps,
                sum,
                out: self.ptr_mut(logits),
                rows: e as i32,
                cols: hidden as i32,
            };
            self.launch(MATVEC_BF16_NORM_ONE_LATE, launch, args);
            return Routed {
                router_late: true,
                ..r
            };
        }
        if let DeviceMatrix::Bf16(w) = gate {
            if self.routes_gate_up_early(&r, gate, rows, hidden) {
                let (_, launch) = bf16_matvec(false, 1, hidden, e);
                let args = Matvec {
                    w: self.ptr(w),
                    x: self.ptr(x),
                    out: self.ptr_mut(logits),
                    rows: e as i32,
                    cols: hidden as i32,
                    batch: 1,
                };
                self.launch(MATVEC_BF16_ONE_LATE, launch, args);
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
    pub(super) fn launch_route(
        &self,
        r: &Routed<'_>,
        rows: usize,
        probs: Ptr,
        ids: Ptr,
        weights: Ptr,
    ) {
        let e = r.experts;
        let args = MoeRoute {
            probs,
            keep: r.keep,
            ids,
            weights,
            experts: e as i32,
            top_k: r.route.top_k as i32,
            renormalize: r.route.renormalize as i32,
        };
        // A block a row, a thread per expert up to 256 of them.
        self.launch(MOE_ROUTE, cfg(rows, row_threads(e), e * 4), args);
    }

    /// The index of the largest of each of `rows` rows of `dim` at `x`, as u32 bits into
    /// `out` (one a row).
    pub(super) fn launch_argmax_rows(&self, x: Ptr, rows: usize, dim: usize, out: Ptr) {
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
        let base = self.ptr(scratch.as_mut().expect("grown"));
        let (count, part, part_i) = (
            base,
            base.floats(ARGMAX_MAX_ROWS),
            base.floats(ARGMAX_MAX_ROWS + per_launch * splits),
        );
        for r0 in (0..rows).step_by(per_launch) {
            let n = per_launch.min(rows - r0);
            let args = ArgmaxRows {
                x: x.floats(r0 * dim),
                out: out.floats(r0),
                dim: dim as i32,
                chunk: chunk as i32,
                count,
                part,
                part_i,
            };
            let grid = LaunchConfig {
                grid_dim: (splits as u32, n as u32, 1),
                block_dim: (ARGMAX_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch(ARGMAX_ROWS, grid, args);
        }
    }
}
