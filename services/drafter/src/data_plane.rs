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

use bytes::{BufMut, Bytes, BytesMut};
use dflash_proto as pb;
use dflash_wire::{Inbound, InboundError, InboundFrames};
use http_body::Frame;
use prost::Message;
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
            Some(Ok(m)) => Frame::data(grpc_message(&m)),
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

/// `m` with gRPC's prefix (uncompressed, big-endian length).
fn grpc_message(m: &pb::DrafterMessage) -> Bytes {
    let len = m.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    m.encode(&mut buf).expect("the buffer has room for the message");
    buf.freeze()
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
