//! The progress line of `dflash up`: the run's key figures, read from the
//! coordinator's status every few seconds.

use std::time::Duration;

use dflash_proto as pb;
use dflash_role::{Security, coordinator_client, with_timeout};

/// One line with the figures an operator watches.
pub fn progress_line(s: &pb::StatusResponse) -> String {
    let l = s.ledger.unwrap_or_default();
    // Committed batches were trained first.
    let trained = l.trained + l.committed;
    let pct = if l.total > 0 { 100.0 * trained as f64 / l.total as f64 } else { 0.0 };
    let mut line = format!(
        "step {} | trained {trained}/{} batches ({pct:.0}%), committed {} | loss {:.3} acc {:.3} accept {:.2}",
        s.step, l.total, l.committed, s.loss, s.accuracy, s.acceptance_length
    );
    if s.bound_by != "unknown" && !s.bound_by.is_empty() {
        line.push_str(&format!(
            " | supply {:.0} tok/s, demand {:.0} tok/s, bound by {}",
            s.supply_tokens_per_s, s.demand_tokens_per_s, s.bound_by
        ));
    }
    if !s.errors.is_empty() {
        line.push_str(&format!(" | {} error(s)", s.errors.len()));
    }
    for a in &s.alarms {
        line.push_str(&format!(" | ALARM {a}"));
    }
    line
}

/// Prints a progress line every `every` until aborted.
pub async fn report(url: &str, security: &Security, every: Duration) {
    let Ok(mut client) = coordinator_client(url, security) else { return };
    let mut last = String::new();
    loop {
        tokio::time::sleep(every).await;
        if let Ok(s) = with_timeout(Duration::from_secs(5), client.status(pb::StatusRequest {})).await {
            let line = progress_line(&s);
            // A stalled run prints nothing new rather than the same line again.
            if line != last && s.step > 0 {
                println!("[progress   ] {line}");
                last = line;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_shows_progress_quality_and_flow() {
        let s = pb::StatusResponse {
            step: 40,
            loss: 3.25,
            accuracy: 0.5,
            acceptance_length: 1.75,
            ledger: Some(pb::LedgerCounts { trained: 10, committed: 30, total: 160, ..Default::default() }),
            supply_tokens_per_s: 5000.0,
            demand_tokens_per_s: 4000.0,
            bound_by: "drafter".into(),
            ..Default::default()
        };
        assert_eq!(
            progress_line(&s),
            "step 40 | trained 40/160 batches (25%), committed 30 | loss 3.250 acc 0.500 accept 1.75 \
             | supply 5000 tok/s, demand 4000 tok/s, bound by drafter"
        );
    }
}
