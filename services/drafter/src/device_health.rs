//! Whether this drafter's own devices still work. A device error that ends
//! a group's generation may be this member's GPU failing or a peer's
//! failure seen through a collective. The member probes its devices to tell
//! them apart: a peer's failure re-forms the group (exit 75, the member
//! joins the next generation); its own broken device takes only this member
//! out, for good (exit 76), so the group does not re-form around a dead GPU
//! forever. The same probe runs when the member starts, so a member started
//! again on a device that stays broken leaves before it joins.

use dflash_role::{Session, StopCause};

/// The first of `devices` that fails its probe, and why.
pub fn first_failing(devices: &[tch::Device]) -> Option<String> {
    devices.iter().find_map(|&d| dflash_models::cuda::probe_device(d).err())
}

/// Probes `devices` before this member takes part in training. A failure
/// in a group of several stops the member as lost (exit 76: the others go
/// on without it); alone, it is an error like any other.
pub fn check_at_start(session: &Session, devices: &[tch::Device]) -> anyhow::Result<()> {
    let Some(why) = first_failing(devices) else { return Ok(()) };
    let msg = format!("a device of this drafter fails its probe at start: {why}");
    if session.config.group.size > 1 {
        session.stop.stop(StopCause::DeviceLost(why));
    }
    Err(anyhow::anyhow!(msg))
}

/// After a device error ended this member's generation: Some(error) when
/// one of its own devices fails its probe (the member is stopped as lost),
/// None when they all pass (a peer's failure: the caller re-forms).
pub fn lost_after_error(session: &Session, devices: &[tch::Device], e: &anyhow::Error) -> Option<anyhow::Error> {
    let why = first_failing(devices)?;
    session.stop.stop(StopCause::DeviceLost(why.clone()));
    Some(anyhow::anyhow!(
        "{}; its device fails a probe since ({why}): this member leaves the drafter group for good",
        dflash_role::format_chain(e)
    ))
}
