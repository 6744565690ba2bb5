//! Weight codecs: how expert matrices are stored at a few bits per weight, and the CPU
//! kernels that multiply activations by them without expanding them first.
//!
//! [`affine`] is MLX's group-wise affine quantization (`w = q * scale + bias`, groups of
//! 64 along the input dimension) and the reduced-bit layouts derived from its 4-bit codes
//! (seed 000, see `docs/FORMAT.md`). [`vq`] is the rotate-then-vector-quantize ladder
//! from 0.7 to 5 bits per weight (DESIGN.md §5).

pub mod affine;
pub mod vq;

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
