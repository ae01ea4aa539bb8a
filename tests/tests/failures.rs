//! Failures are loud: a fatal error in one role fails the run and stops
//! every role with a non-zero exit and the cause in its log; no role waits
//! forever for a peer that died.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::time::{Duration, Instant};

use dflash_tests::{Cluster, Proc, Workspace};
use nix::sys::signal::Signal;

#[test]
fn a_fatal_target_error_stops_every_role_with_its_cause() {
    let ws = Workspace::synthetic(200, 3);
    let cluster = Cluster::new(&ws, ws.config("fatal", ""));
    let mut coord = cluster.coordinator(&[]);
    assert!(coord.wait_for_log("coordinator listening", Duration::from_secs(60)), "{}", coord.log_text());
    // The target reads a different dataset than the coordinator planned
    // from: its samples have other lengths, a fatal data error.
    let data = ws.path("data.jsonl");
    let text = std::fs::read_to_string(&data).unwrap().replace("Count from", "Please count from");
    std::fs::write(&data, text).unwrap();
    let mut drafter = cluster.drafter("drafter");
    let mut target = cluster.target("target-0");

    let started = Instant::now();
    let t = target.expect_exit(Duration::from_secs(60));
    let c = coord.expect_exit(Duration::from_secs(20));
    let d = drafter.expect_exit(Duration::from_secs(20));
    assert!(started.elapsed() < Duration::from_secs(40));
    assert_eq!(t.code(), Some(1), "{}", target.log_text());
    assert_eq!(c.code(), Some(1), "{}", coord.log_text());
    assert_eq!(d.code(), Some(1), "{}", drafter.log_text());
    let cause = "tokens here but";
    assert!(target.log_text().contains(cause), "{}", target.log_text());
    assert!(coord.log_text().contains("fatal error from target target-0"), "{}", coord.log_text());
    assert!(coord.log_text().contains(cause), "{}", coord.log_text());
    let dlog = drafter.log_text();
    assert!(dlog.contains("run failed") && dlog.contains(cause), "{dlog}");
}

#[test]
fn roles_stop_when_the_coordinator_dies() {
    let ws = Workspace::synthetic(200, 3);
    // Enough steps that the run is still going when the coordinator dies.
    let cluster = Cluster::new(&ws, ws.config("coord-dies", "[run]\nmax_steps = 100000\nepochs = 100"));
    let mut coord = cluster.coordinator(&[]);
    let mut drafter = cluster.drafter("drafter");
    let mut target = cluster.target("target-0");
    assert!(drafter.wait_for_log("step 2/", Duration::from_secs(60)), "{}", drafter.log_text());
    coord.signal(Signal::SIGKILL);
    coord.expect_exit(Duration::from_secs(5));
    let killed = Instant::now();
    let d = drafter.expect_exit(Duration::from_secs(30));
    let t = target.expect_exit(Duration::from_secs(30));
    // coordinator_timeout_ms = 3000 plus a heartbeat and the shutdown.
    assert!(killed.elapsed() < Duration::from_secs(15), "took {:?}", killed.elapsed());
    assert_eq!(d.code(), Some(1));
    assert_eq!(t.code(), Some(1));
    for p in [&drafter, &target] {
        assert!(p.log_text().contains("coordinator unreachable"), "{}", p.log_text());
    }
}

#[test]
fn an_invalid_config_names_the_field_and_exits_non_zero() {
    let ws = Workspace::synthetic(20, 2);
    let cluster = Cluster::new(&ws, ws.config("bad", "[pipeline]\nprefetch_depth = 0"));
    let mut coord = cluster.coordinator(&[]);
    let s = coord.expect_exit(Duration::from_secs(30));
    assert_eq!(s.code(), Some(1));
    assert!(coord.log_text().contains("pipeline.prefetch_depth: must be at least 1"), "{}", coord.log_text());

    let cluster = Cluster::new(&ws, ws.config("typo", "[pipeline]\nprefetch_dept = 2"));
    let mut coord = cluster.coordinator(&[]);
    assert_eq!(coord.expect_exit(Duration::from_secs(30)).code(), Some(1));
    assert!(coord.log_text().contains("prefetch_dept"), "{}", coord.log_text());
}

#[test]
fn interrupting_dflash_up_stops_every_role() {
    let ws = Workspace::synthetic(200, 3);
    let config = ws.config("interrupt", "[run]\nmax_steps = 100000\nepochs = 100");
    let args: Vec<String> = [
        "up",
        "--config",
        &config.display().to_string(),
        "--workdir",
        &ws.path("up").display().to_string(),
        "--grace-s",
        "10",
    ]
    .map(String::from)
    .to_vec();
    let mut up = Proc::start("up", "dflash", &args, ws.dir.path());
    assert!(up.wait_for_log("step 2/", Duration::from_secs(60)), "{}", up.log_text());
    up.signal(Signal::SIGINT);
    up.expect_exit(Duration::from_secs(30));
    let log = up.log_text();
    for role in ["coordinator", "target", "drafter"] {
        assert!(log.contains(&format!("[dflash     ] {role} exited")), "{role} not stopped:\n{log}");
    }
    // The drafter checkpointed on SIGTERM before leaving.
    assert!(log.contains("checkpointing step"), "{log}");
}
