//! Dense products (kernels/matvec.cu, cuBLAS): f32 and bf16 matrices times a few rows on
//! the matrix-vector kernels (cuBLAS' GEMM runs far under bandwidth there, and the
//! kernels keep cuBLAS out of a recorded decode step), more rows through cuBLAS.

use std::sync::atomic::Ordering;

use cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::launch::{kernel_args, Ptr};
use super::norm::{Bf16ToF32, SplitBf16, BF16_TO_F32, SPLIT_BF16};
use super::{blocks, cfg, ok, Cuda};

/// A dense weight matrix (or embedding table) in device memory, as
/// [`Backend::upload_matrix`](crate::backend::Backend::upload_matrix) made it.
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
pub(super) fn is_bf16_exact(v: f32) -> bool {
    v.to_bits() & 0xffff == 0
}

/// Rows of `x` up to which a dense product runs as the matrix-vector kernel (its
/// `MV_MAXB`) rather than cuBLAS; also what one VQ matrix-vector launch takes (`VQ_MAXB`).
pub(super) const MATVEC_MAX_BATCH: usize = 4;
/// Columns of a row one warp of the one-row bf16 kernels takes (their `MV_ONE_COLS`).
pub(super) const MV_ONE_COLS: usize = 2048;

pub(super) const MATVEC_F32: &str = "matvec_f32";
pub(super) const MATVEC_BF16: &str = "matvec_bf16";
pub(super) const MATVEC_BF16_ONE: &str = "matvec_bf16_one";
pub(super) const MATVEC_BF16_ONE_LATE: &str = "matvec_bf16_one_late";
kernel_args! {
    /// `out[b] = w · x[b]` for `batch` rows of `x`; `w` is `rows × cols`.
    Matvec for &[MATVEC_F32, MATVEC_BF16, MATVEC_BF16_ONE, MATVEC_BF16_ONE_LATE] => {
        w: Ptr, x: Ptr, out: Ptr, rows: i32, cols: i32, batch: i32,
    }
}

pub(super) const MATVEC_BF16_3: &str = "matvec_bf16_3";
pub(super) const MATVEC_BF16_3_ONE: &str = "matvec_bf16_3_one";
kernel_args! {
    /// Three bf16 products of the same rows: `o_i = w_i · x`, `w_i` of `r_i` rows.
    Matvec3 for &[MATVEC_BF16_3, MATVEC_BF16_3_ONE] => {
        w0: Ptr, w1: Ptr, w2: Ptr, x: Ptr, o0: Ptr, o1: Ptr, o2: Ptr,
        r0: i32, r1: i32, r2: i32, cols: i32, batch: i32,
    }
}

pub(super) const MATVEC_BF16_NORM_ONE_LATE: &str = "matvec_bf16_norm_one_late";
kernel_args! {
    /// `out = w · RMSNorm(x + delta)·norm_w` for one row, `sum = x + delta` (where
    /// `delta` is non-null).
    MatvecNormOneLate for &[MATVEC_BF16_NORM_ONE_LATE] => {
        w: Ptr, x: Ptr, delta: Ptr, norm_w: Ptr, eps: f32, sum: Ptr, out: Ptr,
        rows: i32, cols: i32,
    }
}

/// The bf16 matrix-vector kernel of one matrix or of three for `rows` rows of x, `cols`
/// wide, and its launch for `out_rows` output rows: the one-row versions (a decode step,
/// rows of whole 8s) keep each lane's loads in flight at once, a warp per part of a row
/// ([`one_row_parts`]); the others take a warp per row.
pub(super) fn bf16_matvec(
    three: bool,
    rows: usize,
    cols: usize,
    out_rows: usize,
) -> (&'static str, LaunchConfig) {
    let one = rows == 1 && cols.is_multiple_of(8);
    let rows_per_block = if one { 8 / one_row_parts(cols) } else { 8 };
    let name = match (three, one) {
        (false, false) => MATVEC_BF16,
        (false, true) => MATVEC_BF16_ONE,
        (true, false) => MATVEC_BF16_3,
        (true, true) => MATVEC_BF16_3_ONE,
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
pub(super) fn one_row_takes(cols: usize) -> bool {
    cols.is_multiple_of(8) && one_row_parts(cols) * MV_ONE_COLS >= cols
}

impl Cuda {
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

    /// [`Backend::matmul`](crate::backend::Backend::matmul) into any device buffer: the
    /// matrix-vector kernel for a few rows, cuBLAS otherwise, a bf16 matrix widened to f32
    /// first (or split into bf16 parts on tensor cores).
    pub(super) fn dense_product<O: DevicePtrMut<f32>>(
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
        let (xp, o) = (self.ptr(x), self.ptr_mut(out));
        let matvec = |w: Ptr| Matvec {
            w,
            x: xp,
            out: o,
            rows: out_dim as i32,
            cols: in_dim as i32,
            batch: rows as i32,
        };
        match w {
            DeviceMatrix::F32(w) if rows <= MATVEC_MAX_BATCH && in_dim.is_multiple_of(4) => {
                let launch = cfg(out_dim.div_ceil(8), 256, 0);
                self.launch(MATVEC_F32, launch, matvec(self.ptr(w)));
            }
            DeviceMatrix::F32(w) => self.gemm_xwt(x, w, rows, in_dim, in_dim, out_dim, out),
            // Any width: the kernel falls back to one value per lane off whole 8s.
            DeviceMatrix::Bf16(w) if rows <= MATVEC_MAX_BATCH => {
                let (name, launch) = self.dense_bf16_matvec(false, rows, in_dim, out_dim);
                self.launch(name, launch, matvec(self.ptr(w)));
            }
            DeviceMatrix::Bf16(w) if self.tensor_cores() => {
                self.gemm_bf16_split(x, w, rows, in_dim, out_dim, out)
            }
            DeviceMatrix::Bf16(w) => {
                let n = out_dim * in_dim;
                let mut scratch = self.grown(&self.dense_scratch, n);
                let wide = scratch.as_mut().expect("grown");
                let args = Bf16ToF32 {
                    src: self.ptr(w),
                    dst: self.ptr_mut(wide),
                    n: n as i64,
                };
                let launch = cfg(blocks(n, 256).min(132 * 16) as usize, 256, 0);
                self.launch(BF16_TO_F32, launch, args);
                self.gemm_xwt(x, &*wide, rows, in_dim, in_dim, out_dim, out);
            }
        }
    }

    /// Three bf16 products of the same `rows` (at most [`MATVEC_MAX_BATCH`]) rows in one
    /// launch, `out_dims` rows each.
    pub(super) fn launch_matvec_bf16_3(
        &self,
        x: &CudaSlice<f32>,
        ws: [&CudaSlice<u16>; 3],
        rows: usize,
        in_dim: usize,
        out_dims: [usize; 3],
        outs: [&mut CudaSlice<f32>; 3],
    ) {
        let total: usize = out_dims.iter().sum();
        let (name, launch) = self.dense_bf16_matvec(true, rows, in_dim, total);
        let [w0, w1, w2] = ws.map(|w| self.ptr(w));
        let [o0, o1, o2] = outs.map(|o| self.ptr_mut(o));
        let [r0, r1, r2] = out_dims.map(|d| d as i32);
        let args = Matvec3 {
            w0,
            w1,
            w2,
            x: self.ptr(x),
            o0,
            o1,
            o2,
            r0,
            r1,
            r2,
            cols: in_dim as i32,
            batch: rows as i32,
        };
        self.launch(name, launch, args);
    }

    /// `out[rows, n] = x[rows, k] · w[n, k]ᵀ` for a bf16 `w` on tensor cores: x is split
    /// into bf16 hi and lo parts (`split_bf16`) and cuBLAS adds `w·hiᵀ` and `w·loᵀ` in
    /// f32, so x keeps about 16 bits where one bf16 rounding would keep 8; every product
    /// of a bf16 weight and a bf16 part is exact in f32.
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
        let base = self.ptr_mut(scratch.as_mut().expect("grown"));
        let (hi, lo) = (base, Ptr(base.0 + lo_at as u64));
        let args = SplitBf16 {
            x: self.ptr(x),
            hi,
            lo,
            n: len as i64,
        };
        let launch = cfg(blocks(len, 256).min(132 * 16) as usize, 256, 0);
        self.launch(SPLIT_BF16, launch, args);
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
                    part.0 as *const std::ffi::c_void,
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
    pub(super) fn gemm_xwt<W: DevicePtr<f32>, O: DevicePtrMut<f32>>(
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
}

#[cfg(test)]
mod tests {
    use super::{
        bf16_matvec, is_bf16_exact, one_row_takes, MATVEC_BF16, MATVEC_BF16_3_ONE, MATVEC_BF16_ONE,
    };
    use crate::testing::fresh;
    use half::bf16;

    #[test]
    fn one_row_bf16_products_take_rows_of_whole_8s_up_to_eight_warps_reach() {
        assert_eq!(bf16_matvec(false, 1, 2048, 10).0, MATVEC_BF16_ONE);
        assert_eq!(bf16_matvec(true, 1, 4096, 10).0, MATVEC_BF16_3_ONE);
        assert_eq!(bf16_matvec(false, 2, 2048, 10).0, MATVEC_BF16);
        assert_eq!(bf16_matvec(false, 1, 2044, 10).0, MATVEC_BF16);
        // One warp a row of 2048: eight output rows a block; four parts of 8192: two.
        assert_eq!(bf16_matvec(false, 1, 2048, 17).1.grid_dim.0, 3);
        assert_eq!(bf16_matvec(false, 1, 8192, 17).1.grid_dim.0, 9);
        assert!(one_row_takes(8 * 2048) && !one_row_takes(8 * 2048 + 8));
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
