//! The dflash.v1 gRPC contract, generated from `proto/dflash/v1/*.proto`.

/// Protocol version spoken by this build. A peer speaking another version is
/// refused with a clear error at registration or stream start.
pub const PROTOCOL_VERSION: u32 = 1;

/// The hidden-state RPC's HTTP path (package, service, method of `drafter.proto`),
/// for the data plane that serves and calls it below tonic's codec.
pub const STREAM_HIDDEN_STATES_PATH: &str = "/dflash.v1.Drafter/StreamHiddenStates";

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
