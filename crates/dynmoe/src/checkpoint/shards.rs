//! Hugging Face safetensors checkpoints, single-file or sharded, memory-mapped.
//!
//! A sharded checkpoint is found through `model.safetensors.index.json`, never by
//! listing the directory: the index is what says which shard holds which tensor.
//! Every tensor is checked against the shape the configuration implies before it is
//! read, and every error names the file and the tensor.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;

use super::arch::partial_rotary::PartialRotary;
use super::Error;

/// One memory-mapped shard and its parsed header.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// The tensors of a checkpoint directory.
pub struct Checkpoint {
    shards: Vec<Shard>,
    /// Tensor name to index into `shards`.
    index: HashMap<String, usize>,
    /// The head layout [`Checkpoint::f32`] gives the q and k projections of a model with
    /// partial rotary embedding.
    rotary: Option<PartialRotary>,
}

/// Where a tensor lives and what it is, without reading its data.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Shard file holding it.
    pub file: PathBuf,
    /// Element type as stored.
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: Vec<usize>,
}

impl Checkpoint {
    /// Opens `model.safetensors`, the shards named by `model.safetensors.index.json`, or,
    /// in a converted model directory, `dense.safetensors` (everything but the routed
    /// experts, which live in the expert stores).
    pub fn open(dir: &Path) -> Result<Checkpoint, Error> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let dense = dir.join("dense.safetensors");
        let files: Vec<PathBuf> = if index_path.exists() {
            read_index(&index_path)?
                .into_iter()
                .map(|f| dir.join(f))
                .collect()
        } else if single.exists() {
            vec![single]
        } else if dense.exists() {
            vec![dense]
        } else {
            return Err(Error::NoWeights {
                dir: dir.to_path_buf(),
            });
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for path in files {
            let shard = open_shard(&path)?;
            for name in shard.metadata.tensors().keys() {
                if index.insert(name.clone(), shards.len()).is_some() {
                    return Err(Error::Safetensors {
                        path: path.clone(),
                        reason: format!("tensor {name} appears in more than one shard"),
                    });
                }
            }
            shards.push(shard);
        }
        Ok(Checkpoint {
            shards,
            index,
            rotary: PartialRotary::of_dir(dir),
        })
    }

    /// Whether the checkpoint holds a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.index.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Files this checkpoint was read from.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// Dtype and shape of a tensor.
    pub fn info(&self, name: &str) -> Result<TensorInfo, Error> {
        let shard = self.shard_of(name)?;
        let info = shard
            .metadata
            .info(name)
            .expect("indexed tensor has metadata");
        Ok(TensorInfo {
            file: shard.path.clone(),
            dtype: info.dtype,
            shape: info.shape.clone(),
        })
    }

    /// Reads a tensor as f32, checking that its shape is `shape`; the q and k
    /// projections of a model with partial rotary embedding come in the layout
    /// `arch::partial_rotary` describes.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, Error> {
        let t = self.raw_checked(name, shape)?;
        let mut values = t.f32_range(name, 0, shape.iter().product())?;
        if let Some(rotary) = self.rotary.filter(|_| PartialRotary::applies_to(name)) {
            rotary.reorder(&mut values, shape.first().copied().unwrap_or(0));
        }
        Ok(values)
    }

    /// A tensor's bytes as stored, in place in the mapped shard.
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>, Error> {
        let shard = self.shard_of(name)?;
        let info = shard
            .metadata
            .info(name)
            .expect("indexed tensor has metadata");
        let (start, end) = info.data_offsets;
        let base = 8 + shard.header_len;
        Ok(RawTensor {
            path: &shard.path,
            dtype: info.dtype,
            shape: &info.shape,
            offset: (base + start) as u64,
            bytes: &shard.mmap[base + start..base + end],
        })
    }

    /// [`Checkpoint::raw`], if the tensor's shape is `shape`.
    pub fn raw_checked(&self, name: &str, shape: &[usize]) -> Result<RawTensor<'_>, Error> {
        let t = self.raw(name)?;
        if t.shape != shape {
            return Err(Error::TensorShape {
                path: t.path.to_path_buf(),
                tensor: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape.to_vec(),
            });
        }
        Ok(t)
    }

    /// Each shard's path, file size and header bytes (the 8-byte length and the JSON
    /// header): what identifies the checkpoint without reading its weights.
    pub fn shard_headers(&self) -> impl Iterator<Item = (&Path, u64, &[u8])> {
        self.shards.iter().map(|s| {
            (
                s.path.as_path(),
                s.mmap.len() as u64,
                &s.mmap[..8 + s.header_len],
            )
        })
    }

    /// Each shard's path and its whole file as mapped: header and every tensor's bytes.
    pub fn shard_bytes(&self) -> impl Iterator<Item = (&Path, &[u8])> {
        self.shards.iter().map(|s| (s.path.as_path(), &s.mmap[..]))
    }

    fn shard_of(&self, name: &str) -> Result<&Shard, Error> {
        self.index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| Error::MissingTensor {
                path: self
                    .shards
                    .first()
                    .map(|s| s.path.clone())
                    .unwrap_or_default(),
                tensor: name.to_string(),
            })
    }
}

/// One tensor's bytes as stored.
pub struct RawTensor<'a> {
    /// The shard holding it.
    pub path: &'a Path,
    /// Element type as stored.
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: &'a [usize],
    /// Where its bytes start in the shard file.
    pub offset: u64,
    /// Its bytes, little-endian, row-major.
    pub bytes: &'a [u8],
}

/// The index of the first NaN or infinite value of `values`, scanned in parallel.
pub fn first_non_finite(values: &[f32]) -> Option<usize> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    values
        .par_chunks(CHUNK)
        .enumerate()
        .find_map_first(|(c, chunk)| {
            chunk
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| c * CHUNK + i)
        })
}

/// Bytes per element of a dtype dynmoe reads as f32, or `None`.
pub fn float_size(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::BF16 | Dtype::F16 => Some(2),
        Dtype::F32 => Some(4),
        _ => None,
    }
}

/// Widens little-endian bf16, f16 or f32 `bytes` into `out` (one element each).
///
/// # Panics
/// If `dtype` is not one of those or the lengths disagree.
pub fn widen(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    let size = float_size(dtype).expect("a float dtype");
    assert_eq!(
        bytes.len(),
        out.len() * size,
        "{dtype:?} bytes for {} floats",
        out.len()
    );
    match dtype {
        Dtype::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Dtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

impl RawTensor<'_> {
    /// Elements `start .. start + n` as f32 (bf16, f16 and f32 are read; `name` is for
    /// the error).
    pub fn f32_range(&self, name: &str, start: usize, n: usize) -> Result<Vec<f32>, Error> {
        let size = self.float_size(name)?;
        let mut out = vec![0.0f32; n];
        widen(
            self.dtype,
            &self.bytes[start * size..(start + n) * size],
            &mut out,
        );
        if super::finite_check() {
            if let Some(i) = first_non_finite(&out) {
                return Err(Error::NotFinite {
                    path: self.path.to_path_buf(),
                    tensor: name.to_string(),
                    index: start + i,
                    value: out[i],
                });
            }
        }
        Ok(out)
    }

    /// Bytes per element, if the dtype is one dynmoe reads (`name` is for the error).
    pub fn float_size(&self, name: &str) -> Result<usize, Error> {
        float_size(self.dtype).ok_or_else(|| Error::TensorDtype {
            path: self.path.to_path_buf(),
            tensor: name.to_string(),
            dtype: format!("{:?}", self.dtype),
        })
    }
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// The shard files an index names, in first-mention order, each once.
fn read_index(path: &Path) -> Result<Vec<String>, Error> {
    let text = super::read_regular(path)?;
    let index: Index = serde_json::from_slice(&text).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut files: Vec<String> = index.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    if let Some(bad) = files.iter().find(|f| f.contains('/') || f.contains("..")) {
        return Err(Error::Json {
            path: path.to_path_buf(),
            reason: format!("shard name {bad:?} points outside the checkpoint directory"),
        });
    }
    Ok(files)
}

fn open_shard(path: &Path) -> Result<Shard, Error> {
    let file = super::open_regular(path)?;
    // SAFETY: the map is read-only; a checkpoint changed underneath a running process is
    // outside what any reader of memory-mapped weights can defend against.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&mmap).map_err(|e| Error::Safetensors {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    // read_metadata checks that offsets are contiguous; the data must also all be there.
    let data_len = metadata
        .tensors()
        .values()
        .map(|t| t.data_offsets.1)
        .max()
        .unwrap_or(0);
    if 8 + header_len + data_len > mmap.len() {
        return Err(Error::Safetensors {
            path: path.to_path_buf(),
            reason: format!(
                "truncated: tensors need {} bytes, file has {}",
                8 + header_len + data_len,
                mmap.len()
            ),
        });
    }
    Ok(Shard {
        path: path.to_path_buf(),
        mmap,
        header_len,
        metadata,
    })
}
