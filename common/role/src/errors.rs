//! Tags an error carries to the coordinator and into the logs: its policy
//! kind ([`RoleError`], [`KindExt`]), the device it happened on
//! ([`DeviceError`], [`DeviceExt`]), and its cause chain as one line
//! ([`format_chain`]). The session reports them; every stage formats them.

use dflash_telemetry::ErrorKind;

/// An error with its policy kind attached (see [`ErrorKind`]). Displays
/// as the error it wraps, so cause chains do not repeat it.
#[derive(Debug)]
pub struct RoleError {
    pub kind: ErrorKind,
    pub source: anyhow::Error,
}

impl std::fmt::Display for RoleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for RoleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

/// The policy kind of an error: the outermost [`RoleError`] in its chain,
/// else `internal`.
pub fn kind_of(e: &anyhow::Error) -> ErrorKind {
    links(e).into_iter().find_map(|c| c.downcast_ref::<RoleError>()).map_or(ErrorKind::Internal, |r| r.kind)
}

/// Every error in `e`'s chain, the errors the tags ([`RoleError`],
/// [`DeviceError`]) wrap included: a tag stands in for the error it wraps,
/// so the plain chain skips that error.
fn links(e: &anyhow::Error) -> Vec<&(dyn std::error::Error + 'static)> {
    let mut out = Vec::new();
    for c in e.chain() {
        out.push(c);
        let inner = c.downcast_ref::<RoleError>().map(|r| &r.source);
        if let Some(inner) = inner.or_else(|| c.downcast_ref::<DeviceError>().map(|d| &d.source)) {
            out.extend(links(inner));
            break;
        }
    }
    out
}

/// Tags an error with its kind for the coordinator's policy.
pub trait KindExt<T> {
    fn kind(self, kind: ErrorKind) -> anyhow::Result<T>;
}

impl<T, E: Into<anyhow::Error>> KindExt<T> for Result<T, E> {
    fn kind(self, kind: ErrorKind) -> anyhow::Result<T> {
        self.map_err(|e| RoleError { kind, source: e.into() }.into())
    }
}

/// `outer: inner: innermost` for logs.
pub fn format_chain(e: &anyhow::Error) -> String {
    dflash_telemetry::cause_chain(e.as_ref()).join(": ")
}

/// An error that happened on one device (a GPU's forward, a replica's
/// step). Displays as the error it wraps; the device goes into the
/// coordinator's error report.
#[derive(Debug)]
pub struct DeviceError {
    pub device: String,
    pub source: anyhow::Error,
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for DeviceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

/// The device an error happened on: the innermost [`DeviceError`] in its
/// chain, else empty.
pub fn device_of(e: &anyhow::Error) -> String {
    links(e)
        .into_iter()
        .filter_map(|c| c.downcast_ref::<DeviceError>())
        .last()
        .map_or_else(String::new, |d| d.device.clone())
}

/// Tags an error with the device it happened on.
pub trait DeviceExt<T> {
    fn on_device(self, device: impl std::fmt::Display) -> anyhow::Result<T>;
}

impl<T, E: Into<anyhow::Error>> DeviceExt<T> for Result<T, E> {
    fn on_device(self, device: impl std::fmt::Display) -> anyhow::Result<T> {
        self.map_err(|e| DeviceError { device: device.to_string(), source: e.into() }.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_and_device_are_found_through_each_other_and_contexts() {
        use anyhow::Context;
        let e = Err::<(), _>(anyhow::anyhow!("CUDA out of memory"))
            .kind(ErrorKind::Device)
            .context("forward of batch 7")
            .on_device("cuda:1")
            .context("stage forward-cuda:1")
            .unwrap_err();
        assert_eq!((kind_of(&e), device_of(&e).as_str()), (ErrorKind::Device, "cuda:1"));
        assert_eq!(format_chain(&e), "stage forward-cuda:1: forward of batch 7: CUDA out of memory");
        let plain = anyhow::anyhow!("no device");
        assert_eq!((kind_of(&plain), device_of(&plain).as_str()), (ErrorKind::Internal, ""));
    }
}
