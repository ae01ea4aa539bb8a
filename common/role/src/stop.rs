//! Why and when a role stops: one token every task listens to (and one
//! channel every blocking stage selects on beside its input), and the
//! first cause recorded.

use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

/// The reason a role is stopping.
#[derive(Clone, Debug, PartialEq)]
pub enum StopCause {
    /// The coordinator says every batch is trained and committed.
    RunCompleted,
    /// The coordinator failed the run (with the cause it recorded).
    RunFailed(String),
    /// An operator cancelled the run.
    RunCancelled(String),
    /// SIGTERM or SIGINT.
    Signal(&'static str),
    /// This role hit a fatal error (cause chain joined).
    Fatal(String),
    /// A peer this role depends on vanished past its timeout.
    PeerLost(String),
    /// The drafter group this member trained in ended (a member lost or
    /// one joining): the process exits to be started again and join the
    /// next generation from the last committed checkpoint.
    GroupReform(String),
    /// This drafter group member's own device failed and fails a probe
    /// since: it leaves the group for good (the others re-form without it)
    /// and is not to be started again on that device.
    DeviceLost(String),
}

/// Exit code of a drafter leaving a group that re-forms (EX_TEMPFAIL): a
/// supervisor starts it again (`dflash up`, Compose, Kubernetes).
pub const EXIT_GROUP_REFORM: i32 = 75;

/// Exit code of a drafter group member whose device failed persistently: it
/// left the group for good; a supervisor does not start it again on that
/// device (`dflash up` does not; the run goes on with the other members).
pub const EXIT_DEVICE_LOST: i32 = 76;

impl StopCause {
    /// Process exit code for this cause: 0 for completion and signals.
    pub fn exit_code(&self) -> i32 {
        match self {
            StopCause::RunCompleted | StopCause::Signal(_) => 0,
            StopCause::GroupReform(_) => EXIT_GROUP_REFORM,
            StopCause::DeviceLost(_) => EXIT_DEVICE_LOST,
            _ => 1,
        }
    }
}

impl std::fmt::Display for StopCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopCause::RunCompleted => write!(f, "run completed"),
            StopCause::RunFailed(m) => write!(f, "run failed: {m}"),
            StopCause::RunCancelled(m) => write!(f, "run cancelled: {m}"),
            StopCause::Signal(s) => write!(f, "received {s}"),
            StopCause::Fatal(m) => write!(f, "fatal error: {m}"),
            StopCause::GroupReform(m) => write!(f, "the drafter group re-forms: {m}"),
            StopCause::PeerLost(m) => write!(f, "peer lost: {m}"),
            StopCause::DeviceLost(m) => write!(f, "this member's device is lost, it leaves the drafter group: {m}"),
        }
    }
}

/// Shared stop signal: cancelled once, with the first cause kept.
#[derive(Clone)]
pub struct Stop {
    token: CancellationToken,
    cause: Arc<Mutex<Option<StopCause>>>,
    /// Dropped on stop: every receiver of `stopped` then disconnects, which
    /// wakes threads blocked in a [`flume::Selector`] at once.
    sender: Arc<Mutex<Option<flume::Sender<()>>>>,
    stopped: flume::Receiver<()>,
}

impl Default for Stop {
    fn default() -> Self {
        let (tx, rx) = flume::bounded(1);
        Self {
            token: CancellationToken::new(),
            cause: Arc::default(),
            sender: Arc::new(Mutex::new(Some(tx))),
            stopped: rx,
        }
    }
}

impl Stop {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `cause` (unless one is already recorded) and cancels.
    pub fn stop(&self, cause: StopCause) {
        {
            let mut c = self.cause.lock().expect("stop cause lock");
            if c.is_none() {
                *c = Some(cause);
            }
        }
        self.token.cancel();
        self.sender.lock().expect("stop sender lock").take();
    }

    pub fn is_stopped(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves once stopped.
    pub async fn stopped(&self) {
        self.token.cancelled().await
    }

    /// A channel that disconnects when the role stops (never carries a
    /// message): select on it beside a stage's input.
    pub fn channel(&self) -> &flume::Receiver<()> {
        &self.stopped
    }

    pub fn cause(&self) -> Option<StopCause> {
        self.cause.lock().expect("stop cause lock").clone()
    }

    /// Stops on SIGTERM or SIGINT (what Kubernetes and Ctrl-C send); run
    /// it as a stage ([`crate::Stages::spawn_task`]).
    pub fn on_signals(&self) -> impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static {
        use tokio::signal::unix::{SignalKind, signal};
        let this = self.clone();
        async move {
            let mut term = signal(SignalKind::terminate())?;
            let mut int = signal(SignalKind::interrupt())?;
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
                _ = this.stopped() => return Ok(()),
            };
            tracing::info!("{name} received: stopping");
            this.stop(StopCause::Signal(name));
            Ok(())
        }
    }
}

/// Blocking send on a bounded queue that gives up when the role stops;
/// false when the item was not delivered.
pub fn send_until_stop<T>(tx: &flume::Sender<T>, item: T, stop: &Stop) -> bool {
    if stop.is_stopped() {
        return false;
    }
    flume::Selector::new().send(tx, item, |r| r.is_ok()).recv(stop.channel(), |_| false).wait()
}

/// Blocking receive from a stage's input that gives up when the role
/// stops; None when the input closed or the role stopped.
pub fn recv_until_stop<T>(rx: &flume::Receiver<T>, stop: &Stop) -> Option<T> {
    if stop.is_stopped() {
        return None;
    }
    flume::Selector::new().recv(rx, Result::ok).recv(stop.channel(), |_| None).wait()
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn blocked_stages_wake_the_moment_the_role_stops() {
        let stop = Stop::new();
        let (tx, rx) = flume::bounded::<u32>(1);
        tx.send(1).unwrap();
        let (s1, s2, tx2, rx2) = (stop.clone(), stop.clone(), tx.clone(), rx.clone());
        let sender = std::thread::spawn(move || send_until_stop(&tx2, 2, &s1));
        let (_keep, empty) = flume::bounded::<u32>(1);
        let receiver = std::thread::spawn(move || recv_until_stop(&empty, &s2));
        std::thread::sleep(Duration::from_millis(50));
        let t0 = Instant::now();
        stop.stop(StopCause::Signal("test"));
        assert!(!sender.join().unwrap(), "the full queue's send gave up");
        assert_eq!(receiver.join().unwrap(), None, "the empty queue's receive gave up");
        assert!(t0.elapsed() < Duration::from_millis(50), "{:?}", t0.elapsed());
        assert_eq!(recv_until_stop(&rx2, &stop), None, "a stopped role takes nothing more");
    }
}
