//! Traces and metrics of a real run: an in-process OTLP collector receives
//! the spans of all three processes, and one batch's spans form a single
//! trace whose parent chain follows the data path; each role serves
//! Prometheus metrics while it runs.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dflash_tests::{Workspace, free_port, http_get, metric_value};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;

/// One received span, flattened.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    batch_id: Option<i64>,
}

/// The in-process collector: keeps every span it is sent.
#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| match a.value.as_ref().and_then(|v| v.value.as_ref()) {
                    Some(Value::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for s in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                let batch_id = s.attributes.iter().find(|a| a.key == "batch_id").and_then(|a| {
                    match a.value.as_ref().and_then(|v| v.value.as_ref()) {
                        Some(Value::IntValue(i)) => Some(*i),
                        // u64 fields arrive as their decimal text.
                        Some(Value::StringValue(s)) => s.parse().ok(),
                        _ => None,
                    }
                });
                out.push(Span {
                    service: service.clone(),
                    name: s.name,
                    trace_id: s.trace_id,
                    span_id: s.span_id,
                    parent: s.parent_span_id,
                    batch_id,
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// The metrics URLs `dflash up --metrics` printed, by role.
fn metrics_urls(log: &str) -> HashMap<String, String> {
    let line = log.lines().find_map(|l| l.split_once("metrics: ").map(|(_, r)| r.to_string())).unwrap_or_default();
    line.split(", ").filter_map(|p| p.split_once(' ')).map(|(role, url)| (role.to_string(), url.to_string())).collect()
}

#[test]
fn one_trace_per_batch_spans_the_services_and_metrics_are_served() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let collector = Collector::default();
    let port = free_port();
    let server = TraceServiceServer::new(collector.clone());
    rt.spawn(
        tonic::transport::Server::builder().add_service(server).serve(format!("127.0.0.1:{port}").parse().unwrap()),
    );

    let ws = Workspace::synthetic(300, 4);
    // Long enough (about 200 steps over several epochs) that the metrics
    // pages are polled while work is in flight: one epoch of this dataset
    // trains in well under a second on an idle machine, and the roles exit
    // when the run completes.
    let config = ws.config(
        "traced",
        &format!("[run]\nepochs = 10\nmax_steps = 200\n[telemetry]\notlp_endpoint = \"http://127.0.0.1:{port}\"\n"),
    );
    let extra = ["--metrics", "--progress-every-s", "1"];
    let mut up = dflash_tests::up(&ws, &config, &extra, &[("OTEL_BSP_SCHEDULE_DELAY", "500")]);

    // Metrics while the run goes: every role counts its side of the work.
    assert!(up.wait_for_log("metrics: ", Duration::from_secs(30)), "no metrics line:\n{}", up.log_text());
    let urls = metrics_urls(&up.log_text());
    assert_eq!(urls.len(), 3, "{urls:?}");
    let want = [
        ("target", "dflash_tokens_total{stage=\"captured\"}"),
        ("target", "dflash_payload_bytes_total{direction=\"sent\"}"),
        ("drafter", "dflash_batches_total{stage=\"received\"}"),
        ("drafter", "dflash_tokens_total{stage=\"trained\"}"),
        ("coordinator", "dflash_ledger_batches{state=\"trained\"}"),
    ];
    let mut seen = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while seen.len() < want.len() && Instant::now() < deadline {
        for (role, sample) in want {
            if let Ok(page) = http_get(&urls[role])
                && metric_value(&page, sample).is_some_and(|v| v > 0.0)
            {
                seen.insert(sample, page.contains("dflash_queue_depth"));
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(seen.len(), want.len(), "metrics never counted work: {seen:?}\n{}", up.log_text());

    let status = up.expect_exit(Duration::from_secs(240));
    let log = up.log_text();
    assert!(status.success(), "{log}");
    assert!(log.contains("[progress   ] step "), "no progress line:\n{log}");

    // Spans arrive when each process flushes at exit.
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = collector.0.lock().unwrap().clone();
        let services: std::collections::BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
        if services.len() >= 3 || Instant::now() > deadline {
            break spans;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let services: std::collections::BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services,
        ["dflash-coordinator", "dflash-drafter", "dflash-target"].into(),
        "{} spans from {services:?}",
        spans.len()
    );
    // Control RPCs are traced; health checks are not.
    assert!(spans.iter().any(|s| s.name == "/dflash.v1.Coordinator/Register"), "no RPC spans");
    assert!(!spans.iter().any(|s| s.name.contains("grpc.health")), "health checks were traced");

    // Every stage of one batch, each exactly once, in one trace, each the
    // child of the stage before it.
    let chain = [
        ("lease", "dflash-coordinator", None),
        ("forward", "dflash-target", Some("lease")),
        ("postprocess", "dflash-target", Some("forward")),
        ("send", "dflash-target", Some("postprocess")),
        ("receive", "dflash-drafter", Some("send")),
        ("ack", "dflash-drafter", Some("receive")),
        ("queue_wait", "dflash-drafter", Some("receive")),
        ("h2d", "dflash-drafter", Some("queue_wait")),
        ("train_step", "dflash-drafter", Some("h2d")),
    ];
    let mut checked = 0;
    for batch in 0..30i64 {
        let of_batch: Vec<&Span> = spans.iter().filter(|s| s.batch_id == Some(batch)).collect();
        let by_name: HashMap<&str, Vec<&Span>> = of_batch.iter().fold(HashMap::new(), |mut m, s| {
            m.entry(s.name.as_str()).or_insert_with(Vec::new).push(*s);
            m
        });
        // Batches replayed or trained twice have several spans per stage.
        if chain.iter().any(|(name, ..)| by_name.get(name).map_or(0, Vec::len) != 1) {
            continue;
        }
        let one = |name: &str| by_name[name][0];
        let trace = &one("lease").trace_id;
        for (name, service, parent) in chain {
            let s = one(name);
            assert_eq!(s.service, service, "batch {batch}: {name}");
            assert_eq!(&s.trace_id, trace, "batch {batch}: {name} is in another trace");
            match parent {
                None => assert!(s.parent.is_empty(), "batch {batch}: the lease should be the root"),
                Some(p) => assert_eq!(s.parent, one(p).span_id, "batch {batch}: {name} is not a child of {p}"),
            }
        }
        checked += 1;
    }
    let names: std::collections::BTreeMap<(String, Option<i64>), usize> =
        spans.iter().filter(|s| s.batch_id.is_none_or(|b| b < 3)).fold(Default::default(), |mut m, s| {
            *m.entry((s.name.clone(), s.batch_id)).or_default() += 1;
            m
        });
    assert!(checked >= 10, "only {checked} batches had a complete trace; {} spans: {names:?}", spans.len());
}
