//! A tokenized training dataset read from JSONL.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::{ChatTokenizer, Conversation, DataError};

/// One training sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Stable id: the 0-based line number in the dataset file.
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

/// What loading counted, for the log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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
    /// Reads, tokenizes and masks every line of a JSONL chat dataset.
    /// Lines are read as bytes, so text that is not UTF-8 is a malformed
    /// line (named, and skipped under the skip policy), and text far past
    /// `max_seq_len` tokens is cut before it is tokenized.
    pub fn load(path: &Path, tok: &ChatTokenizer, opts: &LoadOptions) -> Result<Self, DataError> {
        let file = std::fs::File::open(path).map_err(|e| DataError::Io(path.to_path_buf(), e.to_string()))?;
        let mut report = LoadReport::default();
        let mut samples = Vec::new();
        let mut skipped: Vec<String> = Vec::new();
        // Twice what the first max_seq_len tokens can span: the cut cannot
        // reach them.
        let text_budget = tok.text_budget(opts.max_seq_len).saturating_mul(2);
        for (idx, line) in BufReader::new(file).split(b'\n').enumerate() {
            let line = line.map_err(|e| DataError::Io(path.to_path_buf(), e.to_string()))?;
            if line.trim_ascii().is_empty() {
                continue;
            }
            report.lines += 1;
            let line_no = idx as u64 + 1;
            let malformed = |reason: String| DataError::Malformed { path: path.to_path_buf(), line: line_no, reason };
            let conv = match std::str::from_utf8(&line) {
                Err(e) => Err(malformed(format!("is not UTF-8 (invalid byte at offset {})", e.valid_up_to()))),
                Ok(text) => match Conversation::parse_line(text) {
                    Ok(c) if c.messages.iter().any(|m| m.is_assistant()) => Ok(c),
                    Ok(_) => Err(malformed("has no assistant turn to train on".into())),
                    Err(reason) => Err(malformed(reason)),
                },
            };
            let mut conv = match conv {
                Ok(c) => c,
                Err(e) if opts.skip_malformed => {
                    if skipped.len() < 3 {
                        skipped.push(e.to_string());
                    }
                    report.malformed_skipped += 1;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let cut = line.len() > text_budget && conv.truncate_text(text_budget);
            let mut enc = tok.encode_conversation(&conv.messages)?;
            if enc.input_ids.len() > opts.max_seq_len || cut {
                enc.input_ids.truncate(opts.max_seq_len);
                enc.loss_mask.truncate(opts.max_seq_len);
                report.truncated += 1;
            }
            if enc.loss_mask.iter().all(|&m| m == 0) {
                report.without_targets += 1;
                continue;
            }
            report.tokens += enc.input_ids.len() as u64;
            samples.push(Sample { id: idx as u64, input_ids: enc.input_ids, loss_mask: enc.loss_mask });
        }
        report.samples = samples.len() as u64;
        if report.malformed_skipped > 0 {
            let fraction = report.malformed_skipped as f64 / report.lines.max(1) as f64;
            if fraction > opts.max_skipped_fraction {
                return Err(DataError::TooManySkipped {
                    path: path.to_path_buf(),
                    skipped: report.malformed_skipped,
                    lines: report.lines,
                    limit: opts.max_skipped_fraction,
                    first: skipped.join("; "),
                });
            }
            tracing::warn!(
                "{}: skipped {} malformed line(s) of {} ({:.1}%), e.g. {}",
                path.display(),
                report.malformed_skipped,
                report.lines,
                100.0 * fraction,
                skipped.join("; ")
            );
        }
        if samples.is_empty() {
            return Err(DataError::Empty(path.to_path_buf()));
        }
        Ok(Self { path: path.to_path_buf(), samples, report })
    }

    /// The sample with this id, if present.
    pub fn get(&self, id: u64) -> Option<&Sample> {
        // Samples are sorted by id (file order), so binary search works.
        self.samples.binary_search_by_key(&id, |s| s.id).ok().map(|i| &self.samples[i])
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
