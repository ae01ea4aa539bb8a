//! The error policy: every error a role can meet has a kind, and the kind
//! decides whether the role retries or the run fails.
//!
//! | kind            | examples                                             | handling |
//! |-----------------|------------------------------------------------------|----------|
//! | `config`        | invalid field, missing model file                    | fatal    |
//! | `data`          | malformed dataset line (policy `error`)              | fatal    |
//! | `model`         | unsupported architecture, missing tensor             | fatal    |
//! | `device`        | CUDA unavailable, out of memory                      | fatal    |
//! | `protocol`      | wrong protocol version, wrong run id                 | fatal    |
//! | `non_finite`    | NaN/Inf in features or loss, K batches in a row      | fatal (single batches are skipped and reported) |
//! | `checkpoint`    | cannot read a checkpoint (another drafter shape, an I/O error) | fatal |
//! | `checkpoint_unavailable` | no intact checkpoint the ledger committed is reachable (volume not mounted, files damaged) | the drafter exits and the run waits for one that has them (`faults.drafter_absence_timeout_ms`) |
//! | `checkpoint_write` | a checkpoint write failed (full disk, I/O error)  | retried with backoff; training goes on and the last good checkpoint stays |
//! | `bad_batch`     | a received batch fails its checks against the plan (unknown id, other samples, token ids outside the vocabulary) | rejected and reported as skipped; K in a row fail the run |
//! | `internal`      | a worker thread panicked                             | fatal    |
//! | `transport`     | peer unreachable, stream reset                       | retried with backoff until the peer's timeout |
//! | `corrupt_batch` | CRC mismatch, truncated chunk                        | retried: the target resends the batch |
//! | `peer_lost`     | coordinator or drafter gone past its timeout         | fatal    |

use std::fmt;

/// The class of an error, which fixes how it is handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    Config,
    Data,
    Model,
    Device,
    Protocol,
    NonFinite,
    Checkpoint,
    CheckpointUnavailable,
    CheckpointWrite,
    BadBatch,
    Internal,
    Transport,
    CorruptBatch,
    PeerLost,
}

impl ErrorKind {
    /// Whether the role retries (true) or the run fails (false).
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::Transport
                | ErrorKind::CorruptBatch
                | ErrorKind::CheckpointUnavailable
                | ErrorKind::CheckpointWrite
                | ErrorKind::BadBatch
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Config => "config",
            ErrorKind::Data => "data",
            ErrorKind::Model => "model",
            ErrorKind::Device => "device",
            ErrorKind::Protocol => "protocol",
            ErrorKind::NonFinite => "non_finite",
            ErrorKind::Checkpoint => "checkpoint",
            ErrorKind::CheckpointUnavailable => "checkpoint_unavailable",
            ErrorKind::CheckpointWrite => "checkpoint_write",
            ErrorKind::BadBatch => "bad_batch",
            ErrorKind::Internal => "internal",
            ErrorKind::Transport => "transport",
            ErrorKind::CorruptBatch => "corrupt_batch",
            ErrorKind::PeerLost => "peer_lost",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error and its sources, outermost first, deduplicated where a wrapper
/// repeats its source's message.
pub fn cause_chain(err: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut cur = Some(err);
    while let Some(e) = cur {
        let msg = e.to_string();
        if out.last().is_none_or(|prev| !prev.ends_with(&msg)) {
            out.push(msg);
        }
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading shard model-00002.safetensors")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn chain_lists_outermost_first() {
        let e = Outer(std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"));
        assert_eq!(cause_chain(&e), vec!["reading shard model-00002.safetensors", "no such file"]);
    }

    #[test]
    fn only_transport_corruption_bad_batches_and_checkpoint_writes_are_retried() {
        assert!(ErrorKind::Transport.is_retryable());
        assert!(ErrorKind::CorruptBatch.is_retryable());
        assert!(ErrorKind::CheckpointWrite.is_retryable());
        assert!(ErrorKind::BadBatch.is_retryable());
        assert!(ErrorKind::CheckpointUnavailable.is_retryable(), "the run waits for a drafter that has them");
        assert!(!ErrorKind::Checkpoint.is_retryable());
        assert!(!ErrorKind::NonFinite.is_retryable());
        assert!(!ErrorKind::Protocol.is_retryable());
    }
}
