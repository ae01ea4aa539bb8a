//! Evaluation during training: held-out prompts decoded by real
//! speculative decoding with the drafter being trained, on its interval
//! and before the final checkpoint.

use std::path::Path;

use anyhow::Context;
use dflash_data::ChatTokenizer;
use dflash_models::evaluation::{EvalPrompt, EvalReport, PromptPick, evaluate, read_prompts};
use dflash_models::{LoadScope, TargetModel};
use tch::{Device, Kind};

use super::TrainLoop;

/// Evaluation during training: every `eval.interval_steps` steps (and at
/// the end) the drafter being trained decodes held-out prompts with the
/// full target, and tau goes to the log.
pub struct PeriodicEval {
    target: TargetModel,
    prompts: Vec<EvalPrompt>,
    max_new_tokens: usize,
    stop_ids: Vec<u32>,
    pub every: u64,
}

impl PeriodicEval {
    /// None when `eval.prompts_path` is empty or `eval.interval_steps` is 0.
    pub fn load(c: &dflash_config::RunConfig, device: Device, kind: Kind) -> anyhow::Result<Option<Self>> {
        let e = &c.eval;
        if e.prompts_path.is_empty() || e.interval_steps == 0 {
            return Ok(None);
        }
        let dir = c.model.target_dir().map_err(|e| anyhow::anyhow!(e))?;
        let dir = dir.as_path();
        let tok = ChatTokenizer::from_dir(dir)?;
        let pick = PromptPick {
            offset: e.prompts_offset as usize,
            limit: e.max_prompts as usize,
            per_category: e.per_category as usize,
        };
        let prompts = read_prompts(Path::new(&e.prompts_path), &tok, pick).context("eval.prompts_path")?;
        let target = TargetModel::load(dir, device, kind, LoadScope::Full)?;
        tracing::info!(
            "periodic evaluation: {} prompts from {}, every {} steps",
            prompts.len(),
            e.prompts_path,
            e.interval_steps
        );
        Ok(Some(Self {
            target,
            prompts,
            max_new_tokens: e.max_new_tokens as usize,
            stop_ids: tok.stop_ids,
            every: e.interval_steps,
        }))
    }

    /// Runs the evaluation and logs tau, and the drafter's cross-entropy and
    /// accuracy on the drafted slots of the outputs (held-out loss).
    pub fn run(&self, step: u64, trainer: &dflash_models::Trainer) -> EvalReport {
        let r = evaluate(
            &format!("step {step}"),
            &self.target,
            trainer.drafter(),
            trainer.embed(),
            trainer.lm_head(),
            &self.prompts,
            self.max_new_tokens,
            &self.stop_ids,
            None,
            &mut || {},
        );
        let cats: Vec<String> = r.per_category.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
        dflash_telemetry::metrics().acceptance_length.with_label_values(&["eval"]).set(r.tau);
        let slots = match (r.slot_cross_entropy, r.slot_accuracy) {
            (Some(ce), Some(acc)) => format!("; drafted slots: cross-entropy {ce:.4}, accuracy {:.1}%", 100.0 * acc),
            _ => String::new(),
        };
        tracing::info!(
            "eval at step {step}: acceptance length tau {:.3} over {} prompts ({:.1} tok/s; {}){slots}",
            r.tau,
            self.prompts.len(),
            r.tokens_per_s,
            cats.join(", ")
        );
        r
    }
}

impl TrainLoop {
    /// The evaluation on its interval, after a step that trained something
    /// (not once the run is trained: the final one comes with the final
    /// checkpoint).
    pub(super) fn evaluate_on_interval(&self, step: u64, trained_something: bool) {
        if let Some(e) = &self.eval
            && trained_something
            && e.every > 0
            && step.is_multiple_of(e.every)
            && !self.reporter.all_trained()
        {
            e.run(step, &self.trainer);
        }
    }

    /// The evaluation of the trained drafter, before the final checkpoint.
    pub(super) fn evaluate_final(&self) {
        if let Some(e) = self.eval.as_ref().filter(|e| e.every > 0) {
            e.run(self.trainer.step(), &self.trainer);
        }
    }
}
