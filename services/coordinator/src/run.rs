//! The coordinator's state of the run: registry of instances, the ledger,
//! progress, errors, and the run's fate, with the events that announce it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dflash_config::RunConfig;
use dflash_proto as pb;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use dflash_data::PlannedBatch;

use crate::clock::now_ms;
use crate::group::{Change, GroupBook, Member};
use crate::ledger::{CheckpointRecord, Counts, Lease, Ledger, LedgerError, Resumed};

/// Points of the training history a status carries (for a sparkline).
const STATUS_HISTORY_POINTS: u64 = 64;

/// Errors kept for the status (the newest).
const MAX_ERRORS: usize = 100;

/// A registered role instance.
pub struct Instance {
    pub request: pb::RegisterRequest,
    pub last_seen: Instant,
    pub alive: bool,
}

impl Instance {
    pub fn role(&self) -> pb::Role {
        pb::Role::try_from(self.request.role).unwrap_or(pb::Role::Unspecified)
    }
}

pub struct Registry {
    pub instances: BTreeMap<String, Instance>,
    /// The drafter group's rank 0, whose steps and checkpoints count.
    pub drafter: Option<String>,
    /// Who trains together, with which ranks, in which generation.
    pub group: GroupBook,
    /// Since when no drafter is registered (None while one is).
    pub drafter_absent_since: Option<Instant>,
}

/// Latest training progress reported by the drafter.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    pub step: u64,
    pub loss: f32,
    pub accuracy: f32,
    pub acceptance_length: f32,
    pub committed_step: u64,
    pub tokens: u64,
}

pub struct Fate {
    pub state: pb::RunState,
    pub message: String,
}

/// What a drafter's report says about one step, besides its batches.
#[derive(Clone, Debug, Default)]
pub struct StepFigures {
    pub step: u64,
    pub loss: f32,
    pub accuracy: f32,
    pub acceptance_length: f32,
    pub tokens: u64,
    pub input_wait_fraction: f32,
}

/// Everything the coordinator knows, shared by the RPC handlers and the
/// monitor. The state behind its locks is reached through its methods
/// only, each of which keeps ledger, progress and flow consistent.
pub struct Run {
    pub run_id: String,
    pub config: RunConfig,
    pub config_toml: String,
    /// Signs leases (`dflash_proto::lease_token`); drafters get it at
    /// registration, targets never.
    pub lease_key: Vec<u8>,
    ledger: Mutex<Ledger>,
    registry: Mutex<Registry>,
    progress: Mutex<Progress>,
    errors: Mutex<VecDeque<pb::ErrorReport>>,
    flow: Mutex<crate::flow::Flow>,
    fate: Mutex<Fate>,
    events: broadcast::Sender<pb::RunEvent>,
    /// Bumped whenever the drafter group may have moved (a member joined or
    /// left, a generation formed or ended, rank 0 published its rendezvous,
    /// batches were dealt out) or the run ended: what a waiting member's
    /// request waits on instead of polling.
    group_moves: tokio::sync::watch::Sender<u64>,
    /// Bumped whenever a batch may have become leasable: the drafter trained
    /// (the reorder window moved), leases or acknowledged batches returned
    /// to the pool, a drafter resumed, or the group moved. What a target's
    /// `LeaseWork` waits on when it finds nothing to lease, instead of the
    /// target polling.
    work_moves: tokio::sync::watch::Sender<u64>,
    /// Instances that heard of the run's end (its stop event on their event
    /// stream, or a heartbeat answered "run over"), counted in the watch.
    told: Mutex<BTreeSet<String>>,
    told_moves: tokio::sync::watch::Sender<usize>,
    /// Cancelled when the run reaches a terminal state.
    pub ended: CancellationToken,
}

impl Run {
    pub fn new(run_id: String, config: RunConfig, ledger: Ledger, lease_key: Vec<u8>) -> Self {
        let config_toml = dflash_config::to_toml_string(&config);
        let group = GroupBook::new(&config.group);
        let (events, _) = broadcast::channel(64);
        Self {
            run_id,
            config,
            config_toml,
            lease_key,
            ledger: Mutex::new(ledger),
            registry: Mutex::new(Registry {
                instances: BTreeMap::new(),
                drafter: None,
                group,
                drafter_absent_since: Some(Instant::now()),
            }),
            progress: Mutex::new(Progress::default()),
            errors: Mutex::new(VecDeque::new()),
            flow: Mutex::new(crate::flow::Flow::default()),
            fate: Mutex::new(Fate { state: pb::RunState::Running, message: String::new() }),
            events,
            group_moves: tokio::sync::watch::Sender::new(0),
            work_moves: tokio::sync::watch::Sender::new(0),
            told: Mutex::new(BTreeSet::new()),
            told_moves: tokio::sync::watch::Sender::new(0),
            ended: CancellationToken::new(),
        }
    }

    pub fn lease_ms(&self) -> u64 {
        self.config.faults.lease_timeout_ms
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().expect("ledger lock")
    }

    fn flow(&self) -> std::sync::MutexGuard<'_, crate::flow::Flow> {
        self.flow.lock().expect("flow lock")
    }

    /// Up to `max` batches leased to target `holder`, each with the group
    /// member that trains it. Nothing while no generation has its batches
    /// dealt out (the group forms, or its rank 0 has not resumed yet).
    pub fn lease(&self, holder: &str, max: u32) -> Result<Vec<(Lease, Member, u64)>, LedgerError> {
        let reg = self.registry.lock().expect("registry lock");
        let Some(g) = reg.group.current().filter(|g| g.is_assigned()) else { return Ok(Vec::new()) };
        // The window holds for each member's own batches (a member holds
        // its share of the plan, whatever its replicas).
        let window = u64::from(self.config.pipeline.reorder_window) * g.members.len() as u64;
        let leases = self.ledger().lease(holder, max, now_ms(), self.lease_ms(), window)?;
        let mut out = Vec::with_capacity(leases.len());
        let mut unrouted = Vec::new();
        for l in leases {
            match g.destination(l.batch_id) {
                Some(m) => out.push((l, m.clone(), g.number)),
                None => unrouted.push(l.batch_id),
            }
        }
        if !unrouted.is_empty() {
            // Not dealt out in this generation (cannot happen while the
            // ledger and the deal agree): back to pending, and said.
            tracing::error!("batches {unrouted:?} have no member in generation {}: released", g.number);
            // Not a move of the work: a held request woken by it would
            // lease the same batches again at once.
            self.ledger().release_batches(&unrouted)?;
        }
        Ok(out)
    }

    /// A target's heartbeat: its supply figures, and the leases it holds renewed.
    pub fn target_heartbeat(&self, holder: &str, tokens: u64, busy: f32, held: &[u64]) -> Result<(), LedgerError> {
        if tokens > 0 || busy > 0.0 {
            self.flow().target_report(holder, tokens, busy);
        }
        if held.is_empty() {
            return Ok(());
        }
        self.ledger().renew(holder, held, now_ms(), self.lease_ms())
    }

    pub fn mark_sent(&self, holder: &str, batch_ids: &[u64]) -> Result<(), LedgerError> {
        let train_by = now_ms() + self.config.faults.sent_timeout_ms;
        self.ledger().mark_sent(holder, batch_ids, train_by)
    }

    /// A drafter's step: its batches trained, its figures recorded.
    pub fn record_trained(
        &self,
        by: &str,
        batch_ids: &[u64],
        members: &[(u64, String)],
        f: &StepFigures,
    ) -> Result<(), LedgerError> {
        {
            let mut ledger = self.ledger();
            ledger.mark_trained(by, batch_ids, f.step)?;
            if !members.is_empty() {
                ledger.record_members(members)?;
            }
            if f.tokens > 0 {
                ledger.record_progress(&pb::ProgressPoint {
                    step: f.step,
                    loss: f.loss,
                    accuracy: f.accuracy,
                    acceptance_length: f.acceptance_length,
                })?;
            }
        }
        {
            let mut p = self.progress.lock().expect("progress lock");
            p.step = f.step;
            // Reports of steps that trained nothing (duplicates, skips)
            // carry no figures; keep the last ones.
            if f.tokens > 0 {
                p.loss = f.loss;
                p.accuracy = f.accuracy;
                p.acceptance_length = f.acceptance_length;
            }
            p.tokens += f.tokens;
        }
        self.flow().drafter_report(f.tokens, f.input_wait_fraction);
        self.work_moved();
        Ok(())
    }

    /// Every planned batch is trained (or committed).
    pub fn all_trained(&self) -> bool {
        let c = self.counts();
        c.pending + c.leased + c.sent == 0
    }

    /// Where drafter `by` starts (see [`Ledger::resume`]); returns what it
    /// changed and the counts after.
    pub fn resume_drafter(
        &self,
        by: &str,
        start: Option<&CheckpointRecord>,
        batch_ids: &[u64],
        step: u64,
    ) -> Result<(Resumed, Counts), LedgerError> {
        let mut ledger = self.ledger();
        let r = ledger.resume(by, start, batch_ids)?;
        let counts = ledger.counts()?;
        let remaining = ledger.uncommitted_ids()?;
        drop(ledger);
        // Rank 0 starts where the lineage ends: deal out what is left.
        let mut reg = self.registry.lock().expect("registry lock");
        if reg.group.current().is_some_and(|g| g.leader().instance_id == by) {
            reg.group.assign(&remaining);
        }
        drop(reg);
        self.group_moved();
        self.progress.lock().expect("progress lock").committed_step = step;
        Ok((r, counts))
    }

    /// Commits drafter `by`'s checkpoint (see [`Ledger::commit_checkpoint`]);
    /// returns the counts after.
    pub fn commit_checkpoint(
        &self,
        by: &str,
        record: &CheckpointRecord,
        batch_ids: &[u64],
    ) -> Result<Counts, LedgerError> {
        let mut ledger = self.ledger();
        ledger.commit_checkpoint(by, record, batch_ids)?;
        let counts = ledger.counts()?;
        drop(ledger);
        self.progress.lock().expect("progress lock").committed_step = record.step;
        Ok(counts)
    }

    /// Committed checkpoints, newest first.
    pub fn checkpoints(&self) -> Result<Vec<CheckpointRecord>, LedgerError> {
        self.ledger().checkpoints()
    }

    /// The plan's batches and its fingerprint.
    /// A page of the plan ([`crate::ledger::Ledger::plan_page`]).
    pub fn plan_page(&self, from_batch_id: u64, max_bytes: usize) -> Result<(Vec<PlannedBatch>, bool), LedgerError> {
        self.ledger().plan_page(from_batch_id, max_bytes)
    }

    /// The plan's fingerprint, as the ledger records it.
    pub fn plan_fingerprint(&self) -> Result<String, LedgerError> {
        Ok(self.ledger().meta("plan_fingerprint")?.unwrap_or_default())
    }

    /// One sample of supply and demand (the monitor's tick); the summary.
    pub fn sample_flow(&self) -> crate::flow::FlowSummary {
        let mut flow = self.flow();
        flow.sample(Instant::now());
        flow.summary()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<pb::RunEvent> {
        self.events.subscribe()
    }

    /// Events a new watcher needs to catch up: the drafter endpoint and, if
    /// the run is over, the stop.
    pub fn snapshot_events(&self) -> Vec<pb::RunEvent> {
        let mut out = vec![self.group_event()];
        if let Some(stop) = self.stop_event() {
            out.push(stop);
        }
        out
    }

    fn group_event(&self) -> pb::RunEvent {
        let group = self.registry.lock().expect("registry lock").group.event();
        pb::RunEvent { event: Some(pb::run_event::Event::Group(group)) }
    }

    /// Acts on a change of the group: the new generation's rank 0 leads;
    /// an ended generation's leases go back to pending (they were routed to
    /// its members), and every watcher hears of it.
    fn group_changed(&self, change: Change) -> Result<(), LedgerError> {
        {
            let mut reg = self.registry.lock().expect("registry lock");
            match &change {
                Change::Formed(_) => {
                    reg.drafter = reg.group.current().map(|g| g.leader().instance_id.clone());
                    reg.drafter_absent_since = None;
                }
                Change::Ended(g, why) => {
                    tracing::warn!("drafter group generation {g} ended: {why}; its members join the next");
                    reg.drafter = None;
                    reg.drafter_absent_since = Some(Instant::now());
                }
            }
        }
        if matches!(change, Change::Ended(..)) {
            let n = self.ledger().release_all_leases()?;
            if n > 0 {
                tracing::info!("released {n} lease(s) routed to the ended generation");
            }
        }
        let _ = self.events.send(self.group_event());
        self.group_moved();
        Ok(())
    }

    /// Wakes every request waiting for the group to move, and every lease
    /// request (a new deal routes batches, an ended one releases them).
    fn group_moved(&self) {
        self.group_moves.send_modify(|n| *n = n.wrapping_add(1));
        self.work_moved();
    }

    /// Wakes every lease request waiting for work (see `work_moves`).
    fn work_moved(&self) {
        self.work_moves.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that changes whenever a batch may have become leasable
    /// or the run ended (see `work_moves`).
    pub fn watch_work(&self) -> tokio::sync::watch::Receiver<u64> {
        self.work_moves.subscribe()
    }

    /// A receiver that changes whenever the group may have moved or the
    /// run ended (see `group_moves`).
    pub fn watch_group(&self) -> tokio::sync::watch::Receiver<u64> {
        self.group_moves.subscribe()
    }

    /// One attempt to place drafter `instance_id` in the group (see
    /// [`GroupBook`]); rank 0 of `generation` publishes `store_address`.
    /// None: not formed yet.
    pub fn join_group(
        &self,
        instance_id: &str,
        generation: u64,
        store_address: &str,
        replicas: u32,
    ) -> Result<Option<pb::JoinGroupResponse>, LedgerError> {
        let mut changes = Vec::new();
        // Each member trains on the devices the run config gives it; a
        // member that brings another number of replicas runs another config
        // (or build) and would break the deal of batches by rank.
        let configured = self.config.devices.drafter.devices().len() as u32;
        if replicas != configured {
            return Err(LedgerError::Refused(format!(
                "drafter {instance_id} joins with {replicas} replica(s), but devices.drafter ({}) gives every member \
                 of this run's drafter group {configured}: members of different device counts are refused, because \
                 the one run config names the drafter devices for every member and a step deals one batch per rank \
                 (a member with other devices runs another config)",
                self.config.devices.drafter
            )));
        }
        let reply = {
            let mut reg = self.registry.lock().expect("registry lock");
            let (endpoint, version) = reg
                .instances
                .get(instance_id)
                .map(|i| (i.request.endpoint.clone(), i.request.version.clone()))
                .unwrap_or_default();
            // Every member runs the same build (the same step, the same
            // collectives); the config is the coordinator's, the same for all.
            let others = reg.group.member_ids();
            if let Some((other, v)) = others
                .iter()
                .filter(|o| o.as_str() != instance_id)
                .find_map(|o| reg.instances.get(o).map(|i| (o, &i.request.version)).filter(|(_, v)| **v != version))
            {
                return Err(LedgerError::Refused(format!(
                    "drafter {instance_id} runs dflash {version}, but group member {other} runs {v}: every member of \
                     a drafter group must run the same build"
                )));
            }
            let book = &mut reg.group;
            if generation > 0 && !store_address.is_empty() && book.publish_store(generation, instance_id, store_address)
            {
                tracing::info!("generation {generation}: rank 0 serves the rendezvous at {store_address}");
                // News to the members waiting for it.
                self.group_moved();
            }
            if generation == 0 {
                let member = Member { instance_id: instance_id.to_string(), endpoint, replicas: configured as usize };
                changes.extend(book.join(member, Instant::now()));
                match book.try_form(Instant::now()) {
                    Ok(c) => changes.extend(c),
                    Err(why) => {
                        drop(reg);
                        self.end(pb::RunState::Failed, why);
                        return Ok(None);
                    }
                }
            }
            reg.group.joined(instance_id)
        };
        for c in changes {
            self.group_changed(c)?;
        }
        Ok(reply)
    }

    /// The current generation's number (0: none).
    pub fn generation(&self) -> u64 {
        self.registry.lock().expect("registry lock").group.current().map_or(0, |g| g.number)
    }

    /// A member's batches in `generation`, once dealt out, each with the
    /// rank that trains it.
    pub fn assigned(&self, instance_id: &str, generation: u64) -> Option<Vec<(u64, usize)>> {
        let reg = self.registry.lock().expect("registry lock");
        let g = reg.group.current().filter(|g| g.number == generation && g.is_assigned())?;
        g.member_batches(instance_id)
    }

    pub fn stop_event(&self) -> Option<pb::RunEvent> {
        let fate = self.fate.lock().expect("fate lock");
        let reason = match fate.state {
            pb::RunState::Completed => pb::StopReason::Completed,
            pb::RunState::Failed => pb::StopReason::Failed,
            pb::RunState::Cancelled => pb::StopReason::Cancelled,
            _ => return None,
        };
        Some(pb::RunEvent {
            event: Some(pb::run_event::Event::Stop(pb::StopRun {
                reason: reason as i32,
                message: fate.message.clone(),
            })),
        })
    }

    pub fn state(&self) -> (pb::RunState, String) {
        let f = self.fate.lock().expect("fate lock");
        (f.state, f.message.clone())
    }

    pub fn is_running(&self) -> bool {
        self.fate.lock().expect("fate lock").state == pb::RunState::Running
    }

    /// Moves the run to a terminal state once and tells every watcher.
    pub fn end(&self, state: pb::RunState, message: String) {
        {
            let mut f = self.fate.lock().expect("fate lock");
            if f.state != pb::RunState::Running {
                return;
            }
            f.state = state;
            f.message = message.clone();
        }
        match state {
            pb::RunState::Completed => tracing::info!("run {} completed: {message}", self.run_id),
            _ => tracing::error!("run {} {}: {message}", self.run_id, state.as_str_name()),
        }
        if let Some(ev) = self.stop_event() {
            let _ = self.events.send(ev);
        }
        self.ended.cancel();
        self.group_moved();
    }

    /// Instance `id` heard that the run is over.
    pub fn told_of_end(&self, id: &str) {
        if id.is_empty() {
            return;
        }
        let n = {
            let mut told = self.told.lock().expect("told lock");
            told.insert(id.to_string());
            told.len()
        };
        self.told_moves.send_replace(n);
    }

    /// The live instances that have not heard of the run's end yet.
    pub fn untold(&self) -> Vec<String> {
        let told = self.told.lock().expect("told lock").clone();
        let reg = self.registry.lock().expect("registry lock");
        reg.instances.iter().filter(|(id, i)| i.alive && !told.contains(*id)).map(|(id, _)| id.clone()).collect()
    }

    /// Waits until every live instance heard of the run's end, at most
    /// `grace` (an instance that cannot be reached learns it when its
    /// coordinator timeout runs out).
    pub async fn wait_until_all_told(&self, grace: Duration) {
        let mut moves = self.told_moves.subscribe();
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            moves.borrow_and_update();
            let untold = self.untold();
            if untold.is_empty() {
                return;
            }
            if !matches!(tokio::time::timeout_at(deadline, moves.changed()).await, Ok(Ok(()))) {
                tracing::warn!(
                    "{} instance(s) did not hear of the run's end within {grace:?}: {untold:?}",
                    untold.len()
                );
                return;
            }
        }
    }

    /// Registers (or re-registers) an instance.
    pub fn register(&self, req: pb::RegisterRequest) {
        let role = pb::Role::try_from(req.role).unwrap_or(pb::Role::Unspecified);
        let id = req.instance_id.clone();
        let mut reg = self.registry.lock().expect("registry lock");
        let again = reg.instances.contains_key(&id);
        tracing::info!(
            "{} {} {} (host {}, pid {}, devices [{}], version {}{})",
            if again { "re-registered" } else { "registered" },
            role.name(),
            id,
            req.host,
            req.pid,
            req.devices.join(", "),
            req.version,
            if req.endpoint.is_empty() { String::new() } else { format!(", endpoint {}", req.endpoint) }
        );
        let claim = (req.group_generation, req.group_world);
        let member = Member {
            instance_id: id.clone(),
            endpoint: req.endpoint.clone(),
            replicas: self.config.devices.drafter.devices().len(),
        };
        reg.instances.insert(id.clone(), Instance { request: req, last_seen: Instant::now(), alive: true });
        // A member of a generation this coordinator did not form (it
        // restarted): a group of one goes on; a larger one re-forms.
        let adopted = (role == pb::Role::Drafter && claim.0 > 0)
            .then(|| {
                let known = reg.group.current().is_some_and(|g| g.rank_of(&id).is_some());
                (!known).then(|| reg.group.adopt(member, claim.0, claim.1)).flatten()
            })
            .flatten();
        drop(reg);
        if let Some(change) = adopted {
            let formed = matches!(change, Change::Formed(_));
            if let Err(e) = self.group_changed(change) {
                tracing::error!("drafter group: {e}");
            }
            if formed {
                // It resumed long ago: what is left is its, in plan order.
                match self.ledger().uncommitted_ids() {
                    Ok(remaining) => self.registry.lock().expect("registry lock").group.assign(&remaining),
                    Err(e) => tracing::error!("drafter group: {e}"),
                }
                self.group_moved();
            }
        }
    }

    /// Records a heartbeat; false when the instance is unknown.
    pub fn touch(&self, instance_id: &str) -> bool {
        let mut reg = self.registry.lock().expect("registry lock");
        match reg.instances.get_mut(instance_id) {
            Some(i) if i.alive => {
                i.last_seen = Instant::now();
                true
            }
            _ => false,
        }
    }

    pub fn is_current_drafter(&self, instance_id: &str) -> bool {
        self.registry.lock().expect("registry lock").drafter.as_deref() == Some(instance_id)
    }

    /// Whether the instance is a member of the current generation (its
    /// acknowledgements count).
    pub fn is_group_member(&self, instance_id: &str) -> bool {
        self.registry.lock().expect("registry lock").group.current().is_some_and(|g| g.rank_of(instance_id).is_some())
    }

    pub fn record_error(&self, report: pb::ErrorReport) {
        let role = pb::Role::try_from(report.role).unwrap_or(pb::Role::Unspecified).name();
        let device = if report.device.is_empty() { String::new() } else { format!(" on {}", report.device) };
        let chain = report.causes.join(": ");
        let kind = report.kind().or_internal();
        let line = format!("{role} {}{device} [{kind}]: {chain}", report.instance_id);
        if report.fatal {
            tracing::error!("fatal error from {line}");
        } else {
            tracing::warn!("error from {line}");
        }
        let fatal = report.fatal;
        dflash_telemetry::metrics().errors.with_label_values(&[kind.label()]).inc();
        {
            let mut errs = self.errors.lock().expect("errors lock");
            if errs.len() == MAX_ERRORS {
                errs.pop_front();
            }
            errs.push_back(report);
        }
        if fatal {
            self.end(pb::RunState::Failed, line);
        }
    }

    /// One pass of the liveness checks: expired leases, silent instances,
    /// and a drafter absent for too long.
    pub fn check_liveness(&self) -> Result<(), LedgerError> {
        let f = &self.config.faults;
        let expired = self.ledger.lock().expect("ledger lock").expire_leases(now_ms())?;
        if expired > 0 {
            tracing::warn!("{expired} lease(s) expired; their batches are pending again");
        }
        let lost = self.ledger.lock().expect("ledger lock").expire_sent(now_ms())?;
        if lost > 0 {
            tracing::warn!(
                "{lost} acknowledged batch(es) not trained within {} ms (faults.sent_timeout_ms): pending again",
                f.sent_timeout_ms
            );
        }
        if expired + lost > 0 {
            self.work_moved();
        }
        let timeout = Duration::from_millis(f.instance_timeout_ms);
        let mut dead_targets = Vec::new();
        let mut changes = Vec::new();
        let formed = {
            let mut reg = self.registry.lock().expect("registry lock");
            let mut dead_drafters = Vec::new();
            for (id, inst) in reg.instances.iter_mut() {
                if inst.alive && inst.last_seen.elapsed() > timeout {
                    inst.alive = false;
                    tracing::warn!(
                        "{} {id} silent for {} ms: presumed dead",
                        inst.role().name(),
                        f.instance_timeout_ms
                    );
                    match inst.role() {
                        pb::Role::Target => dead_targets.push(id.clone()),
                        pb::Role::Drafter => dead_drafters.push(id.clone()),
                        _ => {}
                    }
                }
            }
            for id in dead_drafters {
                changes.extend(reg.group.lost(&id));
            }
            // The wait for members may have run out.
            reg.group.try_form(Instant::now())
        };
        match formed {
            Ok(c) => changes.extend(c),
            Err(why) => self.end(pb::RunState::Failed, why),
        }
        for c in changes {
            self.group_changed(c)?;
        }
        for id in dead_targets {
            self.flow.lock().expect("flow lock").target_gone(&id);
            let n = self.ledger.lock().expect("ledger lock").release_holder(&id)?;
            tracing::warn!("released {n} lease(s) of target {id}");
            self.work_moved();
        }
        let absent = self.registry.lock().expect("registry lock").drafter_absent_since.map(|t| t.elapsed());
        if let Some(a) = absent
            && a > Duration::from_millis(f.drafter_absence_timeout_ms)
            && self.is_running()
        {
            self.end(
                pb::RunState::Failed,
                format!("no drafter registered for {} s (faults.drafter_absence_timeout_ms)", a.as_secs()),
            );
        }
        Ok(())
    }

    /// The alarms raised now, each `name: what`. `supply_stalled`: the run
    /// is running with work left (batches leased or sent; or pending, once
    /// any target has produced, so that loading targets at the start are
    /// not a stall), and for `faults.supply_stall_alarm_ms` no target
    /// produced a feature token and the drafter trained none: training waits
    /// on work that does not come (a stalled stream, a hung target, with a
    /// lease or between leases). A drafter that trains while the targets
    /// wait for its credits is the run's bound, not a stall.
    pub fn alarms(&self) -> Vec<String> {
        self.alarms_for(&self.counts())
    }

    fn alarms_for(&self, c: &Counts) -> Vec<String> {
        let (silent, supplied) = {
            let flow = self.flow();
            (flow.starved_for(Instant::now()), flow.has_supplied())
        };
        let limit = Duration::from_millis(self.config.faults.supply_stall_alarm_ms);
        let outstanding = c.leased + c.sent > 0 || (supplied && c.pending > 0);
        let mut alarms = Vec::new();
        if self.is_running() && outstanding && silent >= limit {
            alarms.push(format!(
                "supply_stalled: no target produced a token and the drafter trained none for {} s while {} batches \
                 are leased, {} sent and {} pending (faults.supply_stall_alarm_ms = {})",
                silent.as_secs(),
                c.leased,
                c.sent,
                c.pending,
                limit.as_millis()
            ));
        }
        alarms
    }

    /// Mirrors the ledger, the registry and the flow into the metrics;
    /// returns the alarms raised now (as [`Run::alarms`]).
    pub fn export_metrics(&self) -> Vec<String> {
        let m = dflash_telemetry::metrics();
        let c = self.counts();
        for (state, n) in [
            ("pending", c.pending),
            ("leased", c.leased),
            ("sent", c.sent),
            ("trained", c.trained),
            ("committed", c.committed),
        ] {
            m.ledger_batches.with_label_values(&[state]).set(n as i64);
        }
        let flow = self.flow.lock().expect("flow lock").summary();
        m.flow_tokens_per_second.with_label_values(&["supply"]).set(flow.supply_tokens_per_s);
        m.flow_tokens_per_second.with_label_values(&["demand"]).set(flow.demand_tokens_per_s);
        m.idle_fraction.with_label_values(&["drafter_wait"]).set(f64::from(flow.drafter_wait));
        m.idle_fraction.with_label_values(&["targets_idle"]).set(1.0 - f64::from(flow.targets_busy));
        let mut alive = std::collections::BTreeMap::<&str, i64>::new();
        for i in self.registry.lock().expect("registry lock").instances.values() {
            *alive.entry(i.role().name()).or_default() += i64::from(i.alive);
        }
        for role in ["target", "drafter"] {
            m.registered_instances.with_label_values(&[role]).set(alive.get(role).copied().unwrap_or(0));
        }
        let (state, _) = self.state();
        for (s, name) in [
            (pb::RunState::Running, "running"),
            (pb::RunState::Completed, "completed"),
            (pb::RunState::Failed, "failed"),
            (pb::RunState::Cancelled, "cancelled"),
        ] {
            m.run_state.with_label_values(&[name]).set(i64::from(state == s));
        }
        let p = self.progress.lock().expect("progress lock").clone();
        m.step.set(p.step as f64);
        m.loss.set(f64::from(p.loss));
        m.accuracy.set(f64::from(p.accuracy));
        m.acceptance_length.with_label_values(&["simulated"]).set(f64::from(p.acceptance_length));
        let alarms = self.alarms_for(&c);
        let raised = alarms.iter().any(|a| a.starts_with("supply_stalled:"));
        m.alarm.with_label_values(&["supply_stalled"]).set(i64::from(raised));
        alarms
    }

    pub fn counts(&self) -> Counts {
        self.ledger.lock().expect("ledger lock").counts().unwrap_or_default()
    }

    pub fn status(&self) -> pb::StatusResponse {
        let (state, state_message) = self.state();
        let c = self.counts();
        let p = self.progress.lock().expect("progress lock").clone();
        let instances = self
            .registry
            .lock()
            .expect("registry lock")
            .instances
            .iter()
            .map(|(id, i)| pb::InstanceStatus {
                role: i.request.role,
                instance_id: id.clone(),
                host: i.request.host.clone(),
                devices: i.request.devices.clone(),
                version: i.request.version.clone(),
                endpoint: i.request.endpoint.clone(),
                pid: i.request.pid,
                last_seen_ms_ago: i.last_seen.elapsed().as_millis() as u64,
                alive: i.alive,
            })
            .collect();
        let flow = self.flow.lock().expect("flow lock").summary();
        // A status without its history is still a status.
        let history = self.ledger().progress_history(STATUS_HISTORY_POINTS).unwrap_or_default();
        pb::StatusResponse {
            history,
            alarms: self.alarms(),
            supply_tokens_per_s: flow.supply_tokens_per_s,
            demand_tokens_per_s: flow.demand_tokens_per_s,
            bound_by: flow.bound_by.to_string(),
            run_id: self.run_id.clone(),
            state: state as i32,
            state_message,
            instances,
            ledger: Some(pb::LedgerCounts {
                pending: c.pending,
                leased: c.leased,
                sent: c.sent,
                trained: c.trained,
                committed: c.committed,
                total: c.total(),
            }),
            step: p.step,
            loss: p.loss,
            accuracy: p.accuracy,
            acceptance_length: p.acceptance_length,
            committed_step: p.committed_step,
            errors: self.errors.lock().expect("errors lock").iter().cloned().collect(),
        }
    }
}
