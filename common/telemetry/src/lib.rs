//! Logging and the error policy shared by every role.
//!
//! [`init_logging`] sets up the process's log output once. [`ErrorKind`] is
//! the written policy of what is retried and what fails the run;
//! [`cause_chain`] flattens an error for reporting to the coordinator.

mod policy;

pub use policy::{ErrorKind, cause_chain};

use tracing_subscriber::EnvFilter;

/// Log filter variable; `RUST_LOG` is honoured too.
pub const LOG_ENV: &str = "DFLASH_LOG";

/// Installs the log subscriber: compact lines on stderr, level from
/// `DFLASH_LOG` or `RUST_LOG` (default `info`). Idempotent.
pub fn init_logging() {
    let filter = std::env::var(LOG_ENV).or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| "info".to_string());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}
