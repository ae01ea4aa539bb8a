//! The plan's order: batches arrive in whatever order the targets produce
//! them (several targets, replays after a restart, leases that expired and
//! were done again); the sequencer hands them to prefetch in the order of
//! the plan, so that the drafter's weights are a function of the run's
//! config, data and seed, however often the run was interrupted. It holds
//! at most `pipeline.reorder_window` batches that arrived early; the
//! coordinator leases nothing further ahead than that, so the batch the
//! sequencer waits for always has a landing buffer to arrive in.
//!
//! A batch of the plan that the receiver rejected takes its place in the
//! order too (it is reported as skipped). A batch already trained in this
//! lineage (a replay whose acknowledgement was lost) goes on at once: the
//! train loop reports it again and does not train it. In a group's lockstep
//! such a replay is dropped instead: every batch a rank holds is a step of
//! the whole group, so a replay would pair the ranks' batches differently
//! from then on (and add a step); its first copy is reported by the step
//! that trains it.

use std::collections::{BTreeMap, HashMap};

use dflash_role::{Stop, recv_until_stop, send_until_stop};

use crate::pipeline::{Arrival, TrainedSet};

/// Where the ordered batches go: one lane per replica of this drafter.
/// A group member's replicas each train the batches dealt to their rank;
/// a drafter alone has one lane that takes every batch.
pub struct Lanes {
    outputs: Vec<flume::Sender<Arrival>>,
    /// The lane of each batch dealt out (None: every batch to lane 0).
    by_batch: Option<HashMap<u64, usize>>,
}

impl Lanes {
    /// One lane that takes every batch.
    pub fn single(output: flume::Sender<Arrival>) -> Self {
        Self { outputs: vec![output], by_batch: None }
    }

    /// A lane per replica; `by_batch` names each batch's.
    pub fn dealt(outputs: Vec<flume::Sender<Arrival>>, by_batch: HashMap<u64, usize>) -> Self {
        Self { outputs, by_batch: Some(by_batch) }
    }

    fn lane(&self, batch_id: u64) -> Option<&flume::Sender<Arrival>> {
        match &self.by_batch {
            None => self.outputs.first(),
            Some(m) => self.outputs.get(*m.get(&batch_id)?),
        }
    }
}

/// Puts arrivals into the plan's order.
pub struct Sequencer {
    /// Position of each planned batch in the order.
    slot_of: HashMap<u64, usize>,
    order: Vec<u64>,
    /// The next position to hand on.
    next: usize,
    /// Batches trained in this lineage (the checkpoint's, then the train loop's).
    trained: TrainedSet,
    held: BTreeMap<usize, Arrival>,
    /// 0: hand every arrival on as it comes.
    window: usize,
    waiting_logged: Option<u64>,
    /// A group's lockstep: replays are dropped, and the sequencer ends once
    /// its whole order is handed on.
    lockstep: bool,
}

impl Sequencer {
    /// `plan` are the run's batch ids (any order: the order is by id);
    /// `trained` the batches the resumed checkpoint holds.
    pub fn new(plan: impl IntoIterator<Item = u64>, trained: TrainedSet, window: usize) -> Self {
        let mut order: Vec<u64> = plan.into_iter().collect();
        order.sort_unstable();
        let slot_of = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let mut s = Self {
            slot_of,
            order,
            next: 0,
            trained,
            held: BTreeMap::new(),
            window,
            waiting_logged: None,
            lockstep: false,
        };
        s.skip_trained();
        s
    }

    /// For the ranks of a drafter group (see the module's comment).
    pub fn in_lockstep(mut self) -> Self {
        self.lockstep = true;
        self
    }

    /// The batch id the sequencer hands on next (None: the plan is done).
    pub fn next_id(&self) -> Option<u64> {
        self.order.get(self.next).copied()
    }

    fn is_trained(&self, id: u64) -> bool {
        self.trained.contains(id)
    }

    /// Moves past positions already trained (a resumed lineage).
    fn skip_trained(&mut self) {
        while let Some(id) = self.next_id() {
            if !self.is_trained(id) {
                return;
            }
            self.next += 1;
        }
    }

    /// Takes one arrival; returns what may go on now, in order.
    pub fn push(&mut self, a: Arrival) -> Vec<Arrival> {
        let id = a.batch_id();
        if matches!(a, Arrival::Rejected(_)) && self.is_trained(id) {
            return Vec::new();
        }
        let Some(&slot) = self.slot_of.get(&id).filter(|_| self.window > 0) else {
            // Arrival order (or an id outside the plan, which the receiver
            // has already refused): on at once.
            return vec![a];
        };
        if slot < self.next || self.is_trained(id) {
            return match a {
                Arrival::Batch(_) if self.lockstep => {
                    tracing::info!("batch {id} arrived again after it was handed on; dropped (the group's lockstep)");
                    Vec::new()
                }
                // Reported again as trained; never trained twice.
                Arrival::Batch(_) => vec![a],
                Arrival::Rejected(_) => Vec::new(),
            };
        }
        match self.held.get(&slot) {
            // A good copy replaces a rejected one; otherwise the first stays.
            Some(Arrival::Rejected(_)) if matches!(a, Arrival::Batch(_)) => {
                self.held.insert(slot, a);
            }
            Some(_) => {}
            None => {
                self.held.insert(slot, a);
            }
        }
        let mut out = Vec::new();
        while let Some(a) = self.held.remove(&self.next) {
            out.push(a);
            self.next += 1;
            self.skip_trained();
        }
        if out.is_empty() && self.held.len() >= self.window && self.waiting_logged != self.next_id() {
            self.waiting_logged = self.next_id();
            tracing::info!(
                "holding {} batch(es) that came early; waiting for batch {:?}, the next in the plan's order",
                self.held.len(),
                self.next_id()
            );
        }
        out
    }

    /// Batches held, waiting for an earlier one.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Hands arrivals on in order until the input closes or the role stops;
    /// in lockstep, also once its whole order is handed on (a group member's
    /// replicas then tell the others they have no more batches by their
    /// inputs closing). Each arrival goes to its lane: the replica of this
    /// member that trains it (`lanes.lane`).
    pub fn run(mut self, input: flume::Receiver<Arrival>, lanes: Lanes, stop: Stop) {
        let end_when_done = self.lockstep;
        if end_when_done && self.next_id().is_none() {
            return;
        }
        while let Some(a) = recv_until_stop(&input, &stop) {
            for a in self.push(a) {
                let Some(output) = lanes.lane(a.batch_id()) else {
                    // The receiver takes only this member's batches.
                    tracing::error!("batch {} is not dealt to this member's replicas: dropped", a.batch_id());
                    continue;
                };
                if !send_until_stop(output, a, &stop) {
                    return;
                }
            }
            if end_when_done && self.next_id().is_none() {
                return;
            }
            dflash_telemetry::metrics().queue_depth.with_label_values(&["reorder"]).set(self.held() as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use dflash_proto as pb;

    use super::*;
    use crate::pipeline::ReceivedBatch;

    fn rejected(id: u64) -> Arrival {
        Arrival::Rejected(pb::TrainedBatch {
            batch_id: id,
            skipped: true,
            skip_reason: "bad".into(),
            member: String::new(),
        })
    }

    fn ids(v: &[Arrival]) -> Vec<(u64, bool)> {
        v.iter().map(|a| (a.batch_id(), matches!(a, Arrival::Rejected(_)))).collect()
    }

    #[test]
    fn arrivals_leave_in_the_plans_order_and_trained_ones_at_once() {
        let trained = TrainedSet::default();
        trained.reset_to([0, 1, 3]);
        let mut s = Sequencer::new([4, 0, 1, 2, 3, 5, 6], trained.clone(), 4);
        assert_eq!(s.next_id(), Some(2), "a resumed lineage starts at its first untrained batch");
        assert!(s.push(rejected(5)).is_empty());
        assert!(s.push(rejected(4)).is_empty());
        assert_eq!(s.held(), 2);
        // A replay of a trained batch goes on at once; a rejected copy of it does not.
        assert!(s.push(rejected(1)).is_empty());
        assert_eq!(s.next_id(), Some(2));
        // 2 arrives: 2, then 4 (3 is trained), then 5.
        let out = s.push(rejected(2));
        assert_eq!(ids(&out), vec![(2, true), (4, true), (5, true)]);
        assert_eq!((s.next_id(), s.held()), (Some(6), 0));
        assert_eq!(ids(&s.push(rejected(6))), vec![(6, true)]);
        assert_eq!(s.next_id(), None);
    }

    #[test]
    fn each_replica_gets_the_batches_dealt_to_its_rank_in_order() {
        let (tx0, rx0) = flume::unbounded();
        let (tx1, rx1) = flume::unbounded();
        let (input_tx, input) = flume::unbounded();
        // Ranks 2 and 3 of a world of 4: batches 2, 6, 10 (lane 0) and 3, 7, 11 (lane 1).
        let by_batch = [(2, 0), (6, 0), (10, 0), (3, 1), (7, 1), (11, 1)].into_iter().collect();
        let s = Sequencer::new([2, 3, 6, 7, 10, 11], TrainedSet::default(), 4);
        for id in [7, 3, 11, 2, 10, 6] {
            input_tx.send(rejected(id)).unwrap();
        }
        drop(input_tx);
        s.in_lockstep().run(input, Lanes::dealt(vec![tx0, tx1], by_batch), Stop::new());
        let got = |rx: flume::Receiver<Arrival>| rx.drain().map(|a| a.batch_id()).collect::<Vec<_>>();
        assert_eq!(got(rx0), vec![2, 6, 10]);
        assert_eq!(got(rx1), vec![3, 7, 11]);
    }

    #[test]
    fn in_lockstep_a_replay_of_a_batch_handed_on_is_dropped() {
        let batch = |id| {
            let meta = dflash_wire::BatchMeta {
                batch_id: id,
                epoch: 0,
                target_instance: "target-0".into(),
                layout: dflash_wire::Layout::Split,
                dtype: dflash_wire::DType::F32,
                seq_lengths: vec![2],
                input_ids: vec![5, 6],
                loss_mask: vec![1, 1],
                layer_ids: vec![0],
                hidden_size: 2,
                sample_ids: vec![id],
                target_top_k: 0,
                trace_context: Default::default(),
                lease_token: Vec::new(),
            };
            let payload = vec![0u8; meta.payload_bytes()].into();
            let batch = dflash_wire::HostBatch::new(meta, payload).unwrap();
            Arrival::Batch(ReceivedBatch { batch, queue_wait: tracing::Span::none() })
        };
        let mut alone = Sequencer::new([0, 1], TrainedSet::default(), 4);
        assert_eq!(ids(&alone.push(batch(0))), vec![(0, false)]);
        assert_eq!(ids(&alone.push(batch(0))), vec![(0, false)], "alone: on again, reported as trained");
        let mut group = Sequencer::new([0, 1], TrainedSet::default(), 4).in_lockstep();
        assert_eq!(ids(&group.push(batch(0))), vec![(0, false)]);
        assert!(group.push(batch(0)).is_empty(), "a rank's held batch is a step of the whole group");
        assert_eq!(ids(&group.push(batch(1))), vec![(1, false)]);
    }

    #[test]
    fn without_a_window_arrivals_go_on_as_they_come() {
        let mut s = Sequencer::new([0, 1, 2], TrainedSet::default(), 0);
        assert_eq!(ids(&s.push(rejected(2))), vec![(2, true)]);
        assert_eq!(ids(&s.push(rejected(0))), vec![(0, true)]);
    }
}
