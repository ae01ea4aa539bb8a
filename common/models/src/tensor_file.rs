//! Files written at the disk's speed with their sha256 computed on the way:
//! safetensors straight from host tensors' memory (no serialized copy of
//! the data), large sequential writes, the hash on a thread of its own over
//! the same bytes while they are written, the disk's writeback kept going
//! from the first piece, one fsync at the end.
//!
//! A checkpoint's manifest takes its digests from here, so its files are
//! not read back to be hashed.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::Digest;
use tch::{Device, Kind, Tensor};

use crate::ModelError;

/// One file's size and sha256.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub bytes: u64,
    pub sha256: String,
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Size and sha256 of a file, read in 8 MiB pieces.
pub fn digest_file(path: &Path) -> Result<FileDigest, ModelError> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileDigest { bytes, sha256: hex(&hasher.finalize()) })
}

/// Writes `bytes` to a new file at `path`, durable, and returns its digest.
pub fn write_file_digested(path: &Path, bytes: &[u8]) -> Result<FileDigest, ModelError> {
    write_pieces(path, &[bytes])
}

/// Bytes handed to the hasher at a time: large enough for sequential
/// writes at the disk's speed, small enough that hashing and writing
/// overlap from the start.
const PIECE: usize = 64 << 20;

/// Pieces queued between the writer and the hasher.
const PIECES_IN_FLIGHT: usize = 4;

/// Writes the concatenation of `parts` to a new file at `path` (one fsync
/// at the end) while another thread hashes the same bytes; returns the
/// file's digest.
fn write_pieces(path: &Path, parts: &[&[u8]]) -> Result<FileDigest, ModelError> {
    let mut file = std::fs::File::create(path).map_err(|e| ModelError::write(path, e))?;
    let (tx, rx) = flume::bounded::<&[u8]>(PIECES_IN_FLIGHT);
    std::thread::scope(|scope| {
        let hasher = std::thread::Builder::new()
            .name("digest".into())
            .spawn_scoped(scope, move || {
                let mut h = sha2::Sha256::new();
                let mut bytes = 0u64;
                for piece in rx.iter() {
                    h.update(piece);
                    bytes += piece.len() as u64;
                }
                FileDigest { bytes, sha256: hex(&h.finalize()) }
            })
            .map_err(|e| ModelError::io(path, e))?;
        let written = (|| {
            let mut writeback = Writeback::default();
            for part in parts {
                for piece in part.chunks(PIECE) {
                    // The hasher ends early only by panicking, which join reports.
                    let _ = tx.send(piece);
                    file.write_all(piece)?;
                    writeback.written(&file, piece.len());
                }
            }
            file.sync_all()
        })();
        drop(tx);
        let digest = hasher.join().map_err(|_| ModelError::Checkpoint("the digest thread panicked".into()))?;
        written.map_err(|e| ModelError::write(path, e))?;
        Ok(digest)
    })
}

/// Keeps the disk writing while the file is written, instead of filling
/// the page cache first and flushing it all at the final fsync (which left
/// the disk idle for the first part of a checkpoint: 62% of its sequential
/// rate for a 15 GB one). Each piece's writeback starts once it is written,
/// and the writer waits for the writeback of the piece two before, so at
/// most three pieces are dirty at a time. It only speeds the write up: on a
/// filesystem that refuses it, it stops, and the final fsync (which reports
/// any real write error) does it all.
#[derive(Default)]
struct Writeback {
    /// Start and length of the pieces whose writeback was started.
    started: std::collections::VecDeque<(u64, usize)>,
    end: u64,
    refused: bool,
}

impl Writeback {
    const IN_FLIGHT: usize = 2;

    #[cfg(target_os = "linux")]
    fn written(&mut self, file: &std::fs::File, len: usize) {
        if !self.refused && self.start(file, len).is_err() {
            self.refused = true;
        }
    }

    #[cfg(target_os = "linux")]
    fn start(&mut self, file: &std::fs::File, len: usize) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let range = |offset: u64, len: usize, flags| {
            // SAFETY: a plain syscall on an open file descriptor.
            let r = unsafe { libc::sync_file_range(file.as_raw_fd(), offset as i64, len as i64, flags) };
            if r == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
        };
        range(self.end, len, libc::SYNC_FILE_RANGE_WRITE)?;
        self.started.push_back((self.end, len));
        self.end += len as u64;
        if self.started.len() > Self::IN_FLIGHT {
            let (offset, len) = self.started.pop_front().expect("a started piece");
            let wait =
                libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            range(offset, len, wait)?;
        }
        Ok(())
    }

    /// Elsewhere the final fsync does it all.
    #[cfg(not(target_os = "linux"))]
    fn written(&mut self, _: &std::fs::File, _: usize) {}
}

/// The safetensors name of a tensor kind.
fn dtype_name(kind: Kind) -> Option<&'static str> {
    Some(match kind {
        Kind::Float => "F32",
        Kind::BFloat16 => "BF16",
        Kind::Half => "F16",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Uint8 => "U8",
        _ => return None,
    })
}

/// A host tensor's bytes. `t` must be a contiguous CPU tensor; the slice
/// lives as long as the borrow of `t`, and nothing writes the tensor
/// meanwhile (the callers own the tensors they write).
fn host_bytes(t: &Tensor) -> &[u8] {
    debug_assert!(t.device() == Device::Cpu && t.is_contiguous());
    let len = t.numel() * t.kind().elt_size_in_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: a contiguous CPU tensor's storage holds numel elements of its
    // kind from data_ptr; `t` outlives the returned borrow.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len) }
}

/// Writes tensors to one safetensors file with `{"format": "pt"}` metadata,
/// as Hugging Face loaders expect: the header, then each tensor's bytes in
/// the order given, straight from host memory (tensors elsewhere, or not
/// contiguous, are copied to the host first). Durable when it returns;
/// returns the file's digest.
pub fn write_safetensors_digested(path: &Path, tensors: &[(String, Tensor)]) -> Result<FileDigest, ModelError> {
    let host: Vec<Tensor> = tensors
        .iter()
        .map(|(_, t)| {
            if t.device() == Device::Cpu && t.is_contiguous() {
                Ok(t.shallow_clone())
            } else {
                Ok(t.f_to_device(Device::Cpu)?.f_contiguous()?)
            }
        })
        .collect::<Result<_, ModelError>>()?;
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for ((name, _), t) in tensors.iter().zip(&host) {
        let dtype = dtype_name(t.kind()).ok_or_else(|| ModelError::Weights {
            path: path.to_path_buf(),
            message: format!("cannot write {name} of kind {:?}", t.kind()),
        })?;
        let len = t.numel() * t.kind().elt_size_in_bytes();
        let entry = serde_json::json!({ "dtype": dtype, "shape": t.size(), "data_offsets": [offset, offset + len] });
        if header.insert(name.clone(), entry).is_some() {
            return Err(ModelError::Weights { path: path.to_path_buf(), message: format!("{name} given twice") });
        }
        offset += len;
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(header)).expect("json");
    // The data starts 8-byte aligned (the format's recommendation): the
    // header is padded with spaces.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut head = (json.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&json);
    let mut parts: Vec<&[u8]> = vec![&head];
    parts.extend(host.iter().map(host_bytes));
    write_pieces(path, &parts)
}

/// Digests of files named by `names` in `dir`, one thread per file.
pub fn digest_files(dir: &Path, names: &[&str]) -> Result<BTreeMap<String, FileDigest>, ModelError> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = names.iter().map(|f| (f, scope.spawn(move || digest_file(&dir.join(f))))).collect();
        handles
            .into_iter()
            .map(|(f, h)| {
                Ok((f.to_string(), h.join().map_err(|_| ModelError::Checkpoint("digest thread panicked".into()))??))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_file_is_read_back_as_written_with_the_digest_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let tensors = vec![
            ("b".to_string(), Tensor::randn([3, 5], (Kind::Float, Device::Cpu))),
            ("a".to_string(), Tensor::randn([7], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16)),
            ("i".to_string(), Tensor::arange(6, (Kind::Int64, Device::Cpu)).view([2, 3]).tr()),
            ("e".to_string(), Tensor::zeros([0, 4], (Kind::Float, Device::Cpu))),
        ];
        let digest = write_safetensors_digested(&path, &tensors).unwrap();
        assert_eq!(digest, digest_file(&path).unwrap());
        let bytes = std::fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!((8 + header_len) % 8, 0, "the data starts 8-byte aligned");
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
        let read = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in &tensors {
            let view = read.tensor(name).unwrap();
            let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
            assert_eq!(view.shape(), shape.as_slice(), "{name}");
            assert_eq!(view.data(), host_bytes(&t.contiguous()), "{name}");
        }
    }

    #[test]
    fn a_file_of_many_pieces_has_the_digest_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big");
        let bytes: Vec<u8> = (0..PIECE * 2 + 12345).map(|i| (i * 31 % 251) as u8).collect();
        let digest = write_file_digested(&path, &bytes).unwrap();
        assert_eq!(digest.bytes, bytes.len() as u64);
        assert_eq!(digest, digest_file(&path).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    #[test]
    fn a_kind_safetensors_cannot_hold_and_a_name_given_twice_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        let bad = vec![("flag".to_string(), Tensor::ones([2], (Kind::Bool, Device::Cpu)))];
        let e = write_safetensors_digested(&path, &bad).unwrap_err().to_string();
        assert!(e.contains("flag") && e.contains("Bool"), "{e}");
        let t = Tensor::ones([2], (Kind::Float, Device::Cpu));
        let twice = vec![("w".to_string(), t.shallow_clone()), ("w".to_string(), t)];
        let e = write_safetensors_digested(&path, &twice).unwrap_err().to_string();
        assert!(e.contains("w given twice"), "{e}");
    }
}
