//! The Coordinator gRPC service.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use dflash_proto as pb;
use dflash_proto::coordinator_server::Coordinator;
use futures::Stream;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use dflash_proto::CoordinatorError;

use crate::ledger::{CheckpointRecord, LedgerError};

/// About this many bytes of plan per `GetPlan` response: far under gRPC's
/// 4 MiB message limit, however long the plan.
const PLAN_PAGE_BYTES: usize = 1 << 20;

/// A group member's assigned batches per `GetPlan` response (an id of up to
/// ten bytes and a rank of up to five each: at most about 1 MiB).
const ASSIGNED_PAGE: usize = 65_536;
use crate::run::{Run, StepFigures};

pub struct CoordinatorService {
    pub run: Arc<Run>,
    /// Owns the task behind each event stream (joined on shutdown).
    pub streams: dflash_role::Stages,
    /// One permit per open event stream ([`MAX_WATCHERS`]).
    pub watchers: Arc<tokio::sync::Semaphore>,
}

/// At most this many event streams at once: each role instance holds one,
/// each `dflash status --watch` another.
pub const MAX_WATCHERS: usize = 256;

impl CoordinatorService {
    pub fn new(run: Arc<Run>, streams: dflash_role::Stages) -> Self {
        Self { run, streams, watchers: Arc::new(tokio::sync::Semaphore::new(MAX_WATCHERS)) }
    }
}

/// The one place ledger errors become the coordinator's errors.
fn ledger_status(e: LedgerError) -> Status {
    match e {
        // A transition the ledger does not allow: the caller's state is
        // not the run's.
        LedgerError::Refused(why) => {
            tracing::warn!("refused: {why}");
            CoordinatorError::Refused(why).into()
        }
        e => {
            tracing::error!("{e}");
            CoordinatorError::Ledger(e.to_string()).into()
        }
    }
}

fn invalid(field: &str, why: impl std::fmt::Display) -> Status {
    CoordinatorError::InvalidRequest { field: field.into(), why: why.to_string() }.into()
}

impl CoordinatorService {
    fn check_run(&self, run_id: &str) -> Result<(), Status> {
        if run_id != self.run.run_id {
            return Err(CoordinatorError::WrongRun { got: run_id.into(), runs: self.run.run_id.clone() }.into());
        }
        Ok(())
    }

    /// Run id and a live, registered instance.
    fn check_instance(&self, run_id: &str, instance_id: &str) -> Result<(), Status> {
        self.check_run(run_id)?;
        if !self.run.touch(instance_id) {
            return Err(CoordinatorError::NotRegistered(instance_id.into()).into());
        }
        Ok(())
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::RunEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn register(&self, req: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let req = req.into_inner();
        if req.protocol_version != dflash_proto::PROTOCOL_VERSION {
            return Err(CoordinatorError::ProtocolVersion {
                got: req.protocol_version,
                speaks: dflash_proto::PROTOCOL_VERSION,
            }
            .into());
        }
        let role = pb::Role::try_from(req.role).unwrap_or(pb::Role::Unspecified);
        if !matches!(role, pb::Role::Target | pb::Role::Drafter) {
            return Err(invalid("role", format!("{} cannot register", role.name())));
        }
        dflash_proto::check_instance_id(&req.instance_id).map_err(|why| invalid("instance_id", why))?;
        for (field, value) in [("host", &req.host), ("version", &req.version), ("endpoint", &req.endpoint)] {
            if value.len() > 1024 || value.chars().any(char::is_control) {
                return Err(invalid(field, "has control characters or is too long"));
            }
        }
        if req.devices.len() > 64 || req.devices.iter().any(|d| d.len() > 64 || d.chars().any(char::is_control)) {
            return Err(invalid("devices", "must be at most 64 names of printable characters"));
        }
        let (state, message) = self.run.state();
        if state != pb::RunState::Running {
            return Err(CoordinatorError::RunOver { run_id: self.run.run_id.clone(), state, message }.into());
        }
        self.run.register(req);
        // Drafters check lease tokens with the key; targets only carry tokens.
        let lease_key = if role == pb::Role::Drafter { self.run.lease_key.clone().into() } else { Default::default() };
        Ok(Response::new(pb::RegisterResponse {
            run_id: self.run.run_id.clone(),
            config_toml: self.run.config_toml.clone(),
            heartbeat_interval_ms: self.run.config.faults.heartbeat_interval_ms as u32,
            lease_key,
        }))
    }

    async fn heartbeat(&self, req: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let req = req.into_inner();
        self.check_instance(&req.run_id, &req.instance_id)?;
        // Whoever missed the stop event (its stream was down) hears it here.
        if !self.run.is_running() {
            self.run.told_of_end(&req.instance_id);
            let (state, message) = self.run.state();
            return Err(CoordinatorError::RunOver { state, message, run_id: req.run_id }.into());
        }
        self.run
            .target_heartbeat(&req.instance_id, req.tokens_produced, req.busy_fraction, &req.held_batch_ids)
            .map_err(ledger_status)?;
        Ok(Response::new(pb::HeartbeatResponse {}))
    }

    async fn report_error(&self, req: Request<pb::ErrorReport>) -> Result<Response<pb::ReportErrorResponse>, Status> {
        let req = req.into_inner();
        self.check_run(&req.run_id)?;
        self.run.record_error(req);
        Ok(Response::new(pb::ReportErrorResponse {}))
    }

    type WatchEventsStream = EventStream;

    async fn watch_events(&self, req: Request<pb::WatchEventsRequest>) -> Result<Response<EventStream>, Status> {
        let req = req.into_inner();
        self.check_run(&req.run_id)?;
        let Ok(permit) = Arc::clone(&self.watchers).try_acquire_owned() else {
            return Err(CoordinatorError::TooManyWatchers { max: MAX_WATCHERS as u64 }.into());
        };
        let run = Arc::clone(&self.run);
        let mut rx = run.subscribe();
        let (tx, out) = mpsc::channel(16);
        let stop = self.streams.stop().clone();
        let is_stop = |ev: &pb::RunEvent| matches!(ev.event, Some(pb::run_event::Event::Stop(_)));
        let watcher = req.instance_id;
        self.streams.spawn_task("event-stream", async move {
            let _permit = permit;
            // The run's end is the stream's last event.
            let delivered = |last: bool| {
                if last {
                    run.told_of_end(&watcher);
                }
                last
            };
            for ev in run.snapshot_events() {
                let last = is_stop(&ev);
                if tx.send(Ok(ev)).await.is_err() || delivered(last) {
                    return Ok(());
                }
            }
            loop {
                let ev = tokio::select! {
                    r = rx.recv() => r,
                    _ = tx.closed() => return Ok(()),
                    _ = stop.stopped() => return Ok(()),
                };
                let evs = match ev {
                    Ok(ev) => vec![ev],
                    // A slow watcher missed events: send the current state.
                    Err(broadcast::error::RecvError::Lagged(_)) => run.snapshot_events(),
                    Err(broadcast::error::RecvError::Closed) => return Ok(()),
                };
                for ev in evs {
                    let last = is_stop(&ev);
                    if tx.send(Ok(ev)).await.is_err() || delivered(last) {
                        return Ok(());
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn cancel_run(&self, req: Request<pb::CancelRunRequest>) -> Result<Response<pb::CancelRunResponse>, Status> {
        let reason = req.into_inner().reason;
        let reason = if reason.is_empty() { "cancelled by an operator".to_string() } else { reason };
        self.run.end(pb::RunState::Cancelled, reason);
        Ok(Response::new(pb::CancelRunResponse {}))
    }

    async fn status(&self, _req: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        Ok(Response::new(self.run.status()))
    }

    async fn lease_work(&self, req: Request<pb::LeaseWorkRequest>) -> Result<Response<pb::LeaseWorkResponse>, Status> {
        let req = req.into_inner();
        self.check_instance(&req.run_id, &req.instance_id)?;
        // Nothing to lease now (work held back by the reorder window, or
        // all of it out with targets): the request waits, as long as its
        // caller allows, for the drafter's next step or a lease's return
        // instead of the target polling.
        let hold = Duration::from_millis(u64::from(req.max_wait_ms)).min(self.half_rpc_timeout());
        let held = self
            .wait_on(self.run.watch_work(), hold, |run| {
                if !run.is_running() {
                    return Ok(Some((Vec::new(), true)));
                }
                let leases = run.lease(&req.instance_id, req.max_batches.clamp(1, 64)).map_err(ledger_status)?;
                let c = run.counts();
                let exhausted = leases.is_empty() && c.pending + c.leased + c.sent == 0;
                Ok((!leases.is_empty() || exhausted).then_some((leases, exhausted)))
            })
            .await?;
        let (leases, exhausted) = held.unwrap_or_default();
        // After a hold the target asks again at once (and waits here
        // again); unheld, pending work held back by the reorder window comes
        // free with the drafter's next step: soon; nothing pending: later.
        let retry_after_ms = if !leases.is_empty() || exhausted || !hold.is_zero() {
            0
        } else if self.run.counts().pending > 0 {
            20
        } else {
            200
        };
        Ok(Response::new(pb::LeaseWorkResponse {
            retry_after_ms,
            exhausted,
            leases: leases
                .into_iter()
                .map(|(l, member, generation)| {
                    // The root of the batch's trace; the target continues it.
                    let span = dflash_telemetry::batch_span("lease", &Default::default(), l.batch_id);
                    dflash_telemetry::metrics().batches.with_label_values(&["leased"]).inc();
                    pb::WorkLease {
                        batch_id: l.batch_id,
                        epoch: l.epoch,
                        sample_ids: l.sample_ids,
                        sample_lengths: l.sample_lengths,
                        lease_expires_unix_ms: l.expires_ms,
                        trace_context: dflash_telemetry::context_of(&span),
                        generation,
                        drafter_instance: member.instance_id,
                        drafter_endpoint: member.endpoint,
                        lease_token: dflash_proto::lease_token::lease_token(
                            &self.run.lease_key,
                            &self.run.run_id,
                            l.batch_id,
                            &req.instance_id,
                        )
                        .into(),
                    }
                })
                .collect(),
        }))
    }

    async fn report_sent(
        &self,
        req: Request<pb::ReportSentRequest>,
    ) -> Result<Response<pb::ReportSentResponse>, Status> {
        let req = req.into_inner();
        self.check_instance(&req.run_id, &req.instance_id)?;
        if !self.run.is_group_member(&req.drafter_instance) {
            // Acknowledged by a drafter that is gone: the batches stay leased
            // and the target sends them again.
            tracing::warn!(
                "ignoring {} acknowledgement(s) from replaced drafter {}",
                req.batch_ids.len(),
                req.drafter_instance
            );
            return Err(CoordinatorError::NotCurrentDrafter(req.drafter_instance).into());
        }
        self.run.mark_sent(&req.instance_id, &req.batch_ids).map_err(ledger_status)?;
        Ok(Response::new(pb::ReportSentResponse {}))
    }

    async fn report_trained(
        &self,
        req: Request<pb::ReportTrainedRequest>,
    ) -> Result<Response<pb::ReportTrainedResponse>, Status> {
        let req = req.into_inner();
        self.check_instance(&req.run_id, &req.instance_id)?;
        if !self.run.is_current_drafter(&req.instance_id) {
            return Err(CoordinatorError::NotCurrentDrafter(req.instance_id).into());
        }
        let ids: Vec<u64> = req.batches.iter().map(|b| b.batch_id).collect();
        for b in req.batches.iter().filter(|b| b.skipped) {
            tracing::warn!("drafter skipped batch {}: {}", b.batch_id, b.skip_reason);
        }
        let figures = StepFigures {
            step: req.step,
            loss: req.loss,
            accuracy: req.accuracy,
            acceptance_length: req.acceptance_length,
            tokens: req.tokens,
            input_wait_fraction: req.input_wait_fraction,
        };
        let members: Vec<(u64, String)> =
            req.batches.iter().filter(|b| !b.member.is_empty()).map(|b| (b.batch_id, b.member.clone())).collect();
        self.run.record_trained(&req.instance_id, &ids, &members, &figures).map_err(ledger_status)?;
        Ok(Response::new(pb::ReportTrainedResponse { all_trained: self.run.all_trained() }))
    }

    async fn report_checkpoint(
        &self,
        req: Request<pb::ReportCheckpointRequest>,
    ) -> Result<Response<pb::ReportCheckpointResponse>, Status> {
        let req = req.into_inner();
        self.check_instance(&req.run_id, &req.instance_id)?;
        if !self.run.is_current_drafter(&req.instance_id) {
            return Err(CoordinatorError::NotCurrentDrafter(req.instance_id).into());
        }
        let record = (!req.content_hash.is_empty()).then(|| CheckpointRecord {
            step: req.step,
            name: checkpoint_name(&req.path),
            content_hash: req.content_hash.clone(),
        });
        let counts = if req.resumed {
            let (r, counts) = self
                .run
                .resume_drafter(&req.instance_id, record.as_ref(), &req.batch_ids, req.step)
                .map_err(ledger_status)?;
            tracing::info!(
                "drafter {} starts from step {} ({}); {} uncommitted batch(es) will be redone{}{}",
                req.instance_id,
                req.step,
                if req.path.is_empty() { "no checkpoint" } else { req.path.as_str() },
                r.redo,
                if r.uncommitted > 0 {
                    format!(", and {} committed after it (the newer checkpoints were not found intact)", r.uncommitted)
                } else {
                    String::new()
                },
                if r.newly_committed > 0 {
                    format!("; {} batch(es) of its unreported checkpoint are committed now", r.newly_committed)
                } else {
                    String::new()
                }
            );
            counts
        } else {
            let record = record.ok_or_else(|| invalid("content_hash", "is required in a checkpoint report"))?;
            let counts =
                self.run.commit_checkpoint(&req.instance_id, &record, &req.batch_ids).map_err(ledger_status)?;
            tracing::info!("checkpoint at step {} committed: {}", req.step, req.path);
            counts
        };
        let complete = counts.committed == counts.total();
        if complete {
            self.run.end(
                pb::RunState::Completed,
                format!("all {} batches trained and committed (step {})", counts.total(), req.step),
            );
        }
        Ok(Response::new(pb::ReportCheckpointResponse { run_complete: complete }))
    }

    async fn list_checkpoints(
        &self,
        req: Request<pb::ListCheckpointsRequest>,
    ) -> Result<Response<pb::ListCheckpointsResponse>, Status> {
        let req = req.into_inner();
        self.check_instance(&req.run_id, &req.instance_id)?;
        let records = self.run.checkpoints().map_err(ledger_status)?;
        Ok(Response::new(pb::ListCheckpointsResponse {
            checkpoints: records
                .into_iter()
                .map(|c| pb::CommittedCheckpoint { step: c.step, name: c.name, content_hash: c.content_hash })
                .collect(),
        }))
    }

    async fn get_plan(&self, req: Request<pb::GetPlanRequest>) -> Result<Response<pb::GetPlanResponse>, Status> {
        let req = req.into_inner();
        self.check_instance(&req.run_id, &req.instance_id)?;
        let fingerprint = self.run.plan_fingerprint().map_err(ledger_status)?;
        if req.generation == 0 {
            let (batches, plan_complete) =
                self.run.plan_page(req.from_batch_id, PLAN_PAGE_BYTES).map_err(ledger_status)?;
            return Ok(Response::new(pb::GetPlanResponse {
                fingerprint,
                plan_complete,
                batches: batches
                    .into_iter()
                    .map(|b| pb::PlannedBatch {
                        batch_id: b.batch_id,
                        epoch: b.epoch,
                        sample_ids: b.sample_ids,
                        sample_lengths: b.sample_lengths,
                    })
                    .collect(),
                ..Default::default()
            }));
        }
        // A member asking for its batches of a generation waits (within
        // half the RPC deadline) until they are dealt out.
        let (instance, generation) = (req.instance_id.clone(), req.generation);
        let assigned = self.wait_for_group(|run| Ok(run.assigned(&instance, generation))).await?;
        let page = assigned.as_deref().unwrap_or_default();
        let page = &page[(req.from_assigned as usize).min(page.len())..];
        let take = page.len().min(ASSIGNED_PAGE);
        let (assigned_batch_ids, assigned_ranks) = page[..take].iter().map(|&(id, rank)| (id, rank as u32)).unzip();
        Ok(Response::new(pb::GetPlanResponse {
            fingerprint,
            assignment_ready: assigned.is_some(),
            assigned_batch_ids,
            assigned_ranks,
            assigned_complete: take == page.len(),
            ..Default::default()
        }))
    }

    async fn join_group(&self, req: Request<pb::JoinGroupRequest>) -> Result<Response<pb::JoinGroupResponse>, Status> {
        let req = req.into_inner();
        self.check_instance(&req.run_id, &req.instance_id)?;
        let joined = self
            .wait_for_group(|run| {
                let joined = run
                    .join_group(&req.instance_id, req.generation, &req.store_address, req.replicas)
                    .map_err(ledger_status)?;
                Ok(match joined {
                    // Rank 0 needs no store address (it serves the store);
                    // the others wait until it published one.
                    Some(r) if r.rank == 0 || !r.store_address.is_empty() => Some(r),
                    // The caller's generation ended while it waited.
                    None if req.generation > 0 => Some(pb::JoinGroupResponse {
                        formed: false,
                        generation: run.generation(),
                        ..Default::default()
                    }),
                    _ => None,
                })
            })
            .await?;
        Ok(Response::new(joined.unwrap_or_default()))
    }
}

impl CoordinatorService {
    /// Runs `check` until it answers, the run ends or half the RPC deadline
    /// passes (None: ask again), waking whenever the drafter group moves
    /// rather than polling.
    async fn wait_for_group<T>(
        &self,
        mut check: impl FnMut(&Run) -> Result<Option<T>, Status>,
    ) -> Result<Option<T>, Status> {
        self.wait_on(self.run.watch_group(), self.half_rpc_timeout(), |run| {
            if !run.is_running() {
                let (state, message) = run.state();
                return Err(CoordinatorError::RunOver { state, message, run_id: run.run_id.clone() }.into());
            }
            check(run)
        })
        .await
    }

    /// Half the RPC deadline: the longest a request is held, well inside
    /// the caller's own deadline.
    fn half_rpc_timeout(&self) -> Duration {
        Duration::from_millis(self.run.config.faults.rpc_timeout_ms / 2)
    }

    /// Runs `check` whenever `moves` changes, until it answers, `hold`
    /// passes or the coordinator stops (None: the caller asks again): a
    /// request held open instead of a client polling, not delaying a
    /// shutdown. A zero `hold` checks once.
    async fn wait_on<T>(
        &self,
        mut moves: tokio::sync::watch::Receiver<u64>,
        hold: Duration,
        mut check: impl FnMut(&Run) -> Result<Option<T>, Status>,
    ) -> Result<Option<T>, Status> {
        let deadline = tokio::time::Instant::now() + hold;
        loop {
            // Marked seen before the check: a move after it wakes the wait.
            moves.borrow_and_update();
            if let Some(answer) = check(&self.run)? {
                return Ok(Some(answer));
            }
            tokio::select! {
                r = tokio::time::timeout_at(deadline, moves.changed()) => match r {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) | Err(_) => return Ok(None),
                },
                _ = self.streams.stop().stopped() => return Ok(None),
            }
        }
    }
}

/// The directory name of a checkpoint path (what the ledger records).
fn checkpoint_name(path: &str) -> String {
    std::path::Path::new(path).file_name().map_or_else(|| path.to_string(), |n| n.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Ledger;

    /// A coordinator service over a plan of `batches` one-sample batches,
    /// a drafter group of one formed and resumed at the start (so every
    /// batch is dealt out), and target `t` registered.
    fn service(batches: u64, reorder_window: u32, rpc_timeout_ms: u64) -> (tempfile::TempDir, CoordinatorService) {
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = Ledger::open(&dir.path().join("ledger.sqlite")).unwrap();
        let plan: Vec<_> = (0..batches)
            .map(|i| dflash_data::PlannedBatch { batch_id: i, epoch: 0, sample_ids: vec![i], sample_lengths: vec![9] })
            .collect();
        ledger.install_plan("fp", &plan).unwrap();
        let mut config = dflash_config::RunConfig::default();
        config.pipeline.reorder_window = reorder_window;
        config.faults.rpc_timeout_ms = rpc_timeout_ms;
        config.faults.lease_timeout_ms = 2_000;
        let replicas = config.devices.drafter.devices().len() as u32;
        let run = Arc::new(Run::new("run".into(), config, ledger, vec![7; 32]));
        let register = |id: &str, role: pb::Role| {
            run.register(pb::RegisterRequest { role: role as i32, instance_id: id.into(), ..Default::default() })
        };
        register("d", pb::Role::Drafter);
        let joined = run.join_group("d", 0, "", replicas).unwrap().expect("a group of one forms at once");
        assert!(joined.formed);
        run.resume_drafter("d", None, &[], 0).unwrap();
        register("t", pb::Role::Target);
        (dir, CoordinatorService::new(run, dflash_role::Stages::new(dflash_role::Stop::new())))
    }

    /// A lease request that waits as long as the coordinator holds it.
    async fn lease(svc: &CoordinatorService) -> pb::LeaseWorkResponse {
        lease_within(svc, u32::MAX).await
    }

    async fn lease_within(svc: &CoordinatorService, max_wait_ms: u32) -> pb::LeaseWorkResponse {
        let req = pb::LeaseWorkRequest { run_id: "run".into(), instance_id: "t".into(), max_batches: 1, max_wait_ms };
        svc.lease_work(Request::new(req)).await.unwrap().into_inner()
    }

    /// A lease request on its own task, to be held.
    fn spawn_lease(svc: &Arc<CoordinatorService>) -> tokio::task::JoinHandle<pb::LeaseWorkResponse> {
        let svc = Arc::clone(svc);
        tokio::spawn(async move { lease(&svc).await })
    }

    fn ids(r: &pb::LeaseWorkResponse) -> Vec<u64> {
        r.leases.iter().map(|l| l.batch_id).collect()
    }

    fn trained(svc: &CoordinatorService, batch: u64, step: u64) {
        let f = StepFigures { step, tokens: 9, ..Default::default() };
        svc.run.record_trained("d", &[batch], &[], &f).unwrap();
    }

    /// The reorder window (one batch) holds batch 1 back until batch 0 is
    /// trained: the second request waits for the drafter's step and comes
    /// back with batch 1, rather than empty-handed with a time to poll again.
    #[tokio::test]
    async fn a_lease_request_with_nothing_leasable_is_answered_when_the_drafter_trains() {
        let (_dir, svc) = service(3, 1, 60_000);
        let svc = Arc::new(svc);
        assert_eq!(ids(&lease(&svc).await), [0]);
        let held = spawn_lease(&svc);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!held.is_finished(), "the request is held while nothing can be leased");
        trained(&svc, 0, 1);
        let r = tokio::time::timeout(Duration::from_secs(10), held).await.expect("answered after the step").unwrap();
        assert_eq!(ids(&r), [1]);
        assert!(!r.exhausted);
        // Batch 1's lease expires (2 s): its return wakes the waiting
        // request, which takes it again.
        let held = spawn_lease(&svc);
        tokio::time::sleep(Duration::from_millis(200)).await;
        svc.run.check_liveness().unwrap(); // nothing expired yet: still held
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!held.is_finished());
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        svc.run.check_liveness().unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), held).await.expect("answered after the expiry").unwrap();
        assert_eq!(ids(&r), [1]);
        trained(&svc, 1, 2);
        assert_eq!(ids(&lease(&svc).await), [2]);
        trained(&svc, 2, 3);
        let r = lease(&svc).await;
        assert!(r.leases.is_empty() && r.exhausted, "all trained: exhausted at once, not held");
    }

    /// A request with nothing to lease is held as long as its caller waits
    /// and at most half the RPC timeout, and answered at once when the run
    /// ends or the coordinator stops; one that does not wait (max_wait_ms
    /// 0, as from a target that predates the field) is answered at once
    /// with a time to ask again.
    #[tokio::test]
    async fn a_held_lease_request_ends_with_its_hold_the_run_or_the_coordinator() {
        let (_dir, svc) = service(2, 1, 1_000);
        assert_eq!(ids(&lease(&svc).await), [0]);
        let start = std::time::Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), lease(&svc)).await.unwrap();
        assert!(r.leases.is_empty() && !r.exhausted && r.retry_after_ms == 0, "{r:?}");
        assert!(
            start.elapsed() >= Duration::from_millis(450),
            "held {:?}, half the RPC timeout is 500 ms",
            start.elapsed()
        );
        let start = std::time::Instant::now();
        let r = lease_within(&svc, 200).await;
        assert!(r.leases.is_empty() && r.retry_after_ms == 0, "{r:?}");
        assert!(start.elapsed() >= Duration::from_millis(190), "held {:?}, the caller waits 200 ms", start.elapsed());
        let r = lease_within(&svc, 0).await;
        assert!(r.leases.is_empty() && !r.exhausted && r.retry_after_ms == 20, "{r:?}");

        let (_dir, svc) = service(2, 1, 600_000);
        let svc = Arc::new(svc);
        assert_eq!(ids(&lease(&svc).await), [0]);
        let held = spawn_lease(&svc);
        tokio::time::sleep(Duration::from_millis(200)).await;
        svc.run.end(pb::RunState::Cancelled, "test".into());
        let r = tokio::time::timeout(Duration::from_secs(10), held).await.expect("answered at the run's end").unwrap();
        assert!(r.leases.is_empty() && r.exhausted, "{r:?}");

        let (_dir, svc) = service(2, 1, 600_000);
        let svc = Arc::new(svc);
        assert_eq!(ids(&lease(&svc).await), [0]);
        let held = spawn_lease(&svc);
        tokio::time::sleep(Duration::from_millis(200)).await;
        svc.streams.stop().stop(dflash_role::StopCause::Signal("SIGTERM"));
        let r = tokio::time::timeout(Duration::from_secs(10), held).await.expect("answered at the stop").unwrap();
        assert!(r.leases.is_empty() && !r.exhausted, "{r:?}");
    }
}
