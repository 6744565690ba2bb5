//! Products with plain f32 matrices: `gemm` for many rows, dot products split across
//! threads for a few. The unquantized case of every codec: coded kernels fall back to it
//! once enough rows amortise decoding a matrix, and the fast CPU backend runs dense
//! layers with it.

use rayon::prelude::*;

/// Below this many rows a product is a handful of matrix-vector products: splitting the
/// output features across threads beats gemm's packing, which pays off only for tiles.
const GEMV_MAX_ROWS: usize = 4;

/// Output features per rayon task in the matrix-vector path: enough work to amortise
/// scheduling, few enough tasks to balance.
const GEMV_CHUNK: usize = 64;

/// Dot product with `L` independent accumulators, which the compiler vectorises (a sum in
/// order would run one lane at a time); the tail past the last whole `L` in order.
#[inline(always)]
pub(crate) fn dot_lanes<const L: usize>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes::<8>(a, b)
}

/// `out[rows, out_dim] = x[rows, in_dim] · wᵀ` with `w` as `[out_dim, in_dim]`, on every
/// thread.
pub fn matmul(x: &[f32], w: &[f32], rows: usize, in_dim: usize, out_dim: usize, out: &mut [f32]) {
    matmul_with(x, w, rows, in_dim, out_dim, out, true);
}

/// The same product on the calling thread alone, for callers that are already parallel.
pub fn matmul_serial(
    x: &[f32],
    w: &[f32],
    rows: usize,
    in_dim: usize,
    out_dim: usize,
    out: &mut [f32],
) {
    matmul_with(x, w, rows, in_dim, out_dim, out, false);
}

/// [`matmul`] on every thread when `parallel`, else on the calling thread alone.
pub fn matmul_with(
    x: &[f32],
    w: &[f32],
    rows: usize,
    in_dim: usize,
    out_dim: usize,
    out: &mut [f32],
    parallel: bool,
) {
    let out = &mut out[..rows * out_dim];
    if rows <= GEMV_MAX_ROWS && !parallel {
        for r in 0..rows {
            let xr = &x[r * in_dim..(r + 1) * in_dim];
            for (o, wo) in out[r * out_dim..(r + 1) * out_dim]
                .iter_mut()
                .zip(w.chunks_exact(in_dim))
            {
                *o = dot(xr, wo);
            }
        }
        return;
    }
    if rows <= GEMV_MAX_ROWS {
        // out is [rows, out_dim]; transpose the work so each task owns a block of features.
        let mut cols = vec![0.0f32; rows * out_dim];
        cols.par_chunks_mut(GEMV_CHUNK * rows)
            .enumerate()
            .for_each(|(c, block)| {
                for (j, o) in block.chunks_mut(rows).enumerate() {
                    let feature = c * GEMV_CHUNK + j;
                    let wo = &w[feature * in_dim..(feature + 1) * in_dim];
                    for (r, v) in o.iter_mut().enumerate() {
                        *v = dot(&x[r * in_dim..(r + 1) * in_dim], wo);
                    }
                }
            });
        for (feature, o) in cols.chunks(rows).enumerate() {
            for (r, &v) in o.iter().enumerate() {
                out[r * out_dim + feature] = v;
            }
        }
        return;
    }
    // SAFETY: every pointer/stride pair describes memory inside the slices above:
    // dst is rows×out_dim row-major, lhs rows×in_dim row-major, and rhs is w read as
    // its transpose (in_dim×out_dim with row stride 1 and column stride in_dim).
    unsafe {
        gemm::gemm(
            rows,
            out_dim,
            in_dim,
            out.as_mut_ptr(),
            1,
            out_dim as isize,
            false,
            x.as_ptr(),
            1,
            in_dim as isize,
            w.as_ptr(),
            in_dim as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            if parallel {
                gemm::Parallelism::Rayon(0)
            } else {
                gemm::Parallelism::None
            },
        );
    }
}

/// A matrix read in place from a slice: element `(i, j)` at `data[i * row_stride + j *
/// col_stride]` (a head's slice of a cache, or a matrix read as its transpose).
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a> {
    /// The values, from element `(0, 0)` on.
    pub data: &'a [f32],
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
    /// Elements from one row to the next.
    pub row_stride: usize,
    /// Elements from one column to the next.
    pub col_stride: usize,
}

impl Strided<'_> {
    /// Panics unless every element lies inside `data`.
    fn check(&self) {
        if self.rows > 0 && self.cols > 0 {
            let last = (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride;
            assert!(last < self.data.len(), "strided view past its slice");
        }
    }
}

/// `out = a · b` on the calling thread, `out` row-major `[a.rows, b.cols]`.
///
/// # Panics
/// If the inner sizes differ, a view reaches past its slice, or `out` is too short.
pub fn matmul_strided(a: Strided<'_>, b: Strided<'_>, out: &mut [f32]) {
    assert_eq!(a.cols, b.rows, "inner sizes");
    a.check();
    b.check();
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let out = &mut out[..m * n];
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: `check` put every element of both views inside their slices, and `out`
    // holds m × n values written row-major.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
