//! CPU products with affine-quantized weights, read straight from the packed words.
//!
//! `out[b * rows + o] = Σ_i x[b * cols + i] · w[o, i]` for a small batch of activation
//! rows, with `w` in MLX's 4-bit format or the 3- and 2-bit layouts of [`super::lowbit`].
//!
//! # How the kernels avoid decoding work
//!
//! Activations are prepared once per call, not once per weight row:
//!
//! - the columns of each activation row are permuted into the order in which the kernel
//!   pulls codes out of the words, so a vector of 8 codes meets 8 contiguous activations
//!   whatever the layout; the permutation is paid once for all `rows` weight rows;
//! - codes are masked in place instead of shifted down, so a code at bit `s` of its lane
//!   converts to `code · 2^s`; its activation is stored pre-multiplied by `2^-s`, which
//!   is exact, so each product is what it would be with the shifted code;
//! - each 64-column group's `Σx` is computed, so the affine offset folds out of the
//!   inner loop: with a value `(a·q + o)·s + b` (`a, o` = 1, 0 at 4 bits; 2, ½ at 3;
//!   4, 1½ at 2), a group contributes `a·s · Σ q·x + (o·s + b) · Σx`.
//!
//! The inner loop is then one mask, one int-to-float conversion and one multiply-add
//! (per activation row) for 8 codes, the same at every bit width: a lane holds one
//! 32-bit word. MLX's 4-bit words fill 8 lanes per group; the 2- and 3-bit kernels take
//! two groups at a time so that 8 words again fill the 8 lanes. At 3 bits each code is
//! first completed from its upper bits and the lowest bit in the chunk's third word: the
//! layout's `(word_k >> 2p) & 0x03030303` / `(w2 >> (4k + p)) & 0x01010101` alignment
//! means a per-lane shift of the low word and one bit-select per 32 codes do it.
//!
//! On x86-64 with AVX2 and FMA the kernels use those instructions (with AVX-512VL the
//! 3-bit bit-select is one `vpternlogd`); elsewhere a portable version with the same
//! arithmetic runs. Every variant the machine supports is tested against the oracle.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use half::bf16;

use super::lowbit::{self, column, reconstruction, words_per_row};
use super::GROUP_SIZE;

/// A borrowed affine matrix: the words of MLX's 4-bit format (`bits` 4) or of the
/// layouts of [`super::lowbit`] (`bits` 3 and 2), with `[rows, cols / 64]` bf16 scales
/// and biases.
#[derive(Debug, Clone, Copy)]
pub struct AffineView<'a> {
    /// Bits per code: 4, 3 or 2.
    pub bits: u32,
    /// Output features.
    pub rows: usize,
    /// Input features, a multiple of 64.
    pub cols: usize,
    /// `rows * words_per_row(cols, bits)` packed words, row-major.
    pub words: &'a [u32],
    /// Step sizes, `[rows, cols / 64]`.
    pub scales: &'a [bf16],
    /// Offsets, `[rows, cols / 64]`.
    pub biases: &'a [bf16],
}

impl<'a> AffineView<'a> {
    /// Row `r` alone, as a one-row matrix: what an embedding lookup decodes.
    pub fn row(&self, r: usize) -> AffineView<'a> {
        let (w, g) = (words_per_row(self.cols, self.bits), self.cols / GROUP_SIZE);
        AffineView {
            rows: 1,
            words: &self.words[r * w..(r + 1) * w],
            scales: &self.scales[r * g..(r + 1) * g],
            biases: &self.biases[r * g..(r + 1) * g],
            ..*self
        }
    }

    /// The matrix expanded to row-major f32, as the kernels reconstruct it.
    pub fn dequantize(&self) -> Vec<f32> {
        lowbit::dequantize(
            self.words,
            self.scales,
            self.biases,
            self.rows,
            self.cols,
            self.bits,
        )
    }
}

/// Which words a kernel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    Q4,
    Q3,
    Q2,
    /// 16 two-bit codes per word in input order (the older layout).
    NaiveQ2,
}

impl Layout {
    fn bits(self) -> u32 {
        match self {
            Layout::Q4 => 4,
            Layout::Q3 => 3,
            Layout::Q2 | Layout::NaiveQ2 => 2,
        }
    }

    /// Words per 64-column group.
    fn group_words(self) -> usize {
        match self {
            Layout::Q4 => 8,
            Layout::Q3 => 6,
            Layout::Q2 | Layout::NaiveQ2 => 4,
        }
    }

    /// Groups the kernel decodes together: two at 2 and 3 bits, where one group's
    /// words would fill only half of the 8 lanes.
    fn unit(self) -> usize {
        match self {
            Layout::Q3 | Layout::Q2 => 2,
            Layout::Q4 | Layout::NaiveQ2 => 1,
        }
    }

    /// For each position of the kernel's extraction order within a unit: the column
    /// (within the unit) whose code it is, and the bit its code sits at in the lane.
    fn order(self) -> &'static [Slot] {
        match self {
            Layout::Q4 => &ORDER_Q4,
            Layout::Q3 => &ORDER_Q3,
            Layout::Q2 => &ORDER_Q2,
            Layout::NaiveQ2 => &ORDER_PLAIN,
        }
    }
}

/// Where a code of the kernel's extraction order comes from.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Column within the unit (one or two 64-column groups).
    col: u8,
    /// Bit position of the code in its lane: the kernel sees `code · 2^shift`.
    shift: u8,
}

/// 4 bits, one group: position `8n + l` is nibble `n` of the group's word `l` (column
/// `8l + n`), masked in place except the top nibble, which a shift brings down because
/// bit 31 would make the lane negative.
const ORDER_Q4: [Slot; 64] = {
    let mut t = [Slot { col: 0, shift: 0 }; 64];
    let mut i = 0;
    while i < 64 {
        let (n, l) = (i / 8, i % 8);
        let shift = if n < 7 { 4 * n } else { 0 };
        t[i] = Slot {
            col: (8 * l + n) as u8,
            shift: shift as u8,
        };
        i += 1;
    }
    t
};

/// 2 bits, two groups: lane `l` holds word `l % 4` of group `l / 4` (the unit's 8
/// words in memory order); position `8it + l` is the code at bit `2it` of that word,
/// seen at bit `2it` of the low half or, shifted down by 16, of the high half.
const ORDER_Q2: [Slot; 128] = {
    let mut t = [Slot { col: 0, shift: 0 }; 128];
    let mut i = 0;
    while i < 128 {
        let (it, l) = (i / 8, i % 8);
        let (g, c, k) = (l / 4, (l % 4) / 2, l % 2);
        let s = 2 * it;
        t[i] = Slot {
            col: (64 * g + 32 * c + column(k, (s % 8) / 2, s / 8)) as u8,
            shift: (s % 16) as u8,
        };
        i += 1;
    }
    t
};

/// Bit at which the 3-bit kernel assembles a code of 2-bit group `p`, in byte 0: just
/// below the code's upper bits, which stay in place for `p` 1 and 2, move up one for
/// `p` 0 (nothing below bit 0) and down one for `p` 3 (bit 31 is the sign).
const Q3_AT: [usize; 4] = [0, 1, 3, 4];

/// 3 bits, two groups: lane `l` serves upper word `k = l % 2` of chunk `(l % 4) / 2` of
/// group `l / 4`; position `32p + 8b + l` is the code at 2-bit group `p`, byte `b`.
const ORDER_Q3: [Slot; 128] = {
    let mut t = [Slot { col: 0, shift: 0 }; 128];
    let mut i = 0;
    while i < 128 {
        let (p, b, l) = (i / 32, (i / 8) % 4, i % 8);
        let (g, c, k) = (l / 4, (l % 4) / 2, l % 2);
        t[i] = Slot {
            col: (64 * g + 32 * c + column(k, p, b)) as u8,
            shift: (8 * b + Q3_AT[p]) as u8,
        };
        i += 1;
    }
    t
};

const ORDER_PLAIN: [Slot; 64] = {
    let mut t = [Slot { col: 0, shift: 0 }; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = Slot {
            col: i as u8,
            shift: 0,
        };
        i += 1;
    }
    t
};

/// `2^-shift`, exactly.
fn inv_pow2(shift: u8) -> f32 {
    f32::from_bits((127 - shift as u32) << 23)
}

/// Instruction set a call runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 and FMA plus AVX-512F and VL: the same 256-bit kernels with 32 registers,
    /// and one-instruction bit-selects at 3 bits.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// Whether the AVX-512 whole-row kernels ([`x86::Rows`]) can run: they also need BW.
#[cfg(target_arch = "x86_64")]
fn x86_rows() -> bool {
    is_x86_feature_detected!("avx512bw")
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl") {
            return Isa::Avx512;
        }
        return Isa::Avx2;
    }
    Isa::Portable
}

/// Activation rows prepared for one call.
struct Prepared {
    /// `[batch, xcols]`: each unit of columns permuted and scaled by [`Layout::order`];
    /// a unit cut short by the end of the row is padded with zeros.
    xp: Vec<f32>,
    /// Floats per prepared row: `cols` rounded up to whole units.
    xcols: usize,
    /// `[batch, cols / 64]`: Σx over each group.
    sums: Vec<f32>,
}

fn prepare(x: &[f32], batch: usize, cols: usize, layout: Layout) -> Prepared {
    let (order, span) = (layout.order(), layout.unit() * GROUP_SIZE);
    let groups = cols / GROUP_SIZE;
    let xcols = cols.div_ceil(span) * span;
    let mut xp = vec![0.0f32; batch * xcols];
    for (dst, src) in xp
        .chunks_exact_mut(xcols)
        .zip(x[..batch * cols].chunks_exact(cols))
    {
        for (d, s) in dst.chunks_exact_mut(span).zip(src.chunks(span)) {
            for (v, slot) in d.iter_mut().zip(order) {
                let c = slot.col as usize;
                *v = if c < s.len() {
                    s[c] * inv_pow2(slot.shift)
                } else {
                    0.0
                };
            }
        }
    }
    let sums = x[..batch * cols]
        .chunks_exact(GROUP_SIZE)
        .map(sum8)
        .collect::<Vec<f32>>();
    debug_assert_eq!(sums.len(), batch * groups);
    Prepared { xp, xcols, sums }
}

/// Sum with eight lanes, which the compiler vectorises.
fn sum8(v: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = v.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Batch rows handled per pass over a weight row: enough to reuse each decoded vector,
/// few enough that accumulators stay in the 16 vector registers of AVX2.
const TILE: usize = 4;

/// A kernel: one weight row's words for `mult.len()` groups (from a unit boundary)
/// against `T` prepared activation rows `xs` floats apart, `Σ_g mult[g] · Σ_{i in g}
/// code_i · xp_i` for each.
type Kernel<const T: usize> = fn(&[u32], &[f32], &[f32], usize) -> [f32; T];

fn kernel<const T: usize>(layout: Layout, isa: Isa) -> Kernel<T> {
    match (isa, layout) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Layout::Q4) => x86::q4_vl::<T>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Layout::Q3) => x86::q3_vl::<T>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Layout::Q2) => x86::q2_vl::<T>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Layout::Q4) => x86::q4::<T>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Layout::Q3) => x86::q3::<T>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Layout::Q2) => x86::q2::<T>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512, Layout::NaiveQ2) => x86::naive_q2::<T>,
        (Isa::Portable, Layout::NaiveQ2) => naive_q2::<T, false>,
        (Isa::Portable, Layout::Q4) => portable::<T, 0>,
        (Isa::Portable, Layout::Q3) => portable::<T, 1>,
        (Isa::Portable, Layout::Q2) => portable::<T, 2>,
    }
}

/// One weight row against up to [`TILE`] prepared activation rows; see [`Kernel`].
fn row_dot(
    layout: Layout,
    isa: Isa,
    tile: usize,
    words: &[u32],
    mult: &[f32],
    xp: &[f32],
    xs: usize,
) -> [f32; TILE] {
    // The kernels read whole units: a unit cut short at the end of the row is read
    // from a padded copy inside them, never past `words`; `xp` is padded by `prepare`.
    let groups = mult.len();
    let span = groups.div_ceil(layout.unit()) * layout.unit() * GROUP_SIZE;
    assert!(words.len() >= groups * layout.group_words());
    assert!((1..=TILE).contains(&tile) && xp.len() >= (tile - 1) * xs + span);
    let mut out = [0.0f32; TILE];
    match tile {
        1 => out[..1].copy_from_slice(&kernel::<1>(layout, isa)(words, mult, xp, xs)),
        2 => out[..2].copy_from_slice(&kernel::<2>(layout, isa)(words, mult, xp, xs)),
        3 => out[..3].copy_from_slice(&kernel::<3>(layout, isa)(words, mult, xp, xs)),
        _ => out.copy_from_slice(&kernel::<4>(layout, isa)(words, mult, xp, xs)),
    }
    out
}

/// The words of the unit starting at group `g` (of `groups`), zero-padded to a whole
/// unit when the row ends inside it.
fn unit_words(words: &[u32], g: usize, groups: usize, gw: usize, unit: usize) -> [u32; 16] {
    let mut buf = [0u32; 16];
    let n = (groups - g).min(unit) * gw;
    buf[..n].copy_from_slice(&words[g * gw..g * gw + n]);
    buf
}

/// Portable kernels (`L`: 0 = 4 bits, 1 = 3 bits, 2 = 2 bits): decode a unit's codes in
/// extraction order as the SIMD kernels see them (`code · 2^shift`), scale each by its
/// group's multiplier, multiply with the prepared activations.
fn portable<const T: usize, const L: u8>(
    words: &[u32],
    mult: &[f32],
    xp: &[f32],
    xs: usize,
) -> [f32; T] {
    let layout = [Layout::Q4, Layout::Q3, Layout::Q2][L as usize];
    let (order, gw, unit) = (layout.order(), layout.group_words(), layout.unit());
    let span = unit * GROUP_SIZE;
    let groups = mult.len();
    let mut tot = [0.0f32; T];
    let mut codes = [0.0f32; 128];
    for g in (0..groups).step_by(unit) {
        let w = unit_words(words, g, groups, gw, unit);
        for (i, (c, slot)) in codes.iter_mut().zip(order).enumerate() {
            let code = match layout {
                Layout::Q4 => (w[i % 8] >> (4 * (i / 8))) & 0xF,
                Layout::Q2 => (w[i % 8] >> (2 * (i / 8))) & 3,
                _ => {
                    let (p, b, l) = (i / 32, (i / 8) % 4, i % 8);
                    let (u, k) = (6 * (l / 4) + 3 * ((l % 4) / 2), l % 2);
                    let upper = (w[u + k] >> (8 * b + 2 * p)) & 3;
                    2 * upper + ((w[u + 2] >> (8 * b + 4 * k + p)) & 1)
                }
            };
            let m = mult
                .get(g + slot.col as usize / GROUP_SIZE)
                .copied()
                .unwrap_or(0.0);
            *c = (code << slot.shift) as f32 * m;
        }
        for (t, tot) in tot.iter_mut().enumerate() {
            let x = &xp[t * xs + g * GROUP_SIZE..t * xs + g * GROUP_SIZE + span];
            *tot += crate::codec::dense::dot_lanes::<8>(&codes[..span], x);
        }
    }
    tot
}

/// The code-at-a-time baseline on the older layout: each code is shifted out of its
/// word, masked and converted on its own, in input order, then multiplied with its
/// activation. Written plainly, as one would without the layout: the compiler is free
/// to vectorise it (it does, with variable shifts), so what the comparison measures is
/// the decoding the layout saves, not a handicap. `FUSED` picks `mul_add`, which is one
/// instruction where FMA is available and a library call where it is not.
#[inline(always)]
fn naive_q2<const T: usize, const FUSED: bool>(
    words: &[u32],
    mult: &[f32],
    x: &[f32],
    xs: usize,
) -> [f32; T] {
    let mut tot = [0.0f32; T];
    for (g, &m) in mult.iter().enumerate() {
        let mut acc = [[0.0f32; 16]; T];
        for (wi, &word) in words[4 * g..4 * g + 4].iter().enumerate() {
            let mut codes = [0.0f32; 16];
            for (j, c) in codes.iter_mut().enumerate() {
                *c = ((word >> (2 * j)) & 3) as f32;
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let start = t * xs + GROUP_SIZE * g + 16 * wi;
                for ((a, &c), &xv) in acc.iter_mut().zip(&codes).zip(&x[start..start + 16]) {
                    *a = if FUSED {
                        c.mul_add(xv, *a)
                    } else {
                        *a + c * xv
                    };
                }
            }
        }
        for (tot, acc) in tot.iter_mut().zip(&acc) {
            *tot += m * acc.iter().sum::<f32>();
        }
    }
    tot
}

#[cfg(target_arch = "x86_64")]
mod x86;

/// The work of one call, fixed once.
struct Call<'a> {
    w: &'a AffineView<'a>,
    layout: Layout,
    isa: Isa,
    act: Prepared,
    batch: usize,
}

/// Activation floats (all batch rows) a column block may span: half of a 32 KiB L1, so
/// that the block stays cached while every weight row of a task passes over it. At
/// batch 8 a whole 2048-column row would need 64 KiB and be re-read from L2 per row.
const BLOCK_FLOATS: usize = 4096;

impl Call<'_> {
    /// Rows `o0 ..` through [`x86::Rows`] in tiles of up to [`TILE`] activation rows, at
    /// 4 and 2 bits; `false` (nothing written) at other layouts.
    #[cfg(target_arch = "x86_64")]
    fn whole_rows(&self, o0: usize, dst: &mut [f32]) -> bool {
        if !matches!(self.layout, Layout::Q4 | Layout::Q2) {
            return false;
        }
        let (a, off) = reconstruction(self.layout.bits());
        let rows = x86::Rows {
            words: self.w.words,
            scales: self.w.scales,
            biases: self.w.biases,
            groups: self.w.cols / GROUP_SIZE,
            xp: &self.act.xp,
            xs: self.act.xcols,
            sums: &self.act.sums,
            a,
            off,
            batch: self.batch,
        };
        for t0 in (0..self.batch).step_by(TILE) {
            match (self.layout, (self.batch - t0).min(TILE)) {
                (Layout::Q4, 1) => rows.q4::<1>(o0, dst, t0),
                (Layout::Q4, 2) => rows.q4::<2>(o0, dst, t0),
                (Layout::Q4, 3) => rows.q4::<3>(o0, dst, t0),
                (Layout::Q4, _) => rows.q4::<4>(o0, dst, t0),
                (_, 1) => rows.q2::<1>(o0, dst, t0),
                (_, 2) => rows.q2::<2>(o0, dst, t0),
                (_, 3) => rows.q2::<3>(o0, dst, t0),
                (_, _) => rows.q2::<4>(o0, dst, t0),
            }
        }
        true
    }

    /// Rows `o0 ..` of the product into `dst`, `[n_rows, batch]` (one row's batch
    /// values together). `scratch` holds the rows' multipliers.
    fn rows(&self, o0: usize, dst: &mut [f32], scratch: &mut Vec<f32>) {
        let (cols, batch) = (self.w.cols, self.batch);
        let groups = cols / GROUP_SIZE;
        #[cfg(target_arch = "x86_64")]
        if matches!(self.isa, Isa::Avx512) && x86_rows() && self.whole_rows(o0, dst) {
            return;
        }
        let n = dst.len() / batch;
        let per_row = words_per_row(cols, self.layout.bits());
        let (gw, unit) = (self.layout.group_words(), self.layout.unit());
        let (a, off) = reconstruction(self.layout.bits());
        scratch.resize((n + 1) * groups, 0.0);
        let (mult, offs) = scratch.split_at_mut(n * groups);
        // Multipliers for every row, and the offsets' share `Σ_g (o·s + b) · Σx`
        // as each output's starting value.
        for (i, out) in dst.chunks_exact_mut(batch).enumerate() {
            let g0 = (o0 + i) * groups;
            let row_mult = &mut mult[i * groups..(i + 1) * groups];
            let scales = &self.w.scales[g0..g0 + groups];
            let biases = &self.w.biases[g0..g0 + groups];
            for (((m, c), s), b) in row_mult
                .iter_mut()
                .zip(offs.iter_mut())
                .zip(scales)
                .zip(biases)
            {
                let (s, b) = (s.to_f32(), b.to_f32());
                *m = a * s;
                *c = off * s + b;
            }
            for (t, o) in out.iter_mut().enumerate() {
                *o = crate::codec::dense::dot_lanes::<8>(
                    offs,
                    &self.act.sums[t * groups..(t + 1) * groups],
                );
            }
        }
        // Column blocks start on unit boundaries, so only a row's last block can end
        // inside a unit.
        let block = (BLOCK_FLOATS / (batch * GROUP_SIZE * unit)).max(1) * unit;
        let xs = self.act.xcols;
        for g0 in (0..groups).step_by(block) {
            let g1 = (g0 + block).min(groups);
            for (i, out) in dst.chunks_exact_mut(batch).enumerate() {
                let row = (o0 + i) * per_row;
                let words = &self.w.words[row + g0 * gw..row + g1 * gw];
                // The next rows' words, requested now: at batch 1 a row takes about as
                // long to multiply as its words take to arrive from memory, and the
                // hardware prefetcher alone leaves part of that wait exposed.
                if i + PREFETCH_ROWS < n {
                    let ahead = row + PREFETCH_ROWS * per_row;
                    prefetch(&self.w.words[ahead + g0 * gw..ahead + g1 * gw]);
                }
                let m = &mult[i * groups + g0..i * groups + g1];
                for t0 in (0..batch).step_by(TILE) {
                    let tile = TILE.min(batch - t0);
                    let xp = &self.act.xp[t0 * xs + g0 * GROUP_SIZE..];
                    let dots = row_dot(self.layout, self.isa, tile, words, m, xp, xs);
                    for (o, d) in out[t0..t0 + tile].iter_mut().zip(dots) {
                        *o += d;
                    }
                }
            }
        }
    }
}

/// Rows ahead of the current one whose words [`Call::rows`] asks the memory system for.
const PREFETCH_ROWS: usize = 4;

/// Asks for `words` to be brought into cache, one request per 64-byte line.
pub(crate) fn prefetch<T>(words: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in words.chunks((64 / std::mem::size_of::<T>()).max(1)) {
        // SAFETY: a prefetch is a hint and never faults; the address is in `words`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = words;
}

/// Computes output rows `o0 ..` into `dst` (`[n_rows, batch]`, one row's batch values
/// together) with a scratch buffer of the worker's.
pub(crate) type RowsFn<'a> = dyn Fn(usize, &mut [f32], &mut Vec<f32>) + Sync + 'a;

/// Splits the rows over the calling thread and the rayon pool.
///
/// The calling thread starts on the rows at once and pool threads join as they come,
/// all taking chunks from one counter. Waking a sleeping pool thread can take tens of
/// microseconds (far more in a virtual machine), as long as a whole expert product at
/// batch 1; with `par_chunks` the caller would only wait for it.
fn share_rows(dst: &mut [f32], rows: usize, batch: usize, rows_fn: &RowsFn<'_>) {
    let helpers = rayon::current_num_threads().saturating_sub(1);
    // Enough chunks that threads arriving late still find work, each at least 8 rows
    // so the per-chunk cost stays small next to the product.
    let chunk = rows.div_ceil(8 * (helpers + 1)).clamp(8, 64);
    let slots: Vec<Mutex<Option<&mut [f32]>>> = dst
        .chunks_mut(chunk * batch)
        .map(|d| Mutex::new(Some(d)))
        .collect();
    let next = AtomicUsize::new(0);
    let work = || {
        let mut scratch = Vec::new();
        loop {
            let c = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = slots.get(c) else { break };
            if let Some(d) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                rows_fn(c * chunk, d, &mut scratch);
            }
        }
    };
    if helpers == 0 || slots.len() == 1 {
        work();
        return;
    }
    rayon::in_place_scope(|s| {
        for _ in 0..helpers.min(slots.len() - 1) {
            s.spawn(|_| work());
        }
        work();
    });
}

/// Multiply-adds below which a product runs on the calling thread even where it may
/// thread: at batch 1 a 256 × 256 product takes about 6 µs on one core and a little more
/// shared between two (docs/notes/cpu-decode-2026-12-04.md).
const THREAD_ABOVE: usize = 1 << 17;

/// Whether a product of `products` multiply-adds is worth sharing between threads.
pub(crate) fn worth_threads(products: usize) -> bool {
    products >= THREAD_ABOVE
}

/// Runs `rows_fn` over all `rows` output rows, threaded when `parallel`, and puts the
/// results in `out` as `[batch, rows]`.
pub(crate) fn by_rows(
    out: &mut [f32],
    rows: usize,
    batch: usize,
    parallel: bool,
    rows_fn: &RowsFn<'_>,
) {
    // With one activation row the `[rows, batch]` order the row loop writes is `out`'s
    // own; otherwise it goes through a transpose, which costs rows × batch copies.
    let mut transposed = if batch == 1 {
        Vec::new()
    } else {
        vec![0.0f32; rows * batch]
    };
    let dst: &mut [f32] = if batch == 1 { out } else { &mut transposed };
    if parallel {
        share_rows(dst, rows, batch, rows_fn);
    } else {
        rows_fn(0, dst, &mut Vec::new());
    }
    if batch > 1 {
        for (o, vals) in transposed.chunks_exact(batch).enumerate() {
            for (b, &v) in vals.iter().enumerate() {
                out[b * rows + o] = v;
            }
        }
    }
}

fn run(
    x: &[f32],
    batch: usize,
    w: &AffineView<'_>,
    out: &mut [f32],
    layout: Layout,
    isa: Isa,
    parallel: bool,
) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(w.bits, layout.bits(), "view holds {}-bit words", w.bits);
    assert!(
        cols.is_multiple_of(GROUP_SIZE),
        "{cols} columns is not a multiple of {GROUP_SIZE}"
    );
    let groups = cols / GROUP_SIZE;
    assert!(
        w.words.len() >= rows * words_per_row(cols, w.bits),
        "too few words"
    );
    assert!(w.scales.len() >= rows * groups && w.biases.len() >= rows * groups);
    assert!(
        x.len() >= batch * cols,
        "x holds {} values, {batch}×{cols} needed",
        x.len()
    );
    assert!(
        out.len() >= batch * rows,
        "out holds {} values, {batch}×{rows} needed",
        out.len()
    );
    let out = &mut out[..batch * rows];
    if batch == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        out.fill(0.0);
        return;
    }
    let call = Call {
        w,
        layout,
        isa,
        act: prepare(x, batch, cols, layout),
        batch,
    };
    let parallel = parallel && worth_threads(batch * rows * cols);
    by_rows(out, rows, batch, parallel, &|o0, d, s| call.rows(o0, d, s));
}

/// `out[b * rows + o] = Σ_i x[b * cols + i] · w[o, i]` for `batch` activation rows,
/// threaded over output rows. `w.bits` selects MLX 4-bit words or the 3- and 2-bit
/// layouts of [`super::lowbit`].
///
/// # Panics
/// If `w.bits` is not 2, 3 or 4, `w.cols` not a multiple of 64, or a buffer too short.
pub fn matmul(x: &[f32], batch: usize, w: &AffineView<'_>, out: &mut [f32]) {
    run(x, batch, w, out, layout_of(w.bits), detect(), true);
}

/// [`matmul`] on the calling thread, for callers that are already parallel (over
/// experts, say).
pub fn matmul_serial(x: &[f32], batch: usize, w: &AffineView<'_>, out: &mut [f32]) {
    run(x, batch, w, out, layout_of(w.bits), detect(), false);
}

/// The baseline [`matmul`] is measured against: `w` in the older code-at-a-time 2-bit
/// layout ([`super::lowbit::pack_matrix_naive_q2`], `w.bits` 2), each code decoded on
/// its own. Same threading and the same offset folding as [`matmul`].
pub fn matmul_naive_q2(x: &[f32], batch: usize, w: &AffineView<'_>, out: &mut [f32]) {
    run(x, batch, w, out, Layout::NaiveQ2, detect(), true);
}

/// The oracle: expands `w` to f32 (the midpoint reconstruction at 2 and 3 bits) and
/// multiplies plainly, summing in f64.
pub fn matmul_reference(x: &[f32], batch: usize, w: &AffineView<'_>, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let dense = lowbit::dequantize(w.words, w.scales, w.biases, rows, cols, w.bits);
    for b in 0..batch {
        let xr = &x[b * cols..(b + 1) * cols];
        for o in 0..rows {
            let wr = &dense[o * cols..(o + 1) * cols];
            let s: f64 = xr.iter().zip(wr).map(|(&a, &c)| a as f64 * c as f64).sum();
            out[b * rows + o] = s as f32;
        }
    }
}

fn layout_of(bits: u32) -> Layout {
    match bits {
        4 => Layout::Q4,
        3 => Layout::Q3,
        2 => Layout::Q2,
        _ => panic!("no affine kernel for {bits}-bit words (2, 3, 4)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::affine::{lowbit, quantize};
    use crate::testing::{fresh, poisoned, rel_err};

    /// One random matrix in every layout: MLX 4-bit, then 3-bit, 2-bit and the naive
    /// 2-bit layout derived from it.
    struct Mats {
        rows: usize,
        cols: usize,
        q4: Vec<u32>,
        q3: Vec<u32>,
        q2: Vec<u32>,
        naive: Vec<u32>,
        scales: Vec<bf16>,
        biases: Vec<bf16>,
    }

    impl Mats {
        fn new(rows: usize, cols: usize, salt: u64) -> Mats {
            let q = quantize(&fresh(rows * cols, salt), rows, cols, 4).unwrap();
            let pack = |bits| {
                let mut d = vec![0u32; rows * words_per_row(cols, bits)];
                lowbit::pack_matrix(&q.words, rows, cols, bits, &mut d);
                d
            };
            let mut naive = vec![0u32; rows * cols / 16];
            lowbit::pack_matrix_naive_q2(&q.words, rows, cols, &mut naive);
            Mats {
                rows,
                cols,
                q3: pack(3),
                q2: pack(2),
                naive,
                q4: q.words,
                scales: q.scales,
                biases: q.biases,
            }
        }

        fn view(&self, bits: u32, naive: bool) -> AffineView<'_> {
            let words = match (bits, naive) {
                (4, _) => &self.q4,
                (3, _) => &self.q3,
                (2, false) => &self.q2,
                _ => &self.naive,
            };
            AffineView {
                bits,
                rows: self.rows,
                cols: self.cols,
                words,
                scales: &self.scales,
                biases: &self.biases,
            }
        }
    }

    /// Every instruction set this machine can run, so each variant is checked here.
    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if detect() != Isa::Portable {
                v.push(Isa::Avx2);
            }
            if detect() == Isa::Avx512 {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    #[test]
    fn every_kernel_matches_the_reference() {
        // 320 columns = 5 groups (an odd count), 768 = 12; rows not a multiple of the
        // task size.
        for (salt, (rows, cols)) in [(37usize, 320usize), (70, 768)].into_iter().enumerate() {
            let m = Mats::new(rows, cols, 900 + salt as u64);
            for batch in [1usize, 2, 3, 5, 8, 16] {
                let x = fresh(batch * cols, 910 + batch as u64);
                for (bits, naive) in [(4u32, false), (3, false), (2, false), (2, true)] {
                    let mut want = poisoned(batch * rows);
                    matmul_reference(&x, batch, &m.view(bits, false), &mut want);
                    let layout = if naive {
                        Layout::NaiveQ2
                    } else {
                        layout_of(bits)
                    };
                    for isa in isas() {
                        for parallel in [false, true] {
                            let mut got = poisoned(batch * rows);
                            run(
                                &x,
                                batch,
                                &m.view(bits, naive),
                                &mut got,
                                layout,
                                isa,
                                parallel,
                            );
                            let e = rel_err(&got, &want);
                            assert!(
                                e < 1e-5,
                                "{layout:?} {isa:?} parallel {parallel} batch {batch} \
                                 {rows}×{cols}: rel err {e}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn public_entry_points_agree_with_the_reference() {
        let m = Mats::new(50, 2048, 920);
        for batch in [1usize, 4, 9] {
            let x = fresh(batch * 2048, 921 + batch as u64);
            for bits in [4u32, 3, 2] {
                let mut want = poisoned(batch * 50);
                matmul_reference(&x, batch, &m.view(bits, false), &mut want);
                let mut got = poisoned(batch * 50);
                matmul(&x, batch, &m.view(bits, false), &mut got);
                assert!(rel_err(&got, &want) < 1e-5, "matmul q{bits} batch {batch}");
                let mut got = poisoned(batch * 50);
                matmul_serial(&x, batch, &m.view(bits, false), &mut got);
                assert!(rel_err(&got, &want) < 1e-5, "serial q{bits} batch {batch}");
            }
            let mut want = poisoned(batch * 50);
            matmul_reference(&x, batch, &m.view(2, false), &mut want);
            let mut got = poisoned(batch * 50);
            matmul_naive_q2(&x, batch, &m.view(2, true), &mut got);
            assert!(rel_err(&got, &want) < 1e-5, "naive batch {batch}");
        }
    }

    #[test]
    fn reference_matches_dense_product_of_mlx_dequantization() {
        let (rows, cols, batch) = (9, 128, 2);
        let q = quantize(&fresh(rows * cols, 930), rows, cols, 4).unwrap();
        let dense = crate::codec::affine::dequantize(&q);
        let x = fresh(batch * cols, 931);
        let mut want = poisoned(batch * rows);
        crate::backend::cpu::reference::matmul(&x, &dense, batch, cols, rows, &mut want);
        let mut got = poisoned(batch * rows);
        matmul_reference(&x, batch, &q.view().unwrap(), &mut got);
        assert!(rel_err(&got, &want) < 1e-6);
    }

    #[test]
    fn orders_are_permutations() {
        for layout in [Layout::Q4, Layout::Q3, Layout::Q2, Layout::NaiveQ2] {
            let order = layout.order();
            assert_eq!(order.len(), layout.unit() * GROUP_SIZE);
            let mut seen = vec![false; order.len()];
            for s in order {
                assert!(!seen[s.col as usize], "{layout:?} column {}", s.col);
                seen[s.col as usize] = true;
                assert!(s.shift <= 28);
            }
        }
    }

    #[test]
    fn empty_batch_touches_nothing() {
        let m = Mats::new(4, 64, 940);
        let mut out = poisoned(4);
        matmul(&[], 0, &m.view(4, false), &mut out);
        assert!(out.iter().all(|v| v.is_nan()));
    }
}
