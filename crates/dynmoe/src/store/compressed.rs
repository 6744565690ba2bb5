//! A compressed model directory: what `dynmoe compress -o OUT` leaves beside its plan, and
//! what `run`, `eval`, `chat` and `serve` load without the checkpoint it came from.
//!
//! - the checkpoint's `config.json` and tokenizer files;
//! - `dense.safetensors`: every tensor the plan keeps as the checkpoint has it (embeddings,
//!   attention, norms, routers, and the routed experts of layers the plan leaves bf16);
//! - one VQ expert store per rung the plan uses (`experts-vq{bits}.bin` and `.json`,
//!   [`super::vq`]), holding the layers at that rung;
//! - for each VQ rung the plan codes a tensor group at (its dense layers, embeddings, LM
//!   head), `dense-vq{bits}.safetensors` ([`super::dense_vq`]): those weights coded (and
//!   left out of `dense.safetensors`); groups at an affine width stay in
//!   `dense.safetensors` and are quantized at load;
//! - `plan.json` ([`crate::store::plan`]): per layer the codec and the resident experts;
//! - `compressed.json`, written last: what the directory holds, the source checkpoint's
//!   fingerprint the stores were encoded from, and a checksum of `plan.json`. Its presence
//!   marks a complete directory; it is removed first whenever the directory is rewritten.
//!
//! `model::synth::synth_compressed` (`dynmoe synth --vq`) writes the same directory with
//! random contents and no checkpoint: its stores' records come from a generator
//! ([`super::synth_vq`]), and the manifest says so (`generator`); its `source_fingerprint`
//! is then the generator's, seed's and shape's, which the stores name instead of a
//! checkpoint's. Loading checks it exactly as it checks a compressed checkpoint.
//!
//! `docs/FORMAT.md` §14 lists the fields.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::manifest::Generator;
use super::{atomic, base, tensors, Error, DENSE_FILE};
use crate::checkpoint::experts::expert_tensors;
use crate::checkpoint::{Checkpoint, Config};
use crate::codec::vq::codebook::fnv1a;
use crate::codec::vq::Rung;
use crate::store::{plan::Plan, plan::PLAN_FILE};

/// The manifest of a compressed directory, and its commit mark.
pub const MANIFEST_FILE: &str = "compressed.json";

/// `format` of the manifest.
pub const FORMAT: &str = "dynmoe-compressed-model";

/// Version this build writes. It reads version 1 too, whose `dense_vq` names one rung.
pub const VERSION: u32 = 2;

/// What a compressed directory holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The checkpoint directory compressed, as given (for a synthetic directory, the
    /// shape it copies: `synthetic qwen3-30b-a3b`).
    pub source: String,
    /// Its fingerprint (shard headers and `config.json`), or for a synthetic directory the
    /// fingerprint of its generator, seed and expert shape: what the VQ stores name.
    pub source_fingerprint: String,
    /// FNV-1a 64 of `plan.json`, hex.
    pub plan_checksum: String,
    /// Size in bytes of `dense.safetensors`.
    pub dense_bytes: u64,
    /// The VQ rungs whose stores the directory holds, by name (`vq1.5`), each with the
    /// decoder layers at that rung.
    pub stores: BTreeMap<String, Vec<usize>>,
    /// The rungs of the coded tensor groups' files (`dense-vq{bits}.safetensors`), by
    /// name: every VQ rung the plan codes a group outside the routed experts at.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "one_or_many"
    )]
    pub dense_vq: Vec<String>,
    /// Present only in a synthetic directory: the generator and seed its expert records
    /// were made by (`store::synth_vq::GENERATOR`); no checkpoint was compressed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator: Option<Generator>,
}

/// `dense_vq` as version 2 writes it (a list) or version 1 did (one name).
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

/// Whether `dir` is a complete compressed directory (its manifest exists).
pub fn is_compressed(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).exists()
}

/// The `plan_checksum` of a plan file's bytes.
pub(crate) fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a(bytes))
}

/// Writes `manifest` as `dir`'s `compressed.json`, atomically: the last step of writing a
/// directory, which makes it a compressed model. Call under the directory's exclusive
/// lock.
pub(crate) fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(manifest).expect("a manifest serialises");
    atomic::write_file(&dir.join(MANIFEST_FILE), text.as_bytes())
}

fn unusable(dir: &Path, reason: String) -> Error {
    Error::Unusable {
        path: dir.join(MANIFEST_FILE),
        reason,
    }
}

/// The rung of each VQ layer of `plan`, refusals naming the directory's manifest.
fn plan_rungs(plan: &Plan, out: &Path) -> Result<BTreeMap<usize, Rung>, Error> {
    plan.vq_rungs().map_err(|reason| unusable(out, reason))
}

/// Writes the compressed model `plan` describes into `out` (which holds `plan.json`
/// already), from the checkpoint at `src`. A complete earlier result is reused as it is:
/// VQ stores already in `out` are checked and kept ([`super::vq::ensure`]).
/// `progress(done, total)` counts expert records encoded.
pub fn write(
    src: &Path,
    out: &Path,
    plan: &Plan,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Manifest, Error> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let plan_bytes = std::fs::read(out.join(PLAN_FILE)).map_err(io(&out.join(PLAN_FILE)))?;
    let config = Config::from_file(&src.join("config.json"))?;
    let ckpt = Checkpoint::open(src)?;
    let rungs = plan_rungs(plan, out)?;
    // Tensor groups at VQ rungs go to their rung's coded file; those at an affine width
    // stay bf16 and are quantized at load.
    let mut coded: BTreeMap<String, (Rung, super::dense_vq::WeightShapes)> = BTreeMap::new();
    for (codec, weights) in plan.group_codecs().tensors(&ckpt, &config)? {
        if let Some(rung) = super::dense_vq::rung_of(codec).map_err(|r| unusable(out, r))? {
            coded.insert(rung.name(), (rung, weights));
        }
    }
    {
        let _lock = atomic::lock_exclusive(out)?;
        atomic::remove_stale_temps(out)?;
        atomic::remove_committed(&out.join(MANIFEST_FILE))?;
        base::copy_side_files(src, out)?;
        let mut skip = BTreeSet::new();
        for &layer in rungs.keys() {
            let (tensors, ..) = expert_tensors(&config, &ckpt, layer)?;
            skip.extend(tensors.tensor_names(config.moe.num_experts));
        }
        skip.extend(
            coded
                .values()
                .flat_map(|(_, w)| w.iter().map(|(name, _)| name.clone())),
        );
        base::write_dense(&ckpt, &skip, &out.join(DENSE_FILE))?;
    }
    // The stores name the checkpoint they were encoded from; `out` now has its config.
    // A complete earlier store or coded file is kept.
    super::vq::ensure(out, &config, &ckpt, &rungs, progress)?;
    for (rung, weights) in coded.values() {
        super::dense_vq::ensure(out, &ckpt, *rung, weights, progress)?;
    }
    let (fingerprint, _) = tensors::fingerprint(&ckpt, &src.join("config.json"))?;
    let mut stores: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (&layer, rung) in &rungs {
        stores.entry(rung.name()).or_default().push(layer);
    }
    let dense_path = out.join(DENSE_FILE);
    let manifest = Manifest {
        format: FORMAT.to_string(),
        version: VERSION,
        source: src.display().to_string(),
        source_fingerprint: fingerprint,
        plan_checksum: checksum(&plan_bytes),
        dense_bytes: std::fs::metadata(&dense_path)
            .map_err(io(&dense_path))?
            .len(),
        stores,
        dense_vq: coded.keys().cloned().collect(),
        generator: None,
    };
    let _lock = atomic::lock_exclusive(out)?;
    write_manifest(out, &manifest)?;
    Ok(manifest)
}

/// Reads and checks the manifest of `dir` against the files beside it; returns it with
/// the plan.
pub fn open(dir: &Path) -> Result<(Manifest, Plan), Error> {
    let path = dir.join(MANIFEST_FILE);
    let m: Manifest = super::manifest_from_value(&path, super::read_manifest_value(&path)?)?;
    let field = |field: &str, reason: String| Error::Manifest {
        path: path.clone(),
        field: field.to_string(),
        reason,
    };
    if m.format != FORMAT {
        return Err(field(
            "format",
            format!("is {:?}, expected {FORMAT:?}", m.format),
        ));
    }
    if !(1..=VERSION).contains(&m.version) {
        return Err(field(
            "version",
            format!("is {}, this build reads 1 to {VERSION}", m.version),
        ));
    }
    if let Some(g) = &m.generator {
        if g.name != super::synth_vq::GENERATOR {
            return Err(field(
                "generator",
                format!(
                    "names {:?}; this build makes and checks synthetic directories of {:?}",
                    g.name,
                    super::synth_vq::GENERATOR
                ),
            ));
        }
    }
    let plan_path = dir.join(PLAN_FILE);
    let plan_bytes = std::fs::read(&plan_path).map_err(|source| Error::Io {
        path: plan_path.clone(),
        source,
    })?;
    if checksum(&plan_bytes) != m.plan_checksum {
        return Err(field(
            "plan_checksum",
            format!(
                "is {}, {} hashes to {}: the plan changed after compression",
                m.plan_checksum,
                plan_path.display(),
                checksum(&plan_bytes)
            ),
        ));
    }
    let plan = Plan::load(&plan_path).map_err(|e| Error::Unusable {
        path: plan_path.clone(),
        reason: e.to_string(),
    })?;
    let dense = dir.join(DENSE_FILE);
    let found = std::fs::metadata(&dense)
        .map_err(|source| Error::Io {
            path: dense.clone(),
            source,
        })?
        .len();
    if found != m.dense_bytes {
        return Err(Error::Size {
            path: dense,
            expected: m.dense_bytes,
            found,
        });
    }
    let mut want: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (&layer, rung) in &plan_rungs(&plan, dir)? {
        want.entry(rung.name()).or_default().push(layer);
    }
    if want != m.stores {
        return Err(field(
            "stores",
            format!("is {:?}, the plan's VQ layers are {want:?}", m.stores),
        ));
    }
    let codecs = plan.group_codecs();
    let planned: BTreeSet<String> = std::iter::once(codecs.dense)
        .chain(codecs.groups.values().copied())
        .filter_map(|c| super::dense_vq::rung_of(c).ok().flatten())
        .map(|rung| rung.name())
        .collect();
    if let Some(extra) = m.dense_vq.iter().find(|r| !planned.contains(*r)) {
        return Err(field(
            "dense_vq",
            format!(
                "names {extra}, at which the plan codes no tensor group (its rungs: {planned:?})"
            ),
        ));
    }
    Ok((m, plan))
}
