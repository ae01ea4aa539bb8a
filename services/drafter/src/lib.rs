//! The drafter service: the data plane that receives hidden-state streams
//! (`data_plane`, `receiver`), prefetch onto the training device
//! (`prefetch`), the train loop with its checkpoints and reports
//! (`train_loop`), and evaluation during training (`periodic_eval`).

pub mod data_plane;
pub mod periodic_eval;
pub mod prefetch;
pub mod receiver;
pub mod train_loop;
