//! The drafter pipeline's vocabulary: the messages its stages hand on, by
//! value, through bounded queues, and the record of trained batches they
//! share. Every stage imports its input and output from here, never from
//! another stage.
//!
//! ```text
//! receiver --Arrival--> HS queue --> sequencer --Arrival--> lane per replica
//!     --> prefetch --Prepared--> replica step (train loop)
//! ```
//!
//! The train loop's leader writes the [`TrainedSet`]; the replicas (a
//! batch trained already is a duplicate) and the sequencer (it does not
//! wait for one) read it.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use dflash_models::DeviceBatch;
use dflash_proto as pb;
use dflash_wire::HostBatch;

/// A verified batch waiting in the HS queue.
pub struct ReceivedBatch {
    pub batch: HostBatch,
    /// Open while the batch waits in the queue; prefetch closes it.
    pub queue_wait: tracing::Span,
}

/// What the receiver hands on (into the HS queue, then through the
/// sequencer to prefetch): a batch, or the plan's batch it rejected.
#[allow(clippy::large_enum_variant, reason = "moved by value through bounded queues; no allocation per batch")]
pub enum Arrival {
    Batch(ReceivedBatch),
    Rejected(pb::TrainedBatch),
}

impl Arrival {
    pub fn batch_id(&self) -> u64 {
        match self {
            Arrival::Batch(b) => b.batch.meta.batch_id,
            Arrival::Rejected(r) => r.batch_id,
        }
    }
}

/// What the train step takes, in the plan's order: a batch on the device,
/// or the plan's batch the receiver rejected (reported as skipped).
pub enum Prepared {
    Batch(DeviceBatch),
    Rejected(pb::TrainedBatch),
}

/// Batch ids trained in this checkpoint lineage, as every stage that must
/// know reads it: the replicas (a batch trained already is a duplicate)
/// and the sequencer (it does not wait for one). The train loop's leader
/// writes it, as it trains and when it resumes.
#[derive(Clone, Default)]
pub struct TrainedSet(Arc<Mutex<BTreeSet<u64>>>);

impl TrainedSet {
    fn ids(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
        // A panicking holder cannot leave the set half-written: every
        // write is one insert or one replacement.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn contains(&self, id: u64) -> bool {
        self.ids().contains(&id)
    }

    pub fn insert(&self, id: u64) {
        self.ids().insert(id);
    }

    /// The lineage resumed from a checkpoint: exactly what it trained.
    pub fn reset_to(&self, ids: impl IntoIterator<Item = u64>) {
        *self.ids() = ids.into_iter().collect();
    }
}
