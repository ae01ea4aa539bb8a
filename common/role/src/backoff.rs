//! The one retry helper: the written policy's delays
//! ([`dflash_telemetry::retry_delays`]: exponential from 200 ms to 5 s, with
//! jitter so that restarted peers do not come back in step), started over
//! after a success. Every retry loop of the roles waits through it; what a
//! loop does on each failure (retry, register again, give up) comes from the
//! policy's reaction to the error, which differs by loop.

use std::time::Duration;

use crate::Stop;

pub struct Backoff {
    delays: Box<dyn Iterator<Item = Duration> + Send + Sync>,
    restart: fn() -> Box<dyn Iterator<Item = Duration> + Send + Sync>,
    cap: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Backoff {
    /// The written policy's delays.
    pub fn new() -> Self {
        fn policy() -> Box<dyn Iterator<Item = Duration> + Send + Sync> {
            Box::new(dflash_telemetry::retry_delays())
        }
        Self { delays: policy(), restart: policy, cap: dflash_telemetry::RETRY_DELAY_CAP }
    }

    /// Delays for work that fails for longer (a full disk): exponential
    /// from 500 ms to 30 s, with jitter.
    pub fn slow() -> Self {
        fn slow() -> Box<dyn Iterator<Item = Duration> + Send + Sync> {
            use backon::BackoffBuilder;
            Box::new(
                backon::ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(500))
                    .with_max_delay(Duration::from_secs(30))
                    .with_jitter()
                    .without_max_times()
                    .build(),
            )
        }
        Self { delays: slow(), restart: slow, cap: Duration::from_secs(60) }
    }

    /// The next wait after a failure.
    pub fn next_delay(&mut self) -> Duration {
        self.delays.next().unwrap_or(self.cap)
    }

    /// A success: the next wait starts short again.
    pub fn reset(&mut self) {
        self.delays = (self.restart)();
    }

    /// Sleeps the next wait; false when `stop` came first.
    pub async fn sleep(&mut self, stop: &Stop) -> bool {
        let d = self.next_delay();
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = stop.stopped() => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap_and_start_over_after_a_success() {
        let mut b = Backoff::new();
        let first: Vec<Duration> = (0..12).map(|_| b.next_delay()).collect();
        assert!(first[0] <= Duration::from_millis(400), "{first:?}");
        assert!(first.iter().all(|d| *d <= dflash_telemetry::RETRY_DELAY_CAP), "{first:?}");
        assert!(first[11] >= Duration::from_secs(5), "grows to the 5 s step: {first:?}");
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(400));
        let mut slow = Backoff::slow();
        let d = slow.next_delay();
        assert!(d >= Duration::from_millis(500) && d <= Duration::from_secs(1), "{d:?}");
    }

    #[tokio::test]
    async fn a_stop_ends_the_wait() {
        let stop = Stop::new();
        stop.stop(crate::StopCause::Signal("test"));
        let mut b = Backoff::new();
        assert!(!b.sleep(&stop).await);
    }
}
