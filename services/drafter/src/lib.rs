//! The drafter service: the receiver of hidden-state streams (`receiver`,
//! served by [`dflash_wire::rpc`]), the plan's order (`sequencer`),
//! prefetch onto the training device (`prefetch`), the train loop with its
//! checkpoints and evaluation during training (`train_loop`), its reports
//! to the coordinator (`reporter`), and this drafter's membership in the
//! drafter group (`group`). The stages hand on the messages of `pipeline`:
//! each imports them from there, none from another stage.

pub mod device_health;
pub mod group;
pub mod pipeline;
pub mod prefetch;
pub mod receiver;
pub mod reporter;
pub mod sequencer;
pub mod train_loop;
