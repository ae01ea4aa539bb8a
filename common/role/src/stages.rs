//! Running a role's pipeline stages (threads for compute, tasks for I/O):
//! every thread and task a role starts is owned here, so that the first
//! failure stops the role with its cause and stopping joins every one of
//! them (with a bound, naming what did not stop).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::errors::format_chain;
use crate::{Stop, StopCause};

/// Join handles with the stage names they belong to.
type Named<T> = Arc<Mutex<Vec<(String, T)>>>;

/// The stages of one role and the first error any of them returned.
#[derive(Clone)]
pub struct Stages {
    stop: Stop,
    first_error: Arc<Mutex<Option<anyhow::Error>>>,
    threads: Named<std::thread::JoinHandle<()>>,
    tasks: Named<tokio::task::JoinHandle<()>>,
    tracker: tokio_util::task::TaskTracker,
}

impl Stages {
    pub fn new(stop: Stop) -> Self {
        Self {
            stop,
            first_error: Arc::new(Mutex::new(None)),
            threads: Arc::new(Mutex::new(Vec::new())),
            tasks: Arc::new(Mutex::new(Vec::new())),
            tracker: tokio_util::task::TaskTracker::new(),
        }
    }

    /// The role's stop signal.
    pub fn stop(&self) -> &Stop {
        &self.stop
    }

    fn fail(&self, name: &str, e: anyhow::Error) {
        let e = e.context(format!("stage {name}"));
        let line = format_chain(&e);
        let mut slot = self.first_error.lock().expect("first error lock");
        if slot.is_none() {
            *slot = Some(e);
        }
        drop(slot);
        self.stop.stop(StopCause::Fatal(line));
    }

    /// Runs blocking work (a forward or train loop) on its own OS thread.
    /// A panic counts as an error.
    pub fn spawn_thread(&self, name: &str, f: impl FnOnce() -> anyhow::Result<()> + Send + 'static) {
        self.try_spawn_thread(name, f).expect("spawn thread");
    }

    /// [`Stages::spawn_thread`] for threads started per connection, where
    /// the OS refusing a thread must refuse that connection, not stop the
    /// role.
    pub fn try_spawn_thread(
        &self,
        name: &str,
        f: impl FnOnce() -> anyhow::Result<()> + Send + 'static,
    ) -> std::io::Result<()> {
        let this = self.clone();
        let n = name.to_string();
        let handle =
            std::thread::Builder::new().name(name.to_string()).spawn(move || {
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => this.fail(&n, e),
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "unknown panic".into());
                        this.fail(&n, anyhow::anyhow!("panicked: {msg}"));
                    }
                }
            })?;
        let mut threads = self.threads.lock().expect("threads lock");
        // Keep the list to the threads still running (one per stream).
        threads.retain(|(_, h)| !h.is_finished());
        threads.push((name.to_string(), handle));
        Ok(())
    }

    /// Runs async work on the runtime.
    pub fn spawn_task(&self, name: &str, f: impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static) {
        let this = self.clone();
        let n = name.to_string();
        let handle = self.tracker.spawn(async move {
            if let Err(e) = f.await {
                this.fail(&n, e);
            }
        });
        let mut tasks = self.tasks.lock().expect("tasks lock");
        // Keep the list to the tasks still running (some stages spawn one
        // task per connection).
        tasks.retain(|(_, h)| !h.is_finished());
        tasks.push((name.to_string(), handle));
    }

    /// What is still running: (tasks, threads), by name.
    pub fn running(&self) -> (Vec<String>, Vec<String>) {
        let names = |v: &[(String, bool)]| v.iter().filter(|(_, done)| !done).map(|(n, _)| n.clone()).collect();
        let tasks: Vec<(String, bool)> =
            self.tasks.lock().expect("tasks lock").iter().map(|(n, h)| (n.clone(), h.is_finished())).collect();
        let threads: Vec<(String, bool)> =
            self.threads.lock().expect("threads lock").iter().map(|(n, h)| (n.clone(), h.is_finished())).collect();
        (names(&tasks), names(&threads))
    }

    /// The first stage error, if any (taken once).
    pub fn take_error(&self) -> Option<anyhow::Error> {
        self.first_error.lock().expect("first error lock").take()
    }

    /// Waits for every stage to end after a stop, at most `grace`; stages
    /// still running then are named in the log (threads are left to the
    /// process exit, tasks are aborted).
    pub async fn join(&self, grace: Duration) {
        self.tracker.close();
        let deadline = Instant::now() + grace;
        let tasks: Vec<_> = std::mem::take(&mut *self.tasks.lock().expect("tasks lock"));
        for (name, mut h) in tasks {
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, &mut h).await.is_err() {
                tracing::warn!("task {name} did not stop within {grace:?}; aborting it");
                h.abort();
            }
        }
        let threads: Vec<_> = std::mem::take(&mut *self.threads.lock().expect("threads lock"));
        for (name, h) in threads {
            while !h.is_finished() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if h.is_finished() {
                let _ = h.join();
            } else {
                tracing::warn!("thread {name} did not stop within {grace:?}");
                self.threads.lock().expect("threads lock").push((name, h));
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let _ = tokio::time::timeout(left, self.tracker.wait()).await;
        let (tasks, threads) = self.running();
        if tasks.is_empty() && threads.is_empty() {
            tracing::info!("every stage stopped: 0 tasks and 0 threads left running");
        } else {
            tracing::warn!(
                "{} task(s) and {} thread(s) left running: {tasks:?} {threads:?}",
                tasks.len(),
                threads.len()
            );
        }
    }
}
