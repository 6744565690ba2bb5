//! The randomized Hadamard rotation that makes weight blocks look Gaussian.
//!
//! A row is cut into blocks of `R` values ([`block_size`]: 1024, or less where that
//! avoids padding, but at least 16 so that every codebook dimension divides it); the tail
//! block is padded with zeros. Each block is divided by its L2 norm (kept as fp16), its
//! signs flipped by a fixed seeded ±1 vector, transformed by the orthonormal
//! Walsh–Hadamard matrix and multiplied by √R: whatever the weights' outliers, the
//! result has unit mean square and close to i.i.d. N(0, 1) entries, which is what a
//! codebook built for Gaussian vectors needs. The rotation is orthogonal, so it is
//! undone by the same steps in reverse, and a product with the weights can instead be
//! taken in the rotated domain by rotating the activations once per block.

use half::f16;

/// The largest block: 16 bits of fp16 norm per 1024 weights is 0.016 bits per weight.
pub const MAX_BLOCK: usize = 1024;

/// The smallest block: the largest codebook dimension.
pub const MIN_BLOCK: usize = 16;

/// The block size for rows of `cols` values: the largest power of two dividing `cols`
/// (at most 1024) when that is at least 256, so rows such as 768 wide are cut into
/// whole blocks instead of being padded by a third; otherwise `cols` rounded up to a
/// power of two, clamped to 16..1024.
pub fn block_size(cols: usize) -> usize {
    let divisor = 1usize << cols.trailing_zeros().min(10);
    if cols > 0 && divisor >= 256 {
        divisor
    } else {
        cols.next_power_of_two().clamp(MIN_BLOCK, MAX_BLOCK)
    }
}

/// In-place orthonormal fast Walsh–Hadamard transform (`x.len()` a power of two). It is
/// its own inverse.
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    assert!(n.is_power_of_two(), "Hadamard transform of {n} values");
    let mut h = 1;
    while h < n {
        // Butterflies over pairs (i, i + h) within each 2h-wide span; the inner loop runs
        // over contiguous slices so it vectorises.
        for span in x.chunks_exact_mut(2 * h) {
            let (a, b) = span.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (p, q) = (*u, *v);
                *u = p + q;
                *v = p - q;
            }
        }
        h *= 2;
    }
    let scale = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= scale);
}

/// The fixed ±1 vector of `n` entries for `seed` (SplitMix64 bits, one per entry).
pub fn signs(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            if (z ^ (z >> 31)) & 1 == 0 {
                1.0
            } else {
                -1.0
            }
        })
        .collect()
}

/// A matrix in the rotated domain.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotated {
    /// Rows of the original matrix.
    pub rows: usize,
    /// Columns of the original matrix.
    pub cols: usize,
    /// Block size `R`.
    pub block: usize,
    /// Seed of the sign vector.
    pub seed: u64,
    /// Per row, per block: the block's L2 norm, `[rows, blocks]`.
    pub norms: Vec<f16>,
    /// Per row, per block, `R` rotated values of unit mean square, `[rows, blocks × R]`.
    pub values: Vec<f32>,
}

impl Rotated {
    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols.div_ceil(self.block)
    }
}

/// Rotates every row of the row-major `[rows, cols]` matrix `w`.
pub fn rotate(w: &[f32], rows: usize, cols: usize, seed: u64) -> Rotated {
    assert_eq!(w.len(), rows * cols, "matrix of {rows}×{cols}");
    let block = block_size(cols);
    let blocks = cols.div_ceil(block);
    let s = signs(seed, block);
    let mut norms = Vec::with_capacity(rows * blocks);
    let mut values = vec![0.0f32; rows * blocks * block];
    for (r, dst) in values.chunks_exact_mut(blocks * block).enumerate() {
        let row = &w[r * cols..(r + 1) * cols];
        rotate_row(row, &s, dst, |n| norms.push(n));
    }
    Rotated {
        rows,
        cols,
        block,
        seed,
        norms,
        values,
    }
}

/// Rotates one row into `dst` (whole blocks of `signs.len()` values), handing each
/// block's stored norm to `norm` in order.
pub fn rotate_row(row: &[f32], signs: &[f32], dst: &mut [f32], mut norm: impl FnMut(f16)) {
    let block = signs.len();
    let root = (block as f32).sqrt();
    for (b, dst) in dst.chunks_exact_mut(block).enumerate() {
        let src = &row[(b * block).min(row.len())..((b + 1) * block).min(row.len())];
        let n = src.iter().map(|v| v * v).sum::<f32>().sqrt();
        let stored = f16::from_f32(n);
        norm(stored);
        // Divide by the norm that will be stored, so decoding multiplies back exactly.
        let inv = if stored.to_f32() > 0.0 {
            1.0 / stored.to_f32()
        } else {
            0.0
        };
        for (i, d) in dst.iter_mut().enumerate() {
            *d = src.get(i).map_or(0.0, |v| v * inv * signs[i]);
        }
        fwht(dst);
        dst.iter_mut().for_each(|v| *v *= root);
    }
}

/// The matrix back from the rotated domain: `[rows, cols]`, row-major.
pub fn unrotate(r: &Rotated) -> Vec<f32> {
    let (block, blocks) = (r.block, r.blocks());
    let s = signs(r.seed, block);
    let inv_root = 1.0 / (block as f32).sqrt();
    let mut out = vec![0.0f32; r.rows * r.cols];
    let mut buf = vec![0.0f32; block];
    for row in 0..r.rows {
        for b in 0..blocks {
            let at = (row * blocks + b) * block;
            buf.copy_from_slice(&r.values[at..at + block]);
            fwht(&mut buf);
            let norm = r.norms[row * blocks + b].to_f32();
            let dst =
                &mut out[row * r.cols + b * block..row * r.cols + ((b + 1) * block).min(r.cols)];
            for (i, d) in dst.iter_mut().enumerate() {
                *d = buf[i] * inv_root * s[i] * norm;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh, rel_err};

    /// The Sylvester Hadamard matrix of order `n`, normalised.
    fn dense_hadamard(n: usize) -> Vec<f32> {
        let scale = 1.0 / (n as f32).sqrt();
        (0..n * n)
            .map(|k| {
                let (i, j) = (k / n, k % n);
                if (i & j).count_ones() % 2 == 0 {
                    scale
                } else {
                    -scale
                }
            })
            .collect()
    }

    #[test]
    fn agrees_with_the_dense_hadamard_matrix() {
        for n in [2, 8, 64, 1024] {
            let x = fresh(n, n as u64);
            let h = dense_hadamard(n);
            let want: Vec<f32> = (0..n)
                .map(|i| (0..n).map(|j| h[i * n + j] * x[j]).sum())
                .collect();
            let mut got = x.clone();
            fwht(&mut got);
            assert!(rel_err(&got, &want) < 1e-5, "n = {n}");
        }
    }

    #[test]
    fn is_orthogonal_and_its_own_inverse() {
        let x = fresh(1024, 7);
        let mut y = x.clone();
        fwht(&mut y);
        let (nx, ny) = (
            x.iter().map(|v| v * v).sum::<f32>(),
            y.iter().map(|v| v * v).sum::<f32>(),
        );
        assert!((nx - ny).abs() / nx < 1e-5, "norm {nx} became {ny}");
        fwht(&mut y);
        assert!(rel_err(&y, &x) < 1e-5);
    }

    #[test]
    fn signs_are_fixed_by_the_seed_and_balanced() {
        assert_eq!(signs(3, 1024), signs(3, 1024));
        assert_ne!(signs(3, 1024), signs(4, 1024));
        let plus = signs(3, 1024).iter().filter(|&&s| s > 0.0).count();
        assert!((400..624).contains(&plus), "{plus} of 1024 positive");
    }

    #[test]
    fn rotation_round_trips_up_to_the_fp16_norm() {
        // 1500 columns: one full block of 1024 and a zero-padded tail block.
        for (rows, cols) in [(3, 1500), (4, 80), (2, 1024)] {
            let w = fresh(rows * cols, (rows * cols) as u64);
            let r = rotate(&w, rows, cols, 11);
            assert_eq!(r.values.len(), rows * r.blocks() * r.block);
            let back = unrotate(&r);
            assert!(rel_err(&back, &w) < 1e-5, "{rows}×{cols}");
        }
    }

    fn moments(v: &[f32]) -> (f64, f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        let kurt = v.iter().map(|&x| (x as f64 - mean).powi(4)).sum::<f64>() / n / (var * var);
        (mean, var, kurt)
    }

    #[test]
    fn rotated_blocks_look_standard_normal_despite_outliers() {
        let (rows, cols) = (64, 1024);
        let mut w = fresh(rows * cols, 5);
        // About 1% of the weights eight times larger: heavy tails, as real layers have.
        for k in (0..w.len()).step_by(97) {
            w[k] *= 8.0;
        }
        let (_, _, kurt_before) = moments(&w);
        assert!(
            kurt_before > 10.0,
            "the input should be heavy-tailed (kurtosis {kurt_before})"
        );
        let r = rotate(&w, rows, cols, 1);
        let (mean, var, kurt) = moments(&r.values);
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
        // A Gaussian has kurtosis 3.
        assert!((kurt - 3.0).abs() < 0.2, "kurtosis {kurt}");
    }

    #[test]
    fn block_sizes() {
        assert_eq!(block_size(80), 128);
        assert_eq!(block_size(3), 16);
        assert_eq!(block_size(768), 256);
        assert_eq!(block_size(1536), 512);
        assert_eq!(block_size(2048), 1024);
        assert_eq!(block_size(5000), 1024);
    }
}
