//! The coordinator's wall clock, one definition for the run and the ledger.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (lease expiries survive restarts).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
