//! MLX affine quantization: per group of [`GROUP_SIZE`] consecutive inputs of a row,
//! `w ≈ q * scale + bias` with `q` an unsigned `bits`-bit code and `scale`, `bias` stored
//! as bf16.
//!
//! [`quantize`] reproduces `mx.quantize(w, group_size=64, bits, mode="affine")` bit for
//! bit on f32 input (MLX's CPU kernel): statistics, scale and codes are computed in f32,
//! codes from the f32 scale and bias, and only the stored scale and bias are rounded to
//! bf16. A checkpoint quantized by MLX and one quantized here therefore hold the same
//! codes, which is what lets [`lowbit`] derive the 2- and 3-bit stores from either.
//!
//! [`lowbit`] holds the reduced-bit layouts derived from the 4-bit codes and
//! [`kernels`] the CPU products that read all of them straight from packed words.

pub mod kernels;
pub mod lowbit;

use half::bf16;
use rayon::prelude::*;

pub use super::CodecError;

/// Inputs per quantization group (along a row, i.e. the input dimension).
pub const GROUP_SIZE: usize = 64;

/// MLX's floor on the step size: keeps a constant group from dividing by zero.
const EPS: f32 = 1e-7;

/// A matrix in MLX's affine format.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// Bits per code: 2, 4 or 8.
    pub bits: u32,
    /// Output features.
    pub rows: usize,
    /// Input features, a multiple of [`GROUP_SIZE`].
    pub cols: usize,
    /// `rows * cols * bits / 32` words, row-major. Codes are packed low bits first,
    /// `32 / bits` to a little-endian u32, in input order: at 4 bits, code `j` of a word
    /// sits at bits `4j .. 4j + 4`.
    pub words: Vec<u32>,
    /// `[rows, cols / 64]` step sizes.
    pub scales: Vec<bf16>,
    /// `[rows, cols / 64]` offsets: the value code 0 stands for.
    pub biases: Vec<bf16>,
}

impl Quantized {
    /// A view for [`kernels`], which read MLX words at 4 bits only (2 and 3 bits use the
    /// layouts of [`lowbit`], so an MLX 2-bit matrix has no view).
    pub fn view(&self) -> Option<kernels::AffineView<'_>> {
        (self.bits == 4).then_some(kernels::AffineView {
            bits: 4,
            rows: self.rows,
            cols: self.cols,
            words: &self.words,
            scales: &self.scales,
            biases: &self.biases,
        })
    }
}

/// An owned matrix in a layout the [`kernels`] read: MLX's 4-bit words, or the 3- and
/// 2-bit layouts of [`lowbit`] derived from them (keeping the 4-bit scales and biases),
/// the same derivation as the 3- and 2-bit expert stores.
#[derive(Debug, Clone, PartialEq)]
pub struct AffineMatrix {
    /// Bits per code: 4, 3 or 2.
    pub bits: u32,
    /// Output features.
    pub rows: usize,
    /// Input features, a multiple of [`GROUP_SIZE`].
    pub cols: usize,
    /// `rows * lowbit::words_per_row(cols, bits)` words, row-major.
    pub words: Vec<u32>,
    /// `[rows, cols / 64]` step sizes.
    pub scales: Vec<bf16>,
    /// `[rows, cols / 64]` offsets.
    pub biases: Vec<bf16>,
}

impl AffineMatrix {
    /// `w` (row-major `[rows, cols]`) quantized at 4 bits by [`quantize`], then for 3 and
    /// 2 bits repacked by [`lowbit::pack_matrix`].
    pub fn quantize(
        w: &[f32],
        rows: usize,
        cols: usize,
        bits: u32,
    ) -> Result<AffineMatrix, CodecError> {
        if !matches!(bits, 2..=4) {
            return Err(CodecError::Bits {
                bits,
                supported: "2, 3, 4",
            });
        }
        let q4 = quantize(w, rows, cols, 4)?;
        let words = if bits == 4 {
            q4.words
        } else {
            let mut packed = vec![0; rows * lowbit::words_per_row(cols, bits)];
            lowbit::pack_matrix(&q4.words, rows, cols, bits, &mut packed);
            packed
        };
        Ok(AffineMatrix {
            bits,
            rows,
            cols,
            words,
            scales: q4.scales,
            biases: q4.biases,
        })
    }

    /// The view the kernels take.
    pub fn view(&self) -> kernels::AffineView<'_> {
        kernels::AffineView {
            bits: self.bits,
            rows: self.rows,
            cols: self.cols,
            words: &self.words,
            scales: &self.scales,
            biases: &self.biases,
        }
    }

    /// Expands the matrix to row-major f32, as the kernels reconstruct it.
    pub fn dequantize(&self) -> Vec<f32> {
        self.view().dequantize()
    }
}

/// Step, offset and codes of one group, exactly as MLX derives them.
///
/// The zero point sits on the larger-magnitude extreme (`edge`), which code 0 therefore
/// reproduces exactly; the step is then nudged to `edge / round(edge / step)` so that
/// zero also falls on the grid. Its sign makes every code non-negative: positive when
/// the edge is the minimum, negative when it is the maximum.
fn group_params(group: &[f32], n_bins: f32) -> (f32, f32) {
    let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
    for &w in group {
        w_max = w_max.max(w);
        w_min = w_min.min(w);
    }
    let min_is_edge = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(EPS);
    if !min_is_edge {
        scale = -scale;
    }
    let edge = if min_is_edge { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    (scale, bias)
}

/// Quantizes a row-major `[rows, cols]` matrix the way `mx.quantize` (mode "affine",
/// group size 64) does. Inputs are expected finite.
pub fn quantize(w: &[f32], rows: usize, cols: usize, bits: u32) -> Result<Quantized, CodecError> {
    if !matches!(bits, 2 | 4 | 8) {
        return Err(CodecError::Bits {
            bits,
            supported: "2, 4, 8",
        });
    }
    if !cols.is_multiple_of(GROUP_SIZE) {
        return Err(CodecError::Cols {
            cols,
            group: GROUP_SIZE,
        });
    }
    if w.len() != rows * cols {
        return Err(CodecError::Len {
            expected: rows * cols,
            got: w.len(),
        });
    }
    let groups = cols / GROUP_SIZE;
    let per_word = (32 / bits) as usize;
    let words_per_row = cols / per_word;
    let n_bins = ((1u32 << bits) - 1) as f32;
    let mut q = Quantized {
        bits,
        rows,
        cols,
        words: vec![0; rows * words_per_row],
        scales: vec![bf16::ZERO; rows * groups],
        biases: vec![bf16::ZERO; rows * groups],
    };
    if rows == 0 || cols == 0 {
        return Ok(q);
    }
    q.words
        .par_chunks_mut(words_per_row)
        .zip(q.scales.par_chunks_mut(groups))
        .zip(q.biases.par_chunks_mut(groups))
        .zip(w.par_chunks(cols))
        .for_each(|(((words, scales), biases), row)| {
            for (g, group) in row.chunks_exact(GROUP_SIZE).enumerate() {
                let (scale, bias) = group_params(group, n_bins);
                for (word, vals) in words[g * GROUP_SIZE / per_word..]
                    .iter_mut()
                    .zip(group.chunks_exact(per_word))
                {
                    let mut packed = 0u32;
                    for (k, &v) in vals.iter().enumerate() {
                        // Division, not a multiply by the reciprocal: MLX divides, and
                        // the two differ in the last bit often enough to flip a code.
                        let code = ((v - bias) / scale).round_ties_even().clamp(0.0, n_bins);
                        packed |= (code as u32) << (k as u32 * bits);
                    }
                    *word = packed;
                }
                scales[g] = bf16::from_f32(scale);
                biases[g] = bf16::from_f32(bias);
            }
        });
    Ok(q)
}

/// Expands `q` back to a row-major f32 matrix: `code * scale + bias` with the stored
/// bf16 scale and bias widened to f32.
pub fn dequantize(q: &Quantized) -> Vec<f32> {
    let per_word = (32 / q.bits) as usize;
    let mask = (1u32 << q.bits) - 1;
    let groups = q.cols / GROUP_SIZE;
    let mut out = vec![0.0f32; q.rows * q.cols];
    if q.cols == 0 {
        return out;
    }
    out.par_chunks_mut(q.cols).enumerate().for_each(|(r, row)| {
        let words = &q.words[r * q.cols / per_word..(r + 1) * q.cols / per_word];
        for (c, v) in row.iter_mut().enumerate() {
            let code = (words[c / per_word] >> ((c % per_word) as u32 * q.bits)) & mask;
            let g = r * groups + c / GROUP_SIZE;
            *v = code as f32 * q.scales[g].to_f32() + q.biases[g].to_f32();
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fresh;

    fn round_bf16(v: &[f32]) -> Vec<f32> {
        v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
    }

    #[test]
    fn matches_mlx_output_bit_for_bit() {
        // Recorded from `mx.quantize(w, group_size=64, bits)` (MLX 0.32.4, CPU), scales
        // and biases as bf16 bits, on a 2×128 matrix any implementation can rebuild:
        // w[i] = (((i · 2654435761) mod 2³²) >> 20) / 512 − 4, the second row times
        // 0.01. Its values are multiples of 1/512, so many fall exactly halfway between
        // codes: this pins the round-half-to-even and the division, not just the idea.
        let (rows, cols) = (2, 128);
        let mut w: Vec<f32> = (0..(rows * cols) as u64)
            .map(|i| (((i * 2_654_435_761) % (1 << 32)) >> 20) as f32 / 512.0 - 4.0)
            .collect();
        for v in &mut w[cols..] {
            *v *= 0.01;
        }
        let bits16 = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        let q = quantize(&w, rows, cols, 4).unwrap();
        assert_eq!(
            q.words,
            [
                0x5B18E4A0, 0x4A17D39F, 0x3AF6C28E, 0x39F5B17D, 0x28E4A06C, 0x17D39F5C, 0xF6C28E5B,
                0xF5B17E4A, 0xE4A07D39, 0xD39F6C28, 0xC29F5B17, 0xB18E4A06, 0xB17D39F5, 0xAF6C28E4,
                0x9F5B17D3, 0x8E4A06D3, 0x93D71B4E, 0xA4E81B5F, 0xB5F82C60, 0xC6F93D71, 0xD60A4E82,
                0xE71B5F93, 0xE82C6FA4, 0xF93D71B4, 0xF6C28E4B, 0xF5B17E4A, 0xE4A06D39, 0xD39F6C28,
                0xC28F5B17, 0xB18E4A06, 0xA17D39F5, 0xAF6C28E4,
            ]
        );
        assert_eq!(bits16(&q.scales), [0x3F00, 0x3EFE, 0xBBA3, 0x3BA3]);
        assert_eq!(bits16(&q.biases), [0xC080, 0xC07E, 0x3D23, 0xBD23]);
        let q = quantize(&w, rows, cols, 2).unwrap();
        assert_eq!(
            q.words,
            [
                0x72DB72D8, 0x6DCB6DCB, 0x2DB72DCB, 0xDCB6DDB7, 0xDB72DCB6, 0xCB62DB72, 0xB76DCB6D,
                0xB72DB72D, 0x9E379E37, 0xDE78DE78, 0xE379E378, 0xE78DE779, 0xDCB6DDB7, 0xDB72DCB6,
                0xCB62DB72, 0xB76DCB6D,
            ]
        );
        assert_eq!(bits16(&q.scales), [0x4000, 0x3FFE, 0xBCA3, 0x3CA3]);
        assert_eq!(bits16(&q.biases), [0xC080, 0xC07E, 0x3D23, 0xBD23]);
    }

    #[test]
    fn hand_computed_group_with_the_minimum_as_edge() {
        // Range [-2, 1.75]: step 3.75 / 15 = 0.25 exactly; |min| > |max| so the edge is
        // -2 with a positive step; round(-2 / 0.25) = -8 ≠ 0, step stays -2 / -8 = 0.25.
        // Column j holds -2 + 0.25 (j % 16), whose code is j % 16, except two columns
        // placed halfway between codes, which must round to even as MLX's rint does.
        let mut w: Vec<f32> = (0..64).map(|j| -2.0 + 0.25 * (j % 16) as f32).collect();
        // Column 3: 3.5 steps → 4 (even); column 13: 5.5 steps → 6 (even).
        w[3] = -2.0 + 0.25 * 3.5;
        w[13] = -2.0 + 0.25 * 5.5;
        let q = quantize(&w, 1, 64, 4).unwrap();
        assert_eq!(q.scales, vec![bf16::from_f32(0.25)]);
        assert_eq!(q.biases, vec![bf16::from_f32(-2.0)]);
        let mut codes: Vec<u32> = (0..64).map(|j| j % 16).collect();
        codes[3] = 4;
        codes[13] = 6;
        let want: Vec<u32> = codes
            .chunks(8)
            .map(|c| c.iter().enumerate().fold(0, |a, (k, &v)| a | v << (4 * k)))
            .collect();
        assert_eq!(q.words, want);
        // Words 0 and 1 spelled out: codes 0,1,2,4,4,5,6,7 and 8,9,10,11,12,6,14,15,
        // column 0 in the lowest nibble.
        assert_eq!(q.words[0], 0x7654_4210);
        assert_eq!(q.words[1], 0xFE6C_BA98);
    }

    #[test]
    fn hand_computed_group_with_the_maximum_as_edge_and_a_nudged_step() {
        // Range [-1, 4.4]: |max| wins, step -(5.4 / 15) = -0.36, round(4.4 / -0.36) =
        // round(-12.2) = -12, so the step becomes 4.4 / -12 and the bias 4.4. Code 0 is
        // the maximum; the minimum maps to (-1 - 4.4) / (4.4 / -12) = 14.73 → 15.
        let mut w = vec![0.0f32; 64];
        w[0] = 4.4;
        w[1] = -1.0;
        w[2] = 4.4 + 3.0 * (4.4 / -12.0); // exactly on code 3 up to f32 rounding
        let q = quantize(&w, 1, 64, 4).unwrap();
        let step = 4.4f32 / -12.0;
        assert_eq!(q.scales[0], bf16::from_f32(step));
        assert_eq!(q.biases[0], bf16::from_f32(4.4));
        let code = |j: usize| (q.words[j / 8] >> (4 * (j % 8))) & 0xF;
        assert_eq!((code(0), code(1), code(2)), (0, 15, 3));
        // Zero: (0 - 4.4) / step = 12 exactly, the point of the nudge.
        assert_eq!(code(3), 12);
    }

    #[test]
    fn constant_and_zero_groups_are_exact() {
        let w: Vec<f32> = [vec![0.0f32; 64], vec![-3.5f32; 64], vec![2.0f32; 64]].concat();
        let q = quantize(&w, 3, 64, 4).unwrap();
        assert_eq!(dequantize(&q), w);
        // An all-zero group keeps MLX's floor on the step, with the maximum's sign.
        assert_eq!(q.scales[0], bf16::from_f32(-EPS));
        assert_eq!(q.biases[0], bf16::ZERO);
    }

    #[test]
    fn packing_at_two_and_eight_bits_is_low_bits_first() {
        // Column j holds -v(j), v(j) in 0..=n: the edge is the minimum -n, the step
        // n / n = 1 and the bias -n, so column j's code is n - v(j).
        // Column 0 is 0 and column 1 is -n so that the range is n in both cases.
        for (bits, n) in [(2u32, 3u32), (8, 255)] {
            let v = |j: usize| match j {
                0 => 0,
                1 => n,
                _ => (j as u32 * 37) % (n + 1),
            };
            let w: Vec<f32> = (0..64).map(|j| -(v(j) as f32)).collect();
            let q = quantize(&w, 1, 64, bits).unwrap();
            let per = 32 / bits as usize;
            for j in 0..64 {
                let code = (q.words[j / per] >> ((j % per) as u32 * bits)) & n;
                assert_eq!(code, n - v(j), "bits {bits} col {j}");
            }
        }
    }

    #[test]
    fn round_trip_error_is_half_a_step_inside_the_grid() {
        for (salt, bits) in [(1u64, 2u32), (2, 4), (3, 8)] {
            let (rows, cols) = (9, 320);
            let w = fresh(rows * cols, 700 + salt);
            let q = quantize(&w, rows, cols, bits).unwrap();
            let back = dequantize(&q);
            let n_bins = ((1u32 << bits) - 1) as f32;
            for r in 0..rows {
                for g in 0..cols / GROUP_SIZE {
                    let s = q.scales[r * (cols / 64) + g].to_f32();
                    let b = q.biases[r * (cols / 64) + g].to_f32();
                    // bf16 keeps 8 significant bits: its rounding moves the far end of
                    // the grid by up to n_bins·|s|·2⁻⁸ and the bias by |b|·2⁻⁸.
                    let slack = (n_bins * s.abs() + b.abs()) / 256.0 + 1e-6;
                    // MLX's nudge can shrink the grid slightly below the group's range;
                    // values past its far end are clamped to it (at most one step away).
                    let far = b + n_bins * s;
                    let (lo, hi) = (b.min(far), b.max(far));
                    for c in g * 64..(g + 1) * 64 {
                        let (v, e) = (
                            w[r * cols + c],
                            (back[r * cols + c] - w[r * cols + c]).abs(),
                        );
                        let inside = v >= lo - slack && v <= hi + slack;
                        let bound = if inside { 0.5 } else { 1.0 } * s.abs() + slack;
                        assert!(
                            e <= bound,
                            "bits {bits} ({r}, {c}): {v} → err {e} > {bound}"
                        );
                    }
                }
            }
        }
    }

    /// Index of a group's larger-magnitude extreme, ties going to the maximum as in MLX.
    fn edge(group: &[f32]) -> usize {
        let by = |f: fn(&f32, &f32) -> std::cmp::Ordering| {
            (0..group.len())
                .max_by(|&a, &b| f(&group[a], &group[b]))
                .unwrap()
        };
        let (hi, lo) = (by(f32::total_cmp), by(|a, b| b.total_cmp(a)));
        if group[lo].abs() > group[hi].abs() {
            lo
        } else {
            hi
        }
    }

    #[test]
    fn larger_magnitude_extreme_is_reproduced_exactly() {
        // Weights that come from a bf16 checkpoint: the edge is itself a bf16 value,
        // so code 0 gives it back with no error at all.
        let (rows, cols) = (6, 256);
        let w = round_bf16(&fresh(rows * cols, 710));
        let q = quantize(&w, rows, cols, 4).unwrap();
        let back = dequantize(&q);
        for (i, (grp, bgrp)) in w.chunks(64).zip(back.chunks(64)).enumerate() {
            let j = edge(grp);
            assert_eq!(bgrp[j], grp[j], "group {i}");
        }
        // Arbitrary f32 weights: exact up to bf16 rounding of the bias.
        let w = fresh(rows * cols, 711);
        let q = quantize(&w, rows, cols, 4).unwrap();
        let back = dequantize(&q);
        for (i, (grp, bgrp)) in w.chunks(64).zip(back.chunks(64)).enumerate() {
            let j = edge(grp);
            assert_eq!(bgrp[j], bf16::from_f32(grp[j]).to_f32(), "group {i}");
        }
        // A tie in magnitude goes to the maximum: +2.5 is exact, -2.5 is not on the grid
        // (step 2.5 / round(-7.5) = -0.3125 covers 4.6875 < 5 below the maximum).
        let mut grp = vec![0.0f32; 64];
        grp[0] = -2.5;
        grp[1] = 2.5;
        let back = dequantize(&quantize(&grp, 1, 64, 4).unwrap());
        assert_eq!((back[0], back[1]), (2.5 - 15.0 * 0.3125, 2.5));
    }

    #[test]
    fn bad_shapes_and_widths_are_errors() {
        assert!(matches!(
            quantize(&[0.0; 64], 1, 64, 3),
            Err(CodecError::Bits { bits: 3, .. })
        ));
        assert!(matches!(
            quantize(&[0.0; 96], 1, 96, 4),
            Err(CodecError::Cols { cols: 96, .. })
        ));
        assert!(matches!(
            quantize(&[0.0; 64], 2, 64, 4),
            Err(CodecError::Len {
                expected: 128,
                got: 64
            })
        ));
        assert!(matches!(
            AffineMatrix::quantize(&[0.0; 64], 1, 64, 8),
            Err(CodecError::Bits { bits: 8, .. })
        ));
        assert!(matches!(
            AffineMatrix::quantize(&[0.0; 96], 1, 96, 3),
            Err(CodecError::Cols { cols: 96, .. })
        ));
    }
}
