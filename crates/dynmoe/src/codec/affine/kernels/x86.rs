//! The kernels with AVX2 and FMA (and AVX-512VL for one 3-bit step). Each keeps,
//! per activation row, two accumulators for the current unit (enough: a unit's
//! chains are independent of the next unit's, so out-of-order execution overlaps
//! them) and one running total that the unit's multipliers scale into.

use std::arch::x86_64::*;

use super::{unit_words, GROUP_SIZE, Q3_AT};

/// Checked entry points: each wraps a raw kernel below.
macro_rules! entry {
    ($name:ident, $raw:ident) => {
        pub(super) fn $name<const T: usize>(
            words: &[u32],
            mult: &[f32],
            xp: &[f32],
            xs: usize,
        ) -> [f32; T] {
            // SAFETY: `kernel` hands these out only when `detect` found the raw
            // kernel's target features; `row_dot` checked that `words` covers every
            // group and `xp` every activation row, padded to whole units.
            unsafe { $raw::<T>(words, mult, xp.as_ptr(), xs) }
        }
    };
}
entry!(q4, q4_raw);
entry!(q2, q2_raw);
entry!(q3, q3_raw);
entry!(q4_vl, q4_vl_raw);
entry!(q2_vl, q2_vl_raw);
entry!(q3_vl, q3_vl_raw);

/// The baseline compiled with AVX2 and FMA available, so that it and the layout
/// kernels are compared on one instruction set.
pub(super) fn naive_q2<const T: usize>(
    words: &[u32],
    mult: &[f32],
    x: &[f32],
    xs: usize,
) -> [f32; T] {
    #[target_feature(enable = "avx2,fma")]
    fn inner<const T: usize>(words: &[u32], mult: &[f32], x: &[f32], xs: usize) -> [f32; T] {
        super::naive_q2::<T, true>(words, mult, x, xs)
    }
    // SAFETY: handed out by `kernel` only when `detect` found AVX2 and FMA.
    unsafe { inner::<T>(words, mult, x, xs) }
}

#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// Independent chains per activation row: with one row, four keep about eight
/// FMAs in flight; with more rows, the rows supply the independence.
const fn chains(t: usize) -> usize {
    if t == 1 {
        4
    } else {
        2
    }
}

/// Accumulators for `T` activation rows.
struct Acc<const T: usize> {
    unit: [[__m256; 4]; T],
    total: [__m256; T],
}

impl<const T: usize> Acc<T> {
    #[target_feature(enable = "avx2,fma")]
    fn new() -> Self {
        Acc {
            unit: [[_mm256_setzero_ps(); 4]; T],
            total: [_mm256_setzero_ps(); T],
        }
    }

    /// Multiply-adds the 8 codes `f` with the 8 activations at `x + 8 * pos` of
    /// each row.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn fma(&mut self, f: __m256, x: *const f32, xs: usize, pos: usize) {
        let c = pos % chains(T);
        for t in 0..T {
            let xv = _mm256_loadu_ps(x.add(t * xs + 8 * pos));
            self.unit[t][c] = _mm256_fmadd_ps(f, xv, self.unit[t][c]);
        }
    }

    /// Scales the finished unit by `m` (per lane) into the totals and clears it.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn close(&mut self, m: __m256) {
        for t in 0..T {
            let u = &mut self.unit[t];
            let s = if chains(T) == 4 {
                _mm256_add_ps(_mm256_add_ps(u[0], u[1]), _mm256_add_ps(u[2], u[3]))
            } else {
                _mm256_add_ps(u[0], u[1])
            };
            self.total[t] = _mm256_fmadd_ps(m, s, self.total[t]);
            *u = [_mm256_setzero_ps(); 4];
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn finish(&self) -> [f32; T] {
        self.total.map(|v| hsum(v))
    }
}

/// Multipliers of a two-group unit, lanes 0-3 for the first group and 4-7 for the
/// second (absent past the end of the row).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn pair_mult(mult: &[f32], g: usize) -> __m256 {
    let m1 = mult.get(g + 1).copied().unwrap_or(0.0);
    _mm256_insertf128_ps::<1>(
        _mm256_castps128_ps256(_mm_set1_ps(mult[g])),
        _mm_set1_ps(m1),
    )
}

/// The 4-bit loop. MLX words: one 256-bit load is a whole group and lane `l` is
/// word `l`. Nibble `n` is masked in place; the top one is shifted down instead.
macro_rules! q4_body {
    ($w:ident, $mult:ident, $xp:ident, $xs:ident, $T:ident) => {{
        let mut acc = Acc::<$T>::new();
        for (g, &m) in $mult.iter().enumerate() {
            let v = _mm256_loadu_si256($w.as_ptr().add(8 * g).cast());
            let x = $xp.add(GROUP_SIZE * g);
            for n in 0..7 {
                let mask = _mm256_set1_epi32(0xF << (4 * n));
                acc.fma(_mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), x, $xs, n);
            }
            acc.fma(_mm256_cvtepi32_ps(_mm256_srli_epi32::<28>(v)), x, $xs, 7);
            acc.close(_mm256_set1_ps(m));
        }
        acc.finish()
    }};
}

/// The 2-bit loop, two groups (8 words, one load) at a time: lane `l` holds word
/// `l`. Its low half's 8 codes are masked in place, then the same 8 masks serve the
/// high half shifted down by 16, which keeps bit 31 out of the conversions.
macro_rules! q2_body {
    ($w:ident, $mult:ident, $xp:ident, $xs:ident, $T:ident) => {{
        let groups = $mult.len();
        let mut acc = Acc::<$T>::new();
        for g in (0..groups).step_by(2) {
            let v = if g + 2 <= groups {
                _mm256_loadu_si256($w.as_ptr().add(4 * g).cast())
            } else {
                _mm256_loadu_si256(unit_words($w, g, groups, 4, 2).as_ptr().cast())
            };
            let x = $xp.add(GROUP_SIZE * g);
            for (half, v) in [v, _mm256_srli_epi32::<16>(v)].into_iter().enumerate() {
                for it in 0..8 {
                    let mask = _mm256_set1_epi32(3 << (2 * it));
                    let f = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                    acc.fma(f, x, $xs, 8 * half + it);
                }
            }
            acc.close(pair_mult($mult, g));
        }
        acc.finish()
    }};
}

/// MLX 4-bit words.
///
/// # Safety
/// AVX2 and FMA must be available; `w` must hold `8 * mult.len()` words and `xp`
/// `T` rows `xs` floats apart of `64 * mult.len()` floats each.
#[target_feature(enable = "avx2,fma")]
unsafe fn q4_raw<const T: usize>(w: &[u32], mult: &[f32], xp: *const f32, xs: usize) -> [f32; T] {
    q4_body!(w, mult, xp, xs, T)
}

/// [`q4_raw`] compiled for AVX-512VL, whose 32 vector registers hold a tile's
/// accumulators and masks without spilling.
///
/// # Safety
/// As [`q4_raw`], and AVX-512F and VL must be available.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn q4_vl_raw<const T: usize>(
    w: &[u32],
    mult: &[f32],
    xp: *const f32,
    xs: usize,
) -> [f32; T] {
    q4_body!(w, mult, xp, xs, T)
}

/// 2-bit layout.
///
/// # Safety
/// As [`q4_raw`], with `4 * mult.len()` words and activations padded to an even
/// number of groups.
#[target_feature(enable = "avx2,fma")]
unsafe fn q2_raw<const T: usize>(w: &[u32], mult: &[f32], xp: *const f32, xs: usize) -> [f32; T] {
    q2_body!(w, mult, xp, xs, T)
}

/// [`q2_raw`] compiled for AVX-512VL.
///
/// # Safety
/// As [`q2_raw`], and AVX-512F and VL must be available.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn q2_vl_raw<const T: usize>(
    w: &[u32],
    mult: &[f32],
    xp: *const f32,
    xs: usize,
) -> [f32; T] {
    q2_body!(w, mult, xp, xs, T)
}

/// The 3-bit loop; `$select` completes the codes (`m ? x : y`, bitwise).
///
/// Lanes get the upper words `u` and low words `l` of two groups: `[c0w0, c0w1,
/// c1w0, c1w1]` of each and `[c0w2, c0w2, c1w2, c1w2]`. For 2-bit group `p` the upper
/// bits sit at `8b + 2p`; `y` (the low word shifted right by `4k`, or that shifted
/// left by 1 for `p` 2 and 3) puts each lowest bit at `8b + Q3_AT[p]`, just under
/// them once `u` is shifted left (`p` 0) or right (`p` 3) by one.
macro_rules! q3_body {
    ($w:ident, $mult:ident, $xp:ident, $xs:ident, $T:ident, $gather:ident, $select:ident) => {{
        let groups = $mult.len();
        let mut acc = Acc::<$T>::new();
        for g in (0..groups).step_by(2) {
            let buf;
            let src = if g + 2 <= groups {
                $w.as_ptr().add(6 * g)
            } else {
                buf = unit_words($w, g, groups, 6, 2);
                buf.as_ptr()
            };
            // Words 0-7 and 4-11 of the unit.
            let a = _mm256_loadu_si256(src.cast());
            let b = _mm256_loadu_si256(src.add(4).cast());
            let (u, l) = $gather(a, b);
            let y01 = _mm256_srlv_epi32(l, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
            let y23 = _mm256_slli_epi32::<1>(y01);
            let c = [
                $select(_mm256_set1_epi32(0x0606_0606), _mm256_add_epi32(u, u), y01),
                $select(_mm256_set1_epi32(0x0C0C_0C0C), u, y01),
                $select(_mm256_set1_epi32(0x3030_3030), u, y23),
                $select(
                    _mm256_set1_epi32(0x6060_6060),
                    _mm256_srli_epi32::<1>(u),
                    y23,
                ),
            ];
            let x = $xp.add(GROUP_SIZE * g);
            for (p, c) in c.into_iter().enumerate() {
                for b in 0..4 {
                    let mask = _mm256_set1_epi32(7 << (8 * b + Q3_AT[p]));
                    let f = _mm256_cvtepi32_ps(_mm256_and_si256(c, mask));
                    acc.fma(f, x, $xs, 4 * p + b);
                }
            }
            acc.close(pair_mult($mult, g));
        }
        acc.finish()
    }};
}

/// Upper and low words of a 3-bit unit from its words 0-7 (`a`) and 4-11 (`b`).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn gather_avx2(a: __m256i, b: __m256i) -> (__m256i, __m256i) {
    let pick = |ia: __m256i, ib: __m256i| {
        _mm256_blend_epi32::<0xF0>(
            _mm256_permutevar8x32_epi32(a, ia),
            _mm256_permutevar8x32_epi32(b, ib),
        )
    };
    (
        pick(
            _mm256_setr_epi32(0, 1, 3, 4, 0, 0, 0, 0),
            _mm256_setr_epi32(0, 0, 0, 0, 2, 3, 5, 6),
        ),
        pick(
            _mm256_setr_epi32(2, 2, 5, 5, 0, 0, 0, 0),
            _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 7, 7),
        ),
    )
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn select_avx2(m: __m256i, x: __m256i, y: __m256i) -> __m256i {
    _mm256_xor_si256(y, _mm256_and_si256(_mm256_xor_si256(x, y), m))
}

/// [`gather_avx2`] with two-source permutes.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
#[inline]
fn gather_avx512(a: __m256i, b: __m256i) -> (__m256i, __m256i) {
    (
        _mm256_permutex2var_epi32(a, _mm256_setr_epi32(0, 1, 3, 4, 10, 11, 13, 14), b),
        _mm256_permutex2var_epi32(a, _mm256_setr_epi32(2, 2, 5, 5, 12, 12, 15, 15), b),
    )
}

/// [`select_avx2`] as one ternary-logic instruction (0xCA: `m ? x : y`).
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
#[inline]
fn select_avx512(m: __m256i, x: __m256i, y: __m256i) -> __m256i {
    _mm256_ternarylogic_epi32::<0xCA>(m, x, y)
}

/// 3-bit layout, two groups (12 words) at a time.
///
/// # Safety
/// As [`q2_raw`], with `6 * mult.len()` words.
#[target_feature(enable = "avx2,fma")]
unsafe fn q3_raw<const T: usize>(w: &[u32], mult: &[f32], xp: *const f32, xs: usize) -> [f32; T] {
    q3_body!(w, mult, xp, xs, T, gather_avx2, select_avx2)
}

/// [`q3_raw`] with AVX-512VL: two permutes gather the words, one instruction per
/// 32 codes completes them.
///
/// # Safety
/// As [`q3_raw`], and AVX-512F and VL must be available.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn q3_vl_raw<const T: usize>(
    w: &[u32],
    mult: &[f32],
    xp: *const f32,
    xs: usize,
) -> [f32; T] {
    q3_body!(w, mult, xp, xs, T, gather_avx512, select_avx512)
}

/// Products at small batches on AVX-512: whole rows in one call, for a tile of up to four
/// activation rows, each group's multiplier and offset taken from the row's scales and
/// biases as it is reached. At batch 1 a row of a narrow matrix (256 columns: four groups)
/// costs about as much to set up through [`super::Call::rows`] as to multiply, so these
/// run the setup inside the loop; a group's codes, decoded once, serve every row of the
/// tile.
///
/// The activations are [`super::prepare`]'s (`xp` rows `xs` floats apart, in the layout's
/// extraction order and scaling, padded to whole units; `sums` the Σx of each group, a
/// row's `groups` together); `a` and `off` are the layout's midpoint reconstruction, so
/// that code `q` of group `g` stands for `(a·q + off)·s_g + b_g`. `dst` is
/// `[rows, batch]`: row `i`'s value for activation row `t` is `dst[i * batch + t]`, output
/// row `o0 + i`; a tile writes its own `T` columns from `t0`.
pub(super) struct Rows<'a> {
    pub words: &'a [u32],
    pub scales: &'a [half::bf16],
    pub biases: &'a [half::bf16],
    pub groups: usize,
    pub xp: &'a [f32],
    pub xs: usize,
    pub sums: &'a [f32],
    pub a: f32,
    pub off: f32,
    pub batch: usize,
}

impl Rows<'_> {
    /// Row `r`'s groups `g0 .. g0 + 16` (fewer at the row's end, the rest zero): their
    /// multipliers `a·s_g`, and for each activation row `t0 + t` of the tile their
    /// offsets' share `(off·s_g + b_g)·Σx_g`, which that row's accumulator takes lane by
    /// lane so that one reduction serves both.
    #[inline(always)]
    unsafe fn chunk<const T: usize>(
        &self,
        r: usize,
        g0: usize,
        t0: usize,
    ) -> (__m512, [__m512; T]) {
        let n = (self.groups - g0).min(16);
        let k: __mmask16 = if n == 16 { u16::MAX } else { (1u16 << n) - 1 };
        let at = r * self.groups + g0;
        // bf16 is the upper half of an f32.
        let load = |p: &[half::bf16]| {
            let h = _mm256_maskz_loadu_epi16(k, p.as_ptr().add(at).cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        };
        let (s, b) = (load(self.scales), load(self.biases));
        let m = _mm512_mul_ps(_mm512_set1_ps(self.a), s);
        let o = _mm512_fmadd_ps(_mm512_set1_ps(self.off), s, b);
        let c = std::array::from_fn(|t| {
            let x = _mm512_maskz_loadu_ps(k, self.sums.as_ptr().add((t0 + t) * self.groups + g0));
            _mm512_mul_ps(o, x)
        });
        (m, c)
    }

    /// Asserts that rows `o0 .. o0 + rows`, the tile's activation rows from `t0`, padded
    /// to whole units of `unit` groups, and its columns of `dst` are all there.
    fn check<const T: usize>(&self, o0: usize, dst: &[f32], t0: usize, wpg: usize, unit: usize) {
        assert!(T >= 1 && t0 + T <= self.batch && dst.len().is_multiple_of(self.batch));
        let end = o0 + dst.len() / self.batch;
        assert!(self.words.len() >= end * wpg * self.groups);
        assert!(self.scales.len() >= end * self.groups);
        assert!(self.biases.len() >= end * self.groups);
        let last = (t0 + T - 1) * self.xs;
        assert!(self.xs >= 64 * self.groups.next_multiple_of(unit));
        assert!(self.xp.len() >= last + 64 * self.groups.next_multiple_of(unit));
        assert!(self.sums.len() >= (t0 + T) * self.groups);
    }

    /// 4-bit rows (MLX words, [`super::ORDER_Q4`]) for activation rows `t0 .. t0 + T`.
    pub fn q4<const T: usize>(&self, o0: usize, dst: &mut [f32], t0: usize) {
        self.check::<T>(o0, dst, t0, 8, 1);
        // SAFETY: used only where `detect` found AVX-512F and VL and `x86_rows` BW;
        // `check` covered every word, scale, bias, activation and output touched.
        unsafe { self.q4_raw::<T>(o0, dst, t0) }
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw")]
    unsafe fn q4_raw<const T: usize>(&self, o0: usize, dst: &mut [f32], t0: usize) {
        // Nibbles n and n + 1 of every word, one 16-lane vector: in place (the
        // activations are scaled to match), the top one shifted down to keep bit 31
        // out of the conversion.
        let pair = |n: i32| {
            let lo = _mm256_set1_epi32(0xF << (4 * n));
            let hi = _mm256_set1_epi32(if n + 1 < 7 { 0xF << (4 * (n + 1)) } else { 0xF });
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        };
        let masks = [pair(0), pair(2), pair(4), pair(6)];
        let top = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi32(28));
        let groups = self.groups;
        let x = self.xp.as_ptr().add(t0 * self.xs);
        for (i, out) in dst.chunks_exact_mut(self.batch).enumerate() {
            let r = o0 + i;
            let w = self.words.as_ptr().add(r * 8 * groups);
            let mut acc = [_mm512_setzero_ps(); T];
            for g0 in (0..groups).step_by(16) {
                let (m, c) = self.chunk::<T>(r, g0, t0);
                for t in 0..T {
                    acc[t] = _mm512_add_ps(acc[t], c[t]);
                }
                for g in g0..groups.min(g0 + 16) {
                    let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(w.add(8 * g).cast()));
                    let code =
                        |k: usize, v: __m512i| _mm512_cvtepi32_ps(_mm512_and_si512(v, masks[k]));
                    let codes = [
                        code(0, v),
                        code(1, v),
                        code(2, v),
                        code(3, _mm512_srlv_epi32(v, top)),
                    ];
                    let mg = _mm512_permutexvar_ps(_mm512_set1_epi32((g - g0) as i32), m);
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let xg = x.add(t * self.xs + 64 * g);
                        // Two chains, so that a group's sum waits on two products, not four.
                        let s0 = _mm512_mul_ps(codes[0], _mm512_loadu_ps(xg));
                        let s1 = _mm512_mul_ps(codes[1], _mm512_loadu_ps(xg.add(16)));
                        let s0 = _mm512_fmadd_ps(codes[2], _mm512_loadu_ps(xg.add(32)), s0);
                        let s1 = _mm512_fmadd_ps(codes[3], _mm512_loadu_ps(xg.add(48)), s1);
                        *acc = _mm512_fmadd_ps(_mm512_add_ps(s0, s1), mg, *acc);
                    }
                }
            }
            for t in 0..T {
                out[t0 + t] = _mm512_reduce_add_ps(acc[t]);
            }
        }
    }

    /// 2-bit rows (two groups a unit, [`super::ORDER_Q2`]) for activation rows
    /// `t0 .. t0 + T`.
    pub fn q2<const T: usize>(&self, o0: usize, dst: &mut [f32], t0: usize) {
        self.check::<T>(o0, dst, t0, 4, 2);
        // SAFETY: as in `q4`; a unit cut short at a row's end reads only its own words.
        unsafe { self.q2_raw::<T>(o0, dst, t0) }
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw")]
    unsafe fn q2_raw<const T: usize>(&self, o0: usize, dst: &mut [f32], t0: usize) {
        // Codes at bits 2k and 2k + 2 of every word (of the word's low half, or of its
        // high half shifted down), one 16-lane vector, in place.
        let pair = |k: i32| {
            let lo = _mm256_set1_epi32(3 << (2 * k));
            let hi = _mm256_set1_epi32(3 << (2 * k + 2));
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        };
        let masks = [pair(0), pair(2), pair(4), pair(6)];
        // Lanes 0-3 of each eight are the first group's words, 4-7 the second's.
        let unit_lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
        let groups = self.groups;
        let x = self.xp.as_ptr().add(t0 * self.xs);
        for (i, out) in dst.chunks_exact_mut(self.batch).enumerate() {
            let r = o0 + i;
            let row = &self.words[r * 4 * groups..(r + 1) * 4 * groups];
            let mut acc = [_mm512_setzero_ps(); T];
            for g0 in (0..groups).step_by(16) {
                let (m, c) = self.chunk::<T>(r, g0, t0);
                for t in 0..T {
                    acc[t] = _mm512_add_ps(acc[t], c[t]);
                }
                for g in (g0..groups.min(g0 + 16)).step_by(2) {
                    let words = if g + 2 <= groups {
                        _mm256_loadu_si256(row.as_ptr().add(4 * g).cast())
                    } else {
                        // A row's last unit with one group: its four words, zeros above.
                        _mm256_zextsi128_si256(_mm_loadu_si128(row.as_ptr().add(4 * g).cast()))
                    };
                    let mut codes = [_mm512_setzero_ps(); 8];
                    for (half, v) in [words, _mm256_srli_epi32::<16>(words)]
                        .into_iter()
                        .enumerate()
                    {
                        let v = _mm512_broadcast_i64x4(v);
                        for (k, mask) in masks.iter().enumerate() {
                            codes[4 * half + k] = _mm512_cvtepi32_ps(_mm512_and_si512(v, *mask));
                        }
                    }
                    let at = _mm512_add_epi32(unit_lanes, _mm512_set1_epi32((g - g0) as i32));
                    let mg = _mm512_permutexvar_ps(at, m);
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let xu = x.add(t * self.xs + 64 * g);
                        let mut sums = [_mm512_setzero_ps(); 2];
                        for (j, c) in codes.iter().enumerate() {
                            let xv = _mm512_loadu_ps(xu.add(16 * j));
                            sums[j / 4] = _mm512_fmadd_ps(*c, xv, sums[j / 4]);
                        }
                        *acc = _mm512_fmadd_ps(_mm512_add_ps(sums[0], sums[1]), mg, *acc);
                    }
                }
            }
            for t in 0..T {
                out[t0 + t] = _mm512_reduce_add_ps(acc[t]);
            }
        }
    }
}
