//! Weight codecs: how expert matrices are stored at a few bits per weight, and the CPU
//! kernels that multiply activations by them without expanding them first.
//!
//! [`affine`] is MLX's group-wise affine quantization (`w = q * scale + bias`, groups of
//! 64 along the input dimension) and the reduced-bit layouts derived from its 4-bit codes
//! (seed 000, see `docs/FORMAT.md`). [`vq`] is the rotate-then-vector-quantize ladder
//! from 0.7 to 5 bits per weight (docs/ARCHITECTURE.md). [`dense`] is the plain f32
//! product they fall back to.

pub mod affine;
pub mod dense;
pub mod vq;

use std::fmt;
use std::str::FromStr;

/// How a layer's weights are stored, as plans and command lines spell it: `bf16`,
/// `q4`, `q3`, `q2` (affine, seed 000's layouts) or `vq<bits>` (a rung of the VQ
/// ladder, e.g. `vq1.5`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Codec {
    /// The checkpoint's own precision.
    Bf16,
    /// MLX affine codes at 4, 3 or 2 bits.
    Affine {
        /// Bits per code.
        bits: u32,
    },
    /// A VQ rung, by its nominal rate in thousandths of a bit per weight.
    Vq {
        /// Nominal bits per weight × 1000.
        millibits: u32,
    },
}

/// A codec name that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown codec {0:?} (expected bf16, q4, q3, q2 or vq<bits> such as vq1.5)")]
pub struct BadCodec(pub String);

impl FromStr for Codec {
    type Err = BadCodec;

    fn from_str(s: &str) -> Result<Codec, BadCodec> {
        let bad = || BadCodec(s.to_string());
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "bf16" => return Ok(Codec::Bf16),
            "q4" | "q3" | "q2" => {
                return Ok(Codec::Affine {
                    bits: t[1..].parse().map_err(|_| bad())?,
                })
            }
            _ => {}
        }
        let rate = t
            .strip_prefix("vq:")
            .or_else(|| t.strip_prefix("vq"))
            .ok_or_else(bad)?;
        let bits: f64 = rate.parse().map_err(|_| bad())?;
        if !(bits > 0.0 && bits <= 16.0) {
            return Err(bad());
        }
        Ok(Codec::Vq {
            millibits: (bits * 1000.0).round() as u32,
        })
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::Bf16 => f.write_str("bf16"),
            Codec::Affine { bits } => write!(f, "q{bits}"),
            Codec::Vq { millibits } => {
                // Shortest decimal that round-trips: vq1, vq1.5, vq1.125.
                let s = format!("{:.3}", *millibits as f64 / 1000.0);
                write!(f, "vq{}", s.trim_end_matches('0').trim_end_matches('.'))
            }
        }
    }
}

impl Codec {
    /// The VQ rung this names, for `Vq` codecs.
    pub fn rung(self) -> Result<Option<vq::Rung>, CodecError> {
        match self {
            Codec::Vq { .. } => vq::Rung::parse(&self.to_string()).map(Some),
            _ => Ok(None),
        }
    }

    /// Bytes a `[rows, cols]` matrix takes in this codec, as it sits in memory for the
    /// kernels (no file padding): bf16 values; affine codes with a bf16 scale and bias per
    /// group of 64 (columns padded to whole groups); VQ codes (whole bytes per row) and an
    /// fp16 norm per rotation block.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> Result<u64, CodecError> {
        let (r, c) = (rows as u64, cols as u64);
        Ok(match self {
            Codec::Bf16 => 2 * r * c,
            Codec::Affine { bits } => {
                if !(2..=4).contains(&bits) {
                    return Err(CodecError::Bits {
                        bits,
                        supported: "2, 3, 4",
                    });
                }
                let padded = cols.div_ceil(affine::GROUP_SIZE) * affine::GROUP_SIZE;
                let words = affine::lowbit::words_per_row(padded, bits) as u64;
                let groups = (padded / affine::GROUP_SIZE) as u64;
                r * (4 * words + 2 * 2 * groups)
            }
            Codec::Vq { .. } => {
                let rung = self.rung()?.expect("a VQ codec has a rung");
                let blocks = cols.div_ceil(vq::rotation::block_size(cols)) as u64;
                r * (vq::row_bytes(rung, cols) as u64 + 2 * blocks)
            }
        })
    }

    /// Bytes of the codebook this codec needs resident once, whatever uses it: fp16
    /// codewords for a VQ rung, nothing otherwise.
    pub fn codebook_bytes(self) -> Result<u64, CodecError> {
        Ok(match self.rung()? {
            Some(r) => (r.codewords() * r.dim * 2) as u64,
            None => 0,
        })
    }
}

impl serde::Serialize for Codec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Codec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Codec, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Why a matrix could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The bit width is not one the codec supports.
    #[error("unsupported bit width {bits} (supported: {supported})")]
    Bits {
        /// The width asked for.
        bits: u32,
        /// The widths this operation accepts, for the message.
        supported: &'static str,
    },
    /// The input dimension is not a whole number of quantization groups.
    #[error("{cols} columns is not a multiple of the group size {group}")]
    Cols {
        /// Columns (input features) of the matrix.
        cols: usize,
        /// The group size.
        group: usize,
    },
    /// A buffer does not hold `rows × cols` elements.
    #[error("expected {expected} values for the matrix, got {got}")]
    Len {
        /// `rows × cols`.
        expected: usize,
        /// What was passed.
        got: usize,
    },
    /// No rung of the VQ ladder has this name.
    #[error("no VQ rung {name:?} (rungs: {supported})")]
    Rung {
        /// What was asked for.
        name: String,
        /// The ladder's nominal bit widths, for the message.
        supported: String,
    },
    /// A part of a stored matrix has the wrong size.
    #[error("{field}: expected {expected} elements, got {got}")]
    Part {
        /// The part: `norms` or `codes`.
        field: &'static str,
        /// What the shape needs.
        expected: usize,
        /// What was passed.
        got: usize,
    },
    /// A weight is infinite or NaN.
    #[error("weight {index} (row {row}) is not finite")]
    NonFinite {
        /// Flat index of the weight.
        index: usize,
        /// Its row.
        row: usize,
    },
    /// The matrix has no columns.
    #[error("a matrix of {rows}×0 has no columns to encode")]
    NoColumns {
        /// Rows of the matrix.
        rows: usize,
    },
    /// The codebook a rung needs could not be loaded.
    #[error(transparent)]
    Codebook(#[from] vq::codebook::CodebookError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_names_round_trip_and_bad_names_are_refused() {
        for name in [
            "bf16", "q4", "q3", "q2", "vq0.7", "vq1", "vq1.125", "vq2.75", "vq5",
        ] {
            let c: Codec = name.parse().unwrap();
            assert_eq!(c.to_string(), name);
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<Codec>(&json).unwrap(), c);
        }
        assert_eq!("vq:1.5".parse::<Codec>().unwrap().to_string(), "vq1.5");
        for bad in ["q5", "q", "vq", "vq-1", "vqx", "int4", ""] {
            assert!(bad.parse::<Codec>().is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<Codec>("\"q7\"").is_err());
    }

    #[test]
    fn matrix_bytes_follow_each_layout() {
        let c = |s: &str| s.parse::<Codec>().unwrap();
        assert_eq!(c("bf16").matrix_bytes(3, 100).unwrap(), 600);
        // 128 padded columns: q4 16 words, 2 groups of scale + bias per row.
        assert_eq!(c("q4").matrix_bytes(3, 100).unwrap(), 3 * (64 + 8));
        // vq2 on 1024 columns: one block, 128 vectors of 16 bits, one fp16 norm.
        assert_eq!(c("vq2").matrix_bytes(2, 1024).unwrap(), 2 * (256 + 2));
        let bpw = |s: &str| c(s).matrix_bytes(512, 2048).unwrap() as f64 * 8.0 / (512.0 * 2048.0);
        assert!((bpw("vq1.5") - (1.5 + 16.0 / 1024.0)).abs() < 1e-9);
        assert!(bpw("q2") > 2.0 && bpw("q2") < bpw("q3") && bpw("q3") < bpw("q4"));
        assert_eq!(c("vq2").codebook_bytes().unwrap(), 65536 * 8 * 2);
        assert_eq!(c("q2").codebook_bytes().unwrap(), 0);
        assert!(c("vq1.3").matrix_bytes(2, 64).is_err());
    }
}
