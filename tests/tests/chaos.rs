//! Chaos: one CPU run under a seeded schedule of faults -- SIGKILL and
//! SIGSTOP/SIGCONT of the coordinator, the drafter and the targets, a
//! network cut between the targets and the drafter (and one target and the
//! coordinator), the drafter's replies stalled on its open connections
//! (acknowledgements held, keepalives answered: the targets give those
//! streams up after `faults.ack_timeout_ms` and replay), a checkpoint
//! write that fails, the checkpoint disk full (a tmpfs of the test's own
//! mount namespace, its size cut to what it holds until a checkpoint
//! fails with ENOSPC), the newest checkpoint corrupted before the drafter is
//! killed (it resumes from an older committed one and trains the rest
//! again), a slow drafter (stopped three quarters of the time) --
//! supervised as Kubernetes
//! would (a role that exits is started again). Training in the plan's order
//! with keyed randomness makes the run a function of its config, data and
//! seed: the final `model.safetensors` is bit-identical to an uninterrupted
//! run's, and the ledger holds every batch committed exactly once. The
//! schedule and each fault's recovery time are printed, with per fault kind
//! the count and the recovery median / max, and each role's resident memory
//! over the run (peak, and the slope of a line fitted through its samples).
//!
//! The suite runs 12 faults (13 with the second member's replacement) over
//! 6,000 samples with a drafter group of two members, each behind its own
//! proxy; a member killed is replaced by a new process (a new instance).
//! `scripts/chaos-soak.sh SECONDS SEED` runs the same test as a soak:
//! `DFLASH_CHAOS_SEED`, `DFLASH_CHAOS_FAULTS`, `DFLASH_CHAOS_SPACING_MS` and
//! `DFLASH_CHAOS_SAMPLES` (per epoch) and `DFLASH_CHAOS_EPOCHS` size it,
//! `DFLASH_CHAOS_MEMBERS` sets the group's
//! size (1: a drafter alone), `DFLASH_CHAOS_KEEP_LAST` bounds the
//! checkpoints its disk holds, and a recovery slower than
//! `DFLASH_CHAOS_SLOW_S` (10 s) has every role's log lines around it
//! printed (or written to `DFLASH_CHAOS_SLOW_LOG`). The test runs itself
//! again in a user and mount namespace of its own (`unshare`, no root) for
//! the checkpoint disk.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dflash_coordinator::ledger::Ledger;
use dflash_tests::proxy::Proxy;
use dflash_tests::{Cluster, Proc, Workspace};
use nix::sys::signal::Signal;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};

/// Every batch of one epoch; noise on the features (drawn by the drafter,
/// keyed by batch id); two targets, so batches arrive out of order.
const CONFIG: &str = "[run]\nmax_steps = 0\nseed = 3\n\
    [pipeline]\nmax_batch_size = 4\ntoken_budget = 512\n\
    [training]\nfeature_noise_std = 0.05\n\
    [checkpoint]\ninterval_steps = 8\nkeep_last = 0\n\
    [faults]\nlease_timeout_ms = 4000\nack_timeout_ms = 3000";

const SAMPLES: usize = 6000;

/// The size of the faulted run's checkpoint disk (a tmpfs: memory, as
/// much as it holds).
const DISK_BYTES: u64 = 4 << 30;

/// A setting of the soak from the environment, or its suite default.
fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Resident memory of `pid` in MB (`VmRSS`), None once it is gone.
fn rss_mb(pid: i32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Least-squares slope of `points` (seconds, MB) in MB per hour.
fn slope_per_hour(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let (sxy, sxx) = points.iter().fold((0.0, 0.0), |(a, b), p| (a + (p.0 - mx) * (p.1 - my), b + (p.0 - mx).powi(2)));
    if sxx == 0.0 { 0.0 } else { sxy / sxx * 3600.0 }
}

/// The median and the maximum of `v` (not empty).
fn median_max(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1])
}
const CHECKPOINT_INTERVAL: u64 = 8;

fn sha256(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Complete checkpoints (`step-*` folders) under `root`.
fn step_dirs(root: &Path) -> usize {
    std::fs::read_dir(root)
        .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("step-")).count())
        .unwrap_or(0)
}

/// The final (newest) checkpoint's weights.
fn final_weights(ckpt_root: &Path) -> PathBuf {
    let latest = std::fs::read_to_string(ckpt_root.join("latest")).unwrap();
    ckpt_root.join(latest.trim()).join("model.safetensors")
}

fn assert_exactly_once(ledger: &Path) -> usize {
    let audit = Ledger::open(ledger).unwrap().audit().unwrap();
    for a in &audit {
        assert_eq!((a.state.as_str(), a.commits), ("committed", 1), "{a:?}");
    }
    audit.len()
}

/// Seconds since the epoch of a log line's timestamp
/// (`2026-12-01T13:49:09.764960Z  INFO ...`).
fn log_time(line: &str) -> Option<f64> {
    let ts = line.split_whitespace().next()?;
    let t = time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339).ok()?;
    Some(t.unix_timestamp_nanos() as f64 / 1e9)
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// Every role's log lines (each log of the run's folder, restarts
/// included) stamped from `from` to `to`, in time order, each named by its
/// log; at most 600 lines, the first ones.
fn log_window(dir: &Path, from: f64, to: f64) -> String {
    let mut lines: Vec<(f64, String)> = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let name = path.file_stem().unwrap_or_default().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for l in text.lines() {
            if let Some(t) = log_time(l).filter(|t| (from..=to).contains(t)) {
                lines.push((t, format!("  {name:<16} {l}")));
            }
        }
    }
    lines.sort_by(|a, b| a.0.total_cmp(&b.0));
    let more = lines.len().saturating_sub(600);
    let mut out: Vec<String> = lines.into_iter().take(600).map(|(_, l)| l).collect();
    if more > 0 {
        out.push(format!("  ... {more} more lines"));
    }
    out.join("\n")
}

/// The first time after `after` at which one of `logs` shows `needle`.
fn first_after(logs: &[PathBuf], needle: &str, after: f64) -> Option<f64> {
    logs.iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|text| {
            text.lines().filter(|l| l.contains(needle)).filter_map(log_time).filter(|&t| t > after).collect::<Vec<_>>()
        })
        .reduce(f64::min)
}

/// A trained step in a drafter log.
const STEP: &str = " INFO step ";

/// One drafter member: the port it listens on, behind the proxy the
/// targets reach it through.
struct Member {
    port: u16,
    proxy: Proxy,
}

impl Member {
    fn new(port: u16) -> Self {
        Self { port, proxy: Proxy::start(format!("127.0.0.1:{port}").parse().unwrap()) }
    }

    fn start(&self, cluster: &Cluster, name: &str) -> Proc {
        cluster.drafter_at_advertising(name, self.port, &format!("http://127.0.0.1:{}", self.proxy.port))
    }
}

/// The run's processes, started again when they exit (as a supervisor would).
struct Run<'a> {
    cluster: &'a Cluster,
    members: &'a [Member],
    coordinator_proxy: &'a Proxy,
    coordinator: Proc,
    /// One process per drafter member (a group when several): one that
    /// exits -- killed, or leaving its group's ended generation -- is
    /// replaced by a new process (a new instance) in its slot.
    drafters: Vec<Proc>,
    targets: Vec<Proc>,
    started: usize,
    drafter_logs: Vec<PathBuf>,
    done: Option<ExitStatus>,
}

impl<'a> Run<'a> {
    fn start(cluster: &'a Cluster, members: &'a [Member], coordinator_proxy: &'a Proxy) -> Self {
        let coordinator = cluster.coordinator(&[]);
        let drafters: Vec<Proc> =
            members.iter().enumerate().map(|(m, member)| member.start(cluster, &format!("drafter-m{m}-0"))).collect();
        let targets = vec![
            cluster.target("target-0"),
            cluster.target_via("target-1", &format!("http://127.0.0.1:{}", coordinator_proxy.port)),
        ];
        let drafter_logs = drafters.iter().map(|d| d.log.clone()).collect();
        Self {
            cluster,
            members,
            coordinator_proxy,
            coordinator,
            drafters,
            targets,
            started: 0,
            drafter_logs,
            done: None,
        }
    }

    /// Starts again whatever exited; true while the run is not over.
    fn supervise(&mut self) -> bool {
        if self.done.is_some() {
            return false;
        }
        if let Some(s) = self.coordinator.child.try_wait().unwrap() {
            if s.success() {
                self.done = Some(s);
                return false;
            }
            self.started += 1;
            self.coordinator = Proc::start_command(
                &format!("coordinator-{}", self.started),
                &self.cluster.local.coordinator(&format!("127.0.0.1:{}", self.cluster.coordinator_port)),
                &[],
                &self.cluster.logs,
            );
        }
        for m in 0..self.drafters.len() {
            if self.drafters[m].child.try_wait().unwrap().is_some() {
                self.started += 1;
                self.drafters[m] = self.members[m].start(self.cluster, &format!("drafter-m{m}-{}", self.started));
                self.drafter_logs.push(self.drafters[m].log.clone());
            }
        }
        for i in 0..self.targets.len() {
            if self.targets[i].child.try_wait().unwrap().is_some() {
                self.started += 1;
                let name = format!("target-{i}");
                // A new log per start; the instance keeps its name.
                let mut cmd = self.cluster.local.target(&self.cluster.coordinator_url, Some(&name), "127.0.0.1:0");
                if i == 1 {
                    cmd = self.cluster.local.target(
                        &format!("http://127.0.0.1:{}", self.coordinator_proxy.port),
                        Some(&name),
                        "127.0.0.1:0",
                    );
                }
                self.targets[i] =
                    Proc::start_command(&format!("{name}-{}", self.started), &cmd, &[], &self.cluster.logs);
            }
        }
        true
    }

    /// Supervises for `d` (or until the run is over).
    fn hold(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while Instant::now() < until && self.supervise() {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Resident memory of each role now: (role, MB).
    fn memory(&self) -> Vec<(&'static str, f64)> {
        let mut out = Vec::new();
        let drafters = self.drafters.iter().zip(["drafter", "drafter m1"]);
        let roles = std::iter::once(("coordinator", &self.coordinator)).chain(drafters.map(|(p, name)| (name, p)));
        for (name, p) in roles.chain(self.targets.iter().map(|t| ("target", t))) {
            if let Some(mb) = rss_mb(p.pid()) {
                out.push((name, mb));
            }
        }
        out
    }

    /// The last trained step in the current drafters' logs (the group's
    /// rank 0 logs its steps).
    fn last_step(&self) -> u64 {
        self.drafters
            .iter()
            .filter_map(|d| {
                d.log_text().lines().rev().find_map(|l| l.split_once(STEP)?.1.split('/').next()?.parse().ok())
            })
            .max()
            .unwrap_or(0)
    }

    /// Every drafter member's process id.
    fn drafter_pids(&self) -> Vec<i32> {
        self.drafters.iter().map(Proc::pid).collect()
    }

    /// The current drafters' logs, for a failure's message.
    fn drafter_log_text(&self) -> String {
        self.drafters.iter().map(Proc::log_text).collect::<Vec<_>>().join("\n---\n")
    }

    /// Sets every drafter proxy's cut.
    fn cut_drafters(&self, cut: bool) {
        self.members.iter().for_each(|m| m.proxy.set_cut(cut));
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Kill(Role),
    Pause(Role, Duration),
    NetworkCut(Duration),
    StalledReplies(Duration),
    CheckpointWriteFails,
    DiskFull,
    CorruptNewestCheckpoint,
    SlowDrafter(Duration),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    Coordinator,
    /// A drafter member (0 when the drafter is alone).
    Drafter(usize),
    Target(usize),
}

impl Fault {
    /// The fault's kind, for the per-kind summary.
    fn kind(&self) -> String {
        match self {
            Fault::Kill(r) => format!("SIGKILL {r:?}"),
            Fault::Pause(r, _) => format!("SIGSTOP {r:?}"),
            Fault::NetworkCut(_) => "network cut".into(),
            Fault::StalledReplies(_) => "drafter replies stalled".into(),
            Fault::CheckpointWriteFails => "checkpoint write fails".into(),
            Fault::DiskFull => "checkpoint disk full".into(),
            Fault::CorruptNewestCheckpoint => "newest checkpoint corrupted".into(),
            Fault::SlowDrafter(_) => "slow drafter".into(),
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Kill(r) => write!(f, "SIGKILL {r:?}"),
            Fault::Pause(r, d) => write!(f, "SIGSTOP {r:?} for {:.1} s, then SIGCONT", d.as_secs_f64()),
            Fault::NetworkCut(d) => write!(f, "network cut for {:.1} s", d.as_secs_f64()),
            Fault::StalledReplies(d) => write!(f, "drafter replies stalled for {:.1} s", d.as_secs_f64()),
            Fault::CheckpointWriteFails => write!(f, "checkpoint write fails"),
            Fault::DiskFull => write!(f, "checkpoint disk full until a checkpoint fails on it"),
            Fault::CorruptNewestCheckpoint => write!(f, "newest checkpoint corrupted, then SIGKILL Drafter"),
            Fault::SlowDrafter(d) => write!(f, "drafter slowed to a quarter for {:.1} s", d.as_secs_f64()),
        }
    }
}

/// At least one fault of every kind, then a seeded mix, in a seeded order.
/// With several drafter members, a drafter's fault falls on member `i mod
/// members` of the i-th fault drawn, and every member is killed (replaced)
/// at least once; with one, the schedule of a seed is what it was before
/// groups.
fn schedule(seed: u64, n: usize, members: usize) -> Vec<Fault> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut pause = |r| Fault::Pause(r, Duration::from_millis(rng.random_range(800..3500)));
    let mut all = vec![
        Fault::Kill(Role::Drafter(0)),
        Fault::Kill(Role::Target(0)),
        Fault::Kill(Role::Coordinator),
        pause(Role::Drafter(0)),
        pause(Role::Target(1)),
        pause(Role::Coordinator),
        Fault::NetworkCut(Duration::from_millis(3000)),
        Fault::StalledReplies(Duration::from_millis(4500)),
        Fault::CheckpointWriteFails,
        Fault::DiskFull,
        Fault::CorruptNewestCheckpoint,
        Fault::SlowDrafter(Duration::from_millis(4000)),
    ];
    all.extend((1..members).map(|m| Fault::Kill(Role::Drafter(m))));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed + 1);
    while all.len() < n {
        let member = all.len() % members;
        let r = [Role::Coordinator, Role::Drafter(member), Role::Target(0), Role::Target(1)][rng.random_range(0..4)];
        all.push(match rng.random_range(0..7) {
            0 => Fault::Kill(r),
            3 => Fault::CorruptNewestCheckpoint,
            4 => Fault::SlowDrafter(Duration::from_millis(rng.random_range(2000..8000))),
            1 => Fault::Pause(r, Duration::from_millis(rng.random_range(800..3500))),
            2 => Fault::StalledReplies(Duration::from_millis(rng.random_range(1000..6000))),
            6 => Fault::DiskFull,
            _ => Fault::NetworkCut(Duration::from_millis(rng.random_range(1000..4000))),
        });
    }
    for i in (1..all.len()).rev() {
        all.swap(i, rng.random_range(0..=i));
    }
    all
}

/// Injects one fault; returns when it is over (the time recovery counts from).
fn inject(run: &mut Run, fault: Fault, ckpt_root: &Path) -> Result<f64, String> {
    let proc_of = |run: &Run, r: Role| match r {
        Role::Coordinator => run.coordinator.pid(),
        Role::Drafter(m) => run.drafters[m].pid(),
        Role::Target(i) => run.targets[i].pid(),
    };
    match fault {
        Fault::Kill(r) => {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(proc_of(run, r)), Signal::SIGKILL);
            Ok(now())
        }
        Fault::Pause(r, d) => {
            let pid = nix::unistd::Pid::from_raw(proc_of(run, r));
            let _ = nix::sys::signal::kill(pid, Signal::SIGSTOP);
            // Others may exit meanwhile (a coordinator away past their
            // timeout): the supervisor starts them again.
            run.hold(d);
            let _ = nix::sys::signal::kill(pid, Signal::SIGCONT);
            Ok(now())
        }
        Fault::NetworkCut(d) => {
            run.cut_drafters(true);
            run.coordinator_proxy.set_cut(true);
            run.hold(d);
            run.cut_drafters(false);
            run.coordinator_proxy.set_cut(false);
            Ok(now())
        }
        Fault::StalledReplies(d) => {
            run.members.iter().for_each(|m| m.proxy.stall_replies());
            run.hold(d);
            run.members.iter().for_each(|m| m.proxy.release_replies());
            Ok(now())
        }
        Fault::SlowDrafter(d) => {
            // A drafter that runs but slowly (a throttled or shared host):
            // stopped 150 ms of every 200 for `d`. Streams stay up; targets
            // wait on its credits, batches keep their order.
            let until = Instant::now() + d;
            while Instant::now() < until {
                // Member 0: in a group, every rank waits for the slowest.
                let pid = nix::unistd::Pid::from_raw(run.drafters[0].pid());
                let _ = nix::sys::signal::kill(pid, Signal::SIGSTOP);
                std::thread::sleep(Duration::from_millis(150));
                let _ = nix::sys::signal::kill(pid, Signal::SIGCONT);
                run.hold(Duration::from_millis(50));
            }
            Ok(now())
        }
        Fault::CorruptNewestCheckpoint => {
            // Bit rot or a torn copy found at restart: the newest complete
            // checkpoint's weights change in the middle, then the drafter
            // dies. It must refuse that checkpoint and fall back to an older
            // committed one (there is one once two exist: keep_last = 0).
            let deadline = Instant::now() + Duration::from_secs(60);
            while step_dirs(ckpt_root) < 2 && Instant::now() < deadline && run.supervise() {
                std::thread::sleep(Duration::from_millis(50));
            }
            if step_dirs(ckpt_root) < 2 {
                return Err("fewer than two checkpoints to fall back between".into());
            }
            let weights = final_weights(ckpt_root);
            let mut bytes = std::fs::read(&weights).map_err(|e| format!("{}: {e}", weights.display()))?;
            let mid = bytes.len() / 2;
            for b in &mut bytes[mid..mid + 16] {
                *b ^= 0xff;
            }
            std::fs::write(&weights, &bytes).map_err(|e| format!("{}: {e}", weights.display()))?;
            let since = now();
            for pid in run.drafter_pids() {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            }
            // The drafter started again resumes only after passing over it.
            let deadline = Instant::now() + Duration::from_secs(60);
            while first_after(&run.drafter_logs, "after passing over", since).is_none() && Instant::now() < deadline {
                run.hold(Duration::from_millis(50));
            }
            assert!(
                first_after(&run.drafter_logs, "after passing over", since).is_some(),
                "the drafter did not pass over the corrupted {}:\n{}",
                weights.display(),
                run.drafter_log_text()
            );
            Ok(since)
        }
        Fault::DiskFull => {
            // The checkpoint disk has no room left (its size cut to what it
            // holds: the kernel answers the next write ENOSPC) until a
            // checkpoint fails on it, then room again.
            let disk = ckpt_root.parent().unwrap();
            let mut cut = Err(String::new());
            // A write in flight may grow what it holds between the two.
            for _ in 0..20 {
                cut = dflash_tests::disk_used(disk).and_then(|used| dflash_tests::resize_small_disk(disk, used));
                if cut.is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            cut?;
            let since = now();
            let needle = "(no space left on device)";
            let deadline = Instant::now() + Duration::from_secs(60);
            while first_after(&run.drafter_logs, needle, since).is_none() && Instant::now() < deadline {
                if !run.supervise() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let failed = first_after(&run.drafter_logs, needle, since).is_some();
            run.hold(Duration::from_secs(1));
            dflash_tests::resize_small_disk(disk, DISK_BYTES)?;
            if failed { Ok(now()) } else { Err("no checkpoint was tried on the full disk".into()) }
        }
        Fault::CheckpointWriteFails => {
            // The checkpoint two intervals ahead cannot be written: its
            // temporary folder's name is taken by a file.
            let step = (run.last_step() / CHECKPOINT_INTERVAL + 2) * CHECKPOINT_INTERVAL;
            // Whichever member is rank 0 writes it.
            let blockers: Vec<PathBuf> =
                run.drafter_pids().iter().map(|pid| ckpt_root.join(format!(".tmp-step-{step:08}-{pid}"))).collect();
            for b in &blockers {
                std::fs::write(b, b"in the way").unwrap();
            }
            let since = now();
            let needle = format!("checkpoint of step {step} failed");
            let deadline = Instant::now() + Duration::from_secs(60);
            while first_after(&run.drafter_logs, &needle, since).is_none() && Instant::now() < deadline {
                if !run.supervise() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let failed = first_after(&run.drafter_logs, &needle, since).is_some();
            run.hold(Duration::from_secs(1));
            for b in &blockers {
                let _ = std::fs::remove_file(b);
            }
            if failed { Ok(now()) } else { Err(format!("the drafter did not reach step {step}")) }
        }
    }
}

#[test]
fn a_run_under_a_seeded_fault_schedule_ends_bit_identical_to_an_uninterrupted_one() {
    // Every process of the test shares a checkpoint disk that can fill.
    let Some(disk) = dflash_tests::on_small_disk(
        "a_run_under_a_seeded_fault_schedule_ends_bit_identical_to_an_uninterrupted_one",
        &format!("{}k", DISK_BYTES / 1024),
    ) else {
        return;
    };
    // The uninterrupted run.
    let samples = setting("DFLASH_CHAOS_SAMPLES", SAMPLES as u64) as usize;
    let calm = Workspace::synthetic(samples, 3);
    // A soak keeps fewer checkpoints than all (its disk is memory).
    let mut config = CONFIG.replace("keep_last = 0", &format!("keep_last = {}", setting("DFLASH_CHAOS_KEEP_LAST", 0)));
    // A soak passes over its data several times (DFLASH_CHAOS_EPOCHS), so
    // that a restarted role's dataset load stays short.
    let epochs = setting("DFLASH_CHAOS_EPOCHS", 1).max(1);
    config = config.replace("seed = 3\n", &format!("seed = 3\nepochs = {epochs}\n"));
    // A drafter group of this many members (2 unless set), of a fixed
    // size, so that the deal -- and the weights -- are the uninterrupted run's.
    let members = setting("DFLASH_CHAOS_MEMBERS", 2).max(1) as usize;
    if members > 1 {
        config.push_str(&format!("\n[group]\nsize = {members}\ncollective_timeout_ms = 20000\n"));
    }
    let cluster = Cluster::new(&calm, calm.config("calm", &config));
    let t0 = Instant::now();
    let mut coord = cluster.coordinator(&[]);
    let mut procs = vec![cluster.drafter("drafter"), cluster.target("target-0"), cluster.target("target-1")];
    procs.extend((1..members).map(|m| cluster.drafter_at(&format!("drafter-m{m}"), dflash_tests::free_port())));
    let limit = Duration::from_secs(300).max(Duration::from_secs(epochs * samples as u64 / 20));
    assert!(coord.expect_exit(limit).success(), "{}", coord.log_text());
    for p in &mut procs {
        p.expect_exit(Duration::from_secs(60));
    }
    let calm_secs = t0.elapsed().as_secs_f64();
    let batches = assert_exactly_once(&cluster.ledger);
    let want = sha256(&final_weights(&calm.path("checkpoints")));

    // The same run under faults.
    let seed = setting("DFLASH_CHAOS_SEED", 11);
    let faults = schedule(seed, setting("DFLASH_CHAOS_FAULTS", 12) as usize, members);
    // A soak spreads its faults over the run (the suite's come back to back).
    let spacing_ms = setting("DFLASH_CHAOS_SPACING_MS", 0);
    let ws = Workspace::synthetic(samples, 3);
    let ckpt_root = disk.join("checkpoints");
    let config = config.replace("[checkpoint]\n", &format!("[checkpoint]\ndir = \"{}\"\n", ckpt_root.display()));
    let cluster = Cluster::new(&ws, ws.config("chaos", &config));
    let group: Vec<Member> = std::iter::once(cluster.drafter_port)
        .chain((1..members).map(|_| dflash_tests::free_port()))
        .map(Member::new)
        .collect();
    let coordinator_proxy = Proxy::start(format!("127.0.0.1:{}", cluster.coordinator_port).parse().unwrap());
    let t0 = Instant::now();
    let start = now();
    let mut run = Run::start(&cluster, &group, &coordinator_proxy);
    // Training first.
    let until = Instant::now() + Duration::from_secs(90);
    while first_after(&run.drafter_logs, STEP, 0.0).is_none() {
        assert!(Instant::now() < until, "no step: {}", run.drafter_log_text());
        run.hold(Duration::from_millis(100));
    }
    let mut report = Vec::new();
    let mut recoveries: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    // A recovery slower than this has every role's log lines from the
    // fault to the recovery printed (or written to DFLASH_CHAOS_SLOW_LOG).
    let slow_s = setting("DFLASH_CHAOS_SLOW_S", 10) as f64;
    let mut slow: Vec<String> = Vec::new();
    let mut last_at = now();
    let mut memory: std::collections::BTreeMap<&'static str, Vec<(f64, f64)>> = Default::default();
    for (i, &fault) in faults.iter().enumerate() {
        if !run.supervise() {
            break;
        }
        for (role, mb) in run.memory() {
            memory.entry(role).or_default().push((now() - start, mb));
        }
        run.hold(Duration::from_millis((300 + 200 * (i as u64 % 3)).max(spacing_ms)));
        let at = now();
        let previous_at = std::mem::replace(&mut last_at, at);
        let over = match inject(&mut run, fault, &ckpt_root) {
            Ok(t) => t,
            Err(why) => {
                report.push(format!("{:>2}. {fault}: not injected ({why})", i + 1));
                continue;
            }
        };
        // Recovered: a step trained after the fault ended (or, for the
        // checkpoint, a checkpoint written after the path was freed).
        let needle = if matches!(fault, Fault::CheckpointWriteFails | Fault::DiskFull) { "written in" } else { STEP };
        let mut recovered = None;
        let until = Instant::now() + Duration::from_secs(90);
        while recovered.is_none() && Instant::now() < until && run.supervise() {
            recovered = first_after(&run.drafter_logs, needle, over);
            std::thread::sleep(Duration::from_millis(50));
        }
        let line = match recovered {
            Some(t) => {
                recoveries.entry(fault.kind()).or_default().push(t - over);
                let line = format!(
                    "{:>2}. {fault} at +{:.1} s: recovered {:.2} s after it ended",
                    i + 1,
                    at - start,
                    t - over
                );
                if t - over > slow_s {
                    // From the fault before it: a role's restart it caused
                    // (its recovery measured by the steps of queued batches)
                    // may be what this one waits for.
                    slow.push(format!("{line}\n{}", log_window(&cluster.logs, previous_at - 1.0, t)));
                }
                line
            }
            None if run.done.is_some() => format!("{:>2}. {fault}: the run completed before another step", i + 1),
            None => panic!("no recovery from {fault} within 90 s; drafter log:\n{}", run.drafter_log_text()),
        };
        report.push(line);
    }
    let tail = Duration::from_secs(600).max(Duration::from_secs_f64(calm_secs * 2.0));
    let tail_start = Instant::now();
    while run.supervise() && tail_start.elapsed() < tail {
        std::thread::sleep(Duration::from_millis(100));
    }
    let injected = report.iter().filter(|l| !l.contains("not injected")).count();
    let kinds: Vec<String> = recoveries
        .iter_mut()
        .map(|(k, v)| {
            let (median, max) = median_max(v);
            format!("  {k:<28} {:>4}  median {median:>6.2} s  max {max:>6.2} s", v.len())
        })
        .collect();
    let memory: Vec<String> = memory
        .iter()
        .map(|(role, points)| {
            let peak = points.iter().map(|p| p.1).fold(0.0, f64::max);
            format!(
                "  {role:<12} peak {peak:>7.1} MB  slope {:>+8.1} MB/h  ({} samples)",
                slope_per_hour(points),
                points.len()
            )
        })
        .collect();
    println!(
        "chaos schedule (seed {seed}, {members} drafter member(s)), uninterrupted run {calm_secs:.1} s, this run {:.1} s:\n{}\n\
         recovery per fault kind (count, median, max):\n{}\nresident memory per role (sampled before each fault):\n{}\n\
         checkpoint disk (tmpfs): {:.1} MB in {} checkpoints",
        t0.elapsed().as_secs_f64(),
        report.join("\n"),
        kinds.join("\n"),
        memory.join("\n"),
        dflash_tests::disk_used(&disk).unwrap_or(0) as f64 / 1e6,
        step_dirs(&ckpt_root)
    );
    if !slow.is_empty() {
        let text = slow.join("\n\n");
        match std::env::var("DFLASH_CHAOS_SLOW_LOG") {
            Ok(path) => std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {path}: {e}")),
            Err(_) => println!("slow recoveries, with the roles' logs from the fault to the recovery:\n{text}"),
        }
    }
    assert!(run.done.is_some_and(|s| s.success()), "the run did not complete:\n{}", run.coordinator.log_text());
    let wanted = faults.len() * 10 / 12;
    assert!(injected >= wanted, "only {injected} faults were injected:\n{}", report.join("\n"));
    assert_eq!(assert_exactly_once(&cluster.ledger), batches);
    let got = sha256(&final_weights(&ckpt_root));
    assert_eq!(got, want, "the final weights differ from the uninterrupted run's");
}
