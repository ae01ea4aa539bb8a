//! More ways to fail without losing work: a coordinator restart, random
//! kills of drafter and targets in one run, SIGTERM on the drafter, and
//! non-finite features from a target.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::time::{Duration, Instant};

use dflash_coordinator::ledger::Ledger;
use dflash_proto as pb;
use dflash_tests::{Cluster, Proc, Workspace};
use nix::sys::signal::Signal;

fn assert_exactly_once(ledger: &std::path::Path, batches: usize) {
    let l = Ledger::open(ledger).unwrap();
    let audit = l.audit().unwrap();
    assert_eq!(audit.len(), batches);
    for a in &audit {
        assert_eq!((a.state.as_str(), a.commits), ("committed", 1), "{a:?}");
    }
}

const SMALL: &str = "[pipeline]\nmax_batch_size = 4\ntoken_budget = 512\n[faults]\nlease_timeout_ms = 4000";

#[test]
fn the_run_survives_a_coordinator_restart() {
    let ws = Workspace::synthetic(600, 3);
    let cluster = Cluster::new(&ws, ws.config("coord-restart", &format!("{SMALL}\n[run]\nmax_steps = 40\n")));
    let mut coord = cluster.coordinator(&[]);
    let mut drafter = cluster.drafter("drafter");
    let mut target = cluster.target("target-0");
    let (dpid, tpid) = (drafter.pid(), target.pid());
    assert!(drafter.wait_for_log("step 8/", Duration::from_secs(90)), "{}", drafter.log_text());
    coord.signal(Signal::SIGKILL);
    coord.expect_exit(Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(1500));
    let mut coord2 = cluster.coordinator(&[]);
    assert!(coord2.wait_for_log("resuming run", Duration::from_secs(30)), "{}", coord2.log_text());
    assert!(coord2.expect_exit(Duration::from_secs(180)).success(), "{}", coord2.log_text());
    assert!(drafter.expect_exit(Duration::from_secs(30)).success(), "{}", drafter.log_text());
    assert!(target.expect_exit(Duration::from_secs(30)).success(), "{}", target.log_text());
    assert_eq!((drafter.pid(), target.pid()), (dpid, tpid), "roles kept their processes");
    assert!(drafter.log_text().contains("registering again"), "{}", drafter.log_text());
    assert_exactly_once(&cluster.ledger, 40);
}

#[test]
fn chaos_kills_leave_every_batch_trained_once() {
    let ws = Workspace::synthetic(800, 3);
    let cluster = Cluster::new(
        &ws,
        ws.config("chaos", &format!("{SMALL}\n[run]\nmax_steps = 60\n[checkpoint]\ninterval_steps = 6\n")),
    );
    let mut coord = cluster.coordinator(&[]);
    let mut drafter = cluster.drafter("drafter-0");
    let mut targets = vec![cluster.target("target-a"), cluster.target("target-b")];
    // Kill points: after the drafter process has logged this many more steps.
    let plan = [(3, "drafter"), (2, "target"), (4, "drafter"), (2, "target"), (3, "drafter"), (1, "target")];
    for (i, (steps, victim)) in plan.iter().enumerate() {
        let base = steps_logged(&drafter);
        let deadline = Instant::now() + Duration::from_secs(60);
        while steps_logged(&drafter) < base + steps && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if coord.child.try_wait().unwrap().is_some() {
            break; // the run finished first
        }
        if *victim == "drafter" {
            drafter.signal(Signal::SIGKILL);
            drafter.expect_exit(Duration::from_secs(5));
            drafter = cluster.drafter(&format!("drafter-{}", i + 1));
        } else {
            let t = &mut targets[i % 2];
            t.signal(Signal::SIGKILL);
            t.expect_exit(Duration::from_secs(5));
            targets[i % 2] = cluster.target(&format!("target-{}", i + 1));
        }
    }
    assert!(coord.expect_exit(Duration::from_secs(240)).success(), "{}", coord.log_text());
    assert!(drafter.expect_exit(Duration::from_secs(30)).success(), "{}", drafter.log_text());
    for t in &mut targets {
        assert!(t.expect_exit(Duration::from_secs(30)).success(), "{}", t.log_text());
    }
    assert_exactly_once(&cluster.ledger, 60);
}

/// Training steps a drafter process has logged.
fn steps_logged(p: &Proc) -> usize {
    p.log_text().lines().filter(|l| l.contains("INFO step ")).count()
}

#[test]
fn sigterm_makes_the_drafter_checkpoint_and_exit_cleanly() {
    let ws = Workspace::synthetic(600, 3);
    let cluster = Cluster::new(
        &ws,
        ws.config(
            "sigterm",
            &format!("{SMALL}\n[run]\nmax_steps = 10000\nepochs = 100\n[checkpoint]\ninterval_steps = 1000\n"),
        ),
    );
    let _coord = cluster.coordinator(&[]);
    let mut drafter = cluster.drafter("drafter");
    let _target = cluster.target("target-0");
    assert!(drafter.wait_for_log("step 5/", Duration::from_secs(90)), "{}", drafter.log_text());
    drafter.signal(Signal::SIGTERM);
    let t0 = Instant::now();
    let status = drafter.expect_exit(Duration::from_secs(20));
    assert!(status.success(), "{}", drafter.log_text());
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    assert!(drafter.log_text().contains("checkpointing step"), "{}", drafter.log_text());
    let latest = std::fs::read_to_string(ws.path("checkpoints/latest")).unwrap();
    assert!(ws.path("checkpoints").join(latest.trim()).join("optimizer.safetensors").is_file());
}

/// A client playing a target that ships NaN features: the drafter skips
/// them, reports them, and fails the run after K in a row.
#[test]
fn non_finite_features_are_skipped_then_fail_the_run() {
    let ws = Workspace::synthetic(100, 3);
    let cluster = Cluster::new(
        &ws,
        ws.config("nan", "[training]\nmax_bad_batches_in_a_row = 3\n[model]\ntarget_layer_ids = [2]"),
    );
    let mut coord = cluster.coordinator(&[]);
    let mut drafter = cluster.drafter("drafter");
    assert!(drafter.wait_for_log("listening for targets", Duration::from_secs(60)), "{}", drafter.log_text());
    let run_id = coord_run_id(&cluster);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let url = format!("http://127.0.0.1:{}", cluster.drafter_port);
        let mut client = pb::drafter_client::DrafterClient::connect(url).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tx.send(hello(&run_id, dflash_proto::PROTOCOL_VERSION)).await.unwrap();
        let mut acks = client.stream_hidden_states(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
        let _welcome = acks.message().await.unwrap();
        for b in &dflash_tests::plan(&cluster.ledger)[..3] {
            for m in dflash_tests::planned_batch(&cluster.ledger, &run_id, b, 64, f32::NAN, |_| {}) {
                tx.send(m).await.unwrap();
            }
            let ack = acks.message().await.unwrap().unwrap();
            assert!(matches!(ack.msg, Some(pb::drafter_message::Msg::Ack(ref a)) if a.status == pb::AckStatus::Accepted as i32));
        }
        drop(tx);
    });
    assert_eq!(drafter.expect_exit(Duration::from_secs(30)).code(), Some(1));
    assert_eq!(coord.expect_exit(Duration::from_secs(30)).code(), Some(1));
    let log = drafter.log_text();
    assert!(log.contains("non-finite target features") && log.contains("3 batches in a row"), "{log}");
    assert!(coord.log_text().contains("non_finite"), "{}", coord.log_text());
}

fn hello(run_id: &str, version: u32) -> pb::TargetMessage {
    pb::TargetMessage {
        msg: Some(pb::target_message::Msg::Hello(pb::StreamHello {
            protocol_version: version,
            run_id: run_id.into(),
            target_instance: "test-client".into(),
        })),
    }
}

fn coord_run_id(cluster: &Cluster) -> String {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = pb::coordinator_client::CoordinatorClient::connect(cluster.coordinator_url.clone()).await.unwrap();
        c.status(pb::StatusRequest {}).await.unwrap().into_inner().run_id
    })
}

/// Bad input on the wire gets a clear error and costs nothing else.
#[test]
fn bad_wire_input_gets_clear_errors() {
    let ws = Workspace::synthetic(100, 3);
    let cluster = Cluster::new(&ws, ws.config("wire", "[model]\ntarget_layer_ids = [2]"));
    let _coord = cluster.coordinator(&[]);
    let mut drafter = cluster.drafter("drafter");
    assert!(drafter.wait_for_log("listening for targets", Duration::from_secs(60)), "{}", drafter.log_text());
    let run_id = coord_run_id(&cluster);
    let url = format!("http://127.0.0.1:{}", cluster.drafter_port);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let open = |first: pb::TargetMessage| {
            let url = url.clone();
            async move {
                let mut client =
                    pb::drafter_client::DrafterClient::connect(url).await.unwrap().max_encoding_message_size(200 << 20);
                let (tx, rx) = tokio::sync::mpsc::channel(64);
                tx.send(first).await.unwrap();
                let r = client.stream_hidden_states(tokio_stream::wrappers::ReceiverStream::new(rx)).await;
                (tx, r)
            }
        };
        // Unknown protocol version and wrong run id: refused with a reason.
        let (_tx, r) = open(hello(&run_id, 99)).await;
        let e = r.err().unwrap();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("protocol version 99"), "{}", e.message());
        let (_tx, r) = open(hello("another-run", dflash_proto::PROTOCOL_VERSION)).await;
        let e = r.err().unwrap();
        assert!(e.message().contains("wrong run id"), "{}", e.message());
        // Names that would fail a thread's creation or forge log lines.
        for name in ["test\0client", "test-client\n2026-12-01T00:00:00Z ERROR forged"] {
            let mut h = hello(&run_id, dflash_proto::PROTOCOL_VERSION);
            if let Some(pb::target_message::Msg::Hello(hello)) = &mut h.msg {
                hello.target_instance = name.into();
            }
            let (_tx, r) = open(h).await;
            let e = r.err().unwrap();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name:?}: {e:?}");
        }

        let plan = dflash_tests::plan(&cluster.ledger);
        let (tx, r) = open(hello(&run_id, dflash_proto::PROTOCOL_VERSION)).await;
        let mut acks = r.unwrap().into_inner();
        let _welcome = acks.message().await.unwrap();
        // Rejected, never trained, never fatal: a batch the plan does not
        // have, one of other samples, the plan's batch with a token id
        // outside the vocabulary.
        let not_planned = dflash_proto::BatchHeader { batch_id: 999_999, ..Default::default() };
        for (b, edit, why) in [
            (
                &plan[1],
                Box::new(move |h: &mut pb::BatchHeader| h.batch_id = not_planned.batch_id)
                    as Box<dyn FnOnce(&mut pb::BatchHeader)>,
                "not in the run's plan",
            ),
            (&plan[2], Box::new(|h: &mut pb::BatchHeader| h.sample_ids[0] += 1), "but the plan has"),
            (&plan[3], Box::new(|h: &mut pb::BatchHeader| h.input_ids[0] = 999_999), "outside the vocabulary"),
            // Features for a planned batch this client holds no lease on.
            (&plan[4], Box::new(|h: &mut pb::BatchHeader| h.lease_token = vec![1u8; 16].into()), "not leased"),
        ] {
            for m in dflash_tests::planned_batch(&cluster.ledger, &run_id, b, 64, 0.5, edit) {
                tx.send(m).await.unwrap();
            }
            match acks.message().await.unwrap().unwrap().msg {
                Some(pb::drafter_message::Msg::Ack(a)) => {
                    assert_eq!(a.status, pb::AckStatus::Rejected as i32, "{why}: {a:?}");
                    assert!(a.reason.contains(why), "{why}: {}", a.reason);
                }
                other => panic!("{other:?}"),
            }
        }

        // A truncated batch: the drafter asks for it again.
        let mut msgs = dflash_tests::planned_batch(&cluster.ledger, &run_id, &plan[7], 64, 0.5, |_| {});
        let n = msgs.len();
        msgs.remove(n - 2); // drop the last chunk
        for m in msgs {
            tx.send(m).await.unwrap();
        }
        let ack = acks.message().await.unwrap().unwrap();
        match ack.msg {
            Some(pb::drafter_message::Msg::Ack(a)) => {
                assert_eq!(a.status, pb::AckStatus::Resend as i32);
                assert!(a.reason.contains("truncated"), "{}", a.reason);
            }
            other => panic!("{other:?}"),
        }
        // An oversized message (over the 80 MiB limit) ends that stream with
        // a clear status, nothing else.
        let big = pb::TargetMessage {
            msg: Some(pb::target_message::Msg::Chunk(pb::BatchChunk {
                batch_id: 8,
                index: 0,
                data: vec![0u8; 100 << 20].into(),
            })),
        };
        tx.send(big).await.unwrap();
        let e = acks.message().await.err();
        assert!(
            e.is_some_and(|e| e.message().contains("message length too large") || e.code() == tonic::Code::OutOfRange)
        );
    });
    // The drafter is still healthy.
    assert!(drafter.child.try_wait().unwrap().is_none());
}
