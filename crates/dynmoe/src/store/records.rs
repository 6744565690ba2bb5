//! What one expert's record is, whatever its layer's codec, and where a layer's records
//! lie: the unit that resident sets load into slots and reservoirs keep (`residency`).
//! For a checkpoint layer a record is the three projections as stored (bf16, f16 or f32),
//! widened to f32 in a slot; for an expert-store layer the whole record (affine: codes,
//! scales, biases; VQ: header, codes, norms), copied as is.

use safetensors::tensor::Dtype;

use super::vq::VqLayout;
use super::Layout;
use crate::checkpoint::experts::Extent;
use crate::checkpoint::float_size;

/// How one layer's records are encoded.
// One per layer and copied freely; boxing the layout would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RecordFormat {
    /// Gate, up and down in a float dtype: `[i, h]`, `[i, h]`, `[h, i]`.
    Dense {
        /// Dtype as stored.
        dtype: Dtype,
        /// Residual width.
        hidden: usize,
        /// Expert width.
        intermediate: usize,
    },
    /// A record of an affine expert store.
    Affine(Layout),
    /// A record of a VQ expert store.
    Vq(VqLayout),
}

impl RecordFormat {
    /// Gate, up and down of a dense record's values `f`, each with its `(rows, cols)`;
    /// `None` for a store's formats.
    pub fn dense_matrices<'a>(&self, f: &'a [f32]) -> Option<[(&'a [f32], usize, usize); 3]> {
        let RecordFormat::Dense {
            hidden: h,
            intermediate: i,
            ..
        } = *self
        else {
            return None;
        };
        let n = h * i;
        Some([
            (&f[..n], i, h),
            (&f[n..2 * n], i, h),
            (&f[2 * n..3 * n], h, i),
        ])
    }

    /// Bytes of one record as stored.
    pub fn record_bytes(&self) -> usize {
        match *self {
            RecordFormat::Dense {
                dtype,
                hidden,
                intermediate,
            } => 3 * hidden * intermediate * float_size(dtype).expect("a float dtype"),
            RecordFormat::Affine(l) => l.record_size,
            RecordFormat::Vq(l) => l.record_size,
        }
    }

    /// An empty slot buffer for one record.
    pub fn buffer(&self) -> Buffer {
        match *self {
            RecordFormat::Dense {
                hidden,
                intermediate,
                ..
            } => Buffer::F32(vec![0.0; 3 * hidden * intermediate]),
            RecordFormat::Affine(_) | RecordFormat::Vq(_) => {
                Buffer::Words(vec![0; self.record_bytes().div_ceil(4)])
            }
        }
    }
}

/// The data of one slot: f32 weights (gate, up, down back to back) or the words of an
/// affine or VQ record (kept as u32 so its parts can be viewed in place).
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    /// Widened weights.
    F32(Vec<f32>),
    /// A record's bytes.
    Words(Vec<u32>),
}

impl Buffer {
    /// The record bytes of an affine slot.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Buffer::Words(w) => words_as_bytes(w),
            Buffer::F32(_) => panic!("a dense slot has no record bytes"),
        }
    }
}

/// The bytes of `w`, for viewing an affine record held as words.
pub fn words_as_bytes(w: &[u32]) -> &[u8] {
    // SAFETY: u8 has no alignment requirement and every u32 is four valid bytes.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len() * 4) }
}

/// The bytes of `w`, writable, for reading a record into a slot held as words.
pub fn words_as_bytes_mut(w: &mut [u32]) -> &mut [u8] {
    // SAFETY: as above; every byte pattern is a valid u32.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), w.len() * 4) }
}

/// Where each expert of one layer is: its format and, per expert, the runs of bytes
/// that make its record (three for a dense layer, one for an affine record).
#[derive(Debug, Clone)]
pub struct LayerSource {
    /// The layer's records.
    pub format: RecordFormat,
    /// Per expert, the runs in record order.
    pub experts: Vec<Vec<Extent>>,
    /// Per expert, the checksum of its record (`store::manifest::record_checksum`) where
    /// its store's manifest gives one: a reservoir checks each record it reads against
    /// it. `None` for a checkpoint layer.
    pub checksums: Option<Vec<String>>,
}
