//! `dflash-target`: the target service (frozen forward with layer capture,
//! postprocess pool, hidden-state sender), its health check, and `inspect`,
//! which checks a model directory the way the service loads it. The tools
//! (prepare, regenerate, bench-capture) are `dflash` subcommands.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use dflash_config::{Device, DeviceList, RunConfig, group_name};
use dflash_models::features::kind_of;
use dflash_models::placement::{self, Placement};
use dflash_models::{Inspection, LoadScope, TargetModel};
use dflash_proto as pb;
use dflash_role::{Announce, DeviceExt, KindExt, RoleArgs, Session, Stages, Stop, format_chain, registration_failed};
use dflash_telemetry::ErrorKind;
use dflash_wire::FeatureSpec;

use dflash_target::forward::{self, ForwardLoop};
use dflash_target::leases::Leases;
use dflash_target::pipeline::{CapturePipeline, PipelineSettings};
use dflash_target::postprocess;
use dflash_target::router::Router;
use dflash_target::{inspect, sender, work};

#[derive(Parser, Debug)]
#[command(name = "dflash-target", version, about = "The dflash target service and target-side tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Join a run: lease work, run the target forward, stream features to the drafter.
    Serve(ServeArgs),
    /// Check a model directory: what it resolves to, what it needs, and (with --ids) its logits and layers.
    Inspect(inspect::InspectArgs),
    /// Check a gRPC server's grpc.health.v1 status; exit 0 when SERVING.
    Health(dflash_role::HealthArgs),
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    #[command(flatten)]
    role: RoleArgs,
    /// Address for grpc.health.v1 (liveness/readiness probes).
    #[arg(long, env = "DFLASH_HEALTH_LISTEN", default_value = "0.0.0.0:50061")]
    health_listen: SocketAddr,
    /// CPU threads for libtorch (0: libtorch's default).
    #[arg(long, env = "DFLASH_THREADS", default_value_t = 0)]
    threads: i32,
}

fn main() {
    dflash_telemetry::init("dflash-target");
    let cli = Cli::parse();
    let tool = match cli.command {
        Command::Health(h) => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            std::process::exit(rt.block_on(h.run()));
        }
        Command::Serve(a) => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
            std::process::exit(rt.block_on(serve(a)));
        }
        Command::Inspect(a) => inspect::run(&a),
    };
    if let Err(e) = tool {
        tracing::error!("{}", format_chain(&e));
        std::process::exit(1);
    }
}

async fn serve(args: ServeArgs) -> i32 {
    if args.threads > 0 {
        tch::set_num_threads(args.threads);
    }
    let stop = Stop::new();
    // Every thread and task of the role is one of its stages.
    let stages = Stages::new(stop.clone());
    stages.spawn_task("signals", stop.on_signals());
    let announce = Announce { role: pb::Role::Target, devices: vec![], endpoint: String::new() };
    let session = match Session::register(&args.role, announce, stop.clone()).await {
        Ok(s) => s,
        Err(e) => return registration_failed(&e, &stop),
    };
    session.log_config();
    let result = start(&session, &stages, &args).await;
    if result.is_ok() {
        stop.stopped().await;
    } else {
        stop.stop(dflash_role::StopCause::Fatal("startup failed".into()));
    }
    stages.join(Duration::from_millis(session.config.faults.shutdown_grace_ms)).await;
    let result = result.and(stages.take_error().map_or(Ok(()), Err));
    session.finish(result).await
}

/// Loads the models and starts every stage.
async fn start(session: &Arc<Session>, stages: &Stages, args: &ServeArgs) -> anyhow::Result<()> {
    let c = &session.config;
    let stop = session.stop.clone();
    stages.spawn_task("health", dflash_role::serve_health_only(args.health_listen, stop.clone()));
    session.serve_metrics(&args.role, stages).await?;
    let leases = Leases::new();
    let instances = c.devices.target.instances().to_vec();
    let stats = Arc::new(forward::ForwardStats::new(instances.len()));
    let (renew, load_stats) = (leases.clone(), Arc::clone(&stats));
    session.spawn_heartbeat(stages, move || renew.ids(), move || load_stats.load());
    let group = session.spawn_event_watch(stages);

    let dataset = Arc::new(tokio::task::block_in_place(|| work::load_dataset(session))?);
    let spec = FeatureSpec::of(c);
    let model_dir = c.model.target_dir().map_err(|e| anyhow::anyhow!(e)).kind(ErrorKind::Config)?;
    let inspection = check_model(&model_dir, &spec)?;
    let gpus = c.devices.target.cuda_indices();
    if !gpus.is_empty() {
        dflash_models::cuda::ensure_cuda(&gpus).kind(ErrorKind::Device)?;
        dflash_models::cuda::set_cudnn_attention(false);
    }
    let (work_tx, work_rx) = flume::bounded(instances.len());
    let (host_tx, host_rx) = flume::bounded(1);
    for group in &instances {
        let name = group_name(group);
        let instance = Instance { devices: group, model_dir: &model_dir, inspection: &inspection };
        let fl = instance_pipeline(session, stages, &instance, &spec, &stats, &host_tx).on_device(&name)?;
        let (rx, s) = (work_rx.clone(), stop.clone());
        stages.spawn_thread(&format!("forward-{name}"), move || fl.run(rx, s).on_device(name));
    }
    drop(host_tx);
    session.announce_devices(c.devices.target.devices().iter().map(ToString::to_string).collect()).await?;
    stages.spawn_task("lease", work::lease_loop(Arc::clone(session), dataset, leases, work_tx));
    // The in-flight limit is split across the streams.
    let streams = c.pipeline.streams_per_target as usize;
    let window = (c.pipeline.max_inflight_batches as usize).div_ceil(streams);
    let reports = sender::spawn_reporter(Arc::clone(session), stages);
    let router = Router { session: Arc::clone(session), stages: stages.clone(), group, streams, window, reports };
    stages.spawn_task("route", router.run(host_rx));
    Ok(())
}

/// Checks the model directory as loading it will (the config, every
/// tensor's name, shape and dtype, the shards) without reading a weight:
/// a bad model is refused, naming the file and tensor or field, before any
/// GPU work starts.
fn check_model(dir: &Path, spec: &FeatureSpec) -> anyhow::Result<Inspection> {
    let last_layer =
        spec.layer_ids.iter().map(|&i| i as i64).max().ok_or_else(|| anyhow::anyhow!("no captured layers"))?;
    let scope = load_scope(spec, last_layer);
    tokio::task::block_in_place(|| TargetModel::inspect(dir, kind_of(spec.dtype), scope)).kind(ErrorKind::Model)
}

/// One target instance to start: its devices and the model it holds.
struct Instance<'a> {
    devices: &'a DeviceList,
    model_dir: &'a Path,
    inspection: &'a Inspection,
}

/// The split of an instance's layers over its devices, planned from the
/// checkpoint's headers, the batch size and the devices' free memory
/// before any weight is read: a model that does not fit is refused, naming
/// what it needs and what the devices have.
fn plan_instance(
    c: &RunConfig,
    i: &Instance,
    devices: &[tch::Device],
    spec: &FeatureSpec,
) -> anyhow::Result<Placement> {
    let (config, tokens) = (&i.inspection.config, c.pipeline.token_budget as u64);
    let elem = kind_of(spec.dtype).elt_size_in_bytes() as u64;
    let mut f = i.inspection.footprint.clone();
    f.workspace = placement::workspace_bytes(config, tokens, elem, spec.target_top_k > 0);
    // Batches whose captures are on the devices at once: the forward loop's,
    // the postprocess queue's and the worker's; and the feature cache. Each
    // captured layer stays on the device of its part, with its share of the
    // cache.
    let held = c.pipeline.target_postprocess_depth as u64 + 2;
    let cache = (c.pipeline.target_feature_cache_mib as u64) << 20;
    let ids: Vec<i64> = spec.layer_ids.iter().map(|&i| i as i64).collect();
    let captured = ids.len().max(1) as u64;
    f.capture(&ids, held * tokens * config.hidden_size as u64 * elem + cache.div_ceil(captured));
    let capacity = placement::capacities(devices);
    let plan = Placement::plan(devices, &f, Some(&capacity))
        .map_err(|e| anyhow::anyhow!("{}: {e}", i.model_dir.display()))
        .kind(ErrorKind::Model)?;
    let parts: Vec<String> = (plan.parts().iter().zip(plan.bytes(&f)).enumerate())
        .map(|(k, (p, need))| {
            let free = match capacity[k] {
                u64::MAX => " (free memory unknown)".to_string(),
                c => format!(" of {} free", placement::gib(c)),
            };
            let (from, to, on) = (p.layers.start, p.layers.end - 1, i.devices.devices()[k]);
            format!("layers {from}-{to} on {on} (needs {}{free})", placement::gib(need))
        })
        .collect();
    tracing::info!("target {}: {}", group_name(i.devices), parts.join("; "));
    Ok(plan)
}

/// What a target holds: the layers up to the last captured one, or all of
/// it (final norm and LM head included) when it ships distillation targets.
fn load_scope(spec: &FeatureSpec, last_layer: i64) -> LoadScope {
    if spec.target_top_k > 0 { LoadScope::Full } else { LoadScope::CaptureUpTo { last_layer } }
}

/// One instance's model (on its devices) and its capture pipeline (the
/// postprocess stage -- a worker, or inline at depth 0 -- feeding
/// `host_tx`, started here; the forward loop that drives it, returned).
/// Ids come in on the instance's first device; each captured layer leaves
/// from the device of the part that computed it.
fn instance_pipeline(
    session: &Session,
    stages: &Stages,
    instance: &Instance,
    spec: &FeatureSpec,
    stats: &Arc<forward::ForwardStats>,
    host_tx: &flume::Sender<postprocess::OutboundBatch>,
) -> anyhow::Result<ForwardLoop> {
    let c = &session.config;
    let name = group_name(instance.devices);
    let layer_ids: Vec<i64> = spec.layer_ids.iter().map(|&i| i as i64).collect();
    let last_layer = *layer_ids.iter().max().expect("resolved by the coordinator");
    let kind = kind_of(spec.dtype);
    let devices: Vec<tch::Device> = instance.devices.devices().iter().map(dflash_models::cuda::torch_device).collect();
    let cuda = match instance.devices.devices()[0] {
        Device::Cpu => None,
        Device::Cuda(i) => Some((dflash_models::gpu::context(i as usize).kind(ErrorKind::Device)?, i as usize)),
    };
    let plan = plan_instance(c, instance, &devices, spec)?;
    let dir = instance.model_dir.to_path_buf();
    let scope = load_scope(spec, last_layer);
    let model =
        tokio::task::block_in_place(|| TargetModel::load_placed(&dir, &plan, kind, scope)).kind(ErrorKind::Model)?;
    let top_k = spec.target_top_k;
    tracing::info!(
        "target {name}: loaded {} of {} layers of the {} target ({kind:?}), capturing {layer_ids:?}, {} layout{}",
        model.loaded_layers(),
        model.config.num_layers,
        dflash_models::zoo::architecture(model.config.family).hf_architecture(),
        spec.layout,
        if top_k > 0 { format!(", and its top-{top_k} next tokens for distillation") } else { String::new() },
    );
    let p = &c.pipeline;
    let settings = PipelineSettings {
        spec: spec.clone(),
        seed: c.run.seed,
        target_instance: session.instance_id.clone(),
        label: format!("target {name}"),
        postprocess_depth: p.target_postprocess_depth as usize,
        token_budget: p.token_budget as usize,
        // Payloads wait in: postprocess, the sender's queue, and the
        // unacknowledged window; one more so the pipeline never starves.
        pinned_buffers: (p.target_postprocess_depth.max(1) + p.max_inflight_batches + 2) as usize,
        feature_cache_bytes: (p.target_feature_cache_mib as usize) << 20,
    };
    let stop = session.stop.clone();
    let pipeline = CapturePipeline::build(model, cuda, settings, Arc::clone(stats), host_tx.clone(), stop.clone())?;
    if let Some(worker) = pipeline.postprocess {
        stages.spawn_thread(&format!("postprocess-{name}"), move || worker.run(stop).on_device(name));
    }
    Ok(pipeline.forward)
}
