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
//! four activation rows per pass over a weight row, so each looked-up codeword serves
//! all four; above, the matrix is decoded once and multiplied with gemm. With AVX2, FMA
//! and F16C, hand-written kernels read an fp16 copy of the codebook (picked at run
//! time); every variant is tested against [`matmul_reference`].

use super::codebook::Codebook;
use super::rotation::{fwht, signs};
use super::{row_bytes, VqView};
use crate::codec::affine::kernels::{by_rows, prefetch};

/// Above this many activation rows the weights are decoded and multiplied with gemm,
/// as the affine path does.
pub const EXPAND_ABOVE_ROWS: usize = 16;

/// Activation rows per pass over a weight row.
const TILE: usize = 4;

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

/// One weight row: its codes from the row's first byte (more may follow), the codebook
/// as f32 `[2^k, P]`, per block `n_b / √R`, and `T` rotated activation rows `xs` apart.
struct RowArgs<'a> {
    codes: &'a [u8],
    k: usize,
    table: &'a [f32],
    /// The same codebook as fp16, for the x86 kernels.
    half: &'a [half::f16],
    mult: &'a [f32],
    block: usize,
    xp: &'a [f32],
    xs: usize,
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
fn row_body<const P: usize, const T: usize, const FUSED: bool>(a: &RowArgs<'_>) -> [f32; TILE] {
    let per_block = a.block / P;
    let mut tot = [0.0f32; TILE];
    let mut at = 0;
    let step = |acc: &mut [[f32; P]; T], at: usize, x0: usize| {
        let idx = index(a.codes, at, a.k);
        let cw: &[f32; P] = a.table[idx * P..idx * P + P].try_into().unwrap();
        for (t, acc) in acc.iter_mut().enumerate() {
            let xv: &[f32; P] = a.xp[t * a.xs + x0..t * a.xs + x0 + P].try_into().unwrap();
            for l in 0..P {
                acc[l] = madd::<FUSED>(cw[l], xv[l], acc[l]);
            }
        }
    };
    for (b, &m) in a.mult.iter().enumerate() {
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
            tot[t] += m * s;
        }
    }
    tot
}

type RowFn = fn(&RowArgs<'_>) -> [f32; TILE];

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! Kernels for 4-, 8- and 16-value codewords with AVX2, FMA and F16C: the codebook
    //! is read as fp16 (half the cache footprint; a 2^16 × 8 book is 1 MiB) and each
    //! 8 looked-up values are converted in one instruction and multiplied with 8
    //! activations of each row of the tile. Two accumulators per row alternate, so
    //! consecutive multiply-adds are independent.

    use std::arch::x86_64::*;

    use super::{index, RowArgs, TILE};

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// The 8 codebook values of chunk `c` of a block (`at`: bit of the block's first
    /// index): one 8-value codeword, two 4-value ones, or half of a 16-value one.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn chunk<const P: usize>(a: &RowArgs<'_>, at: usize, c: usize) -> __m256 {
        let half = a.half.as_ptr().cast::<u16>();
        match P {
            8 => {
                let i = index(a.codes, at + c * a.k, a.k);
                _mm256_cvtph_ps(_mm_loadu_si128(half.add(8 * i).cast()))
            }
            4 => {
                let i0 = index(a.codes, at + 2 * c * a.k, a.k);
                let i1 = index(a.codes, at + (2 * c + 1) * a.k, a.k);
                let lo = _mm_loadl_epi64(half.add(4 * i0).cast());
                let hi = _mm_loadl_epi64(half.add(4 * i1).cast());
                _mm256_cvtph_ps(_mm_unpacklo_epi64(lo, hi))
            }
            _ => {
                let i = index(a.codes, at + (c / 2) * a.k, a.k);
                _mm256_cvtph_ps(_mm_loadu_si128(half.add(16 * i + 8 * (c % 2)).cast()))
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available; `a.half` must hold `2^k · P` values and
    /// `a.xp` `T` rows `a.xs` apart of `a.mult.len() · a.block` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn row_raw<const P: usize, const T: usize>(a: &RowArgs<'_>) -> [f32; TILE] {
        let chunks = a.block / 8;
        let bits_per_block = a.block / P * a.k;
        let xp = a.xp.as_ptr();
        let mut tot = [0.0f32; TILE];
        for (b, &m) in a.mult.iter().enumerate() {
            let at = b * bits_per_block;
            let mut acc0 = [_mm256_setzero_ps(); T];
            let mut acc1 = [_mm256_setzero_ps(); T];
            let x0 = b * a.block;
            // `block` is a power of two of at least 16: whole pairs of chunks.
            for c in (0..chunks).step_by(2) {
                let w0 = chunk::<P>(a, at, c);
                let w1 = chunk::<P>(a, at, c + 1);
                for t in 0..T {
                    let x = xp.add(t * a.xs + x0 + 8 * c);
                    acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc0[t]);
                    acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), acc1[t]);
                }
            }
            for t in 0..T {
                tot[t] += m * hsum(_mm256_add_ps(acc0[t], acc1[t]));
            }
        }
        tot
    }

    pub(super) fn f16c<const P: usize, const T: usize>(a: &RowArgs<'_>) -> [f32; TILE] {
        assert!(a.half.len() >= P << a.k, "codebook of 2^{} × {P}", a.k);
        assert!(
            a.block.is_multiple_of(16) && a.xp.len() >= (T - 1) * a.xs + a.mult.len() * a.block
        );
        // SAFETY: handed out by `row_fn` only when `detect` found AVX2, FMA and F16C;
        // the asserts cover every codebook index (`k` bits) and activation read.
        unsafe { row_raw::<P, T>(a) }
    }

    pub(super) fn avx2<const P: usize, const T: usize>(a: &RowArgs<'_>) -> [f32; TILE] {
        #[target_feature(enable = "avx2,fma")]
        fn inner<const P: usize, const T: usize>(a: &RowArgs<'_>) -> [f32; TILE] {
            super::row_body::<P, T, true>(a)
        }
        // SAFETY: handed out by `row_fn` only when `detect` found AVX2 and FMA.
        unsafe { inner::<P, T>(a) }
    }
}

fn portable<const P: usize, const T: usize>(a: &RowArgs<'_>) -> [f32; TILE] {
    row_body::<P, T, false>(a)
}

fn row_fn(isa: Isa, p: usize, t: usize) -> RowFn {
    macro_rules! by_tile {
        ($f:ident, $p:literal) => {
            match t {
                1 => $f::<$p, 1>,
                2 => $f::<$p, 2>,
                3 => $f::<$p, 3>,
                _ => $f::<$p, 4>,
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
        Isa::Avx2 if p == 2 => {
            use x86::avx2;
            by_dim!(avx2)
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            use x86::f16c;
            match p {
                4 => by_tile!(f16c, 4),
                8 => by_tile!(f16c, 8),
                _ => by_tile!(f16c, 16),
            }
        }
    }
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
            crate::backend::cpu::fast::matmul(x, &dense, batch, w.cols, w.rows, out);
        } else {
            crate::backend::cpu::fast::matmul_serial(x, &dense, batch, w.cols, w.rows, out);
        }
        return;
    }
    let xp = prepare(x, batch, w);
    let (blocks, block) = (w.blocks(), w.block);
    let xs = blocks * block;
    let rb = row_bytes(w.rung, w.cols);
    let (p, k) = (w.rung.dim, w.rung.index_bits as usize);
    let inv_root = 1.0 / (block as f32).sqrt();
    let fns: Vec<RowFn> = (1..=TILE).map(|t| row_fn(isa, p, t)).collect();
    let rows_fn = |o0: usize, dst: &mut [f32], mult: &mut Vec<f32>| {
        mult.resize(blocks, 0.0);
        let n = dst.len() / batch;
        for (i, out) in dst.chunks_exact_mut(batch).enumerate() {
            let o = o0 + i;
            if i + PREFETCH_ROWS < n {
                let ahead = (o + PREFETCH_ROWS) * rb;
                prefetch(&w.codes[ahead..ahead + rb]);
            }
            for (m, n) in mult.iter_mut().zip(&w.norms[o * blocks..(o + 1) * blocks]) {
                *m = n.to_f32() * inv_root;
            }
            for t0 in (0..batch).step_by(TILE) {
                let tile = TILE.min(batch - t0);
                let args = RowArgs {
                    codes: &w.codes[o * rb..],
                    k,
                    table: book.values(),
                    half: book.values_f16(),
                    mult,
                    block,
                    xp: &xp[t0 * xs..],
                    xs,
                };
                let dots = fns[tile - 1](&args);
                out[t0..t0 + tile].copy_from_slice(&dots[..tile]);
            }
        }
    };
    by_rows(out, w.rows, batch, parallel, &rows_fn);
}

fn shipped(w: &VqView<'_>) -> &'static Codebook {
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
        // columns of padding; 13: a single 16-wide block.
        for (rows, cols) in [(37usize, 1500usize), (21, 80), (9, 13)] {
            let w = fresh(rows * cols, (rows * cols) as u64);
            for (i, rung) in LADDER.into_iter().enumerate() {
                let m = VqMatrix::encode(&w, rows, cols, rung, 40 + i as u64).unwrap();
                let v = m.view();
                let book = rung.codebook().unwrap();
                for batch in [1usize, 2, 3, 5, 8, 16, 17] {
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
