//! `dflash-coordinator`: loads and validates the run config once, plans the
//! work into the ledger, and serves the Coordinator API until the run ends.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use dflash_config::ConfigFlags;
use dflash_coordinator::ledger::Ledger;
use dflash_coordinator::plan::plan_run;
use dflash_coordinator::run::Run;
use dflash_coordinator::service::CoordinatorService;
use dflash_proto::coordinator_server::CoordinatorServer;
use dflash_role::{Stop, format_chain};
use tonic_health::ServingStatus;

#[derive(Parser, Debug)]
#[command(name = "dflash-coordinator", version, about = "The dflash coordinator service")]
struct Args {
    #[command(flatten)]
    config: ConfigFlags,
    /// Address to serve the Coordinator API and grpc.health.v1 on.
    #[arg(long, env = "DFLASH_LISTEN", default_value = "0.0.0.0:50051")]
    listen: SocketAddr,
    /// SQLite ledger of the run's work (default: runs/<run.name>.ledger.sqlite).
    /// Restarting with the same ledger resumes the run.
    #[arg(long, env = "DFLASH_LEDGER")]
    ledger: Option<PathBuf>,
}

fn main() {
    dflash_telemetry::init_logging();
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let code = runtime.block_on(async {
        match run(args).await {
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
    let plan = plan_run(config)?;
    let ledger_path =
        args.ledger.clone().unwrap_or_else(|| PathBuf::from(format!("runs/{}.ledger.sqlite", plan.config.run.name)));
    let mut ledger = Ledger::open(&ledger_path)?;
    let resumed = ledger.install_plan(&plan.fingerprint, &plan.batches)?;
    let run_id = match ledger.meta("run_id")? {
        Some(id) => id,
        None => {
            let id = format!("{}-{}", plan.config.run.name, &uuid::Uuid::new_v4().simple().to_string()[..8]);
            ledger.set_meta("run_id", &id)?;
            id
        }
    };
    let counts = ledger.counts()?;
    if resumed {
        tracing::info!(
            "resuming run {run_id} from ledger {}: {} of {} batches committed",
            ledger_path.display(),
            counts.committed,
            counts.total()
        );
    }
    tracing::info!(
        "coordinator effective run config (run {run_id}, from {}):\n{}",
        loader.describe_sources(),
        plan.config.to_string().lines().map(|l| format!("  {l}\n")).collect::<String>()
    );
    let run = Arc::new(Run::new(run_id.clone(), plan.config, ledger));
    if counts.total() > 0 && counts.committed == counts.total() {
        run.end(dflash_proto::RunState::Completed, "every batch was already committed".into());
    }

    let stop = Stop::new();
    stop.stop_on_signals();
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status("", ServingStatus::Serving).await;
    health.set_serving::<CoordinatorServer<CoordinatorService>>().await;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    tracing::info!("coordinator listening on {}", listener.local_addr()?);
    let service = CoordinatorServer::new(CoordinatorService { run: Arc::clone(&run) });
    let server_stop = stop.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(service)
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async move {
                server_stop.stopped().await
            }),
    );

    // Liveness checks until the run ends or the process is told to stop.
    let monitor_run = Arc::clone(&run);
    let monitor_stop = stop.clone();
    let monitor = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let mut last_log = std::time::Instant::now();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = monitor_stop.stopped() => return,
            }
            monitor_run.flow.lock().expect("flow lock").sample(std::time::Instant::now());
            if let Err(e) = monitor_run.check_liveness() {
                monitor_run.end(dflash_proto::RunState::Failed, format!("ledger failure: {e}"));
            }
            if last_log.elapsed() > Duration::from_secs(30) && monitor_run.is_running() {
                let c = monitor_run.counts();
                tracing::info!(
                    "ledger: {} pending, {} leased, {} sent, {} trained, {} committed of {}",
                    c.pending,
                    c.leased,
                    c.sent,
                    c.trained,
                    c.committed,
                    c.total()
                );
                tracing::info!("{}", monitor_run.flow.lock().expect("flow lock").summary());
                last_log = std::time::Instant::now();
            }
        }
    });

    tokio::select! {
        _ = run.ended.cancelled() => {
            // Let every watcher receive the stop before the server goes.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        _ = stop.stopped() => {
            tracing::info!("coordinator stopping; the ledger keeps the run resumable");
        }
    }
    stop.stop(dflash_role::StopCause::Signal("end of run"));
    monitor.abort();
    if tokio::time::timeout(Duration::from_secs(5), server).await.is_err() {
        tracing::warn!("server did not drain within 5 s");
    }
    let (state, message) = run.state();
    Ok(match state {
        dflash_proto::RunState::Completed | dflash_proto::RunState::Running => 0,
        _ => {
            tracing::error!("run {run_id} ended {}: {message}", state.as_str_name());
            1
        }
    })
}
