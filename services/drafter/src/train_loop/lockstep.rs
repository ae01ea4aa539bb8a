//! The group's lockstep: a rank steps only when every rank holds its next
//! batch in the plan's order (or has none left), and learns the other
//! ranks' outcomes of each step through the collective.

use std::time::Duration;

use dflash_models::collective::Collective;
use dflash_role::{KindExt, Stop};
use dflash_telemetry::ErrorKind;

use super::step::{Next, ReplicaOutcome, ReplicaReport, next_prepared};
use crate::pipeline::Prepared;

/// A rank of a drafter group of several ranks (replicas of this member,
/// of others, or both). It steps only when every rank holds its next batch
/// in the plan's order (or has none left), so that step k trains the k-th
/// batch dealt to each rank whatever the timing; and it learns the others'
/// outcomes through the collective (rank 0 reports them all).
#[derive(Default)]
pub struct GroupMember {
    /// Instance id of each rank.
    pub names: Vec<String>,
    held: Option<Prepared>,
    exhausted: bool,
    /// The other ranks' reports of the last step.
    gathered: Vec<ReplicaReport>,
}

/// Per rank in the gathered reports: batch id + 1 (0: none), outcome,
/// loss, accuracy, acceptance length, tokens.
const GATHERED: usize = 6;

/// What the ranks agreed before a step.
pub(super) enum Turn {
    /// A rank is stopping: every rank stops.
    Stopping,
    /// A rank is not ready yet, or none holds a batch: no step now.
    Wait,
    /// Every rank is ready: step, with this rank's batch if it holds one.
    Step(Option<Prepared>),
}

impl GroupMember {
    pub fn new(names: Vec<String>) -> Self {
        Self { names, ..Self::default() }
    }

    /// The other ranks' reports of the step just taken.
    pub fn take_gathered(&mut self) -> Vec<ReplicaReport> {
        std::mem::take(&mut self.gathered)
    }

    /// Before a step: takes this rank's next batch if it holds none (and
    /// more may come), then agrees with every rank whether the group steps.
    pub(super) fn agree(
        &mut self,
        input: &flume::Receiver<Prepared>,
        g: &dyn Collective,
        device: tch::Device,
        stop: &Stop,
    ) -> anyhow::Result<Turn> {
        if self.held.is_none() && !self.exhausted {
            match next_prepared(input, stop) {
                Next::Batch(p) => self.held = Some(p),
                Next::Closed => self.exhausted = true,
                Next::Idle => {}
            }
        }
        let flags = [
            f64::from(u8::from(self.held.is_some() || self.exhausted)),
            f64::from(u8::from(stop.is_stopped())),
            f64::from(u8::from(self.held.is_some())),
        ];
        // Rank 0 may pause between steps (evaluating, snapshotting a
        // checkpoint): this wait ends when the others are ready or the
        // generation ends, not after the collective timeout (where the
        // collective can be cancelled: NCCL).
        let a = g.agree_between_steps(&flags, device).kind(ErrorKind::PeerLost)?;
        if a[1] > 0.0 {
            return Ok(Turn::Stopping);
        }
        if a[0] < g.world() as f64 || a[2] == 0.0 {
            return Ok(Turn::Wait);
        }
        Ok(Turn::Step(self.held.take()))
    }

    /// Shares every rank's outcome of the step with every rank.
    pub(super) fn gather(
        &mut self,
        g: &dyn Collective,
        own: &ReplicaReport,
        step: u64,
        device: tch::Device,
    ) -> anyhow::Result<()> {
        let (rank, world) = (g.rank(), g.world());
        let mut v = vec![0f64; world * GATHERED];
        let slot = &mut v[rank * GATHERED..(rank + 1) * GATHERED];
        slot[0] = own.batch_id.map_or(0.0, |id| id as f64 + 1.0);
        slot[1] = match &own.outcome {
            ReplicaOutcome::Trained(m) => {
                (slot[2], slot[3], slot[4], slot[5]) = (m.loss, m.accuracy, m.acceptance_length, m.tokens as f64);
                1.0
            }
            ReplicaOutcome::Skipped(_) => 2.0,
            ReplicaOutcome::Rejected(_) => 3.0,
            ReplicaOutcome::Duplicate => 4.0,
        };
        let all = g.agree(&v, device).kind(ErrorKind::PeerLost)?;
        self.gathered = (0..world)
            .filter(|&r| r != rank)
            .map(|r| {
                let s = &all[r * GATHERED..(r + 1) * GATHERED];
                let outcome = match s[1] as u8 {
                    1 => ReplicaOutcome::Trained(dflash_models::StepMetrics {
                        step,
                        loss: s[2],
                        accuracy: s[3],
                        acceptance_length: s[4],
                        tokens: s[5] as u64,
                        ..Default::default()
                    }),
                    2 => ReplicaOutcome::Skipped(format!("not finite on rank {r}")),
                    3 => ReplicaOutcome::Rejected(format!("rejected by rank {r}")),
                    _ => ReplicaOutcome::Duplicate,
                };
                ReplicaReport {
                    batch_id: (s[0] > 0.0).then(|| s[0] as u64 - 1),
                    member: self.names.get(r).cloned().unwrap_or_default(),
                    outcome,
                    busy: Duration::ZERO,
                }
            })
            .collect();
        Ok(())
    }
}
