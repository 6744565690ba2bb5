//! Raw access to a checkpoint's tensors for conversion: the bytes as stored (to copy the
//! dense tensors unchanged) and the routed experts as f32 matrices (to quantize them),
//! under whichever naming the checkpoint uses.

use std::collections::BTreeSet;
use std::path::Path;

use super::layout::Proj;
use super::manifest::{Fnv64, SourceFile};
use super::Error;
use crate::model::{self, Checkpoint, Config};

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

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Where one MoE layer keeps its routed experts.
enum Naming {
    /// One tensor per expert and projection: `{prefix}.{e}.{names[p]}.weight`.
    PerExpert {
        prefix: String,
        names: [&'static str; 3],
    },
    /// transformers 5's fused layout: `gate_up_proj` `[E, 2I, H]` (gate rows first) and
    /// `down_proj` `[E, H, I]`.
    Fused { gate_up: String, down: String },
}

/// The routed experts of every MoE layer of a checkpoint.
pub struct Experts {
    /// MoE layer ids, ascending, with their naming.
    layers: Vec<(usize, Naming)>,
    /// Experts per layer.
    pub per_layer: usize,
    /// Residual width.
    pub hidden: usize,
    /// Expert width.
    pub intermediate: usize,
}

impl Experts {
    /// Finds every MoE layer's experts in the checkpoint, under the `mlp.experts`
    /// naming (Qwen3-MoE, Qwen2-MoE, OLMoE), Mixtral's `block_sparse_moe.experts` with
    /// `w1`/`w3`/`w2`, or the fused layout.
    pub fn resolve(config: &Config, tensors: &Checkpoint) -> Result<Experts, Error> {
        let layers = config
            .moe_layers()
            .map(|l| Ok((l, naming(tensors, l)?)))
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Experts {
            layers,
            per_layer: config.moe.num_experts,
            hidden: config.hidden_size,
            intermediate: config.moe.expert_intermediate,
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
        let mut names = BTreeSet::new();
        for (_, naming) in &self.layers {
            match naming {
                Naming::PerExpert { prefix, names: n } => {
                    for e in 0..self.per_layer {
                        for p in n {
                            names.insert(format!("{prefix}.{e}.{p}.weight"));
                        }
                    }
                }
                Naming::Fused { gate_up, down } => {
                    names.insert(gate_up.clone());
                    names.insert(down.clone());
                }
            }
        }
        names
    }

    /// `[rows, cols]` of a projection as the checkpoint stores it.
    pub fn shape(&self, proj: Proj) -> [usize; 2] {
        match proj {
            Proj::Gate | Proj::Up => [self.intermediate, self.hidden],
            Proj::Down => [self.hidden, self.intermediate],
        }
    }

    /// The weight of one projection of record `index` (layers ascending, experts
    /// ascending) as f32, `[rows, cols]` row-major, and the name of the tensor it is in.
    pub fn matrix(
        &self,
        tensors: &Checkpoint,
        index: usize,
        proj: Proj,
    ) -> Result<(Vec<f32>, String), Error> {
        let (_, naming) = &self.layers[index / self.per_layer];
        let e = index % self.per_layer;
        let [rows, cols] = self.shape(proj);
        let n = rows * cols;
        match naming {
            Naming::PerExpert { prefix, names } => {
                let name = format!("{prefix}.{e}.{}.weight", names[proj.index()]);
                let t = tensors.raw_checked(&name, &[rows, cols])?;
                Ok((t.f32_range(&name, 0, n)?, name))
            }
            Naming::Fused { gate_up, down } => {
                let (i, h, experts) = (self.intermediate, self.hidden, self.per_layer);
                let (name, shape, start) = match proj {
                    Proj::Gate => (gate_up, [experts, 2 * i, h], e * 2 * n),
                    Proj::Up => (gate_up, [experts, 2 * i, h], e * 2 * n + n),
                    Proj::Down => (down, [experts, h, i], e * n),
                };
                let t = tensors.raw_checked(name, &shape)?;
                Ok((t.f32_range(name, start, n)?, name.clone()))
            }
        }
    }
}

fn naming(tensors: &Checkpoint, layer: usize) -> Result<Naming, Error> {
    let candidates: [(&str, [&'static str; 3]); 2] = [
        ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        ("block_sparse_moe", ["w1", "w3", "w2"]),
    ];
    for (block, names) in candidates {
        let prefix = format!("model.layers.{layer}.{block}.experts");
        if tensors.contains(&format!("{prefix}.0.{}.weight", names[0])) {
            return Ok(Naming::PerExpert { prefix, names });
        }
    }
    let fused = format!("model.layers.{layer}.mlp.experts");
    if tensors.contains(&format!("{fused}.gate_up_proj")) {
        return Ok(Naming::Fused {
            gate_up: format!("{fused}.gate_up_proj"),
            down: format!("{fused}.down_proj"),
        });
    }
    Err(model::Error::MissingTensor {
        path: tensors
            .files()
            .next()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        tensor: format!("{fused}.0.gate_proj.weight"),
    }
    .into())
}
