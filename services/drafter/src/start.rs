//! The drafter's start, in its steps: the devices, one trainer per replica,
//! a place in the group (rank 0 resumes and leads), the batches this
//! member takes, the data plane, then per replica a prefetch stage and a
//! train thread fed by one sequencer.

use std::net::SocketAddr;
use std::sync::Arc;

use dflash_models::Trainer;
use dflash_models::collective::Collective;
use dflash_role::{DeviceExt, KindExt, Session, Stages, Stop};
use dflash_telemetry::ErrorKind;
use dflash_wire::FeatureSpec;

use dflash_drafter::pipeline::{Arrival, TrainedSet};
use dflash_drafter::prefetch::{self, Prefetcher};
use dflash_drafter::receiver::{self, Expected};
use dflash_drafter::reporter::Reporter;
use dflash_drafter::sequencer::{Lanes, Sequencer};
use dflash_drafter::train_loop::{GroupMember, PeriodicEval, ReplicaStep, TrainLoop, follow_member};
use dflash_drafter::{device_health, group};

use crate::{Dealt, build_trainer, dealt_batches, device_name, fetch_plan, member_ends, serve_targets, sync_replica};

pub(crate) async fn start(
    session: &Arc<Session>,
    stages: &Stages,
    listener: tokio::net::TcpListener,
    endpoint: &str,
    health_listen: Option<SocketAddr>,
) -> anyhow::Result<()> {
    let c = &session.config;
    session.spawn_heartbeat(stages, Vec::new, || (0, 0.0));
    let events = session.spawn_event_watch(stages);
    let tdevs = open_devices(session)?;
    // One trainer per replica; replica 0 leads (resumes, logs, checkpoints).
    let mut trainers = tdevs
        .iter()
        .map(|&d| tokio::task::block_in_place(|| build_trainer(session, d)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let kind = trainers[0].drafter().kind();
    let hidden = trainers[0].drafter().config.hidden_size;
    let vocab_size = trainers[0].drafter().config.vocab_size as u32;
    let (hs_tx, hs_rx) = flume::bounded(c.pipeline.hs_queue_depth as usize);
    let plan = Arc::new(fetch_plan(session).await?);

    // A place in the drafter group first, one rank per replica: rank 0
    // resumes and leads.
    let membership = group::join(session, tdevs.len()).await?;
    group::spawn_leave_watch(session, stages, events, &membership);
    // Resume before accepting batches, so the coordinator resets the work
    // this drafter will not have before any target sends it more.
    let leader = if membership.leads() {
        Some(lead(session, stages, trainers.remove(0), tdevs[0], kind, hs_tx.clone())?)
    } else {
        None
    };
    // Ranks of a larger group: the rendezvous, and the batches the
    // coordinator dealt out to each of this member's replicas.
    let own_host = group::own_host(&membership, endpoint);
    let in_group = membership.world > 1;
    let dealt = if in_group {
        dealt_batches(session, &membership, &own_host).await?
    } else {
        Dealt { stores: Vec::new(), order: plan.keys().copied().collect(), lanes: Default::default() }
    };
    let spec = FeatureSpec::of(c);
    let max_payload = spec.payload_bytes(c.pipeline.token_budget as usize, hidden as usize);
    let expected = Expected {
        spec: spec.clone(),
        hidden_size: hidden as u32,
        vocab_size,
        plan: batches_here(&plan, &dealt.order, in_group),
        run_id: session.run_id.clone(),
        lease_key: session.lease_key.clone().into(),
    };
    serve_targets(session, stages, tdevs[0], expected, max_payload, hs_tx, listener, health_listen).await?;
    tracing::info!("drafter listening for targets at {endpoint}");
    let devices = c.devices.drafter.devices();
    session.announce_devices(devices.iter().map(ToString::to_string).collect()).await?;

    // Per replica: a lane of the plan's order, a prefetch stage onto its
    // device and a train thread, in lockstep with every other rank of the
    // group (this member's and the others') when there are several.
    let trained = leader.as_ref().map_or_else(Default::default, TrainLoop::trained_set);
    let Dealt { stores, order, lanes } = dealt;
    let lane_rxs = spawn_sequencer(stages, hs_rx, order, trained.clone(), in_group.then_some(lanes), tdevs.len(), c);
    let mut roles = leader.map(Rank::Leader).into_iter().chain(trainers.into_iter().map(Rank::Follower));
    let mut stores = stores.into_iter();
    for ((lane, &device), input) in tdevs.iter().enumerate().zip(lane_rxs) {
        let replica = Replica {
            rank: membership.rank + lane,
            device,
            input,
            role: roles.next().expect("a trainer per replica"),
            store: stores.next(),
        };
        replica.spawn(session, stages, &membership, &own_host, &spec, kind, max_payload, &trained)?;
    }
    Ok(())
}

/// The drafter's devices, checked: CUDA loaded where named, deterministic
/// kernels if the run asks, and each device's probe passed (a device that
/// fails it keeps this member out of the group).
fn open_devices(session: &Session) -> anyhow::Result<Vec<tch::Device>> {
    let c = &session.config;
    let gpus = c.devices.drafter.cuda_indices();
    if !gpus.is_empty() {
        dflash_models::cuda::ensure_cuda(&gpus).kind(ErrorKind::Device)?;
        if c.training.deterministic_kernels {
            dflash_models::cuda::set_deterministic_algorithms(true);
            tracing::info!("deterministic kernels only (training.deterministic_kernels)");
        }
    }
    let tdevs: Vec<tch::Device> = c.devices.drafter.devices().iter().map(dflash_models::cuda::torch_device).collect();
    device_health::check_at_start(session, &tdevs).kind(ErrorKind::Device)?;
    Ok(tdevs)
}

/// Rank 0's train loop: its evaluation during training, the progress
/// reporter, and the resume from the ledger's committed checkpoint.
fn lead(
    session: &Arc<Session>,
    stages: &Stages,
    trainer: Trainer,
    device: tch::Device,
    kind: tch::Kind,
    hs_tx: flume::Sender<Arrival>,
) -> anyhow::Result<TrainLoop> {
    let c = &session.config;
    let eval = tokio::task::block_in_place(|| PeriodicEval::load(c, device, kind)).kind(ErrorKind::Config)?;
    let (reporter, delivery) = Reporter::start(Arc::clone(session));
    stages.spawn_task("report-progress", delivery);
    let rt = tokio::runtime::Handle::current();
    let mut train = TrainLoop::new(trainer, Arc::clone(session), rt, hs_tx, eval, reporter);
    tokio::task::block_in_place(|| train.resume())?;
    Ok(train)
}

/// The plan's batches this member takes: all of them alone, its own in a
/// group (another member's would break the step order).
fn batches_here(plan: &Arc<receiver::Plan>, order: &[u64], in_group: bool) -> Arc<receiver::Plan> {
    if in_group {
        Arc::new(order.iter().filter_map(|id| plan.get(id).map(|p| (*id, p.clone()))).collect())
    } else {
        Arc::clone(plan)
    }
}

/// The sequencer: arrivals in, each replica's lane out in the plan's order
/// (in lockstep with the group's other ranks when dealt). Returns each
/// replica's lane.
fn spawn_sequencer(
    stages: &Stages,
    hs_rx: flume::Receiver<Arrival>,
    order: Vec<u64>,
    trained: TrainedSet,
    dealt: Option<std::collections::HashMap<u64, usize>>,
    replicas: usize,
    c: &dflash_config::RunConfig,
) -> Vec<flume::Receiver<Arrival>> {
    let mut sequencer = Sequencer::new(order, trained, c.pipeline.reorder_window as usize);
    if dealt.is_some() {
        sequencer = sequencer.in_lockstep();
    }
    let (lane_txs, lane_rxs): (Vec<_>, Vec<_>) = (0..replicas).map(|_| flume::bounded(1)).unzip();
    let lanes = match dealt {
        Some(by_batch) => Lanes::dealt(lane_txs, by_batch),
        None => Lanes::single(lane_txs.into_iter().next().expect("one device at least")),
    };
    let stop = stages.stop().clone();
    stages.spawn_thread("sequencer", move || {
        sequencer.run(hs_rx, lanes, stop);
        Ok(())
    });
    lane_rxs
}

/// The pinned-to-device copy landing of a GPU replica (None on a CPU):
/// prefetch depth + 2 device buffers of the largest payload and a side
/// stream for the copies.
fn gpu_landing(
    device: tch::Device,
    c: &dflash_config::RunConfig,
    max_payload: usize,
) -> anyhow::Result<Option<prefetch::GpuLanding>> {
    let tch::Device::Cuda(i) = device else { return Ok(None) };
    let ctx = dflash_models::gpu::context(i).kind(ErrorKind::Device)?;
    let bufs = (0..c.pipeline.prefetch_depth as usize + 2)
        .map(|_| dflash_models::gpu::DeviceBuf::new(&ctx, max_payload))
        .collect::<Result<Vec<_>, _>>()
        .kind(ErrorKind::Device)?;
    let stream = dflash_models::gpu::side_stream(&ctx).kind(ErrorKind::Device)?;
    Ok(Some(prefetch::GpuLanding { ordinal: i, stream, buffers: dflash_models::gpu::Pool::new(bufs) }))
}

/// One replica of this member: its rank, device, lane from the sequencer,
/// what it is (leader or follower) and its group store (in a group).
struct Replica {
    rank: usize,
    device: tch::Device,
    input: flume::Receiver<Arrival>,
    role: Rank,
    store: Option<dflash_models::gloo::GroupStore>,
}

impl Replica {
    /// Spawns the replica's prefetch stage and train thread.
    #[allow(clippy::too_many_arguments, reason = "what every replica of the member shares")]
    fn spawn(
        self,
        session: &Arc<Session>,
        stages: &Stages,
        membership: &group::Membership,
        own_host: &str,
        spec: &FeatureSpec,
        kind: tch::Kind,
        max_payload: usize,
        trained: &TrainedSet,
    ) -> anyhow::Result<()> {
        let c = &session.config;
        let Replica { rank, device, input, role, store } = self;
        let (pf_tx, pf_rx) = flume::bounded(c.pipeline.prefetch_depth as usize);
        let pf = Prefetcher {
            device,
            kind,
            spec: spec.clone(),
            seed: c.run.seed,
            gpu: gpu_landing(device, c, max_payload)?,
            stop: stages.stop().clone(),
        };
        let s = stages.stop().clone();
        stages
            .spawn_thread(&format!("prefetch-{rank}"), move || pf.run(input, pf_tx, s).on_device(device_name(device)));
        let step = ReplicaStep {
            input: pf_rx,
            group: None,
            trained: trained.clone(),
            device,
            check_every: c.checkpoint.interval_steps,
            member: session.instance_id.clone(),
            group_member: None,
        };
        let (m, host, s, sess) = (membership.clone(), own_host.to_string(), stages.stop().clone(), Arc::clone(session));
        stages.spawn_thread(&format!("train-{rank}"), move || {
            let trained = train_replica(role, step, store, &m, rank, &host, device, s);
            // In a group of several members, a lost peer or a failed
            // collective ends this generation, not the run. A drafter alone
            // (however many devices) fails as any process does: its replicas
            // live and die together.
            if m.members > 1 { member_ends(&sess, trained, device) } else { trained }.on_device(device_name(device))
        });
        Ok(())
    }
}

/// A replica's train thread: in a group, its collective first and the
/// leader's state taken; then the leader's loop or a follower's.
#[allow(clippy::too_many_arguments, reason = "the replica's parts, moved into its thread")]
fn train_replica(
    mut role: Rank,
    mut step: ReplicaStep,
    store: Option<dflash_models::gloo::GroupStore>,
    m: &group::Membership,
    rank: usize,
    host: &str,
    device: tch::Device,
    stop: Stop,
) -> anyhow::Result<()> {
    if let Some(store) = store {
        let g = group::collective(store, m, rank, host, device, &stop)?;
        role.join_group(g.as_ref(), device)?;
        if rank == 0 {
            tracing::info!("data-parallel training on {} rank(s) of {} member(s) (rank 0 leads)", m.world, m.members);
        }
        step.group = Some(g);
        step.group_member = Some(GroupMember::new(m.names.clone()));
    }
    match role {
        Rank::Leader(train) => train.run(step),
        Rank::Follower(trainer) => follow_member(trainer, step, stop),
    }
}

/// What one replica's train thread is: rank 0 leads (resumes, reports,
/// checkpoints); every other rank follows in lockstep.
#[allow(clippy::large_enum_variant, reason = "made once per replica and moved into its thread")]
enum Rank {
    Leader(TrainLoop),
    Follower(Trainer),
}

impl Rank {
    /// Takes rank 0's weights, optimizer state and step: every rank then
    /// steps from the same state.
    fn join_group(&mut self, g: &dyn Collective, device: tch::Device) -> anyhow::Result<()> {
        let trainer = match self {
            Rank::Leader(train) => train.trainer(),
            Rank::Follower(t) => &*t,
        };
        sync_replica(g, trainer)?;
        let own = if g.rank() == 0 { trainer.step() as f64 } else { 0.0 };
        let step = g.agree(&[own], device).kind(ErrorKind::PeerLost)?[0] as u64;
        if let Rank::Follower(t) = self {
            t.set_step(step);
        }
        Ok(())
    }
}
