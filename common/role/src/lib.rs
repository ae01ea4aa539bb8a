//! What every role process does with the coordinator: register and receive
//! the run config, heartbeat, watch run events, report errors, serve
//! grpc.health.v1, and stop for one recorded cause.

mod backoff;
mod errors;
mod health;
pub mod lock;
pub mod memory;
pub mod security;
mod session;
mod stages;
mod stop;

pub use backoff::Backoff;
pub use errors::{DeviceError, DeviceExt, KindExt, RoleError, device_of, format_chain, kind_of};
pub use health::{HealthArgs, check_health, serve_health, serve_health_only};
pub use lock::{ExclusiveLock, LockError};
pub use security::{Security, SecurityArgs};
pub use session::{
    Announce, CoordinatorConn, RoleArgs, Session, coordinator_client, lazy_channel, registration_failed,
    run_over_cause, with_timeout,
};
pub use stages::Stages;
pub use stop::{EXIT_DEVICE_LOST, EXIT_GROUP_REFORM, Stop, StopCause, recv_until_stop, send_until_stop};
