//! One live run per working folder or ledger: an exclusive advisory lock
//! (`flock`) on a lock file, held for the life of the process. The kernel
//! drops it when the process ends, however it ends, so a crash leaves no
//! stale lock behind; the file records who holds it, so a refusal can name
//! the holder.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// A lock that another live process holds, or a lock file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{path} is in use by a live run ({holder}); stop it first, or use another folder")]
    Held { path: PathBuf, holder: String },
    #[error("cannot lock {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// An exclusive lock, released when dropped (or when the process ends).
#[derive(Debug)]
pub struct ExclusiveLock {
    _file: File,
    path: PathBuf,
}

impl ExclusiveLock {
    /// Takes the lock file `path` (created if missing), recording `what`
    /// holds it (with this process's pid, host and start time); refuses
    /// with the recorded holder when another live process has it.
    pub fn acquire(path: &Path, what: &str) -> Result<Self, LockError> {
        let io = |source| LockError::Io { path: path.to_path_buf(), source };
        let mut file =
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path).map_err(io)?;
        // SAFETY: flock on a file descriptor this function owns for the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::WouldBlock {
                return Err(io(err));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() { "holder unknown".to_string() } else { holder.to_string() };
            return Err(LockError::Held { path: path.to_path_buf(), holder });
        }
        let host = hostname::get().map(|h| h.to_string_lossy().into_owned()).unwrap_or_else(|_| "?".into());
        let since =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default();
        let record = format!("{what}, pid {} on {host}, since unix time {since}\n", std::process::id());
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(record.as_bytes()).map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(Self { _file: file, path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_named_and_takes_it_once_released() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.lock");
        let first = ExclusiveLock::acquire(&path, "dflash up --workdir w").unwrap();
        // flock locks belong to open files: a second open in this process
        // is refused as another process would be.
        let err = ExclusiveLock::acquire(&path, "another").unwrap_err().to_string();
        assert!(err.contains("dflash up --workdir w") && err.contains(&format!("pid {}", std::process::id())), "{err}");
        assert!(err.contains("run.lock"), "{err}");
        drop(first);
        let again = ExclusiveLock::acquire(&path, "the next run").unwrap();
        assert_eq!(again.path(), path);
        assert!(std::fs::read_to_string(&path).unwrap().starts_with("the next run"));
    }
}
