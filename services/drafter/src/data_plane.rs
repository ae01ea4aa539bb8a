//! The drafter's data plane as an HTTP service: the `Drafter` gRPC
//! service's one RPC, `StreamHiddenStates`, served one layer below tonic's
//! codec. On the wire it is the same gRPC (length-prefixed protobuf over
//! HTTP/2, status in trailers), so tonic clients, interceptors and the
//! health service work unchanged; what differs is that chunk payloads go
//! from the HTTP/2 frames they arrived in straight to their landing buffer
//! ([`dflash_wire::InboundFrames`]), instead of being gathered into a
//! message buffer first: one pass over every payload byte less.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use dflash_proto as pb;
use dflash_wire::{Inbound, InboundError, InboundFrames};
use http_body::Frame;
use tokio::sync::mpsc;
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;

use crate::receiver::DrafterService;

/// Acknowledgements (or the status that ends the stream) to send back.
pub type AckSender = mpsc::Sender<Result<pb::DrafterMessage, Status>>;

/// The `Drafter` service for tonic's router (wrap it in an interceptor as
/// any generated server).
#[derive(Clone)]
pub struct DataPlane(Arc<DrafterService>);

impl DataPlane {
    pub fn new(service: DrafterService) -> Self {
        Self(Arc::new(service))
    }
}

impl NamedService for DataPlane {
    const NAME: &'static str = "dflash.v1.Drafter";
}

impl tower::Service<http::Request<Body>> for DataPlane {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let service = self.0.clone();
        Box::pin(async move {
            if req.uri().path() != pb::STREAM_HIDDEN_STATES_PATH {
                return Ok(
                    Status::unimplemented(format!("{} is not a method of this drafter", req.uri().path())).into_http()
                );
            }
            let incoming = InboundStream::new(req.into_body(), dflash_role::transport::MAX_MESSAGE_BYTES);
            Ok(match service.open_stream(incoming).await {
                Ok(acks) => {
                    let mut response = http::Response::new(Body::new(AckBody { acks, done: false }));
                    response
                        .headers_mut()
                        .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
                    response
                }
                Err(status) => status.into_http(),
            })
        })
    }
}

/// A target's request body as a sequence of [`Inbound`] messages.
pub struct InboundStream {
    body: Body,
    frames: InboundFrames,
    ended: bool,
}

impl InboundStream {
    pub fn new(body: Body, max_message: usize) -> Self {
        Self { body, frames: InboundFrames::new(max_message), ended: false }
    }

    /// The next message; `None` when the target closed the stream.
    /// Cancel-safe: frames already read stay queued.
    pub async fn next(&mut self) -> Result<Option<Inbound>, Status> {
        loop {
            if let Some(m) = self.frames.next_message().map_err(status_of)? {
                return Ok(Some(m));
            }
            if self.ended {
                self.frames.finish().map_err(status_of)?;
                return Ok(None);
            }
            let body = &mut self.body;
            match std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut *body), cx)).await {
                // Trailers carry nothing for this RPC.
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.frames.push(data);
                    }
                }
                Some(Err(status)) => return Err(status),
                None => self.ended = true,
            }
        }
    }
}

fn status_of(e: InboundError) -> Status {
    match e {
        InboundError::TooLarge { .. } => Status::out_of_range(e.to_string()),
        InboundError::Compressed => Status::unimplemented(e.to_string()),
        InboundError::Truncated(_) | InboundError::Decode(_) => Status::invalid_argument(e.to_string()),
    }
}

/// The response body: each acknowledgement as a gRPC message, then the
/// status as trailers (OK when the stream ends without an error).
struct AckBody {
    acks: mpsc::Receiver<Result<pb::DrafterMessage, Status>>,
    done: bool,
}

impl http_body::Body for AckBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let frame = match ready!(self.acks.poll_recv(cx)) {
            Some(Ok(m)) => Frame::data(dflash_wire::grpc_message(&m)),
            Some(Err(status)) => {
                self.done = true;
                Frame::trailers(trailers(&status))
            }
            None => {
                self.done = true;
                Frame::trailers(trailers(&Status::ok("")))
            }
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

fn trailers(status: &Status) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    if status.add_header(&mut map).is_err() {
        // Only a message that is not valid header text gets here.
        map.clear();
        let _ = Status::internal("unencodable status").add_header(&mut map);
    }
    map
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::time::Duration;

    use dflash_wire::{BatchMeta, DType, HostBatch, Layout, batch_messages, grpc_pieces};
    use pb::target_message::Msg;
    use prost::Message;
    use tower::ServiceExt;

    use super::*;
    use crate::receiver::{Expected, Landing, ReceivedBatch};

    fn service(queue: flume::Sender<ReceivedBatch>) -> DataPlane {
        DataPlane::new(DrafterService {
            landing: Landing::host(2),
            run_id: "run-1".into(),
            instance_id: "drafter-0".into(),
            credits: 2,
            expected: Expected { hidden_size: 8, layer_ids: vec![0] },
            max_payload_bytes: 1 << 20,
            queue,
            stop: dflash_role::Stop::new(),
            hello_timeout: Duration::from_secs(10),
        })
    }

    fn hello(run_id: &str) -> pb::TargetMessage {
        pb::TargetMessage {
            msg: Some(Msg::Hello(pb::StreamHello {
                protocol_version: dflash_proto::PROTOCOL_VERSION,
                run_id: run_id.into(),
                target_instance: "target-0".into(),
            })),
        }
    }

    fn batch() -> HostBatch {
        let meta = BatchMeta {
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
            trace_context: Default::default(),
        };
        let payload: Vec<u8> = (0..meta.payload_bytes()).map(|i| (i * 13 % 251) as u8).collect();
        HostBatch::new(meta, payload.into()).unwrap()
    }

    /// A request body of fixed frames.
    struct Frames(VecDeque<Bytes>);

    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = Status;
        fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }

    /// `messages` framed as a target frames them, cut into 100-byte HTTP/2 frames.
    fn request(path: &str, messages: Vec<pb::TargetMessage>) -> http::Request<Body> {
        let bytes: Vec<u8> = messages
            .into_iter()
            .flat_map(|m| {
                let (head, payload) = grpc_pieces(m).split();
                [head.to_vec(), payload.map(|p| p.to_vec()).unwrap_or_default()].concat()
            })
            .collect();
        let frames = bytes.chunks(100).map(Bytes::copy_from_slice).collect();
        let mut req = http::Request::new(Body::new(Frames(frames)));
        *req.uri_mut() = http::Uri::try_from(path).unwrap();
        req
    }

    /// The response's messages and its final status (trailers, or the
    /// headers of a refusal).
    async fn answer(service: DataPlane, req: http::Request<Body>) -> (Vec<pb::DrafterMessage>, Status) {
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
        let got = queued.try_recv().unwrap().batch;
        assert_eq!((got.payload, got.meta.input_ids), (b.payload, b.meta.input_ids));
    }

    #[tokio::test]
    async fn refusals_come_back_as_grpc_statuses() {
        let (queue, _queued) = flume::bounded(4);
        let (_, status) =
            answer(service(queue.clone()), request(pb::STREAM_HIDDEN_STATES_PATH, vec![hello("other")])).await;
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert!(status.message().contains("wrong run id \"other\""), "{}", status.message());
        let (_, status) = answer(service(queue), request("/dflash.v1.Drafter/Nope", vec![])).await;
        assert_eq!(status.code(), tonic::Code::Unimplemented);
    }
}
