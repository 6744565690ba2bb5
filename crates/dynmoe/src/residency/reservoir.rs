//! Where non-resident experts live, and the loader threads that bring them into a spare
//! slot without the decode loop waiting.
//!
//! A record is whatever one expert is at its layer's codec: for a checkpoint layer the
//! three projections as stored (bf16, f16 or f32), widened to f32 in the slot; for an
//! expert-store layer the whole record (affine: codes, scales, biases; VQ: header, codes,
//! norms), copied as is.
//! The reservoir holds every record in RAM, or reads it from the file it already lives
//! in (the checkpoint shard, or the expert store itself). Disk reads bypass the page
//! cache (`O_DIRECT`, whole aligned blocks through a bounce buffer) where the file system
//! allows it, so what streams from disk is read from the disk, not from memory a warm
//! cache lends; elsewhere (tmpfs, say) they are plain `pread`s.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::Serialize;

use super::Error;

use crate::checkpoint::widen;
use crate::store::records::{words_as_bytes_mut, Buffer, LayerSource, RecordFormat};

/// Where the reservoir keeps non-resident experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReservoirKind {
    /// A copy of every record in host memory.
    Ram,
    /// The files the records already live in, read past the page cache where the file
    /// system allows it.
    Disk,
}

/// Alignment of `O_DIRECT` reads: offset, length and buffer in whole blocks of this (the
/// largest logical block size of common devices).
const DIRECT_ALIGN: usize = 4096;

/// A buffer whose usable part starts on a [`DIRECT_ALIGN`] boundary, reused by each
/// loader thread.
#[derive(Default)]
struct Bounce {
    bytes: Vec<u8>,
}

impl Bounce {
    /// `len` bytes starting on an aligned address.
    fn aligned(&mut self, len: usize) -> &mut [u8] {
        if self.bytes.len() < len + DIRECT_ALIGN {
            self.bytes = vec![0u8; len + DIRECT_ALIGN];
        }
        let skip = self.bytes.as_ptr().align_offset(DIRECT_ALIGN);
        &mut self.bytes[skip..skip + len]
    }
}

thread_local! {
    static BOUNCE: RefCell<Bounce> = RefCell::new(Bounce::default());
}

/// A file's second handle opened with `O_DIRECT`, while the file system takes it.
struct Direct {
    file: Option<File>,
    /// Cleared at the first read the file system refuses (EINVAL): from then on, plain
    /// reads.
    works: AtomicBool,
}

impl Direct {
    fn open(path: &Path) -> Direct {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok();
        Direct {
            works: AtomicBool::new(file.is_some()),
            file,
        }
    }

    /// Reads `out.len()` bytes at `offset` through the aligned blocks that hold them;
    /// `None` when this file takes no direct reads (the caller reads plainly).
    fn read(&self, out: &mut [u8], offset: u64) -> Option<std::io::Result<()>> {
        let file = self
            .file
            .as_ref()
            .filter(|_| self.works.load(Ordering::Relaxed))?;
        let a = DIRECT_ALIGN as u64;
        let start = offset / a * a;
        let end = (offset + out.len() as u64).div_ceil(a) * a;
        let skip = (offset - start) as usize;
        BOUNCE.with(|b| {
            let mut b = b.borrow_mut();
            let block = b.aligned((end - start) as usize);
            // The last block may run past the end of the file: a short read is fine as
            // long as it covers the bytes asked for.
            let mut got = 0;
            while got < skip + out.len() {
                match file.read_at(&mut block[got..], start + got as u64) {
                    Ok(0) => {
                        return Some(Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the file ends before the record",
                        )))
                    }
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) && got == 0 => {
                        self.works.store(false, Ordering::Relaxed);
                        return None;
                    }
                    Err(e) => return Some(Err(e)),
                }
            }
            out.copy_from_slice(&block[skip..skip + out.len()]);
            Some(Ok(()))
        })
    }
}

struct LayerReservoir {
    format: RecordFormat,
    /// Per expert, the checksum its record must have (records of expert stores).
    checksums: Option<Vec<String>>,
    /// Per expert, runs as (file index, offset, length).
    runs: Vec<Vec<(usize, u64, usize)>>,
    /// Per expert, the record's bytes (RAM reservoir).
    ram: Vec<Vec<u8>>,
}

/// Files kept open by a disk reservoir, shared by all layers.
struct Files {
    paths: Vec<PathBuf>,
    files: Vec<File>,
    direct: Vec<Direct>,
}

impl Files {
    fn index(&mut self, path: &Path) -> Result<usize, Error> {
        if let Some(i) = self.paths.iter().position(|p| p == path) {
            return Ok(i);
        }
        let file = File::open(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        self.paths.push(path.to_path_buf());
        self.files.push(file);
        self.direct.push(Direct::open(path));
        Ok(self.files.len() - 1)
    }
}

/// Every non-resident expert, in RAM or on disk; shared with the loader threads.
pub struct Reservoir {
    kind: ReservoirKind,
    layers: BTreeMap<usize, LayerReservoir>,
    files: Vec<File>,
    direct: Vec<Direct>,
    paths: Vec<PathBuf>,
}

impl Reservoir {
    /// A reservoir of `kind` over `sources` (by decoder layer). A RAM reservoir reads
    /// every record once, here; a disk reservoir only checks that each run lies inside
    /// its file.
    pub fn open(
        kind: ReservoirKind,
        sources: &BTreeMap<usize, LayerSource>,
    ) -> Result<Reservoir, Error> {
        let mut files = Files {
            paths: Vec::new(),
            files: Vec::new(),
            direct: Vec::new(),
        };
        let mut layers = BTreeMap::new();
        for (&layer, src) in sources {
            let mut runs = Vec::with_capacity(src.experts.len());
            for (e, extents) in src.experts.iter().enumerate() {
                let total: usize = extents.iter().map(|x| x.len).sum();
                if total != src.format.record_bytes() {
                    return Err(Error::Config(format!(
                        "layer {layer} expert {e}: {total} bytes of record, the format has {}",
                        src.format.record_bytes()
                    )));
                }
                let mut r = Vec::new();
                for x in extents {
                    let i = files.index(&x.file)?;
                    let size = files.files[i]
                        .metadata()
                        .map_err(|source| Error::Io {
                            path: x.file.clone(),
                            source,
                        })?
                        .len();
                    if x.offset + x.len as u64 > size {
                        return Err(Error::Io {
                            path: x.file.clone(),
                            source: std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                format!(
                                    "layer {layer} expert {e} needs bytes {}..{}, the file has {size}",
                                    x.offset,
                                    x.offset + x.len as u64
                                ),
                            ),
                        });
                    }
                    r.push((i, x.offset, x.len));
                }
                runs.push(r);
            }
            layers.insert(
                layer,
                LayerReservoir {
                    format: src.format,
                    checksums: src.checksums.clone(),
                    runs,
                    ram: Vec::new(),
                },
            );
        }
        let mut shared = Reservoir {
            kind,
            layers,
            files: files.files,
            direct: files.direct,
            paths: files.paths,
        };
        if kind == ReservoirKind::Ram {
            let keys: Vec<usize> = shared.layers.keys().copied().collect();
            for layer in keys {
                let n = shared.layers[&layer].runs.len();
                let mut ram = Vec::with_capacity(n);
                for e in 0..n {
                    ram.push(shared.read_raw(layer, e)?);
                }
                shared.layers.get_mut(&layer).expect("layer").ram = ram;
            }
        }
        Ok(shared)
    }

    /// Where the records live.
    pub fn kind(&self) -> ReservoirKind {
        self.kind
    }

    /// The record format of `layer`.
    pub fn format(&self, layer: usize) -> RecordFormat {
        self.layers[&layer].format
    }

    /// Whether disk reads of every file bypass the page cache (false for a RAM reservoir,
    /// or where a file system refused `O_DIRECT`).
    pub fn reads_direct(&self) -> bool {
        self.kind == ReservoirKind::Disk
            && self
                .direct
                .iter()
                .all(|d| d.file.is_some() && d.works.load(Ordering::Relaxed))
    }

    /// Bytes the reservoir holds in RAM.
    pub fn ram_bytes(&self) -> usize {
        self.layers
            .values()
            .flat_map(|l| l.ram.iter().map(Vec::len))
            .sum()
    }

    /// A record's bytes as stored, read from its files and checked against its
    /// checksum.
    fn read_raw(&self, layer: usize, e: usize) -> Result<Vec<u8>, Error> {
        let l = &self.layers[&layer];
        let mut out = vec![0u8; l.format.record_bytes()];
        self.pread(&l.runs[e], &mut out)?;
        self.verify(layer, e, &out)?;
        Ok(out)
    }

    /// Whether `bytes`, just read for expert `e` of `layer`, are the record its store's
    /// manifest summed: a file damaged or replaced in place since is an error, never
    /// weights. Records from a checkpoint carry no checksum and pass.
    fn verify(&self, layer: usize, e: usize, bytes: &[u8]) -> Result<(), Error> {
        let l = &self.layers[&layer];
        let Some(sums) = &l.checksums else {
            return Ok(());
        };
        let found = crate::store::manifest::record_checksum(bytes);
        if found == sums[e] {
            return Ok(());
        }
        let (f, offset, _) = l.runs[e][0];
        Err(Error::Damaged {
            path: self.paths[f].clone(),
            layer,
            expert: e,
            offset,
            found,
            expected: sums[e].clone(),
        })
    }

    /// Reads `runs` into `out`, past the page cache for a disk reservoir where its file
    /// system allows (a RAM reservoir fills itself once, through the cache).
    fn pread(&self, runs: &[(usize, u64, usize)], out: &mut [u8]) -> Result<(), Error> {
        let mut at = 0;
        for &(f, offset, len) in runs {
            let dst = &mut out[at..at + len];
            let direct = match self.kind {
                ReservoirKind::Disk => self.direct[f].read(dst, offset),
                ReservoirKind::Ram => None,
            };
            direct
                .unwrap_or_else(|| self.files[f].read_exact_at(dst, offset))
                .map_err(|source| Error::Io {
                    path: self.paths[f].clone(),
                    source,
                })?;
            at += len;
        }
        Ok(())
    }

    /// Reads expert `e` of `layer` into `buf` (a buffer of the layer's format) and
    /// returns the bytes moved out of the reservoir. `scratch` holds a dense record's
    /// stored bytes on their way to f32.
    pub fn read(
        &self,
        layer: usize,
        e: usize,
        buf: &mut Buffer,
        scratch: &mut Vec<u8>,
    ) -> Result<usize, Error> {
        let l = &self.layers[&layer];
        let n = l.format.record_bytes();
        let ram = self.kind == ReservoirKind::Ram;
        match (l.format, buf) {
            (RecordFormat::Affine(_) | RecordFormat::Vq(_), Buffer::Words(w)) => {
                let dst = &mut words_as_bytes_mut(w)[..n];
                if ram {
                    // Checked when it was read into RAM.
                    dst.copy_from_slice(&l.ram[e]);
                } else {
                    self.pread(&l.runs[e], dst)?;
                    self.verify(layer, e, dst)?;
                }
            }
            (RecordFormat::Dense { dtype, .. }, Buffer::F32(f)) => {
                let src: &[u8] = if ram {
                    &l.ram[e]
                } else {
                    scratch.resize(n, 0);
                    self.pread(&l.runs[e], scratch)?;
                    scratch
                };
                widen(dtype, src, f);
            }
            _ => panic!("a slot buffer of another format for layer {layer}"),
        }
        Ok(n)
    }
}

/// A request to fill `buffer` with expert `expert` of `layer`.
pub struct Job {
    /// Decoder layer.
    pub layer: usize,
    /// Expert id.
    pub expert: u32,
    /// A spare slot buffer, handed to the loader and back.
    pub buffer: Buffer,
}

/// A finished [`Job`].
pub struct Loaded {
    /// Decoder layer.
    pub layer: usize,
    /// Expert id.
    pub expert: u32,
    /// The buffer, filled if `result` is `Ok`.
    pub buffer: Buffer,
    /// Bytes read, or why the read failed.
    pub result: Result<usize, String>,
    /// Seconds the read took.
    pub seconds: f64,
}

/// A pool of loader threads reading the reservoir into spare slots.
pub struct Loader {
    jobs: Option<Sender<Job>>,
    done: Receiver<Loaded>,
    threads: Vec<JoinHandle<()>>,
}

impl Loader {
    /// `threads` loader threads (at least one) over `reservoir`.
    pub fn new(reservoir: Arc<Reservoir>, threads: usize) -> Loader {
        let (jobs, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let (tx, done) = mpsc::channel();
        let threads = (0..threads.max(1))
            .map(|i| {
                let (rx, tx, res) = (rx.clone(), tx.clone(), reservoir.clone());
                std::thread::Builder::new()
                    .name(format!("dynmoe-loader-{i}"))
                    .spawn(move || {
                        let mut scratch = Vec::new();
                        loop {
                            // The lock is held only while taking a job, not while reading.
                            let job = rx.lock().expect("loader queue").recv();
                            let Ok(mut job) = job else { return };
                            let t = Instant::now();
                            let result = res
                                .read(
                                    job.layer,
                                    job.expert as usize,
                                    &mut job.buffer,
                                    &mut scratch,
                                )
                                .map_err(|e| e.to_string());
                            let loaded = Loaded {
                                layer: job.layer,
                                expert: job.expert,
                                buffer: job.buffer,
                                result,
                                seconds: t.elapsed().as_secs_f64(),
                            };
                            if tx.send(loaded).is_err() {
                                return;
                            }
                        }
                    })
                    .expect("spawning a loader thread")
            })
            .collect();
        Loader {
            jobs: Some(jobs),
            done,
            threads,
        }
    }

    /// Queues a load.
    pub fn submit(&self, job: Job) {
        self.jobs
            .as_ref()
            .expect("loader running")
            .send(job)
            .expect("loader threads alive");
    }

    /// Every load finished so far, without waiting.
    pub fn ready(&self) -> Vec<Loaded> {
        self.done.try_iter().collect()
    }

    /// The next finished load, waiting for it (tests and draining only; the forward
    /// pass never waits).
    pub fn wait(&self) -> Loaded {
        self.done.recv().expect("loader threads alive")
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Direct, DIRECT_ALIGN};
    use crate::testing::TempDir;
    use std::os::unix::fs::FileExt;

    #[test]
    fn direct_reads_give_the_bytes_plain_reads_give_at_any_offset_and_length() {
        let dir = TempDir::new("direct");
        let path = dir.path("records.bin");
        // Three blocks and a ragged tail, every byte telling its place.
        let len = 3 * DIRECT_ALIGN + 1234;
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let direct = Direct::open(&path);
        let plain = std::fs::File::open(&path).unwrap();
        let cases = [
            (0, DIRECT_ALIGN),
            (0, 1),
            (17, 4000),
            (DIRECT_ALIGN - 3, 9),
            (DIRECT_ALIGN, 2 * DIRECT_ALIGN),
            (5000, len - 5000),
            (len - 1, 1),
        ];
        let mut took_direct = false;
        for (offset, n) in cases {
            let mut got = vec![0xAAu8; n];
            match direct.read(&mut got, offset as u64) {
                Some(r) => {
                    r.unwrap();
                    took_direct = true;
                }
                None => plain.read_exact_at(&mut got, offset as u64).unwrap(),
            }
            assert_eq!(got, bytes[offset..offset + n], "{n} bytes at {offset}");
        }
        // On a file system that takes O_DIRECT (ext4, xfs) every read above went past the
        // cache; tmpfs refuses it at open or at the first read, and then none does.
        assert_eq!(
            took_direct,
            direct.works.load(std::sync::atomic::Ordering::Relaxed)
        );
        // Past the end of the file is an error, not stale bytes.
        let mut past = vec![0u8; 10];
        if let Some(r) = direct.read(&mut past, len as u64 - 5) {
            assert!(r.is_err());
        }
    }
}
