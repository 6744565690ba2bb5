//! Raw access to a checkpoint's tensors for conversion: the bytes as stored (to copy the
//! dense tensors unchanged) and the routed experts as f32 matrices (to quantize them),
//! under whichever naming the checkpoint uses.

use std::collections::BTreeSet;
use std::path::Path;

use super::layout::Proj;
use super::manifest::{Fnv64, SourceFile};
use super::Error;
use crate::checkpoint::arch;
use crate::checkpoint::{experts::ExpertShape, experts::ExpertTensors};
use crate::checkpoint::{Checkpoint, Config};

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// FNV-1a 64 over every shard's name, size and header bytes (in name order) and over
/// `config.json`: it changes whenever a tensor is added, removed, reshaped or moved, or
/// the configuration changes, without reading the weights. Also returns the files it
/// covers.
pub fn fingerprint(
    ckpt: &Checkpoint,
    config_path: &Path,
) -> Result<(String, Vec<SourceFile>), Error> {
    let mut shards: Vec<(&Path, u64, &[u8])> = ckpt.shard_headers().collect();
    shards.sort_by(|a, b| a.0.file_name().cmp(&b.0.file_name()));
    let mut hash = Fnv64::default();
    let mut files = Vec::new();
    let mut add = |name: String, size: u64, bytes: &[u8]| {
        hash.field(name.as_bytes()).u64(size).field(bytes);
        files.push(SourceFile { name, size });
    };
    for (path, size, header) in shards {
        add(file_name(path), size, header);
    }
    let config = std::fs::read(config_path).map_err(io(config_path))?;
    add(file_name(config_path), config.len() as u64, &config);
    Ok((hash.hex(), files))
}

/// Bytes hashed as one piece of a shard; pieces are hashed in parallel and their hashes
/// combined in order, since byte-at-a-time FNV would otherwise take a core-minute per
/// 60 GB.
const PIECE: usize = 8 << 20;

/// FNV-1a 64 over the whole checkpoint as it would run: every shard's name and every byte
/// of it (header and weights), `config.json`, and `tokenizer.json` where there is one.
/// Unlike [`fingerprint`] it changes when a single weight does, at the price of reading
/// every byte once; results measured on a checkpoint (the probe journal) are keyed by it.
pub fn content_fingerprint(ckpt: &Checkpoint, dir: &Path) -> Result<String, Error> {
    use rayon::prelude::*;
    let mut shards: Vec<(&Path, &[u8])> = ckpt.shard_bytes().collect();
    shards.sort_by(|a, b| a.0.file_name().cmp(&b.0.file_name()));
    let mut hash = Fnv64::default();
    for (path, bytes) in shards {
        let pieces: Vec<u64> = bytes
            .par_chunks(PIECE)
            .map(|p| Fnv64::default().bytes(p).finish())
            .collect();
        hash.field(file_name(path).as_bytes())
            .u64(bytes.len() as u64);
        for p in pieces {
            hash.u64(p);
        }
    }
    for name in ["config.json", "tokenizer.json"] {
        let path = dir.join(name);
        match std::fs::read(&path) {
            Ok(bytes) => hash.field(name.as_bytes()).field(&bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && name != "config.json" => {
                &mut hash
            }
            Err(e) => return Err(io(&path)(e)),
        };
    }
    Ok(hash.hex())
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The routed experts of every MoE layer of a checkpoint.
pub struct Experts {
    /// MoE layer ids, ascending, with where their experts are.
    layers: Vec<(usize, ExpertTensors)>,
    shape: ExpertShape,
    /// Experts per layer.
    pub per_layer: usize,
    /// Residual width.
    pub hidden: usize,
    /// Expert width.
    pub intermediate: usize,
}

impl Experts {
    /// Finds every MoE layer's experts in the checkpoint, named as its architecture
    /// names them (see `model::arch`), per expert or fused.
    pub fn resolve(config: &Config, ckpt: &Checkpoint) -> Result<Experts, Error> {
        let layers = config
            .moe_layers()
            .map(|l| {
                let names = arch::ffn_names(config.arch, ckpt, l);
                let block = format!("model.layers.{l}.{}", names.block);
                Ok((l, ExpertTensors::find(ckpt, &block, names.projections)?))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let shape = ExpertShape::of(config);
        Ok(Experts {
            layers,
            shape,
            per_layer: shape.experts,
            hidden: shape.hidden,
            intermediate: shape.intermediate,
        })
    }

    /// MoE layer ids, ascending.
    pub fn layer_ids(&self) -> Vec<usize> {
        self.layers.iter().map(|(l, _)| *l).collect()
    }

    /// Records in the store: one per expert of every MoE layer.
    pub fn count(&self) -> usize {
        self.layers.len() * self.per_layer
    }

    /// Names of every tensor the experts occupy (left out of the dense tensors).
    pub fn tensor_names(&self) -> BTreeSet<String> {
        self.layers
            .iter()
            .flat_map(|(_, t)| t.tensor_names(self.per_layer))
            .collect()
    }

    /// The weight of one projection of record `index` (layers ascending, experts
    /// ascending) as f32, `[rows, cols]` row-major, and the name of the tensor it is in.
    pub fn matrix(
        &self,
        ckpt: &Checkpoint,
        index: usize,
        proj: Proj,
    ) -> Result<(Vec<f32>, String), Error> {
        let (_, tensors) = &self.layers[index / self.per_layer];
        Ok(tensors.matrix(ckpt, &self.shape, index % self.per_layer, proj.index())?)
    }
}
