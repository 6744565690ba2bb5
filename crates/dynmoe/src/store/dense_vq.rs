//! Dense linear layers (attention projections, shared experts, dense MLPs) coded at a
//! rung of the VQ ladder: `dense-vq{bits}.safetensors`, beside a Hugging Face checkpoint
//! (encoded on first use, like the VQ expert stores) or inside a compressed model
//! directory (written by `dynmoe compress`). At an affine width (`q4`, `q3`, `q2`) they
//! need no file: [`quantize_affine`] codes them from the checkpoint at every load.
//!
//! A safetensors file, so any safetensors reader can list it: for each coded weight
//! `NAME`, `NAME.vq_codes` (U8, `[rows, row_bytes]`) and `NAME.vq_norms` (F16,
//! `[rows, blocks]`), exactly a [`VqMatrix`]'s parts. The header's metadata says what
//! the codes mean and where they came from: `format`, `version`, `rung`, `codebook`
//! (the checksum of the codebook the codes index), `source_fingerprint` (the checkpoint
//! they were encoded from) and `tensors`, a JSON object giving each weight's `rows`,
//! `cols`, rotation `seed` and a `checksum` of its codes and norms. docs/FORMAT.md §15.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use half::f16;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use super::manifest::Fnv64;
use super::{atomic, tensors, Error};
use crate::checkpoint::arch::{is_dense_linear, CodedGroup};
use crate::checkpoint::{Checkpoint, Config};
use crate::codec::affine::AffineMatrix;
use crate::codec::vq::{row_bytes, Rung, VqMatrix, VqView};
use crate::codec::{Codec, CodecError};

/// A dense linear layer's weight coded in host memory (shared, so several models can
/// hold one coding).
#[derive(Debug, Clone, PartialEq)]
pub enum CodedWeight {
    /// At a VQ rung.
    Vq(Arc<VqMatrix>),
    /// At an affine width (4, 3 or 2 bits).
    Affine(Arc<AffineMatrix>),
}

impl CodedWeight {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            CodedWeight::Vq(m) => (m.rows, m.cols),
            CodedWeight::Affine(m) => (m.rows, m.cols),
        }
    }
}

/// Dense linear layers (attention projections, shared experts, dense MLPs) coded at VQ
/// rungs, by the name of their weight tensor (`model.layers.3.self_attn.q_proj.weight`):
/// what a `dense-vq{bits}.safetensors` file holds.
pub type DenseVq = BTreeMap<String, Arc<VqMatrix>>;

/// Dense linear layers and an untied LM head coded at any codec, by the name of their
/// weight tensor: what a model runs coded.
pub type CodedLayers = BTreeMap<String, CodedWeight>;

/// The VQ-coded layers of `coded`, as a model runs them.
pub fn vq_layers(coded: DenseVq) -> CodedLayers {
    coded
        .into_iter()
        .map(|(name, m)| (name, CodedWeight::Vq(m)))
        .collect()
}

/// Value of the `format` metadata field.
pub const FORMAT: &str = "dynmoe-dense-vq";

/// The version this build writes and reads.
pub const VERSION: u32 = 1;

/// The rung of the file dense layers at `codec` are coded into: none for bf16, and none
/// for the affine widths, which are quantized at load. A codec dense layers cannot take
/// is refused, with the reason.
pub fn rung_of(codec: Codec) -> Result<Option<Rung>, String> {
    match codec {
        Codec::Bf16 | Codec::Affine { bits: 2..=4 } => Ok(None),
        Codec::Vq { .. } => codec.rung().map_err(|e| e.to_string()),
        Codec::Affine { .. } => Err(format!(
            "dense layers take bf16, q4, q3, q2 or a VQ rung (vq0.7 … vq5), not {codec}"
        )),
    }
}

/// The file of the dense layers coded at `rung`.
pub fn file_name(rung: Rung) -> String {
    format!("dense-{}.safetensors", rung.name())
}

/// The rotation seed of weight `name`: fixed by the name, so a re-encoding of the same
/// tensor gives the same bytes.
pub fn seed(name: &str) -> u64 {
    Fnv64::default().bytes(name.as_bytes()).finish()
}

/// Weight tensors by name, each with its `[rows, cols]`.
pub type WeightShapes = Vec<(String, [usize; 2])>;

/// The dense linear weights of a checkpoint, by name, with their `[rows, cols]`: what a
/// dense codec applies to (and what bits accounting prices at it).
pub fn dense_linear_weights(ckpt: &Checkpoint) -> Result<WeightShapes, Error> {
    let mut out = Vec::new();
    for name in ckpt.names() {
        let shape = ckpt.info(name)?.shape;
        if is_dense_linear(name, &shape) {
            out.push((name.to_string(), [shape[0], shape[1]]));
        }
    }
    out.sort();
    Ok(out)
}

/// The untied LM head of a checkpoint, `lm_head.weight` with its `[rows, cols]`; `None`
/// when the head is tied to the embedding (which stays bf16).
pub fn lm_head_weight(
    ckpt: &Checkpoint,
    config: &Config,
) -> Result<Option<(String, [usize; 2])>, Error> {
    let name = "lm_head.weight";
    if config.tie_word_embeddings || !ckpt.contains(name) {
        return Ok(None);
    }
    let shape = ckpt.info(name)?.shape;
    Ok(match shape[..] {
        [rows, cols] => Some((name.to_string(), [rows, cols])),
        _ => None,
    })
}

/// The codec each group of coded tensors runs at: the token embeddings, an untied LM
/// head, each decoder layer's dense linear weights (docs/ARCHITECTURE.md, Allocation).
/// Groups not listed in `groups` take the default of their kind.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupCodecs {
    /// Dense linear weights of the layers `groups` does not list.
    pub dense: Codec,
    /// An untied LM head, unless listed.
    pub head: Codec,
    /// The token embeddings (and a head tied to them), unless listed.
    pub embedding: Codec,
    /// Groups at a codec of their own.
    pub groups: BTreeMap<CodedGroup, Codec>,
}

impl Default for GroupCodecs {
    fn default() -> GroupCodecs {
        GroupCodecs::uniform(Codec::Bf16, Codec::Bf16, Codec::Bf16)
    }
}

impl GroupCodecs {
    /// Every dense layer at `dense`, the head at `head`, the embeddings at `embedding`.
    pub fn uniform(dense: Codec, head: Codec, embedding: Codec) -> GroupCodecs {
        GroupCodecs {
            dense,
            head,
            embedding,
            groups: BTreeMap::new(),
        }
    }

    /// The codec of `group`.
    pub fn of(&self, group: CodedGroup) -> Codec {
        self.groups.get(&group).copied().unwrap_or(match group {
            CodedGroup::Embedding => self.embedding,
            CodedGroup::Head => self.head,
            CodedGroup::Dense(_) => self.dense,
        })
    }

    /// The codec of checkpoint tensor `name` of `shape`: `None` for a tensor in no group
    /// (routers, norms, routed experts) or one left bf16.
    pub fn of_tensor(&self, name: &str, shape: &[usize], config: &Config) -> Option<Codec> {
        CodedGroup::of(name, shape, config)
            .map(|g| self.of(g))
            .filter(|&c| c != Codec::Bf16)
    }

    /// The coded tensors of `ckpt` by codec, each with its `[rows, cols]`, sorted by
    /// name; a codec a tensor cannot take is refused, naming its group.
    pub fn tensors(
        &self,
        ckpt: &Checkpoint,
        config: &Config,
    ) -> Result<BTreeMap<Codec, WeightShapes>, Error> {
        let mut out: BTreeMap<Codec, WeightShapes> = BTreeMap::new();
        for (group, weights) in group_weights(ckpt, config)? {
            let codec = self.of(group);
            if codec == Codec::Bf16 {
                continue;
            }
            if let Err(reason) = rung_of(codec) {
                let name = &weights[0].0;
                return Err(Error::Codec {
                    path: ckpt.info(name).map(|i| i.file).unwrap_or_default(),
                    tensor: name.clone(),
                    reason,
                });
            }
            out.entry(codec).or_default().extend(weights);
        }
        for weights in out.values_mut() {
            weights.sort();
        }
        Ok(out)
    }
}

/// The weights of every tensor group of `ckpt` (embeddings, an untied LM head, each
/// layer's dense linear weights) with their `[rows, cols]`, sorted by name within a group.
pub fn group_weights(
    ckpt: &Checkpoint,
    config: &Config,
) -> Result<BTreeMap<CodedGroup, WeightShapes>, Error> {
    let mut out: BTreeMap<CodedGroup, WeightShapes> = BTreeMap::new();
    for name in ckpt.names() {
        let shape = ckpt.info(name)?.shape;
        if let Some(g) = CodedGroup::of(name, &shape, config) {
            out.entry(g)
                .or_default()
                .push((name.to_string(), [shape[0], shape[1]]));
        }
    }
    for weights in out.values_mut() {
        weights.sort();
    }
    Ok(out)
}

/// Encodes `weights` (names and shapes, e.g. [`dense_linear_weights`]) of `ckpt` at
/// `rung`; `progress(done, total)` after each weight.
pub fn encode(
    ckpt: &Checkpoint,
    rung: Rung,
    weights: &[(String, [usize; 2])],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<DenseVq, Error> {
    code_each(ckpt, weights, progress, |w, rows, cols, name| {
        VqMatrix::encode(w, rows, cols, rung, seed(name)).map(Arc::new)
    })
}

/// Quantizes `weights` of `ckpt` at `bits` (4, 3 or 2) as [`AffineMatrix::quantize`]
/// does; `progress(done, total)` after each weight. A width that is not a whole number
/// of quantization groups is an error naming the tensor and its file.
pub fn quantize_affine(
    ckpt: &Checkpoint,
    bits: u32,
    weights: &[(String, [usize; 2])],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CodedLayers, Error> {
    code_each(ckpt, weights, progress, |w, rows, cols, _| {
        AffineMatrix::quantize(w, rows, cols, bits).map(|m| CodedWeight::Affine(Arc::new(m)))
    })
}

/// Each of `weights` read from `ckpt` as f32 and coded by `code(w, rows, cols, name)`,
/// failures naming the tensor and its shard; `progress(done, total)` after each.
fn code_each<T>(
    ckpt: &Checkpoint,
    weights: &[(String, [usize; 2])],
    progress: &mut dyn FnMut(usize, usize),
    code: impl Fn(&[f32], usize, usize, &str) -> Result<T, CodecError>,
) -> Result<BTreeMap<String, T>, Error> {
    let mut out = BTreeMap::new();
    for (i, (name, [rows, cols])) in weights.iter().enumerate() {
        let w = ckpt.f32(name, &[*rows, *cols])?;
        let m = code(&w, *rows, *cols, name).map_err(|e| Error::Codec {
            path: ckpt.info(name).map(|i| i.file).unwrap_or_default(),
            tensor: name.clone(),
            reason: e.to_string(),
        })?;
        out.insert(name.clone(), m);
        progress(i + 1, weights.len());
    }
    Ok(out)
}

/// One coded weight's entry in the `tensors` metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    rows: usize,
    cols: usize,
    seed: u64,
    checksum: String,
}

fn checksum(m: &VqView<'_>) -> String {
    let norms: Vec<u8> = m.norms.iter().flat_map(|v| v.to_le_bytes()).collect();
    Fnv64::default().bytes(m.codes).bytes(&norms).hex()
}

/// [`super::vq::codebook_id`], a failure named as this file's `codebook` field.
fn codebook_id(path: &Path, rung: Rung) -> Result<String, Error> {
    super::vq::codebook_id(rung).map_err(|reason| Error::manifest(path, "codebook", reason))
}

/// Writes `coded` (every matrix at `rung`) to `path`, atomically. Returns its size.
pub fn write(
    path: &Path,
    rung: Rung,
    source_fingerprint: &str,
    coded: &DenseVq,
) -> Result<u64, Error> {
    let mut entries = BTreeMap::new();
    let mut parts: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, m) in coded {
        if m.rung != rung {
            return Err(Error::Codec {
                path: path.to_path_buf(),
                tensor: name.clone(),
                reason: format!("coded at {}, the file holds {}", m.rung.name(), rung.name()),
            });
        }
        let v = m.view();
        entries.insert(
            name.clone(),
            Entry {
                rows: m.rows,
                cols: m.cols,
                seed: m.seed,
                checksum: checksum(&v),
            },
        );
        let norms: Vec<u8> = m.norms.iter().flat_map(|x| x.to_le_bytes()).collect();
        let rb = row_bytes(rung, m.cols);
        parts.push((
            format!("{name}.vq_codes"),
            Dtype::U8,
            vec![m.rows, rb],
            m.codes.clone(),
        ));
        parts.push((
            format!("{name}.vq_norms"),
            Dtype::F16,
            vec![m.rows, v.blocks()],
            norms,
        ));
    }
    let metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("version".to_string(), VERSION.to_string()),
        ("rung".to_string(), rung.name()),
        ("codebook".to_string(), codebook_id(path, rung)?),
        (
            "source_fingerprint".to_string(),
            source_fingerprint.to_string(),
        ),
        (
            "tensors".to_string(),
            serde_json::to_string(&entries).expect("entries serialise"),
        ),
    ]);
    let bad = |e: safetensors::SafeTensorError| Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    };
    let views = parts
        .iter()
        .map(|(n, dtype, shape, data)| {
            TensorView::new(*dtype, shape.clone(), data).map(|v| (n.as_str(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(bad)?;
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(bad)?;
    atomic::write_file(path, &bytes)?;
    Ok(bytes.len() as u64)
}

/// Reads the coded weights in `path`, checking that they are at `rung`, index this
/// build's codebook, came from the checkpoint `source_fingerprint` names, and that every
/// weight's codes and norms match their checksum.
pub fn read(path: &Path, rung: Rung, source_fingerprint: &str) -> Result<DenseVq, Error> {
    let bytes = super::read_file(path)?;
    let unusable = |reason: String| Error::Unusable {
        path: path.to_path_buf(),
        reason,
    };
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| unusable(format!("not a safetensors file: {e}")))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let field = |name: &str| -> Result<&String, Error> {
        meta.get(name)
            .ok_or_else(|| Error::manifest(path, name, "is missing"))
    };
    let expect = |name: &str, want: &str| -> Result<(), Error> {
        let got = field(name)?;
        if got != want {
            return Err(Error::manifest(
                path,
                name,
                format!("is {got:?}, expected {want:?}"),
            ));
        }
        Ok(())
    };
    expect("format", FORMAT)?;
    expect("version", &VERSION.to_string())?;
    expect("rung", &rung.name())?;
    expect("codebook", &codebook_id(path, rung)?)?;
    expect("source_fingerprint", source_fingerprint)?;
    let entries: BTreeMap<String, Entry> = serde_json::from_str(field("tensors")?)
        .map_err(|e| Error::manifest(path, "tensors", e.to_string()))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| unusable(format!("not a safetensors file: {e}")))?;
    let expected_tensors = 2 * entries.len();
    if st.len() != expected_tensors {
        return Err(unusable(format!(
            "{} tensors, the `tensors` field names {} weights ({expected_tensors} tensors)",
            st.len(),
            entries.len()
        )));
    }
    let mut out = DenseVq::new();
    for (name, e) in entries {
        let part = |suffix: &str, dtype: Dtype| -> Result<Vec<u8>, Error> {
            let t = st
                .tensor(&format!("{name}.{suffix}"))
                .map_err(|_| unusable(format!("tensor {name}.{suffix} is missing")))?;
            if t.dtype() != dtype {
                return Err(unusable(format!(
                    "tensor {name}.{suffix} is {:?}, expected {dtype:?}",
                    t.dtype()
                )));
            }
            Ok(t.data().to_vec())
        };
        let codes = part("vq_codes", Dtype::U8)?;
        let norms: Vec<f16> = part("vq_norms", Dtype::F16)?
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect();
        let view = VqView::from_parts(e.rows, e.cols, rung, e.seed, &norms, &codes)
            .map_err(|err| Error::manifest(path, &format!("tensors.{name}"), err.to_string()))?;
        let sum = checksum(&view);
        if sum != e.checksum {
            return Err(Error::manifest(
                path,
                &format!("tensors.{name}.checksum"),
                format!(
                    "is {}, the stored codes and norms hash to {sum}",
                    e.checksum
                ),
            ));
        }
        let m = VqMatrix {
            rows: view.rows,
            cols: view.cols,
            rung,
            block: view.block,
            seed: view.seed,
            norms,
            codes,
        };
        out.insert(name, Arc::new(m));
    }
    Ok(out)
}

/// The `weights` of the checkpoint in `dir` at `rung`: read from
/// `dir/dense-vq{bits}.safetensors` when it holds them and matches the checkpoint, else
/// encoded and added to it (under the directory's lock) for the next run. Weights the file
/// holds beyond those asked for are kept in it.
pub fn ensure(
    dir: &Path,
    ckpt: &Checkpoint,
    rung: Rung,
    weights: &[(String, [usize; 2])],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<DenseVq, Error> {
    let path = dir.join(file_name(rung));
    let (fingerprint, _) = tensors::fingerprint(ckpt, &dir.join("config.json"))?;
    let subset = |coded: &DenseVq| -> Option<DenseVq> {
        weights
            .iter()
            .map(|(n, _)| coded.get(n).map(|m| (n.clone(), m.clone())))
            .collect()
    };
    {
        let _lock = atomic::lock_shared(dir)?;
        if let Some(found) = read(&path, rung, &fingerprint)
            .ok()
            .and_then(|c| subset(&c))
        {
            return Ok(found);
        }
    }
    let lock = atomic::lock_exclusive(dir);
    // Again under the lock: another process may have written it meanwhile.
    let mut held = read(&path, rung, &fingerprint).unwrap_or_default();
    if let Some(found) = subset(&held) {
        return Ok(found);
    }
    let missing: Vec<(String, [usize; 2])> = weights
        .iter()
        .filter(|(n, _)| !held.contains_key(n))
        .cloned()
        .collect();
    held.extend(encode(ckpt, rung, &missing, progress)?);
    // A read-only checkpoint directory still runs; it encodes again next time.
    if lock.is_ok() {
        write(&path, rung, &fingerprint, &held)?;
    }
    Ok(subset(&held).expect("every weight asked for was just encoded"))
}
