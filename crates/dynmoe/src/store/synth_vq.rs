//! Synthetic VQ expert stores: records of random codes at a rung of the VQ ladder,
//! generated directly rather than encoded, so that speed can be measured at the low
//! rungs on the shapes of published models. Encoding runs at a few million weights a
//! second; the 12-layer Qwen3-30B-A3B shape has 7 G expert weights, its random records
//! are made at the speed of the disk.
//!
//! Every record is made by the generator [`GENERATOR`], seeded by the seed, the layer and
//! the expert, in the layout of [`super::vq`] (`VqLayout`, packed by `vq::pack_record`,
//! the rotation seeds of `store::vq_encode::vq_seed`): for gate, up and down in turn,
//! every code bit random, so that every index is uniform over the rung's `2^k`
//! codewords, then one norm per rotation block, uniform within ±[`SPREAD`] of a mean
//! chosen so that decoded weights have the standard deviation [`STD`] of the other
//! synthetic weights (see [`mean_norm`]).
//!
//! A block decodes as `w = n · D H v / √R` (norm `n`, sign flips `D`, orthonormal
//! Walsh–Hadamard `H`, the `R` looked-up codeword values `v`; `codec::vq::kernels`), so
//! `‖w‖² = n² ‖v‖² / R` and a decoded weight has mean square `n² · e / R`, where `e` is the
//! mean square of a codeword value over codewords drawn uniformly: somewhat under 1, as a
//! codebook for N(0, I) shrinks its cells' contents toward their centroids. Hence
//! `n = STD · √R / √e`, and the spread of `n` divides that by `√(1 + SPREAD²/3)` to keep
//! the mean square.
//!
//! The store is written like an encoded one ([`super::vq::write_store`]: temporary file,
//! flush, rename, manifest last) and checked like one (every record's checksum, or a spot
//! check for large files). Its manifest says what it is: `source.kind` is
//! [`SOURCE_KIND`] and `source.generator` names [`GENERATOR`] and the seed, so opening it
//! also makes a few records again and compares them byte for byte ([`spot_check`]); a
//! generator this build does not know is refused. `docs/FORMAT.md` §16.1 specifies the
//! generator.
//!
//! ```no_run
//! use std::path::Path;
//! use dynmoe::codec::vq::Rung;
//! use dynmoe::store::{atomic, manifest::ModelInfo, synth, synth_vq};
//! let dir = Path::new("q30-vq1.5");
//! let spec = synth::Spec {
//!     hidden: 2048,
//!     intermediate: 768,
//!     layers: (0..12).collect(),
//!     experts_per_layer: 128,
//!     model: ModelInfo { model_type: "qwen3_moe".into(), name: "qwen3-30b-a3b".into() },
//!     seed: 0,
//! };
//! std::fs::create_dir_all(dir).unwrap();
//! let _lock = atomic::lock_exclusive(dir)?;
//! let written = synth_vq::write_store(dir, &spec, Rung::parse("vq1.5").unwrap(), &mut |_, _| {})?;
//! assert_eq!(written.record_size % 16384, 0);
//! # Ok::<(), dynmoe::store::Error>(())
//! ```

use std::path::PathBuf;

use half::f16;
use serde::Serialize;

use super::synth::{fill_random, make_records, record_rng, source_generator, Spec, SPREAD, STD};
use super::vq::{self, data_file_name, pack_record, record_checksum, VqLayout, VqStore};
use super::{lowbit, Error};
use crate::codec::vq::{row_bytes, Rung, VqMatrix};
use crate::codec::CodecError;
use crate::rng::Rng;
use crate::store::vq_encode::vq_seed;

pub use super::synth::SOURCE_KIND;

/// Name and version of the record generator. Any change to the bytes it makes needs a
/// new name: stores of another generator are refused.
pub const GENERATOR: &str = "dynmoe-vq-uniform-1";

/// Mean square of one codeword value of `rung`'s codebook, over every codeword alike:
/// what a uniformly drawn index contributes to a block's energy.
pub fn codeword_energy(rung: Rung) -> Result<f64, CodecError> {
    let values = rung.codebook()?.values();
    Ok(values.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / values.len() as f64)
}

/// Mean block norm of a matrix with rotation blocks of `block` values at `rung`: decoded
/// weights then have standard deviation [`STD`] (see the module's derivation).
pub fn mean_norm(rung: Rung, block: usize) -> Result<f32, CodecError> {
    let spread = 1.0 + (SPREAD as f64).powi(2) / 3.0;
    Ok((STD as f64 * (block as f64 / (codeword_energy(rung)? * spread)).sqrt()) as f32)
}

/// What makes every record of one store: its layout, the model's experts per layer
/// (for the rotation seeds), the seed, and each projection's mean block norm.
struct RecordMaker {
    layout: VqLayout,
    experts_per_layer: usize,
    seed: u64,
    mean_norms: [f32; 3],
}

impl RecordMaker {
    fn new(layout: VqLayout, experts_per_layer: usize, seed: u64) -> Result<Self, CodecError> {
        let mut mean_norms = [0.0; 3];
        for (n, m) in mean_norms.iter_mut().zip(&layout.matrices) {
            *n = mean_norm(layout.rung, m.block)?;
        }
        Ok(RecordMaker {
            layout,
            experts_per_layer,
            seed,
            mean_norms,
        })
    }

    /// Gate, up and down of `expert` of decoder layer `layer`: for each in turn, its
    /// codes from the stream (the bits past a row's last index cleared, as the encoder
    /// leaves them), then one output per block norm, row-major: bits 40..64 place the
    /// norm within ±`SPREAD` of the mean.
    fn matrices(&self, layer: usize, expert: usize) -> [VqMatrix; 3] {
        let rung = self.layout.rung;
        let mut rng = record_rng(GENERATOR, self.seed, layer, expert);
        [0, 1, 2].map(|j| {
            let m = &self.layout.matrices[j];
            let mut codes = vec![0u8; m.codes.len];
            fill_random(&mut rng, &mut codes);
            let rb = row_bytes(rung, m.cols);
            let bits = m.cols.div_ceil(m.block) * m.block / rung.dim * rung.index_bits as usize;
            if !bits.is_multiple_of(8) {
                for row in codes.chunks_exact_mut(rb) {
                    row[rb - 1] &= (1u8 << (bits % 8)) - 1;
                }
            }
            let norms = (0..m.norms.len / 2)
                .map(|_| f16::from_f32(self.mean_norms[j] * spread_factor(&mut rng)))
                .collect();
            VqMatrix {
                rows: m.rows,
                cols: m.cols,
                rung,
                block: m.block,
                seed: vq_seed(layer, self.experts_per_layer, expert, j),
                norms,
                codes,
            }
        })
    }

    /// The record of `expert` of decoder layer `layer`.
    fn record(&self, layer: usize, expert: usize) -> Vec<u8> {
        pack_record(&self.layout, layer, expert, &self.matrices(layer, expert))
    }
}

/// Uniform in `[1 − SPREAD, 1 + SPREAD]`, from the top 24 bits of one output.
fn spread_factor(rng: &mut Rng) -> f32 {
    let unit = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
    1.0 - SPREAD + 2.0 * SPREAD * unit
}

/// The store [`write_store`] wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Written {
    /// The rung's name, `vq1.5`.
    pub rung: String,
    /// The data file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Bytes per record, page-aligned.
    pub record_size: usize,
    /// Bytes of one expert's codes and block norms: what a product with it reads.
    pub expert_bytes: usize,
}

/// Bytes of one expert's codes and block norms in `layout`.
pub fn expert_bytes(layout: &VqLayout) -> usize {
    layout
        .matrices
        .iter()
        .map(|m| m.codes.len + m.norms.len)
        .sum()
}

/// Writes `rung`'s store of random records for every expert of `spec` into `dir`
/// (`experts-vq{bits}.bin` and its manifest, [`super::vq::write_store`]). Records are made
/// in parallel a batch at a time, one batch ahead of the writer, with their checksums.
/// `progress(done, total)` counts records. Call under the directory's exclusive lock.
pub fn write_store(
    dir: &std::path::Path,
    spec: &Spec,
    rung: Rung,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Written, Error> {
    let total = spec.count();
    if total == 0 || !spec.layers.windows(2).all(|w| w[0] < w[1]) {
        return Err(Error::BadShape {
            reason: format!(
                "MoE layers {:?} with {} experts each: need at least one layer, strictly \
                 ascending, and one expert",
                spec.layers, spec.experts_per_layer
            ),
        });
    }
    let layout = VqLayout::new(rung, spec.hidden, spec.intermediate)?;
    let path = dir.join(data_file_name(rung));
    let maker = RecordMaker::new(layout, spec.experts_per_layer, spec.seed).map_err(|e| {
        Error::Unusable {
            path: path.clone(),
            reason: e.to_string(),
        }
    })?;
    let source = spec.source_of(GENERATOR);
    vq::write_store(
        dir,
        &layout,
        spec.experts_per_layer,
        spec.model.clone(),
        source,
        |sink| {
            make_records(
                spec,
                |layer, expert| {
                    let record = maker.record(layer, expert);
                    let checksum = record_checksum(&record);
                    (record, checksum)
                },
                |layer, (record, checksum)| sink.push(layer, &record, checksum),
                progress,
            )?;
            Ok(format!(
            "synthetic: random {} records ({GENERATOR}, seed {}), not encoded from a checkpoint",
            rung.name(),
            spec.seed
        ))
        },
    )?;
    Ok(Written {
        rung: rung.name(),
        path,
        bytes: layout.file_size(total),
        record_size: layout.record_size,
        expert_bytes: expert_bytes(&layout),
    })
}

/// The check of an opened store whose source is random records: the manifest must name
/// [`GENERATOR`], and the records a spot check picks (first, last, evenly spread ones
/// between) must be the ones it makes from the manifest's seed, byte for byte.
pub(crate) fn spot_check(store: &VqStore) -> Result<(), String> {
    let m = store.manifest();
    let generator = source_generator(&m.source, GENERATOR)?;
    let layout = *store.layout();
    let maker =
        RecordMaker::new(layout, m.experts_per_layer, generator.seed).map_err(|e| e.to_string())?;
    let per_layer = m.experts_per_layer;
    let picks = lowbit::spot_check_records(
        m.record_count as usize,
        layout.record_size,
        layout.record_size,
    );
    for i in picks {
        let (layer, expert) = (m.layers[i / per_layer].layer, i % per_layer);
        let expected = maker.record(layer, expert);
        if let Some(at) = expected
            .iter()
            .zip(store.record_bytes(i))
            .position(|(a, b)| a != b)
        {
            return Err(format!(
                "record {i} (layer {layer}, expert {expert}) differs at byte {at} from the \
                 record {GENERATOR} makes from seed {}: the manifest's source.generator is not \
                 what made the records",
                generator.seed
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::vq::get_bits;
    use crate::store::vq::{record_views, RecordHeader};
    use crate::testing::mean_std;

    fn rung(name: &str) -> Rung {
        Rung::parse(name).unwrap()
    }

    /// Decoded through the reference decoder (codewords looked up, rotation undone),
    /// the weights of a few records have mean zero and standard deviation `STD`, at rungs
    /// of different `p`, in full blocks (1024, 256) and in a padded one (96 of 128).
    #[test]
    fn decoded_weights_have_the_intended_distribution() {
        for (name, hidden, intermediate) in
            [("vq1.5", 2048, 768), ("vq0.7", 256, 96), ("vq3", 128, 96)]
        {
            let layout = VqLayout::new(rung(name), hidden, intermediate).unwrap();
            let maker = RecordMaker::new(layout, 8, 11).unwrap();
            let mut all = Vec::new();
            for e in 0..3 {
                let record = maker.record(2, e);
                for v in record_views(&layout, &record) {
                    all.extend(v.decode().unwrap());
                }
            }
            let (mean, std) = mean_std(&all);
            assert!(mean.abs() < 0.02 * STD as f64, "{name}: mean {mean}");
            assert!(
                (std / STD as f64 - 1.0).abs() < 0.05,
                "{name}: std {std}, want {STD}"
            );
        }
    }

    /// The sizes `docs/FORMAT.md` §16.1 gives for Qwen3-30B-A3B at vq1.5: gate and up rows
    /// of 2048 columns are two blocks of 1024 (256 vectors of 12 bits, 384 bytes), down rows
    /// of 768 three blocks of 256 (144 bytes).
    #[test]
    fn qwen3_30b_a3b_at_vq1_5_by_hand() {
        let l = VqLayout::new(rung("vq1.5"), 2048, 768).unwrap();
        assert_eq!(
            expert_bytes(&l),
            3 * 768 * 384 + 2 * 768 * 2 * 2 + 2048 * 3 * 2
        );
        assert_eq!(expert_bytes(&l), 903_168);
        assert_eq!((l.data_end, l.record_size), (903_232, 56 * 16384));
        assert_eq!(l.file_size(12 * 128), 1_409_286_144);
    }

    #[test]
    fn records_depend_on_seed_layer_and_expert() {
        let layout = VqLayout::new(rung("vq1.5"), 64, 48).unwrap();
        let one = |seed, layer, expert| {
            RecordMaker::new(layout, 8, seed)
                .unwrap()
                .record(layer, expert)
        };
        assert_eq!(one(1, 2, 3), one(1, 2, 3));
        assert_ne!(one(1, 2, 3), one(2, 2, 3));
        assert_ne!(one(1, 2, 3), one(1, 3, 3));
        assert_ne!(one(1, 2, 3), one(1, 2, 4));
        let r = one(1, 2, 3);
        assert!(r[layout.data_end..].iter().all(|&b| b == 0));
        let h = RecordHeader::read(&r).unwrap();
        assert_eq!((h.layer, h.expert), (2, 3));
        assert_eq!(h.seeds, [0, 1, 2].map(|p| vq_seed(2, 8, 3, p)));
    }

    /// Rows whose indices do not fill their last byte (a 16-column row at p 16, k 11: one
    /// index, 5 bits over) keep those bits zero, as the encoder leaves them; the indices
    /// themselves cover the codebook.
    #[test]
    fn index_bits_are_uniform_and_row_padding_is_clear() {
        let r = rung("vq0.7");
        let layout = VqLayout::new(r, 16, 16).unwrap();
        let maker = RecordMaker::new(layout, 4, 5).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for e in 0..4 {
            for m in maker.matrices(1, e) {
                assert_eq!(m.codes.len(), m.rows * 2);
                for row in m.codes.chunks_exact(2) {
                    assert_eq!(row[1] >> 3, 0, "bits past the index");
                    seen.insert(get_bits(row, 0, 11));
                }
            }
        }
        assert!(seen.len() > 100, "{} distinct indices", seen.len());
        // Norms spread within ±25% of their mean.
        let mean = mean_norm(r, 16).unwrap();
        for m in maker.matrices(0, 0) {
            assert!(m
                .norms
                .iter()
                .all(|n| (n.to_f32() / mean - 1.0).abs() <= SPREAD + 1e-3));
        }
    }
}
