//! Probe results survive an interrupted `compress`: each loss is appended to a journal
//! and flushed to disk as soon as it is measured, and a rerun answers every probe it
//! already has from the journal. A crash mid-write leaves at most one torn last line,
//! which is ignored.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::isp::{Prober, Setting};
use crate::store::journal::{Journal, Skipped};

/// One journal entry (besides its context: model, calibration text).
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    /// The settings, canonically spelled.
    key: String,
    /// The measured loss.
    loss: f64,
}

/// The canonical spelling of a configuration.
pub fn key(settings: &[Setting]) -> String {
    settings
        .iter()
        .map(|s| format!("{}:{:.6}", s.codec, s.removed))
        .collect::<Vec<_>>()
        .join(",")
}

/// A [`Prober`] that consults and extends a journal of earlier results.
pub struct CachedProber<P> {
    inner: P,
    journal: Journal,
    known: Mutex<HashMap<String, f64>>,
    hits: std::sync::atomic::AtomicUsize,
    skipped: Skipped,
}

/// Why the journal could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError<E> {
    /// The journal could not be opened or written.
    #[error("{path}: {source}")]
    Io {
        /// The journal.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The wrapped prober failed.
    #[error("{0}")]
    Probe(E),
}

impl<P: Prober> CachedProber<P> {
    /// Opens (or creates) the journal at `path`. Only lines recorded under the same
    /// `context` are reused, so a journal left by another model or calibration text is
    /// never trusted; [`CachedProber::skipped`] says what was left out.
    pub fn open(inner: P, path: &Path, context: &str) -> Result<Self, CacheError<P::Error>> {
        let (journal, reopened) =
            Journal::open::<Entry>(path, context).map_err(|source| CacheError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        let known = reopened
            .entries
            .into_iter()
            .filter(|e| e.loss.is_finite())
            .map(|e| (e.key, e.loss))
            .collect();
        Ok(CachedProber {
            inner,
            journal,
            known: Mutex::new(known),
            hits: Default::default(),
            skipped: reopened.skipped,
        })
    }

    /// The journal's lines that were not reused: of other contexts, or untrusted.
    pub fn skipped(&self) -> &Skipped {
        &self.skipped
    }

    /// Probes answered from the journal so far.
    pub fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The wrapped prober.
    pub fn inner(&self) -> &P {
        &self.inner
    }
}

impl<P: Prober> Prober for CachedProber<P> {
    type Error = CacheError<P::Error>;

    fn loss(&self, settings: &[Setting]) -> Result<f64, Self::Error> {
        let k = key(settings);
        if let Some(&l) = self.known.lock().unwrap_or_else(|e| e.into_inner()).get(&k) {
            self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(l);
        }
        let loss = self.inner.loss(settings).map_err(CacheError::Probe)?;
        let entry = Entry {
            key: k.clone(),
            loss,
        };
        self.journal
            .append(&entry)
            .map_err(|source| CacheError::Io {
                path: self.journal.path().to_path_buf(),
                source,
            })?;
        self.known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(k, loss);
        Ok(loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TempDir;
    use std::fs::OpenOptions;
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counting(AtomicUsize);

    impl Prober for Counting {
        type Error = ();
        fn loss(&self, s: &[Setting]) -> Result<f64, ()> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(s.iter().map(|x| x.codec as f64 + x.removed).sum())
        }
    }

    fn config(c: usize) -> Vec<Setting> {
        vec![
            Setting {
                codec: c,
                removed: 0.25,
            };
            3
        ]
    }

    #[test]
    fn reruns_reuse_results_and_ignore_torn_or_foreign_lines() {
        let dir = TempDir::new("probe-cache");
        let path = dir.path("probes.jsonl");
        let first = CachedProber::open(Counting(AtomicUsize::new(0)), &path, "model-a").unwrap();
        for c in 0..3 {
            first.loss(&config(c)).unwrap();
        }
        assert_eq!(first.inner().0.load(Ordering::Relaxed), 3);
        drop(first);
        // A crash mid-append leaves a torn line.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"context\":\"model-a\",\"key\":\"9:0.0")
            .unwrap();
        drop(f);

        let again = CachedProber::open(Counting(AtomicUsize::new(0)), &path, "model-a").unwrap();
        for c in 0..4 {
            assert_eq!(again.loss(&config(c)).unwrap(), 3.0 * (c as f64 + 0.25));
        }
        assert_eq!(
            (again.hits(), again.inner().0.load(Ordering::Relaxed)),
            (3, 1)
        );
        drop(again);

        // Another context trusts nothing, and says so; the journal still parses line by line.
        let other = CachedProber::open(Counting(AtomicUsize::new(0)), &path, "model-b").unwrap();
        other.loss(&config(0)).unwrap();
        assert_eq!(other.hits(), 0);
        assert_eq!(other.skipped().other_contexts["model-a"], 4);
        let lines = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            lines
                .lines()
                .filter(|l| serde_json::from_str::<Entry>(l).is_ok())
                .count(),
            5
        );
    }
}
