//! The one-machine launcher behind `dflash up`: prepares assets, starts the
//! three roles as separate processes on loopback ports, prefixes their logs,
//! restarts a drafter or target that is killed (as Kubernetes would), and
//! stops them together. Every role binds port 0 and the launcher learns
//! the port from the role's own log line, so no port is chosen by binding
//! and releasing it (another process could take it in between).

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use dflash_cluster::{LISTENING, LocalCluster, METRICS, RoleCommand, address_after};
use dflash_config::ConfigFlags;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Assets `dflash up` can prepare before starting.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prepare {
    /// The small random Llama-style target and a generated chat dataset.
    Synthetic,
    /// SmolLM2-135M-Instruct, chitchat prompts answered by SmolLM2 itself
    /// (600 prompts, greedy, at most 96 new tokens), MT-Bench turn-1 prompts.
    Smollm2Chitchat,
}

/// Chitchat prompts regenerated for the SmolLM2 recipe (the reference run's data size).
const CHITCHAT_TRAIN_PROMPTS: usize = 600;
const CHITCHAT_NEW_TOKENS: usize = 96;

/// Options of `dflash up` beyond the run config.
#[derive(clap::Args, Debug, Clone)]
pub struct UpArgs {
    /// Prepare these assets first (skipped when they exist).
    #[arg(long, value_enum)]
    pub prepare: Option<Prepare>,
    /// Folder for the ledger and logs of this run.
    #[arg(long, default_value = "runs/up")]
    pub workdir: PathBuf,
    /// libtorch threads of the target process (0: libtorch's default).
    #[arg(long, default_value_t = 0)]
    pub target_threads: u32,
    /// libtorch threads of the drafter process (0: libtorch's default).
    #[arg(long, default_value_t = 0)]
    pub drafter_threads: u32,
    /// Seconds the roles get to stop after Ctrl-C or a failure before they are killed.
    #[arg(long, default_value_t = 30)]
    pub grace_s: u64,
    /// Skip the acceptance-length evaluation after training (run when
    /// `eval.prompts_path` is set).
    #[arg(long)]
    pub no_final_eval: bool,
    /// Seconds between progress lines (0: none).
    #[arg(long, default_value_t = 10)]
    pub progress_every_s: u64,
    /// Give every role a Prometheus endpoint on a free loopback port.
    #[arg(long)]
    pub metrics: bool,
    /// Transport security of all three roles (the token reaches them
    /// through the environment, not the command line).
    #[command(flatten)]
    pub security: dflash_role::SecurityArgs,
}

/// Restarts of one killed role within one `dflash up`.
const MAX_RESTARTS: u32 = 10;
/// Points of the training history the end-of-run plot draws (the ledger
/// keeps every step; a plot needs no more than a few per pixel column).
const PLOT_POINTS: u64 = 2000;

pub struct Launcher {
    config: ConfigFlags,
    up: UpArgs,
    bin_dir: PathBuf,
    /// Lines of the roles' output that say where they listen.
    tap: tokio::sync::mpsc::Sender<(&'static str, String)>,
    tapped: tokio::sync::Mutex<Tapped>,
}

/// The watched lines received so far, and the channel they come in on.
struct Tapped {
    rx: tokio::sync::mpsc::Receiver<(&'static str, String)>,
    seen: Vec<(&'static str, String)>,
}

/// How to start a role (again).
#[derive(Clone)]
struct Spec {
    name: &'static str,
    program: PathBuf,
    args: Vec<String>,
    /// Started again when killed by a signal.
    restart: bool,
}

impl Spec {
    fn of(name: &'static str, c: RoleCommand, restart: bool) -> Self {
        Self { name, program: c.program, args: c.args, restart }
    }
}

struct Role {
    spec: Spec,
    child: Child,
    restarts: u32,
}

/// Forwards a child's output line by line with a role prefix, and the
/// lines that say where it listens to `tap`.
fn prefix_lines(
    name: &'static str,
    stream: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    tap: tokio::sync::mpsc::Sender<(&'static str, String)>,
) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stream).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            println!("[{name:<11}] {line}");
            if line.contains(LISTENING) || line.contains(METRICS) {
                let _ = tap.try_send((name, line));
            }
        }
    });
}

impl Launcher {
    /// The roles' command lines: the run config, the run's ledger, the
    /// security flags and metrics endpoints every role gets.
    fn cluster(&self) -> LocalCluster {
        let config = self.config.to_args();
        let mut c = LocalCluster::new(&self.bin_dir, config, &self.up.workdir.join("ledger.sqlite"));
        let sec = &self.up.security;
        c.scheme = if sec.tls_cert.is_some() { "https" } else { "http" };
        // TLS files go to every role by flag; the token by environment.
        for (flag, path) in [("--tls-cert", &sec.tls_cert), ("--tls-key", &sec.tls_key), ("--tls-ca", &sec.tls_ca)] {
            if let Some(p) = path {
                c.common_args.extend([flag.to_string(), p.display().to_string()]);
            }
        }
        if self.up.metrics {
            c.common_args.extend(["--metrics-listen".into(), "127.0.0.1:0".into()]);
        }
        (c.drafter_threads, c.target_threads) = (self.up.drafter_threads, self.up.target_threads);
        c
    }

    pub fn new(config: ConfigFlags, up: UpArgs) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating the dflash binary")?;
        let bin_dir = exe.parent().context("dflash has no parent folder")?.to_path_buf();
        let (tap, tapped) = tokio::sync::mpsc::channel(64);
        Ok(Self { config, up, bin_dir, tap, tapped: tokio::sync::Mutex::new(Tapped { rx: tapped, seen: Vec::new() }) })
    }

    fn spawn(&self, name: &'static str, program: &Path, args: &[String]) -> anyhow::Result<Role> {
        self.start(Spec { name, program: program.to_path_buf(), args: args.to_vec(), restart: false })
    }

    fn start(&self, spec: Spec) -> anyhow::Result<Role> {
        let (name, program) = (spec.name, &spec.program);
        if !program.is_file() {
            anyhow::bail!(
                "{} not found next to dflash (build the workspace: cargo build --release)",
                program.display()
            );
        }
        let mut cmd = Command::new(program);
        cmd.args(&spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: Ctrl-C reaches the launcher only, which
            // then stops the roles in order.
            .process_group(0)
            .kill_on_drop(true);
        if let Some(t) = &self.up.security.token {
            cmd.env("DFLASH_TOKEN", t);
        }
        // Per-process settings of the launcher's environment would make
        // the three roles bind the same ports or share an identity.
        for v in
            ["DFLASH_LISTEN", "DFLASH_HEALTH_LISTEN", "DFLASH_METRICS_LISTEN", "DFLASH_INSTANCE_ID", "DFLASH_ADVERTISE"]
        {
            cmd.env_remove(v);
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {}", program.display()))?;
        prefix_lines(name, child.stdout.take().expect("piped"), self.tap.clone());
        prefix_lines(name, child.stderr.take().expect("piped"), self.tap.clone());
        Ok(Role { spec, child, restarts: 0 })
    }

    /// Waits (up to a minute) for `role` to log the address it listens on
    /// after `marker`; fails if a role exits first.
    async fn wait_for_address(&self, role: &'static str, marker: &str, roles: &mut [Role]) -> anyhow::Result<String> {
        let mut tapped = self.tapped.lock().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let found = tapped.seen.iter().find_map(|(name, line)| {
                (*name == role).then(|| address_after(line, marker)).flatten().map(str::to_string)
            });
            if let Some(addr) = found {
                return Ok(addr);
            }
            for r in roles.iter_mut() {
                if let Some(status) = r.child.try_wait()? {
                    anyhow::bail!("{} exited ({status}) before {role} was listening", r.spec.name);
                }
            }
            let wait = deadline.min(tokio::time::Instant::now() + Duration::from_millis(200));
            match tokio::time::timeout_at(wait, tapped.rx.recv()).await {
                Ok(Some(line)) => tapped.seen.push(line),
                Ok(None) => anyhow::bail!("the roles' output closed"),
                Err(_) if tokio::time::Instant::now() >= deadline => {
                    anyhow::bail!("{role} did not say where it listens within 60 s")
                }
                Err(_) => {}
            }
        }
    }

    /// Runs a tool to completion, its output prefixed.
    async fn tool(&self, name: &'static str, program: &str, args: &[String]) -> anyhow::Result<()> {
        let mut role = self.spawn(name, &self.bin_dir.join(program), args)?;
        let status = role.child.wait().await?;
        if !status.success() {
            anyhow::bail!("{program} {} failed ({status})", args.first().map_or("", String::as_str));
        }
        Ok(())
    }

    async fn prepare(&self) -> anyhow::Result<()> {
        let Some(recipe) = self.up.prepare else { return Ok(()) };
        let config = self.config.loader()?.load()?;
        let s = |x: &str| x.to_string();
        match recipe {
            Prepare::Synthetic => {
                let args = [
                    s("prepare-synthetic"),
                    s("--model-dir"),
                    config.model.target_path.clone(),
                    s("--dataset"),
                    config.data.train_path.clone(),
                ];
                self.tool("prepare", "dflash", &args).await
            }
            Prepare::Smollm2Chitchat => {
                self.tool("prepare", "dflash", &[s("prepare-smollm2"), s("--out"), config.model.target_path.clone()])
                    .await?;
                let data_dir = Path::new(&config.data.train_path).parent().unwrap_or(Path::new(".")).to_path_buf();
                self.tool("prepare", "dflash", &[s("prepare-corpora"), s("--out"), data_dir.display().to_string()])
                    .await?;
                if Path::new(&config.data.train_path).is_file() {
                    return Ok(());
                }
                let args = [
                    s("regenerate"),
                    s("--model"),
                    config.model.target_path.clone(),
                    s("--input"),
                    data_dir.join("chitchat-prompts.jsonl").display().to_string(),
                    s("--limit"),
                    CHITCHAT_TRAIN_PROMPTS.to_string(),
                    s("--max-new-tokens"),
                    CHITCHAT_NEW_TOKENS.to_string(),
                    s("--output"),
                    config.data.train_path.clone(),
                ];
                self.tool("regenerate", "dflash", &args).await
            }
        }
    }

    /// Acceptance length of the trained drafter next to an untrained one,
    /// on every prompt set of `[eval]`, then the report over all of them.
    async fn final_eval(&self) -> anyhow::Result<()> {
        let config = self.config.loader()?.load()?;
        let e = &config.eval;
        let sets = e.all_sets();
        if self.up.no_final_eval || sets.is_empty() {
            return Ok(());
        }
        let mut results = Vec::new();
        for (i, set) in sets.iter().enumerate() {
            let json = self.up.workdir.join(format!("eval-{i}.json"));
            let args = vec![
                "eval".to_string(),
                "--target".into(),
                config.model.target_path.clone(),
                "--drafter".into(),
                config.checkpoint.dir.clone(),
                "--prompts".into(),
                set.prompts_path.clone(),
                "--set-name".into(),
                set.name.clone(),
                "--offset".into(),
                set.prompts_offset.to_string(),
                "--limit".into(),
                set.max_prompts.to_string(),
                "--per-category".into(),
                set.per_category.to_string(),
                "--max-new-tokens".into(),
                e.max_new_tokens.to_string(),
                "--baseline".into(),
                "--json".into(),
                json.display().to_string(),
            ];
            self.tool("eval", "dflash", &args).await?;
            results.push(crate::run_report::SetResult::read(&json)?);
        }
        let report = crate::run_report::render(&results, config.drafter.block_size());
        let path = self.up.workdir.join("report.txt");
        std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("[dflash     ] report ({}):", path.display());
        for line in report.lines() {
            eprintln!("[dflash     ] {line}");
        }
        Ok(())
    }

    /// Runs the roles until the run ends, one fails, or Ctrl-C. Returns the
    /// exit code.
    pub async fn run(self) -> anyhow::Result<i32> {
        std::fs::create_dir_all(&self.up.workdir).with_context(|| format!("creating {}", self.up.workdir.display()))?;
        // One live `dflash up` per workdir: a second one would resume the
        // live run's ledger with roles of its own and write into its
        // checkpoints.
        let _lock = dflash_role::ExclusiveLock::acquire(&self.up.workdir.join("run.lock"), "dflash up")?;
        self.prepare().await?;
        let ledger_path = self.up.workdir.join("ledger.sqlite");
        if ledger_path.is_file() {
            let counts = dflash_coordinator::ledger::Ledger::open(&ledger_path)?.counts()?;
            if counts.total() > 0 && counts.committed == counts.total() {
                eprintln!(
                    "[dflash     ] the run in {} is complete ({} batches committed); evaluating its last checkpoint. \
                     Remove the folder (make clean-runs) to train again.",
                    self.up.workdir.display(),
                    counts.total()
                );
                self.plot_training(&ledger_path);
                self.final_eval().await?;
                return Ok(0);
            }
            eprintln!(
                "[dflash     ] resuming the run in {}: {} of {} batches committed",
                self.up.workdir.display(),
                counts.committed,
                counts.total()
            );
        }
        let cluster = self.cluster();
        let mut roles = vec![self.start(Spec::of("coordinator", cluster.coordinator("127.0.0.1:0"), false))?];
        let coord_url = cluster.url(&self.wait_for_address("coordinator", LISTENING, &mut roles).await?);
        roles.push(self.start(Spec::of("drafter", cluster.drafter(&coord_url, "127.0.0.1:0"), true))?);
        roles.push(self.start(Spec::of("target", cluster.target(&coord_url, None, "127.0.0.1:0"), true))?);
        if self.up.metrics {
            let mut urls = Vec::new();
            for role in ["coordinator", "drafter", "target"] {
                let addr = self.wait_for_address(role, METRICS, &mut roles).await?;
                urls.push(format!("{role} {addr}"));
            }
            eprintln!("[dflash     ] metrics: {}", urls.join(", "));
        }
        let progress = (self.up.progress_every_s > 0).then(|| {
            let every = Duration::from_secs(self.up.progress_every_s);
            let security = self.up.security.load();
            tokio::spawn(async move {
                let Ok(security) = security else { return };
                crate::progress::report(&coord_url, &security, every).await
            })
        });
        let code = self.supervise(roles, Duration::from_secs(self.up.grace_s)).await?;
        if let Some(p) = progress {
            p.abort();
        }
        self.plot_training(&ledger_path);
        if code == 0 {
            self.final_eval().await?;
        }
        Ok(code)
    }

    /// Draws the run's training figures from the ledger into the run folder
    /// and says where. A run that trained nothing yet has nothing to draw; a
    /// plot that cannot be written is reported, and costs the run nothing.
    fn plot_training(&self, ledger_path: &Path) {
        let path = self.up.workdir.join("training.svg");
        if !ledger_path.is_file() {
            return; // the coordinator never started: nothing was trained
        }
        let drawn = dflash_coordinator::ledger::Ledger::open(ledger_path)
            .and_then(|l| l.progress_history(PLOT_POINTS))
            .map_err(anyhow::Error::from)
            .and_then(|history| {
                let title = format!("{} (steps {})", self.up.workdir.display(), history.last().map_or(0, |p| p.step));
                crate::plot::write_training_plot(&path, &title, &history)
            });
        match drawn {
            Ok(()) => eprintln!("[dflash     ] training plot: {}", path.display()),
            Err(e) => eprintln!("[dflash     ] no training plot: {e:#}"),
        }
    }
}

fn terminate(roles: &[Role]) {
    for r in roles {
        if let Some(pid) = r.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
    }
}

impl Launcher {
    /// Waits for the roles. The coordinator ends the run; every other role
    /// follows it. A drafter or target killed by a signal (SIGKILL, the OOM
    /// killer) is started again, at most [`MAX_RESTARTS`] times: it resumes
    /// from its checkpoint or its leases. A drafter group member that lost
    /// its device (exit 76) is not; the others go on. A role that fails
    /// (exits with an error it reported), or Ctrl-C, stops all of them
    /// (SIGTERM, then SIGKILL after `grace`).
    async fn supervise(&self, mut roles: Vec<Role>, grace: Duration) -> anyhow::Result<i32> {
        let mut failed = false;
        let mut stopping: Option<tokio::time::Instant> = None;
        let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
        let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        while !roles.is_empty() {
            let deadline = stopping.map(|t| t + grace);
            tokio::select! {
                _ = &mut ctrl_c, if stopping.is_none() => {
                    eprintln!("[dflash     ] interrupted: stopping every role");
                    terminate(&roles);
                    stopping = Some(tokio::time::Instant::now());
                    failed = true;
                }
                _ = sigterm.recv(), if stopping.is_none() => {
                    terminate(&roles);
                    stopping = Some(tokio::time::Instant::now());
                    failed = true;
                }
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600))), if deadline.is_some() => {
                    for r in &mut roles {
                        eprintln!("[dflash     ] {} did not stop within {grace:?}: killing it", r.spec.name);
                        let _ = r.child.start_kill();
                    }
                    stopping = Some(tokio::time::Instant::now() + Duration::from_secs(3600));
                }
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            let mut i = 0;
            while i < roles.len() {
                let Some(status) = roles[i].child.try_wait()? else {
                    i += 1;
                    continue;
                };
                let name = roles[i].spec.name;
                // Killed (SIGKILL, the OOM killer), or a drafter leaving a
                // group that re-forms: started again.
                let why = match (status.signal(), status.code()) {
                    (Some(sig), _) => Some(format!("was killed (signal {sig})")),
                    (_, Some(dflash_role::EXIT_GROUP_REFORM)) => Some("left its drafter group to join the next".into()),
                    _ => None,
                };
                if let Some(why) = why
                    && roles[i].spec.restart
                    && stopping.is_none()
                    && roles[i].restarts < MAX_RESTARTS
                {
                    let restarts = roles[i].restarts + 1;
                    eprintln!("[dflash     ] {name} {why}: starting it again ({restarts} of {MAX_RESTARTS})");
                    let mut again = self.start(roles[i].spec.clone())?;
                    again.restarts = restarts;
                    roles[i] = again;
                    i += 1;
                    continue;
                }
                let r = roles.remove(i);
                if status.code() == Some(dflash_role::EXIT_DEVICE_LOST) {
                    // A group member whose device is lost: not started
                    // again; the group goes on without it (the coordinator
                    // fails the run if too few members remain).
                    eprintln!("[dflash     ] {name} lost its device and left the drafter group: not starting it again");
                    drop(r);
                    continue;
                }
                if status.success() {
                    eprintln!("[dflash     ] {name} exited");
                } else {
                    eprintln!("[dflash     ] {name} exited with {status}");
                    failed = true;
                }
                if (name == "coordinator" || !status.success()) && stopping.is_none() {
                    // The run is over (or broken): give the others the grace
                    // period to notice and stop by themselves, then signal.
                    stopping = Some(tokio::time::Instant::now());
                    if !roles.is_empty() && !status.success() {
                        terminate(&roles);
                    }
                }
                drop(r);
            }
        }
        Ok(if failed { 1 } else { 0 })
    }
}
