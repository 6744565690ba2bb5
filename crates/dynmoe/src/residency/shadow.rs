//! Shadows: every expert of a layer that keeps only some resident, coded at a low rung of
//! the VQ ladder and always held, so that a token routed to an expert outside the set
//! runs its shadow instead of losing that share of its routing (docs/ARCHITECTURE.md,
//! Residency).
//!
//! A shadow is encoded once, when the sets are made, from the expert's record as the
//! reservoir holds it (bf16 values, or a VQ record decoded first), and kept in memory at
//! its codes' size: no page padding, as a store's record would carry.

use std::sync::Arc;

use super::{Error, Reservoir};
use crate::codec::vq::{Rung, VqMatrix};
use crate::store::records::{Buffer, RecordFormat};
use crate::store::vq::record_views;
use crate::store::vq_encode::VqExperts;

/// The shadows of every expert of `layer`, at `rung`.
pub(super) fn shadows(
    reservoir: &Reservoir,
    layer: usize,
    experts: usize,
    rung: Rung,
) -> Result<VqExperts, Error> {
    let format = reservoir.format(layer);
    let mut scratch = Vec::new();
    let mut buf = format.buffer();
    let mut out = Vec::with_capacity(experts);
    for e in 0..experts {
        reservoir.read(layer, e, &mut buf, &mut scratch)?;
        let [gate, up, down] = decoded(format, &buf, layer)?;
        // A seed per layer, expert and projection: shadows of one model never share a
        // rotation by accident.
        let seed = |p: u64| (layer as u64) << 40 | (e as u64) << 8 | p;
        let encode = |(w, rows, cols): (Vec<f32>, usize, usize), p: u64| {
            VqMatrix::encode(&w, rows, cols, rung, seed(p)).map_err(|source| {
                Error::Config(format!(
                    "layer {layer} expert {e}: shadow at {}: {source}",
                    rung.name()
                ))
            })
        };
        out.push([encode(gate, 0)?, encode(up, 1)?, encode(down, 2)?]);
    }
    Ok(VqExperts::Encoded(Arc::new(out)))
}

/// Gate, up and down of a record as f32 values with their `(rows, cols)`.
fn decoded(
    format: RecordFormat,
    buf: &Buffer,
    layer: usize,
) -> Result<[(Vec<f32>, usize, usize); 3], Error> {
    match (format, buf) {
        (RecordFormat::Dense { .. }, Buffer::F32(f)) => {
            let m = format.dense_matrices(f).expect("a dense format");
            Ok(m.map(|(w, rows, cols)| (w.to_vec(), rows, cols)))
        }
        (RecordFormat::Vq(layout), Buffer::Words(_)) => {
            let views = record_views(&layout, buf.bytes());
            let mut out = Vec::with_capacity(3);
            for v in views {
                let w = v.decode().map_err(|source| {
                    Error::Config(format!("layer {layer}: a VQ record for a shadow: {source}"))
                })?;
                out.push((w, v.rows, v.cols));
            }
            Ok(out.try_into().expect("three projections"))
        }
        _ => Err(Error::Config(format!(
            "layer {layer}: shadows are made from bf16 or VQ experts, not from an affine store's \
             records"
        ))),
    }
}

/// Bytes the shadows hold: codes and block norms of every matrix.
pub(super) fn shadow_bytes(s: &VqExperts) -> usize {
    match s {
        VqExperts::Encoded(m) => m
            .iter()
            .flatten()
            .map(|x| x.code_bytes() + x.norm_bytes())
            .sum(),
        VqExperts::Stored { .. } => 0,
    }
}
