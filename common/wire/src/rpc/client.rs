//! The target's end of `StreamHiddenStates`: the call made one layer below
//! tonic's codec, so that chunk payloads reach the HTTP/2 layer as the
//! slices of the batch they are ([`crate::grpc_pieces`]) instead of being copied into an encode
//! buffer first. Same gRPC on the wire; acknowledgements are decoded by
//! tonic as usual (they are small).

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use dflash_proto as pb;
use http_body::Frame;
use tokio::sync::mpsc;
use tonic::body::Body;
use tonic::codec::{Codec, Streaming};
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tower::{Service, ServiceExt};

use super::transport::MAX_MESSAGE_BYTES;

/// Opens a hidden-state stream on `channel` that sends `messages` (hello
/// first) and returns the drafter's replies. `auth` adds the call's
/// credentials, as an interceptor on a generated client would.
pub async fn open_hidden_state_stream(
    mut channel: Channel,
    mut auth: impl Interceptor,
    messages: mpsc::Receiver<pb::TargetMessage>,
) -> Result<tonic::Response<Streaming<pb::DrafterMessage>>, Status> {
    let (metadata, _, ()) = auth.call(tonic::Request::new(()))?.into_parts();
    let body = OutboundBody { messages, pending: None, _channel: channel.clone() };
    let mut req = http::Request::new(Body::new(body));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = http::Uri::from_static(pb::STREAM_HIDDEN_STATES_PATH);
    let headers = req.headers_mut();
    headers.extend(metadata.into_headers());
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    let ready = channel.ready().await.map_err(|e| Status::unavailable(format!("drafter connection: {e}")))?;
    let response = ready.call(req).await.map_err(|e| Status::unavailable(format!("drafter connection: {e}")))?;
    let (parts, body) = response.into_parts();
    // A refusal comes as a response of headers only, the status among them.
    if let Some(status) = Status::from_header_map(&parts.headers)
        && status.code() != Code::Ok
    {
        return Err(status);
    }
    let decoder = tonic_prost::ProstCodec::<pb::TargetMessage, pb::DrafterMessage>::default().decoder();
    Ok(tonic::Response::new(Streaming::new_response(decoder, body, parts.status, None, Some(MAX_MESSAGE_BYTES))))
}

/// The request body: each message's gRPC framing, chunk payloads as their
/// own zero-copy frame.
struct OutboundBody {
    messages: mpsc::Receiver<pb::TargetMessage>,
    /// A chunk's payload, sent after its head.
    pending: Option<Bytes>,
    /// Keeps the connection open until the body's last frame is sent, as a
    /// generated client holding its channel would.
    _channel: Channel,
}

impl http_body::Body for OutboundBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(payload) = self.pending.take() {
            return Poll::Ready(Some(Ok(Frame::data(payload))));
        }
        Poll::Ready(ready!(self.messages.poll_recv(cx)).map(|m| {
            let (head, payload) = crate::grpc_pieces(m).split();
            self.pending = payload;
            Ok(Frame::data(head))
        }))
    }
}
