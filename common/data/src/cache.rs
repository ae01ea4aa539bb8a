//! A cache of tokenized datasets, so that a restarted role reads its samples
//! instead of tokenizing the whole dataset again.
//!
//! Every target and the coordinator tokenize the dataset at start, and every
//! restart after a fault starts them again: on two busy cores that was 15-20 s
//! per 100,000 conversations, and it set the recovery time of the chaos soak.
//! The cache file is named by a SHA-256 over everything that decides the
//! samples: the dataset's bytes, the tokenizer's two files, the load options
//! and [`FORMAT`]. Hashing the dataset reads it once (about 2 GB/s), far
//! cheaper than rendering and tokenizing it, and unlike a size-and-mtime key it
//! cannot serve samples of an edited file. A file that is torn, corrupt or of
//! another format fails its checks and is tokenized again, never trusted.
//! Writes go to a temporary file renamed into place, so roles that tokenize
//! at once each leave a whole file. A cache that cannot be written (a
//! read-only data folder) costs a warning, not the run.
//!
//! Layout (little-endian): the magic, [`FORMAT`], a JSON header (the key, the
//! load report, the first skipped records), then per sample its id, length,
//! ids and loss mask, and last a CRC-32C of everything before it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{ChatTokenizer, Dataset, LoadOptions, LoadReport, Sample};

const MAGIC: &[u8; 8] = b"DFLTOKS\n";
/// Bump when tokenization or masking changes what a record becomes: old
/// cache files then miss instead of serving stale samples.
pub const FORMAT: u32 = 1;
/// Cache files kept per dataset file name (other keys: earlier versions of
/// the file, or other runs' options); older ones are removed.
const KEEP_PER_DATASET: usize = 4;

/// What the header records besides the samples.
#[derive(Serialize, Deserialize)]
struct Header {
    key: String,
    dataset: String,
    samples: u64,
    report: LoadReport,
    skipped_examples: Vec<String>,
}

/// The key of a dataset under a tokenizer and options: hex SHA-256.
fn cache_key(dataset: &Path, tok: &ChatTokenizer, opts: &LoadOptions) -> std::io::Result<String> {
    let mut h = Sha256::new();
    h.update(MAGIC);
    h.update(FORMAT.to_le_bytes());
    for path in [dataset.to_path_buf(), tok.dir().join("tokenizer.json"), tok.dir().join("tokenizer_config.json")] {
        let mut file = std::fs::File::open(&path)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut len = 0u64;
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            len += n as u64;
        }
        // Lengths between the files, so that bytes cannot move from one to
        // the next under the same hash.
        h.update(len.to_le_bytes());
    }
    h.update((opts.max_seq_len as u64).to_le_bytes());
    h.update([u8::from(opts.skip_malformed)]);
    h.update(opts.max_skipped_fraction.to_le_bytes());
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn file_prefix(dataset: &Path) -> String {
    dataset.file_name().map_or_else(|| "dataset".into(), |n| n.to_string_lossy().into_owned())
}

impl Dataset {
    /// [`Dataset::load`] through the cache in `cache_dir` (none: a plain
    /// load): the samples of an earlier load with the same key when a
    /// whole, matching file is there; otherwise loaded and then written
    /// there for the next start. Errors are the load's; the cache's own
    /// trouble is logged and passed over.
    pub fn load_cached(
        path: &Path,
        tok: &ChatTokenizer,
        opts: &LoadOptions,
        cache_dir: Option<&Path>,
    ) -> Result<Self, crate::DataError> {
        let Some(cache_dir) = cache_dir else { return Self::load(path, tok, opts) };
        let key = match cache_key(path, tok, opts) {
            Ok(k) => k,
            // The load names the unreadable file.
            Err(_) => return Self::load(path, tok, opts),
        };
        let file = cache_dir.join(format!("{}.{}.tok", file_prefix(path), &key[..32]));
        match read_cache(&file, &key) {
            Ok(Some(ds)) => {
                tracing::info!("dataset {}: tokenized samples read from the cache {}", path.display(), file.display());
                return Ok(Dataset { path: path.to_path_buf(), ..ds });
            }
            Ok(None) => {}
            Err(why) => tracing::warn!("ignoring the dataset cache {}: {why}; tokenizing again", file.display()),
        }
        let (ds, skipped) = Self::load_with_skipped(path, tok, opts)?;
        match write_cache(&file, &key, &ds, &skipped) {
            Ok(()) => {
                tracing::info!("dataset {}: tokenized samples cached in {}", path.display(), file.display());
                prune(cache_dir, &file_prefix(path), &file);
            }
            Err(e) => tracing::warn!(
                "could not cache the tokenized dataset in {}: {e} (data.cache_dir; the next start tokenizes again)",
                file.display()
            ),
        }
        Ok(ds)
    }
}

/// The cached dataset in `file`, `None` when there is no file, or why a
/// file that is there cannot be used.
fn read_cache(file: &Path, key: &str) -> Result<Option<Dataset>, String> {
    let bytes = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let body_end = bytes.len().checked_sub(4).ok_or("shorter than its checksum")?;
    let stored = u32::from_le_bytes(bytes[body_end..].try_into().expect("4 bytes"));
    if crc32c::crc32c(&bytes[..body_end]) != stored {
        return Err("its checksum does not match (a torn or damaged file)".into());
    }
    let mut r = Reader { bytes: &bytes[..body_end], at: 0 };
    if r.take(MAGIC.len())? != MAGIC {
        return Err("not a dflash dataset cache".into());
    }
    let format = r.u32()?;
    if format != FORMAT {
        return Err(format!("format {format}, this build reads {FORMAT}"));
    }
    let header_len = r.u32()? as usize;
    let header: Header = serde_json::from_slice(r.take(header_len)?).map_err(|e| format!("header: {e}"))?;
    if header.key != key {
        return Err("its key is not this dataset's".into());
    }
    let mut samples = Vec::with_capacity(header.samples.min(1 << 24) as usize);
    for _ in 0..header.samples {
        let id = r.u64()?;
        let len = r.u32()? as usize;
        let ids = r.take(len.checked_mul(4).ok_or("sample length overflows")?)?;
        let input_ids = ids.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        let loss_mask = r.take(len)?.to_vec();
        samples.push(Sample { id, input_ids, loss_mask });
    }
    if r.at != r.bytes.len() {
        return Err(format!("{} bytes after the last sample", r.bytes.len() - r.at));
    }
    let report = header.report;
    if report.malformed_skipped > 0 {
        tracing::warn!(
            "{}: skipped {} malformed record(s) of {}, e.g. {}",
            header.dataset,
            report.malformed_skipped,
            report.lines,
            header.skipped_examples.join("; ")
        );
    }
    Ok(Some(Dataset { path: PathBuf::from(header.dataset), samples, report }))
}

/// Bounds-checked reads from the cache's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or("cut short")?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
}

/// Writes the cache through a temporary file renamed into place.
fn write_cache(file: &Path, key: &str, ds: &Dataset, skipped: &[String]) -> std::io::Result<()> {
    let dir = file.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let header = Header {
        key: key.to_string(),
        dataset: ds.path.display().to_string(),
        samples: ds.samples.len() as u64,
        report: ds.report.clone(),
        skipped_examples: skipped.to_vec(),
    };
    let header = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
    let tmp = file.with_extension(format!("tok.tmp-{}", std::process::id()));
    let written = (|| {
        let mut out =
            CrcWriter { inner: std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp)?), crc: 0 };
        out.write_all(MAGIC)?;
        out.write_all(&FORMAT.to_le_bytes())?;
        out.write_all(&(header.len() as u32).to_le_bytes())?;
        out.write_all(&header)?;
        for s in &ds.samples {
            out.write_all(&s.id.to_le_bytes())?;
            out.write_all(&(s.len() as u32).to_le_bytes())?;
            let ids: Vec<u8> = s.input_ids.iter().flat_map(|id| id.to_le_bytes()).collect();
            out.write_all(&ids)?;
            out.write_all(&s.loss_mask)?;
        }
        let crc = out.crc;
        let mut f = out.inner.into_inner().map_err(|e| e.into_error())?;
        f.write_all(&crc.to_le_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, file)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A writer that keeps the CRC-32C of what went through it.
struct CrcWriter<W> {
    inner: W,
    crc: u32,
}

impl<W: Write> CrcWriter<W> {
    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.crc = crc32c::crc32c_append(self.crc, bytes);
        self.inner.write_all(bytes)
    }
}

/// Removes all but the newest [`KEEP_PER_DATASET`] cache files of one
/// dataset file name (never `keep`). A reader that has a removed file open
/// keeps reading it; one that finds it gone tokenizes.
fn prune(dir: &Path, prefix: &str, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            // `<prefix>.<32 hex>.tok`: exactly this dataset's files.
            name.strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix('.'))
                .and_then(|rest| rest.strip_suffix(".tok"))
                .is_some_and(|k| k.len() == 32 && k.bytes().all(|b| b.is_ascii_hexdigit()))
                && p != keep
        })
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    for (_, old) in files.into_iter().skip(KEEP_PER_DATASET - 1) {
        if std::fs::remove_file(&old).is_ok() {
            tracing::info!("removed the old dataset cache {}", old.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{write_synthetic_dataset, write_synthetic_tokenizer};

    struct Fixture {
        dir: tempfile::TempDir,
        tok: ChatTokenizer,
        data: PathBuf,
        cache: PathBuf,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        write_synthetic_tokenizer(dir.path()).unwrap();
        let tok = ChatTokenizer::from_dir(dir.path()).unwrap();
        let data = dir.path().join("d.jsonl");
        write_synthetic_dataset(&data, 50, 3).unwrap();
        let cache = dir.path().join(".dflash-cache");
        Fixture { dir, tok, data, cache }
    }

    impl Fixture {
        fn cached(&self, opts: &LoadOptions) -> Dataset {
            Dataset::load_cached(&self.data, &self.tok, opts, Some(&self.cache)).unwrap()
        }

        fn plain(&self, opts: &LoadOptions) -> Dataset {
            Dataset::load(&self.data, &self.tok, opts).unwrap()
        }
    }

    fn cache_files(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        v.sort();
        v
    }

    fn same(a: &Dataset, b: &Dataset) {
        assert_eq!(a.samples, b.samples);
        assert_eq!(a.report, b.report);
        assert_eq!(a.path, b.path);
    }

    #[test]
    fn a_second_load_reads_the_samples_the_first_cached() {
        let f = fixture();
        let opts = LoadOptions::strict(64);
        let plain = f.plain(&opts);
        same(&f.cached(&opts), &plain);
        let files = cache_files(&f.cache);
        assert_eq!(files.len(), 1, "{files:?}");
        // A valid file under the same key with other samples is what the
        // next load returns: proof that it reads the cache, not the data.
        let key = cache_key(&f.data, &f.tok, &opts).unwrap();
        let mut altered = f.plain(&opts);
        altered.samples.truncate(7);
        altered.samples[0].input_ids[0] ^= 1;
        write_cache(&files[0], &key, &altered, &[]).unwrap();
        let read = f.cached(&opts);
        assert_eq!(read.samples, altered.samples);
        assert_eq!(read.path, f.data);
    }

    #[test]
    fn an_edited_dataset_other_options_or_another_tokenizer_miss_the_cache() {
        let f = fixture();
        let opts = LoadOptions::strict(64);
        f.cached(&opts);
        // Other options: another key, another file, the right samples.
        let short = LoadOptions::strict(40);
        same(&f.cached(&short), &f.plain(&short));
        assert_eq!(cache_files(&f.cache).len(), 2);
        // One byte of the data changed (same length): the edited file's samples.
        let mut bytes = std::fs::read(&f.data).unwrap();
        let marker = b"\"content\":\"";
        let at = bytes.windows(marker.len()).position(|w| w == marker).unwrap() + marker.len();
        bytes[at] = if bytes[at] == b'x' { b'y' } else { b'x' };
        std::fs::write(&f.data, &bytes).unwrap();
        let edited = f.plain(&opts);
        same(&f.cached(&opts), &edited);
        assert_eq!(cache_files(&f.cache).len(), 3);
        // The tokenizer's config changed (a template edit): another key.
        let cfg = f.dir.path().join("tokenizer_config.json");
        let text = std::fs::read_to_string(&cfg).unwrap();
        std::fs::write(&cfg, text.replacen('{', "{\"dflash_test\": 1, ", 1)).unwrap();
        let tok = ChatTokenizer::from_dir(f.dir.path()).unwrap();
        Dataset::load_cached(&f.data, &tok, &opts, Some(&f.cache)).unwrap();
        assert_eq!(cache_files(&f.cache).len(), 4);
    }

    #[test]
    fn a_torn_or_damaged_cache_is_tokenized_again_and_rewritten_whole() {
        let f = fixture();
        let opts = LoadOptions::strict(64);
        let plain = f.plain(&opts);
        f.cached(&opts);
        let file = cache_files(&f.cache).remove(0);
        let whole = std::fs::read(&file).unwrap();
        let key = cache_key(&f.data, &f.tok, &opts).unwrap();
        for (what, damaged) in [
            ("torn", whole[..whole.len() / 2].to_vec()),
            ("a flipped bit", {
                let mut b = whole.clone();
                b[whole.len() - 10] ^= 0x10;
                b
            }),
            ("empty", Vec::new()),
        ] {
            std::fs::write(&file, &damaged).unwrap();
            assert!(read_cache(&file, &key).is_err(), "{what}: accepted");
            same(&f.cached(&opts), &plain);
            assert_eq!(std::fs::read(&file).unwrap(), whole, "{what}: not rewritten whole");
        }
        // A whole file of another key is refused by its header too.
        let refused = read_cache(&file, &"0".repeat(64)).err().unwrap();
        assert!(refused.contains("key"), "{refused}");
    }

    #[test]
    fn a_cache_that_cannot_be_written_costs_nothing_but_the_cache() {
        let f = fixture();
        let opts = LoadOptions::strict(64);
        // The cache folder's place is taken by a file: no folder can be made.
        let blocked = f.dir.path().join("blocked");
        std::fs::write(&blocked, b"not a folder").unwrap();
        let ds = Dataset::load_cached(&f.data, &f.tok, &opts, Some(&blocked)).unwrap();
        same(&ds, &f.plain(&opts));
        // A missing dataset is the load's error, naming the file.
        let missing = f.dir.path().join("missing.jsonl");
        let err = Dataset::load_cached(&missing, &f.tok, &opts, Some(&f.cache)).err().unwrap().to_string();
        assert!(err.contains("missing.jsonl"), "{err}");
    }

    #[test]
    fn old_cache_files_of_a_dataset_are_pruned_others_kept() {
        let f = fixture();
        std::fs::create_dir_all(&f.cache).unwrap();
        for i in 0..6 {
            std::fs::write(f.cache.join(format!("d.jsonl.{:032x}.tok", i)), b"old").unwrap();
        }
        let other = f.cache.join(format!("e.jsonl.{:032x}.tok", 1));
        std::fs::write(&other, b"another dataset's").unwrap();
        f.cached(&LoadOptions::strict(64));
        let files = cache_files(&f.cache);
        let ours = files.iter().filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("d.jsonl.")).count();
        assert_eq!(ours, KEEP_PER_DATASET, "{files:?}");
        assert!(other.exists());
    }
}
