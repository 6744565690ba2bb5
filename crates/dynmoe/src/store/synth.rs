//! Synthetic expert stores: random records in the layout of a converted model, written
//! straight to disk, so that speed can be measured on the shapes of published models
//! without their weights and without ever writing their experts in bf16.
//!
//! Every record is made by the generator [`GENERATOR`], seeded by the seed, the layer
//! and the expert, as a 4-bit record: every byte of the three code parts random (codes
//! uniform over 0..16), and for each group of 64 weights a scale of random sign and of
//! magnitude uniform within ±[`SPREAD`] of its mean, with the bias `−7.5 × scale` that
//! centres the group's sixteen levels on zero. Decoded weights then have mean zero and
//! standard deviation [`STD`], as the bf16 weights of `model::synth` have. The 3- and
//! 2-bit records are that record re-packed exactly as `lowbit` re-packs `experts.bin`,
//! whether or not the 4-bit store is written, so a 2-bit store is the same bytes with
//! or without its base.
//!
//! The VQ counterpart, random VQ records for synthetic compressed directories, is
//! [`super::synth_vq`]; it shares this module's stream, [`Spec`], [`STD`] and [`SPREAD`].
//!
//! Manifests say what the records are: the source of a store made here has kind
//! [`SOURCE_KIND`] and names the generator and seed. A 4-bit store is written with
//! such a source, and the low-bit stores written beside it are derived from it as
//! `lowbit` derives them (source `experts.bin`), so `lowbit::ensure` keeps or rebuilds
//! them as it would a converted model's. A low-bit store written without a 4-bit store
//! stands alone: its own source is the generator. Either way, the spot check that
//! `lowbit` runs on every open makes a few records again from the generator and compares
//! them byte for byte (`spot_check`), which is what a flipped byte in those records
//! fails.
//!
//! ```no_run
//! use std::path::Path;
//! use dynmoe::store::{atomic, manifest::ModelInfo, synth};
//! let dir = Path::new("q2-only");
//! let spec = synth::Spec {
//!     hidden: 4096,
//!     intermediate: 1536,
//!     layers: (0..94).collect(),
//!     experts_per_layer: 128,
//!     model: ModelInfo { model_type: "qwen3_moe".into(), name: "qwen3-235b-a22b".into() },
//!     seed: 0,
//! };
//! std::fs::create_dir_all(dir).unwrap();
//! let _lock = atomic::lock_exclusive(dir)?;
//! synth::prepare(dir, &[2])?;
//! synth::write_stores(dir, &spec, &[2], &mut |_, _| {})?;
//! # Ok::<(), dynmoe::store::Error>(())
//! ```

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::bf16;
use rayon::prelude::*;
use serde::Serialize;

use super::atomic::{self, TempOutput};
use super::layout::{Layout, SUPPORTED_BITS};
use super::lowbit::{self, Checked, Packing};
use super::manifest::{
    record_checksum, Created, Fnv64, Generator, Manifest, ModelInfo, Source, FORMAT, SCALE_DTYPE,
    VERSION,
};
use super::{data_file_name, manifest_file_name, Error, BASE_FILE, PAGE};
use crate::codec::affine::GROUP_SIZE;
use crate::rng::Rng;

/// The `source.kind` of a store of random records.
pub const SOURCE_KIND: &str = "synthetic";

/// Name and version of the record generator. Any change to the bytes it makes needs a
/// new name: stores of another generator fail the spot check.
pub const GENERATOR: &str = "dynmoe-affine-uniform-1";

/// Standard deviation of the decoded 4-bit weights.
pub const STD: f32 = 0.02;

/// A group's scale magnitude is uniform in `[1 − SPREAD, 1 + SPREAD]` times the mean
/// magnitude, so that groups differ as real ones do (a kernel that mixes up groups gives
/// other results).
pub const SPREAD: f32 = 0.25;

/// The experts of a synthetic model.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of an expert's hidden layer.
    pub intermediate: usize,
    /// The MoE layers, strictly ascending.
    pub layers: Vec<usize>,
    /// Routed experts per MoE layer.
    pub experts_per_layer: usize,
    /// The model the manifests name.
    pub model: ModelInfo,
    /// Seed of the generator.
    pub seed: u64,
}

impl Spec {
    /// Records per store: every expert of every MoE layer.
    pub(crate) fn count(&self) -> usize {
        self.layers.len() * self.experts_per_layer
    }

    /// Size of the store at `bits`.
    pub fn store_bytes(&self, bits: u32) -> Result<u64, Error> {
        Ok(Layout::new(bits, self.hidden, self.intermediate)?.file_size(self.count()))
    }

    /// The source every affine store made from this spec names, directly or through
    /// `experts.bin`.
    fn source(&self) -> Source {
        self.source_of(GENERATOR)
    }

    /// The source of stores whose records `generator` makes from this spec: the same
    /// generator, seed and shape always have the same fingerprint.
    pub(crate) fn source_of(&self, generator: &str) -> Source {
        let mut h = Fnv64::default();
        h.field(SOURCE_KIND.as_bytes())
            .field(generator.as_bytes())
            .u64(self.seed)
            .u64(self.hidden as u64)
            .u64(self.intermediate as u64)
            .u64(self.experts_per_layer as u64)
            .u64(self.layers.len() as u64);
        for &l in &self.layers {
            h.u64(l as u64);
        }
        Source {
            kind: SOURCE_KIND.to_string(),
            fingerprint: h.hex(),
            files: Vec::new(),
            generator: Some(Generator {
                name: generator.to_string(),
                seed: self.seed,
            }),
        }
    }
}

/// Mean scale magnitude: sixteen equally likely levels `q · s` (q = 0..15, centred by
/// the bias) have variance `255/12 · s²`, and the spread of `s` multiplies its mean
/// square by `1 + SPREAD²/3`.
fn mean_scale() -> f32 {
    STD / (255.0 / 12.0 * (1.0 + SPREAD * SPREAD / 3.0)).sqrt()
}

/// The generator of one record of `generator`: FNV-1a of the generator's name, the seed,
/// the layer and the expert seeds a SplitMix64 stream.
pub(crate) fn record_rng(generator: &str, seed: u64, layer: usize, expert: usize) -> Rng {
    Rng::seeded(
        Fnv64::default()
            .field(generator.as_bytes())
            .u64(seed)
            .u64(layer as u64)
            .u64(expert as u64)
            .finish(),
    )
}

/// Fills `bytes` with the stream's 64-bit outputs, little-endian; a tail shorter than 8
/// bytes takes the first bytes of one more output.
pub(crate) fn fill_random(rng: &mut Rng, bytes: &mut [u8]) {
    let mut chunks = bytes.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let last = rng.next_u64().to_le_bytes();
        tail.copy_from_slice(&last[..tail.len()]);
    }
}

/// The 4-bit record of `expert` of `layer`: the code parts of gate, up and down filled
/// in order with the stream's 64-bit outputs (little-endian; a part's tail takes the
/// first bytes of one more output), then per scale part one output per group: bits
/// 40..64 give the magnitude, bit 0 the sign. Padding is zero.
fn q4_record(layout: &Layout, seed: u64, layer: usize, expert: usize) -> Vec<u8> {
    debug_assert_eq!(layout.bits, 4);
    let mut record = vec![0u8; layout.record_size];
    let mut rng = record_rng(GENERATOR, seed, layer, expert);
    for m in &layout.matrices {
        fill_random(&mut rng, &mut record[m.codes.range()]);
    }
    let mean = mean_scale();
    for m in &layout.matrices {
        for g in 0..m.rows * m.groups_per_row() {
            let r = rng.next_u64();
            let unit = (r >> 40) as f32 / (1u64 << 24) as f32;
            let magnitude = mean * (1.0 - SPREAD + 2.0 * SPREAD * unit);
            let scale = bf16::from_f32(if r & 1 == 0 { magnitude } else { -magnitude });
            // From the rounded scale, so that the levels stay centred on zero.
            let bias = bf16::from_f32(-7.5 * scale.to_f32());
            let at = |offset: usize| offset + 2 * g..offset + 2 * g + 2;
            record[at(m.scales.offset)].copy_from_slice(&scale.to_le_bytes());
            record[at(m.biases.offset)].copy_from_slice(&bias.to_le_bytes());
        }
    }
    record
}

/// The record of `expert` of `layer` in each of `layouts` (the 4-bit layout `q4` and
/// lower precisions, in any order).
fn records(
    q4: &Layout,
    layouts: &[Layout],
    seed: u64,
    layer: usize,
    expert: usize,
) -> Vec<Vec<u8>> {
    let src = q4_record(q4, seed, layer, expert);
    let low: Vec<Layout> = layouts.iter().filter(|l| l.bits != 4).copied().collect();
    let mut packed = if low.is_empty() {
        Vec::new()
    } else {
        lowbit::pack_into(&src, q4, &low, Packing::Current)
    }
    .into_iter();
    let mut src = Some(src);
    layouts
        .iter()
        .map(|l| match l.bits {
            4 => src.take().expect("4 bits asked for once"),
            _ => packed.next().expect("one record per low-bit layout"),
        })
        .collect()
}

/// The generator a synthetic store's `source` names, if it is `name` (the one this build
/// makes and checks such records with).
pub(crate) fn source_generator<'s>(
    source: &'s Source,
    name: &str,
) -> Result<&'s Generator, String> {
    let Some(generator) = &source.generator else {
        return Err(format!(
            "source kind {SOURCE_KIND:?} but no source.generator in the manifest"
        ));
    };
    if generator.name != name {
        return Err(format!(
            "records of generator {:?}; this build makes and checks {name:?}",
            generator.name
        ));
    }
    Ok(generator)
}

/// The spot check of a store of random records: the records `lowbit` spot-checks
/// (first, last, evenly spread ones between) made again from the manifest's generator
/// and seed, and compared with the stored ones byte for byte, padding included.
pub(crate) fn spot_check(store: &Checked) -> Result<(), String> {
    let m = &store.manifest;
    let generator = source_generator(&m.source, GENERATOR)?;
    let q4 = store.layout.with_bits(4).map_err(|e| e.to_string())?;
    let per_layer = m.experts_per_layer;
    let picks = lowbit::spot_check_records(
        m.record_count as usize,
        q4.record_size,
        store.layout.record_size,
    );
    for i in picks {
        let (layer, expert) = (m.layers[i / per_layer], i % per_layer);
        let expected = records(&q4, &[store.layout], generator.seed, layer, expert);
        if let Some(at) = expected[0]
            .iter()
            .zip(store.record(i))
            .position(|(a, b)| a != b)
        {
            return Err(format!(
                "record {i} (layer {layer}, expert {expert}) differs at byte {at} from the record \
                 {GENERATOR} makes from seed {}: damage",
                generator.seed
            ));
        }
    }
    Ok(())
}

/// One store [`write_stores`] wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Written {
    /// Bits per code.
    pub bits: u32,
    /// The data file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Bytes per record.
    pub record_size: usize,
}

/// Readies `dir` for [`write_stores`] of the precisions `bits`: deletes temporary files
/// a killed writer left, the manifests of every precision (the commit marks: gone until
/// the new stores are complete) and the data files of precisions not asked for, which
/// belong to another model. Call it, and everything up to the end of [`write_stores`],
/// holding `atomic::lock_exclusive(dir)`.
pub fn prepare(dir: &Path, bits: &[u32]) -> Result<(), Error> {
    atomic::remove_stale_temps(dir)?;
    for b in SUPPORTED_BITS {
        atomic::remove_committed(&dir.join(manifest_file_name(b)))?;
    }
    for b in SUPPORTED_BITS.into_iter().filter(|b| !bits.contains(b)) {
        atomic::remove_committed(&dir.join(data_file_name(b)))?;
    }
    Ok(())
}

/// Writes the expert stores of `spec` at each precision of `bits` (2, 3, 4) into `dir`:
/// every data file atomically, then the manifests, 4-bit first. Records are made in
/// parallel a batch at a time, one batch ahead of the writer, so memory holds three
/// batches whatever the model's size. `progress(done, total)` counts records. Call after
/// [`prepare`], under the directory's exclusive lock.
pub fn write_stores(
    dir: &Path,
    spec: &Spec,
    bits: &[u32],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Written>, Error> {
    // The base first: its manifest is written first, and derived ones name it.
    let mut targets: Vec<u32> = Vec::new();
    for &b in bits {
        if !SUPPORTED_BITS.contains(&b) {
            return Err(Error::UnsupportedBits { bits: b });
        }
        if !targets.contains(&b) {
            targets.push(b);
        }
    }
    targets.sort_unstable_by(|a, b| b.cmp(a));
    if targets.is_empty() || spec.count() == 0 {
        return Err(Error::BadShape {
            reason: format!(
                "nothing to write: precisions {bits:?}, {} layers × {} experts",
                spec.layers.len(),
                spec.experts_per_layer
            ),
        });
    }
    if !spec.layers.windows(2).all(|w| w[0] < w[1]) {
        return Err(Error::BadShape {
            reason: format!("MoE layers {:?} are not strictly ascending", spec.layers),
        });
    }
    let q4 = Layout::new(4, spec.hidden, spec.intermediate)?;
    let layouts = targets
        .iter()
        .map(|&b| q4.with_bits(b))
        .collect::<Result<Vec<_>, _>>()?;
    let mut outs = targets
        .iter()
        .map(|&b| {
            // Records of real shapes (MBs) go to the file unbuffered; small ones are
            // gathered.
            TempOutput::create(&dir.join(data_file_name(b)))
                .map(|f| BufWriter::with_capacity(256 << 10, f))
        })
        .collect::<Result<Vec<_>, _>>()?;

    let total = spec.count();
    let mut checksums = vec![Vec::with_capacity(total); layouts.len()];
    make_records(
        spec,
        |layer, expert| {
            records(&q4, &layouts, spec.seed, layer, expert)
                .into_iter()
                .map(|r| {
                    let sum = record_checksum(&r);
                    (r, sum)
                })
                .collect::<Vec<_>>()
        },
        |_, record| {
            for (k, (out, (bytes, sum))) in outs.iter_mut().zip(record).enumerate() {
                out.write_all(&bytes).map_err(|source| Error::Io {
                    path: out.get_ref().path().to_path_buf(),
                    source,
                })?;
                checksums[k].push(sum);
            }
            Ok(())
        },
        progress,
    )?;
    let mut written = Vec::new();
    for (out, layout) in outs.into_iter().zip(&layouts) {
        let path = out.get_ref().path().to_path_buf();
        atomic::commit_buffered(out)?;
        written.push(Written {
            bits: layout.bits,
            path,
            bytes: layout.file_size(total),
            record_size: layout.record_size,
        });
    }
    let base = base_manifest(spec, &q4);
    for (layout, sums) in layouts.iter().zip(checksums) {
        let manifest = match layout.bits {
            4 => Manifest {
                checksums: sums,
                ..base.clone()
            },
            _ if targets.contains(&4) => {
                lowbit::derived_manifest(&base, layout, Packing::Current, sums)
            }
            bits => standalone_manifest(&base, layout, bits, sums),
        };
        atomic::write_file(
            &dir.join(manifest_file_name(layout.bits)),
            &manifest.to_bytes(),
        )?;
    }
    Ok(written)
}

/// The manifest of a 4-bit store of `spec`'s random records, without checksums (the
/// caller adds them).
fn base_manifest(spec: &Spec, layout: &Layout) -> Manifest {
    let source = spec.source();
    let count = spec.count();
    Manifest {
        format: FORMAT.to_string(),
        version: VERSION,
        file: BASE_FILE.to_string(),
        bits: 4,
        group_size: GROUP_SIZE,
        scale_dtype: SCALE_DTYPE.to_string(),
        page: PAGE,
        hidden: layout.hidden,
        intermediate: layout.intermediate,
        layers: spec.layers.clone(),
        experts_per_layer: spec.experts_per_layer,
        record_size: layout.record_size as u64,
        record_count: count as u64,
        file_size: layout.file_size(count),
        checksums: Vec::new(),
        fingerprint: store_fingerprint(&source, 4),
        model: spec.model.clone(),
        created: Created::now(&format!(
            "synthetic: random 4-bit records ({GENERATOR}, seed {}), no checkpoint",
            spec.seed
        )),
        source,
    }
}

/// The manifest of a low-bit store written without its 4-bit store: its source is the
/// generator, not `experts.bin`.
fn standalone_manifest(
    base: &Manifest,
    layout: &Layout,
    bits: u32,
    checksums: Vec<String>,
) -> Manifest {
    let seed = base.source.generator.as_ref().map_or(0, |g| g.seed);
    Manifest {
        fingerprint: store_fingerprint(&base.source, bits),
        source: base.source.clone(),
        created: Created::now(&format!(
            "synthetic: random 4-bit records ({GENERATOR}, seed {seed}) re-packed to {bits} bits; \
             the 4-bit store was not written"
        )),
        ..lowbit::derived_manifest(base, layout, Packing::Current, checksums)
    }
}

/// The fingerprint of a store of random records: the same records (generator, seed,
/// shape) at the same precision and layout always have the same identity.
fn store_fingerprint(source: &Source, bits: u32) -> String {
    Fnv64::default()
        .field(source.fingerprint.as_bytes())
        .u64(bits as u64)
        .u64(VERSION as u64)
        .hex()
}

/// Every record of `spec`'s experts, in order: `make(layer, expert)` runs on all cores a
/// batch at a time, one batch ahead of `take(layer, record)`; `progress(done, total)`
/// counts records.
pub(crate) fn make_records<T: Send>(
    spec: &Spec,
    make: impl Fn(usize, usize) -> T + Sync,
    mut take: impl FnMut(usize, T) -> Result<(), Error>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), Error> {
    let (total, per_layer) = (spec.count(), spec.experts_per_layer);
    let batch = 2 * rayon::current_num_threads().max(1);
    progress(0, total);
    pipelined(
        total.div_ceil(batch),
        |k| {
            (k * batch..total.min((k + 1) * batch))
                .into_par_iter()
                .map(|i| {
                    let layer = spec.layers[i / per_layer];
                    (layer, make(layer, i % per_layer))
                })
                .collect::<Vec<_>>()
        },
        |k, made| {
            for (layer, record) in made {
                take(layer, record)?;
            }
            progress(total.min((k + 1) * batch), total);
            Ok(())
        },
    )
}

/// Runs `make(k)` for `k` in `0..n` on a thread of its own (parallel inside `make`),
/// one batch ahead of `consume`, which gets the batches in order on the calling thread:
/// making and writing overlap, and at most three batches are alive. An error from
/// `consume` stops the maker after the batch it is on.
pub(crate) fn pipelined<T: Send>(
    n: usize,
    make: impl Fn(usize) -> T + Sync,
    mut consume: impl FnMut(usize, T) -> Result<(), Error>,
) -> Result<(), Error> {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let make = &make;
        s.spawn(move || {
            for k in 0..n {
                if tx.send(make(k)).is_err() {
                    break;
                }
            }
        });
        for (k, batch) in rx.iter().enumerate() {
            consume(k, batch)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::affine::lowbit::dequantize;
    use crate::store::layout::get_u32s;
    use crate::testing::mean_std;

    fn decoded(record: &[u8], layout: &Layout) -> Vec<f32> {
        let bf16s = |b: &[u8]| -> Vec<bf16> {
            b.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        layout
            .matrices
            .iter()
            .flat_map(|m| {
                dequantize(
                    &get_u32s(&record[m.codes.range()]),
                    &bf16s(&record[m.scales.range()]),
                    &bf16s(&record[m.biases.range()]),
                    m.rows,
                    m.cols,
                    layout.bits,
                )
            })
            .collect()
    }

    /// Decoded weights have mean zero and the intended spread at 4 bits; at 2 and 3 bits
    /// the midpoint reconstruction narrows it by its known factor (levels 1.5, 5.5, 9.5,
    /// 13.5 have variance 20 s² against 21.25 s² for sixteen levels).
    #[test]
    fn decoded_weights_have_the_intended_distribution() {
        let q4 = Layout::new(4, 256, 128).unwrap();
        let layouts = [q4, q4.with_bits(3).unwrap(), q4.with_bits(2).unwrap()];
        let mut all: [Vec<f32>; 3] = Default::default();
        for e in 0..4 {
            for (v, (r, l)) in all
                .iter_mut()
                .zip(records(&q4, &layouts, 3, 1, e).iter().zip(&layouts))
            {
                v.extend(decoded(r, l));
            }
        }
        let expect = [1.0, (21.0f64 / 21.25).sqrt(), (20.0f64 / 21.25).sqrt()];
        for ((v, l), f) in all.iter().zip(&layouts).zip(expect) {
            let (mean, std) = mean_std(v);
            assert!(mean.abs() < 2e-4, "{} bits: mean {mean}", l.bits);
            let want = STD as f64 * f;
            assert!(
                (std / want - 1.0).abs() < 0.02,
                "{} bits: std {std}, want {want}",
                l.bits
            );
        }
    }

    #[test]
    fn records_depend_on_seed_layer_and_expert_and_pad_with_zeros() {
        let q4 = Layout::new(4, 64, 96).unwrap();
        let one = |seed, layer, expert| records(&q4, &[q4], seed, layer, expert).remove(0);
        assert_eq!(one(1, 2, 3), one(1, 2, 3));
        assert_ne!(one(1, 2, 3), one(2, 2, 3));
        assert_ne!(one(1, 2, 3), one(1, 3, 3));
        assert_ne!(one(1, 2, 3), one(1, 2, 4));
        assert!(one(1, 2, 3)[q4.data_end..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_low_bit_record_is_the_re_pack_of_the_4_bit_one() {
        let q4 = Layout::new(4, 128, 64).unwrap();
        let q2 = q4.with_bits(2).unwrap();
        let both = records(&q4, &[q2, q4], 9, 0, 1);
        let repacked = lowbit::pack_into(&both[1], &q4, &[q2], Packing::Current);
        assert_eq!(both[0], repacked[0]);
    }

    #[test]
    fn pipelined_keeps_order_and_stops_on_error() {
        let mut seen = Vec::new();
        pipelined(
            5,
            |k| k * 10,
            |_, v| {
                seen.push(v);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(seen, [0, 10, 20, 30, 40]);
        let made = std::sync::atomic::AtomicUsize::new(0);
        let err = pipelined(
            1000,
            |k| {
                made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                k
            },
            |k, _| match k {
                2 => Err(Error::Missing { path: "x".into() }),
                _ => Ok(()),
            },
        );
        assert!(err.is_err());
        assert!(made.load(std::sync::atomic::Ordering::Relaxed) < 10);
    }
}
