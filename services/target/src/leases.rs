//! The batches a target holds leases on. A [`Lease`] travels with its
//! batch from the lease through forward, postprocess and the sender's
//! unacknowledged window; while any stage still owns it, heartbeats renew
//! it ([`Leases::ids`]). Dropping the batch (acknowledged, rejected, or
//! abandoned anywhere) gives the lease up, so no stage has to remember to.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Every lease this target holds (a batch leased again while a stale copy
/// from an ended drafter generation is still on its way out counts twice).
#[derive(Clone, Default)]
pub struct Leases(Arc<Mutex<BTreeMap<u64, usize>>>);

/// The drafter group member a leased batch goes to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Destination {
    pub generation: u64,
    pub instance_id: String,
    pub endpoint: String,
}

impl Leases {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a lease the coordinator granted on `batch_id`, for the
    /// group member `destination`.
    pub fn hold(&self, batch_id: u64, destination: Destination) -> Lease {
        *self.lock().entry(batch_id).or_default() += 1;
        Lease(Arc::new(Held { batch_id, destination, leases: self.clone() }))
    }

    /// The batch ids held now (what a heartbeat renews).
    pub fn ids(&self) -> Vec<u64> {
        self.lock().keys().copied().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, usize>> {
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

    /// The member the batch goes to.
    pub fn destination(&self) -> &Destination {
        &self.0.destination
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({})", self.0.batch_id)
    }
}

struct Held {
    batch_id: u64,
    destination: Destination,
    leases: Leases,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.leases.lock();
        if let Some(n) = held.get_mut(&self.batch_id) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.batch_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_renewed_while_any_stage_owns_its_batch() {
        let leases = Leases::new();
        let a = leases.hold(3, Destination::default());
        let b = leases.hold(5, Destination::default());
        let a_copy = a.clone();
        assert_eq!(leases.ids(), vec![3, 5]);
        drop(a);
        assert_eq!(leases.ids(), vec![3, 5], "a clone still owns batch 3");
        drop(a_copy);
        assert_eq!(leases.ids(), vec![5]);
        drop(b);
        assert!(leases.ids().is_empty());
    }

    #[test]
    fn a_batch_leased_again_while_a_stale_copy_leaves_stays_held() {
        let leases = Leases::new();
        let stale = leases.hold(7, Destination { generation: 1, ..Default::default() });
        let fresh = leases.hold(7, Destination { generation: 2, ..Default::default() });
        drop(stale);
        assert_eq!(leases.ids(), vec![7]);
        assert_eq!(fresh.destination().generation, 2);
        drop(fresh);
        assert!(leases.ids().is_empty());
    }
}
