//! Writing a VQ expert store (docs/FORMAT.md, §13.4): whole records appended to a
//! temporary data file with their checksums, the file committed, and the manifest
//! written last. [`super::vq`] encodes or copies the records; [`super::synth_vq`] makes
//! random ones.

use std::io::{BufWriter, Write};
use std::path::Path;

use super::atomic::{self, TempOutput};
use super::manifest::{Created, ModelInfo, Source};
use super::vq::{
    codebook_id, data_file_name, manifest_file_name, VqLayerEntry, VqLayout, VqManifest, FORMAT,
    HEADER, SEED_RULE, VERSION,
};
use super::{Error, PAGE};

/// The data file of a store being written by [`write_store`]: whole records appended
/// layer by layer (ascending), each layer's experts in order, with their checksums.
pub(crate) struct RecordSink {
    out: BufWriter<TempOutput>,
    layout: VqLayout,
    experts: usize,
    entries: Vec<VqLayerEntry>,
}

impl RecordSink {
    /// Appends the record of the next expert of decoder layer `layer`, whose checksum
    /// ([`record_checksum`]) is `checksum`: computed by the caller, where records are
    /// made in parallel.
    pub(crate) fn push(
        &mut self,
        layer: usize,
        record: &[u8],
        checksum: String,
    ) -> Result<(), Error> {
        let path = self.out.get_ref().path();
        if record.len() != self.layout.record_size {
            return Err(Error::Unusable {
                path: path.to_path_buf(),
                reason: format!(
                    "a record of {} bytes, the layout's are {}",
                    record.len(),
                    self.layout.record_size
                ),
            });
        }
        let open = self
            .entries
            .last()
            .is_some_and(|e| e.checksums.len() < self.experts);
        match self.entries.last() {
            Some(e) if open && e.layer != layer => {
                return Err(Error::BadShape {
                    reason: format!(
                        "{}: layer {layer} begins after {} of layer {}'s {} experts",
                        path.display(),
                        e.checksums.len(),
                        e.layer,
                        self.experts
                    ),
                })
            }
            Some(e) if !open && e.layer >= layer => {
                return Err(Error::BadShape {
                    reason: format!(
                        "{}: layer {layer} after layer {}: layers must ascend",
                        path.display(),
                        e.layer
                    ),
                })
            }
            _ if open => {}
            _ => self.entries.push(VqLayerEntry {
                layer,
                offset: self.layout.record_offset(self.entries.len() * self.experts),
                checksums: Vec::with_capacity(self.experts),
            }),
        }
        if let Err(source) = self.out.write_all(record) {
            let path = self.out.get_ref().path().to_path_buf();
            return Err(Error::Io { path, source });
        }
        self.entries
            .last_mut()
            .expect("an entry was opened above")
            .checksums
            .push(checksum);
        Ok(())
    }
}

/// Writes `rung`'s store (`layout.rung`) into `dir` from the records `fill` appends,
/// the way every VQ store is written: the manifest removed first (its removal flushed),
/// the data file written to a temporary name, flushed and renamed, then the manifest,
/// naming `model`, `source` and the note `fill` returns. A crash leaves at worst a data
/// file without a manifest, which is never used. Call under the directory's exclusive
/// lock. Returns the manifest written.
pub(crate) fn write_store(
    dir: &Path,
    layout: &VqLayout,
    experts: usize,
    model: ModelInfo,
    source: Source,
    fill: impl FnOnce(&mut RecordSink) -> Result<String, Error>,
) -> Result<VqManifest, Error> {
    let rung = layout.rung;
    let manifest_path = dir.join(manifest_file_name(rung));
    let path = dir.join(data_file_name(rung));
    let codebook = codebook_id(rung).map_err(|reason| Error::Unusable {
        path: path.clone(),
        reason,
    })?;
    atomic::remove_committed(&manifest_path)?;
    let mut sink = RecordSink {
        out: BufWriter::with_capacity(4 << 20, TempOutput::create(&path)?),
        layout: *layout,
        experts,
        entries: Vec::new(),
    };
    let note = fill(&mut sink)?;
    let RecordSink { out, entries, .. } = sink;
    if entries.is_empty() || entries.iter().any(|e| e.checksums.len() != experts) {
        return Err(Error::BadShape {
            reason: format!(
                "{}: every layer needs its {experts} experts; written: {:?}",
                path.display(),
                entries
                    .iter()
                    .map(|e| (e.layer, e.checksums.len()))
                    .collect::<Vec<_>>()
            ),
        });
    }
    atomic::commit_buffered(out)?;
    let total = entries.len() * experts;
    let manifest = VqManifest {
        format: FORMAT.to_string(),
        version: VERSION,
        file: data_file_name(rung),
        rung: rung.name(),
        dim: rung.dim,
        index_bits: rung.index_bits,
        codebook,
        page: PAGE,
        header: HEADER,
        hidden: layout.hidden,
        intermediate: layout.intermediate,
        experts_per_layer: experts,
        seed: SEED_RULE.to_string(),
        record_size: layout.record_size as u64,
        record_count: total as u64,
        file_size: layout.file_size(total),
        layers: entries,
        model,
        source,
        created: Created::now(&note),
    };
    atomic::write_file(&manifest_path, &manifest.to_bytes())?;
    Ok(manifest)
}
