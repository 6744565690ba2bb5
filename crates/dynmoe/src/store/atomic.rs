//! Crash-safe writes and the directory lock.
//!
//! Every file a later run trusts is written to a temporary name in the same directory,
//! flushed to disk, renamed over its final name, and the directory is flushed, so a
//! crash leaves either the old file or the new one, never a prefix of the new one under
//! the real name. A store's manifest is its commit mark: it is removed before the data
//! file is replaced and written after, so a data file is only trusted with a manifest
//! written after it.
//!
//! Writers (conversion and low-bit builds) hold an exclusive lock on `experts.lock` in
//! the store's directory while they check and build; readers hold a shared lock while
//! they check and map. The lock file itself is never removed: removing it would let two
//! processes lock two different files of the same name.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::Error;

/// The lock file's name.
pub const LOCK_FILE: &str = "experts.lock";

/// Marks temporary files: `.{final name}.tmp.{pid}.{n}`.
const TMP_MARK: &str = ".tmp.";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a mapped file was when it was mapped: its size and modification time. A writer
/// of dynmoe never changes a committed file in place (it renames a new one over it, which
/// leaves a mapping intact, and changes only the old file's change time, not these);
/// anything else that does (`cp` over it, `truncate`) changes them, and a reader that
/// compares them before reading the mapping again stops with [`Error::Changed`] instead
/// of reading garbage or dying of SIGBUS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    len: u64,
    mtime: (i64, i64),
}

impl FileStamp {
    /// The stamp of the open `file` (`path` names it in errors).
    pub fn of(file: &File, path: &Path) -> Result<FileStamp, Error> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata().map_err(io(path))?;
        Ok(FileStamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
        })
    }

    /// [`Error::Changed`] if `file` is no longer what this stamp recorded.
    pub fn check(&self, file: &File, path: &Path) -> Result<(), Error> {
        let now = FileStamp::of(file, path)?;
        if now == *self {
            return Ok(());
        }
        let what = if now.len != self.len {
            format!("{} bytes when opened, {} now", self.len, now.len)
        } else {
            "rewritten in place since it was opened".to_string()
        };
        Err(Error::Changed {
            path: path.to_path_buf(),
            what,
        })
    }
}

/// Opens `path` for reading if it is a regular file (`checkpoint::open_regular`): a FIFO
/// or device is [`Error::NotRegular`], a missing file [`Error::Missing`].
pub fn open_regular(path: &Path) -> Result<File, Error> {
    crate::checkpoint::open_regular(path).map_err(regular_error)
}

/// A reading error of `checkpoint::open_regular` or `read_regular` as the store names it.
pub(crate) fn regular_error(e: crate::checkpoint::Error) -> Error {
    match e {
        crate::checkpoint::Error::NotRegular { path } => Error::NotRegular { path },
        crate::checkpoint::Error::Io { path, source } => match source.kind() {
            std::io::ErrorKind::NotFound => Error::Missing { path },
            _ => Error::Io { path, source },
        },
        e => e.into(),
    }
}

/// A temporary name beside `path`, unique within this process and across processes.
fn temp_path(path: &Path) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    path.with_file_name(format!(
        ".{name}{TMP_MARK}{}.{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A file being written under a temporary name beside its final one. [`commit`]
/// flushes it to disk and renames it into place; dropping it uncommitted removes it.
///
/// [`commit`]: TempOutput::commit
#[derive(Debug)]
pub struct TempOutput {
    file: Option<File>,
    tmp: PathBuf,
    path: PathBuf,
}

impl TempOutput {
    /// Creates the temporary file for `path`.
    pub fn create(path: &Path) -> Result<TempOutput, Error> {
        let tmp = temp_path(path);
        let file = File::create(&tmp).map_err(io(&tmp))?;
        Ok(TempOutput {
            file: Some(file),
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// The final path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes the file to disk, renames it to its final name and flushes the directory.
    pub fn commit(mut self) -> Result<(), Error> {
        let mut file = self.file.take().expect("not yet committed");
        file.flush().map_err(io(&self.tmp))?;
        file.sync_all().map_err(io(&self.tmp))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path).map_err(io(&self.path))?;
        sync_dir(&self.path)
    }
}

/// Flushes a buffered [`TempOutput`] and commits it; an error names its final path.
pub fn commit_buffered(out: std::io::BufWriter<TempOutput>) -> Result<(), Error> {
    let path = out.get_ref().path().to_path_buf();
    out.into_inner()
        .map_err(|e| Error::Io {
            path,
            source: e.into_error(),
        })?
        .commit()
}

impl Write for TempOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.as_mut().expect("not yet committed").write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.file
            .as_mut()
            .expect("not yet committed")
            .write_all(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.as_mut().expect("not yet committed").flush()
    }
}

impl Drop for TempOutput {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `path` atomically: `write` fills a temporary file in the same directory,
/// which is then flushed, renamed to `path`, and the directory flushed. On any error
/// the temporary file is removed and `path` is left as it was.
pub fn create_output<T>(
    path: &Path,
    write: impl FnOnce(&mut TempOutput) -> Result<T, Error>,
) -> Result<T, Error> {
    let mut out = TempOutput::create(path)?;
    let value = write(&mut out)?;
    out.commit()?;
    Ok(value)
}

/// Writes `bytes` to `path` atomically.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    create_output(path, |f| f.write_all(bytes).map_err(io(path)))
}

/// Removes `path` if it exists and flushes the directory, so that the removal is on
/// disk before whatever the caller does next.
pub fn remove_committed(path: &Path) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Ok(()) => sync_dir(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(path)(e)),
    }
}

/// Flushes the directory holding `path`, making a rename or removal in it durable.
fn sync_dir(path: &Path) -> Result<(), Error> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // Directories cannot be opened for flushing on every platform; where they can
    // (Unix), a failure is a real I/O error.
    if cfg!(unix) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io(dir))?;
    }
    Ok(())
}

/// Removes temporary files that a killed writer left in `dir`. Only call this while
/// holding the exclusive lock: then no live writer owns any of them.
pub fn remove_stale_temps(dir: &Path) -> Result<(), Error> {
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if is_temp_name(&name) {
            std::fs::remove_file(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

/// Whether `name` has the form of [`temp_path`]'s names: `.{name}.tmp.{pid}.{n}`.
fn is_temp_name(name: &str) -> bool {
    let Some((stem, tail)) = name.rsplit_once(TMP_MARK) else {
        return false;
    };
    let numbers: Vec<&str> = tail.split('.').collect();
    stem.starts_with('.')
        && stem.len() > 1
        && numbers.len() == 2
        && numbers
            .iter()
            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A held lock on a store directory; released when dropped.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// Takes the exclusive lock on `dir`, waiting for other holders.
pub fn lock_exclusive(dir: &Path) -> Result<DirLock, Error> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io(&path))?;
    file.lock().map_err(io(&path))?;
    Ok(DirLock { _file: file })
}

/// Takes a shared lock on `dir`, waiting for an exclusive holder to finish. Returns
/// `None` where the lock file cannot be created (a read-only directory): no writer can
/// change such a directory either.
pub fn lock_shared(dir: &Path) -> Result<Option<DirLock>, Error> {
    let path = dir.join(LOCK_FILE);
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .or_else(|_| File::open(&path));
    let file = match opened {
        Ok(f) => f,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::PermissionDenied
                    | std::io::ErrorKind::ReadOnlyFilesystem
                    | std::io::ErrorKind::NotFound
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(io(&path)(e)),
    };
    file.lock_shared().map_err(io(&path))?;
    Ok(Some(DirLock { _file: file }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dynmoe-atomic-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn failed_write_leaves_old_file_and_no_temp() {
        let dir = scratch("fail");
        let path = dir.join("experts.json");
        write_file(&path, b"old").unwrap();
        let err = create_output(&path, |f| {
            f.write_all(b"half").unwrap();
            Err::<(), _>(Error::Missing { path: path.clone() })
        });
        assert!(err.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("experts.json")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stale_temps_are_removed() {
        let dir = scratch("stale");
        std::fs::write(dir.join(".experts2.bin.tmp.1.0"), b"x").unwrap();
        std::fs::write(dir.join("experts2.bin"), b"y").unwrap();
        remove_stale_temps(&dir).unwrap();
        assert!(!dir.join(".experts2.bin.tmp.1.0").exists());
        assert!(dir.join("experts2.bin").exists());
        assert!(is_temp_name(".config.json.tmp.12.3"));
        assert!(!is_temp_name(".config.json.tmp.12"));
        assert!(!is_temp_name("config.json.tmp.1.2"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
