//! A real Prometheus (Debian's, unpacked by scripts/setup-prometheus.sh)
//! scrapes the three roles of a CPU run every second, with the shipped
//! alerting rules loaded, and the test asks it through its HTTP query API:
//! the training step rises, the ledger's gauges add up to the plan, and a
//! SIGKILLed drafter's replacement shows as a new process whose counters
//! start again. promtool checks the shipped scrape config and rules and runs
//! their unit tests; the Grafana dashboard and the rules query only metrics
//! the roles export.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use dflash_tests::{Cluster, Proc, Workspace, free_port, http_get, repo_root};
use nix::sys::signal::Signal;

/// prometheus or promtool, as scripts/setup-prometheus.sh unpacked them.
fn prometheus_bin(name: &str) -> PathBuf {
    let dir =
        std::env::var_os("DFLASH_PROMETHEUS_DIR").map_or_else(|| repo_root().join(".cache/prometheus"), PathBuf::from);
    let path = dir.join("bin").join(name);
    assert!(path.exists(), "{} is missing: run scripts/setup-prometheus.sh (make test does)", path.display());
    path
}

fn promtool(args: &[&str]) -> String {
    let out =
        Command::new(prometheus_bin("promtool")).args(args).current_dir(repo_root().join("deploy/prometheus")).output();
    let out = out.unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn the_shipped_scrape_config_and_alerting_rules_pass_promtool_and_their_unit_tests() {
    assert!(promtool(&["check", "config", "prometheus.yml"]).contains("SUCCESS"));
    let rules = promtool(&["check", "rules", "rules.yml"]);
    assert!(rules.contains("SUCCESS: 6 rules found"), "{rules}");
    // Each alert pending, firing and cleared at the minutes the test names.
    assert!(promtool(&["test", "rules", "rules.test.yml"]).contains("SUCCESS"));
}

/// Every `dflash_*` metric a PromQL text names.
fn metric_names(promql: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = promql;
    while let Some(i) = rest.find("dflash_") {
        let name: String = rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        rest = &rest[i + name.len()..];
        out.insert(name);
    }
    out
}

/// Whether `name` is a declared metric or one series of a declared histogram.
fn declared(name: &str, names: &BTreeSet<String>) -> bool {
    names.contains(name)
        || ["_bucket", "_sum", "_count"].iter().any(|s| name.strip_suffix(s).is_some_and(|b| names.contains(b)))
}

#[test]
fn the_dashboard_and_the_rules_query_only_metrics_the_roles_export() {
    let names: BTreeSet<String> = dflash_telemetry::metrics().names().iter().cloned().collect();
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo_root().join("deploy/grafana/dflash.json")).unwrap())
            .unwrap();
    let mut queried = BTreeSet::new();
    let panels = dash["panels"].as_array().unwrap();
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            let used = metric_names(expr);
            assert!(!used.is_empty(), "panel {:?} queries no dflash metric: {expr}", p["title"]);
            queried.extend(used);
        }
    }
    let rules = std::fs::read_to_string(repo_root().join("deploy/prometheus/rules.yml")).unwrap();
    let in_rules = metric_names(&rules);
    let unknown: Vec<_> = queried.iter().chain(&in_rules).filter(|n| !declared(n, &names)).collect();
    assert!(unknown.is_empty(), "queried but not exported: {unknown:?} (exported: {names:?})");
    // What the issue asks the dashboard to show.
    for want in [
        "dflash_tokens_total",
        "dflash_queue_depth",
        "dflash_idle_fraction",
        "dflash_flow_tokens_per_second",
        "dflash_loss",
        "dflash_accuracy",
        "dflash_acceptance_length",
        "dflash_step_seconds_bucket",
        "dflash_errors_total",
    ] {
        assert!(queried.contains(want), "the dashboard shows no {want}");
    }
    assert!(panels.len() >= 10);
}

/// A query's instant vector through Prometheus's HTTP API: (labels, value).
fn query(port: u16, promql: &str) -> Vec<(serde_json::Value, f64)> {
    let encoded: String = promql
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let Ok(body) = http_get(&format!("http://127.0.0.1:{port}/api/v1/query?query={encoded}")) else {
        return Vec::new();
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { return Vec::new() };
    assert_eq!(v["status"], "success", "{promql}: {body}");
    v["data"]["result"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| (r["metric"].clone(), r["value"][1].as_str().unwrap().parse().unwrap()))
        .collect()
}

/// The single value of a query, once it has one.
fn scalar(port: u16, promql: &str) -> Option<f64> {
    query(port, promql).first().map(|(_, v)| *v)
}

/// Waits until `check` holds for the query's single value.
fn wait_until(port: u16, promql: &str, timeout: Duration, check: impl Fn(f64) -> bool) -> Option<f64> {
    let deadline = Instant::now() + timeout;
    loop {
        let v = scalar(port, promql);
        if v.is_some_and(&check) || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn with_metrics(mut cmd: dflash_cluster::RoleCommand, port: u16) -> dflash_cluster::RoleCommand {
    cmd.args.extend(["--metrics-listen".into(), format!("127.0.0.1:{port}")]);
    cmd
}

fn write_scrape_config(dir: &Path, ports: [(&str, u16); 3]) -> PathBuf {
    let mut text = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n",
        repo_root().join("deploy/prometheus/rules.yml").display()
    );
    for (job, port) in ports {
        text += &format!("  - job_name: {job}\n    static_configs:\n      - targets: [\"127.0.0.1:{port}\"]\n");
    }
    let path = dir.join("prometheus.yml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_real_prometheus_scrapes_every_role_and_sees_a_drafter_restart() {
    let ws = Workspace::synthetic(800, 3);
    // Long enough for a few dozen scrapes on two cores.
    let extra = "[run]\nepochs = 40\nmax_steps = 2500\nlog_every_steps = 50\n[checkpoint]\ninterval_steps = 100\n";
    let cluster = Cluster::new(&ws, ws.config("scraped", extra));
    let (pc, pd, pt, pp) = (free_port(), free_port(), free_port(), free_port());
    let config = write_scrape_config(ws.dir.path(), [("coordinator", pc), ("drafter", pd), ("target", pt)]);
    let data = ws.path("tsdb");
    let prom_args: Vec<String> = vec![
        format!("--config.file={}", config.display()),
        format!("--storage.tsdb.path={}", data.display()),
        format!("--web.listen-address=127.0.0.1:{pp}"),
    ];
    let mut prom = Proc::start("prometheus", prometheus_bin("prometheus").to_str().unwrap(), &prom_args, &cluster.logs);

    let coord_cmd = with_metrics(cluster.local.coordinator(&format!("127.0.0.1:{}", cluster.coordinator_port)), pc);
    let mut coord = Proc::start_command("coordinator", &coord_cmd, &[], &cluster.logs);
    let drafter_cmd = || {
        with_metrics(
            cluster.local.drafter(&cluster.coordinator_url, &format!("127.0.0.1:{}", cluster.drafter_port)),
            pd,
        )
    };
    let mut drafter = Proc::start_command("drafter", &drafter_cmd(), &[], &cluster.logs);
    let target_cmd = with_metrics(cluster.local.target(&cluster.coordinator_url, Some("target-0"), "127.0.0.1:0"), pt);
    let mut target = Proc::start_command("target", &target_cmd, &[], &cluster.logs);

    // Every role is scraped.
    let up = wait_until(pp, "sum(up)", Duration::from_secs(60), |v| v == 3.0);
    assert_eq!(up, Some(3.0), "targets up: {:?}\n{}", query(pp, "up"), prom.log_text());

    // The step counter rises between two evaluations.
    let step = "max(dflash_step{job=\"drafter\"})";
    let first = wait_until(pp, step, Duration::from_secs(60), |v| v > 0.0).unwrap_or(0.0);
    let later = wait_until(pp, step, Duration::from_secs(60), |v| v > first);
    assert!(later.is_some_and(|v| v > first), "step {first} -> {later:?}\n{}", drafter.log_text());

    // The ledger's gauges add up to the plan.
    let planned = dflash_tests::plan(&cluster.ledger).len() as f64;
    let total =
        wait_until(pp, "sum(dflash_ledger_batches{job=\"coordinator\"})", Duration::from_secs(30), |v| v == planned);
    assert_eq!(total, Some(planned), "{:?}", query(pp, "dflash_ledger_batches"));

    // The drafter dies and a replacement takes its place at the same
    // metrics address: Prometheus sees a new process whose counters start
    // from zero again (a reset), and its start counter is 1 again.
    let trained = "max(dflash_tokens_total{job=\"drafter\",stage=\"trained\"})";
    wait_until(pp, trained, Duration::from_secs(30), |v| v > 0.0);
    let started = scalar(pp, "max(dflash_process_start_time_seconds{job=\"drafter\"})").unwrap();
    drafter.signal(Signal::SIGKILL);
    drafter.expect_exit(Duration::from_secs(5));
    let mut drafter = Proc::start_command("drafter-2", &drafter_cmd(), &[], &cluster.logs);
    let restarted =
        wait_until(pp, "max(dflash_process_start_time_seconds{job=\"drafter\"})", Duration::from_secs(60), |v| {
            v > started
        });
    assert!(restarted.is_some_and(|v| v > started), "no new drafter process seen\n{}", drafter.log_text());
    let resets = "sum(resets(dflash_tokens_total{job=\"drafter\",stage=\"trained\"}[5m]))";
    let r = wait_until(pp, resets, Duration::from_secs(90), |v| v >= 1.0);
    assert!(r.is_some_and(|v| v >= 1.0), "{resets} = {r:?}\n{}", drafter.log_text());
    let changes = scalar(pp, "sum(changes(dflash_process_start_time_seconds{job=\"drafter\"}[5m]))");
    assert!(changes.is_some_and(|v| v >= 1.0), "{changes:?}");
    assert_eq!(scalar(pp, "max(dflash_process_starts_total{job=\"drafter\"})"), Some(1.0));

    // What Prometheus scraped from the roles is what they declare.
    let scraped = http_get(&format!("http://127.0.0.1:{pp}/api/v1/label/__name__/values")).unwrap();
    let scraped: serde_json::Value = serde_json::from_str(&scraped).unwrap();
    let declared_names: BTreeSet<String> = dflash_telemetry::metrics().names().iter().cloned().collect();
    let dflash: Vec<&str> = scraped["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .filter(|n| n.starts_with("dflash_"))
        .collect();
    assert!(dflash.len() >= 15, "{dflash:?}");
    for n in &dflash {
        assert!(declared(n, &declared_names), "{n} is scraped but not declared");
    }
    // The rules evaluated against the live series without error.
    let rules = http_get(&format!("http://127.0.0.1:{pp}/api/v1/rules")).unwrap();
    let rules: serde_json::Value = serde_json::from_str(&rules).unwrap();
    let evaluated: Vec<(String, String)> = rules["data"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap().to_string(), r["health"].as_str().unwrap_or("").to_string()))
        .collect();
    assert_eq!(evaluated.len(), 6, "{evaluated:?}");
    assert!(evaluated.iter().all(|(_, h)| h == "ok"), "{evaluated:?}");

    assert!(coord.expect_exit(Duration::from_secs(300)).success(), "{}", coord.log_text());
    assert!(drafter.expect_exit(Duration::from_secs(30)).success(), "{}", drafter.log_text());
    assert!(target.expect_exit(Duration::from_secs(30)).success(), "{}", target.log_text());
    prom.signal(Signal::SIGTERM);
    prom.expect_exit(Duration::from_secs(30));
}
