//! Stopping a role with work in flight joins everything it started: every
//! task and thread is owned by the role's stages and counted on the way
//! out, so a stopped role leaves none running.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::time::Duration;

use dflash_tests::{Cluster, Workspace};
use nix::sys::signal::Signal;

const JOINED: &str = "every stage stopped: 0 tasks and 0 threads left running";

/// OS threads of a live process.
fn threads(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0)
}

#[test]
fn roles_stopped_mid_run_leave_no_task_or_thread_running() {
    let ws = Workspace::synthetic(400, 3);
    // No checkpoint on the interval: the one written is the SIGTERM one.
    let config = "[run]\nmax_steps = 100000\nepochs = 100\n[pipeline]\nmax_batch_size = 4\ntoken_budget = 512\n\
                  [checkpoint]\ninterval_steps = 100000";
    let cluster = Cluster::new(&ws, ws.config("in-flight", config));
    let mut coord = cluster.coordinator(&[]);
    let mut drafter = cluster.drafter("drafter");
    let mut target = cluster.target("target-0");
    assert!(drafter.wait_for_log("step 3/", Duration::from_secs(90)), "{}", drafter.log_text());
    // Mid-run: the drafter receives, prefetches and trains while the target
    // leases, forwards, postprocesses and streams.
    for p in [&drafter, &target] {
        let n = threads(p.pid());
        assert!(n > 4, "{} runs {n} threads mid-run", p.name);
    }
    target.signal(Signal::SIGTERM);
    drafter.signal(Signal::SIGTERM);
    target.expect_exit(Duration::from_secs(30));
    drafter.expect_exit(Duration::from_secs(30));
    for p in [&drafter, &target] {
        let log = p.log_text();
        assert!(log.contains(JOINED), "{} did not join every stage:\n{log}", p.name);
        assert!(!log.contains("left running:"), "{}:\n{log}", p.name);
    }
    // The drafter checkpointed what it had trained before it went.
    assert!(drafter.log_text().contains("checkpointing step"), "{}", drafter.log_text());
    coord.signal(Signal::SIGTERM);
    coord.expect_exit(Duration::from_secs(30));
    assert!(coord.log_text().contains(JOINED), "{}", coord.log_text());
}
