//! CPU products with VQ-coded weights, read straight from the codes.
//!
//! `out[b * rows + o] = Σ_i x[b * cols + i] · w[o, i]`, the convention of
//! [`crate::codec::affine::kernels`].
//!
//! A block of a weight row is `w_b = n_b · D H v / √R` (norm `n_b`, signs `D`,
//! orthonormal Hadamard `H`, codewords `v`), so `w_b · x_b = n_b / √R · v · (H D x_b)`.
//! Each activation block is flipped and transformed once per call; a weight row is then
//! a sum over its vectors of one codebook lookup (`p` values) times `p` activations,
//! scaled by `n_b / √R` per block. No weight is ever transformed back.
//!
//! Up to [`EXPAND_ABOVE_ROWS`] activation rows the kernels run straight from the codes,
//! up to eight activation rows per pass over a weight row, so each looked-up codeword
//! serves all of them; above, the matrix is decoded once and multiplied with gemm. A
//! kernel call covers a run of weight rows. With AVX2, FMA and F16C, kernels built for
//! each rung's `(p, k)` read an fp16 copy of the codebook (picked at run time); blocks
//! too short for their steps (only in rows under 128 columns) take a generic loop.
//! Every variant is tested against [`matmul_reference`].
//!
//! At 2 bits (`k` = 16) the codebook is 1 MiB, as large as a core's L2 cache, and
//! nearly every lookup misses L1; that, not the arithmetic, is what the 2-bit product
//! costs beyond the smaller rungs (`benches/vq_kernels.rs` measures both, and the same
//! codes with their lookups confined to 512 or 32 KiB of the book). The lookups are
//! bound by the lines the caches can move, not by how many are in flight: on a Zen 4
//! core each of these was measured no faster, most of them slower: codewords
//! prefetched a few steps or a whole row ahead (into L1 or L2 only), two or four weight
//! rows interleaved per pass to share the activation loads, a column-blocked row order,
//! codes prefetched further ahead or non-temporally, a sweep of the book into cache
//! before the rows, other thread chunk sizes, and the book on a 2 MiB huge page.

use half::f16;

use super::codebook::Codebook;
use super::rotation::{fwht, signs};
use super::{row_bytes, VqView};
use crate::codec::affine::kernels::{by_rows, prefetch, worth_threads};

/// Above this many activation rows the weights are decoded and multiplied with gemm,
/// as the affine path does.
pub const EXPAND_ABOVE_ROWS: usize = 16;

/// Activation rows per pass over a weight row.
const TILE: usize = 8;

/// The activation rows of the passes over a weight row for `batch` rows: passes of
/// [`TILE`] while that many are left, then one of up to 4, then the rest. Kernels
/// exist for tiles of 1 to 4 and 8.
fn tiles(batch: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut t0 = 0;
    std::iter::from_fn(move || {
        let left = batch - t0;
        let tile = if left >= TILE { TILE } else { left.min(4) };
        (tile > 0).then(|| {
            t0 += tile;
            (t0 - tile, tile)
        })
    })
}

/// Bytes past the end of a row's codes that a kernel may read: rows closer than this
/// to the end of the codes are handed over from a padded copy.
const SLACK: usize = 16;

/// Rows ahead whose codes are requested from memory while the current one is worked on.
const PREFETCH_ROWS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Portable,
    /// AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        return Isa::Avx2;
    }
    Isa::Portable
}

/// Activation rows in the rotated domain, `[batch, blocks × R]`.
fn prepare(x: &[f32], batch: usize, w: &VqView<'_>) -> Vec<f32> {
    let (cols, block) = (w.cols, w.block);
    let width = w.blocks() * block;
    let s = signs(w.seed, block);
    let mut xp = vec![0.0f32; batch * width];
    for (dst, src) in xp.chunks_exact_mut(width).zip(x.chunks_exact(cols)) {
        for (b, d) in dst.chunks_exact_mut(block).enumerate() {
            let src = &src[b * block..((b + 1) * block).min(cols)];
            for (i, v) in d.iter_mut().enumerate() {
                *v = src.get(i).map_or(0.0, |x| x * s[i]);
            }
            fwht(d);
        }
    }
    xp
}

/// A run of `rows` consecutive weight rows: their codes, `rb` bytes a row, with at
/// least [`SLACK`] bytes after the last; their `[rows, blocks]` norms; the codebook as
/// f32 `[2^k, P]` and fp16; and `T` rotated activation rows `xs` apart.
struct RowArgs<'a> {
    rows: usize,
    codes: &'a [u8],
    rb: usize,
    norms: &'a [f16],
    k: usize,
    table: &'a [f32],
    /// The same codebook as fp16, for the x86 kernels.
    half: &'a [f16],
    /// `1 / √R`: a block's norm times this scales its sum of lookups.
    inv_root: f32,
    block: usize,
    blocks: usize,
    xp: &'a [f32],
    xs: usize,
}

/// The loop over the rows of `a`, writing row `r`'s `T` dots at `out[r * stride..]`;
/// `row` takes a row's codes (more bytes follow) and norms. Inlined into each kernel,
/// with `row`, so that a call covers many rows.
#[inline(always)]
fn each_row<const T: usize>(
    a: &RowArgs<'_>,
    out: &mut [f32],
    stride: usize,
    row: impl Fn(&[u8], &[f16]) -> [f32; TILE],
) {
    for r in 0..a.rows {
        if r + PREFETCH_ROWS < a.rows {
            let ahead = (r + PREFETCH_ROWS) * a.rb;
            prefetch(&a.codes[ahead..ahead + a.rb]);
        }
        let dots = row(
            &a.codes[r * a.rb..],
            &a.norms[r * a.blocks..(r + 1) * a.blocks],
        );
        out[r * stride..r * stride + T].copy_from_slice(&dots[..T]);
    }
}

/// The index of `k` bits at bit `at`: one unaligned 8-byte load away from the end.
#[inline(always)]
fn index(codes: &[u8], at: usize, k: usize) -> usize {
    let first = at / 8;
    let word = match codes.get(first..first + 8) {
        Some(b) => u64::from_le_bytes(b.try_into().unwrap()),
        None => return super::get_bits(codes, at, k) as usize,
    };
    ((word >> (at % 8)) & ((1u64 << k) - 1)) as usize
}

#[inline(always)]
fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// The row loop for vectors of `P` values and `T` activation rows: two sets of
/// accumulators, alternate vectors, so that consecutive multiply-adds do not wait on
/// each other. `FUSED` uses fused multiply-add, which is one instruction only where
/// FMA is compiled in.
#[inline(always)]
fn row_body<const P: usize, const T: usize, const FUSED: bool>(
    a: &RowArgs<'_>,
    codes: &[u8],
    norms: &[f16],
) -> [f32; TILE] {
    let per_block = a.block / P;
    let mut tot = [0.0f32; TILE];
    let mut at = 0;
    let step = |acc: &mut [[f32; P]; T], at: usize, x0: usize| {
        let idx = index(codes, at, a.k);
        let cw: &[f32; P] = a.table[idx * P..idx * P + P].try_into().unwrap();
        for (t, acc) in acc.iter_mut().enumerate() {
            let xv: &[f32; P] = a.xp[t * a.xs + x0..t * a.xs + x0 + P].try_into().unwrap();
            for l in 0..P {
                acc[l] = madd::<FUSED>(cw[l], xv[l], acc[l]);
            }
        }
    };
    for (b, n) in norms.iter().enumerate() {
        let mut acc0 = [[0.0f32; P]; T];
        let mut acc1 = [[0.0f32; P]; T];
        let x0 = b * a.block;
        let mut j = 0;
        while j + 2 <= per_block {
            step(&mut acc0, at, x0 + j * P);
            step(&mut acc1, at + a.k, x0 + (j + 1) * P);
            at += 2 * a.k;
            j += 2;
        }
        if j < per_block {
            step(&mut acc0, at, x0 + j * P);
            at += a.k;
        }
        for t in 0..T {
            let s: f32 = (0..P).map(|l| acc0[t][l] + acc1[t][l]).sum();
            tot[t] += n.to_f32() * a.inv_root * s;
        }
    }
    tot
}

/// A kernel: the rows of its arguments, each row's dots at `out[r * stride..]`.
type RowFn = fn(&RowArgs<'_>, &mut [f32], usize);

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! Kernels for one rung's `(P, K)` with AVX2, FMA and F16C. The codebook is read as
    //! fp16 (half the cache footprint; a 2^16 × 8 book is 1 MiB) and each 8 looked-up
    //! values are converted in one instruction and multiplied with 8 activations of
    //! each row of the tile.
    //!
    //! With `K` known, a step reads the codes of a whole number of bytes in one or two
    //! loads and takes its indices apart with constant shifts, so an index costs a
    //! shift and a mask instead of a load, a bounds check and variable shifts. The
    //! lookups of a step are independent of each other and of the multiply-adds, so
    //! the core keeps many in flight; several accumulators per row keep the adds from
    //! waiting on each other.

    use std::arch::x86_64::*;

    use half::f16;

    use super::{each_row, RowArgs, SLACK, TILE};

    /// Indices decoded per step: a whole number of bytes (`8 / gcd(K, 8)` indices) and
    /// at least four chunks of 8 values where those codes fit one 16-byte read.
    pub(super) const fn step_indices(p: usize, k: usize) -> usize {
        let tz = k.trailing_zeros() as usize;
        let whole = 8 >> if tz < 3 { tz } else { 3 };
        let mut u = if 32 / p > whole { 32 / p } else { whole };
        while u * k > 128 && u > whole {
            u /= 2;
        }
        u
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// The `k` bits at bit `at` of the 128-bit little-endian word `lo`, `hi`.
    #[inline(always)]
    fn field(lo: u64, hi: u64, at: usize, k: usize) -> usize {
        let v = if at + k <= 64 {
            lo >> at
        } else if at >= 64 {
            hi >> (at - 64)
        } else {
            lo >> at | hi << (64 - at)
        };
        (v & ((1u64 << k) - 1)) as usize
    }

    /// Chunk `c` (8 values) of a step whose indices are `idx`: one 8-value codeword,
    /// two 4-value or four 2-value ones, or half of a 16-value one.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn chunk<const P: usize>(half: *const u16, idx: &[usize; 8], c: usize) -> __m256 {
        let h = match P {
            16 => _mm_loadu_si128(half.add(16 * idx[c / 2] + 8 * (c % 2)).cast()),
            8 => _mm_loadu_si128(half.add(8 * idx[c]).cast()),
            4 => {
                let lo = _mm_loadl_epi64(half.add(4 * idx[2 * c]).cast());
                let hi = _mm_loadl_epi64(half.add(4 * idx[2 * c + 1]).cast());
                _mm_unpacklo_epi64(lo, hi)
            }
            _ => {
                let w = |j: usize| half.add(2 * idx[4 * c + j]).cast::<i32>().read_unaligned();
                _mm_setr_epi32(w(0), w(1), w(2), w(3))
            }
        };
        _mm256_cvtph_ps(h)
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available; `a.half` must hold `2^K · P` values,
    /// `a.xp` `T` rows `a.xs` apart of `norms.len() · a.block` values, `codes` the
    /// row's codes and [`SLACK`] bytes more, and `a.block / P` must be a multiple of
    /// [`step_indices`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn row_raw<const P: usize, const K: usize, const T: usize>(
        a: &RowArgs<'_>,
        codes: &[u8],
        norms: &[f16],
    ) -> [f32; TILE] {
        let u = step_indices(P, K);
        let chunks = u * P / 8;
        let lanes = match T {
            1 | 2 => 4,
            3 | 4 => 2,
            _ => 1,
        }
        .min(chunks);
        let steps = a.block / P / u;
        let half = a.half.as_ptr().cast::<u16>();
        let mut code = codes.as_ptr();
        let mut x = a.xp.as_ptr();
        let mut tot = [0.0f32; TILE];
        for n in norms {
            let m = n.to_f32() * a.inv_root;
            let mut acc = [[_mm256_setzero_ps(); 4]; T];
            for _ in 0..steps {
                let lo = code.cast::<u64>().read_unaligned();
                let hi = if u * K > 64 {
                    code.add(8).cast::<u64>().read_unaligned()
                } else {
                    0
                };
                let mut idx = [0usize; 8];
                for (i, v) in idx.iter_mut().enumerate().take(u) {
                    *v = field(lo, hi, i * K, K);
                }
                for c in 0..chunks {
                    let w = chunk::<P>(half, &idx, c);
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let xv = _mm256_loadu_ps(x.add(t * a.xs + 8 * c));
                        acc[c % lanes] = _mm256_fmadd_ps(w, xv, acc[c % lanes]);
                    }
                }
                code = code.add(u * K / 8);
                x = x.add(u * P);
            }
            for (tot, acc) in tot.iter_mut().zip(&acc) {
                let s = acc[1..lanes]
                    .iter()
                    .fold(acc[0], |s, &v| _mm256_add_ps(s, v));
                *tot += m * hsum(s);
            }
        }
        tot
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_raw<const P: usize, const K: usize, const T: usize>(
        a: &RowArgs<'_>,
        out: &mut [f32],
        stride: usize,
    ) {
        // SAFETY: as for `rows_raw`, whose checks cover every row.
        each_row::<T>(a, out, stride, |codes, norms| unsafe {
            row_raw::<P, K, T>(a, codes, norms)
        });
    }

    pub(super) fn fixed<const P: usize, const K: usize, const T: usize>(
        a: &RowArgs<'_>,
        out: &mut [f32],
        stride: usize,
    ) {
        let u = step_indices(P, K);
        assert!(a.half.len() >= P << K, "codebook of 2^{K} × {P}");
        assert_eq!(a.block / P / u * u * P, a.block, "block of {}", a.block);
        // Each row reads `blocks · block / P` indices of `K` bits, then up to `SLACK`
        // bytes past the last step.
        let used = a.blocks * a.block / P * K / 8;
        assert!(a.rows == 0 || a.codes.len() >= (a.rows - 1) * a.rb + used + SLACK);
        assert!(a.norms.len() >= a.rows * a.blocks);
        assert!(a.xp.len() >= (T - 1) * a.xs + a.blocks * a.block);
        // SAFETY: handed out by `row_fn` only when `detect` found AVX2, FMA and F16C;
        // the asserts cover every codebook index (`K` bits), code and activation read.
        unsafe { rows_raw::<P, K, T>(a, out, stride) }
    }

    pub(super) fn avx2<const P: usize, const T: usize>(
        a: &RowArgs<'_>,
        out: &mut [f32],
        stride: usize,
    ) {
        #[target_feature(enable = "avx2,fma")]
        fn inner<const P: usize, const T: usize>(a: &RowArgs<'_>, out: &mut [f32], stride: usize) {
            each_row::<T>(a, out, stride, |codes, norms| {
                super::row_body::<P, T, true>(a, codes, norms)
            });
        }
        // SAFETY: handed out by `row_fn` only when `detect` found AVX2 and FMA.
        unsafe { inner::<P, T>(a, out, stride) }
    }
}

fn portable<const P: usize, const T: usize>(a: &RowArgs<'_>, out: &mut [f32], stride: usize) {
    each_row::<T>(a, out, stride, |codes, norms| {
        row_body::<P, T, false>(a, codes, norms)
    });
}

/// The kernel for vectors of `p` values, `k`-bit indices, `t` activation rows and
/// blocks of `block` values.
fn row_fn(isa: Isa, p: usize, k: usize, t: usize, block: usize) -> RowFn {
    macro_rules! by_tile {
        ($f:ident, $p:literal) => {
            match t {
                1 => $f::<$p, 1>,
                2 => $f::<$p, 2>,
                3 => $f::<$p, 3>,
                4 => $f::<$p, 4>,
                8 => $f::<$p, 8>,
                _ => unreachable!("no kernel for tiles of {t}"),
            }
        };
    }
    macro_rules! by_dim {
        ($f:ident) => {
            match p {
                2 => by_tile!($f, 2),
                4 => by_tile!($f, 4),
                8 => by_tile!($f, 8),
                16 => by_tile!($f, 16),
                _ => unreachable!("no kernel for {p}-dimensional codewords"),
            }
        };
    }
    match isa {
        Isa::Portable => by_dim!(portable),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => match fixed_fn(p, k, t) {
            Some(f) if (block / p).is_multiple_of(x86::step_indices(p, k)) => f,
            _ => {
                use x86::avx2;
                by_dim!(avx2)
            }
        },
    }
}

/// The x86 kernel specialised for a ladder rung's `(p, k)`, if there is one.
#[cfg(target_arch = "x86_64")]
fn fixed_fn(p: usize, k: usize, t: usize) -> Option<RowFn> {
    macro_rules! rungs {
        ($(($p:literal, $k:literal)),*) => {
            match (p, k) {
                $(($p, $k) => Some(match t {
                    1 => x86::fixed::<$p, $k, 1>,
                    2 => x86::fixed::<$p, $k, 2>,
                    3 => x86::fixed::<$p, $k, 3>,
                    4 => x86::fixed::<$p, $k, 4>,
                    8 => x86::fixed::<$p, $k, 8>,
                    _ => unreachable!("no kernel for tiles of {t}"),
                }),)*
                _ => None,
            }
        };
    }
    rungs!(
        (16, 11),
        (8, 8),
        (8, 9),
        (8, 10),
        (8, 12),
        (8, 14),
        (8, 16),
        (4, 9),
        (4, 10),
        (4, 11),
        (4, 12),
        (4, 16),
        (2, 10)
    )
}

fn check(x: &[f32], batch: usize, w: &VqView<'_>, out: &[f32]) {
    assert!(
        x.len() >= batch * w.cols,
        "x holds {} values, {batch}×{} needed",
        x.len(),
        w.cols
    );
    assert!(
        out.len() >= batch * w.rows,
        "out holds {} values, {batch}×{} needed",
        out.len(),
        w.rows
    );
    assert!(
        w.codes.len() >= w.rows * row_bytes(w.rung, w.cols) && w.norms.len() >= w.rows * w.blocks(),
        "view parts shorter than its shape"
    );
}

fn run(
    x: &[f32],
    batch: usize,
    w: &VqView<'_>,
    book: &Codebook,
    out: &mut [f32],
    isa: Isa,
    parallel: bool,
) {
    check(x, batch, w, out);
    let out = &mut out[..batch * w.rows];
    if batch == 0 || w.rows == 0 {
        return;
    }
    let x = &x[..batch * w.cols];
    if batch > EXPAND_ABOVE_ROWS {
        let dense = w.decode_with(book);
        if parallel {
            crate::codec::dense::matmul(x, &dense, batch, w.cols, w.rows, out);
        } else {
            crate::codec::dense::matmul_serial(x, &dense, batch, w.cols, w.rows, out);
        }
        return;
    }
    let xp = prepare(x, batch, w);
    let (blocks, block) = (w.blocks(), w.block);
    let xs = blocks * block;
    let rb = row_bytes(w.rung, w.cols);
    let (p, k) = (w.rung.dim, w.rung.index_bits as usize);
    let inv_root = 1.0 / (block as f32).sqrt();
    let fns: Vec<(usize, RowFn)> = tiles(batch)
        .map(|(t0, tile)| (t0, row_fn(isa, p, k, tile, block)))
        .collect();
    // The rows from `padded_from` on, copied with `SLACK` zero bytes after them.
    let padded_from = match w.codes.len().checked_sub(rb + SLACK) {
        Some(room) => w.rows.min(room / rb + 1),
        None => 0,
    };
    let mut padded = w.codes[padded_from * rb..w.rows * rb].to_vec();
    padded.resize(padded.len() + SLACK, 0);
    let rows_fn = |o0: usize, dst: &mut [f32], _: &mut Vec<f32>| {
        let n = dst.len() / batch;
        // The rows before `padded_from` straight from the codes, the rest from the copy.
        let split = padded_from.clamp(o0, o0 + n) - o0;
        for (first, count, codes) in [
            (o0, split, &w.codes[o0 * rb..]),
            (
                o0 + split,
                n - split,
                &padded[(o0 + split).max(padded_from) * rb - padded_from * rb..],
            ),
        ] {
            if count == 0 {
                continue;
            }
            for &(t0, f) in &fns {
                let args = RowArgs {
                    rows: count,
                    codes,
                    rb,
                    norms: &w.norms[first * blocks..(first + count) * blocks],
                    k,
                    table: book.values(),
                    half: book.values_f16(),
                    inv_root,
                    block,
                    blocks,
                    xp: &xp[t0 * xs..],
                    xs,
                };
                let out = &mut dst[(first - o0) * batch + t0..];
                f(&args, out, batch);
            }
        }
    };
    let parallel = parallel && worth_threads(batch * w.rows * w.cols);
    by_rows(out, w.rows, batch, parallel, &rows_fn);
}

/// The codebook of `w`'s rung, compiled into the program.
pub(crate) fn shipped(w: &VqView<'_>) -> &'static Codebook {
    // The embedded codebooks are checked by the test suite; one failing to load is a
    // broken build, not bad input.
    w.rung
        .codebook()
        .unwrap_or_else(|e| panic!("{}: {e}", w.rung.name()))
}

/// `out[b * rows + o] = Σ_i x[b * cols + i] · w[o, i]` for `batch` activation rows,
/// threaded over output rows.
///
/// # Panics
/// If a buffer is too short for the shape.
pub fn matmul(x: &[f32], batch: usize, w: &VqView<'_>, out: &mut [f32]) {
    run(x, batch, w, shipped(w), out, detect(), true);
}

/// [`matmul`] on the calling thread, for callers that are already parallel.
pub fn matmul_serial(x: &[f32], batch: usize, w: &VqView<'_>, out: &mut [f32]) {
    run(x, batch, w, shipped(w), out, detect(), false);
}

/// The oracle: decodes `w` to f32 ([`VqView::decode`]) and multiplies plainly,
/// summing in f64.
pub fn matmul_reference(x: &[f32], batch: usize, w: &VqView<'_>, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let dense = w.decode_with(shipped(w));
    for b in 0..batch {
        let xr = &x[b * cols..(b + 1) * cols];
        for o in 0..rows {
            let wr = &dense[o * cols..(o + 1) * cols];
            let s: f64 = xr.iter().zip(wr).map(|(&a, &c)| a as f64 * c as f64).sum();
            out[b * rows + o] = s as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::vq::{VqMatrix, LADDER};
    use crate::testing::{fresh, poisoned, rel_err};

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if detect() != Isa::Portable {
                v.push(Isa::Avx2);
            }
        }
        v
    }

    #[test]
    fn every_rung_and_kernel_matches_the_reference() {
        // 1500 columns: a full block and a ragged tail; 80: one block of 128 with 48
        // columns of padding; 13: a single 16-wide block, too small for the x86 steps.
        // 768: four blocks of 256.
        for (rows, cols) in [(37usize, 1500usize), (21, 80), (9, 13), (11, 768)] {
            let w = fresh(rows * cols, (rows * cols) as u64);
            for (i, rung) in LADDER.into_iter().enumerate() {
                let m = VqMatrix::encode(&w, rows, cols, rung, 40 + i as u64).unwrap();
                let v = m.view();
                let book = rung.codebook().unwrap();
                for batch in [1usize, 2, 3, 5, 8, 11, 16, 17] {
                    let x = fresh(batch * cols, 500 + batch as u64);
                    let mut want = poisoned(batch * rows);
                    matmul_reference(&x, batch, &v, &mut want);
                    for isa in isas() {
                        for parallel in [false, true] {
                            let mut got = poisoned(batch * rows);
                            run(&x, batch, &v, book, &mut got, isa, parallel);
                            let e = rel_err(&got, &want);
                            assert!(
                                e < 1e-5,
                                "{} {isa:?} parallel {parallel} batch {batch} \
                                 {rows}×{cols}: rel err {e}",
                                rung.name()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn codes_inside_a_longer_buffer_are_read_in_place() {
        // A stored record's codes are followed by other bytes, so no row is copied;
        // the bytes after the codes must not change the result.
        let (rows, cols) = (13, 1024);
        let w = fresh(rows * cols, 90);
        for (i, rung) in LADDER.into_iter().enumerate() {
            let m = VqMatrix::encode(&w, rows, cols, rung, i as u64).unwrap();
            let mut codes = m.codes.clone();
            codes.extend((0..3 * SLACK).map(|i| (i * 37 + 11) as u8));
            let v = VqView {
                codes: &codes,
                ..m.view()
            };
            let book = rung.codebook().unwrap();
            for batch in [1usize, 3, 6] {
                let x = fresh(batch * cols, 91 + batch as u64);
                let mut want = poisoned(batch * rows);
                matmul_reference(&x, batch, &m.view(), &mut want);
                for isa in isas() {
                    let mut got = poisoned(batch * rows);
                    run(&x, batch, &v, book, &mut got, isa, false);
                    let e = rel_err(&got, &want);
                    assert!(e < 1e-5, "{} {isa:?} batch {batch}: {e}", rung.name());
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_rung_has_a_fixed_kernel_for_blocks_of_128_and_more() {
        for rung in LADDER {
            let (p, k) = (rung.dim, rung.index_bits as usize);
            for t in [1, 2, 3, 4, TILE] {
                assert!(fixed_fn(p, k, t).is_some(), "{} tile {t}", rung.name());
            }
            let u = x86::step_indices(p, k);
            assert!(
                (u * k).is_multiple_of(8) && u * k <= 8 * SLACK,
                "{}",
                rung.name()
            );
            assert!((128 / p).is_multiple_of(u), "{} steps of {u}", rung.name());
        }
    }

    #[test]
    fn public_entry_points_agree_with_the_reference() {
        let (rows, cols) = (50, 2048);
        let w = fresh(rows * cols, 71);
        let m = VqMatrix::encode(&w, rows, cols, LADDER[6], 5).unwrap();
        for batch in [1usize, 4, 9, 20] {
            let x = fresh(batch * cols, 72 + batch as u64);
            let mut want = poisoned(batch * rows);
            matmul_reference(&x, batch, &m.view(), &mut want);
            let mut got = poisoned(batch * rows);
            matmul(&x, batch, &m.view(), &mut got);
            assert!(rel_err(&got, &want) < 1e-5, "matmul batch {batch}");
            let mut got = poisoned(batch * rows);
            matmul_serial(&x, batch, &m.view(), &mut got);
            assert!(rel_err(&got, &want) < 1e-5, "serial batch {batch}");
        }
    }

    #[test]
    fn empty_batch_touches_nothing() {
        let m = VqMatrix::encode(&fresh(4 * 64, 80), 4, 64, LADDER[1], 0).unwrap();
        let mut out = poisoned(4);
        matmul(&[], 0, &m.view(), &mut out);
        assert!(out.iter().all(|v| v.is_nan()));
    }
}
