//! The byte layout of one expert record, shared by the packer, prefill and decode.
//!
//! A record holds one routed expert: the codes of its gate, up and down projections,
//! then six blocks of bf16 scales and biases (gate scales, gate biases, up scales, up
//! biases, down scales, down biases). Every part starts at a 64-byte-aligned offset so a
//! kernel can load it with aligned vector reads; the record is padded to a whole number
//! of 16 KiB pages so every record starts page-aligned in the file and can be read with
//! `O_DIRECT` or mapped on its own. Low-bit records keep this order: only the code parts
//! shrink, the six scale/bias blocks are copied verbatim from the 4-bit record.

use crate::codec::affine::lowbit::words_per_row;
use crate::codec::affine::GROUP_SIZE;

use super::Error;

/// Records start at multiples of this many bytes and are padded to it.
pub const PAGE: usize = 16 * 1024;

/// Every part of a record starts at a multiple of this many bytes.
pub const ALIGN: usize = 64;

/// The precisions a store may hold.
pub const SUPPORTED_BITS: [u32; 3] = [2, 3, 4];

/// One of the three projections of a SwiGLU expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proj {
    /// `gate_proj` (Mixtral's `w1`): `[intermediate, hidden]`.
    Gate,
    /// `up_proj` (Mixtral's `w3`): `[intermediate, hidden]`.
    Up,
    /// `down_proj` (Mixtral's `w2`): `[hidden, intermediate]`.
    Down,
}

impl Proj {
    /// The three projections in record order.
    pub const ALL: [Proj; 3] = [Proj::Gate, Proj::Up, Proj::Down];

    /// Position in record order.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A byte range inside a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Bytes from the start of the record.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl Part {
    /// One past the last byte.
    pub fn end(&self) -> usize {
        self.offset + self.len
    }

    /// The range, for slicing a record.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.end()
    }
}

/// Where one projection's codes, scales and biases sit in a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixLayout {
    /// Output features (rows of the checkpoint's weight).
    pub rows: usize,
    /// Input features as stored: the checkpoint's columns rounded up to a multiple of
    /// [`GROUP_SIZE`] (equal to them in every published model).
    pub cols: usize,
    /// Input features in the checkpoint.
    pub true_cols: usize,
    /// Codes: `rows × words_per_row(cols, bits)` little-endian u32 words.
    pub codes: Part,
    /// Scales: `rows × cols / 64` bf16, row-major.
    pub scales: Part,
    /// Biases: `rows × cols / 64` bf16, row-major.
    pub biases: Part,
}

impl MatrixLayout {
    /// u32 words of codes per row.
    pub fn words_per_row(&self, bits: u32) -> usize {
        words_per_row(self.cols, bits)
    }

    /// Quantization groups per row.
    pub fn groups_per_row(&self) -> usize {
        self.cols / GROUP_SIZE
    }
}

/// The layout of every record of one store: one precision, one expert shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bits per code: 2, 3 or 4.
    pub bits: u32,
    /// Width of the residual stream (the checkpoint's `hidden_size`).
    pub hidden: usize,
    /// Width of one expert's hidden layer (the checkpoint's expert intermediate size).
    pub intermediate: usize,
    /// Gate, up and down, in record order.
    pub matrices: [MatrixLayout; 3],
    /// One past the last meaningful byte; the rest of the record is zero padding.
    pub data_end: usize,
    /// Bytes per record: `data_end` rounded up to [`PAGE`].
    pub record_size: usize,
}

/// `n` rounded up to a multiple of `to`.
pub fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// Columns as stored: the checkpoint's, rounded up to whole quantization groups.
pub fn stored_cols(cols: usize) -> usize {
    round_up(cols, GROUP_SIZE)
}

impl Layout {
    /// The layout of a `bits`-bit record of an expert with these dimensions.
    pub fn new(bits: u32, hidden: usize, intermediate: usize) -> Result<Layout, Error> {
        if !SUPPORTED_BITS.contains(&bits) {
            return Err(Error::UnsupportedBits { bits });
        }
        if hidden == 0 || intermediate == 0 {
            return Err(Error::BadShape {
                reason: format!("hidden {hidden} and intermediate {intermediate} must be positive"),
            });
        }
        let shapes = [
            (intermediate, hidden),
            (intermediate, hidden),
            (hidden, intermediate),
        ];
        // Codes of all three matrices first, then the six scale/bias blocks, so that the
        // low-bit records differ from the 4-bit one only in the first three parts.
        let mut cursor = 0;
        let mut take = |len: usize| {
            let part = Part {
                offset: round_up(cursor, ALIGN),
                len,
            };
            cursor = part.end();
            part
        };
        let codes =
            shapes.map(|(rows, cols)| take(rows * words_per_row(stored_cols(cols), bits) * 4));
        let blocks = shapes.map(|(rows, cols)| {
            let len = rows * stored_cols(cols) / GROUP_SIZE * 2;
            (take(len), take(len))
        });
        let matrices = [0, 1, 2].map(|m| MatrixLayout {
            rows: shapes[m].0,
            cols: stored_cols(shapes[m].1),
            true_cols: shapes[m].1,
            codes: codes[m],
            scales: blocks[m].0,
            biases: blocks[m].1,
        });
        Ok(Layout {
            bits,
            hidden,
            intermediate,
            matrices,
            data_end: cursor,
            record_size: round_up(cursor, PAGE),
        })
    }

    /// The layout of one projection.
    pub fn matrix(&self, proj: Proj) -> &MatrixLayout {
        &self.matrices[proj.index()]
    }

    /// The six scale and bias blocks in record order (gate scales, gate biases, up
    /// scales, up biases, down scales, down biases): the parts copied verbatim between
    /// precisions.
    pub fn scale_blocks(&self) -> [Part; 6] {
        let m = &self.matrices;
        [
            m[0].scales,
            m[0].biases,
            m[1].scales,
            m[1].biases,
            m[2].scales,
            m[2].biases,
        ]
    }

    /// File offset of record `index` (records follow each other from offset 0).
    pub fn record_offset(&self, index: usize) -> u64 {
        index as u64 * self.record_size as u64
    }

    /// Size of a store of `records` records.
    pub fn file_size(&self, records: usize) -> u64 {
        self.record_offset(records)
    }

    /// The same expert shape at another precision.
    pub fn with_bits(&self, bits: u32) -> Result<Layout, Error> {
        Layout::new(bits, self.hidden, self.intermediate)
    }
}

/// Writes `src` into `dst` as little-endian u32s; `dst` must hold exactly them.
pub(crate) fn put_u32s(dst: &mut [u8], src: &[u32]) {
    assert_eq!(dst.len(), src.len() * 4, "part length");
    for (d, s) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

/// Writes `src` into `dst` as little-endian bf16s; `dst` must hold exactly them.
pub(crate) fn put_bf16s(dst: &mut [u8], src: &[half::bf16]) {
    assert_eq!(dst.len(), src.len() * 2, "part length");
    for (d, s) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

/// Reads little-endian u32s.
pub(crate) fn get_u32s(src: &[u8]) -> Vec<u32> {
    src.chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-30B-A3B's experts (hidden 2048, intermediate 768), computed by hand:
    /// each matrix has 768 × 2048 codes; at 4 bits that is 786 432 bytes, at 3 bits
    /// 589 824, at 2 bits 393 216. Each of the six scale/bias blocks holds
    /// 768 × 2048 / 64 bf16 = 49 152 bytes. Every part is a multiple of 64 bytes, so
    /// there is no alignment padding, and the totals happen to be whole pages.
    #[test]
    fn qwen3_30b_record_sizes_by_hand() {
        let blocks = 6 * 49_152;
        for (bits, matrix, pages) in [(4, 786_432, 162), (3, 589_824, 126), (2, 393_216, 90)] {
            let l = Layout::new(bits, 2048, 768).unwrap();
            assert_eq!(l.data_end, 3 * matrix + blocks, "{bits}-bit");
            assert_eq!(l.record_size, pages * PAGE, "{bits}-bit");
            assert_eq!(l.matrices[1].codes.offset, matrix);
            assert_eq!(l.matrices[0].scales.offset, 3 * matrix);
            assert_eq!(l.matrices[2].biases.end(), l.data_end);
        }
    }

    #[test]
    fn unaligned_columns_are_padded_to_whole_groups() {
        // The small fixture's experts: hidden 256, intermediate 80.
        let l = Layout::new(4, 256, 80).unwrap();
        let down = l.matrix(Proj::Down);
        assert_eq!((down.rows, down.cols, down.true_cols), (256, 128, 80));
        assert_eq!(down.codes.len, 256 * 128 / 2);
        for part in l
            .matrices
            .iter()
            .flat_map(|m| [m.codes, m.scales, m.biases])
        {
            assert_eq!(part.offset % ALIGN, 0);
        }
        assert_eq!(l.record_size % PAGE, 0);
        assert_eq!(l.record_offset(3), 3 * l.record_size as u64);
    }

    #[test]
    fn low_bit_layouts_keep_the_scale_blocks_sizes() {
        let q4 = Layout::new(4, 256, 80).unwrap();
        for bits in [2, 3] {
            let q = q4.with_bits(bits).unwrap();
            let lens = |l: &Layout| l.scale_blocks().map(|p| p.len);
            assert_eq!(lens(&q), lens(&q4));
        }
        assert!(matches!(
            Layout::new(5, 64, 64),
            Err(Error::UnsupportedBits { bits: 5 })
        ));
    }
}
