//! Rotate-then-vector-quantize codecs (HIGGS style, docs/ARCHITECTURE.md, The VQ ladder).
//!
//! A weight row is cut into blocks ([`rotation`]); each block is stored as its fp16 L2
//! norm and, after a seeded sign flip and a Walsh–Hadamard transform, as close to
//! i.i.d. N(0, 1) values, which are cut into `p`-dimensional vectors and replaced by
//! the `k`-bit index of the nearest codeword of a codebook built for N(0, I_p)
//! ([`codebook`]). The rate is `k / p` bits per weight plus 16 bits of norm per block.
//!
//! The [`LADDER`] has thirteen rungs from 0.7 to 5 bits per weight. The 0.7 rung sits
//! at 11/16 = 0.6875 bits, the nearest rate with `p` ≤ 16.
//!
//! Products ([`kernels`]) are taken in the rotated domain: each activation block is
//! sign-flipped and transformed once per call, after which a weight row is a sum of
//! codeword lookups times activations, with no inverse transform of the weights.

pub mod codebook;
pub mod kernels;
pub mod report;
pub mod rotation;

use half::f16;
use rayon::prelude::*;

use self::codebook::Codebook;
use super::CodecError;

/// One rung of the ladder: vectors of `dim` values coded with `index_bits`-bit indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rung {
    /// The nominal bits per weight it stands for, as written on the command line.
    pub nominal: &'static str,
    /// Values per vector, `p` (2, 4, 8 or 16: a divisor of every block).
    pub dim: usize,
    /// Bits per index, `k`: the codebook has `2^k` codewords.
    pub index_bits: u32,
}

const fn rung(nominal: &'static str, dim: usize, index_bits: u32) -> Rung {
    Rung {
        nominal,
        dim,
        index_bits,
    }
}

/// The ladder, lowest rate first. Eight-dimensional codebooks up to 2 bits, four-
/// dimensional ones from 2.25 to 4 (where 8 dimensions would need more than 2^16
/// codewords) and two-dimensional at 5 bits. The rates are exact except 0.7 (0.6875).
pub const LADDER: [Rung; 13] = [
    rung("0.7", 16, 11),
    rung("1", 8, 8),
    rung("1.125", 8, 9),
    rung("1.25", 8, 10),
    rung("1.5", 8, 12),
    rung("1.75", 8, 14),
    rung("2", 8, 16),
    rung("2.25", 4, 9),
    rung("2.5", 4, 10),
    rung("2.75", 4, 11),
    rung("3", 4, 12),
    rung("4", 4, 16),
    rung("5", 2, 10),
];

impl Rung {
    /// The rung named `s`: its nominal bits (`"1.5"`) or its name (`"vq1.5"`).
    pub fn parse(s: &str) -> Result<Rung, CodecError> {
        let bits = s.trim().strip_prefix("vq").unwrap_or(s.trim());
        let value: Option<f64> = bits.parse().ok();
        LADDER
            .iter()
            .find(|r| r.nominal == bits || value == r.nominal.parse().ok())
            .copied()
            .ok_or_else(|| CodecError::Rung {
                name: s.to_string(),
                supported: LADDER.map(|r| r.nominal).join(", "),
            })
    }

    /// `vq` and the nominal bits: `vq1.5`.
    pub fn name(self) -> String {
        format!("vq{}", self.nominal)
    }

    /// Index bits per weight, `k / p`.
    pub fn rate(self) -> f64 {
        self.index_bits as f64 / self.dim as f64
    }

    /// Codewords in the codebook, `2^k`.
    pub fn codewords(self) -> usize {
        1 << self.index_bits
    }

    /// Position in [`LADDER`].
    pub fn position(self) -> usize {
        LADDER
            .iter()
            .position(|r| *r == self)
            .expect("rungs come from the ladder")
    }

    /// Stored bits per weight of a matrix with `cols` columns: the codes (whole bytes
    /// per row, including the zero-padded tail block) and the fp16 norm of each block.
    pub fn bits_per_weight(self, cols: usize) -> f64 {
        let blocks = cols.div_ceil(rotation::block_size(cols));
        (8 * row_bytes(self, cols) + 16 * blocks) as f64 / cols as f64
    }

    /// The rung's shipped codebook.
    pub fn codebook(self) -> Result<&'static Codebook, CodecError> {
        Ok(codebook::shipped(self)?)
    }
}

/// Bytes of codes per row of `cols` columns.
pub fn row_bytes(rung: Rung, cols: usize) -> usize {
    let block = rotation::block_size(cols);
    let vectors = cols.div_ceil(block) * block / rung.dim;
    (vectors * rung.index_bits as usize).div_ceil(8)
}

/// A matrix in a VQ rung.
#[derive(Debug, Clone, PartialEq)]
pub struct VqMatrix {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The rung.
    pub rung: Rung,
    /// Rotation block size, [`rotation::block_size`] of `cols`.
    pub block: usize,
    /// Seed of the rotation's sign vector.
    pub seed: u64,
    /// Per row, per block: the L2 norm, `[rows, blocks]`.
    pub norms: Vec<f16>,
    /// Per row, [`row_bytes`] bytes: the `k`-bit indices of its vectors in order, packed
    /// from the least significant bit of the first byte.
    pub codes: Vec<u8>,
}

/// A borrowed [`VqMatrix`], for example over a memory-mapped record.
#[derive(Debug, Clone, Copy)]
pub struct VqView<'a> {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The rung.
    pub rung: Rung,
    /// Rotation block size.
    pub block: usize,
    /// Seed of the rotation's sign vector.
    pub seed: u64,
    /// `[rows, blocks]` norms.
    pub norms: &'a [f16],
    /// `rows * row_bytes(rung, cols)` bytes of codes.
    pub codes: &'a [u8],
}

impl VqMatrix {
    /// Encodes the row-major `[rows, cols]` matrix `w`: rotation with `seed`, then the
    /// nearest codeword ([`Codebook::nearest`]) of every vector, rows in parallel.
    pub fn encode(
        w: &[f32],
        rows: usize,
        cols: usize,
        rung: Rung,
        seed: u64,
    ) -> Result<VqMatrix, CodecError> {
        Self::encode_with(w, rows, cols, rung, seed, rung.codebook()?, false)
    }

    /// [`encode`](Self::encode) with a given codebook, searching every codeword when
    /// `exact` (to measure what the cell search costs).
    pub fn encode_with(
        w: &[f32],
        rows: usize,
        cols: usize,
        rung: Rung,
        seed: u64,
        book: &Codebook,
        exact: bool,
    ) -> Result<VqMatrix, CodecError> {
        if w.len() != rows * cols {
            return Err(CodecError::Len {
                expected: rows * cols,
                got: w.len(),
            });
        }
        if cols == 0 {
            return Err(CodecError::NoColumns { rows });
        }
        if let Some(index) = w.iter().position(|v| !v.is_finite()) {
            return Err(CodecError::NonFinite {
                index,
                row: index / cols,
            });
        }
        assert_eq!(book.rung(), rung, "codebook of another rung");
        let block = rotation::block_size(cols);
        let blocks = cols.div_ceil(block);
        let rb = row_bytes(rung, cols);
        let signs = rotation::signs(seed, block);
        let (p, k) = (rung.dim, rung.index_bits as usize);
        let mut norms = vec![f16::ZERO; rows * blocks];
        let mut codes = vec![0u8; rows * rb];
        codes
            .par_chunks_mut(rb)
            .zip(norms.par_chunks_mut(blocks))
            .zip(w.par_chunks(cols))
            .for_each_init(
                || vec![0.0f32; blocks * block],
                |buf, ((code, norm), row)| {
                    let mut b = 0;
                    rotation::rotate_row(row, &signs, buf, |n| {
                        norm[b] = n;
                        b += 1;
                    });
                    for (j, v) in buf.chunks_exact(p).enumerate() {
                        let idx = if exact {
                            book.nearest_exact(v)
                        } else {
                            book.nearest(v)
                        };
                        put_bits(code, j * k, k, idx);
                    }
                },
            );
        Ok(VqMatrix {
            rows,
            cols,
            rung,
            block,
            seed,
            norms,
            codes,
        })
    }

    /// The borrowed view.
    pub fn view(&self) -> VqView<'_> {
        VqView {
            rows: self.rows,
            cols: self.cols,
            rung: self.rung,
            block: self.block,
            seed: self.seed,
            norms: &self.norms,
            codes: &self.codes,
        }
    }

    /// The weights as stored, `[rows, cols]`.
    pub fn decode(&self) -> Result<Vec<f32>, CodecError> {
        self.view().decode()
    }

    /// Bytes of the fp16 norms.
    pub fn norm_bytes(&self) -> usize {
        2 * self.norms.len()
    }

    /// Bytes of the codes.
    pub fn code_bytes(&self) -> usize {
        self.codes.len()
    }
}

impl<'a> VqView<'a> {
    /// A view over stored parts, checking their sizes against the shape.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        rung: Rung,
        seed: u64,
        norms: &'a [f16],
        codes: &'a [u8],
    ) -> Result<VqView<'a>, CodecError> {
        if cols == 0 {
            return Err(CodecError::NoColumns { rows });
        }
        let block = rotation::block_size(cols);
        for (field, expected, got) in [
            ("norms", rows * cols.div_ceil(block), norms.len()),
            ("codes", rows * row_bytes(rung, cols), codes.len()),
        ] {
            if expected != got {
                return Err(CodecError::Part {
                    field,
                    expected,
                    got,
                });
            }
        }
        Ok(VqView {
            rows,
            cols,
            rung,
            block,
            seed,
            norms,
            codes,
        })
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols.div_ceil(self.block)
    }

    /// Row `r` alone, as a one-row matrix (the rotation is the same for every row): what
    /// an embedding lookup decodes.
    pub fn row(&self, r: usize) -> VqView<'a> {
        let (rb, blocks) = (row_bytes(self.rung, self.cols), self.blocks());
        VqView {
            rows: 1,
            norms: &self.norms[r * blocks..(r + 1) * blocks],
            codes: &self.codes[r * rb..(r + 1) * rb],
            ..*self
        }
    }

    /// The weights as stored, `[rows, cols]`: codewords looked up, then the rotation
    /// undone. The reference every kernel is checked against.
    pub fn decode(&self) -> Result<Vec<f32>, CodecError> {
        let book = self.rung.codebook()?;
        Ok(self.decode_with(book))
    }

    /// [`decode`](Self::decode) with a given codebook.
    pub fn decode_with(&self, book: &Codebook) -> Vec<f32> {
        let (p, k) = (self.rung.dim, self.rung.index_bits as usize);
        let rb = row_bytes(self.rung, self.cols);
        let width = self.blocks() * self.block;
        let mut values = vec![0.0f32; self.rows * width];
        for (r, dst) in values.chunks_exact_mut(width).enumerate() {
            let code = &self.codes[r * rb..(r + 1) * rb];
            for (j, v) in dst.chunks_exact_mut(p).enumerate() {
                v.copy_from_slice(book.codeword(get_bits(code, j * k, k) as usize));
            }
        }
        rotation::unrotate(&rotation::Rotated {
            rows: self.rows,
            cols: self.cols,
            block: self.block,
            seed: self.seed,
            norms: self.norms.to_vec(),
            values,
        })
    }
}

/// Writes the `k`-bit `value` at bit `at` of `bytes` (least significant bit first).
fn put_bits(bytes: &mut [u8], at: usize, k: usize, value: u32) {
    for i in 0..k {
        if value >> i & 1 == 1 {
            bytes[(at + i) / 8] |= 1 << ((at + i) % 8);
        }
    }
}

/// The `k`-bit value at bit `at` of `bytes`.
pub(crate) fn get_bits(bytes: &[u8], at: usize, k: usize) -> u32 {
    let first = at / 8;
    let mut word = [0u8; 8];
    let n = (bytes.len() - first).min(8);
    word[..n].copy_from_slice(&bytes[first..first + n]);
    ((u64::from_le_bytes(word) >> (at % 8)) & ((1u64 << k) - 1)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh, rel_err};

    #[test]
    fn ladder_rates_and_names() {
        for r in LADDER {
            assert!(r.dim.is_power_of_two() && r.dim <= rotation::MIN_BLOCK);
            assert!(r.index_bits <= 16);
            let nominal: f64 = r.nominal.parse().unwrap();
            if r.nominal != "0.7" {
                assert_eq!(r.rate(), nominal, "{}", r.name());
            }
            assert_eq!(Rung::parse(&r.name()).unwrap(), r);
            assert_eq!(Rung::parse(r.nominal).unwrap(), r);
        }
        assert_eq!(Rung::parse("0.7").unwrap().rate(), 0.6875);
        assert_eq!(Rung::parse("2.0").unwrap().index_bits, 16);
        let err = Rung::parse("1.4").unwrap_err();
        assert!(err.to_string().contains("1.4") && err.to_string().contains("1.75"));
        // 2 bits at 2048 columns: 2 blocks of 1024, 32 bits of norms per 2048 weights.
        let r = Rung::parse("2").unwrap();
        assert_eq!(r.bits_per_weight(2048), 2.0 + 32.0 / 2048.0);
        // 80 columns are padded to a block of 128.
        assert_eq!(r.bits_per_weight(80), (2.0 * 128.0 + 16.0) / 80.0);
    }

    #[test]
    fn bits_round_trip() {
        let mut bytes = vec![0u8; 40];
        let vals: Vec<u32> = (0u32..20)
            .map(|i: u32| i.wrapping_mul(2654435761) & 0x7FF)
            .collect();
        for (j, &v) in vals.iter().enumerate() {
            put_bits(&mut bytes, j * 11, 11, v);
        }
        for (j, &v) in vals.iter().enumerate() {
            assert_eq!(get_bits(&bytes[..28], j * 11, 11), v);
        }
    }

    #[test]
    fn encode_decode_error_is_the_codebook_distortion() {
        // Gaussian rows: the relative error is about the rung's Gaussian distortion.
        let (rows, cols) = (16, 1024);
        let w = fresh(rows * cols, 3);
        for r in [LADDER[1], LADDER[7]] {
            let m = VqMatrix::encode(&w, rows, cols, r, 9).unwrap();
            assert_eq!(m.code_bytes(), rows * row_bytes(r, cols));
            assert_eq!(m.norm_bytes(), 2 * rows);
            let back = m.decode().unwrap();
            let e = rel_err(&back, &w).powi(2);
            let bound = 2f64.powf(-2.0 * r.rate());
            assert!(e > bound && e < 3.0 * bound, "{}: mse {e}", r.name());
        }
    }

    #[test]
    fn bad_input_is_refused_with_the_field_named() {
        let r = LADDER[1];
        let mut w = fresh(4 * 32, 4);
        assert!(matches!(
            VqMatrix::encode(&w, 4, 31, r, 0),
            Err(CodecError::Len { .. })
        ));
        assert!(matches!(
            VqMatrix::encode(&[], 4, 0, r, 0),
            Err(CodecError::NoColumns { .. })
        ));
        w[40] = f32::NAN;
        assert_eq!(
            VqMatrix::encode(&w, 4, 32, r, 0).unwrap_err(),
            CodecError::NonFinite { index: 40, row: 1 }
        );
        let m = VqMatrix::encode(&fresh(4 * 32, 5), 4, 32, r, 0).unwrap();
        let err = VqView::from_parts(4, 32, r, 0, &m.norms, &m.codes[1..]).unwrap_err();
        assert!(err.to_string().starts_with("codes:"), "{err}");
        let err = VqView::from_parts(4, 32, r, 0, &m.norms[1..], &m.codes).unwrap_err();
        assert!(err.to_string().starts_with("norms:"), "{err}");
        let v = VqView::from_parts(4, 32, r, 0, &m.norms, &m.codes).unwrap();
        assert_eq!(v.decode().unwrap(), m.decode().unwrap());
    }
}
