//! The coordinator: owns the run config, the ledger of work, the registry
//! of role instances, health, and the run's fate.

pub mod clock;
pub mod flow;
pub mod group;
pub mod ledger;
pub mod plan;
pub mod run;
pub mod service;
