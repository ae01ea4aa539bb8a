//! `dflash-drafter`: the drafter service. Receives hidden-state batches from
//! targets, queues and prefetches them, trains the DFlash drafter and
//! checkpoints it.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use dflash_models::blocks::BlockSettings;
use dflash_models::collective::Collective;
use dflash_models::optim::{AdamWSettings, LrSchedule};
use dflash_models::{Drafter, DrafterConfig, LayerType, TrainSettings, Trainer};
use dflash_proto as pb;
use dflash_role::{Announce, KindExt, RoleArgs, Session, Stages, Stop, StopCause, registration_failed};
use dflash_telemetry::ErrorKind;
use tonic_health::ServingStatus;

use dflash_drafter::receiver::{self, DrafterService, Expected, Landing};
use dflash_drafter::{device_health, group};
use dflash_models::features::kind_of;
use dflash_wire::DType;
use dflash_wire::rpc::{HiddenStateService, transport};

#[derive(Parser, Debug)]
#[command(name = "dflash-drafter", version, about = "The dflash drafter service")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Join a run: receive target features, train, checkpoint.
    Serve(ServeArgs),
    /// Check a gRPC server's grpc.health.v1 status; exit 0 when SERVING.
    Health(dflash_role::HealthArgs),
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    #[command(flatten)]
    role: RoleArgs,
    /// Address for the hidden-state stream and grpc.health.v1.
    #[arg(long, env = "DFLASH_LISTEN", default_value = "0.0.0.0:50052")]
    listen: SocketAddr,
    /// URL targets use to reach this drafter (default: http(s)://<hostname>:<port>;
    /// a port of 0 stands for the port bound).
    #[arg(long, env = "DFLASH_ADVERTISE")]
    advertise: Option<String>,
    /// Also serve grpc.health.v1 in plain text here (for probes that cannot
    /// speak TLS or send the token).
    #[arg(long, env = "DFLASH_HEALTH_LISTEN")]
    health_listen: Option<SocketAddr>,
    /// CPU threads for libtorch (0: libtorch's default).
    #[arg(long, env = "DFLASH_THREADS", default_value_t = 0)]
    threads: i32,
}

mod start;

fn main() {
    // SAFETY: first thing in main, before any other thread exists.
    unsafe { dflash_models::cuda::fix_cublas_workspace() };
    dflash_telemetry::init("dflash-drafter");
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Health(h) => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            rt.block_on(h.run())
        }
        Command::Serve(args) => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
            rt.block_on(serve(args))
        }
    };
    std::process::exit(code);
}

async fn serve(args: ServeArgs) -> i32 {
    if args.threads > 0 {
        tch::set_num_threads(args.threads);
    }
    let stop = Stop::new();
    // Every thread and task of the role is one of its stages.
    let stages = Stages::new(stop.clone());
    stages.spawn_task("signals", stop.on_signals());
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot listen on {}: {e}", args.listen);
            return 1;
        }
    };
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(args.listen.port());
    // An advertised port 0 is the port just bound (`--listen ...:0`).
    let advertise = args.advertise.as_ref().map(|a| match a.strip_suffix(":0") {
        Some(base) => format!("{base}:{port}"),
        None => a.clone(),
    });
    let endpoint = advertise.unwrap_or_else(|| {
        let host = hostname::get().map(|h| h.to_string_lossy().into_owned()).unwrap_or_else(|_| "127.0.0.1".into());
        let scheme = if args.role.security.tls_cert.is_some() { "https" } else { "http" };
        format!("{scheme}://{host}:{port}")
    });
    let announce = Announce { role: pb::Role::Drafter, devices: vec![], endpoint: endpoint.clone() };
    let session = match Session::register(&args.role, announce, stop.clone()).await {
        Ok(s) => s,
        Err(e) => return registration_failed(&e, &stop),
    };
    session.log_config();
    let result = match session.serve_metrics(&args.role, &stages).await {
        Ok(()) => start::start(&session, &stages, listener, &endpoint, args.health_listen).await,
        Err(e) => Err(e),
    };
    if result.is_ok() {
        stop.stopped().await;
    } else {
        stop.stop(StopCause::Fatal("startup failed".into()));
    }
    stages.join(Duration::from_millis(session.config.faults.shutdown_grace_ms)).await;
    let result = result.and(stages.take_error().map_or(Ok(()), Err));
    session.finish(result).await
}

/// The run's plan from the coordinator: what every batch must hold, page
/// after page (each RPC under its deadline).
async fn fetch_plan(session: &Session) -> anyhow::Result<receiver::Plan> {
    let (mut plan, mut from_batch_id) = (receiver::Plan::new(), 0);
    loop {
        let req = pb::GetPlanRequest {
            run_id: session.run_id.clone(),
            instance_id: session.instance_id.clone(),
            generation: 0,
            from_batch_id,
            from_assigned: 0,
        };
        let page = dflash_role::with_timeout(session.rpc_timeout(), session.client().get_plan(req))
            .await
            .map_err(|s| anyhow::anyhow!("fetching the run's plan (from batch {from_batch_id}): {}", s.message()))
            .kind(ErrorKind::PeerLost)?;
        let last = page.batches.last().map(|b| b.batch_id);
        for b in page.batches {
            let planned =
                receiver::Planned { epoch: b.epoch, sample_ids: b.sample_ids, sample_lengths: b.sample_lengths };
            plan.insert(b.batch_id, planned);
        }
        match (page.plan_complete, last) {
            (true, _) => {
                tracing::info!("plan: {} batches ({})", plan.len(), page.fingerprint);
                return Ok(plan);
            }
            (false, Some(last)) => from_batch_id = last + 1,
            (false, None) => anyhow::bail!("the coordinator sent an empty, incomplete page of the plan"),
        }
    }
}

/// A libtorch device as the config names it ("cpu", "cuda:1").
fn device_name(d: tch::Device) -> String {
    match d {
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

/// The batches the coordinator dealt out to this member of `generation`,
/// each with the rank (one of its replicas) that trains it (ready once rank
/// 0 has resumed, which it has when the members met).
async fn fetch_assignment(session: &Session, generation: u64) -> anyhow::Result<Vec<(u64, usize)>> {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(session.config.group.collective_timeout_ms);
    let what = format!("asking for generation {generation}'s batches (group.collective_timeout_ms)");
    // The list comes in pages: each answer adds one, and the next call asks
    // from where it ended.
    let got: Arc<std::sync::Mutex<Vec<(u64, usize)>>> = Default::default();
    let batches = group::ask_until(session, &what, Some(deadline), || {
        let got = Arc::clone(&got);
        let from_assigned = got.lock().unwrap_or_else(|p| p.into_inner()).len() as u64;
        let req = pb::GetPlanRequest {
            run_id: session.run_id.clone(),
            instance_id: session.instance_id.clone(),
            generation,
            from_batch_id: 0,
            from_assigned,
        };
        let mut client = session.client();
        async move {
            let p = dflash_role::with_timeout(session.rpc_timeout(), client.get_plan(req)).await?;
            if !p.assignment_ready {
                return Ok(None);
            }
            if p.assigned_ranks.len() != p.assigned_batch_ids.len() {
                return Ok(Some(Err(anyhow::anyhow!(
                    "the coordinator dealt {} batch(es) with {} rank(s)",
                    p.assigned_batch_ids.len(),
                    p.assigned_ranks.len()
                ))));
            }
            if !p.assigned_complete && p.assigned_batch_ids.is_empty() {
                return Ok(Some(Err(anyhow::anyhow!("the coordinator sent an empty, incomplete page of the deal"))));
            }
            let mut got = got.lock().unwrap_or_else(|p| p.into_inner());
            got.extend(p.assigned_batch_ids.into_iter().zip(p.assigned_ranks.into_iter().map(|r| r as usize)));
            // Not complete: the next page at once.
            Ok(p.assigned_complete.then(|| Ok(std::mem::take(&mut *got))))
        }
    })
    .await;
    // Dealt out in time or not at all (a lost peer: the caller decides
    // whether that ends a generation); a refusal or the run's end is what it is.
    batches.and_then(|dealt| dealt.kind(ErrorKind::Protocol))
}

/// The generation this member trains in cannot go on (a member lost, a
/// collective that failed or timed out): the role stops to join the next
/// one (exit code 75), rather than failing the run.
fn reform(session: &Session, e: anyhow::Error) -> anyhow::Error {
    session.stop.stop(StopCause::GroupReform(dflash_role::format_chain(&e)));
    e
}

/// How a member's training ended: a lost peer or a device error in a
/// collective ends this generation (the role leaves to join the next);
/// anything else is what it is.
fn member_ends(session: &Session, result: anyhow::Result<()>, device: tch::Device) -> anyhow::Result<()> {
    match result {
        Err(e) if matches!(dflash_role::kind_of(&e), ErrorKind::PeerLost | ErrorKind::Device) => {
            // This member's own device failing is not the group's problem:
            // it leaves for good (exit 76) instead of re-forming forever.
            if let Some(lost) = device_health::lost_after_error(session, &[device], &e) {
                return Err(lost);
            }
            tracing::warn!("leaving the drafter group: {}", dflash_role::format_chain(&e));
            reform(session, e);
            Ok(())
        }
        other => other,
    }
}

/// Gives every replica rank 0's weights and optimizer state.
fn sync_replica(g: &dyn Collective, t: &Trainer) -> anyhow::Result<()> {
    let tensors = t.state_tensors();
    g.broadcast_from_rank0(&tensors).kind(ErrorKind::Device)
}

/// Builds the trainer from the run config and the target's embeddings.
fn build_trainer(session: &Session, device: tch::Device) -> anyhow::Result<Trainer> {
    let c = &session.config;
    let kind = kind_of(DType::compute(c.model.dtype, device.is_cuda()));
    let target_dir = c.model.target_dir().map_err(|e| anyhow::anyhow!(e)).kind(ErrorKind::Config)?;
    let (target, embed, lm_head) = dflash_models::load_embeddings(&target_dir, device, kind).kind(ErrorKind::Model)?;
    let mask = c.drafter.mask_token_id.context("drafter.mask_token_id is unresolved").kind(ErrorKind::Config)?;
    let mut dc = DrafterConfig::for_target(
        &target,
        c.drafter.num_layers as i64,
        c.drafter.block_size() as i64,
        mask as i64,
        c.model.target_layer_ids.iter().map(|&i| i as i64).collect(),
    );
    dc.layer_types = c
        .drafter
        .layer_types
        .iter()
        .flatten()
        .map(|t| match t {
            dflash_config::DrafterLayerType::FullAttention => LayerType::FullAttention,
            dflash_config::DrafterLayerType::SlidingAttention => LayerType::SlidingAttention,
        })
        .collect();
    dc.sliding_window = c.drafter.sliding_window.map(i64::from);
    dc.dflash2 = c.drafter.dflash2().map(|v| dflash_models::dflash2::Dflash2Config {
        conv_kernel_size: v.conv_kernel_size.into(),
        conv_group_size: v.conv_group_size.into(),
        selector_rank: v.selector_rank.into(),
        selector_top_k: v.selector_top_k.into(),
    });
    tch::manual_seed(c.run.seed as i64);
    let mut drafter = Drafter::new(dc, device, kind);
    if c.drafter.init_from_target_layers {
        let n = drafter.init_from_target(&target_dir).kind(ErrorKind::Model)?;
        tracing::info!("initialised {n} drafter tensors from the target's top layers");
    }
    if let Some(init) = &c.drafter.init_from {
        drafter.load_weights(Path::new(init)).kind(ErrorKind::Checkpoint)?;
        tracing::info!("initialised the drafter from {init}");
    }
    drafter.set_f32_residual(c.training.f32_residual);
    drafter
        .set_fp8_matmuls(c.training.precision == dflash_config::Precision::Fp8)
        .map_err(anyhow::Error::from)
        .kind(ErrorKind::Config)?;
    let params: i64 = drafter.named_parameters().iter().map(|(_, t)| t.numel() as i64).sum();
    tracing::info!(
        "drafter: {} layers, hidden {}, {params} parameters, {kind:?} on {device:?}",
        c.drafter.num_layers,
        target.hidden_size
    );
    let t = &c.training;
    if drafter.uses_split_attention() {
        tracing::info!(
            "block attention: split (two mask-free flash calls merged by log-sum-exp), context prefixes shared by groups of {} blocks",
            t.attention_chunk_blocks
        );
    } else {
        tracing::info!("block attention: chunked mask, {} blocks per attention call", t.attention_chunk_blocks);
    }
    let settings = TrainSettings {
        blocks: BlockSettings {
            block_size: c.drafter.block_size() as usize,
            mask_token_id: mask as i64,
            // D-PACE weighs slots itself: only which slots count matters then.
            gamma: match t.loss {
                dflash_config::Objective::Dpace => 1.0,
                _ => c.drafter.effective_gamma().context("drafter.gamma is unresolved")?,
            },
            anchors_per_sequence: t.anchors_per_sequence as usize,
        },
        schedule: LrSchedule::new(t.lr, t.total_steps, t.warmup_ratio, t.min_lr_ratio),
        adamw: AdamWSettings {
            beta1: t.adam_beta1,
            beta2: t.adam_beta2,
            eps: t.adam_eps,
            weight_decay: t.weight_decay,
        },
        grad_clip: t.grad_clip,
        max_blocks_per_micro_batch: t.max_blocks_per_micro_batch as usize,
        loss_chunk_blocks: t.loss_chunk_blocks as usize,
        attention_chunk_blocks: t.attention_chunk_blocks as usize,
        context_pad_multiple: t.context_pad_multiple as usize,
        seed: c.run.seed,
        selector_loss_weight: t.selector_loss_weight.unwrap_or(dflash_config::DEFAULT_SELECTOR_LOSS_WEIGHT),
        objective: match t.loss {
            dflash_config::Objective::Ce => dflash_models::Objective::CrossEntropy,
            dflash_config::Objective::Dpace => {
                dflash_models::Objective::Dpace { alpha: t.dpace_alpha.unwrap_or(dflash_config::DEFAULT_DPACE_ALPHA) }
            }
            dflash_config::Objective::Kd => dflash_models::Objective::Distill,
        },
    };
    Ok(Trainer::new(drafter, embed, lm_head, settings))
}

/// The data plane: landing buffers for received payloads (pinned on a GPU),
/// the hidden-state service that checks each batch against `expected` and
/// queues it on `queue`, its health service, and the gRPC server on
/// `listener`, spawned as stages.
#[allow(clippy::too_many_arguments)]
async fn serve_targets(
    session: &Arc<Session>,
    stages: &Stages,
    device: tch::Device,
    expected: Expected,
    max_payload: usize,
    queue: flume::Sender<dflash_drafter::pipeline::Arrival>,
    listener: tokio::net::TcpListener,
    health_listen: Option<SocketAddr>,
) -> anyhow::Result<()> {
    let c = &session.config;
    let stop = session.stop.clone();
    // Payloads live in: the HS queue, prefetch, the train step, and the
    // batches being received; the extra room keeps receiving while the
    // queue is full.
    let n = c.pipeline.hs_queue_depth as usize + 4;
    let landing = match device {
        tch::Device::Cuda(i) => {
            let ctx = dflash_models::gpu::context(i).kind(ErrorKind::Device)?;
            Landing::Pinned(dflash_models::gpu::pinned_pool(&ctx, n, max_payload).kind(ErrorKind::Device)?)
        }
        _ => Landing::host(n),
    };
    tracing::info!("{n} {landing} for received payloads of up to {} MiB", max_payload >> 20);
    let service = DrafterService {
        landing,
        run_id: session.run_id.clone(),
        instance_id: session.instance_id.clone(),
        credits: c.pipeline.max_inflight_batches,
        expected,
        max_payload_bytes: max_payload,
        queue,
        stop: stop.clone(),
        hello_timeout: session.rpc_timeout(),
        stall_timeout: Duration::from_millis(c.faults.stream_stall_timeout_ms),
        streams: Arc::new(tokio::sync::Semaphore::new(c.pipeline.max_target_streams as usize)),
        max_streams: c.pipeline.max_target_streams as usize,
        stages: stages.clone(),
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status("", ServingStatus::Serving).await;
    health.set_serving::<HiddenStateService<DrafterService>>().await;
    if let Some(addr) = health_listen {
        stages.spawn_task("health", dflash_role::serve_health(addr, health_service.clone(), stop.clone()));
    }
    let server_stop = stop.clone();
    let server = session
        .security
        .server(transport::data_server())?
        .add_service(health_service)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            HiddenStateService::new(service),
            session.security.server_auth(),
        ))
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async move {
            server_stop.stopped().await
        });
    stages.spawn_task("grpc", async move { server.await.context("drafter gRPC server") });
    Ok(())
}

/// What a member of a group of several ranks trains: its stores of the
/// rendezvous (one per replica), the batches the coordinator dealt to its
/// ranks in the plan's order, and the lane (replica) of each.
struct Dealt {
    stores: Vec<dflash_models::gloo::GroupStore>,
    order: Vec<u64>,
    lanes: std::collections::HashMap<u64, usize>,
}

/// The rendezvous of this member's ranks and the batches dealt to them.
async fn dealt_batches(
    session: &Arc<Session>,
    membership: &group::Membership,
    own_host: &str,
) -> anyhow::Result<Dealt> {
    // A member of several leaves its generation on a lost peer; a drafter
    // alone has no peer to lose and fails as it is.
    let leave = |e: anyhow::Error| if membership.members > 1 { reform(session, e) } else { e };
    let stores = group::rendezvous(session, membership, own_host).await.map_err(leave)?;
    let assigned = fetch_assignment(session, membership.generation)
        .await
        .map_err(|e| if dflash_role::kind_of(&e) == ErrorKind::PeerLost { leave(e) } else { e })?;
    let first = membership.rank;
    let mut lanes = std::collections::HashMap::with_capacity(assigned.len());
    for &(id, rank) in &assigned {
        if !membership.ranks().contains(&rank) {
            return Err(anyhow::anyhow!(
                "the coordinator dealt batch {id} to rank {rank}, not one of this member's ({:?})",
                membership.ranks()
            ))
            .kind(ErrorKind::Protocol);
        }
        lanes.insert(id, rank - first);
    }
    let order: Vec<u64> = assigned.iter().map(|&(id, _)| id).collect();
    tracing::info!(
        "ranks {:?} train {} batch(es) of the plan (first: {:?})",
        membership.ranks(),
        order.len(),
        order.first()
    );
    Ok(Dealt { stores, order, lanes })
}
