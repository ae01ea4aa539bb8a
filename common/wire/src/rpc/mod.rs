//! Both ends of the hidden-state RPC (`Drafter.StreamHiddenStates`) below
//! tonic's codec, in one place: the target's call ([`open_hidden_state_stream`]),
//! the drafter's service ([`HiddenStateService`] over a [`StreamHandler`]),
//! the inbound message cutting they rest on ([`InboundStream`]), and the
//! HTTP/2 settings both sides use ([`transport`]).

mod client;
mod server;
pub mod transport;

pub use client::open_hidden_state_stream;
pub use server::{AckReceiver, AckSender, HiddenStateService, InboundStream, MAX_HELLO_BYTES, StreamHandler};
