//! Append-only JSON-lines journals of measured results (probe losses, benchmark rows),
//! so that interrupted work resumes where it stopped.
//!
//! Every line names the context it was measured in (model, texts, settings); reopening
//! returns only the lines of the same context, so results of another model or text are
//! never trusted. Each line ends with a checksum of the rest of it, so a line changed on
//! disk is told from a good one. Each line is synced as it is written, so a crash loses
//! at most the line being written: a torn last line is cut off on reopening.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::manifest::Fnv64;

/// One line: the context and the entry's own fields beside it.
#[derive(Serialize, Deserialize)]
struct Line<T> {
    context: String,
    #[serde(flatten)]
    entry: T,
}

/// How a line ends: `,"sum":"fnv1a64:` and 16 hex digits of the hash of the line written
/// without it, then `"}`. Kept inside the JSON object so a line stays plain JSON.
const SUM_OPEN: &str = ",\"sum\":\"";
const SUM_LEN: usize = SUM_OPEN.len() + "fnv1a64:".len() + 16 + "\"}".len();

/// What reopening left out, besides the entries it returned.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Lines recorded under another context, counted by context.
    pub other_contexts: BTreeMap<String, usize>,
    /// Line numbers (from 1) that are damaged: not JSON, a checksum that does not match
    /// the line, or not an entry of this journal's kind.
    pub damaged: Vec<usize>,
    /// Lines without a checksum, written before lines carried one: nothing tells a good
    /// one from one changed on disk, so none is used.
    pub unchecked: usize,
    /// Whether a torn last line (a crash mid-write) was cut off.
    pub torn: bool,
}

impl Skipped {
    /// Lines that were left out because they could not be trusted as written.
    pub fn untrusted(&self) -> usize {
        self.damaged.len() + self.unchecked
    }
}

/// A journal's earlier entries under one context, and what was left out.
#[derive(Debug)]
pub struct Reopened<T> {
    /// Entries recorded under the same context, oldest first.
    pub entries: Vec<T>,
    /// What was not returned, and why.
    pub skipped: Skipped,
}

/// An open journal.
pub struct Journal {
    path: PathBuf,
    context: String,
    file: Mutex<File>,
}

/// Checks one line's checksum; returns the line as written before it was added.
fn verified(line: &str) -> Option<String> {
    let cut = line.len().checked_sub(SUM_LEN)?;
    let (body, tail) = (line.get(..cut)?, line.get(cut..)?);
    let sum = tail.strip_prefix(SUM_OPEN)?.strip_suffix("\"}")?;
    let body = format!("{body}}}");
    (Fnv64::default().bytes(body.as_bytes()).hex() == sum).then_some(body)
}

impl Journal {
    /// Opens (or creates) the journal at `path` for `context`; returns it with the
    /// entries recorded earlier under the same context, oldest first, and an account of
    /// the lines left out (see [`Skipped`]).
    pub fn open<T: DeserializeOwned>(
        path: &Path,
        context: &str,
    ) -> std::io::Result<(Journal, Reopened<T>)> {
        let mut entries = Vec::new();
        let mut skipped = Skipped::default();
        // Bytes, not text: a write torn inside a multi-byte character must not make the
        // whole journal unreadable.
        match std::fs::read(path) {
            Ok(bytes) => {
                // A torn last line would glue itself to the next entry: cut it off.
                let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
                if whole < bytes.len() {
                    OpenOptions::new()
                        .write(true)
                        .open(path)?
                        .set_len(whole as u64)?;
                    skipped.torn = true;
                }
                let text = String::from_utf8_lossy(&bytes[..whole]);
                for (n, l) in text.lines().enumerate() {
                    if l.trim().is_empty() {
                        continue;
                    }
                    let Some(body) = verified(l) else {
                        let old = serde_json::from_str::<serde_json::Value>(l)
                            .is_ok_and(|v| v.is_object() && v.get("sum").is_none());
                        if old {
                            skipped.unchecked += 1;
                        } else {
                            skipped.damaged.push(n + 1);
                        }
                        continue;
                    };
                    match serde_json::from_str::<Line<T>>(&body) {
                        Ok(line) if line.context == context => entries.push(line.entry),
                        Ok(line) => *skipped.other_contexts.entry(line.context).or_default() += 1,
                        Err(_) => skipped.damaged.push(n + 1),
                    }
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
            Reopened { entries, skipped },
        ))
    }

    /// Appends `entry` and syncs it to disk.
    pub fn append<T: Serialize>(&self, entry: &T) -> std::io::Result<()> {
        let line = Line {
            context: self.context.clone(),
            entry,
        };
        let body = serde_json::to_string(&line).map_err(std::io::Error::other)?;
        let sum = Fnv64::default().bytes(body.as_bytes()).hex();
        let text = format!("{}{SUM_OPEN}{sum}\"}}\n", &body[..body.len() - 1]);
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
    fn entries_survive_reopening_by_context_and_a_torn_line_is_cut_off() {
        let dir = TempDir::new("journal");
        let path = dir.path("j.jsonl");
        let (j, old) = Journal::open::<Entry>(&path, "model a").unwrap();
        assert!(old.entries.is_empty());
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
        assert_eq!(old.entries, vec![entry("x", 1.5), entry("y", 2.5)]);
        assert!(old.skipped.torn);
        assert_eq!(old.skipped.other_contexts["model b"], 1);
        j.append(&entry("z", 3.5)).unwrap();
        let (_, old) = Journal::open::<Entry>(&path, "model a").unwrap();
        let want = vec![entry("x", 1.5), entry("y", 2.5), entry("z", 3.5)];
        assert_eq!(old.entries, want);
        assert_eq!(old.skipped.untrusted(), 0, "{:?}", old.skipped);
        assert!(!old.skipped.torn);
        let (_, b) = Journal::open::<Entry>(&path, "model b").unwrap();
        assert_eq!(b.entries, vec![entry("x", 9.0)]);
        assert_eq!(b.skipped.other_contexts["model a"], 3);
    }

    #[test]
    fn a_line_changed_on_disk_or_without_a_checksum_is_not_trusted() {
        let dir = TempDir::new("journal-damage");
        let path = dir.path("j.jsonl");
        let (j, _) = Journal::open::<Entry>(&path, "m").unwrap();
        for (k, v) in [("a", 1.0), ("b", 2.0), ("c", 3.0)] {
            j.append(&entry(k, v)).unwrap();
        }
        drop(j);
        let text = std::fs::read_to_string(&path).unwrap();
        // One digit of the second value changed, and a line as journals wrote them before
        // they carried checksums.
        let changed = text.replacen("\"value\":2.0", "\"value\":7.0", 1);
        assert_ne!(changed, text);
        let old = "{\"context\":\"m\",\"key\":\"d\",\"value\":4.0}\n";
        std::fs::write(&path, format!("{changed}not json\n{old}")).unwrap();
        let (_, r) = Journal::open::<Entry>(&path, "m").unwrap();
        assert_eq!(r.entries, vec![entry("a", 1.0), entry("c", 3.0)]);
        assert_eq!(r.skipped.damaged, vec![2, 4]);
        assert_eq!(r.skipped.unchecked, 1);
        assert_eq!(r.skipped.untrusted(), 3);
        // A good line of another kind is no entry of this journal either.
        #[derive(Debug, Deserialize)]
        struct Other {
            #[allow(dead_code)]
            other: u8,
        }
        let (_, r) = Journal::open::<Other>(&path, "m").unwrap();
        assert!(r.entries.is_empty());
        assert_eq!(r.skipped.damaged, vec![1, 2, 3, 4]);
    }
}
