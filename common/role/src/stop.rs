//! Why and when a role stops: one token every task listens to, and the
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
}

impl StopCause {
    /// Process exit code for this cause: 0 for completion and signals.
    pub fn exit_code(&self) -> i32 {
        match self {
            StopCause::RunCompleted | StopCause::Signal(_) => 0,
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
            StopCause::PeerLost(m) => write!(f, "peer lost: {m}"),
        }
    }
}

/// Shared stop signal: cancelled once, with the first cause kept.
#[derive(Clone, Default)]
pub struct Stop {
    token: CancellationToken,
    cause: Arc<Mutex<Option<StopCause>>>,
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
    }

    pub fn is_stopped(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves once stopped.
    pub async fn stopped(&self) {
        self.token.cancelled().await
    }

    /// Blocks a non-async thread until stopped.
    pub fn stopped_blocking(&self) {
        while !self.is_stopped() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    pub fn cause(&self) -> Option<StopCause> {
        self.cause.lock().expect("stop cause lock").clone()
    }

    /// Stops on SIGTERM or SIGINT (what Kubernetes and Ctrl-C send).
    pub fn stop_on_signals(&self) {
        use tokio::signal::unix::{SignalKind, signal};
        let this = self.clone();
        tokio::spawn(async move {
            let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
                tracing::error!("cannot install signal handlers");
                return;
            };
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
                _ = this.stopped() => return,
            };
            tracing::info!("{name} received: stopping");
            this.stop(StopCause::Signal(name));
        });
    }
}

/// Blocking send on a bounded queue that gives up when the role stops
/// (checking every 100 ms); false when the item was not delivered.
pub fn send_until_stop<T>(tx: &flume::Sender<T>, mut item: T, stop: &Stop) -> bool {
    loop {
        match tx.send_timeout(item, std::time::Duration::from_millis(100)) {
            Ok(()) => return true,
            Err(flume::SendTimeoutError::Timeout(back)) if !stop.is_stopped() => item = back,
            Err(_) => return false,
        }
    }
}
