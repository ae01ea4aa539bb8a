//! The errors each service answers with: one enum per service, one
//! explicit mapping to gRPC status codes, and the whole structured error in
//! the status's details ([`ErrorDetail`]), so that a client decodes the
//! enum back ([`CoordinatorError::from_status`]) instead of reading the
//! message text, and the written policy (dflash-telemetry) decides what to
//! do from it.

use std::collections::HashMap;

use prost::Message;
use tonic::{Code, Status};

use crate::{ErrorDetail, RunState};

/// Why the coordinator refused a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CoordinatorError {
    #[error("protocol version {got} is not supported (this coordinator speaks {speaks})")]
    ProtocolVersion { got: u32, speaks: u32 },
    #[error("wrong run id \"{got}\": this coordinator runs \"{runs}\"")]
    WrongRun { got: String, runs: String },
    /// The run is over: no more work, no new members.
    #[error("run {run_id} is over ({}): {message}", state.as_str_name())]
    RunOver { run_id: String, state: RunState, message: String },
    /// The instance must register (again: the coordinator restarted).
    #[error("instance {0} is not registered")]
    NotRegistered(String),
    /// Only the run's current drafter may report training and checkpoints.
    #[error("{0} is not the current drafter")]
    NotCurrentDrafter(String),
    #[error("{field} {why}")]
    InvalidRequest { field: String, why: String },
    /// A report asks for a transition the ledger does not allow.
    #[error("{0}")]
    Refused(String),
    /// The ledger's storage failed.
    #[error("ledger: {0}")]
    Ledger(String),
    /// The coordinator serves this many event streams already.
    #[error("the coordinator serves at most {max} event streams at once")]
    TooManyWatchers { max: u64 },
}

impl CoordinatorError {
    /// The status code each variant answers with.
    pub fn code(&self) -> Code {
        match self {
            CoordinatorError::ProtocolVersion { .. } => Code::FailedPrecondition,
            CoordinatorError::WrongRun { .. } => Code::InvalidArgument,
            CoordinatorError::RunOver { .. } => Code::FailedPrecondition,
            CoordinatorError::NotRegistered(_) => Code::NotFound,
            CoordinatorError::NotCurrentDrafter(_) => Code::PermissionDenied,
            CoordinatorError::InvalidRequest { .. } => Code::InvalidArgument,
            CoordinatorError::Refused(_) => Code::Aborted,
            CoordinatorError::Ledger(_) => Code::Internal,
            CoordinatorError::TooManyWatchers { .. } => Code::ResourceExhausted,
        }
    }

    fn detail(&self) -> (&'static str, Vec<(&'static str, String)>) {
        match self {
            CoordinatorError::ProtocolVersion { got, speaks } => {
                ("protocol_version", vec![("got", got.to_string()), ("speaks", speaks.to_string())])
            }
            CoordinatorError::WrongRun { got, runs } => {
                ("wrong_run", vec![("got", got.clone()), ("runs", runs.clone())])
            }
            CoordinatorError::RunOver { run_id, state, message } => (
                "run_over",
                vec![("run_id", run_id.clone()), ("state", state.as_str_name().into()), ("message", message.clone())],
            ),
            CoordinatorError::NotRegistered(id) => ("not_registered", vec![("instance_id", id.clone())]),
            CoordinatorError::NotCurrentDrafter(id) => ("not_current_drafter", vec![("instance_id", id.clone())]),
            CoordinatorError::InvalidRequest { field, why } => {
                ("invalid_request", vec![("field", field.clone()), ("why", why.clone())])
            }
            CoordinatorError::Refused(why) => ("refused", vec![("why", why.clone())]),
            CoordinatorError::Ledger(why) => ("ledger", vec![("why", why.clone())]),
            CoordinatorError::TooManyWatchers { max } => ("too_many_watchers", vec![("max", max.to_string())]),
        }
    }

    /// The error as a status, its structured form in the details.
    pub fn into_status(self) -> Status {
        let (kind, fields) = self.detail();
        encode("coordinator", kind, &self.to_string(), self.code(), fields)
    }

    /// The coordinator's error in a status, if the status carries one
    /// (not a transport failure, a timeout or another server's answer).
    pub fn from_status(status: &Status) -> Option<Self> {
        let (kind, f) = decode(status, "coordinator")?;
        let num = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok());
        Some(match kind.as_str() {
            "protocol_version" => CoordinatorError::ProtocolVersion {
                got: u32::try_from(num("got")?).ok()?,
                speaks: u32::try_from(num("speaks")?).ok()?,
            },
            "wrong_run" => CoordinatorError::WrongRun { got: field(&f, "got"), runs: field(&f, "runs") },
            "run_over" => CoordinatorError::RunOver {
                run_id: field(&f, "run_id"),
                state: RunState::from_str_name(&field(&f, "state"))?,
                message: field(&f, "message"),
            },
            "not_registered" => CoordinatorError::NotRegistered(field(&f, "instance_id")),
            "not_current_drafter" => CoordinatorError::NotCurrentDrafter(field(&f, "instance_id")),
            "invalid_request" => CoordinatorError::InvalidRequest { field: field(&f, "field"), why: field(&f, "why") },
            "refused" => CoordinatorError::Refused(field(&f, "why")),
            "ledger" => CoordinatorError::Ledger(field(&f, "why")),
            "too_many_watchers" => CoordinatorError::TooManyWatchers { max: num("max")? },
            _ => return None,
        })
    }
}

impl From<CoordinatorError> for Status {
    fn from(e: CoordinatorError) -> Self {
        e.into_status()
    }
}

/// Why the drafter's data plane refused or ended a hidden-state stream.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DrafterError {
    #[error("protocol version {got} is not supported (this drafter speaks {speaks})")]
    ProtocolVersion { got: u32, speaks: u32 },
    #[error("wrong run id \"{got}\": this drafter trains run \"{trains}\"")]
    WrongRun { got: String, trains: String },
    #[error("the first message of a stream must be a hello")]
    NoHello,
    #[error("no hello within {ms} ms")]
    HelloTimeout { ms: u64 },
    #[error("the hello's target_instance {0}")]
    BadInstanceId(String),
    /// The drafter serves this many streams already; try again later.
    #[error("the drafter serves at most {max} streams at once (pipeline.max_target_streams)")]
    TooManyStreams { max: u64 },
    /// A batch in progress brought nothing for too long; the stream ended.
    #[error("a batch was in progress and nothing arrived for {ms} ms (faults.stream_stall_timeout_ms)")]
    Stalled { ms: u64 },
    #[error("message of {len} bytes exceeds the limit of {limit}")]
    MessageTooLarge { len: u64, limit: u64 },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("compressed messages are not supported")]
    Compressed,
    #[error("{0} is not a method of this drafter")]
    UnknownMethod(String),
    /// The drafter is stopping (a restart comes up elsewhere).
    #[error("the drafter is stopping")]
    Stopping,
    /// The drafter cannot take the stream now (the OS refused it a thread).
    #[error("the drafter cannot take the stream now: {0}")]
    Overloaded(String),
}

impl DrafterError {
    /// The status code each variant answers with.
    pub fn code(&self) -> Code {
        match self {
            DrafterError::ProtocolVersion { .. } => Code::FailedPrecondition,
            DrafterError::WrongRun { .. } => Code::InvalidArgument,
            DrafterError::NoHello => Code::InvalidArgument,
            DrafterError::HelloTimeout { .. } => Code::DeadlineExceeded,
            DrafterError::BadInstanceId(_) => Code::InvalidArgument,
            DrafterError::TooManyStreams { .. } => Code::ResourceExhausted,
            DrafterError::Stalled { .. } => Code::DeadlineExceeded,
            DrafterError::MessageTooLarge { .. } => Code::OutOfRange,
            DrafterError::Malformed(_) => Code::InvalidArgument,
            DrafterError::Compressed => Code::Unimplemented,
            DrafterError::UnknownMethod(_) => Code::Unimplemented,
            DrafterError::Stopping => Code::Unavailable,
            DrafterError::Overloaded(_) => Code::ResourceExhausted,
        }
    }

    fn detail(&self) -> (&'static str, Vec<(&'static str, String)>) {
        match self {
            DrafterError::ProtocolVersion { got, speaks } => {
                ("protocol_version", vec![("got", got.to_string()), ("speaks", speaks.to_string())])
            }
            DrafterError::WrongRun { got, trains } => {
                ("wrong_run", vec![("got", got.clone()), ("trains", trains.clone())])
            }
            DrafterError::NoHello => ("no_hello", vec![]),
            DrafterError::HelloTimeout { ms } => ("hello_timeout", vec![("ms", ms.to_string())]),
            DrafterError::BadInstanceId(why) => ("bad_instance_id", vec![("why", why.clone())]),
            DrafterError::TooManyStreams { max } => ("too_many_streams", vec![("max", max.to_string())]),
            DrafterError::Stalled { ms } => ("stalled", vec![("ms", ms.to_string())]),
            DrafterError::MessageTooLarge { len, limit } => {
                ("message_too_large", vec![("len", len.to_string()), ("limit", limit.to_string())])
            }
            DrafterError::Malformed(why) => ("malformed", vec![("why", why.clone())]),
            DrafterError::Compressed => ("compressed", vec![]),
            DrafterError::UnknownMethod(path) => ("unknown_method", vec![("path", path.clone())]),
            DrafterError::Stopping => ("stopping", vec![]),
            DrafterError::Overloaded(why) => ("overloaded", vec![("why", why.clone())]),
        }
    }

    /// The error as a status, its structured form in the details.
    pub fn into_status(self) -> Status {
        let (kind, fields) = self.detail();
        encode("drafter", kind, &self.to_string(), self.code(), fields)
    }

    /// The drafter's error in a status, if the status carries one.
    pub fn from_status(status: &Status) -> Option<Self> {
        let (kind, f) = decode(status, "drafter")?;
        let num = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok());
        Some(match kind.as_str() {
            "protocol_version" => DrafterError::ProtocolVersion {
                got: u32::try_from(num("got")?).ok()?,
                speaks: u32::try_from(num("speaks")?).ok()?,
            },
            "wrong_run" => DrafterError::WrongRun { got: field(&f, "got"), trains: field(&f, "trains") },
            "no_hello" => DrafterError::NoHello,
            "hello_timeout" => DrafterError::HelloTimeout { ms: num("ms")? },
            "bad_instance_id" => DrafterError::BadInstanceId(field(&f, "why")),
            "too_many_streams" => DrafterError::TooManyStreams { max: num("max")? },
            "stalled" => DrafterError::Stalled { ms: num("ms")? },
            "message_too_large" => DrafterError::MessageTooLarge { len: num("len")?, limit: num("limit")? },
            "malformed" => DrafterError::Malformed(field(&f, "why")),
            "compressed" => DrafterError::Compressed,
            "unknown_method" => DrafterError::UnknownMethod(field(&f, "path")),
            "stopping" => DrafterError::Stopping,
            "overloaded" => DrafterError::Overloaded(field(&f, "why")),
            _ => return None,
        })
    }
}

impl From<DrafterError> for Status {
    fn from(e: DrafterError) -> Self {
        e.into_status()
    }
}

fn field(fields: &HashMap<String, String>, key: &str) -> String {
    fields.get(key).cloned().unwrap_or_default()
}

fn encode(service: &str, kind: &str, message: &str, code: Code, fields: Vec<(&'static str, String)>) -> Status {
    let detail = ErrorDetail {
        service: service.into(),
        kind: kind.into(),
        message: message.into(),
        fields: fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
    };
    Status::with_details(code, message, detail.encode_to_vec().into())
}

fn decode(status: &Status, service: &str) -> Option<(String, HashMap<String, String>)> {
    let d = ErrorDetail::decode(status.details()).ok()?;
    (d.service == service).then_some((d.kind, d.fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coordinator_errors() -> Vec<CoordinatorError> {
        vec![
            CoordinatorError::ProtocolVersion { got: 9, speaks: 3 },
            CoordinatorError::WrongRun { got: "a".into(), runs: "b".into() },
            CoordinatorError::RunOver { run_id: "r".into(), state: RunState::Completed, message: "done".into() },
            CoordinatorError::NotRegistered("t".into()),
            CoordinatorError::NotCurrentDrafter("d".into()),
            CoordinatorError::InvalidRequest { field: "instance_id".into(), why: "is empty".into() },
            CoordinatorError::Refused("no".into()),
            CoordinatorError::Ledger("disk".into()),
            CoordinatorError::TooManyWatchers { max: 256 },
        ]
    }

    fn drafter_errors() -> Vec<DrafterError> {
        vec![
            DrafterError::ProtocolVersion { got: 9, speaks: 3 },
            DrafterError::WrongRun { got: "a".into(), trains: "b".into() },
            DrafterError::NoHello,
            DrafterError::HelloTimeout { ms: 10 },
            DrafterError::BadInstanceId("x".into()),
            DrafterError::TooManyStreams { max: 4 },
            DrafterError::Stalled { ms: 30 },
            DrafterError::MessageTooLarge { len: 9, limit: 8 },
            DrafterError::Malformed("bad".into()),
            DrafterError::Compressed,
            DrafterError::UnknownMethod("/x".into()),
            DrafterError::Stopping,
            DrafterError::Overloaded("no thread".into()),
        ]
    }

    #[test]
    fn every_variant_maps_to_its_code_and_decodes_back_from_the_status() {
        let want = [
            Code::FailedPrecondition,
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::NotFound,
            Code::PermissionDenied,
            Code::InvalidArgument,
            Code::Aborted,
            Code::Internal,
            Code::ResourceExhausted,
        ];
        assert_eq!(coordinator_errors().len(), want.len());
        for (e, code) in coordinator_errors().into_iter().zip(want) {
            let s = e.clone().into_status();
            assert_eq!(s.code(), code, "{e:?}");
            assert_eq!(s.message(), e.to_string());
            assert_eq!(CoordinatorError::from_status(&s), Some(e.clone()), "{e:?}");
            assert_eq!(DrafterError::from_status(&s), None, "another service's error is not this one's");
        }
        let want = [
            Code::FailedPrecondition,
            Code::InvalidArgument,
            Code::InvalidArgument,
            Code::DeadlineExceeded,
            Code::InvalidArgument,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
            Code::OutOfRange,
            Code::InvalidArgument,
            Code::Unimplemented,
            Code::Unimplemented,
            Code::Unavailable,
            Code::ResourceExhausted,
        ];
        assert_eq!(drafter_errors().len(), want.len());
        for (e, code) in drafter_errors().into_iter().zip(want) {
            let s = e.clone().into_status();
            assert_eq!(s.code(), code, "{e:?}");
            assert_eq!(DrafterError::from_status(&s), Some(e.clone()), "{e:?}");
        }
        // A plain status (a transport failure, a timeout) carries none.
        assert_eq!(CoordinatorError::from_status(&Status::unavailable("connection refused")), None);
    }
}
