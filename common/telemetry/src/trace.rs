//! Traces: one OpenTelemetry trace per batch across the services, exported
//! over OTLP/gRPC when an endpoint is known, silent otherwise.
//!
//! Each pipeline stage opens a [`batch_span`] whose parent is the previous
//! stage's [`TraceContext`] (W3C `traceparent`), which travels with the
//! batch: in the coordinator's lease, in the target's work items and host
//! batches, and in the wire header to the drafter.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::global;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::dynamic_filter_fn;
use tracing_subscriber::registry::LookupSpan;

/// A W3C trace context (`traceparent`, `tracestate`) as carried in headers.
pub type TraceContext = HashMap<String, String>;

/// Whether spans are recorded at all (an exporter is attached).
static ENABLED: AtomicBool = AtomicBool::new(false);
static SERVICE: OnceLock<String> = OnceLock::new();
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();
static EXPORTER: OnceLock<Attached> = OnceLock::new();

/// The OTLP exporter and the runtime its gRPC client runs on.
struct Attached {
    exporter: Arc<opentelemetry_otlp::SpanExporter>,
    runtime: tokio::runtime::Handle,
}

/// The provider's exporter: drops spans until [`enable_otlp`] attaches the
/// OTLP exporter, then runs each export on the process's tokio runtime
/// (the SDK's batch thread has no reactor of its own, and tonic needs one).
#[derive(Debug)]
struct LateExporter;

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Attached")
    }
}

impl SpanExporter for LateExporter {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let attached = EXPORTER.get().map(|a| (Arc::clone(&a.exporter), a.runtime.clone()));
        async move {
            let Some((exporter, runtime)) = attached else { return Ok(()) };
            match runtime.spawn(async move { exporter.export(batch).await }).await {
                Ok(r) => r,
                Err(e) => Err(OTelSdkError::InternalFailure(format!("span export task: {e}"))),
            }
        }
    }
}

fn resource() -> Resource {
    let service = SERVICE.get().cloned().unwrap_or_else(|| "dflash".to_string());
    Resource::builder().with_service_name(service).build()
}

/// The trace layer of the subscriber: records spans of `dflash::*` targets
/// once an exporter is attached.
pub(crate) fn layer<S>(service: &str) -> impl Layer<S>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    let _ = SERVICE.set(service.to_string());
    let provider = SdkTracerProvider::builder().with_batch_exporter(LateExporter).with_resource(resource()).build();
    let tracer = provider.tracer("dflash");
    let _ = PROVIDER.set(provider);
    global::set_text_map_propagator(TraceContextPropagator::new());
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(dynamic_filter_fn(|m, _| ENABLED.load(Ordering::Relaxed) && m.target().starts_with("dflash::")))
}

/// The collector named by the standard variables
/// (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, then `OTEL_EXPORTER_OTLP_ENDPOINT`);
/// none when unset, empty, or `OTEL_SDK_DISABLED=true`.
pub fn otlp_endpoint_from_env() -> Option<String> {
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
        return None;
    }
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
}

/// Starts exporting spans over OTLP/gRPC to `configured` (the run config's
/// `telemetry.otlp_endpoint`) or else the `OTEL_*` variables; does nothing
/// when neither names one. Returns the endpoint in use. Must run inside the
/// tokio runtime the exports will use.
pub fn enable_otlp(configured: Option<&str>) -> anyhow::Result<Option<String>> {
    let Some(endpoint) =
        configured.map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).or_else(otlp_endpoint_from_env)
    else {
        return Ok(None);
    };
    if let Some(_a) = EXPORTER.get() {
        return Ok(Some(endpoint));
    }
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| anyhow::anyhow!("OTLP export needs a tokio runtime (internal error)"))?;
    let _guard = runtime.enter();
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint.clone())
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| anyhow::anyhow!("OTLP exporter for {endpoint}: {e}"))?;
    exporter.set_resource(&resource());
    let _ = EXPORTER.set(Attached { exporter: Arc::new(exporter), runtime });
    ENABLED.store(true, Ordering::Relaxed);
    tracing::info!("exporting traces over OTLP/gRPC to {endpoint}");
    Ok(Some(endpoint))
}

/// Whether spans are being exported.
pub fn traces_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Flushes and stops the exporter (bounded by the exporter's timeout).
/// Blocking: call it from a plain thread or `spawn_blocking`.
pub fn shutdown_tracing() {
    if let Some(p) = PROVIDER.get()
        && traces_enabled()
    {
        if let Err(e) = p.force_flush() {
            tracing::warn!("flushing traces: {e}");
        }
        let _ = p.shutdown_with_timeout(Duration::from_secs(5));
        ENABLED.store(false, Ordering::Relaxed);
    }
}

/// A span for one pipeline stage of one batch, child of `parent` (the
/// previous stage's context; a new trace when empty).
pub fn batch_span(stage: &'static str, parent: &TraceContext, batch_id: u64) -> Span {
    let span = tracing::info_span!(target: "dflash::batch", parent: None, "batch", otel.name = stage, batch_id);
    if !parent.is_empty() && !span.is_disabled() {
        let cx = global::get_text_map_propagator(|p| p.extract(parent));
        let _ = span.set_parent(cx);
    }
    span
}

/// The context to hand to the next stage (empty when traces are off).
pub fn context_of(span: &Span) -> TraceContext {
    let mut out = TraceContext::new();
    if !span.is_disabled() {
        global::get_text_map_propagator(|p| p.inject_context(&span.context(), &mut out));
    }
    out
}

/// The span of one control RPC (none for health checks).
pub fn rpc_span(path: &str) -> Span {
    if path.starts_with("/grpc.health.v1.") {
        return Span::none();
    }
    tracing::info_span!(target: "dflash::rpc", "rpc", otel.name = path, otel.kind = "server", rpc.system = "grpc")
}
