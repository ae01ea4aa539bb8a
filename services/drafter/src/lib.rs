//! The drafter service: the receiver of hidden-state streams (`receiver`,
//! served by [`dflash_wire::rpc`]), the plan's order (`sequencer`), prefetch onto the training device
//! (`prefetch`), the train loop with its checkpoints (`train_loop`), its
//! reports to the coordinator (`reporter`), and evaluation during training
//! (`periodic_eval`), and this drafter's membership in the drafter group
//! (`group`).

pub mod group;
pub mod periodic_eval;
pub mod prefetch;
pub mod receiver;
pub mod reporter;
pub mod sequencer;
pub mod train_loop;
