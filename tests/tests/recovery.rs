//! Nothing lost: a drafter killed with SIGKILL comes back from its last
//! checkpoint while the targets keep running (same processes) and replay
//! what it never acknowledged; a killed target's leases go to another
//! target. Every batch ends trained exactly once in the committed history.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::time::{Duration, Instant};

use dflash_coordinator::ledger::Ledger;
use dflash_proto as pb;
use dflash_tests::proxy::Proxy;
use dflash_tests::{Cluster, Workspace};
use nix::sys::signal::Signal;

fn assert_exactly_once(ledger: &std::path::Path, batches: usize) {
    let l = Ledger::open(ledger).unwrap();
    let audit = l.audit().unwrap();
    assert_eq!(audit.len(), batches);
    for a in &audit {
        assert_eq!((a.state.as_str(), a.commits), ("committed", 1), "{a:?}");
    }
}

#[test]
fn a_killed_drafter_resumes_and_targets_keep_running() {
    killed_drafter_resumes(&Workspace::synthetic(600, 3));
}

#[test]
fn a_killed_drafter_resumes_with_a_mixture_of_experts_target() {
    killed_drafter_resumes(&Workspace::synthetic_shape(600, "tiny-moe"));
}

fn killed_drafter_resumes(ws: &Workspace) {
    let extra =
        "[run]\nmax_steps = 40\n[checkpoint]\ninterval_steps = 8\n[pipeline]\nmax_batch_size = 4\ntoken_budget = 512";
    let cluster = Cluster::new(ws, ws.config("drafter-restart", extra));
    let mut coord = cluster.coordinator(&[]);
    let mut target = cluster.target("target-0");
    let target_pid = target.pid();
    let mut drafter = cluster.drafter("drafter-1");
    assert!(drafter.wait_for_log("checkpoint", Duration::from_secs(90)), "{}", drafter.log_text());
    assert!(drafter.wait_for_log("step 12/", Duration::from_secs(90)), "{}", drafter.log_text());
    drafter.signal(Signal::SIGKILL);
    drafter.expect_exit(Duration::from_secs(5));
    let killed = Instant::now();

    // While no drafter is there the target holds its batches and waits.
    std::thread::sleep(Duration::from_secs(2));
    assert!(target.child.try_wait().unwrap().is_none(), "the target must keep running");

    let mut drafter2 = cluster.drafter("drafter-2");
    assert!(drafter2.wait_for_log("resumed from", Duration::from_secs(60)), "{}", drafter2.log_text());
    assert!(drafter2.wait_for_log("step ", Duration::from_secs(60)), "{}", drafter2.log_text());
    let recovery = killed.elapsed();
    eprintln!("drafter SIGKILL to first trained step of its replacement: {:.2} s", recovery.as_secs_f64());
    assert!(recovery < Duration::from_secs(30), "recovery took {recovery:?}");

    assert!(coord.expect_exit(Duration::from_secs(180)).success(), "{}", coord.log_text());
    assert!(drafter2.expect_exit(Duration::from_secs(30)).success(), "{}", drafter2.log_text());
    assert!(target.expect_exit(Duration::from_secs(30)).success(), "{}", target.log_text());
    assert_eq!(target.pid(), target_pid);
    assert!(target.log_text().contains("replaying") || coord.log_text().contains("will be redone"));
    assert_exactly_once(&cluster.ledger, 40);
}

/// The coordinator's ledger counts, through its Status RPC.
fn ledger_counts(cluster: &Cluster) -> Option<pb::LedgerCounts> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = pb::coordinator_client::CoordinatorClient::connect(cluster.coordinator_url.clone()).await.ok()?;
        c.status(pb::StatusRequest {}).await.ok()?.into_inner().ledger
    })
}

#[test]
fn a_killed_targets_leases_go_to_another_target() {
    killed_targets_leases_go_to_another_target(&[]);
}

/// The same with target instances of two CPU parts each (the model's
/// layers split between them): the instance is killed and replaced whole.
#[test]
fn a_killed_target_instance_of_two_parts_is_replaced_and_nothing_is_lost() {
    killed_targets_leases_go_to_another_target(&["--target-devices", "cpu,cpu"]);
}

fn killed_targets_leases_go_to_another_target(coordinator_args: &[&str]) {
    let ws = Workspace::synthetic(600, 3);
    let extra =
        "[run]\nmax_steps = 30\n[faults]\nlease_timeout_ms = 3000\n[pipeline]\nmax_batch_size = 4\ntoken_budget = 512";
    let cluster = Cluster::new(&ws, ws.config("target-loss", extra));
    let mut coord = cluster.coordinator(coordinator_args);
    // Targets reach the drafter through a proxy that is cut: the first
    // target leases batches and cannot hand them over, so it is certain to
    // die holding leases (with batches flowing, a fast run may have finished
    // before the kill lands).
    let proxy = Proxy::start(format!("127.0.0.1:{}", cluster.drafter_port).parse().unwrap());
    proxy.set_cut(true);
    let mut drafter = cluster.drafter_advertising("drafter", &format!("http://127.0.0.1:{}", proxy.port));
    let mut t0 = cluster.target("target-0");
    let deadline = Instant::now() + Duration::from_secs(90);
    while ledger_counts(&cluster).is_none_or(|c| c.leased == 0) {
        assert!(Instant::now() < deadline, "target-0 never leased a batch:\n{}", t0.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.signal(Signal::SIGKILL);
    t0.expect_exit(Duration::from_secs(5));
    let killed = Instant::now();
    assert!(coord.wait_for_log("lease(s) of target target-0", Duration::from_secs(20)), "{}", coord.log_text());
    eprintln!("target SIGKILL to its leases released for re-lease: {:.2} s", killed.elapsed().as_secs_f64());
    assert!(!coord.log_text().contains("released 0 lease(s)"), "{}", coord.log_text());

    // Another target takes the released batches; the run ends with every
    // batch trained and committed once.
    proxy.set_cut(false);
    let mut t1 = cluster.target("target-1");
    assert!(coord.expect_exit(Duration::from_secs(180)).success(), "{}", coord.log_text());
    assert!(t1.expect_exit(Duration::from_secs(30)).success(), "{}", t1.log_text());
    if coordinator_args.contains(&"cpu,cpu") {
        // Layers 0 and 1 are loaded (the drafter captures layer 1): one a part.
        let want = "target cpu,cpu: layers 0-0 on cpu (needs";
        assert!(t1.log_text().contains(want) && t1.log_text().contains("; layers 1-1 on cpu"), "{}", t1.log_text());
    }
    assert!(drafter.expect_exit(Duration::from_secs(30)).success(), "{}", drafter.log_text());
    assert_exactly_once(&cluster.ledger, 30);
}

/// A drafter whose replies stop arriving while its connection stays up
/// (keepalive pings answered, every acknowledgement held in the network):
/// after `faults.ack_timeout_ms` the target gives the stream up, connects
/// again and replays what was not acknowledged. The stall is never lifted;
/// the run completes with every batch trained and committed once. Without
/// the timeout the target waits on that stream for good.
#[test]
fn a_target_gives_up_a_stream_whose_acknowledgements_stop_and_replays_it() {
    let ws = Workspace::synthetic(600, 3);
    let extra =
        "[run]\nmax_steps = 30\n[faults]\nack_timeout_ms = 3000\n[pipeline]\nmax_batch_size = 4\ntoken_budget = 512";
    let cluster = Cluster::new(&ws, ws.config("ack-timeout", extra));
    let mut coord = cluster.coordinator(&[]);
    let proxy = Proxy::start(format!("127.0.0.1:{}", cluster.drafter_port).parse().unwrap());
    let mut drafter = cluster.drafter_advertising("drafter", &format!("http://127.0.0.1:{}", proxy.port));
    let mut target = cluster.target("target-0");
    assert!(drafter.wait_for_log("step 3/", Duration::from_secs(90)), "{}", drafter.log_text());
    proxy.stall_replies();
    let stalled = Instant::now();
    let gave_up = "acknowledged nothing for 3000 ms";
    assert!(target.wait_for_log(gave_up, Duration::from_secs(60)), "{}", target.log_text());
    eprintln!("replies stalled to the stream given up: {:.2} s", stalled.elapsed().as_secs_f64());
    assert!(coord.expect_exit(Duration::from_secs(180)).success(), "{}", coord.log_text());
    assert!(drafter.expect_exit(Duration::from_secs(30)).success(), "{}", drafter.log_text());
    assert!(target.expect_exit(Duration::from_secs(30)).success(), "{}", target.log_text());
    assert!(target.log_text().contains("replaying"), "{}", target.log_text());
    assert_exactly_once(&cluster.ledger, 30);
}
