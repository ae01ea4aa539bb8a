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

pub use dflash_proto::ErrorKind;
use dflash_proto::{CoordinatorError, DrafterError, RunState};

/// The written policy's decision for a kind (the table above). The kind
/// itself is the protocol's one enum, so that the kind a role reports is
/// the kind the coordinator reads, with no second list to keep in step.
pub trait KindPolicy {
    /// Whether the role retries (true) or the run fails (false).
    fn is_retryable(&self) -> bool;
}

impl KindPolicy for ErrorKind {
    fn is_retryable(&self) -> bool {
        matches!(
            self,
            ErrorKind::Transport
                | ErrorKind::CorruptBatch
                | ErrorKind::CheckpointUnavailable
                | ErrorKind::CheckpointWrite
                | ErrorKind::BadBatch
        )
    }
}

/// What a role does about a failed call to a peer, decided from the
/// peer's decoded error (None: no answer -- unreachable, a timeout, a
/// broken connection).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reaction {
    /// Try again with backoff (until the peer's timeout).
    Retry,
    /// Register again (the coordinator restarted), then retry.
    Register,
    /// The run is over: stop the role for the run's reason.
    RunOver(RunState),
    /// Nothing will help: the role fails with this error.
    Fail,
    /// This drafter's group generation is over (another took its place):
    /// it leaves, to join the next generation (exit code 75).
    Rejoin,
}

/// | coordinator's answer | reaction |
/// |---|---|
/// | none (unreachable, timeout) | retry with backoff until `faults.coordinator_timeout_ms` |
/// | `NotRegistered` | register again, then retry |
/// | `RunOver` | stop for the run's reason |
/// | `Ledger` (its storage failed), `TooManyWatchers` | retry with backoff |
/// | `NotCurrentDrafter` | a drafter leaves its ended group generation to join the next |
/// | `ProtocolVersion`, `WrongRun`, `InvalidRequest`, `Refused` | fail |
pub fn on_coordinator_error(e: Option<&CoordinatorError>) -> Reaction {
    match e {
        None | Some(CoordinatorError::Ledger(_) | CoordinatorError::TooManyWatchers { .. }) => Reaction::Retry,
        Some(CoordinatorError::NotRegistered(_)) => Reaction::Register,
        Some(CoordinatorError::RunOver { state, .. }) => Reaction::RunOver(*state),
        Some(CoordinatorError::NotCurrentDrafter(_)) => Reaction::Rejoin,
        Some(
            CoordinatorError::ProtocolVersion { .. }
            | CoordinatorError::WrongRun { .. }
            | CoordinatorError::InvalidRequest { .. }
            | CoordinatorError::Refused(_),
        ) => Reaction::Fail,
    }
}

/// | drafter's answer on a hidden-state stream | reaction |
/// |---|---|
/// | none (unreachable, reset) | reconnect with backoff; unacknowledged batches are replayed |
/// | `TooManyStreams`, `Stalled`, `HelloTimeout`, `Stopping`, `Overloaded` | reconnect with backoff |
/// | `ProtocolVersion`, `WrongRun`, `BadInstanceId`, `NoHello`, `MessageTooLarge`, `Malformed`, `Compressed`, `UnknownMethod` | fail: this target sends what the drafter cannot take |
pub fn on_drafter_error(e: Option<&DrafterError>) -> Reaction {
    match e {
        None
        | Some(
            DrafterError::TooManyStreams { .. }
            | DrafterError::Stalled { .. }
            | DrafterError::HelloTimeout { .. }
            | DrafterError::Stopping
            | DrafterError::Overloaded(_),
        ) => Reaction::Retry,
        Some(
            DrafterError::ProtocolVersion { .. }
            | DrafterError::WrongRun { .. }
            | DrafterError::BadInstanceId(_)
            | DrafterError::NoHello
            | DrafterError::MessageTooLarge { .. }
            | DrafterError::Malformed(_)
            | DrafterError::Compressed
            | DrafterError::UnknownMethod(_),
        ) => Reaction::Fail,
    }
}

/// Retry delays of the written policy: exponential from 200 ms, capped at
/// 5 s, with jitter so that restarted peers do not come back in step.
/// The longest delay [`retry_delays`] gives: 5 s, jittered up to twice that.
pub const RETRY_DELAY_CAP: std::time::Duration = std::time::Duration::from_secs(10);

pub fn retry_delays() -> impl Iterator<Item = std::time::Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(200))
        .with_max_delay(std::time::Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
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

    /// Every variant of the coordinator's errors with the reaction the
    /// table above gives it (the match below stops compiling when a
    /// variant is added without a row here).
    fn coordinator_rows() -> Vec<(CoordinatorError, Reaction)> {
        let over = CoordinatorError::RunOver { run_id: "r".into(), state: RunState::Cancelled, message: "^C".into() };
        let rows = vec![
            (CoordinatorError::Ledger("io".into()), Reaction::Retry),
            (CoordinatorError::TooManyWatchers { max: 256 }, Reaction::Retry),
            (CoordinatorError::NotRegistered("t".into()), Reaction::Register),
            (over, Reaction::RunOver(RunState::Cancelled)),
            (CoordinatorError::NotCurrentDrafter("d".into()), Reaction::Rejoin),
            (CoordinatorError::ProtocolVersion { got: 9, speaks: 3 }, Reaction::Fail),
            (CoordinatorError::WrongRun { got: "a".into(), runs: "b".into() }, Reaction::Fail),
            (CoordinatorError::InvalidRequest { field: "f".into(), why: "w".into() }, Reaction::Fail),
            (CoordinatorError::Refused("no".into()), Reaction::Fail),
        ];
        for (e, _) in &rows {
            match e {
                CoordinatorError::Ledger(_)
                | CoordinatorError::TooManyWatchers { .. }
                | CoordinatorError::NotRegistered(_)
                | CoordinatorError::RunOver { .. }
                | CoordinatorError::NotCurrentDrafter(_)
                | CoordinatorError::ProtocolVersion { .. }
                | CoordinatorError::WrongRun { .. }
                | CoordinatorError::InvalidRequest { .. }
                | CoordinatorError::Refused(_) => {}
            }
        }
        rows
    }

    fn drafter_rows() -> Vec<(DrafterError, Reaction)> {
        let rows = vec![
            (DrafterError::TooManyStreams { max: 2 }, Reaction::Retry),
            (DrafterError::Stalled { ms: 1 }, Reaction::Retry),
            (DrafterError::HelloTimeout { ms: 1 }, Reaction::Retry),
            (DrafterError::Stopping, Reaction::Retry),
            (DrafterError::Overloaded("no thread".into()), Reaction::Retry),
            (DrafterError::ProtocolVersion { got: 9, speaks: 3 }, Reaction::Fail),
            (DrafterError::WrongRun { got: "a".into(), trains: "b".into() }, Reaction::Fail),
            (DrafterError::BadInstanceId("x".into()), Reaction::Fail),
            (DrafterError::NoHello, Reaction::Fail),
            (DrafterError::MessageTooLarge { len: 9, limit: 8 }, Reaction::Fail),
            (DrafterError::Malformed("m".into()), Reaction::Fail),
            (DrafterError::Compressed, Reaction::Fail),
            (DrafterError::UnknownMethod("/x".into()), Reaction::Fail),
        ];
        for (e, _) in &rows {
            match e {
                DrafterError::TooManyStreams { .. }
                | DrafterError::Stalled { .. }
                | DrafterError::HelloTimeout { .. }
                | DrafterError::Stopping
                | DrafterError::Overloaded(_)
                | DrafterError::ProtocolVersion { .. }
                | DrafterError::WrongRun { .. }
                | DrafterError::BadInstanceId(_)
                | DrafterError::NoHello
                | DrafterError::MessageTooLarge { .. }
                | DrafterError::Malformed(_)
                | DrafterError::Compressed
                | DrafterError::UnknownMethod(_) => {}
            }
        }
        rows
    }

    #[test]
    fn reactions_follow_the_table_for_every_variant_as_decoded_from_its_status() {
        assert_eq!(on_coordinator_error(None), Reaction::Retry, "no answer: retry");
        assert_eq!(on_drafter_error(None), Reaction::Retry, "no answer: reconnect");
        for (e, want) in coordinator_rows() {
            // What a client meets: the status on the wire, decoded.
            let decoded = CoordinatorError::from_status(&e.clone().into_status());
            assert_eq!(decoded.as_ref(), Some(&e));
            assert_eq!(on_coordinator_error(decoded.as_ref()), want, "{e:?}");
        }
        for (e, want) in drafter_rows() {
            let decoded = DrafterError::from_status(&e.clone().into_status());
            assert_eq!(decoded.as_ref(), Some(&e));
            assert_eq!(on_drafter_error(decoded.as_ref()), want, "{e:?}");
        }
    }

    #[test]
    fn retry_delays_back_off_exponentially_to_a_cap() {
        let delays: Vec<_> = retry_delays().take(12).collect();
        assert!(delays[0] >= std::time::Duration::from_millis(200), "starts at 200 ms: {:?}", delays[0]);
        for d in &delays {
            assert!(*d <= RETRY_DELAY_CAP, "capped: {d:?}");
        }
        let last = delays[delays.len() - 1];
        assert!(last >= std::time::Duration::from_secs(5), "grows to the cap: {last:?}");
        assert!(delays[3] > delays[0], "grows: {delays:?}");
    }

    #[test]
    fn kinds_are_labelled_by_their_protocol_name_and_unspecified_reads_as_internal() {
        assert_eq!(ErrorKind::NonFinite.label(), "non_finite");
        assert_eq!(ErrorKind::CheckpointUnavailable.to_string(), "checkpoint_unavailable");
        assert_eq!(ErrorKind::Unspecified.or_internal(), ErrorKind::Internal);
        assert_eq!(ErrorKind::Device.or_internal(), ErrorKind::Device);
        assert!(!ErrorKind::Unspecified.is_retryable());
    }

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
