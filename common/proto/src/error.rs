//! The errors each service answers with: one enum per service, one
//! explicit mapping to gRPC status codes, and the whole structured error in
//! the status's details ([`ErrorDetail`]), so that a client decodes the
//! enum back ([`CoordinatorError::from_status`]) instead of reading the
//! message text, and the written policy (dflash-telemetry) decides what to
//! do from it.
//!
//! The detail is typed by serde: the variant's name in `kind` and its
//! fields as JSON, so adding a variant is one edit of the enum (and of its
//! code, which the compiler asks for), not an encoder and a decoder.

use prost::Message;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use tonic::{Code, Status};

use crate::{ErrorDetail, RunState};

/// Why the coordinator refused a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", content = "fields", rename_all = "snake_case")]
pub enum CoordinatorError {
    #[error("protocol version {got} is not supported (this coordinator speaks {speaks})")]
    ProtocolVersion { got: u32, speaks: u32 },
    #[error("wrong run id \"{got}\": this coordinator runs \"{runs}\"")]
    WrongRun { got: String, runs: String },
    /// The run is over: no more work, no new members.
    #[error("run {run_id} is over ({}): {message}", state.as_str_name())]
    RunOver {
        run_id: String,
        #[serde(with = "run_state_name")]
        state: RunState,
        message: String,
    },
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

    /// The error as a status, its structured form in the details.
    pub fn into_status(self) -> Status {
        encode("coordinator", &self, self.code())
    }

    /// The coordinator's error in a status, if the status carries one
    /// (not a transport failure, a timeout or another server's answer).
    pub fn from_status(status: &Status) -> Option<Self> {
        decode(status, "coordinator")
    }
}

impl From<CoordinatorError> for Status {
    fn from(e: CoordinatorError) -> Self {
        e.into_status()
    }
}

/// Why the drafter's data plane refused or ended a hidden-state stream.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", content = "fields", rename_all = "snake_case")]
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

    /// The error as a status, its structured form in the details.
    pub fn into_status(self) -> Status {
        encode("drafter", &self, self.code())
    }

    /// The drafter's error in a status, if the status carries one.
    pub fn from_status(status: &Status) -> Option<Self> {
        decode(status, "drafter")
    }
}

impl From<DrafterError> for Status {
    fn from(e: DrafterError) -> Self {
        e.into_status()
    }
}

/// The error's variant and fields in a status's details.
fn encode<E: Serialize + std::fmt::Display>(service: &str, e: &E, code: Code) -> Status {
    let message = e.to_string();
    // An enum of plain fields always serializes; were it not to, the
    // status still carries the code and the message.
    let tagged = serde_json::to_value(e).unwrap_or_default();
    let detail = ErrorDetail {
        service: service.into(),
        kind: tagged.get("kind").and_then(|k| k.as_str()).unwrap_or_default().into(),
        message: message.clone(),
        fields_json: tagged.get("fields").map(|f| f.to_string()).unwrap_or_default(),
    };
    Status::with_details(code, message, detail.encode_to_vec().into())
}

/// `service`'s error in a status, if its details carry one this build
/// knows (None: a transport failure, a timeout, another service's error).
fn decode<E: DeserializeOwned>(status: &Status, service: &str) -> Option<E> {
    let d = ErrorDetail::decode(status.details()).ok()?;
    if d.service != service {
        return None;
    }
    let mut tagged = serde_json::Map::new();
    tagged.insert("kind".into(), d.kind.into());
    if !d.fields_json.is_empty() {
        tagged.insert("fields".into(), serde_json::from_str(&d.fields_json).ok()?);
    }
    serde_json::from_value(tagged.into()).ok()
}

/// A run state in an error's fields by its protocol name (`RUN_STATE_COMPLETED`).
mod run_state_name {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::RunState;

    pub fn serialize<S: Serializer>(state: &RunState, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(state.as_str_name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<RunState, D::Error> {
        let name = String::deserialize(d)?;
        RunState::from_str_name(&name).ok_or_else(|| serde::de::Error::custom(format!("unknown run state {name:?}")))
    }
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

    #[test]
    fn the_detail_names_the_variant_and_carries_its_fields_as_json() {
        let s = CoordinatorError::RunOver { run_id: "r".into(), state: RunState::Failed, message: "nan".into() }
            .into_status();
        let d = ErrorDetail::decode(s.details()).unwrap();
        assert_eq!((d.service.as_str(), d.kind.as_str()), ("coordinator", "run_over"));
        let fields: serde_json::Value = serde_json::from_str(&d.fields_json).unwrap();
        assert_eq!(fields, serde_json::json!({"run_id": "r", "state": "RUN_STATE_FAILED", "message": "nan"}));
        let d = ErrorDetail::decode(DrafterError::Stopping.into_status().details()).unwrap();
        assert_eq!((d.kind.as_str(), d.fields_json.as_str()), ("stopping", ""));
    }

    #[test]
    fn a_detail_this_build_does_not_know_decodes_to_none() {
        let status = |kind: &str, fields: &str| {
            let d = ErrorDetail {
                service: "drafter".into(),
                kind: kind.into(),
                message: "m".into(),
                fields_json: fields.into(),
            };
            Status::with_details(Code::Internal, "m", d.encode_to_vec().into())
        };
        assert_eq!(DrafterError::from_status(&status("stalled", r#"{"ms":5}"#)), Some(DrafterError::Stalled { ms: 5 }));
        assert_eq!(DrafterError::from_status(&status("a_newer_variant", "")), None);
        assert_eq!(DrafterError::from_status(&status("stalled", r#"{"ms":"five"}"#)), None, "a field of another type");
        assert_eq!(DrafterError::from_status(&status("stalled", "{")), None, "not JSON");
    }
}
