//! Telemetry shared by every role: log output, OpenTelemetry traces that
//! follow each batch across the services, Prometheus metrics, and the
//! written error policy.
//!
//! [`init`] installs the log subscriber once, with a trace layer that stays
//! silent until [`enable_otlp`] names a collector. Roles learn the endpoint
//! only after registering, so the layer is in place from the start and the
//! exporter is attached later (a reloadable layer would hide the span
//! context that cross-process propagation needs).

mod metrics;
mod policy;
mod trace;

pub use metrics::{Metrics, metrics, serve_metrics};
pub use policy::{
    ErrorKind, KindPolicy, RETRY_DELAY_CAP, Reaction, cause_chain, on_coordinator_error, on_drafter_error, retry_delays,
};
pub use trace::{
    TraceContext, batch_span, context_of, enable_otlp, otlp_endpoint_from_env, rpc_span, shutdown_tracing,
    traces_enabled,
};

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Log filter variable; `RUST_LOG` is honoured too.
pub const LOG_ENV: &str = "DFLASH_LOG";

/// Installs the process's subscriber: compact log lines on stderr (level
/// from `DFLASH_LOG` or `RUST_LOG`, default `info`) and the trace layer for
/// `service` (e.g. `dflash-target`). Idempotent.
pub fn init(service: &str) {
    let filter = std::env::var(LOG_ENV).or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| "info".to_string());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .with_filter(EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new("info")));
    let _ = tracing_subscriber::registry().with(fmt).with(trace::layer(service)).try_init();
}

/// Log output only, for tools and benchmarks that export no traces.
pub fn init_logging() {
    init("dflash");
}
