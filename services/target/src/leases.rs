//! The batches a target holds leases on. A [`Lease`] travels with its
//! batch from the lease through forward, postprocess and the sender's
//! unacknowledged window; while any stage still owns it, heartbeats renew
//! it ([`Leases::ids`]). Dropping the batch (acknowledged, rejected, or
//! abandoned anywhere) gives the lease up, so no stage has to remember to.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// Every lease this target holds.
#[derive(Clone, Default)]
pub struct Leases(Arc<Mutex<BTreeSet<u64>>>);

impl Leases {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a lease the coordinator granted on `batch_id`.
    pub fn hold(&self, batch_id: u64) -> Lease {
        self.lock().insert(batch_id);
        Lease(Arc::new(Held { batch_id, leases: self.clone() }))
    }

    /// The batch ids held now (what a heartbeat renews).
    pub fn ids(&self) -> Vec<u64> {
        self.lock().iter().copied().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
        // The set stays consistent whatever a panicking holder did.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The lease on one batch; clones share it, and it ends with the last one.
#[derive(Clone)]
pub struct Lease(Arc<Held>);

impl Lease {
    pub fn batch_id(&self) -> u64 {
        self.0.batch_id
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({})", self.0.batch_id)
    }
}

struct Held {
    batch_id: u64,
    leases: Leases,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.leases.lock().remove(&self.batch_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_renewed_while_any_stage_owns_its_batch() {
        let leases = Leases::new();
        let a = leases.hold(3);
        let b = leases.hold(5);
        let a_copy = a.clone();
        assert_eq!(leases.ids(), vec![3, 5]);
        drop(a);
        assert_eq!(leases.ids(), vec![3, 5], "a clone still owns batch 3");
        drop(a_copy);
        assert_eq!(leases.ids(), vec![5]);
        drop(b);
        assert!(leases.ids().is_empty());
    }
}
