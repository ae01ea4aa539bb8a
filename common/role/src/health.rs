//! grpc.health.v1 for roles.

use std::net::SocketAddr;

use tonic_health::ServingStatus;

use crate::Stop;

/// Serves only grpc.health.v1 on `addr` until `stop` (roles without another
/// gRPC service, like the target, use this for probes).
pub async fn serve_health_only(addr: SocketAddr, stop: Stop) -> anyhow::Result<()> {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter.set_service_status("", ServingStatus::Serving).await;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!("health on {}", listener.local_addr()?);
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), stop.stopped())
        .await?;
    Ok(())
}
