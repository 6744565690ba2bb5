//! Append-only JSON-lines journals of measured results (probe losses, benchmark rows),
//! so that interrupted work resumes where it stopped.
//!
//! Every line names the context it was measured in (model, texts, settings); reopening
//! returns only the lines of the same context, so results of another model or text are
//! never trusted. Each line is synced as it is written, so a crash loses at most the
//! line being written: a torn last line is ended on reopening and ignored.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// One line: the context and the entry's own fields beside it.
#[derive(Serialize, Deserialize)]
struct Line<T> {
    context: String,
    #[serde(flatten)]
    entry: T,
}

/// An open journal.
pub struct Journal {
    path: PathBuf,
    context: String,
    file: Mutex<File>,
}

impl Journal {
    /// Opens (or creates) the journal at `path` for `context`; returns it with the
    /// entries recorded earlier under the same context, oldest first. Lines that do not
    /// parse as `T` (torn, or of another kind) are skipped.
    pub fn open<T: DeserializeOwned>(
        path: &Path,
        context: &str,
    ) -> std::io::Result<(Journal, Vec<T>)> {
        let mut entries = Vec::new();
        // Bytes, not text: a write torn inside a multi-byte character must not make the
        // whole journal unreadable.
        match std::fs::read(path) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                entries.extend(
                    text.lines()
                        .filter_map(|l| serde_json::from_str::<Line<T>>(l).ok())
                        .filter(|l| l.context == context)
                        .map(|l| l.entry),
                );
                // A torn last line would glue itself to the next entry: end it first.
                if !text.is_empty() && !text.ends_with('\n') {
                    OpenOptions::new()
                        .append(true)
                        .open(path)?
                        .write_all(b"\n")?;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok((
            Journal {
                path: path.to_path_buf(),
                context: context.to_string(),
                file: Mutex::new(file),
            },
            entries,
        ))
    }

    /// Appends `entry` and syncs it to disk.
    pub fn append<T: Serialize>(&self, entry: &T) -> std::io::Result<()> {
        let line = Line {
            context: self.context.clone(),
            entry,
        };
        let mut text = serde_json::to_string(&line).map_err(std::io::Error::other)?;
        text.push('\n');
        let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
        f.write_all(text.as_bytes())?;
        f.sync_data()
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TempDir;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Entry {
        key: String,
        value: f64,
    }

    fn entry(key: &str, value: f64) -> Entry {
        Entry {
            key: key.into(),
            value,
        }
    }

    #[test]
    fn entries_survive_reopening_by_context_and_a_torn_line_is_dropped() {
        let dir = TempDir::new("journal");
        let path = dir.path("j.jsonl");
        let (j, old) = Journal::open::<Entry>(&path, "model a").unwrap();
        assert!(old.is_empty());
        j.append(&entry("x", 1.5)).unwrap();
        j.append(&entry("y", 2.5)).unwrap();
        let (other, _) = Journal::open::<Entry>(&path, "model b").unwrap();
        other.append(&entry("x", 9.0)).unwrap();
        drop((j, other));
        // A crash mid-write.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"context":"model a","key":"z","val"#)
            .unwrap();
        drop(f);

        let (j, old) = Journal::open::<Entry>(&path, "model a").unwrap();
        assert_eq!(old, vec![entry("x", 1.5), entry("y", 2.5)]);
        j.append(&entry("z", 3.5)).unwrap();
        let (_, old) = Journal::open::<Entry>(&path, "model a").unwrap();
        assert_eq!(old, vec![entry("x", 1.5), entry("y", 2.5), entry("z", 3.5)]);
        let (_, b) = Journal::open::<Entry>(&path, "model b").unwrap();
        assert_eq!(b, vec![entry("x", 9.0)]);
    }
}
