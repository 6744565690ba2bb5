//! Conversion of a Hugging Face checkpoint into a converted model directory: the routed
//! experts as MLX affine 4-bit records in `experts.bin`, every other tensor unchanged in
//! `dense.safetensors`, and the configuration and tokenizer files beside them.

use std::collections::{BTreeSet, HashMap};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use serde::Serialize;

use super::atomic::{self, create_output};
use super::layout::{put_bf16s, put_u32s, Layout, Proj};
use super::manifest::{
    record_checksum, Created, Fnv64, Manifest, ModelInfo, Source, SCALE_DTYPE, VERSION,
};
use super::tensors::{self, Experts};
use super::{manifest_file_name, Error, BASE_FILE, DENSE_FILE};
use crate::checkpoint::{Checkpoint, Config};
use crate::codec::affine::{quantize, GROUP_SIZE};

/// Files copied unchanged from the checkpoint directory when present; `config.json` is
/// required, the rest optional.
pub const SIDE_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// What a conversion wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ConvertReport {
    /// The converted model directory.
    pub out_dir: PathBuf,
    /// Expert records in `experts.bin`.
    pub records: usize,
    /// Bytes per record.
    pub record_size: usize,
    /// Size of `experts.bin`.
    pub experts_bytes: u64,
    /// Tensors in `dense.safetensors`.
    pub dense_tensors: usize,
    /// Size of `dense.safetensors`.
    pub dense_bytes: u64,
    /// Side files copied (config, tokenizer).
    pub copied: Vec<String>,
    /// Wall time of the whole conversion.
    pub seconds: f64,
}

/// Converts the checkpoint in `model_dir` into a self-contained model directory
/// `out_dir`: `experts.bin` with every routed expert of every MoE layer quantized to
/// 4 bits, its manifest `experts.json`, the remaining tensors in `dense.safetensors`,
/// and the config and tokenizer files. `progress(done, total)` counts expert records.
///
/// Experts are quantized in parallel and written in record order. Every file is written
/// atomically and `experts.json` last, under the directory's exclusive lock, so an
/// interrupted conversion leaves no store a later run would trust.
pub fn convert(
    model_dir: &Path,
    out_dir: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ConvertReport, Error> {
    let start = Instant::now();
    let config_path = model_dir.join("config.json");
    let config = Config::from_file(&config_path)?;
    let ckpt = Checkpoint::open(model_dir)?;
    std::fs::create_dir_all(out_dir).map_err(|source| Error::Io {
        path: out_dir.to_path_buf(),
        source,
    })?;
    refuse_same_dir(model_dir, out_dir)?;

    let _lock = atomic::lock_exclusive(out_dir)?;
    atomic::remove_stale_temps(out_dir)?;
    // The manifest is the commit mark of the store: gone until the new one is complete.
    let manifest_path = out_dir.join(manifest_file_name(4));
    atomic::remove_committed(&manifest_path)?;

    let experts = Experts::resolve(&config, &ckpt)?;
    let layout = Layout::new(4, experts.hidden, experts.intermediate)?;

    let (dense_tensors, dense_bytes) =
        write_dense(&ckpt, &experts.tensor_names(), &out_dir.join(DENSE_FILE))?;
    let copied = copy_side_files(model_dir, out_dir)?;
    let data_path = out_dir.join(BASE_FILE);
    let checksums = write_records(&ckpt, &experts, &layout, &data_path, progress)?;

    let manifest = base_manifest(&config, model_dir, &ckpt, &experts, &layout, checksums)?;
    atomic::write_file(&manifest_path, &manifest.to_bytes())?;
    Ok(ConvertReport {
        out_dir: out_dir.to_path_buf(),
        records: experts.count(),
        record_size: layout.record_size,
        experts_bytes: manifest.file_size,
        dense_tensors,
        dense_bytes,
        copied,
        seconds: start.elapsed().as_secs_f64(),
    })
}

fn refuse_same_dir(model_dir: &Path, out_dir: &Path) -> Result<(), Error> {
    let canonical = |p: &Path| {
        p.canonicalize().map_err(|source| Error::Io {
            path: p.to_path_buf(),
            source,
        })
    };
    if canonical(model_dir)? == canonical(out_dir)? {
        return Err(Error::SameDirectory {
            dir: out_dir.to_path_buf(),
        });
    }
    Ok(())
}

/// The manifest of a freshly written base store. Its fingerprint mixes the
/// checkpoint's with the time and process, so that every conversion is a new identity
/// and low-bit stores derived from an earlier one are rebuilt.
fn base_manifest(
    config: &Config,
    model_dir: &Path,
    tensors: &Checkpoint,
    experts: &Experts,
    layout: &Layout,
    checksums: Vec<String>,
) -> Result<Manifest, Error> {
    let (checkpoint, files) = tensors::fingerprint(tensors, &model_dir.join("config.json"))?;
    let created = Created::now("routed experts of the checkpoint quantized to MLX affine 4-bit");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let fingerprint = Fnv64::default()
        .field(checkpoint.as_bytes())
        .u64(nanos)
        .u64(std::process::id() as u64)
        .hex();
    let count = experts.count();
    Ok(Manifest {
        format: super::manifest::FORMAT.to_string(),
        version: VERSION,
        file: BASE_FILE.to_string(),
        bits: 4,
        group_size: GROUP_SIZE,
        scale_dtype: SCALE_DTYPE.to_string(),
        page: super::PAGE,
        hidden: layout.hidden,
        intermediate: layout.intermediate,
        layers: experts.layer_ids(),
        experts_per_layer: experts.per_layer,
        record_size: layout.record_size as u64,
        record_count: count as u64,
        file_size: layout.file_size(count),
        checksums,
        fingerprint,
        model: ModelInfo {
            model_type: config.arch.model_type().to_string(),
            name: dir_name(model_dir),
        },
        source: Source {
            kind: "checkpoint".to_string(),
            fingerprint: checkpoint,
            files,
            generator: None,
        },
        created,
    })
}

fn dir_name(dir: &Path) -> String {
    dir.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default()
}

/// Quantizes every expert and writes the records in order; returns their checksums.
/// Records are quantized (and summed) a batch at a time in parallel, so memory holds a
/// few records per thread, not the model.
fn write_records(
    tensors: &Checkpoint,
    experts: &Experts,
    layout: &Layout,
    path: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<String>, Error> {
    let total = experts.count();
    let batch = 2 * rayon::current_num_threads().max(1);
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    create_output(path, |file| {
        let mut out = BufWriter::with_capacity(4 << 20, file);
        let mut checksums = Vec::with_capacity(total);
        progress(0, total);
        for first in (0..total).step_by(batch) {
            let last = (first + batch).min(total);
            let records = (first..last)
                .into_par_iter()
                .map(|i| {
                    let record = quantize_record(tensors, experts, layout, i)?;
                    let sum = record_checksum(&record);
                    Ok((record, sum))
                })
                .collect::<Result<Vec<_>, Error>>()?;
            for (record, sum) in records {
                out.write_all(&record).map_err(io)?;
                checksums.push(sum);
            }
            progress(last, total);
        }
        out.flush().map_err(io)?;
        Ok(checksums)
    })
}

/// Record `index`: the three projections quantized at 4 bits, laid out by `layout`.
fn quantize_record(
    tensors: &Checkpoint,
    experts: &Experts,
    layout: &Layout,
    index: usize,
) -> Result<Vec<u8>, Error> {
    let mut record = vec![0u8; layout.record_size];
    for proj in Proj::ALL {
        let m = layout.matrix(proj);
        let (w, name) = experts.matrix(tensors, index, proj)?;
        let w = pad_cols(w, m.rows, m.true_cols, m.cols);
        let q = quantize(&w, m.rows, m.cols, 4).map_err(|e| Error::Codec {
            path: tensors
                .raw(&name)
                .map(|t| t.path.to_path_buf())
                .unwrap_or_default(),
            tensor: name.clone(),
            reason: e.to_string(),
        })?;
        put_u32s(&mut record[m.codes.range()], &q.words);
        put_bf16s(&mut record[m.scales.range()], &q.scales);
        put_bf16s(&mut record[m.biases.range()], &q.biases);
    }
    Ok(record)
}

/// Widens each row from `cols` to `padded` columns by repeating its last weight, so
/// the last group's range, and therefore the codes of its real weights, are what a
/// group of only the real weights would give. Kernels multiply the padding by zeros.
fn pad_cols(w: Vec<f32>, rows: usize, cols: usize, padded: usize) -> Vec<f32> {
    if cols == padded {
        return w;
    }
    let mut out = Vec::with_capacity(rows * padded);
    for row in w.chunks_exact(cols) {
        out.extend_from_slice(row);
        out.resize(out.len() + padded - cols, row[cols - 1]);
    }
    out
}

/// Writes every tensor of `tensors` except those named in `skip`, as stored, to the
/// safetensors file `path` (atomically); returns the tensor count and file size.
pub(crate) fn write_dense(
    tensors: &Checkpoint,
    skip: &BTreeSet<String>,
    path: &Path,
) -> Result<(usize, u64), Error> {
    let mut dense: Vec<(&str, _)> = tensors
        .names()
        .into_iter()
        .filter(|n| !skip.contains(*n))
        .map(|n| tensors.raw(n).map(|t| (n, t)))
        .collect::<Result<_, _>>()?;
    // safetensors' own order: by descending dtype alignment, then name.
    dense.sort_by(|(a, ta), (b, tb)| tb.dtype.cmp(&ta.dtype).then(a.cmp(b)));

    let layout: Vec<_> = dense
        .iter()
        .map(|(name, t)| (name.to_string(), t.dtype, t.shape.to_vec(), t.bytes.len()))
        .collect();
    let header = safetensors_header(path, &layout)?;
    let offset: usize = layout.iter().map(|t| t.3).sum();

    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    create_output(path, |file| {
        let mut out = BufWriter::with_capacity(4 << 20, file);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(&header).map_err(io)?;
        for (_, t) in &dense {
            out.write_all(t.bytes).map_err(io)?;
        }
        out.flush().map_err(io)
    })?;
    Ok((dense.len(), (8 + header.len() + offset) as u64))
}

/// The header of a safetensors file holding `tensors` (name, dtype, shape, bytes) one
/// after another in the order given, with `{"format": "pt"}` metadata: the JSON padded
/// with spaces to a multiple of 8, without the length prefix that precedes it in the
/// file. `path` names the file in errors.
pub(crate) fn safetensors_header(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>, usize)],
) -> Result<Vec<u8>, Error> {
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|(name, dtype, shape, len)| {
            let info = TensorInfo {
                dtype: *dtype,
                shape: shape.clone(),
                data_offsets: (offset, offset + len),
            };
            offset += len;
            (name.clone(), info)
        })
        .collect();
    let format = HashMap::from([("format".to_string(), "pt".to_string())]);
    let header = Metadata::new(Some(format), infos)
        .and_then(|m| Ok(serde_json::to_string(&m)?))
        .map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
    let mut header = header.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(header)
}

/// Copies the config and tokenizer files that exist.
pub(crate) fn copy_side_files(model_dir: &Path, out_dir: &Path) -> Result<Vec<String>, Error> {
    let mut copied = Vec::new();
    for name in SIDE_FILES {
        let src = model_dir.join(name);
        let bytes = match std::fs::read(&src) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && name != "config.json" => continue,
            Err(source) => return Err(Error::Io { path: src, source }),
        };
        atomic::write_file(&out_dir.join(name), &bytes)?;
        copied.push(name.to_string());
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_repeats_the_last_weight() {
        let w = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(
            pad_cols(w, 2, 3, 5),
            vec![1.0, 2.0, 3.0, 3.0, 3.0, 4.0, 5.0, 6.0, 6.0, 6.0]
        );
    }
}
