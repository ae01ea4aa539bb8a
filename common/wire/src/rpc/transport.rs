//! The hidden-state stream's transport settings, in one place for the
//! drafter's server, the targets' clients and the transport benchmark.
//! Larger HTTP/2 windows and frames than the defaults carry multi-MiB
//! chunks at several GB/s (BENCHMARKS.md, transport); keepalives bound how long a dead
//! peer goes unnoticed.

use std::time::Duration;

use tonic::transport::{Endpoint, Server};

/// Largest gRPC message either side accepts (a chunk plus its framing).
pub const MAX_MESSAGE_BYTES: usize = 80 << 20;

const STREAM_WINDOW: u32 = 16 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;
const MAX_FRAME: u32 = 1 << 20;

/// Server builder for the drafter's data plane.
pub fn data_server() -> Server {
    Server::builder()
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONNECTION_WINDOW))
        .max_frame_size(Some(MAX_FRAME))
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
}

/// Client endpoint of a drafter's data plane; an error names the URL.
pub fn data_endpoint(url: &str) -> Result<Endpoint, String> {
    Ok(Endpoint::from_shared(url.to_string())
        .map_err(|e| format!("drafter endpoint {url}: {e}"))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true)
        .initial_stream_window_size(Some(STREAM_WINDOW))
        .initial_connection_window_size(Some(CONNECTION_WINDOW)))
}
