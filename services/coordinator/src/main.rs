//! `dflash-coordinator`: loads and validates the run config once, plans the
//! work into the ledger, and serves the Coordinator API until the run ends.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use dflash_config::ConfigFlags;
use dflash_coordinator::ledger::Ledger;
use dflash_coordinator::plan::{RunPlan, plan_run};
use dflash_coordinator::run::Run;
use dflash_coordinator::service::CoordinatorService;
use dflash_proto::coordinator_server::CoordinatorServer;
use dflash_role::{HealthArgs, SecurityArgs, Stages, Stop, format_chain};
use tonic::service::interceptor::InterceptedService;
use tonic_health::ServingStatus;

#[derive(Parser, Debug)]
#[command(
    name = "dflash-coordinator",
    version,
    about = "The dflash coordinator service",
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    config: ConfigFlags,
    #[command(flatten)]
    security: SecurityArgs,
    /// Also serve grpc.health.v1 in plain text here (for probes that cannot
    /// speak TLS or send the token).
    #[arg(long, env = "DFLASH_HEALTH_LISTEN")]
    health_listen: Option<SocketAddr>,
    /// Serve Prometheus metrics on http://<addr>/metrics (off when unset).
    #[arg(long, env = "DFLASH_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Address to serve the Coordinator API and grpc.health.v1 on.
    #[arg(long, env = "DFLASH_LISTEN", default_value = "0.0.0.0:50051")]
    listen: SocketAddr,
    /// SQLite ledger of the run's work (default: runs/<run.name>.ledger.sqlite).
    /// Restarting with the same ledger resumes the run.
    #[arg(long, env = "DFLASH_LEDGER")]
    ledger: Option<PathBuf>,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Checks a gRPC server's grpc.health.v1 status; exit 0 when SERVING.
    Health(HealthArgs),
}

/// How long the coordinator keeps answering after the run ended.
const END_LINGER: Duration = Duration::from_secs(2);

fn main() {
    dflash_telemetry::init("dflash-coordinator");
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    if let Some(Command::Health(h)) = &args.command {
        std::process::exit(runtime.block_on(h.run()));
    }
    let code = runtime.block_on(async {
        let result = run(args).await;
        let _ = tokio::task::spawn_blocking(dflash_telemetry::shutdown_tracing).await;
        match result {
            Ok(code) => code,
            Err(e) => {
                tracing::error!("{}", format_chain(&e));
                1
            }
        }
    });
    std::process::exit(code);
}

async fn run(args: Args) -> anyhow::Result<i32> {
    let loader = args.config.loader()?;
    let config = loader.load()?;
    let security = args.security.load()?;
    dflash_telemetry::enable_otlp(Some(&config.telemetry.otlp_endpoint))?;
    let plan = plan_run(config)?;
    let ledger_path =
        args.ledger.clone().unwrap_or_else(|| PathBuf::from(format!("runs/{}.ledger.sqlite", plan.config.run.name)));
    let _lock = lock_ledger(&ledger_path)?;
    let (ledger, run_id) = open_ledger(&ledger_path, &plan)?;
    tracing::info!(
        "coordinator effective run config (run {run_id}, from {}):\n{}",
        loader.describe_sources(),
        plan.config.to_string().lines().map(|l| format!("  {l}\n")).collect::<String>()
    );
    let counts = ledger.counts()?;
    let lease_key = ledger.lease_key()?;
    let run = Arc::new(Run::new(run_id.clone(), plan.config, ledger, lease_key));
    if counts.total() > 0 && counts.committed == counts.total() {
        run.end(dflash_proto::RunState::Completed, "every batch was already committed".into());
    }

    let stop = Stop::new();
    // Every task of the coordinator is one of its stages, joined on stop.
    let stages = Stages::new(stop.clone());
    stages.spawn_task("signals", stop.on_signals());
    serve(&args, &security, &run, &stages).await?;
    // Liveness checks until the run ends or the process is told to stop.
    stages.spawn_task("monitor", monitor(Arc::clone(&run), stop.clone()));
    wait_for_end(&run, &stop).await;
    stop.stop(dflash_role::StopCause::Signal("end of run"));
    stages.join(Duration::from_secs(5)).await;
    let (state, message) = run.state();
    Ok(match state {
        dflash_proto::RunState::Completed | dflash_proto::RunState::Running => 0,
        _ => {
            tracing::error!("run {run_id} ended {}: {message}", state.as_str_name());
            1
        }
    })
}

/// One coordinator per ledger: a second run on it would lease the live
/// run's batches to roles of its own. Held until the coordinator exits.
fn lock_ledger(ledger_path: &Path) -> anyhow::Result<dflash_role::ExclusiveLock> {
    if let Some(dir) = ledger_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut lock_name = ledger_path.to_path_buf().into_os_string();
    lock_name.push(".lock");
    Ok(dflash_role::ExclusiveLock::acquire(Path::new(&lock_name), "the coordinator of this ledger")?)
}

/// The ledger with the plan installed, and the run's id (made on a new
/// ledger, read back on a resumed one). A resumed run's old leases end
/// unless their targets come back in time.
fn open_ledger(ledger_path: &Path, plan: &RunPlan) -> anyhow::Result<(Ledger, String)> {
    let mut ledger = Ledger::open(ledger_path)?;
    let resumed = ledger.install_plan(&plan.fingerprint, &plan.batches)?;
    let run_id = match ledger.meta("run_id")? {
        Some(id) => id,
        None => {
            let id = format!("{}-{}", plan.config.run.name, &uuid::Uuid::new_v4().simple().to_string()[..8]);
            ledger.set_meta("run_id", &id)?;
            id
        }
    };
    if resumed {
        // Leases of targets that do not come back end after an instance
        // timeout, as a target that falls silent loses its leases; a live
        // target may first take its longest retry delay to find us again.
        let deadline = dflash_coordinator::clock::now_ms()
            + plan.config.faults.instance_timeout_ms
            + dflash_telemetry::RETRY_DELAY_CAP.as_millis() as u64;
        let n = ledger.shorten_leases(deadline)?;
        if n > 0 {
            tracing::info!(
                "{n} batch(es) leased before this start go back to pending unless their target renews them within \
                 faults.instance_timeout_ms (and the longest retry delay)"
            );
        }
        let counts = ledger.counts()?;
        tracing::info!(
            "resuming run {run_id} from ledger {}: {} of {} batches committed",
            ledger_path.display(),
            counts.committed,
            counts.total()
        );
    }
    Ok((ledger, run_id))
}

/// The Coordinator API and grpc.health.v1 (and plain health and metrics
/// where asked), each a stage that ends on stop.
async fn serve(args: &Args, security: &dflash_role::Security, run: &Arc<Run>, stages: &Stages) -> anyhow::Result<()> {
    let stop = stages.stop().clone();
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status("", ServingStatus::Serving).await;
    health.set_serving::<CoordinatorServer<CoordinatorService>>().await;
    if let Some(addr) = args.health_listen {
        stages.spawn_task("health", dflash_role::serve_health(addr, health_service.clone(), stop.clone()));
    }
    if let Some(addr) = args.metrics_listen {
        let stop = stop.clone();
        stages.spawn_task("metrics", dflash_telemetry::serve_metrics(addr, async move { stop.stopped().await }).await?);
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    tracing::info!("coordinator listening on {} ({})", listener.local_addr()?, security.summary());
    let service = CoordinatorService::new(Arc::clone(run), stages.clone());
    let service = InterceptedService::new(CoordinatorServer::new(service), security.server_auth());
    let server = security
        // A request that is not complete within the RPC timeout (a
        // half-sent body) is answered CANCELLED; streams the server
        // sends (WatchEvents) are not affected. Keepalives find dead
        // connections.
        .server(
            tonic::transport::Server::builder()
                .timeout(Duration::from_millis(run.config.faults.rpc_timeout_ms))
                .http2_keepalive_interval(Some(Duration::from_secs(10)))
                .http2_keepalive_timeout(Some(Duration::from_secs(20))),
        )?
        .trace_fn(|req| dflash_telemetry::rpc_span(req.uri().path()))
        .add_service(health_service)
        .add_service(service)
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async move {
            stop.stopped().await
        });
    stages.spawn_task("grpc", async move { server.await.context("coordinator gRPC server") });
    Ok(())
}

/// Every 200 ms: the flow sampled, alarms exported (each logged when
/// raised and when cleared), liveness checked; every 30 s the ledger's
/// counts and the flow logged. Until stop.
async fn monitor(run: Arc<Run>, stop: Stop) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut last_log = std::time::Instant::now();
    let mut raised: Vec<String> = Vec::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.stopped() => return Ok(()),
        }
        let flow = run.sample_flow();
        let alarms = run.export_metrics();
        let name = |a: &String| a.split(':').next().unwrap_or_default().to_string();
        for a in alarms.iter().filter(|a| !raised.iter().any(|r| name(r) == name(a))) {
            tracing::error!("ALARM {a}");
        }
        for r in raised.iter().filter(|r| !alarms.iter().any(|a| name(a) == name(r))) {
            tracing::info!("alarm {} cleared", name(r));
        }
        raised = alarms;
        if let Err(e) = run.check_liveness() {
            run.end(dflash_proto::RunState::Failed, format!("ledger failure: {e}"));
        }
        if last_log.elapsed() > Duration::from_secs(30) && run.is_running() {
            let c = run.counts();
            tracing::info!(
                "ledger: {} pending, {} leased, {} sent, {} trained, {} committed of {}",
                c.pending,
                c.leased,
                c.sent,
                c.trained,
                c.committed,
                c.total()
            );
            tracing::info!("{flow}");
            last_log = std::time::Instant::now();
        }
    }
}

/// Until the run ends (then every live instance hears of it first) or the
/// process is told to stop.
async fn wait_for_end(run: &Run, stop: &Stop) {
    tokio::select! {
        _ = run.ended.cancelled() => {
            // Every live instance hears of the end (its event stream, or
            // its next heartbeat) before the server goes; and the server
            // answers for a moment longer, so that a role a supervisor
            // restarts just now hears that the run is over instead of
            // waiting out its connect timeout for a coordinator that left.
            let linger = tokio::time::sleep(END_LINGER);
            let heartbeat = Duration::from_millis(run.config.faults.heartbeat_interval_ms);
            run.wait_until_all_told((heartbeat * 3).max(END_LINGER)).await;
            linger.await;
        }
        _ = stop.stopped() => {
            tracing::info!("coordinator stopping; the ledger keeps the run resumable");
        }
    }
}
