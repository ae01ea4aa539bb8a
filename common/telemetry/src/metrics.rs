//! Prometheus metrics: one registry per process, the figures an operator
//! watches (throughput, queues, idle time, loss, acceptance length, bytes,
//! errors), served as text on `/metrics`.

use std::net::SocketAddr;
use std::sync::LazyLock;

use prometheus::{
    CounterVec, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric a role may export; each role sets the ones that apply.
pub struct Metrics {
    pub registry: Registry,
    /// Feature tokens by stage: `captured` (target forward), `sent`
    /// (acknowledged by a drafter), `received`, `trained`.
    pub tokens: IntCounterVec,
    /// Batches by stage: `leased`, `captured` (`cache_hit`: those of them
    /// the target feature cache served), `sent`, `resent`, `received`,
    /// `trained`, `skipped`, `duplicate`.
    pub batches: IntCounterVec,
    /// Current depth of each bounded queue (`work`, `postprocess`, `send`,
    /// `hs_queue`, `prefetch`).
    pub queue_depth: IntGaugeVec,
    /// Batches sent to a drafter and not yet acknowledged.
    pub inflight_batches: IntGaugeVec,
    /// Fraction of wall time a loop waited for input (`forward`, `train`).
    pub idle_fraction: GaugeVec,
    /// Target GPUs: seconds idle between forwards, by reason: `unqueued`
    /// (the next forward was not launched yet: no work, or the postprocess
    /// queue full) or `ids` (launched, waiting for its ids upload).
    pub gpu_idle_seconds: CounterVec,
    pub step_seconds: Histogram,
    /// Drafter: how long a checkpoint paused training (its host snapshot;
    /// the whole write when `checkpoint.async_write` is off), and how long
    /// it took until durable.
    pub checkpoint_seconds: HistogramVec,
    pub loss: Gauge,
    pub accuracy: Gauge,
    /// `simulated` (from the training step) and `eval` (real speculative
    /// decoding on held-out prompts).
    pub acceptance_length: GaugeVec,
    pub step: Gauge,
    /// Payload bytes by direction (`sent`, `received`).
    pub bytes: IntCounterVec,
    /// Errors by kind of the written policy.
    pub errors: IntCounterVec,
    /// Coordinator: ledger batches by state.
    pub ledger_batches: IntGaugeVec,
    /// Coordinator: feature tokens/s the targets produce (`supply`) and the
    /// drafters train (`demand`).
    pub flow_tokens_per_second: GaugeVec,
    pub registered_instances: IntGaugeVec,
    /// Coordinator: 1 for the run's state (`running`, `completed`,
    /// `failed`, `cancelled`), 0 for the others.
    pub run_state: IntGaugeVec,
    /// Coordinator: 1 while the named alarm is raised (`supply_stalled`).
    pub alarm: IntGaugeVec,
    pub up: IntCounter,
    /// Unix time this process started: a restart shows as a change.
    pub start_time: Gauge,
    /// Resident memory, read from `/proc/self/statm` at each scrape.
    pub resident_memory: Gauge,
    names: Vec<String>,
}

/// What every metric's name starts with (`dflash_`).
const PREFIX: &str = "dflash";

/// Registers a metric with the registry, notes its name, and returns it
/// (a cheap handle).
fn reg<C: prometheus::core::Collector + Clone + 'static>(
    r: &Registry,
    names: &mut Vec<String>,
    metric: prometheus::Result<C>,
) -> C {
    let m = metric.expect("valid metric");
    // The registry adds its prefix when it gathers.
    names.extend(m.desc().iter().map(|d| format!("{PREFIX}_{}", d.fq_name)));
    r.register(Box::new(m.clone())).expect("unique metric");
    m
}

impl Metrics {
    fn new() -> Self {
        let r = Registry::new_custom(Some(PREFIX.into()), None).expect("registry");
        let mut names = Vec::new();
        let step_seconds = reg(
            &r,
            &mut names,
            Histogram::with_opts(
                HistogramOpts::new("step_seconds", "Wall time of one optimizer step")
                    .buckets(prometheus::exponential_buckets(0.005, 2.0, 14).expect("buckets")),
            ),
        );
        let up =
            reg(&r, &mut names, IntCounter::new("process_starts_total", "Starts of this process (1 while it runs)"));
        up.inc();
        let start_time =
            reg(&r, &mut names, Gauge::new("process_start_time_seconds", "Unix time this process started"));
        start_time
            .set(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()));
        let resident_memory =
            reg(&r, &mut names, Gauge::new("process_resident_memory_bytes", "Resident memory of this process"));
        Self {
            tokens: reg(
                &r,
                &mut names,
                IntCounterVec::new(Opts::new("tokens_total", "Feature tokens by pipeline stage"), &["stage"]),
            ),
            batches: reg(
                &r,
                &mut names,
                IntCounterVec::new(Opts::new("batches_total", "Batches by pipeline stage"), &["stage"]),
            ),
            queue_depth: reg(
                &r,
                &mut names,
                IntGaugeVec::new(Opts::new("queue_depth", "Items in each bounded queue"), &["queue"]),
            ),
            inflight_batches: reg(
                &r,
                &mut names,
                IntGaugeVec::new(Opts::new("inflight_batches", "Unacknowledged batches per stream"), &["stream"]),
            ),
            idle_fraction: reg(
                &r,
                &mut names,
                GaugeVec::new(Opts::new("idle_fraction", "Fraction of wall time a loop waited for input"), &["loop"]),
            ),
            gpu_idle_seconds: reg(
                &r,
                &mut names,
                CounterVec::new(
                    Opts::new("gpu_idle_seconds_total", "Target GPU time idle between forwards"),
                    &["reason"],
                ),
            ),
            step_seconds,
            checkpoint_seconds: reg(
                &r,
                &mut names,
                HistogramVec::new(
                    HistogramOpts::new(
                        "checkpoint_seconds",
                        "Checkpoints: training paused (`pause`) and until durable (`write`)",
                    )
                    .buckets(prometheus::exponential_buckets(0.01, 2.0, 16).expect("buckets")),
                    &["phase"],
                ),
            ),
            loss: reg(&r, &mut names, Gauge::new("loss", "Training loss of the last step")),
            accuracy: reg(&r, &mut names, Gauge::new("accuracy", "Token accuracy of the last step")),
            acceptance_length: reg(
                &r,
                &mut names,
                GaugeVec::new(Opts::new("acceptance_length", "Acceptance length tau"), &["kind"]),
            ),
            step: reg(&r, &mut names, Gauge::new("step", "Optimizer step")),
            bytes: reg(
                &r,
                &mut names,
                IntCounterVec::new(Opts::new("payload_bytes_total", "Hidden-state payload bytes"), &["direction"]),
            ),
            errors: reg(&r, &mut names, IntCounterVec::new(Opts::new("errors_total", "Errors by kind"), &["kind"])),
            ledger_batches: reg(
                &r,
                &mut names,
                IntGaugeVec::new(Opts::new("ledger_batches", "Ledger batches by state"), &["state"]),
            ),
            flow_tokens_per_second: reg(
                &r,
                &mut names,
                GaugeVec::new(Opts::new("flow_tokens_per_second", "Supply and demand"), &["side"]),
            ),
            registered_instances: reg(
                &r,
                &mut names,
                IntGaugeVec::new(Opts::new("registered_instances", "Registered instances by role"), &["role"]),
            ),
            run_state: reg(
                &r,
                &mut names,
                IntGaugeVec::new(Opts::new("run_state", "1 for the run's state"), &["state"]),
            ),
            alarm: reg(&r, &mut names, IntGaugeVec::new(Opts::new("alarm", "1 while the alarm is raised"), &["name"])),
            up,
            start_time,
            resident_memory,
            names,
            registry: r,
        }
    }

    /// The name of every metric a role may export (with the registry's
    /// `dflash_` prefix; a histogram's series add `_bucket`, `_sum`,
    /// `_count`), whether or not this process has set it: what dashboards
    /// and alerting rules may query.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        if let Some(bytes) = resident_bytes() {
            self.resident_memory.set(bytes as f64);
        }
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            return format!("# encoding failed: {e}\n");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// Resident set size from `/proc/self/statm` (pages, second field).
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The process's metrics.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// Binds `/metrics` on `addr` (port 0 picks one; the log line names it)
/// and returns the server, to run as one of the role's stages until
/// `shutdown` completes.
pub async fn serve_metrics(
    addr: SocketAddr,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("metrics endpoint {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route("/metrics", axum::routing::get(|| async { metrics().render() }));
    tracing::info!("metrics on http://{bound}/metrics");
    Ok(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|e| anyhow::anyhow!("metrics endpoint {bound}: {e}"))
    })
}
