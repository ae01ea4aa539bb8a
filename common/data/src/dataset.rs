//! A tokenized training dataset read from JSONL or Parquet.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::{ChatTokenizer, Conversation, DataError};

/// One training sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Stable id: the 0-based line (JSONL) or row (Parquet) of the record.
    pub id: u64,
    pub input_ids: Vec<u32>,
    /// 1 where the token is trained on.
    pub loss_mask: Vec<u8>,
}

impl Sample {
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}

/// How to read a dataset.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Longer sequences are cut to this many tokens.
    pub max_seq_len: usize,
    /// Skip (and count) malformed lines instead of failing.
    pub skip_malformed: bool,
    /// With `skip_malformed`: fail when more than this fraction of the
    /// lines is skipped.
    pub max_skipped_fraction: f64,
}

impl LoadOptions {
    /// Fail on the first malformed line.
    pub fn strict(max_seq_len: usize) -> Self {
        Self { max_seq_len, skip_malformed: false, max_skipped_fraction: 0.0 }
    }
}

/// What loading counted, for the log (and the tokenized cache's header).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoadReport {
    pub lines: u64,
    pub samples: u64,
    pub malformed_skipped: u64,
    pub truncated: u64,
    /// Samples with no assistant token after truncation (nothing to train on).
    pub without_targets: u64,
    pub tokens: u64,
}

/// The samples of a dataset, in file order.
pub struct Dataset {
    pub path: PathBuf,
    pub samples: Vec<Sample>,
    pub report: LoadReport,
}

impl Dataset {
    /// Reads, tokenizes and masks every record of a chat dataset: the lines
    /// of a JSONL file, or the rows of a Parquet file as Hugging Face
    /// datasets saves them ([`crate::parquet_rows`]). JSONL lines are read as
    /// bytes, so text that is not UTF-8 is a malformed line (named, and
    /// skipped under the skip policy), and text far past `max_seq_len`
    /// tokens is cut before it is tokenized. A sample's id is its record's
    /// 0-based line or row number.
    pub fn load(path: &Path, tok: &ChatTokenizer, opts: &LoadOptions) -> Result<Self, DataError> {
        Ok(Self::load_with_skipped(path, tok, opts)?.0)
    }

    /// [`Dataset::load`], and the first few records it skipped (for the
    /// cache, which logs them again at each read).
    pub(crate) fn load_with_skipped(
        path: &Path,
        tok: &ChatTokenizer,
        opts: &LoadOptions,
    ) -> Result<(Self, Vec<String>), DataError> {
        let mut acc = Accumulator::new(path, tok, opts);
        if crate::parquet_rows::is_parquet(path) {
            for (idx, row) in crate::parquet_rows::chat_rows(path, &[])?.into_iter().enumerate() {
                let conv = Conversation::from_json(row).map_err(|reason| DataError::MalformedRow {
                    path: path.to_path_buf(),
                    row: idx as u64 + 1,
                    reason,
                });
                // A row's size is its text (its JSON is built, not read).
                let size = conv.as_ref().map_or(0, |c| c.messages.iter().map(|m| m.content.len()).sum());
                acc.take(idx as u64, size, conv)?;
            }
            return acc.finish();
        }
        let file = std::fs::File::open(path).map_err(|e| DataError::Io(path.to_path_buf(), e.to_string()))?;
        for (idx, line) in BufReader::new(file).split(b'\n').enumerate() {
            let line = line.map_err(|e| DataError::Io(path.to_path_buf(), e.to_string()))?;
            if line.trim_ascii().is_empty() {
                continue;
            }
            let line_no = idx as u64 + 1;
            let malformed = |reason: String| DataError::Malformed { path: path.to_path_buf(), line: line_no, reason };
            let conv = match std::str::from_utf8(&line) {
                Err(e) => Err(malformed(format!("is not UTF-8 (invalid byte at offset {})", e.valid_up_to()))),
                Ok(text) => Conversation::parse_line(text).map_err(malformed),
            };
            acc.take(idx as u64, line.len(), conv)?;
        }
        acc.finish()
    }

    /// The sample with this id, if present.
    pub fn get(&self, id: u64) -> Option<&Sample> {
        // Samples are sorted by id (file order), so binary search works.
        self.samples.binary_search_by_key(&id, |s| s.id).ok().map(|i| &self.samples[i])
    }
}

/// Turns parsed records into samples, under the malformed-record policy.
struct Accumulator<'a> {
    path: &'a Path,
    tok: &'a ChatTokenizer,
    opts: &'a LoadOptions,
    report: LoadReport,
    samples: Vec<Sample>,
    /// The first few records skipped, for the log.
    skipped: Vec<String>,
    /// Twice what the first max_seq_len tokens can span: the cut cannot
    /// reach them.
    text_budget: usize,
    /// Records are Parquet rows (errors name rows, not lines).
    rows: bool,
}

impl<'a> Accumulator<'a> {
    fn new(path: &'a Path, tok: &'a ChatTokenizer, opts: &'a LoadOptions) -> Self {
        let text_budget = tok.text_budget(opts.max_seq_len).saturating_mul(2);
        let rows = crate::parquet_rows::is_parquet(path);
        Self {
            path,
            tok,
            opts,
            report: LoadReport::default(),
            samples: Vec::new(),
            skipped: Vec::new(),
            text_budget,
            rows,
        }
    }

    /// One record (`size` bytes as read): a sample, a skip, or the error.
    fn take(&mut self, id: u64, size: usize, conv: Result<Conversation, DataError>) -> Result<(), DataError> {
        self.report.lines += 1;
        let conv = conv.and_then(|c| {
            if c.messages.iter().any(|m| m.is_assistant()) {
                return Ok(c);
            }
            let reason = "has no assistant turn to train on".to_string();
            Err(if self.rows {
                DataError::MalformedRow { path: self.path.to_path_buf(), row: id + 1, reason }
            } else {
                DataError::Malformed { path: self.path.to_path_buf(), line: id + 1, reason }
            })
        });
        let mut conv = match conv {
            Ok(c) => c,
            Err(e) if self.opts.skip_malformed => {
                if self.skipped.len() < 3 {
                    self.skipped.push(e.to_string());
                }
                self.report.malformed_skipped += 1;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let cut = size > self.text_budget && conv.truncate_text(self.text_budget);
        let mut enc = self.tok.encode_conversation(&conv.messages)?;
        if enc.input_ids.len() > self.opts.max_seq_len || cut {
            enc.input_ids.truncate(self.opts.max_seq_len);
            enc.loss_mask.truncate(self.opts.max_seq_len);
            self.report.truncated += 1;
        }
        if enc.loss_mask.iter().all(|&m| m == 0) {
            self.report.without_targets += 1;
            return Ok(());
        }
        self.report.tokens += enc.input_ids.len() as u64;
        self.samples.push(Sample { id, input_ids: enc.input_ids, loss_mask: enc.loss_mask });
        Ok(())
    }

    fn finish(mut self) -> Result<(Dataset, Vec<String>), DataError> {
        let (path, report) = (self.path, &mut self.report);
        report.samples = self.samples.len() as u64;
        if report.malformed_skipped > 0 {
            let fraction = report.malformed_skipped as f64 / report.lines.max(1) as f64;
            if fraction > self.opts.max_skipped_fraction {
                return Err(DataError::TooManySkipped {
                    path: path.to_path_buf(),
                    skipped: report.malformed_skipped,
                    lines: report.lines,
                    limit: self.opts.max_skipped_fraction,
                    first: self.skipped.join("; "),
                });
            }
            tracing::warn!(
                "{}: skipped {} malformed record(s) of {} ({:.1}%), e.g. {}",
                path.display(),
                report.malformed_skipped,
                report.lines,
                100.0 * fraction,
                self.skipped.join("; ")
            );
        }
        if self.samples.is_empty() {
            return Err(DataError::Empty(path.to_path_buf()));
        }
        Ok((Dataset { path: path.to_path_buf(), samples: self.samples, report: self.report }, self.skipped))
    }
}

impl std::fmt::Display for LoadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} samples, {} tokens from {} lines ({} malformed skipped, {} truncated, {} without assistant tokens)",
            self.samples, self.tokens, self.lines, self.malformed_skipped, self.truncated, self.without_targets
        )
    }
}
