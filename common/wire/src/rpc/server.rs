//! The drafter's end of `StreamHiddenStates`: the `Drafter` gRPC service's
//! one RPC, served one layer below tonic's codec. On the wire it is the
//! same gRPC (length-prefixed protobuf over HTTP/2, status in trailers),
//! so tonic clients, interceptors and the health service work unchanged;
//! what differs is that chunk payloads go from the HTTP/2 frames they
//! arrived in straight to their landing buffer ([`crate::InboundFrames`]),
//! instead of being gathered into a message buffer first: one pass over
//! every payload byte less. What happens to a stream is the
//! [`StreamHandler`]'s business (the drafter's receiver).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use dflash_proto as pb;
use dflash_proto::DrafterError;
use http_body::Frame;
use tokio::sync::mpsc;
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;

use crate::{Inbound, InboundError, InboundFrames};

/// Acknowledgements (or the status that ends the stream) to send back.
pub type AckSender = mpsc::Sender<Result<pb::DrafterMessage, Status>>;
/// The other end of an [`AckSender`]: what the response body sends.
pub type AckReceiver = mpsc::Receiver<Result<pb::DrafterMessage, Status>>;

/// What the service does with one target's stream.
pub trait StreamHandler: Send + Sync + 'static {
    /// Takes a new stream (nothing read yet, messages capped at
    /// [`MAX_HELLO_BYTES`] until the handler raises the cap) and returns
    /// the replies to send back; an error refuses the stream with that
    /// status.
    fn open_stream(&self, incoming: InboundStream) -> impl Future<Output = Result<AckReceiver, Status>> + Send;
}

/// The `Drafter` service for tonic's router (wrap it in an interceptor as
/// any generated server).
pub struct HiddenStateService<H>(Arc<H>);

impl<H> HiddenStateService<H> {
    pub fn new(handler: H) -> Self {
        Self(Arc::new(handler))
    }
}

impl<H> Clone for HiddenStateService<H> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<H> NamedService for HiddenStateService<H> {
    const NAME: &'static str = "dflash.v1.Drafter";
}

impl<H: StreamHandler> tower::Service<http::Request<Body>> for HiddenStateService<H> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let handler = Arc::clone(&self.0);
        Box::pin(async move {
            if req.uri().path() != pb::STREAM_HIDDEN_STATES_PATH {
                return Ok(Status::from(DrafterError::UnknownMethod(req.uri().path().into())).into_http());
            }
            // Until its hello, a stream may send only small messages: a peer
            // that never says who it is cannot make the drafter buffer
            // megabytes.
            let incoming = InboundStream::new(req.into_body(), MAX_HELLO_BYTES);
            Ok(match handler.open_stream(incoming).await {
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

/// Largest message before the hello (a hello is a few dozen bytes).
pub const MAX_HELLO_BYTES: usize = 64 << 10;

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

    /// Accepts messages up to `max` bytes from now on (after the hello).
    pub fn allow_messages_up_to(&mut self, max: usize) {
        self.frames.set_max_message(max);
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
    Status::from(match e {
        InboundError::TooLarge { len, limit } => DrafterError::MessageTooLarge { len: len as u64, limit: limit as u64 },
        InboundError::Compressed => DrafterError::Compressed,
        InboundError::Truncated(_) | InboundError::Decode(_) => DrafterError::Malformed(e.to_string()),
    })
}

/// The response body: each acknowledgement as a gRPC message, then the
/// status as trailers (OK when the stream ends without an error).
struct AckBody {
    acks: AckReceiver,
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
            Some(Ok(m)) => Frame::data(crate::grpc_message(&m)),
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
