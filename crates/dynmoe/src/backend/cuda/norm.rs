//! Norms, elementwise ops, embedding, RoPE and a decode step's small copies
//! (kernels/norm.cu): launches bound by their latency rather than by their bytes, each
//! one kernel.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::launch::{kernel_args, kernel_params, Args, Ptr};
use super::{blocks, cfg, one_d, row_threads, Cuda, DeviceMatrix};
use crate::backend::Weight;

/// Widest row a warp normalises alone (the kernels' `NORM_WARP_DIM`); wider rows take a
/// block each.
pub(super) const NORM_WARP_DIM: usize = 512;

pub(super) const FILL: &str = "fill";
kernel_args! {
    /// `x[..n] = v`.
    Fill for &[FILL] => { x: Ptr, v: f32, n: i64 }
}

pub(super) const EMBED: &str = "embed";
pub(super) const EMBED_BF16: &str = "embed_bf16";
kernel_args! {
    /// `out[r] = table[ids[r]]`, a block a row, NaN for an id of `rows` or more;
    /// `embed_bf16` from a table of bf16 bits.
    Embed for &[EMBED, EMBED_BF16] => { table: Ptr, ids: Ptr, out: Ptr, dim: i32, rows: u32 }
}

pub(super) const BF16_TO_F32: &str = "bf16_to_f32";
kernel_args! {
    /// `dst[..n]` = the bf16 `src[..n]` widened.
    Bf16ToF32 for &[BF16_TO_F32] => { src: Ptr, dst: Ptr, n: i64 }
}

pub(super) const SPLIT_BF16: &str = "split_bf16";
kernel_args! {
    /// `x` split into bf16 parts `hi` (x rounded) and `lo` (the rest rounded).
    SplitBf16 for &[SPLIT_BF16] => { x: Ptr, hi: Ptr, lo: Ptr, n: i64 }
}

kernel_params! {
    /// The rows an RMSNorm kernel takes: `rows` rows of `dim`, and the norm's epsilon.
    NormRows => { rows: i32, dim: i32, eps: f32 }
}

pub(super) const RMS_NORM: &str = "rms_norm";
kernel_args! {
    /// `out = RMSNorm(x)·w`.
    RmsNorm for &[RMS_NORM] => { x: Ptr, w: Ptr, out: Ptr, rows: NormRows }
}

pub(super) const RMS_NORM_INPLACE: &str = "rms_norm_inplace";
kernel_args! {
    /// `x = RMSNorm(x)·w`.
    RmsNormInplace for &[RMS_NORM_INPLACE] => { x: Ptr, w: Ptr, rows: NormRows }
}

pub(super) const ADD_RMS_NORM: &str = "add_rms_norm";
kernel_args! {
    /// `x += delta`, then `out = RMSNorm(x)·w`.
    AddRmsNorm for &[ADD_RMS_NORM] => { x: Ptr, delta: Ptr, w: Ptr, out: Ptr, rows: NormRows }
}

pub(super) const ADD_RMS_NORM_TO: &str = "add_rms_norm_to";
kernel_args! {
    /// `sum = x + delta`, then `out = RMSNorm(sum)·w`.
    AddRmsNormTo for &[ADD_RMS_NORM_TO] => {
        x: Ptr, delta: Ptr, w: Ptr, sum: Ptr, out: Ptr, rows: NormRows,
    }
}

pub(super) const ADD_BIAS: &str = "add_bias";
kernel_args! {
    /// `x[i] += bias[i % dim]`.
    AddBias for &[ADD_BIAS] => { x: Ptr, bias: Ptr, dim: i32, n: i64 }
}

pub(super) const ADD: &str = "add";
kernel_args! {
    /// `x += y`.
    Add for &[ADD] => { x: Ptr, y: Ptr, n: i64 }
}

pub(super) const SILU_MUL: &str = "silu_mul";
kernel_args! {
    /// `gate = silu(gate) ⊙ up`.
    SiluMul for &[SILU_MUL] => { gate: Ptr, up: Ptr, n: i64 }
}

pub(super) const CLAMP_VALUES: &str = "clamp_values";
kernel_args! {
    /// `x` clamped to `[-limit, limit]`.
    ClampValues for &[CLAMP_VALUES] => { x: Ptr, limit: f32, n: i64 }
}

pub(super) const SOFTMAX_ROWS: &str = "softmax_rows";
kernel_args! {
    /// Each row of `dim` replaced by its softmax, a block a row.
    SoftmaxRows for &[SOFTMAX_ROWS] => { x: Ptr, dim: i32 }
}

pub(super) const ROPE: &str = "rope";
kernel_args! {
    /// RoPE of each row's heads at `positions[r]`, or `pos0 + r` where `positions` is null.
    Rope for &[ROPE] => {
        x: Ptr, positions: Ptr, pos0: u32, inv_freq: Ptr, heads: i32, head_dim: i32,
    }
}

pub(super) const GATHER_ROWS: &str = "gather_rows";
kernel_args! {
    /// `dst[r] = src[rows[r]]`.
    GatherRows for &[GATHER_ROWS] => { src: Ptr, rows: Ptr, dst: Ptr, width: i32 }
}

pub(super) const SCATTER_ADD_ROWS: &str = "scatter_add_rows";
kernel_args! {
    /// `dst[rows[r]] += scales[r] · src[r]`, atomically.
    ScatterAddRows for &[SCATTER_ADD_ROWS] => {
        src: Ptr, rows: Ptr, scales: Ptr, dst: Ptr, width: i32,
    }
}

pub(super) const COPY_F4: &str = "copy_f4";
kernel_args! {
    /// `dst[..n4] = src[..n4]`, float4s.
    CopyF4 for &[COPY_F4] => { src: Ptr, dst: Ptr, n4: i64 }
}

pub(super) const WRITE_ROW_AT: &str = "write_row_at";
kernel_args! {
    /// `dst` row `*pos` = `src`.
    WriteRowAt for &[WRITE_ROW_AT] => { src: Ptr, dst: Ptr, pos: Ptr, width: i32 }
}

pub(super) const ADVANCE_STEP: &str = "advance_step";
kernel_args! {
    /// The token at `chosen` becomes `step`'s input, at the next position.
    AdvanceStep for &[ADVANCE_STEP] => { step: Ptr, chosen: Ptr }
}

impl NormRows {
    pub fn new(rows: usize, dim: usize, eps: f32) -> NormRows {
        NormRows {
            rows: rows as i32,
            dim: dim as i32,
            eps,
        }
    }

    /// The launch of the RMSNorm kernels: a warp per row for narrow rows (up to 8 a
    /// block), else a block per row with a thread per 4 values (at most 1024; at least
    /// 64, so the block sum has whole warps).
    fn launch(&self) -> LaunchConfig {
        let (rows, dim) = (self.rows as usize, self.dim as usize);
        if dim <= NORM_WARP_DIM {
            let per_block = rows.min(8);
            cfg(rows.div_ceil(per_block), (per_block * 32) as u32, 0)
        } else {
            let threads = dim.div_ceil(4).next_power_of_two().clamp(64, 1024);
            cfg(rows, threads as u32, 0)
        }
    }
}

impl Cuda {
    /// `x[..n] = v` on the device.
    pub fn fill(&self, x: &mut CudaSlice<f32>, v: f32, n: usize) {
        let x = self.ptr_mut(x);
        self.fill_at(x, v, n);
    }

    /// [`fill`](Self::fill) of the `n` floats at `x`.
    pub(super) fn fill_at(&self, x: Ptr, v: f32, n: usize) {
        if n == 0 {
            return;
        }
        let launch = cfg(blocks(n, 256).min(4096) as usize, 256, 0);
        self.launch(FILL, launch, Fill { x, v, n: n as i64 });
    }

    /// `dst[..n] = src[..n]` through the copy kernel (16-byte accesses), the reference
    /// bandwidth quantized kernels are measured against. `n` must be a multiple of 4.
    pub fn copy_kernel(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>, n: usize) {
        assert!(
            n.is_multiple_of(4),
            "copy of {n} floats is not whole float4s"
        );
        let args = CopyF4 {
            src: self.ptr(src),
            dst: self.ptr_mut(dst),
            n4: (n / 4) as i64,
        };
        let launch = cfg(blocks(n / 4, 256).min(132 * 16) as usize, 256, 0);
        self.launch(COPY_F4, launch, args);
    }

    /// `out[r] = table[ids[r]]` for `n` ids in device memory (`u32` bits, whatever the
    /// buffer's element type); a coded table decodes only those rows.
    pub(super) fn embed_rows<I: DevicePtr<T>, T>(
        &self,
        table: Weight<'_, DeviceMatrix>,
        dim: usize,
        ids: &I,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let table = match table {
            Weight::Dense(t) => t,
            Weight::Affine(w) => return self.gather_affine(&w, ids, n, out),
            Weight::Vq(w) => return self.gather_vq(&w, ids, n, out),
        };
        let (name, table, len) = match table {
            DeviceMatrix::Bf16(t) => (EMBED_BF16, self.ptr(t), t.len()),
            DeviceMatrix::F32(t) => (EMBED, self.ptr(t), t.len()),
        };
        let args = Embed {
            table,
            ids: self.ptr(ids),
            out: self.ptr_mut(out),
            dim: dim as i32,
            rows: (len / dim.max(1)).min(u32::MAX as usize) as u32,
        };
        // Up to a thread per value: a decode step's one row is a single block, whose
        // threads would otherwise each wait on several loads in turn.
        let threads = dim.next_power_of_two().clamp(32, 1024) as u32;
        self.launch(name, cfg(n, threads, 0), args);
    }

    /// One of the RMSNorm kernels (`args` of `name`) over `rows`' rows, if any.
    pub(super) fn launch_norm<A: Args>(&self, name: &'static str, rows: NormRows, args: A) {
        if rows.rows > 0 {
            self.launch(name, rows.launch(), args);
        }
    }

    /// One of the kernels of a thread an element (`args` of `name`) over `n` elements, if
    /// any.
    pub(super) fn launch_each<A: Args>(&self, name: &'static str, n: usize, args: A) {
        if let Some(launch) = one_d(n) {
            self.launch(name, launch, args);
        }
    }

    /// Each of `rows` rows of `dim` replaced by its softmax.
    pub(super) fn launch_softmax_rows(&self, x: Ptr, rows: usize, dim: usize) {
        if rows > 0 {
            let args = SoftmaxRows { x, dim: dim as i32 };
            self.launch(SOFTMAX_ROWS, cfg(rows, row_threads(dim), 0), args);
        }
    }

    /// RoPE of `rows` rows of `heads` heads at the positions `args` names.
    pub(super) fn launch_rope(&self, args: Rope, rows: usize, heads: usize, head_dim: usize) {
        self.launch(ROPE, cfg(rows * heads, row_threads(head_dim / 2), 0), args);
    }

    /// The row-wise kernel `name` (gather or scatter) over `rows` rows of `width`.
    pub(super) fn launch_rows<A: Args>(
        &self,
        name: &'static str,
        rows: usize,
        width: usize,
        args: A,
    ) {
        if rows > 0 {
            self.launch(name, cfg(rows, row_threads(width), 0), args);
        }
    }

    /// Row `*pos` of `dst` = `src`'s first row, `width` wide.
    pub(super) fn launch_write_row_at(&self, src: Ptr, dst: Ptr, pos: Ptr, width: usize) {
        let args = WriteRowAt {
            src,
            dst,
            pos,
            width: width as i32,
        };
        self.launch(WRITE_ROW_AT, cfg(blocks(width, 256) as usize, 256, 0), args);
    }

    /// The token at `chosen` into `step`, at the next position.
    pub(super) fn launch_advance_step(&self, step: Ptr, chosen: Ptr) {
        self.launch(ADVANCE_STEP, cfg(1, 1, 0), AdvanceStep { step, chosen });
    }
}
