//! The dflash.v1 gRPC contract, generated from `proto/dflash/v1/*.proto`.

/// Protocol version spoken by this build. A peer speaking another version is
/// refused with a clear error at registration or stream start. 5: batch
/// headers carry the lease token of their batch. 6: error details carry
/// their variant's fields as JSON (typed by serde). 7: the plan comes in
/// pages (`GetPlan`'s `from_batch_id` / `from_assigned`).
pub const PROTOCOL_VERSION: u32 = 7;

/// The hidden-state RPC's HTTP path (package, service, method of `drafter.proto`),
/// for the data plane that serves and calls it below tonic's codec.
pub const STREAM_HIDDEN_STATES_PATH: &str = "/dflash.v1.Drafter/StreamHiddenStates";

pub mod error;
pub mod lease_token;

pub use error::{CoordinatorError, DrafterError};

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("dflash.v1");
}

pub use v1::*;

impl Role {
    /// Lower-case role name used in logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Role::Unspecified => "unspecified",
            Role::Coordinator => "coordinator",
            Role::Target => "target",
            Role::Drafter => "drafter",
        }
    }
}

impl ErrorKind {
    /// The kind's name in logs and metric labels: the protocol name
    /// without its prefix, lower case (`non_finite`).
    pub fn label(self) -> String {
        self.as_str_name().trim_start_matches("ERROR_KIND_").to_ascii_lowercase()
    }

    /// A reported kind, an unspecified one (a peer that set none) read
    /// as internal.
    pub fn or_internal(self) -> Self {
        if self == ErrorKind::Unspecified { ErrorKind::Internal } else { self }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

/// Longest instance id a peer may use.
pub const MAX_INSTANCE_ID: usize = 128;

/// Checks an instance id a peer sent (registration, stream hello, batch
/// header): 1 to [`MAX_INSTANCE_ID`] printable ASCII characters without
/// spaces. It names threads, log lines and ledger rows: a NUL would fail a
/// thread's creation, a newline would forge log lines.
pub fn check_instance_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("is empty".into());
    }
    if id.len() > MAX_INSTANCE_ID {
        return Err(format!("is {} bytes long (at most {MAX_INSTANCE_ID})", id.len()));
    }
    if let Some(c) = id.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!("{:?} contains {c:?}: only printable ASCII without spaces is allowed", id));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_ids_are_printable_and_bounded() {
        check_instance_id("target-node-3.example:1234").unwrap();
        for bad in ["", "a\0b", "a\nb", "a b", "ü", &"x".repeat(129)] {
            assert!(check_instance_id(bad).is_err(), "{bad:?}");
        }
    }
}
