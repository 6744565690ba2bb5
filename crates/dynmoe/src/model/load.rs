//! Opening a model directory on a backend: a Hugging Face checkpoint, a converted
//! directory whose experts are read from their expert stores, or a compressed directory
//! that runs its plan's codecs. Stores a codec asks for are built on first use.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::{weights, Codecs, Error, ExpertBits, LoadedModel, Model};
use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, Config, Tokenizer};
use crate::codec::vq::Rung;
use crate::codec::Codec;
use crate::store::dense_vq::{self, vq_layers, CodedLayers, GroupCodecs};
use crate::store::plan::Plan;
use crate::store::vq_encode::VqExperts;
use crate::store::{compressed, ExpertStore};

/// Loads config, weights and tokenizer from a model directory: a Hugging Face checkpoint,
/// or a converted directory whose experts are read from their 4-bit store (in a
/// directory without one, from its most precise store: see `store::default_bits`).
pub fn load<B: Backend>(dir: &Path, backend: B) -> Result<LoadedModel<B>, Error> {
    load_with(dir, backend, &ExpertBits::default())
}

/// [`load`], with the routed experts of a converted directory at `bits` (stores at 3
/// and 2 bits are built from the 4-bit one if they are missing or unusable).
pub fn load_with<B: Backend>(
    dir: &Path,
    backend: B,
    bits: &ExpertBits,
) -> Result<LoadedModel<B>, Error> {
    load_with_codecs(dir, backend, &Codecs::from(bits))
}

/// [`load`], with each MoE layer's routed experts in the codec `codecs` asks for.
pub fn load_with_codecs<B: Backend>(
    dir: &Path,
    backend: B,
    codecs: &Codecs,
) -> Result<LoadedModel<B>, Error> {
    load_with_progress(dir, backend, codecs, &mut |_, _| {})
}

/// [`load_with_codecs`], calling `progress(done, total)` with the expert records written
/// while a VQ expert store is built (a one-time cost of the first load at a rung), and
/// with the dense weights coded.
pub fn load_with_progress<B: Backend>(
    dir: &Path,
    backend: B,
    codecs: &Codecs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedModel<B>, Error> {
    use crate::codec::Codec;
    if crate::store::compressed::is_compressed(dir) {
        if codecs != &Codecs::default() {
            return Err(Error::Config(format!(
                "{} is a compressed model: it runs the codecs of its plan.json",
                dir.display()
            )));
        }
        return Ok(load_compressed(dir, backend)?.0);
    }
    let config = Config::from_file(&dir.join("config.json"))?;
    let checkpoint = Checkpoint::open(dir)?;
    let converted = crate::store::is_converted(dir);
    let mut bits = ExpertBits {
        default: converted.then(|| crate::store::default_bits(dir)),
        ..ExpertBits::default()
    };
    let mut rungs = BTreeMap::new();
    for layer in config.moe_layers() {
        let refuse = |codec, why: &str| Error::Codec {
            dir: dir.to_path_buf(),
            layer,
            codec,
            why: why.to_string(),
        };
        match codecs.of(layer) {
            None => {}
            Some(Codec::Affine { bits: b }) => {
                if !converted {
                    return Err(Error::NoExpertStore {
                        dir: dir.to_path_buf(),
                    });
                }
                bits.per_layer.insert(layer, b);
            }
            Some(c @ Codec::Vq { .. }) => {
                if converted {
                    return Err(refuse(
                        c,
                        "VQ rungs are encoded from the bf16 experts of a Hugging Face checkpoint, \
                         and a converted directory keeps only the 4-bit store",
                    ));
                }
                let rung = c
                    .rung()
                    .map_err(|e| refuse(c, &e.to_string()))?
                    .expect("a VQ codec has a rung");
                rungs.insert(layer, rung);
            }
            Some(Codec::Bf16) if converted => {
                return Err(refuse(
                    Codec::Bf16,
                    "a converted directory keeps its experts in the 4-bit store",
                ))
            }
            Some(Codec::Bf16) => {}
        }
    }
    let stores = if converted {
        Some(open_stores(dir, &config, &bits)?)
    } else {
        None
    };
    let vq = stored_vq_experts(dir, &config, &checkpoint, &rungs, progress)?;
    let coded = coded_layers(
        dir,
        &checkpoint,
        &config,
        &codecs.groups(),
        converted,
        progress,
    )?;
    let model = Model::load(config, &checkpoint, stores, &vq, &coded, backend)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        model,
        tokenizer,
    })
}

/// The tensors of the checkpoint in `dir` that `codecs` codes (embeddings, LM head,
/// dense linear layers; none for bf16): at a VQ rung from the coded files beside it,
/// encoded on first use; at an affine width quantized from the checkpoint's values, which
/// a converted directory (`converted`) keeps too.
pub fn coded_layers(
    dir: &Path,
    ckpt: &Checkpoint,
    config: &Config,
    codecs: &GroupCodecs,
    converted: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CodedLayers, Error> {
    use crate::codec::Codec;
    use crate::store::dense_vq;
    let mut out = CodedLayers::new();
    for (codec, weights) in codecs.tensors(ckpt, config)? {
        match codec {
            Codec::Affine { bits } => {
                out.extend(dense_vq::quantize_affine(ckpt, bits, &weights, progress)?)
            }
            _ => {
                if converted {
                    return Err(Error::Config(format!(
                        "{}: layers at {codec} are encoded from a Hugging Face checkpoint's \
                         bf16 weights; a converted directory holds none",
                        dir.display()
                    )));
                }
                let rung = dense_vq::rung_of(codec)
                    .map_err(Error::Config)?
                    .expect("a VQ codec is coded into a file");
                let coded = dense_vq::ensure(dir, ckpt, rung, &weights, progress)?;
                out.extend(vq_layers(coded));
            }
        }
    }
    Ok(out)
}

/// The VQ experts of the layers in `rungs` (decoder layer → rung), read from the VQ
/// expert stores of the checkpoint directory `dir`: encoded once, on the first load that
/// asks for a layer at a rung, and reused by every later one (see `store::vq`);
/// `progress(done, total)` counts the records written while building.
pub fn stored_vq_experts(
    dir: &Path,
    config: &Config,
    ckpt: &Checkpoint,
    rungs: &BTreeMap<usize, crate::codec::vq::Rung>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BTreeMap<usize, VqExperts>, Error> {
    if rungs.is_empty() {
        return Ok(BTreeMap::new());
    }
    let ensured = crate::store::vq::ensure(dir, config, ckpt, rungs, progress)?;
    Ok(ensured
        .stores
        .into_iter()
        .map(|(layer, store)| (layer, VqExperts::Stored { store, layer }))
        .collect())
}

/// The expert store each MoE layer reads, built where missing.
fn open_stores(
    dir: &Path,
    config: &Config,
    bits: &ExpertBits,
) -> Result<weights::LayerStores, Error> {
    let mut wanted: Vec<u32> = Vec::new();
    for layer in config.moe_layers() {
        let b = bits.of(layer);
        if !matches!(b, 2..=4) {
            return Err(Error::ExpertBits { layer, bits: b });
        }
        if !wanted.contains(&b) {
            wanted.push(b);
        }
    }
    // Opening checks a store (manifest, size, a byte-for-byte spot check); only the
    // derived stores that fail it are built, together, and opened again.
    let mut opened = BTreeMap::new();
    let mut missing = Vec::new();
    for &b in &wanted {
        match ExpertStore::open(dir, b) {
            Ok(store) => {
                opened.insert(b, Arc::new(store));
            }
            Err(_) if b < 4 => missing.push(b),
            Err(e) => return Err(e.into()),
        }
    }
    if !missing.is_empty() {
        crate::store::lowbit::ensure_many(dir, &missing)?;
        for b in missing {
            opened.insert(b, Arc::new(ExpertStore::open(dir, b)?));
        }
    }
    Ok(config
        .moe_layers()
        .map(|layer| (layer, opened[&bits.of(layer)].clone()))
        .collect())
}

/// Loads the compressed model in `dir` on `backend`, every expert routable; returns it
/// with its plan (whose resident sets `runtime::residency` installs).
pub fn load_compressed<B: Backend>(
    dir: &Path,
    backend: B,
) -> Result<(LoadedModel<B>, Plan), Error> {
    let (manifest, plan) = compressed::open(dir)?;
    let config = Config::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(dir)?;
    let mut vq = BTreeMap::new();
    for (name, layers) in &manifest.stores {
        let rung = Rung::parse(name).map_err(|source| Error::Encode {
            tensor: format!("{} store {name}", dir.display()),
            source,
        })?;
        let store = std::sync::Arc::new(crate::store::vq::VqStore::open_encoded_from(
            dir,
            rung,
            &manifest.source_fingerprint,
        )?);
        for &layer in layers {
            vq.insert(
                layer,
                VqExperts::Stored {
                    store: store.clone(),
                    layer,
                },
            );
        }
    }
    // Groups at VQ rungs are read from their rung's coded file, and must be coded at the
    // rung the plan gives them; groups at an affine width are quantized from the bf16
    // copy in dense.safetensors.
    let codecs = plan.group_codecs();
    let mut dense = CodedLayers::new();
    for name in &manifest.dense_vq {
        let rung = Rung::parse(name).map_err(|source| Error::Encode {
            tensor: format!("{} dense_vq {name}", dir.display()),
            source,
        })?;
        let path = dir.join(dense_vq::file_name(rung));
        for (tensor, m) in dense_vq::read(&path, rung, &manifest.source_fingerprint)? {
            let planned = codecs.of_tensor(&tensor, &[m.rows, m.cols], &config);
            if planned.and_then(|c| c.rung().ok().flatten()) != Some(rung) {
                return Err(Error::Config(format!(
                    "{}: {tensor} is coded at {name}, but plan.json gives it {}",
                    path.display(),
                    planned.map_or("bf16".to_string(), |c| c.to_string())
                )));
            }
            dense.insert(tensor, dense_vq::CodedWeight::Vq(m));
        }
    }
    // What dense.safetensors still holds of a coded group is at an affine width; a group
    // the plan puts at a VQ rung is in its rung's file, not here.
    for (codec, weights) in codecs.tensors(&ckpt, &config)? {
        match codec {
            Codec::Affine { bits } => dense.extend(dense_vq::quantize_affine(
                &ckpt,
                bits,
                &weights,
                &mut |_, _| {},
            )?),
            _ => {
                return Err(Error::Config(format!(
                    "{}: {} is in dense.safetensors, but plan.json codes it at {codec}",
                    dir.display(),
                    weights[0].0
                )))
            }
        }
    }
    let model = Model::load(config, &ckpt, None, &vq, &dense, backend)?;
    Ok((
        LoadedModel {
            dir: dir.to_path_buf(),
            model,
            tokenizer: Tokenizer::from_dir(dir)?,
        },
        plan,
    ))
}
