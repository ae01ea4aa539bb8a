//! The target service: the frozen target forward with layer capture per
//! device (`forward`, its CUDA ids upload in `upload`, reuse of earlier
//! epochs in `feature_cache`), which hands a `captured::CapturedBatch` to
//! the postprocess pool (`postprocess`), the
//! hidden-state senders (`sender`, one set per drafter group member, which
//! `router` picks by each batch's lease), and the lease loop feeding them
//! (`work`). `pipeline` builds one instance's forward loop and
//! postprocessing, for the service and the capture bench. `inspect` checks a model directory the way the service loads it.

pub mod captured;
pub mod feature_cache;
pub mod forward;
pub mod inspect;
pub mod leases;
pub mod pipeline;
pub mod postprocess;
pub mod router;
pub mod sender;
pub mod upload;
pub mod work;
