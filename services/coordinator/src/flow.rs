//! Supply and demand: how many feature tokens the targets produce and the
//! drafter trains per second, and which side bounds the run, so an operator
//! can move GPUs between the roles.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Rates are computed over this window.
const WINDOW: Duration = Duration::from_secs(60);
/// Samples kept (one per monitor tick at most; bounded).
const MAX_SAMPLES: usize = 4096;

pub struct Flow {
    /// When a target last produced a token (or the flow began).
    last_supply: Instant,
    /// When the drafter last trained a token (or the flow began).
    last_training: Instant,
    /// Last cumulative count each target reported (restarts start at 0).
    produced_by: BTreeMap<String, u64>,
    busy_by: BTreeMap<String, f32>,
    produced_total: u64,
    trained_total: u64,
    drafter_wait: f32,
    samples: VecDeque<(Instant, u64, u64)>,
}

/// A summary for the status and the log.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FlowSummary {
    pub supply_tokens_per_s: f64,
    pub demand_tokens_per_s: f64,
    pub targets_busy: f32,
    pub drafter_wait: f32,
    pub bound_by: &'static str,
}

impl Default for Flow {
    fn default() -> Self {
        Self {
            last_supply: Instant::now(),
            last_training: Instant::now(),
            produced_by: BTreeMap::new(),
            busy_by: BTreeMap::new(),
            produced_total: 0,
            trained_total: 0,
            drafter_wait: 0.0,
            samples: VecDeque::new(),
        }
    }
}

impl Flow {
    /// How long no target has produced a token (since the flow began, if
    /// none ever did).
    pub fn supply_silent_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_supply)
    }

    /// Whether any target has produced a token in this flow.
    pub fn has_supplied(&self) -> bool {
        self.produced_total > 0
    }

    /// How long neither a target produced a token nor the drafter trained
    /// one: training that waits on work that does not come. (Supply alone
    /// is silent whenever the drafter bounds the run: the targets wait for
    /// its credits while it trains what it holds.)
    pub fn starved_for(&self, now: Instant) -> Duration {
        self.supply_silent_for(now).min(now.saturating_duration_since(self.last_training))
    }

    /// A target's heartbeat: its cumulative tokens and busy fraction.
    pub fn target_report(&mut self, instance: &str, tokens_produced: u64, busy: f32) {
        let last = self.produced_by.insert(instance.to_string(), tokens_produced).unwrap_or(0);
        let new = tokens_produced.saturating_sub(last.min(tokens_produced));
        if new > 0 {
            self.last_supply = Instant::now();
        }
        self.produced_total += new;
        self.busy_by.insert(instance.to_string(), busy);
    }

    /// A target is gone: forget its busy fraction.
    pub fn target_gone(&mut self, instance: &str) {
        self.busy_by.remove(instance);
    }

    /// The drafter trained `tokens` and waited this fraction of its time.
    pub fn drafter_report(&mut self, tokens: u64, wait: f32) {
        if tokens > 0 {
            self.last_training = Instant::now();
        }
        self.trained_total += tokens;
        self.drafter_wait = wait;
    }

    pub fn sample(&mut self, now: Instant) {
        self.samples.push_back((now, self.produced_total, self.trained_total));
        while self.samples.len() > MAX_SAMPLES || self.samples.front().is_some_and(|s| now - s.0 > WINDOW) {
            self.samples.pop_front();
        }
    }

    pub fn summary(&self) -> FlowSummary {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return FlowSummary { bound_by: "unknown", ..FlowSummary::default() };
        };
        let secs = (last.0 - first.0).as_secs_f64();
        if secs < 1.0 {
            return FlowSummary { bound_by: "unknown", ..FlowSummary::default() };
        }
        let supply = (last.1 - first.1) as f64 / secs;
        let demand = (last.2 - first.2) as f64 / secs;
        let busy =
            if self.busy_by.is_empty() { 0.0 } else { self.busy_by.values().sum::<f32>() / self.busy_by.len() as f32 };
        // The side that never waits is the one that bounds the run.
        let bound_by = if demand == 0.0 && supply == 0.0 {
            "idle"
        } else if self.drafter_wait < 0.05 && busy < 0.9 {
            "drafter"
        } else if self.drafter_wait > 0.2 {
            "targets"
        } else {
            "balanced"
        };
        FlowSummary {
            supply_tokens_per_s: supply,
            demand_tokens_per_s: demand,
            targets_busy: busy,
            drafter_wait: self.drafter_wait,
            bound_by,
        }
    }
}

impl std::fmt::Display for FlowSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "supply {:.0} tokens/s (targets busy {:.0}%), demand {:.0} tokens/s (drafter waiting {:.0}%): ",
            self.supply_tokens_per_s,
            100.0 * self.targets_busy,
            self.demand_tokens_per_s,
            100.0 * self.drafter_wait
        )?;
        match self.bound_by {
            "drafter" => write!(f, "the drafter bounds the run; more drafter GPUs (or fewer target GPUs) would help"),
            "targets" => write!(f, "the targets bound the run; more target GPUs (or fewer drafter GPUs) would help"),
            other => write!(f, "{other}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_the_bounding_side() {
        let mut f = Flow::default();
        let t0 = Instant::now();
        f.sample(t0);
        f.target_report("t0", 10_000, 0.3);
        f.target_report("t0", 20_000, 0.3); // cumulative: +10,000 more
        f.drafter_report(15_000, 0.0);
        f.sample(t0 + Duration::from_secs(10));
        let s = f.summary();
        assert_eq!((s.supply_tokens_per_s, s.demand_tokens_per_s), (2000.0, 1500.0));
        assert_eq!(s.bound_by, "drafter");
        f.drafter_report(0, 0.5);
        assert_eq!(f.summary().bound_by, "targets");
        // A restarted target counts from zero again without going negative.
        f.target_report("t0", 500, 0.3);
        f.sample(t0 + Duration::from_secs(11));
        assert!(f.summary().supply_tokens_per_s > 0.0);
    }

    #[test]
    fn training_that_goes_on_while_supply_waits_is_not_starved() {
        let mut f = Flow::default();
        std::thread::sleep(Duration::from_millis(30));
        f.drafter_report(100, 0.0);
        let now = Instant::now();
        assert!(f.supply_silent_for(now) >= Duration::from_millis(30));
        assert!(f.starved_for(now) < Duration::from_millis(30), "the drafter trains: not starved");
        std::thread::sleep(Duration::from_millis(30));
        f.drafter_report(0, 1.0); // a report that trained nothing keeps the clock
        assert!(f.starved_for(Instant::now()) >= Duration::from_millis(30));
        f.target_report("t0", 10, 1.0);
        assert!(f.starved_for(Instant::now()) < Duration::from_millis(30), "supply came");
    }
}
