//! Training data: chat datasets in JSONL or Parquet, the target's tokenizer and chat
//! template, assistant-only loss masks, and the deterministic batch plan.

mod cache;
mod chat;
mod dataset;
pub mod parquet_rows;
mod plan;
mod synthetic;
mod tokenizer;
mod tokenizer_files;

use std::path::PathBuf;

pub use chat::{Conversation, Message};
pub use dataset::{Dataset, LoadOptions, LoadReport, Sample};
pub use plan::{PlannedBatch, batch_id, plan_epoch};
pub use synthetic::{
    SYNTHETIC_SPECIALS, synthetic_conversation, write_long_synthetic_dataset, write_synthetic_dataset,
    write_synthetic_tokenizer,
};
pub use tokenizer::{ChatTokenizer, Encoded};
pub use tokenizer_files::{BpeSpec, byte_alphabet, chatml_template, write_bpe_tokenizer};

/// Why data could not be read. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{0}: {1}")]
    Io(PathBuf, String),
    #[error("{}:{line}: malformed line: {reason}", path.display())]
    Malformed { path: PathBuf, line: u64, reason: String },
    #[error("{}: row {row}: malformed row: {reason}", path.display())]
    MalformedRow { path: PathBuf, row: u64, reason: String },
    #[error("{}: column {column} {reason}", path.display())]
    Schema { path: PathBuf, column: String, reason: String },
    #[error("tokenizer {0}: {1}")]
    Tokenizer(PathBuf, String),
    #[error("chat template in {0}: {1}")]
    Template(PathBuf, String),
    #[error("{0}: no usable samples")]
    Empty(PathBuf),
    #[error(
        "{}: {skipped} of {lines} lines are malformed, more than data.max_skipped_fraction = {limit} allows \
         (a wrong file?); first: {first}",
        path.display()
    )]
    TooManySkipped { path: PathBuf, skipped: u64, lines: u64, limit: f64, first: String },
}
