//! What the leader shows of the steps: a log line every
//! `run.log_every_steps` (throughput, input wait) and the metrics endpoint.

use std::time::{Duration, Instant};

/// Throughput and input wait over the window of the log line.
pub(super) struct ProgressLog {
    started: Instant,
    pub(super) tokens: u64,
    wait: Duration,
    /// Fraction of the current window spent waiting for input.
    pub(super) input_wait: f32,
    /// No step logged by this process yet: a resumed drafter logs its first.
    first: bool,
}

impl ProgressLog {
    pub(super) fn new() -> Self {
        Self { started: Instant::now(), tokens: 0, wait: Duration::ZERO, input_wait: 0.0, first: true }
    }

    pub(super) fn waited(&mut self, d: Duration) {
        self.wait += d;
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        self.input_wait = (self.wait.as_secs_f64() / secs) as f32;
    }

    /// Whether `step` gets a line: every `every` steps, and this process's first.
    fn due(&mut self, step: u64, every: u64) -> bool {
        std::mem::take(&mut self.first) || step.is_multiple_of(every.max(1))
    }

    /// The step's line every `log_every_steps` (and this process's first
    /// step, so a resume shows when training went on); a new window after it.
    pub(super) fn step(
        &mut self,
        c: &dflash_config::RunConfig,
        step: u64,
        m: &dflash_models::StepMetrics,
        queue: usize,
    ) {
        if !self.due(step, c.run.log_every_steps) {
            return;
        }
        let secs = self.started.elapsed().as_secs_f64();
        // DFlash2: how often the label is among the selector's candidates
        // (this process's micro-batches).
        let recall = m.candidate_recall.map_or_else(String::new, |r| format!(" | recall {r:.3}"));
        tracing::info!(
            "step {step}/{} | loss {:.4} | acc {:.3} | accept {:.2}{recall} | lr {:.2e} | grad {:.2} | {:.0} tok/s | queue {}/{} | wait {:.0}%",
            c.training.total_steps,
            m.loss,
            m.accuracy,
            m.acceptance_length,
            m.lr,
            m.grad_norm,
            self.tokens as f64 / secs,
            queue,
            c.pipeline.hs_queue_depth,
            100.0 * self.wait.as_secs_f64() / secs
        );
        *self = Self { input_wait: self.input_wait, first: false, ..Self::new() };
    }
}

/// The leader's view of one step, for the metrics endpoint.
pub(super) fn export_step_metrics(
    step: u64,
    m: Option<&dflash_models::StepMetrics>,
    tokens: u64,
    input_wait: f32,
    queue: usize,
    step_seconds: f64,
) {
    let g = dflash_telemetry::metrics();
    g.step.set(step as f64);
    g.idle_fraction.with_label_values(&["train"]).set(f64::from(input_wait));
    g.queue_depth.with_label_values(&["hs_queue"]).set(queue as i64);
    if let Some(m) = m {
        g.tokens.with_label_values(&["trained"]).inc_by(tokens);
        g.batches.with_label_values(&["trained"]).inc();
        g.loss.set(m.loss);
        g.accuracy.set(m.accuracy);
        g.acceptance_length.with_label_values(&["simulated"]).set(m.acceptance_length);
        g.step_seconds.observe(step_seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::ProgressLog;

    #[test]
    fn a_process_logs_its_first_step_then_every_nth() {
        let mut log = ProgressLog::new();
        let logged: Vec<u64> = (41..=75).filter(|&s| log.due(s, 10)).collect();
        assert_eq!(logged, [41, 50, 60, 70]);
    }
}
