//! The 2- and 3-bit layouts derived from MLX 4-bit codes (seed 000).
//!
//! A reduced-bit matrix keeps the 4-bit matrix's bf16 scales and biases and drops the
//! low bits of each code: `q >> 2` at two bits, reconstructed at `(4q + 1.5) * scale +
//! bias`, and `q >> 1` at three bits, at `(2q + 0.5) * scale + bias` (the midpoints of
//! the 4-bit ranges each new code covers).
//!
//! # Layout
//!
//! Each row is cut into chunks of 32 consecutive input columns `x[32c .. 32c + 32]`,
//! seen as an even stream `xe[j] = x[32c + 2j]` and an odd stream `xo[j] = x[32c + 2j +
//! 1]`, `j < 16`. That is the order the MLX 4-bit nibble trick reads codes in: for a
//! 4-bit word `w`, the bytes of `w & 0x0F0F0F0F` are the codes of four consecutive `xe`
//! elements and those of `(w >> 4) & 0x0F0F0F0F` of the matching `xo` elements. The
//! reduced layouts keep that property, so a kernel multiplies four consecutive floats by
//! the four bytes of one masked word.
//!
//! - **2 bits**, two words per chunk. Word `k` (0, 1), group `p` (0..4), byte `b` (0..4)
//!   holds at bit `8b + 2p` the code of `xe[8k + 4p + b]` for `p < 2` and of
//!   `xo[8k + 4(p - 2) + b]` for `p >= 2`; `(word >> 2p) & 0x03030303` is four
//!   consecutive codes of one stream.
//! - **3 bits**, three words per chunk. Words 0 and 1 hold each code's upper two bits in
//!   exactly the 2-bit layout; word 2 holds its lowest bit at `8b + 4k + p`, `(k, p, b)`
//!   being the code's 2-bit position, so `(w2 >> (4k + p)) & 0x01010101` lines up byte
//!   for byte with `(word_k >> 2p) & 0x03030303` and `code = 2 * upper + lowest`.
//!
//! A row's words are contiguous (`cols / 16` at 2 bits, `3 * cols / 32` at 3, `cols / 8`
//! at 4) and rows follow each other in order.
//!
//! The older layout this replaces ([`pack_matrix_naive_q2`]) packs 16 two-bit codes per
//! word in input order; it is kept as the baseline the layout is measured against.

use half::bf16;
use rayon::prelude::*;

use super::GROUP_SIZE;

/// Columns per chunk of the reduced layouts.
pub const CHUNK: usize = 32;

/// Words per row of a `bits`-bit matrix with `cols` input columns (`bits` in 2, 3, 4).
///
/// # Panics
/// On any other bit width.
pub fn words_per_row(cols: usize, bits: u32) -> usize {
    match bits {
        4 => cols / 8,
        3 => cols * 3 / 32,
        2 => cols / 16,
        _ => panic!("no affine layout at {bits} bits (2, 3, 4)"),
    }
}

/// Position of column `j` (`j < 32`) of a chunk in the 2-bit layout: word `k`, group
/// `p`, byte `b`. Column `j` is element `j / 2` of the even (`j` even) or odd stream.
const fn slot(j: usize) -> (usize, usize, usize) {
    let e = j / 2;
    let p = (e % 8) / 4 + 2 * (j % 2);
    (e / 8, p, e % 4)
}

/// For column `j` (`j < 32`) of a chunk: which of the chunk's two 2-bit words holds its
/// code, and at which bit offset.
pub fn q2_slot(j: usize) -> (usize, u32) {
    assert!(j < CHUNK, "column {j} is outside a 32-column chunk");
    let (k, p, b) = slot(j);
    (k, (8 * b + 2 * p) as u32)
}

/// For column `j` (`j < 32`) of a chunk: the bit offset of its code's lowest bit in the
/// chunk's third 3-bit word.
pub fn q3_low_bit(j: usize) -> u32 {
    assert!(j < CHUNK, "column {j} is outside a 32-column chunk");
    let (k, p, b) = slot(j);
    (8 * b + 4 * k + p) as u32
}

/// The column (within a chunk) of the code at `(k, p, b)`: the inverse of [`q2_slot`].
pub(crate) const fn column(k: usize, p: usize, b: usize) -> usize {
    if p < 2 {
        2 * (8 * k + 4 * p + b)
    } else {
        2 * (8 * k + 4 * (p - 2) + b) + 1
    }
}

fn check_shape(q4_words: &[u32], rows: usize, cols: usize, dst: &[u32], bits: u32) {
    assert!(
        cols.is_multiple_of(GROUP_SIZE),
        "{cols} columns is not a multiple of {GROUP_SIZE}"
    );
    assert!(
        q4_words.len() >= rows * cols / 8,
        "4-bit source holds {} words, {rows}×{cols} needs {}",
        q4_words.len(),
        rows * cols / 8
    );
    let need = rows * words_per_row(cols, bits);
    assert!(
        dst.len() >= need,
        "destination holds {} words, needs {need}",
        dst.len()
    );
}

/// The 2-bit words (and, for 3 bits, the low-bit word) of one chunk, from its four MLX
/// 4-bit words. Whole-word masks move 4 codes at a time: `(w >> 2) & 0x03030303` is the
/// top two bits of the even-column nibbles, already one per byte in stream order.
#[inline]
fn pack_chunk(w: &[u32]) -> ([u32; 2], u32) {
    const M2: u32 = 0x0303_0303;
    const M1: u32 = 0x0101_0101;
    let even = |i: usize| (w[i] >> 2) & M2;
    let odd = |i: usize| (w[i] >> 6) & M2;
    let even_low = |i: usize| (w[i] >> 1) & M1;
    let odd_low = |i: usize| (w[i] >> 5) & M1;
    let mut upper = [0u32; 2];
    let mut low = 0u32;
    for (k, upper) in upper.iter_mut().enumerate() {
        // Source words 2k and 2k+1 cover xe/xo[8k .. 8k + 8]: groups p = 0, 1 (even) and
        // p = 2, 3 (odd) of word k.
        *upper = even(2 * k) | even(2 * k + 1) << 2 | odd(2 * k) << 4 | odd(2 * k + 1) << 6;
        let s = 4 * k as u32;
        low |= even_low(2 * k) << s
            | even_low(2 * k + 1) << (s + 1)
            | odd_low(2 * k) << (s + 2)
            | odd_low(2 * k + 1) << (s + 3);
    }
    (upper, low)
}

/// Repacks a row-major matrix of MLX 4-bit words into the `bits`-bit layout (2 or 3;
/// 4 copies). `dst` must hold `rows * words_per_row(cols, bits)` words.
///
/// # Panics
/// If `cols` is not a multiple of 64 or a buffer is too short.
pub fn pack_matrix(q4_words: &[u32], rows: usize, cols: usize, bits: u32, dst: &mut [u32]) {
    check_shape(q4_words, rows, cols, dst, bits);
    let (src_row, dst_row) = (cols / 8, words_per_row(cols, bits));
    if rows == 0 || cols == 0 {
        return;
    }
    let src = &q4_words[..rows * src_row];
    let dst = &mut dst[..rows * dst_row];
    match bits {
        4 => dst.copy_from_slice(src),
        2 => dst
            .par_chunks_mut(dst_row)
            .zip(src.par_chunks(src_row))
            .for_each(|(d, s)| {
                for (dc, sc) in d.chunks_exact_mut(2).zip(s.chunks_exact(4)) {
                    dc.copy_from_slice(&pack_chunk(sc).0);
                }
            }),
        3 => dst
            .par_chunks_mut(dst_row)
            .zip(src.par_chunks(src_row))
            .for_each(|(d, s)| {
                for (dc, sc) in d.chunks_exact_mut(3).zip(s.chunks_exact(4)) {
                    let (upper, low) = pack_chunk(sc);
                    dc[0] = upper[0];
                    dc[1] = upper[1];
                    dc[2] = low;
                }
            }),
        _ => panic!("pack_matrix targets 2, 3 or 4 bits, not {bits}"),
    }
}

/// Sixteen 2-bit codes in input order from two MLX 4-bit words (8 nibbles each): keep
/// each nibble's top two bits and squeeze out the gaps, 2 → 4 → 8 → 16 bits at a time.
#[inline]
fn squeeze(w: u32) -> u32 {
    let t = (w >> 2) & 0x3333_3333;
    let t = (t | t >> 2) & 0x0F0F_0F0F;
    let t = (t | t >> 4) & 0x00FF_00FF;
    (t | t >> 8) & 0x0000_FFFF
}

/// Repacks MLX 4-bit words into the older code-at-a-time 2-bit layout: 16 codes
/// (`q >> 2`) per word, low bits first, in input order. `dst` must hold
/// `rows * cols / 16` words.
///
/// # Panics
/// If `cols` is not a multiple of 64 or a buffer is too short.
pub fn pack_matrix_naive_q2(q4_words: &[u32], rows: usize, cols: usize, dst: &mut [u32]) {
    check_shape(q4_words, rows, cols, dst, 2);
    let n = rows * cols / 16;
    dst[..n]
        .par_iter_mut()
        .zip(q4_words[..2 * n].par_chunks_exact(2))
        .for_each(|(d, s)| *d = squeeze(s[0]) | squeeze(s[1]) << 16);
}

/// One row's codes from its words, in input order. The reduced layouts are read the
/// way they were packed, four codes per masked word.
fn decode_row(w: &[u32], bits: u32, out: &mut [u8]) {
    const M2: u32 = 0x0303_0303;
    const M1: u32 = 0x0101_0101;
    match bits {
        4 => {
            for (o, &word) in out.chunks_exact_mut(8).zip(w) {
                for (n, v) in o.iter_mut().enumerate() {
                    *v = ((word >> (4 * n)) & 0xF) as u8;
                }
            }
        }
        _ => {
            let per_chunk = if bits == 2 { 2 } else { 3 };
            for (o, cw) in out.chunks_exact_mut(CHUNK).zip(w.chunks_exact(per_chunk)) {
                let low = if bits == 3 { cw[2] } else { 0 };
                for k in 0..2 {
                    for p in 0..4 {
                        let upper = ((cw[k] >> (2 * p)) & M2).to_le_bytes();
                        let lowest = ((low >> (4 * k + p)) & M1).to_le_bytes();
                        for b in 0..4 {
                            o[column(k, p, b)] = if bits == 2 {
                                upper[b]
                            } else {
                                2 * upper[b] + lowest[b]
                            };
                        }
                    }
                }
            }
        }
    }
}

/// The codes of a `bits`-bit matrix (2 or 3 in the layouts above, 4 in MLX's), one byte
/// each, row-major in input order.
///
/// # Panics
/// On a bit width other than 2, 3, 4 or a buffer too short for the shape.
pub fn unpack_codes(words: &[u32], rows: usize, cols: usize, bits: u32) -> Vec<u8> {
    let per_row = words_per_row(cols, bits);
    assert!(
        cols.is_multiple_of(CHUNK),
        "{cols} columns is not a multiple of {CHUNK}"
    );
    assert!(
        words.len() >= rows * per_row,
        "too few words for {rows}×{cols}"
    );
    let mut out = vec![0u8; rows * cols];
    if cols > 0 {
        out.par_chunks_mut(cols)
            .zip(words.par_chunks(per_row))
            .for_each(|(o, w)| decode_row(w, bits, o));
    }
    out
}

/// The codes of a matrix in the older code-at-a-time 2-bit layout, one byte each,
/// row-major in input order.
pub fn unpack_codes_naive_q2(words: &[u32], rows: usize, cols: usize) -> Vec<u8> {
    assert!(
        words.len() >= rows * cols / 16,
        "too few words for {rows}×{cols}"
    );
    (0..rows * cols)
        .map(|i| ((words[i / 16] >> (2 * (i % 16))) & 3) as u8)
        .collect()
}

/// `(a, o)` such that code `q` stands for `(a * q + o) * scale + bias`: the midpoint
/// reconstruction of the reduced layouts, plain MLX at 4 bits.
pub(crate) fn reconstruction(bits: u32) -> (f32, f32) {
    match bits {
        4 => (1.0, 0.0),
        3 => (2.0, 0.5),
        2 => (4.0, 1.5),
        _ => panic!("no affine layout at {bits} bits (2, 3, 4)"),
    }
}

/// Expands a `bits`-bit matrix (2, 3 in the layouts above, 4 in MLX's) to row-major f32,
/// with the midpoint reconstruction at 2 and 3 bits: `(a·q + o) · scale + bias`.
///
/// # Panics
/// On a bit width other than 2, 3, 4 or a buffer too short for the shape.
pub fn dequantize(
    words: &[u32],
    scales: &[bf16],
    biases: &[bf16],
    rows: usize,
    cols: usize,
    bits: u32,
) -> Vec<f32> {
    let per_row = words_per_row(cols, bits);
    let groups = cols / GROUP_SIZE;
    assert!(
        cols.is_multiple_of(GROUP_SIZE),
        "{cols} columns is not a multiple of {GROUP_SIZE}"
    );
    assert!(
        words.len() >= rows * per_row,
        "too few words for {rows}×{cols}"
    );
    assert!(scales.len() >= rows * groups && biases.len() >= rows * groups);
    let (a, o) = reconstruction(bits);
    let mut out = vec![0.0f32; rows * cols];
    if cols == 0 {
        return out;
    }
    out.par_chunks_mut(cols).enumerate().for_each_init(
        || vec![0u8; cols],
        |codes, (r, row)| {
            decode_row(&words[r * per_row..(r + 1) * per_row], bits, codes);
            let (s, b) = (&scales[r * groups..], &biases[r * groups..]);
            for (g, (vals, qs)) in row
                .chunks_exact_mut(GROUP_SIZE)
                .zip(codes.chunks_exact(GROUP_SIZE))
                .enumerate()
            {
                let (s, b) = (s[g].to_f32(), b[g].to_f32());
                for (v, &q) in vals.iter_mut().zip(qs) {
                    *v = (a * q as f32 + o) * s + b;
                }
            }
        },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// Per chunk column: (word, shift) of its 2-bit code, then the shift of its 3-bit low bit.
    const SLOTS: [(u8, u8, u8); CHUNK] = {
        let mut t = [(0u8, 0u8, 0u8); CHUNK];
        let mut j = 0;
        while j < CHUNK {
            let (k, p, b) = slot(j);
            t[j] = (k as u8, (8 * b + 2 * p) as u8, (8 * b + 4 * k + p) as u8);
            j += 1;
        }
        t
    };

    /// Codes read one at a time through [`q2_slot`]'s and [`q3_low_bit`]'s positions:
    /// the oracle the word-at-a-time readers are checked against.
    fn unpack_by_slots(words: &[u32], rows: usize, cols: usize, bits: u32) -> Vec<u8> {
        let per_row = words_per_row(cols, bits);
        let mut out = vec![0u8; rows * cols];
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            let w = &words[r * per_row..(r + 1) * per_row];
            for (c, chunk) in row.chunks_exact_mut(CHUNK).enumerate() {
                for (j, code) in chunk.iter_mut().enumerate() {
                    let (k, s, l) = SLOTS[j];
                    *code = match bits {
                        4 => (w[4 * c + j / 8] >> (4 * (j % 8))) & 0xF,
                        2 => (w[2 * c + k as usize] >> s) & 3,
                        _ => {
                            let upper = (w[3 * c + k as usize] >> s) & 3;
                            2 * upper + ((w[3 * c + 2] >> l) & 1)
                        }
                    } as u8;
                }
            }
        }
        out
    }

    /// Random 4-bit words for a `rows × cols` matrix.
    fn random_q4(rows: usize, cols: usize, salt: u64) -> Vec<u32> {
        let mut rng = Rng::new(salt);
        (0..rows * cols / 8)
            .map(|_| rng.next_u64() as u32)
            .collect()
    }

    fn q4_codes(words: &[u32]) -> Vec<u8> {
        words
            .iter()
            .flat_map(|&w| (0..8).map(move |n| ((w >> (4 * n)) & 0xF) as u8))
            .collect()
    }

    const SHAPES: [(usize, usize); 5] = [(1, 64), (3, 128), (2, 192), (5, 768), (4, 2048)];

    #[test]
    fn pack_then_unpack_is_exact() {
        for (i, &(rows, cols)) in SHAPES.iter().enumerate() {
            let q4 = random_q4(rows, cols, 800 + i as u64);
            let codes = q4_codes(&q4);
            assert_eq!(unpack_codes(&q4, rows, cols, 4), codes);
            for (bits, drop) in [(2u32, 2u32), (3, 1)] {
                let mut packed = vec![0u32; rows * words_per_row(cols, bits)];
                pack_matrix(&q4, rows, cols, bits, &mut packed);
                let want: Vec<u8> = codes.iter().map(|&c| c >> drop).collect();
                assert_eq!(
                    unpack_by_slots(&packed, rows, cols, bits),
                    want,
                    "{rows}×{cols} q{bits}"
                );
                assert_eq!(
                    unpack_codes(&packed, rows, cols, bits),
                    want,
                    "{rows}×{cols} q{bits}"
                );
            }
            let mut naive = vec![0u32; rows * cols / 16];
            pack_matrix_naive_q2(&q4, rows, cols, &mut naive);
            let want: Vec<u8> = codes.iter().map(|&c| c >> 2).collect();
            assert_eq!(
                unpack_codes_naive_q2(&naive, rows, cols),
                want,
                "{rows}×{cols} naive"
            );
            let mut copy = vec![0u32; q4.len()];
            pack_matrix(&q4, rows, cols, 4, &mut copy);
            assert_eq!(copy, q4);
        }
    }

    /// A one-row, two-chunk matrix whose only non-zero 4-bit code is `code` at `col`.
    fn single(col: usize, code: u32) -> Vec<u32> {
        let mut w = vec![0u32; 64 / 8];
        w[col / 8] = code << (4 * (col % 8));
        w
    }

    fn pack(q4: &[u32], bits: u32) -> Vec<u32> {
        let mut d = vec![0u32; words_per_row(64, bits)];
        pack_matrix(q4, 1, 64, bits, &mut d);
        d
    }

    #[test]
    fn hand_placed_codes_land_where_the_layout_says() {
        // Each case: column, then the 2-bit word index and bit worked out by hand, then
        // the 3-bit low-bit word index and bit. 4-bit code 14 = 0b1110 gives 2-bit code
        // 0b11 and 3-bit code 0b111 (upper 0b11, lowest 1).
        let cases = [
            // Column 0 = xe[0] of chunk 0: k 0, p 0, b 0 → word 0 bit 0; low at 0.
            (0usize, 0usize, 0u32, 2usize, 0u32),
            // Column 10 = xe[5]: k 0, p 1 (5 = 4·1 + 1), b 1 → word 0 bit 8·1 + 2·1 =
            // 10; low bit 8·1 + 4·0 + 1 = 9.
            (10, 0, 10, 2, 9),
            // Column 27 = xo[13]: k 1, p 2 + 1 = 3 (13 = 8 + 4·1 + 1), b 1 → word 1 bit
            // 8 + 6 = 14; low bit 8 + 4 + 3 = 15.
            (27, 1, 14, 2, 15),
            // Column 30 = xe[15]: k 1, p 1, b 3 → word 1 bit 24 + 2 = 26; low 24 + 4 + 1.
            (30, 1, 26, 2, 29),
            // Column 31 = xo[15]: k 1, p 3, b 3 → word 1 bit 30; low bit 31.
            (31, 1, 30, 2, 31),
            // Column 33 = chunk 1, xo[0]: k 0, p 2, b 0 → chunk 1's word 0, i.e. word 2
            // of the row (word 3 at 3 bits), bit 4; low bit 2 in word 3 + 2 = 5.
            (33, 2, 4, 5, 2),
            // Column 36 = chunk 1, xe[2]: k 0, p 0, b 2 → word 2 bit 16; low bit 16.
            (36, 2, 16, 5, 16),
        ];
        for (col, w2, bit2, w3low, bit3low) in cases {
            let q4 = single(col, 14);
            let mut want2 = vec![0u32; 4];
            want2[w2] = 3 << bit2;
            assert_eq!(pack(&q4, 2), want2, "q2 column {col}");
            // Upper bits of the 3-bit code use the same word and bit, counted in 3-word
            // chunks; the low bit goes to the chunk's third word.
            let mut want3 = vec![0u32; 6];
            want3[3 * (w2 / 2) + w2 % 2] = 3 << bit2;
            want3[w3low] = 1 << bit3low;
            assert_eq!(pack(&q4, 3), want3, "q3 column {col}");
            let j = col % 32;
            assert_eq!(q2_slot(j), (w2 % 2, bit2));
            assert_eq!(q3_low_bit(j), bit3low);
            // 4-bit code 13 = 0b1101: 3-bit 0b110, lowest bit 0, so no low word bit.
            let q4 = single(col, 13);
            want3[w3low] = 0;
            assert_eq!(pack(&q4, 3), want3, "q3 column {col}, code 13");
        }
    }

    #[test]
    fn slots_cover_every_bit_once() {
        let mut seen2 = [[false; 32]; 2];
        let mut seen3 = [false; 32];
        for j in 0..32 {
            let (k, b) = q2_slot(j);
            assert!(b % 2 == 0 && !seen2[k][b as usize]);
            seen2[k][b as usize] = true;
            let l = q3_low_bit(j) as usize;
            assert!(!seen3[l]);
            seen3[l] = true;
            let (k, p, b) = slot(j);
            assert_eq!(column(k, p, b), j);
        }
    }

    #[test]
    fn one_masked_word_is_four_consecutive_codes() {
        // The property the kernels rely on, on random words of every layout.
        let (rows, cols) = (3, 256);
        let q4 = random_q4(rows, cols, 810);
        let c4 = unpack_codes(&q4, rows, cols, 4);
        let mut q2 = vec![0u32; rows * cols / 16];
        let mut q3 = vec![0u32; rows * cols * 3 / 32];
        pack_matrix(&q4, rows, cols, 2, &mut q2);
        pack_matrix(&q4, rows, cols, 3, &mut q3);
        let c2 = unpack_codes(&q2, rows, cols, 2);
        let c3 = unpack_codes(&q3, rows, cols, 3);
        for chunk in 0..rows * cols / 32 {
            let x0 = 32 * chunk;
            // Code of stream element j: even stream xe[j] = x[2j], odd xo[j] = x[2j + 1].
            let stream = |codes: &[u8], odd: usize, j: usize| codes[x0 + 2 * j + odd];
            for w in 0..4 {
                let word = q4[4 * chunk + w];
                for b in 0..4 {
                    let e = ((word & 0x0F0F_0F0F) >> (8 * b)) as u8;
                    let o = (((word >> 4) & 0x0F0F_0F0F) >> (8 * b)) as u8;
                    assert_eq!(e, stream(&c4, 0, 4 * w + b));
                    assert_eq!(o, stream(&c4, 1, 4 * w + b));
                }
            }
            for k in 0..2 {
                let w2 = q2[2 * chunk + k];
                let (u, l) = (q3[3 * chunk + k], q3[3 * chunk + 2]);
                for p in 0..4 {
                    let bytes2 = ((w2 >> (2 * p)) & 0x0303_0303).to_le_bytes();
                    let upper = ((u >> (2 * p)) & 0x0303_0303).to_le_bytes();
                    let lowest = ((l >> (4 * k + p)) & 0x0101_0101).to_le_bytes();
                    for b in 0..4 {
                        let (odd, j) = if p < 2 {
                            (0, 8 * k + 4 * p + b)
                        } else {
                            (1, 8 * k + 4 * (p - 2) + b)
                        };
                        assert_eq!(bytes2[b], stream(&c2, odd, j), "chunk {chunk} k {k} p {p}");
                        assert_eq!(2 * upper[b] + lowest[b], stream(&c3, odd, j));
                    }
                }
            }
        }
    }

    #[test]
    fn dequantize_uses_the_midpoints() {
        // Two rows, one group each; 4-bit codes 0..16 repeated; scales 0.5 and -1,
        // biases 1 and 2.
        let (rows, cols) = (2, 64);
        let q4: Vec<u32> = [0x7654_3210, 0xFEDC_BA98].repeat(rows * cols / 16);
        let scales = [bf16::from_f32(0.5), bf16::from_f32(-1.0)];
        let biases = [bf16::from_f32(1.0), bf16::from_f32(2.0)];
        let d4 = dequantize(&q4, &scales, &biases, rows, cols, 4);
        let mut q2 = vec![0u32; rows * cols / 16];
        let mut q3 = vec![0u32; rows * cols * 3 / 32];
        pack_matrix(&q4, rows, cols, 2, &mut q2);
        pack_matrix(&q4, rows, cols, 3, &mut q3);
        let d2 = dequantize(&q2, &scales, &biases, rows, cols, 2);
        let d3 = dequantize(&q3, &scales, &biases, rows, cols, 3);
        for i in 0..rows * cols {
            let (s, b) = if i < cols { (0.5, 1.0) } else { (-1.0, 2.0) };
            let q = (i % 16) as f32;
            assert_eq!(d4[i], q * s + b);
            // q4 = 13 → q2 = 3 → 4·3 + 1.5 = 13.5, the middle of 12..=15.
            assert_eq!(d2[i], (4.0 * (q / 4.0).floor() + 1.5) * s + b);
            // q4 = 13 → q3 = 6 → 2·6 + 0.5 = 12.5, the middle of 12..=13.
            assert_eq!(d3[i], (2.0 * (q / 2.0).floor() + 0.5) * s + b);
        }
        // At 4 bits the result is MLX's own dequantization.
        let mlx = super::super::Quantized {
            bits: 4,
            rows,
            cols,
            words: q4,
            scales: scales.to_vec(),
            biases: biases.to_vec(),
        };
        assert_eq!(super::super::dequantize(&mlx), d4);
    }

    #[test]
    fn word_readers_match_the_slot_positions_on_any_words() {
        // Arbitrary words, not only packed ones: every bit pattern must read the same.
        let mut rng = Rng::new(820);
        for bits in [2u32, 3, 4] {
            let (rows, cols) = (3, 192);
            let words: Vec<u32> = (0..rows * words_per_row(cols, bits))
                .map(|_| rng.next_u64() as u32)
                .collect();
            assert_eq!(
                unpack_codes(&words, rows, cols, bits),
                unpack_by_slots(&words, rows, cols, bits)
            );
        }
    }

    #[test]
    fn words_per_row_matches_bits() {
        assert_eq!(words_per_row(2048, 4), 256);
        assert_eq!(words_per_row(2048, 3), 192);
        assert_eq!(words_per_row(2048, 2), 128);
    }
}
