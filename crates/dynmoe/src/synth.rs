//! Checkpoints with the shapes of published MoE models and random weights, so that
//! speed can be measured on exactly those shapes without downloading them.
//!
//! [`synth_converted`] writes a converted model directory directly: `config.json`, the
//! tokenizer, `dense.safetensors` with random bf16 non-expert weights (the distribution
//! below) and expert stores of random records at the precisions asked for
//! (`store::synth`), with or without the 4-bit store. No bf16 expert is ever written, and
//! memory holds a few records and a few MB of dense weights per thread, so the whole of
//! Qwen3-235B-A22B's shape is written at the speed of the disk.
//!
//! [`synth_compressed`] writes a compressed model directory (`store::compressed`) the same
//! way, with every MoE layer's routed experts at one rung of the VQ ladder: the same
//! `dense.safetensors`, one VQ store of random records generated directly
//! (`store::synth_vq`, never encoded), a `plan.json` that keeps every expert resident at
//! that rung, and `compressed.json` last. It loads and runs as a compressed checkpoint
//! does, through the same checks.
//!
//! [`synth`] writes a Hugging Face checkpoint instead, for `dynmoe convert`. Its directory
//! holds a `config.json` of the named model (its first `layers` layers, if
//! asked), bf16 safetensors in Hugging Face's per-expert layout (one shard per decoder
//! layer plus one for the embedding, final norm and LM head, found through
//! `model.safetensors.index.json`) and a tokenizer copied from another model directory.
//! Weights are uniform with a standard deviation of 0.02 (norms are ones), drawn from a
//! seed, so two runs with the same arguments write the same bytes. Every file is written
//! atomically and the index last.

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use half::bf16;
use rayon::prelude::*;
use safetensors::tensor::{Dtype, TensorView};

use crate::codec::vq::{Rung, LADDER};
use crate::codec::Codec;
use crate::model::Error;
use crate::rng::Rng;
use crate::store::manifest::{Generator, ModelInfo};
use crate::store::{self, atomic, compressed, synth_vq, vq, DENSE_FILE};
use crate::store::{plan::LayerPlan, plan::Plan, plan::PlanError, plan::PLAN_FILE};

mod shapes;
pub use shapes::{shape, Family, MlaShape, Shape, SHAPES};

/// What [`synth`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SynthReport {
    /// Output directory.
    pub dir: PathBuf,
    /// Decoder layers written.
    pub layers: usize,
    /// Parameters written.
    pub params: usize,
    /// Bytes of safetensors written.
    pub bytes: usize,
}

impl Shape {
    /// The non-expert tensors of a `layers`-layer model in `dense.safetensors`' order
    /// (safetensors' own: all bf16, so by name), with shapes and byte counts.
    fn dense_layout(&self, layers: usize) -> Vec<(String, Dtype, Vec<usize>, usize)> {
        let mut t: Vec<_> = (0..layers)
            .map(Some)
            .chain([None])
            .flat_map(|l| self.dense_tensors(l))
            .map(|(name, dims)| {
                let bytes = 2 * dims.iter().product::<usize>();
                (name, Dtype::BF16, dims, bytes)
            })
            .collect();
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t
    }

    /// The expert stores of a `layers`-layer model of this shape.
    fn expert_spec(&self, layers: usize, seed: u64) -> store::synth::Spec {
        store::synth::Spec {
            hidden: self.hidden,
            intermediate: self.moe_intermediate,
            layers: self.moe_layers(layers),
            experts_per_layer: self.experts,
            model: ModelInfo {
                model_type: self.model_type().to_string(),
                name: self.name.to_string(),
            },
            seed,
        }
    }

    /// Size of `dense.safetensors` of a `layers`-layer model.
    fn dense_bytes(&self, layers: usize) -> Result<u64, Error> {
        let dense = self.dense_layout(layers);
        let header = store::base::safetensors_header(Path::new(DENSE_FILE), &dense)?;
        Ok((8 + header.len() + dense.iter().map(|t| t.3).sum::<usize>()) as u64)
    }

    /// Bytes of `dense.safetensors` and the stores at `bits` that [`synth_converted`]
    /// writes for `layers` layers (the config and tokenizer files aside).
    pub fn converted_bytes(&self, layers: usize, bits: &[u32]) -> Result<u64, Error> {
        let mut bytes = self.dense_bytes(layers)?;
        let spec = self.expert_spec(layers, 0);
        let mut seen = Vec::new();
        for &b in bits {
            if !seen.contains(&b) {
                bytes += spec.store_bytes(b)?;
                seen.push(b);
            }
        }
        Ok(bytes)
    }

    /// Bytes of `dense.safetensors` and the VQ store at `rung` that [`synth_compressed`]
    /// writes for `layers` layers (the small JSON and tokenizer files aside).
    pub fn compressed_bytes(&self, layers: usize, rung: Rung) -> Result<u64, Error> {
        let layout = vq::VqLayout::new(rung, self.hidden, self.moe_intermediate)?;
        let moe_layers = self.moe_layers(layers).len();
        Ok(self.dense_bytes(layers)? + layout.file_size(moe_layers * self.experts))
    }

    /// The most layers, up to `layers`, whose converted directory at `bits` takes at
    /// most `budget` bytes; 0 if not even one layer does.
    pub fn layers_fitting(&self, layers: usize, bits: &[u32], budget: u64) -> Result<usize, Error> {
        most_layers(layers, budget, |n| self.converted_bytes(n, bits))
    }

    /// The most layers, up to `layers`, whose compressed directory at `rung` takes at most
    /// `budget` bytes; 0 if not even one layer does.
    pub fn layers_fitting_vq(
        &self,
        layers: usize,
        rung: Rung,
        budget: u64,
    ) -> Result<usize, Error> {
        most_layers(layers, budget, |n| self.compressed_bytes(n, rung))
    }

    /// The plan of a `layers`-layer synthetic compressed directory: every MoE layer at
    /// `rung` with every expert resident, priced as `dynmoe compress` prices plans (dense
    /// bf16 tensors and the rung's codebook in `dense_bytes`, every parameter in
    /// `params_total`); the budget is exactly what it spends.
    fn vq_plan(&self, layers: usize, rung: Rung, seed: u64) -> Result<Plan, Error> {
        let codec: Codec = rung.name().parse().expect("rung names parse as codecs");
        let encode = |source| Error::Encode {
            tensor: format!("{} experts at {}", self.name, rung.name()),
            source,
        };
        let (h, i, e) = (self.hidden, self.moe_intermediate, self.experts);
        let expert = 2 * codec.matrix_bytes(i, h).map_err(encode)?
            + codec.matrix_bytes(h, i).map_err(encode)?;
        let dense_params: u64 = self
            .dense_layout(layers)
            .iter()
            .map(|t| t.2.iter().product::<usize>() as u64)
            .sum();
        let dense_bytes = 2 * dense_params;
        let moe_layers = self.moe_layers(layers);
        let plans: Vec<LayerPlan> = moe_layers
            .iter()
            .map(|&layer| LayerPlan {
                layer,
                codec,
                experts: e,
                resident: e,
                spare_slots: Some(0),
                shadow_bytes: 0,
                resident_bytes: e as u64 * expert,
                reservoir_bytes: 0,
                keep: Vec::new(),
            })
            .collect();
        let resident_bytes = dense_bytes + plans.iter().map(|l| l.resident_bytes).sum::<u64>();
        let params_total = dense_params + (moe_layers.len() * e * 3 * h * i) as u64;
        Ok(Plan {
            format: crate::store::plan::FORMAT.to_string(),
            version: crate::store::plan::VERSION,
            model_type: self.model_type().to_string(),
            source: format!("synthetic {}", self.name),
            budget_bits: resident_bytes as f64 * 8.0 / params_total as f64,
            budget_bytes: resident_bytes,
            params_total,
            dense_codec: Codec::Bf16,
            groups: Default::default(),
            shadow: None,
            dense_bytes,
            resident_bytes,
            reservoir_bytes: 0,
            unspent_bytes: 0,
            layers: plans,
            rounds: serde_json::json!({
                "scope": "model",
                "synthetic": {
                    "like": self.name,
                    "rung": rung.name(),
                    "generator": synth_vq::GENERATOR,
                    "seed": seed,
                    "note": "every layer at one rung, every expert resident: no allocation ran",
                },
            }),
        })
    }
}

/// The most layers `n` in `1..=layers` with `bytes(n) ≤ budget`; 0 if none.
fn most_layers(
    layers: usize,
    budget: u64,
    bytes: impl Fn(usize) -> Result<u64, Error>,
) -> Result<usize, Error> {
    for n in (1..=layers).rev() {
        if bytes(n)? <= budget {
            return Ok(n);
        }
    }
    Ok(0)
}

/// Standard deviation of the random dense (and bf16 expert) weights.
const STD: f32 = 0.02;

/// The salt of tensor `name`'s generator under `seed`.
fn salt(name: &str, seed: u64) -> u64 {
    name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// bf16 little-endian bytes of tensor `name`: ones for norms, else uniform with
/// standard deviation 0.02 from a generator seeded by `seed` and the name.
fn tensor_bytes(name: &str, n: usize, seed: u64) -> Vec<u8> {
    if name.ends_with("norm.weight") {
        return bf16::ONE.to_le_bytes().repeat(n);
    }
    let mut rng = Rng::seeded(salt(name, seed));
    let half_width = STD * 3f32.sqrt();
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        let v = (2.0 * rng.uniform() - 1.0) * half_width;
        out.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
    }
    out
}

/// Values in each independently seeded chunk of a tensor of `dense.safetensors`, so that
/// one tensor is made on many threads, with the same bytes whatever their number.
const CHUNK: usize = 1 << 20;

/// bf16 little-endian bytes of values `chunk × CHUNK ..` (at most [`CHUNK`], at most
/// `n` in all) of tensor `name`: ones for norms, else uniform with standard deviation
/// 0.02, as [`tensor_bytes`] makes them, from a generator seeded by `seed`, the name and
/// the chunk, 16 bits of each 64-bit output per value (bf16 keeps 8).
fn dense_chunk(name: &str, n: usize, chunk: usize, seed: u64) -> Vec<u8> {
    let len = CHUNK.min(n - chunk * CHUNK);
    if name.ends_with("norm.weight") {
        return bf16::ONE.to_le_bytes().repeat(len);
    }
    // A value depends on its 16 random bits alone: look it up rather than convert.
    static VALUES: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    let values = VALUES.get_or_init(|| {
        let half_width = STD * 3f32.sqrt();
        (0..1u32 << 16)
            .map(|r| {
                let unit = (r as f32 + 0.5) / 65536.0;
                bf16::from_f32((2.0 * unit - 1.0) * half_width).to_bits()
            })
            .collect()
    });
    let mut rng =
        Rng::seeded(salt(name, seed) ^ (chunk as u64).wrapping_mul(0xa076_1d64_78bd_642f));
    let mut out = Vec::with_capacity(2 * len + 8);
    for _ in 0..len.div_ceil(4) {
        let r = rng.next_u64();
        let four = (0..4).fold(0u64, |w, k| {
            w | (values[((r >> (16 * k)) & 0xffff) as usize] as u64) << (16 * k)
        });
        out.extend_from_slice(&four.to_le_bytes());
    }
    out.truncate(2 * len);
    out
}

/// Writes `dense.safetensors` of a `layers`-layer model of `shape` to `path`
/// atomically, a few chunks per thread at a time; `progress(bytes)` after each batch.
/// Returns the tensor count and the file's size.
fn write_dense(
    shape: &Shape,
    layers: usize,
    seed: u64,
    path: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<(usize, u64), store::Error> {
    let tensors = shape.dense_layout(layers);
    let header = store::base::safetensors_header(path, &tensors)?;
    let jobs: Vec<(usize, usize)> = tensors
        .iter()
        .enumerate()
        .flat_map(|(t, (_, _, _, bytes))| (0..(bytes / 2).div_ceil(CHUNK)).map(move |c| (t, c)))
        .collect();
    let batch = 2 * rayon::current_num_threads().max(1);
    let io = |source| store::Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut written = (8 + header.len()) as u64;
    atomic::create_output(path, |file| {
        // Chunks of 2 MB go to the file unbuffered; small tensors are gathered.
        let mut out = BufWriter::with_capacity(256 << 10, file);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(&header).map_err(io)?;
        store::synth::pipelined(
            jobs.len().div_ceil(batch),
            |k| {
                jobs[k * batch..jobs.len().min((k + 1) * batch)]
                    .par_iter()
                    .map(|&(t, c)| dense_chunk(&tensors[t].0, tensors[t].3 / 2, c, seed))
                    .collect::<Vec<_>>()
            },
            |_, chunks| {
                for c in chunks {
                    out.write_all(&c).map_err(io)?;
                    written += c.len() as u64;
                }
                progress(written);
                Ok(())
            },
        )?;
        out.flush().map_err(io)
    })?;
    Ok((tensors.len(), written))
}

/// What [`synth_converted`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConvertedReport {
    /// Output directory.
    pub dir: PathBuf,
    /// Decoder layers written.
    pub layers: usize,
    /// Tensors in `dense.safetensors`.
    pub dense_tensors: usize,
    /// Size of `dense.safetensors`.
    pub dense_bytes: u64,
    /// Wall time of `dense.safetensors`.
    pub dense_seconds: f64,
    /// The expert stores.
    pub stores: Vec<store::synth::Written>,
    /// Wall time of the whole directory.
    pub seconds: f64,
}

impl ConvertedReport {
    /// Bytes of `dense.safetensors` and the stores.
    pub fn bytes(&self) -> u64 {
        self.dense_bytes + self.stores.iter().map(|s| s.bytes).sum::<u64>()
    }
}

/// The layer count asked for, checked against the shape.
fn layer_count(shape: &Shape, layers: Option<usize>, out: &Path) -> Result<usize, Error> {
    let layers = layers.unwrap_or(shape.layers);
    if layers == 0 || layers > shape.layers {
        return Err(crate::checkpoint::Error::InvalidField {
            path: out.to_path_buf(),
            field: "layers".into(),
            reason: format!("{layers} layers asked of a {}-layer model", shape.layers),
        }
        .into());
    }
    Ok(layers)
}

/// Writes `config.json` of `layers` layers and the tokenizer files of `tokenizer_dir`.
fn write_config_and_tokenizer(
    shape: &Shape,
    layers: usize,
    tokenizer_dir: &Path,
    out: &Path,
) -> Result<(), Error> {
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        let src = tokenizer_dir.join(file);
        if src.exists() {
            let bytes = std::fs::read(&src).map_err(Error::io(&src))?;
            atomic::write_file(&out.join(file), &bytes)?;
        }
    }
    let config = serde_json::to_vec_pretty(&shape.config_json(layers)).expect("config serializes");
    atomic::write_file(&out.join("config.json"), &config)?;
    Ok(())
}

/// Writes a converted model directory of `shape` with its first `layers` layers (all if
/// `None`) into `out`: `config.json`, the tokenizer files of `tokenizer_dir`,
/// `dense.safetensors` with random bf16 weights and the expert stores at `bits` (2, 3,
/// 4; without 4, the low-bit stores stand alone) with random records, all from `seed`:
/// two runs with the same arguments write the same bytes (manifests aside, which carry
/// the time). `progress(done, total)` counts bytes.
///
/// Under the directory's exclusive lock: the stores' manifests are removed first and
/// written last, every file atomically, so an interrupted run leaves no store a later
/// run would trust. A directory that holds a Hugging Face checkpoint or a compressed
/// model is refused: loaders would read those instead.
pub fn synth_converted(
    shape: &Shape,
    layers: Option<usize>,
    bits: &[u32],
    tokenizer_dir: &Path,
    out: &Path,
    seed: u64,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ConvertedReport, Error> {
    let start = Instant::now();
    let layers = layer_count(shape, layers, out)?;
    if bits.is_empty() {
        return Err(store::Error::BadShape {
            reason: "no expert precision asked for".into(),
        }
        .into());
    }
    if let Some(&b) = bits
        .iter()
        .find(|b| !store::layout::SUPPORTED_BITS.contains(b))
    {
        return Err(store::Error::UnsupportedBits { bits: b }.into());
    }
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    for other in [
        "model.safetensors",
        "model.safetensors.index.json",
        store::compressed::MANIFEST_FILE,
    ] {
        if out.join(other).exists() {
            return Err(crate::checkpoint::Error::InvalidField {
                path: out.join(other),
                field: "out".into(),
                reason: "the output directory holds another model, which loaders would read \
                         instead of the synthetic one; choose another directory"
                    .into(),
            }
            .into());
        }
    }
    let total = shape.converted_bytes(layers, bits)? as usize;
    let _lock = atomic::lock_exclusive(out)?;
    store::synth::prepare(out, bits)?;
    write_config_and_tokenizer(shape, layers, tokenizer_dir, out)?;
    let (dense_tensors, dense_bytes) =
        write_dense(shape, layers, seed, &out.join(DENSE_FILE), &mut |done| {
            progress(done as usize, total)
        })?;
    let dense_seconds = start.elapsed().as_secs_f64();
    let spec = shape.expert_spec(layers, seed);
    let record_bytes: u64 = {
        let mut b = bits.to_vec();
        b.sort_unstable();
        b.dedup();
        b.iter()
            .map(|&b| store::Layout::new(b, shape.hidden, shape.moe_intermediate))
            .map(|l| l.map(|l| l.record_size as u64))
            .sum::<Result<u64, _>>()?
    };
    let stores = store::synth::write_stores(out, &spec, bits, &mut |done, _| {
        progress((dense_bytes + done as u64 * record_bytes) as usize, total)
    })?;
    Ok(ConvertedReport {
        dir: out.to_path_buf(),
        layers,
        dense_tensors,
        dense_bytes,
        dense_seconds,
        stores,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// What [`synth_compressed`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CompressedReport {
    /// Output directory.
    pub dir: PathBuf,
    /// Decoder layers written.
    pub layers: usize,
    /// Tensors in `dense.safetensors`.
    pub dense_tensors: usize,
    /// Size of `dense.safetensors`.
    pub dense_bytes: u64,
    /// Wall time of `dense.safetensors`.
    pub dense_seconds: f64,
    /// The VQ expert store.
    pub store: synth_vq::Written,
    /// Resident bits per weight of the plan (every parameter counted).
    pub resident_bits: f64,
    /// Wall time of the whole directory.
    pub seconds: f64,
}

impl CompressedReport {
    /// Bytes of `dense.safetensors` and the store.
    pub fn bytes(&self) -> u64 {
        self.dense_bytes + self.store.bytes
    }
}

/// Refuses an output directory that holds a model `synth_compressed` did not write
/// (a checkpoint, a converted directory, a compressed checkpoint or the journal of one
/// being compressed): its files would be mixed with the synthetic ones or deleted.
fn check_compressed_out(out: &Path) -> Result<(), Error> {
    let refuse = |path: PathBuf, what: &str| -> Error {
        crate::checkpoint::Error::InvalidField {
            path,
            field: "out".into(),
            reason: format!(
                "the output directory holds {what}, which a synthetic compressed model would \
                 be mixed with; choose another directory"
            ),
        }
        .into()
    };
    for (file, what) in [
        ("model.safetensors", "a checkpoint"),
        ("model.safetensors.index.json", "a checkpoint"),
        ("probes.jsonl", "the probe journal of `dynmoe compress`"),
    ] {
        if out.join(file).exists() {
            return Err(refuse(out.join(file), what));
        }
    }
    if store::is_converted(out) {
        return Err(refuse(
            out.to_path_buf(),
            "a converted model's expert stores",
        ));
    }
    let manifest = out.join(compressed::MANIFEST_FILE);
    if manifest.exists() {
        let text = std::fs::read(&manifest).map_err(Error::io(&manifest))?;
        let synthetic = serde_json::from_slice::<serde_json::Value>(&text)
            .is_ok_and(|v| v.get("generator").is_some_and(|g| !g.is_null()));
        if !synthetic {
            return Err(refuse(manifest, "a compressed checkpoint"));
        }
    }
    Ok(())
}

/// Writes a compressed model directory (`store::compressed`) of `shape` with its first
/// `layers` layers (all if `None`) into `out`, every MoE layer's routed experts at `rung`
/// and resident: `config.json`, the tokenizer files of `tokenizer_dir`,
/// `dense.safetensors` with random bf16 weights (as [`synth_converted`] writes it), the
/// store `experts-vq{bits}.bin` of random records (`store::synth_vq`), `plan.json`, and
/// `compressed.json` naming the generator and seed, all from `seed`: two runs with the
/// same arguments write the same bytes (the store's manifest aside, which carries the
/// time). `progress(done, total)` counts bytes.
///
/// Under the directory's exclusive lock: `compressed.json` is removed first and written
/// last, every file atomically, so an interrupted run leaves no directory a loader would
/// take for a model. Stores of other rungs a previous run left are removed. A directory
/// that holds another model is refused ([`check_compressed_out`]).
pub fn synth_compressed(
    shape: &Shape,
    layers: Option<usize>,
    rung: Rung,
    tokenizer_dir: &Path,
    out: &Path,
    seed: u64,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CompressedReport, Error> {
    let start = Instant::now();
    let layers = layer_count(shape, layers, out)?;
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    check_compressed_out(out)?;
    let total = shape.compressed_bytes(layers, rung)? as usize;
    let plan = shape.vq_plan(layers, rung, seed)?;
    let _lock = atomic::lock_exclusive(out)?;
    atomic::remove_stale_temps(out)?;
    atomic::remove_committed(&out.join(compressed::MANIFEST_FILE))?;
    for other in LADDER.iter().filter(|r| **r != rung) {
        atomic::remove_committed(&out.join(vq::manifest_file_name(*other)))?;
        atomic::remove_committed(&out.join(vq::data_file_name(*other)))?;
    }
    write_config_and_tokenizer(shape, layers, tokenizer_dir, out)?;
    let (dense_tensors, dense_bytes) =
        write_dense(shape, layers, seed, &out.join(DENSE_FILE), &mut |done| {
            progress(done as usize, total)
        })?;
    let dense_seconds = start.elapsed().as_secs_f64();
    let spec = shape.expert_spec(layers, seed);
    let record_size = vq::VqLayout::new(rung, shape.hidden, shape.moe_intermediate)?.record_size;
    let store = synth_vq::write_store(out, &spec, rung, &mut |done, _| {
        progress((dense_bytes as usize) + done * record_size, total)
    })?;
    let plan_path = out.join(PLAN_FILE);
    plan.save(&plan_path).map_err(|e| match e {
        PlanError::Store(e) => Error::from(e),
        other => Error::Config(other.to_string()),
    })?;
    let plan_bytes = std::fs::read(&plan_path).map_err(Error::io(&plan_path))?;
    let manifest = compressed::Manifest {
        format: compressed::FORMAT.to_string(),
        version: compressed::VERSION,
        source: format!("synthetic {}", shape.name),
        source_fingerprint: spec.source_of(synth_vq::GENERATOR).fingerprint,
        plan_checksum: compressed::checksum(&plan_bytes),
        dense_bytes,
        stores: [(rung.name(), spec.layers.clone())].into(),
        dense_vq: Vec::new(),
        generator: Some(Generator {
            name: synth_vq::GENERATOR.to_string(),
            seed,
        }),
    };
    compressed::write_manifest(out, &manifest)?;
    Ok(CompressedReport {
        dir: out.to_path_buf(),
        layers,
        dense_tensors,
        dense_bytes,
        dense_seconds,
        store,
        resident_bits: plan.resident_bits(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Writes a random checkpoint of `shape` with its first `layers` layers (all if `None`)
/// into `out`, with the tokenizer files of `tokenizer_dir`. `progress(done, total)`
/// counts shards.
pub fn synth(
    shape: &Shape,
    layers: Option<usize>,
    tokenizer_dir: &Path,
    out: &Path,
    seed: u64,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SynthReport, Error> {
    let layers = layer_count(shape, layers, out)?;
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let index_path = out.join("model.safetensors.index.json");
    // The index is the commit mark: gone until every shard is in place.
    atomic::remove_committed(&index_path)?;
    write_config_and_tokenizer(shape, layers, tokenizer_dir, out)?;

    let shards: Vec<Option<usize>> = (0..layers).map(Some).chain([None]).collect();
    let mut weight_map = BTreeMap::new();
    let (mut params, mut bytes) = (0, 0);
    for (k, &layer) in shards.iter().enumerate() {
        let file = match layer {
            Some(l) => format!("model-layer-{l:03}.safetensors"),
            None => "model-rest.safetensors".to_string(),
        };
        let tensors = shape.tensors(layer);
        let data: Vec<Vec<u8>> = tensors
            .par_iter()
            .map(|(name, dims)| tensor_bytes(name, dims.iter().product(), seed))
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .zip(&data)
            .map(|((name, dims), d)| {
                let v = TensorView::new(Dtype::BF16, dims.clone(), d).expect("sizes agree");
                (name.clone(), v)
            })
            .collect();
        let path = out.join(&file);
        let serialized = safetensors::serialize(views, None).map_err(|e| {
            crate::checkpoint::Error::Safetensors {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
        atomic::write_file(&path, &serialized)?;
        for (name, dims) in &tensors {
            params += dims.iter().product::<usize>();
            weight_map.insert(name.clone(), file.clone());
        }
        bytes += serialized.len();
        progress(k + 1, shards.len());
    }
    let index = serde_json::json!({
        "metadata": {"total_size": bytes},
        "weight_map": weight_map,
    });
    atomic::write_file(
        &index_path,
        &serde_json::to_vec_pretty(&index).expect("index serializes"),
    )?;
    Ok(SynthReport {
        dir: out.to_path_buf(),
        layers,
        params,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::config::Config;
    use crate::checkpoint::Checkpoint;
    use crate::testing::{fixture, TempDir};

    /// A shrunken Qwen3-30B-A3B shape, which the other families' small shapes start from.
    const SMALL: Shape = Shape {
        name: "small",
        family: Family::Qwen3Moe,
        hidden: 64,
        moe_intermediate: 64,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        experts: 8,
        top_k: 2,
        vocab: 8192,
        rope_theta: 1e6,
    };

    /// A two-layer checkpoint of [`SMALL`] loads, runs, and is the same bytes when
    /// written twice.
    #[test]
    fn a_small_shape_round_trips_through_the_loader() {
        let s = SMALL;
        let (a, b) = (TempDir::new("synth-a"), TempDir::new("synth-b"));
        let tok = fixture("small-moe");
        let r = synth(&s, Some(2), &tok, a.dir(), 7, &mut |_, _| {}).unwrap();
        synth(&s, Some(2), &tok, b.dir(), 7, &mut |_, _| {}).unwrap();
        assert_eq!(r.layers, 2);
        let c = Config::from_file(&a.path("config.json")).unwrap();
        assert_eq!((c.layers.len(), c.hidden_size, c.moe.top_k), (2, 64, 2));
        let ckpt = Checkpoint::open(a.dir()).unwrap();
        assert_eq!(ckpt.names().len(), 3 + 2 * (9 + 3 * 8));
        for f in ["model-layer-001.safetensors", "model-rest.safetensors"] {
            assert_eq!(
                std::fs::read(a.path(f)).unwrap(),
                std::fs::read(b.path(f)).unwrap(),
                "{f}"
            );
        }
        let m = crate::model::load(a.dir(), crate::backend::Cpu::fast()).unwrap();
        let mut state = m.model.new_state(8);
        let logits = m.model.forward(&mut state, &[1, 2, 3], 2).unwrap();
        assert!(logits.len() == 8192 && logits.iter().all(|v| v.is_finite()));
    }

    /// Small shapes of GLM-4.5 (a leading dense layer, shared experts, the grouped
    /// sigmoid router, q/k/v bias, partial rotary) and DeepSeek-V3 (latent attention with
    /// YaRN besides) written as a checkpoint, a converted and a compressed directory:
    /// each loads and runs.
    #[test]
    fn small_glm_and_deepseek_shapes_run_in_every_directory_kind() {
        let glm = Shape {
            name: "small-glm",
            family: Family::Glm4Moe {
                leading_dense: 1,
                dense_intermediate: 128,
                shared_experts: 1,
                scale: 2.5,
                qk_norm: true,
            },
            layers: 3,
            ..SMALL
        };
        let deepseek = Shape {
            name: "small-deepseek",
            family: Family::DeepseekV3 {
                leading_dense: 1,
                dense_intermediate: 128,
                groups: [4, 2],
                scale: 2.5,
                mla: MlaShape {
                    q_lora: 64,
                    kv_lora: 64,
                    nope: 16,
                    rope: 8,
                    v: 16,
                },
                yarn: [4.0, 512.0, 32.0, 1.0],
            },
            heads: 4,
            kv_heads: 4,
            head_dim: 24,
            ..glm
        };
        for s in [glm, deepseek] {
            small_shape_runs(&s);
        }
    }

    fn small_shape_runs(s: &Shape) {
        let tok = fixture("small-moe");
        let (a, b, c) = (
            TempDir::new("synth-small"),
            TempDir::new("synth-small-converted"),
            TempDir::new("synth-small-compressed"),
        );
        synth(s, None, &tok, a.dir(), 3, &mut |_, _| {}).unwrap();
        let config = Config::from_file(&a.path("config.json")).unwrap();
        assert_eq!(config.arch.model_type(), s.model_type());
        assert_eq!(config.moe_layers().collect::<Vec<_>>(), vec![1, 2]);
        synth_converted(s, None, &[4, 2], &tok, b.dir(), 3, &mut |_, _| {}).unwrap();
        let rung = Rung::parse("vq2").unwrap();
        synth_compressed(s, None, rung, &tok, c.dir(), 3, &mut |_, _| {}).unwrap();
        for dir in [a.dir(), b.dir(), c.dir()] {
            let m = crate::model::load(dir, crate::backend::Cpu::fast())
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            let mut state = m.model.new_state(8);
            let logits = m.model.forward(&mut state, &[1, 2, 3], 2).unwrap();
            assert!(logits.len() == 8192 && logits.iter().all(|v| v.is_finite()));
        }
    }

    #[test]
    fn known_shapes_have_their_published_sizes() {
        // Total and active parameters as the models' cards give them, in billions: a
        // mistyped field of a shape moves one or the other by more than the tolerance
        // (2%; 5% for Kimi-K2's card, which rounds to "1T" and "32B"). Z.ai's cards count
        // active parameters without the embedding and LM head, the others with them.
        for (name, total, active, active_counts_embeddings, tolerance) in [
            ("qwen3-30b-a3b", 30.5, 3.3, true, 0.02),
            ("qwen3-235b-a22b", 235.0, 22.0, true, 0.02),
            ("qwen3-coder-480b-a35b", 480.0, 35.0, true, 0.02),
            ("glm-4.5", 355.0, 32.0, false, 0.02),
            ("glm-4.5-air", 106.0, 12.0, false, 0.02),
            ("deepseek-v3", 671.0, 37.0, true, 0.02),
            ("kimi-k2", 1000.0, 32.0, true, 0.05),
        ] {
            let s = shape(name).unwrap();
            let count = |t: Vec<(String, Vec<usize>)>| -> usize {
                t.iter().map(|(_, d)| d.iter().product::<usize>()).sum()
            };
            let experts = 3 * s.hidden * s.moe_intermediate;
            let moe = s.moe_layers(s.layers);
            let layers: usize = (0..s.layers).map(|l| count(s.tensors(Some(l)))).sum();
            let rest = count(s.tensors(None));
            let all = (layers + rest) as f64 / 1e9;
            let idle = moe.len() * (s.experts - s.top_k) * experts;
            let counted_rest = if active_counts_embeddings { rest } else { 0 };
            let on = (layers - idle + counted_rest) as f64 / 1e9;
            assert!((all / total - 1.0).abs() < tolerance, "{name}: {all:.1} B");
            assert!(
                (on / active - 1.0).abs() < tolerance,
                "{name}: {on:.1} B active"
            );
        }
    }

    #[test]
    fn unknown_shapes_and_layer_counts_are_refused() {
        let e = shape("qwen9").unwrap_err().to_string();
        assert!(e.contains("qwen3-30b-a3b"), "{e}");
        let dir = TempDir::new("synth-bad");
        let s = shape("qwen3-30b-a3b").unwrap();
        let e = synth(
            &s,
            Some(49),
            &fixture("small-moe"),
            dir.dir(),
            0,
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("49 layers"), "{e}");
    }
}
