//! The receiver through its gRPC service: requests framed as a target
//! frames them, answers read as a target reads them.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use dflash_wire::rpc::HiddenStateService;
use dflash_wire::{BatchMeta, DType, HostBatch, Layout, batch_messages, grpc_pieces};
use http_body::Frame;
use pb::target_message::Msg;
use prost::Message;
use tonic::body::Body;
use tower::ServiceExt;

use super::*;
use crate::pipeline::Arrival;

/// The service's parts a test looks at afterwards.
struct Probe {
    landing: Landing,
    streams: Arc<tokio::sync::Semaphore>,
}

fn service(queue: flume::Sender<Arrival>) -> HiddenStateService<DrafterService> {
    service_with(queue, 4, Duration::from_secs(10)).0
}

/// The run's lease key in these tests.
const KEY: [u8; 32] = [5; 32];

/// The token of a batch leased to an instance in run-1.
fn token(batch_id: u64, target: &str) -> Vec<u8> {
    dflash_proto::lease_token::lease_token(&KEY, "run-1", batch_id, target)
}

/// A service whose plan holds batch 11 (sample 3, 10 tokens), vocabulary 16.
fn service_with(
    queue: flume::Sender<Arrival>,
    max_streams: usize,
    stall: Duration,
) -> (HiddenStateService<DrafterService>, Probe) {
    let plan: Plan = [(11, Planned { epoch: 0, sample_ids: vec![3], sample_lengths: vec![10] })].into();
    let landing = Landing::host(2);
    let streams = Arc::new(tokio::sync::Semaphore::new(max_streams));
    let dp = HiddenStateService::new(DrafterService {
        landing: landing.clone(),
        run_id: "run-1".into(),
        instance_id: "drafter-0".into(),
        credits: 2,
        expected: Expected {
            spec: FeatureSpec {
                dtype: DType::F32,
                layout: Layout::Split,
                layer_ids: vec![0],
                noise_std: 0.0,
                target_top_k: 0,
            },
            hidden_size: 8,
            vocab_size: 16,
            plan: Arc::new(plan),
            run_id: "run-1".into(),
            lease_key: KEY.as_slice().into(),
        },
        max_payload_bytes: 1 << 20,
        queue,
        stop: dflash_role::Stop::new(),
        hello_timeout: Duration::from_secs(10),
        stall_timeout: stall,
        streams: Arc::clone(&streams),
        max_streams,
        stages: dflash_role::Stages::new(dflash_role::Stop::new()),
    });
    (dp, Probe { landing, streams })
}

fn hello(run_id: &str) -> pb::TargetMessage {
    hello_from(run_id, "target-0")
}

fn hello_from(run_id: &str, target: &str) -> pb::TargetMessage {
    pb::TargetMessage {
        msg: Some(Msg::Hello(pb::StreamHello {
            protocol_version: dflash_proto::PROTOCOL_VERSION,
            run_id: run_id.into(),
            target_instance: target.into(),
        })),
    }
}

fn batch() -> HostBatch {
    batch_with(|_| {})
}

/// Batch 11 of the plan, changed by `edit`; with the token of its lease
/// (batch and instance as edited) unless the edit set one.
fn batch_with(edit: impl FnOnce(&mut BatchMeta)) -> HostBatch {
    let mut meta = BatchMeta {
        batch_id: 11,
        epoch: 0,
        target_instance: "target-0".into(),
        layout: Layout::Split,
        dtype: DType::F32,
        seq_lengths: vec![10],
        input_ids: (0..10).collect(),
        loss_mask: vec![1; 10],
        layer_ids: vec![0],
        hidden_size: 8,
        sample_ids: vec![3],
        target_top_k: 0,
        trace_context: Default::default(),
        lease_token: Vec::new(),
    };
    edit(&mut meta);
    if meta.lease_token.is_empty() {
        meta.lease_token = token(meta.batch_id, &meta.target_instance);
    }
    let payload: Vec<u8> = (0..meta.payload_bytes()).map(|i| (i * 13 % 251) as u8).collect();
    HostBatch::new(meta, payload.into()).unwrap()
}

/// A request body of fixed frames; then the end, or (`hang`) nothing
/// ever again, as a stalled peer.
struct Frames(VecDeque<Bytes>, bool);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = Status;
    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        match self.0.pop_front() {
            Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
            None if self.1 => Poll::Pending,
            None => Poll::Ready(None),
        }
    }
}

/// `messages` framed as a target frames them, cut into 100-byte HTTP/2 frames.
fn request(path: &str, messages: Vec<pb::TargetMessage>) -> http::Request<Body> {
    request_body(path, messages, false)
}

fn request_body(path: &str, messages: Vec<pb::TargetMessage>, hang: bool) -> http::Request<Body> {
    let bytes: Vec<u8> = messages
        .into_iter()
        .flat_map(|m| {
            let (head, payload) = grpc_pieces(m).split();
            [head.to_vec(), payload.map(|p| p.to_vec()).unwrap_or_default()].concat()
        })
        .collect();
    let frames = bytes.chunks(100).map(Bytes::copy_from_slice).collect();
    let mut req = http::Request::new(Body::new(Frames(frames, hang)));
    *req.uri_mut() = http::Uri::try_from(path).unwrap();
    req
}

/// The response's messages and its final status (trailers, or the
/// headers of a refusal).
async fn answer(
    service: HiddenStateService<DrafterService>,
    req: http::Request<Body>,
) -> (Vec<pb::DrafterMessage>, Status) {
    let response = service.oneshot(req).await.unwrap();
    if let Some(refused) = Status::from_header_map(response.headers()) {
        return (Vec::new(), refused);
    }
    let mut body = response.into_body();
    let mut messages = Vec::new();
    loop {
        let frame = tokio::time::timeout(
            Duration::from_secs(10),
            std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx)),
        )
        .await
        .expect("the response ends")
        .expect("trailers end the response")
        .unwrap();
        match frame.into_data() {
            Ok(data) => messages.push(pb::DrafterMessage::decode(&data[5..]).unwrap()),
            Err(frame) => {
                let trailers = frame.into_trailers().unwrap();
                return (messages, Status::from_header_map(&trailers).unwrap());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_framed_by_a_target_is_queued_byte_for_byte_and_acknowledged() {
    let (queue, queued) = flume::bounded(4);
    let b = batch();
    let mut messages = vec![hello("run-1")];
    messages.extend(batch_messages(&b, 96));
    let (acks, status) = answer(service(queue), request(pb::STREAM_HIDDEN_STATES_PATH, messages)).await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    assert!(matches!(&acks[0].msg, Some(pb::drafter_message::Msg::Welcome(w)) if w.credits == 2));
    match &acks[1].msg {
        Some(pb::drafter_message::Msg::Ack(a)) => {
            assert_eq!((a.batch_id, a.status), (11, pb::AckStatus::Accepted as i32), "{}", a.reason)
        }
        other => panic!("{other:?}"),
    }
    let Ok(Arrival::Batch(got)) = queued.try_recv() else { panic!("the batch is queued") };
    let got = got.batch;
    assert_eq!((got.payload, got.meta.input_ids), (b.payload, b.meta.input_ids));
}

#[tokio::test]
async fn refusals_come_back_as_grpc_statuses() {
    let (queue, _queued) = flume::bounded(4);
    let (_, status) =
        answer(service(queue.clone()), request(pb::STREAM_HIDDEN_STATES_PATH, vec![hello("other")])).await;
    assert_eq!(
        DrafterError::from_status(&status),
        Some(DrafterError::WrongRun { got: "other".into(), trains: "run-1".into() }),
        "the structured error travels in the status: {status:?}"
    );
    let (_, status) = answer(service(queue.clone()), request("/dflash.v1.Drafter/Nope", vec![])).await;
    assert_eq!(status.code(), tonic::Code::Unimplemented);
    // Names that would fail a thread's creation or forge log lines.
    for name in ["target\0x", "target-0\n2026-12-01 INFO forged", ""] {
        let (_, status) =
            answer(service(queue.clone()), request(pb::STREAM_HIDDEN_STATES_PATH, vec![hello_from("run-1", name)]))
                .await;
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{name:?}: {status:?}");
    }
}

fn acks_of(messages: &[pb::DrafterMessage]) -> Vec<(u64, i32, String)> {
    messages
        .iter()
        .filter_map(|m| match &m.msg {
            Some(pb::drafter_message::Msg::Ack(a)) => Some((a.batch_id, a.status, a.reason.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_that_are_not_the_plans_are_rejected_and_bad_contents_reported_as_skipped() {
    let cases: Vec<(HostBatch, bool, &str)> = vec![
        (batch_with(|m| m.batch_id = 12), false, "not in the run's plan"),
        (batch_with(|m| m.sample_ids = vec![4]), false, "but the plan has [3]"),
        // Another instance's batch on this stream: its token is not this
        // stream's (refused at the header, before it takes a buffer).
        (batch_with(|m| m.target_instance = "target-9".into()), false, "not leased to that instance"),
        (
            batch_with(|m| {
                m.target_instance = "target-9".into();
                m.lease_token = token(11, "target-0");
            }),
            false,
            "stream is target-0's",
        ),
        // Features for a planned batch from a stream that holds no lease on
        // it: a made-up token, another instance's token, none.
        (batch_with(|m| m.lease_token = vec![7; 16]), false, "not leased to that instance"),
        (batch_with(|m| m.lease_token = token(11, "target-1")), false, "not leased to that instance"),
        (batch_with(|m| m.lease_token = vec![0; 0].into_iter().chain([1]).collect()), false, "no valid lease token"),
        (
            batch_with(|m| m.input_ids[7] = 999_999),
            true,
            "token id 999999 at position 7 is outside the vocabulary (16)",
        ),
        (
            batch_with(|m| m.target_top_k = 4),
            true,
            "the target's top-4 next tokens but the run distills from its top 0",
        ),
    ];
    for (b, skip, why) in cases {
        let (queue, queued) = flume::bounded(4);
        let (dp, _probe) = service_with(queue, 4, Duration::from_secs(10));
        let mut messages = vec![hello("run-1")];
        messages.extend(batch_messages(&b, 96));
        let (acks, status) = answer(dp, request(pb::STREAM_HIDDEN_STATES_PATH, messages)).await;
        assert_eq!(status.code(), tonic::Code::Ok, "rejections do not end the stream: {status:?}");
        let acks = acks_of(&acks);
        assert_eq!(acks.len(), 1, "{acks:?}");
        assert_eq!((acks[0].0, acks[0].1), (b.meta.batch_id, pb::AckStatus::Rejected as i32));
        assert!(acks[0].2.contains(why), "{why}: {}", acks[0].2);
        match queued.try_recv() {
            Ok(Arrival::Rejected(s)) if skip => {
                assert!(s.skipped && s.batch_id == 11 && s.skip_reason.contains(why), "{s:?}")
            }
            Ok(Arrival::Rejected(s)) => panic!("{why}: not the plan's batch, yet reported as skipped: {s:?}"),
            Ok(Arrival::Batch(_)) => panic!("{why}: a rejected batch is never queued for training"),
            Err(_) => assert!(!skip, "{why}: the plan's batch must be reported as skipped"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_capped_and_a_peer_is_held_to_small_messages_until_its_hello() {
    let (queue, _queued) = flume::bounded(4);
    let (dp, probe) = service_with(queue.clone(), 1, Duration::from_secs(10));
    let held = Arc::clone(&probe.streams).try_acquire_owned().unwrap();
    let (_, status) = answer(dp.clone(), request(pb::STREAM_HIDDEN_STATES_PATH, vec![hello("run-1")])).await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("at most 1 streams"), "{}", status.message());
    drop(held);
    let (_, status) = answer(dp, request(pb::STREAM_HIDDEN_STATES_PATH, vec![hello("run-1")])).await;
    assert_eq!(status.code(), tonic::Code::Ok, "a free permit admits the stream: {status:?}");
    // The permit goes back once the stream's task has joined its
    // landing thread, just after the response ends.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while probe.streams.available_permits() < 1 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(probe.streams.available_permits(), 1, "the stream's permit came back");

    // A first message of 1 MiB (a chunk where the hello should be).
    let big = pb::TargetMessage {
        msg: Some(Msg::Chunk(pb::BatchChunk { batch_id: 1, index: 0, data: vec![0u8; 1 << 20].into() })),
    };
    let (_, status) = answer(service(queue), request(pb::STREAM_HIDDEN_STATES_PATH, vec![big])).await;
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stalls_mid_batch_is_ended_and_its_landing_buffer_returned() {
    let (queue, queued) = flume::bounded(4);
    let (dp, probe) = service_with(queue, 4, Duration::from_millis(300));
    let mut messages = vec![hello("run-1")];
    // The header and the first chunk, then silence.
    messages.extend(batch_messages(&batch(), 96).take(2));
    let t0 = std::time::Instant::now();
    let (acks, status) = answer(dp, request_body(pb::STREAM_HIDDEN_STATES_PATH, messages, true)).await;
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert!(acks_of(&acks).is_empty() && queued.try_recv().is_err());
    let Landing::Host(pool) = &probe.landing else { unreachable!() };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while pool.free_count() < 2 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(pool.free_count(), 2, "the stalled batch's buffer went back to the pool");
}
