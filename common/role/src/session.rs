//! A role's session with the coordinator: registration (and
//! re-registration after a coordinator restart), heartbeats, the event
//! watch, and error reports.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use dflash_config::RunConfig;
use dflash_proto as pb;
use dflash_proto::CoordinatorError;
use dflash_proto::coordinator_client::CoordinatorClient;
use dflash_telemetry::{ErrorKind, KindPolicy, Reaction};
use tokio::sync::watch;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::errors::{device_of, format_chain, kind_of};
use crate::security::{ClientAuth, Security, SecurityArgs};
use crate::{Stages, Stop, StopCause};

/// A Coordinator API client that sends the shared token.
pub type CoordinatorConn = CoordinatorClient<InterceptedService<Channel, ClientAuth>>;

/// Command-line settings every role shares.
#[derive(clap::Args, Clone, Debug)]
pub struct RoleArgs {
    /// Coordinator URL.
    #[arg(long, env = "DFLASH_COORDINATOR", default_value = "http://127.0.0.1:50051")]
    pub coordinator: String,
    /// Name of this instance (default: role-host-pid). The instance id is
    /// the name plus a suffix drawn at process start: a restarted process
    /// is a new instance, even where the name stays (a container's pid 1,
    /// a Kubernetes pod name).
    #[arg(long, env = "DFLASH_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Seconds to keep trying to reach the coordinator at startup.
    #[arg(long, env = "DFLASH_CONNECT_TIMEOUT_S", default_value_t = 60)]
    pub connect_timeout_s: u64,
    #[command(flatten)]
    pub security: SecurityArgs,
    /// Serve Prometheus metrics on http://<addr>/metrics (off when unset).
    #[arg(long, env = "DFLASH_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

/// What a role announces about itself.
#[derive(Clone, Debug)]
pub struct Announce {
    pub role: pb::Role,
    pub devices: Vec<String>,
    /// Data-plane URL (drafters), empty otherwise.
    pub endpoint: String,
}

/// A registered role instance.
pub struct Session {
    pub run_id: String,
    /// The run's lease key (drafters only; empty for targets).
    pub lease_key: Vec<u8>,
    pub config: RunConfig,
    pub instance_id: String,
    pub role: pb::Role,
    pub stop: Stop,
    pub security: Security,
    client: CoordinatorConn,
    /// What registering (again) says; a drafter adds its group membership.
    request: std::sync::Mutex<pb::RegisterRequest>,
    rpc_timeout: Duration,
}

/// Bounded wait for one RPC.
pub async fn with_timeout<T>(
    timeout: Duration,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, tonic::Status> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r.map(tonic::Response::into_inner),
        Err(_) => Err(tonic::Status::deadline_exceeded(format!("no answer within {timeout:?}"))),
    }
}

/// A lazily connecting channel (reconnects by itself after failures),
/// with client TLS for `https://` URLs.
pub fn lazy_channel(url: &str, security: &Security) -> anyhow::Result<Channel> {
    let endpoint = Endpoint::from_shared(url.to_string())
        .with_context(|| format!("invalid URL {url}"))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    Ok(security.endpoint(endpoint)?.connect_lazy())
}

/// A Coordinator API client for `url`.
pub fn coordinator_client(url: &str, security: &Security) -> anyhow::Result<CoordinatorConn> {
    Ok(CoordinatorClient::with_interceptor(lazy_channel(url, security)?, security.client_auth()))
}

fn default_instance_name(role: pb::Role) -> String {
    let host = hostname::get().map(|h| h.to_string_lossy().into_owned()).unwrap_or_else(|_| "host".into());
    format!("{}-{host}-{}", role.name(), std::process::id())
}

/// This process's instance id: `name` and a suffix unique to the process
/// start. The coordinator keys everything an instance holds (leases, a
/// place in the drafter group) by it, so a process that restarts under the
/// same name must not inherit what its predecessor held.
fn instance_id(name: &str) -> String {
    format!("{name}-{:06x}", rand::random::<u32>() & 0xff_ffff)
}

impl Session {
    /// Registers with the coordinator, retrying until `connect_timeout_s`,
    /// and returns the session with the validated run config.
    pub async fn register(args: &RoleArgs, announce: Announce, stop: Stop) -> anyhow::Result<Arc<Self>> {
        let instance_id =
            instance_id(&args.instance_id.clone().unwrap_or_else(|| default_instance_name(announce.role)));
        let host = hostname::get().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default();
        let request = pb::RegisterRequest {
            protocol_version: dflash_proto::PROTOCOL_VERSION,
            role: announce.role as i32,
            instance_id: instance_id.clone(),
            host,
            devices: announce.devices,
            version: env!("CARGO_PKG_VERSION").to_string(),
            endpoint: announce.endpoint,
            pid: std::process::id(),
            group_generation: 0,
            group_world: 0,
        };
        let security = args.security.load()?;
        let mut client = coordinator_client(&args.coordinator, &security)?;
        let deadline = Instant::now() + Duration::from_secs(args.connect_timeout_s);
        let mut backoff = crate::Backoff::new();
        let resp = loop {
            let attempt = with_timeout(Duration::from_secs(10), client.register(request.clone())).await;
            let s = match attempt {
                Ok(r) => break r,
                Err(s) => s,
            };
            let refusal = CoordinatorError::from_status(&s);
            match dflash_telemetry::on_coordinator_error(refusal.as_ref()) {
                // The coordinator answered and refused: no retry will help.
                Reaction::RunOver(state) => {
                    // Nothing to join: a role started after the run ended
                    // (a supervisor restarting it) stops for the run's reason,
                    // with exit 0 when the run completed.
                    stop.stop(run_over_cause(state, s.message().to_string()));
                    anyhow::bail!("the coordinator at {} refused registration: {}", args.coordinator, s.message());
                }
                Reaction::Fail => {
                    anyhow::bail!("the coordinator at {} refused registration: {}", args.coordinator, s.message());
                }
                _ if Instant::now() >= deadline => {
                    anyhow::bail!(
                        "cannot reach the coordinator at {} within {} s: {}",
                        args.coordinator,
                        args.connect_timeout_s,
                        s.message()
                    );
                }
                _ => {
                    tracing::debug!("coordinator not ready ({}); retrying", s.message());
                    let delay = backoff.next_delay();
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = stop.stopped() => anyhow::bail!("stopped while registering"),
                    }
                }
            }
        };
        let config = dflash_config::from_toml_str(&resp.config_toml).context("run config from the coordinator")?;
        config.validate().context("run config from the coordinator")?;
        dflash_telemetry::enable_otlp(Some(&config.telemetry.otlp_endpoint)).context("traces")?;
        let rpc_timeout = Duration::from_millis(config.faults.rpc_timeout_ms);
        if announce.role == pb::Role::Drafter && resp.lease_key.len() != dflash_proto::lease_token::KEY_BYTES {
            anyhow::bail!(
                "the coordinator gave no lease key ({} bytes): it cannot be the coordinator of protocol {}",
                resp.lease_key.len(),
                dflash_proto::PROTOCOL_VERSION
            );
        }
        Ok(Arc::new(Self {
            run_id: resp.run_id,
            lease_key: resp.lease_key.to_vec(),
            config,
            instance_id,
            role: announce.role,
            stop,
            security,
            client,
            request: std::sync::Mutex::new(request),
            rpc_timeout,
        }))
    }

    fn register_request(&self) -> pb::RegisterRequest {
        self.request.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A drafter's place in its group, said when it registers again (to a
    /// coordinator that restarted).
    pub fn set_group(&self, generation: u64, world: u32) {
        let mut r = self.request.lock().unwrap_or_else(|e| e.into_inner());
        (r.group_generation, r.group_world) = (generation, world);
    }

    /// Registers again with the devices the role ended up on (known only
    /// once the config arrived and the models loaded).
    pub async fn announce_devices(&self, devices: Vec<String>) -> anyhow::Result<()> {
        let mut req = self.register_request();
        req.devices = devices;
        with_timeout(self.rpc_timeout, self.client().register(req)).await.map_err(|s| {
            if let Some(CoordinatorError::RunOver { state, message, .. }) = CoordinatorError::from_status(&s) {
                // The run ended while this role was starting: stop for the
                // run's reason, as its event stream would have said.
                self.stop.stop(run_over_cause(state, message));
            }
            anyhow::anyhow!("re-registering with devices: {}", s.message())
        })?;
        Ok(())
    }

    /// A client for this session's coordinator (cheap clone of the channel).
    pub fn client(&self) -> CoordinatorConn {
        self.client.clone()
    }

    /// The run config as TOML (stored in checkpoints).
    pub fn config_toml(&self) -> String {
        dflash_config::to_toml_string(&self.config)
    }

    pub fn rpc_timeout(&self) -> Duration {
        self.rpc_timeout
    }

    /// Logs the effective config once, as every role does at startup.
    pub fn log_config(&self) {
        tracing::info!("{}", self.config.startup_banner(self.role.name(), &self.run_id));
        tracing::info!("transport security: {}", self.security.summary());
    }

    /// Starts the metrics endpoint when `--metrics-listen` is set.
    pub async fn serve_metrics(&self, args: &RoleArgs, stages: &Stages) -> anyhow::Result<()> {
        if let Some(addr) = args.metrics_listen {
            let stop = self.stop.clone();
            let server = dflash_telemetry::serve_metrics(addr, async move { stop.stopped().await }).await?;
            stages.spawn_task("metrics", server);
        }
        Ok(())
    }

    /// Heartbeats every `faults.heartbeat_interval_ms`, carrying the batch
    /// ids `held` returns (to renew their leases). Re-registers when the
    /// coordinator no longer knows this instance (it restarted); stops the
    /// role when the coordinator is unreachable past its timeout.
    /// `load` returns (tokens produced so far, busy fraction) for targets.
    pub fn spawn_heartbeat(
        self: &Arc<Self>,
        stages: &Stages,
        held: impl Fn() -> Vec<u64> + Send + Sync + 'static,
        load: impl Fn() -> (u64, f32) + Send + Sync + 'static,
    ) {
        let this = Arc::clone(self);
        stages.spawn_task("heartbeat", async move {
            let f = &this.config.faults;
            let period = Duration::from_millis(f.heartbeat_interval_ms);
            let give_up = Duration::from_millis(f.coordinator_timeout_ms);
            let mut last_ok = Instant::now();
            let mut client = this.client();
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(period) => {}
                    _ = this.stop.stopped() => return Ok(()),
                }
                let (tokens_produced, busy_fraction) = load();
                let req = pb::HeartbeatRequest {
                    run_id: this.run_id.clone(),
                    instance_id: this.instance_id.clone(),
                    held_batch_ids: held(),
                    tokens_produced,
                    busy_fraction,
                };
                let s = match with_timeout(this.rpc_timeout, client.heartbeat(req)).await {
                    Ok(_) => {
                        last_ok = Instant::now();
                        continue;
                    }
                    Err(s) => s,
                };
                match dflash_telemetry::on_coordinator_error(CoordinatorError::from_status(&s).as_ref()) {
                    Reaction::Register => {
                        tracing::warn!("the coordinator does not know this instance (restarted?): registering again");
                        match with_timeout(this.rpc_timeout, client.register(this.register_request())).await {
                            Ok(r) if r.run_id == this.run_id => last_ok = Instant::now(),
                            Ok(r) => {
                                this.stop.stop(StopCause::Fatal(format!(
                                    "the coordinator now runs run {} instead of {}",
                                    r.run_id, this.run_id
                                )));
                                return Ok(());
                            }
                            Err(e) => tracing::warn!("re-registration failed: {}", e.message()),
                        }
                    }
                    Reaction::RunOver(state) => {
                        this.stop.stop(run_over_cause(state, s.message().to_string()));
                        return Ok(());
                    }
                    Reaction::Fail => {
                        this.stop.stop(StopCause::Fatal(format!("coordinator: {}", s.message())));
                        return Ok(());
                    }
                    Reaction::Rejoin => {
                        this.stop.stop(StopCause::GroupReform(s.message().to_string()));
                        return Ok(());
                    }
                    Reaction::Retry => {
                        tracing::debug!("heartbeat failed: {}", s.message());
                        if last_ok.elapsed() > give_up {
                            this.stop.stop(StopCause::PeerLost(format!(
                                "coordinator unreachable for {} s ({})",
                                give_up.as_secs(),
                                s.message()
                            )));
                            return Ok(());
                        }
                    }
                }
            }
        });
    }

    /// Watches the run's events: stops the role when the run ends, and
    /// tells the drafter group as it changes.
    pub fn spawn_event_watch(self: &Arc<Self>, stages: &Stages) -> watch::Receiver<Option<pb::DrafterGroup>> {
        let (tx, rx) = watch::channel(None);
        let this = Arc::clone(self);
        stages.spawn_task("event-watch", async move {
            let mut client = this.client();
            let mut backoff = crate::Backoff::new();
            loop {
                let req = pb::WatchEventsRequest { run_id: this.run_id.clone(), instance_id: this.instance_id.clone() };
                let stream = tokio::select! {
                    r = with_timeout(this.rpc_timeout, client.watch_events(req)) => r,
                    _ = this.stop.stopped() => return Ok(()),
                };
                if let Ok(mut stream) = stream {
                    backoff.reset();
                    loop {
                        let msg = tokio::select! {
                            m = stream.message() => m,
                            _ = this.stop.stopped() => return Ok(()),
                        };
                        match msg {
                            Ok(Some(ev)) => this.handle_event(ev, &tx),
                            Ok(None) | Err(_) => break,
                        }
                    }
                }
                // Reconnect with backoff; the heartbeat decides when the
                // coordinator is lost.
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                    _ = this.stop.stopped() => return Ok(()),
                }
            }
        });
        rx
    }

    fn handle_event(&self, ev: pb::RunEvent, tx: &watch::Sender<Option<pb::DrafterGroup>>) {
        match ev.event {
            Some(pb::run_event::Event::Group(g)) if tx.borrow().as_ref() != Some(&g) => {
                if g.members.is_empty() {
                    tracing::info!("drafter group: none training (generation {} over, or forming)", g.generation);
                } else {
                    tracing::info!(
                        "drafter group generation {}: {}",
                        g.generation,
                        g.members
                            .iter()
                            .map(|m| format!("{} at {}", m.instance_id, m.endpoint))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                let _ = tx.send(Some(g));
            }
            Some(pb::run_event::Event::Stop(s)) => {
                let cause = match pb::StopReason::try_from(s.reason) {
                    Ok(pb::StopReason::Completed) => StopCause::RunCompleted,
                    Ok(pb::StopReason::Cancelled) => StopCause::RunCancelled(s.message),
                    _ => StopCause::RunFailed(s.message),
                };
                tracing::info!("coordinator stops the run: {cause}");
                self.stop.stop(cause);
            }
            // The group as it was already known.
            Some(pb::run_event::Event::Group(_)) | None => {}
        }
    }

    /// Reports an error with its cause chain and the device it happened
    /// on ([`DeviceExt`]). Best effort: a coordinator that cannot be
    /// reached is logged, not waited for.
    pub async fn report_error(&self, kind: ErrorKind, err: &anyhow::Error) {
        self.report_error_as(kind, err, !kind.is_retryable()).await
    }

    /// Reports an error to the coordinator; a `fatal` one ends the run.
    async fn report_error_as(&self, kind: ErrorKind, err: &anyhow::Error, fatal: bool) {
        let causes = dflash_telemetry::cause_chain(err.as_ref());
        let report = pb::ErrorReport {
            run_id: self.run_id.clone(),
            role: self.role as i32,
            instance_id: self.instance_id.clone(),
            device: device_of(err),
            kind: kind as i32,
            message: causes.first().cloned().unwrap_or_default(),
            causes,
            fatal,
        };
        if let Err(s) = with_timeout(self.rpc_timeout, self.client().report_error(report)).await {
            tracing::warn!("could not report the error to the coordinator: {}", s.message());
        }
    }

    /// Ends a role's main: reports a fatal error, logs why the role stops,
    /// and returns the exit code.
    pub async fn finish(&self, result: anyhow::Result<()>) -> i32 {
        let code = self.finish_inner(result).await;
        // Spans of the last batches go out before the process does.
        let _ = tokio::task::spawn_blocking(dflash_telemetry::shutdown_tracing).await;
        code
    }

    async fn finish_inner(&self, result: anyhow::Result<()>) -> i32 {
        match (&result, self.stop.cause()) {
            // The error is why this member leaves its drafter group (a peer
            // or the rendezvous lost): it joins the next generation, the
            // run goes on.
            (Err(e), Some(StopCause::GroupReform(_))) => {
                tracing::warn!("leaving the drafter group: {}", format_chain(e))
            }
            // Its own device is lost: reported (not as the run's end: the
            // group goes on without this member).
            (Err(e), Some(StopCause::DeviceLost(_))) => {
                tracing::error!("{}", format_chain(e));
                self.report_error_as(kind_of(e), e, false).await;
            }
            // The run ended while this role was still starting or waiting
            // on it (a replacement arriving after the last commit): that is
            // the run's end, not this role's failure.
            (Err(e), Some(StopCause::RunCompleted | StopCause::RunFailed(_) | StopCause::RunCancelled(_))) => {
                tracing::info!("the run ended meanwhile: {}", format_chain(e))
            }
            (Err(e), _) => {
                let kind = kind_of(e);
                tracing::error!("{}", format_chain(e));
                self.report_error(kind, e).await;
                self.stop.stop(StopCause::Fatal(format_chain(e)));
            }
            (Ok(()), _) => {}
        }
        let cause = self.stop.cause().unwrap_or(StopCause::RunCompleted);
        let code = cause.exit_code();
        if code == 0 {
            tracing::info!("stopping: {cause}");
        } else {
            tracing::error!("stopping: {cause}");
        }
        code
    }
}

/// The stop cause of a run that is over in `state`.
pub fn run_over_cause(state: pb::RunState, message: String) -> StopCause {
    match state {
        pb::RunState::Completed => StopCause::RunCompleted,
        pb::RunState::Cancelled => StopCause::RunCancelled(message),
        _ => StopCause::RunFailed(message),
    }
}

/// Logs why registration failed and returns the process exit code: 0 when
/// the run it tried to join had completed, 1 otherwise.
pub fn registration_failed(e: &anyhow::Error, stop: &Stop) -> i32 {
    match stop.cause() {
        Some(cause @ StopCause::RunCompleted) => {
            tracing::info!("nothing to do ({cause}): {}", format_chain(e));
            0
        }
        _ => {
            tracing::error!("{}", format_chain(e));
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_that_ended_during_startup_stops_the_role_for_the_runs_reason() {
        let over = |state| {
            let s =
                CoordinatorError::RunOver { run_id: "r1".into(), state, message: "bad sample".into() }.into_status();
            match CoordinatorError::from_status(&s) {
                Some(CoordinatorError::RunOver { state, message, .. }) => run_over_cause(state, message),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(over(pb::RunState::Failed), StopCause::RunFailed("bad sample".into()));
        assert_eq!(over(pb::RunState::Completed), StopCause::RunCompleted);
        assert!(matches!(over(pb::RunState::Cancelled), StopCause::RunCancelled(_)));
    }
}
