//! grpc.health.v1 for roles: a plain-text health server for probes, and
//! the client side behind each binary's `health` subcommand.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use tonic_health::ServingStatus;
use tonic_health::pb::health_check_response::ServingStatus as Status;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};

use crate::{Security, Stop, lazy_channel};

/// Serves grpc.health.v1 on `addr` in plain text until `stop`. Roles
/// without another server (the target) report SERVING here; the others
/// pass the service of their main server so both answer alike.
pub async fn serve_health_only(addr: SocketAddr, stop: Stop) -> anyhow::Result<()> {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter.set_service_status("", ServingStatus::Serving).await;
    serve_health(addr, service, stop).await
}

/// Serves an existing health service on its own plain-text port (for
/// probes that cannot speak TLS).
pub async fn serve_health<T: Health>(addr: SocketAddr, service: HealthServer<T>, stop: Stop) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("health listener {addr}"))?;
    tracing::info!("health on {}", listener.local_addr()?);
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), stop.stopped())
        .await?;
    Ok(())
}

/// Asks `url` for the status of `service` ("" is the whole server);
/// Ok only for SERVING. What the `health` subcommand of every binary runs.
pub async fn check_health(url: &str, service: &str, security: &Security, timeout: Duration) -> anyhow::Result<()> {
    let mut client = HealthClient::new(lazy_channel(url, security)?);
    let req = tonic_health::pb::HealthCheckRequest { service: service.to_string() };
    let resp = tokio::time::timeout(timeout, client.check(req))
        .await
        .map_err(|_| anyhow::anyhow!("{url}: no answer within {timeout:?}"))?
        .map_err(|s| anyhow::anyhow!("{url}: {} ({:?})", s.message(), s.code()))?
        .into_inner();
    match Status::try_from(resp.status) {
        Ok(Status::Serving) => Ok(()),
        Ok(other) => anyhow::bail!("{url}: {}", other.as_str_name()),
        Err(_) => anyhow::bail!("{url}: unknown status {}", resp.status),
    }
}

/// The `health` subcommand's arguments, shared by every binary.
#[derive(clap::Args, Clone, Debug)]
pub struct HealthArgs {
    /// URL of the gRPC server to check.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub url: String,
    /// Service to ask about ("" for the whole server).
    #[arg(long, default_value = "")]
    pub service: String,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 5)]
    pub timeout_s: u64,
    #[command(flatten)]
    pub security: crate::SecurityArgs,
}

impl HealthArgs {
    /// Runs the check and returns the process exit code (0 when SERVING).
    pub async fn run(&self) -> i32 {
        let result = async {
            let security = self.security.load()?;
            check_health(&self.url, &self.service, &security, Duration::from_secs(self.timeout_s)).await
        }
        .await;
        match result {
            Ok(()) => {
                println!("SERVING");
                0
            }
            Err(e) => {
                eprintln!("not healthy: {e:#}");
                1
            }
        }
    }
}
