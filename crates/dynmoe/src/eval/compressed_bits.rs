//! Bits per weight of a compressed model directory as it is: the bytes each group of
//! tensors takes in the directory's files (`dense.safetensors`, the coded dense layers,
//! the VQ expert stores) and what of them stays resident under its plan, over the
//! group's parameters. [`super::bits`] prices a checkpoint under codecs it is given; this
//! reads what `compress` wrote, so a compressed directory is not priced as bf16.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::Serialize;

use crate::checkpoint::arch::{classify, TensorKind};
use crate::checkpoint::{Checkpoint, Config};
use crate::codec::Codec;
use crate::model::Error;
use crate::store::compressed;
use crate::store::vq::VqLayout;

/// The groups bits are reported by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    /// Token embeddings.
    Embedding,
    /// An untied LM head.
    LmHead,
    /// Attention projections.
    Attention,
    /// Shared experts and the MLPs of dense layers.
    SharedAndDenseMlp,
    /// Routed experts: resident ones as resident, all of them on disk.
    RoutedExperts,
    /// Routers, norms and anything else kept as the checkpoint had it.
    RoutersAndNorms,
}

fn group_of(kind: TensorKind) -> Group {
    match kind {
        TensorKind::Embedding => Group::Embedding,
        TensorKind::LmHead => Group::LmHead,
        TensorKind::Attention => Group::Attention,
        TensorKind::SharedExperts | TensorKind::DenseMlp => Group::SharedAndDenseMlp,
        TensorKind::RoutedExperts => Group::RoutedExperts,
        TensorKind::Router | TensorKind::Norm | TensorKind::Other => Group::RoutersAndNorms,
    }
}

/// One group's parameters and bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GroupBits {
    /// Parameters (weights) of the group.
    pub params: u64,
    /// Bytes resident while the model runs.
    pub resident_bytes: u64,
    /// Bytes in the directory's files.
    pub disk_bytes: u64,
    /// `resident_bytes × 8 / params`.
    pub resident_bits: f64,
    /// `disk_bytes × 8 / params`.
    pub disk_bits: f64,
}

/// A compressed directory's bits per weight, by group and over the whole model.
#[derive(Debug, Clone, Serialize)]
pub struct CompressedBits {
    /// By group.
    pub groups: BTreeMap<Group, GroupBits>,
    /// The whole model: every group summed (codebooks apart).
    pub total: GroupBits,
    /// Codebooks of the VQ rungs in use, resident once each, not in any group.
    pub codebook_bytes: u64,
}

/// The JSON header of a safetensors file, read without its data.
fn safetensors_header(path: &Path) -> Result<serde_json::Value, Error> {
    let bad = |reason: String| -> Error {
        crate::checkpoint::Error::Safetensors {
            path: path.to_path_buf(),
            reason,
        }
        .into()
    };
    let mut f = std::fs::File::open(path).map_err(Error::io(path))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(Error::io(path))?;
    let len = u64::from_le_bytes(len);
    if len > f.metadata().map_err(Error::io(path))?.len() {
        return Err(bad(format!("header length {len} exceeds the file")));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(Error::io(path))?;
    serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))
}

fn codec_err(what: &str) -> impl FnOnce(crate::codec::CodecError) -> Error + '_ {
    move |source| Error::Encode {
        tensor: what.to_string(),
        source,
    }
}

/// Reads the compressed directory at `dir` and accounts for its bytes.
pub fn compressed_bits(dir: &Path) -> Result<CompressedBits, Error> {
    let (manifest, plan) = compressed::open(dir)?;
    let config = Config::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(dir)?;
    let mut groups: BTreeMap<Group, GroupBits> = BTreeMap::new();
    let mut add = |g: Group, params: u64, resident: u64, disk: u64| {
        let e = groups.entry(g).or_default();
        e.params += params;
        e.resident_bytes += resident;
        e.disk_bytes += disk;
    };
    let by_layer: BTreeMap<usize, _> = plan.layers.iter().map(|l| (l.layer, l)).collect();
    let codecs = plan.group_codecs();
    for name in ckpt.names() {
        let info = ckpt.info(name)?;
        let params: u64 = info.shape.iter().map(|&d| d as u64).product();
        let disk = params * info.dtype.bitsize() as u64 / 8;
        let kind = classify(name);
        let resident = if kind == TensorKind::RoutedExperts {
            // A layer the plan keeps bf16: its resident share of the experts' tensors.
            let layer = name
                .split("layers.")
                .nth(1)
                .and_then(|r| r.split('.').next()?.parse::<usize>().ok());
            match layer.and_then(|l| by_layer.get(&l)) {
                Some(l) => disk / l.experts as u64 * l.resident as u64,
                None => disk,
            }
        } else if let Some(c @ Codec::Affine { .. }) = codecs.of_tensor(name, &info.shape, &config)
        {
            // Kept bf16 on disk, coded at load.
            c.matrix_bytes(info.shape[0], info.shape[1])
                .map_err(codec_err(name))?
        } else {
            disk
        };
        add(group_of(kind), params, resident, disk);
    }
    let mut rungs: Vec<Codec> = Vec::new();
    for rung in &manifest.dense_vq {
        let codec: Codec = rung.parse().map_err(|e| Error::Config(format!("{e}")))?;
        rungs.push(codec);
        let rung = codec
            .rung()
            .map_err(codec_err("dense_vq"))?
            .expect("a VQ codec has a rung");
        let path = dir.join(crate::store::dense_vq::file_name(rung));
        let header = safetensors_header(&path)?;
        let shapes: BTreeMap<String, serde_json::Value> = header["__metadata__"]["tensors"]
            .as_str()
            .and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or_default();
        for (name, t) in header.as_object().into_iter().flatten() {
            let Some(weight) = name
                .strip_suffix(".vq_codes")
                .or(name.strip_suffix(".vq_norms"))
            else {
                continue;
            };
            let offsets = &t["data_offsets"];
            let bytes = offsets[1].as_u64().unwrap_or(0) - offsets[0].as_u64().unwrap_or(0);
            // The parameters are counted once per weight, with its codes.
            let params = if name.ends_with(".vq_codes") {
                let s = &shapes.get(weight).ok_or_else(|| {
                    Error::Config(format!("{}: no shape for {weight}", path.display()))
                })?;
                s["rows"].as_u64().unwrap_or(0) * s["cols"].as_u64().unwrap_or(0)
            } else {
                0
            };
            add(group_of(classify(weight)), params, bytes, bytes);
        }
    }
    let (h, inter) = (config.hidden_size, config.moe.expert_intermediate);
    for (rung, layers) in &manifest.stores {
        let codec: Codec = rung.parse().map_err(|e| Error::Config(format!("{e}")))?;
        rungs.push(codec);
        let rung = codec.rung().map_err(codec_err(rung))?.expect("a VQ rung");
        let layout = VqLayout::new(rung, h, inter).map_err(|e| Error::Store(Box::new(e)))?;
        let record = layout.record_size as u64;
        for l in layers.iter().filter_map(|l| by_layer.get(l)) {
            let params = (l.experts * 3 * h * inter) as u64;
            // Resident: the experts a layer keeps and the spare slots its swaps land in.
            let held = l.resident + l.spare_slots.unwrap_or(0);
            add(
                Group::RoutedExperts,
                params,
                held as u64 * record + l.shadow_bytes,
                l.experts as u64 * record,
            );
        }
    }
    rungs.sort();
    rungs.dedup();
    let codebook_bytes = rungs
        .iter()
        .map(|c| c.codebook_bytes())
        .sum::<Result<u64, _>>()
        .map_err(codec_err("codebooks"))?;
    let mut total = GroupBits::default();
    for g in groups.values_mut() {
        total.params += g.params;
        total.resident_bytes += g.resident_bytes;
        total.disk_bytes += g.disk_bytes;
        finish(g);
    }
    finish(&mut total);
    Ok(CompressedBits {
        groups,
        total,
        codebook_bytes,
    })
}

fn finish(g: &mut GroupBits) {
    let per = |bytes: u64| bytes as f64 * 8.0 / g.params.max(1) as f64;
    (g.resident_bits, g.disk_bits) = (per(g.resident_bytes), per(g.disk_bytes));
}
