//! `dflash`: the one-machine launcher and operator commands.
//!
//! `dflash up` starts the coordinator, a target and a drafter as separate
//! processes on loopback ports with one config, streams their logs with a
//! role prefix, and stops them together (Ctrl-C included).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use dflash_config::ConfigFlags;
use dflash_coordinator::launcher::{Launcher, UpArgs};
use dflash_proto as pb;
use dflash_role::{SecurityArgs, coordinator_client, format_chain, with_timeout};

#[derive(Parser, Debug)]
#[command(name = "dflash", version, about = "Train DFlash drafters online: one-machine runs and operator commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run coordinator, target and drafter on this machine with one config.
    Up {
        #[command(flatten)]
        config: ConfigFlags,
        #[command(flatten)]
        up: UpArgs,
    },
    /// Show a run's state: instances, ledger, progress, errors.
    Status {
        #[arg(long, env = "DFLASH_COORDINATOR", default_value = "http://127.0.0.1:50051")]
        coordinator: String,
        #[command(flatten)]
        security: SecurityArgs,
    },
    /// Stop a run: every role exits.
    Cancel {
        #[arg(long, env = "DFLASH_COORDINATOR", default_value = "http://127.0.0.1:50051")]
        coordinator: String,
        #[arg(long, default_value = "cancelled by an operator")]
        reason: String,
        #[command(flatten)]
        security: SecurityArgs,
    },
    /// Check a gRPC server's grpc.health.v1 status; exit 0 when SERVING.
    Health(dflash_role::HealthArgs),
}

fn main() -> ExitCode {
    dflash_telemetry::init_logging();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = rt.block_on(async {
        match cli.command {
            Command::Up { config, up } => Launcher::new(config, up)?.run().await,
            Command::Status { coordinator, security } => status(&coordinator, &security).await.map(|()| 0),
            Command::Health(h) => Ok(h.run().await),
            Command::Cancel { coordinator, reason, security } => {
                let mut c = coordinator_client(&coordinator, &security.load()?)?;
                with_timeout(std::time::Duration::from_secs(10), c.cancel_run(pb::CancelRunRequest { reason })).await?;
                Ok(0)
            }
        }
    });
    match result {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("dflash: {}", format_chain(&e));
            ExitCode::FAILURE
        }
    }
}

async fn status(coordinator: &str, security: &SecurityArgs) -> anyhow::Result<()> {
    let mut c = coordinator_client(coordinator, &security.load()?)?;
    let s = with_timeout(std::time::Duration::from_secs(10), c.status(pb::StatusRequest {})).await?;
    let state = pb::RunState::try_from(s.state).unwrap_or(pb::RunState::Unspecified);
    println!("run {}: {} {}", s.run_id, state.as_str_name(), s.state_message);
    if let Some(l) = &s.ledger {
        println!(
            "ledger: {} pending, {} leased, {} sent, {} trained, {} committed of {}",
            l.pending, l.leased, l.sent, l.trained, l.committed, l.total
        );
    }
    println!(
        "progress: step {} (committed {}), loss {:.4}, accuracy {:.3}, acceptance {:.2}",
        s.step, s.committed_step, s.loss, s.accuracy, s.acceptance_length
    );
    println!(
        "flow: supply {:.0} tokens/s, demand {:.0} tokens/s, bound by {}",
        s.supply_tokens_per_s, s.demand_tokens_per_s, s.bound_by
    );
    for i in &s.instances {
        let role = pb::Role::try_from(i.role).unwrap_or(pb::Role::Unspecified);
        println!(
            "  {:<8} {:<32} {:<6} pid {:<7} [{}] seen {} ms ago {}",
            role.name(),
            i.instance_id,
            if i.alive { "alive" } else { "dead" },
            i.pid,
            i.devices.join(","),
            i.last_seen_ms_ago,
            i.endpoint
        );
    }
    for e in &s.errors {
        println!("  error [{}] {}: {}", e.kind, e.instance_id, e.causes.join(": "));
    }
    Ok(())
}
