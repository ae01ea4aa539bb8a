//! One replica's step: take a batch if one comes within a short wait,
//! compute its gradients, agree with the other replicas, average, step.
//! The leader's replica runs inside the train loop; every other rank runs
//! [`follow_member`].

use std::time::{Duration, Instant};

use dflash_models::collective::Collective;
use dflash_models::{StepMetrics, StepOutcome};
use dflash_role::KindExt;
use dflash_telemetry::ErrorKind;

use super::lockstep::{GroupMember, Turn};
use super::step::{Agreement, Next, ReplicaOutcome, ReplicaReport, next_prepared};
use crate::pipeline::{Prepared, TrainedSet};

/// One replica's side of the lockstep: take a batch if one comes within a
/// short wait, compute its gradients, agree with the other replicas on who
/// contributes and whether to stop, average gradients, step. Every replica
/// takes the same optimizer steps, so their weights stay identical.
pub struct ReplicaStep {
    pub input: flume::Receiver<Prepared>,
    pub group: Option<Box<dyn Collective>>,
    pub trained: TrainedSet,
    pub device: tch::Device,
    /// Verify every this many steps that the replicas hold identical weights.
    pub check_every: u64,
    /// This process's instance id (the member its replicas belong to).
    pub member: String,
    /// Set with `group` (a group of several ranks): see [`GroupMember`].
    pub group_member: Option<GroupMember>,
}

impl ReplicaStep {
    pub fn world(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.world())
    }

    pub fn step(
        &mut self,
        trainer: &mut dflash_models::Trainer,
        stop: &dflash_role::Stop,
    ) -> anyhow::Result<(ReplicaReport, Agreement)> {
        if self.group_member.is_some() {
            return self.member_step(trainer, stop);
        }
        let prepared = match next_prepared(&self.input, stop) {
            Next::Batch(p) => Some(p),
            Next::Idle | Next::Closed => None,
        };
        self.train_step(trainer, prepared, stop)
    }

    /// A group rank's step: first every rank says whether it is ready.
    fn member_step(
        &mut self,
        trainer: &mut dflash_models::Trainer,
        stop: &dflash_role::Stop,
    ) -> anyhow::Result<(ReplicaReport, Agreement)> {
        let m = self.group_member.as_mut().expect("a group member");
        let g = self.group.as_deref().expect("a group member has a collective");
        let turn = m.agree(&self.input, g, self.device, stop)?;
        let idle = ReplicaReport {
            batch_id: None,
            member: self.member.clone(),
            outcome: ReplicaOutcome::Duplicate,
            busy: Duration::ZERO,
        };
        let prepared = match turn {
            Turn::Stopping => return Ok((idle, Agreement { any_batch: false, stopping: true })),
            Turn::Wait => return Ok((idle, Agreement { any_batch: false, stopping: false })),
            Turn::Step(prepared) => prepared,
        };
        let (report, agreement) = self.train_step(trainer, prepared, stop)?;
        let m = self.group_member.as_mut().expect("a group member");
        let g = self.group.as_deref().expect("a group member has a collective");
        m.gather(g, &report, trainer.step(), self.device)?;
        Ok((report, agreement))
    }

    /// Trains `prepared` (if any) in lockstep with the other replicas.
    fn train_step(
        &mut self,
        trainer: &mut dflash_models::Trainer,
        prepared: Option<Prepared>,
        stop: &dflash_role::Stop,
    ) -> anyhow::Result<(ReplicaReport, Agreement)> {
        let (batch, rejected) = match prepared {
            Some(Prepared::Batch(b)) => (Some(b), None),
            Some(Prepared::Rejected(r)) => (None, Some(r)),
            None => (None, None),
        };
        let t0 = Instant::now();
        let span = batch.as_ref().map(|b| dflash_telemetry::batch_span("train_step", &b.trace_context, b.batch_id));
        let _entered = span.as_ref().map(tracing::Span::enter);
        let mut report = ReplicaReport {
            batch_id: batch.as_ref().map(|b| b.batch_id).or(rejected.as_ref().map(|r| r.batch_id)),
            member: self.member.clone(),
            outcome: ReplicaOutcome::Duplicate,
            busy: Duration::ZERO,
        };
        if let Some(r) = rejected {
            report.outcome = ReplicaOutcome::Rejected(r.skip_reason);
        }
        let mut contributes = false;
        let mut pending = None;
        if let Some(b) = &batch {
            let dup = self.trained.contains(b.batch_id);
            if !dup {
                // Alone, the gradients' norm is final now and comes back
                // with the metrics; replicas read it after the exchange.
                let (outcome, norm) = match self.group {
                    None => trainer.compute_gradients_with_norm(b),
                    Some(_) => (trainer.compute_gradients(b), None),
                };
                match outcome {
                    StepOutcome::Trained(m) => {
                        contributes = true;
                        pending = Some((m, norm));
                    }
                    StepOutcome::Skipped(r) => report.outcome = ReplicaOutcome::Skipped(r),
                }
            }
        }
        let flags = [
            f64::from(u8::from(contributes)),
            f64::from(u8::from(report.batch_id.is_some())),
            f64::from(u8::from(stop.is_stopped())),
        ];
        let agreed = match &self.group {
            Some(g) => g.agree(&flags, self.device).kind(ErrorKind::Device)?,
            None => flags.to_vec(),
        };
        let agreement = Agreement { any_batch: agreed[1] > 0.0, stopping: agreed[2] > 0.0 };
        if !agreement.stopping && agreed[0] > 0.0 {
            if let Some(g) = &self.group {
                g.average_gradients(&trainer.drafter().named_parameters(), agreed[0]).kind(ErrorKind::Device)?;
            }
            let applied = match pending.take() {
                Some((m, Some(norm))) => trainer.apply_gradients_with_norm(m, norm),
                Some((m, None)) => trainer.apply_gradients(m),
                None => trainer.apply_gradients(StepMetrics::default()),
            };
            match applied {
                StepOutcome::Trained(m) if contributes => report.outcome = ReplicaOutcome::Trained(m),
                StepOutcome::Trained(_) => {}
                StepOutcome::Skipped(r) if contributes => report.outcome = ReplicaOutcome::Skipped(r),
                StepOutcome::Skipped(_) => {}
            }
            if let Some(g) = &self.group
                && trainer.step().is_multiple_of(self.check_every.max(1))
            {
                let sum =
                    g.check_identical(&trainer.drafter().named_parameters(), self.device).kind(ErrorKind::Device)?;
                if g.rank() == 0 {
                    tracing::info!(
                        "step {}: weights identical on all {} replicas (checksum {sum:.6e})",
                        trainer.step(),
                        g.world()
                    );
                }
            }
        }
        report.busy = t0.elapsed();
        Ok((report, agreement))
    }
}

/// A rank other than 0 (another replica of this member, or of another
/// member): steps in lockstep and keeps its own record of what it trained
/// (replays are not trained twice); rank 0 learns its outcomes through the
/// collective and reports them.
pub fn follow_member(
    mut trainer: dflash_models::Trainer,
    mut replica: ReplicaStep,
    stop: dflash_role::Stop,
) -> anyhow::Result<()> {
    loop {
        let (report, flags) = replica.step(&mut trainer, &stop)?;
        if flags.stopping {
            return Ok(());
        }
        if let Some(id) = report.batch_id
            && !matches!(report.outcome, ReplicaOutcome::Duplicate)
        {
            replica.trained.insert(id);
        }
    }
}
