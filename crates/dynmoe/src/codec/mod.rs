//! Weight codecs: how expert matrices are stored at a few bits per weight, and the CPU
//! kernels that multiply activations by them without expanding them first.
//!
//! [`affine`] is MLX's group-wise affine quantization (`w = q * scale + bias`, groups of
//! 64 along the input dimension) and the reduced-bit layouts derived from its 4-bit codes
//! (seed 000, see `docs/FORMAT.md`).

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
}
