//! The one-machine launcher behind `dflash up`: prepares assets, starts the
//! three roles as separate processes on loopback ports, prefixes their logs,
//! and stops them together.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
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

/// Chitchat prompts regenerated for the SmolLM2 recipe (DATA.md's reference).
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

pub struct Launcher {
    config: ConfigFlags,
    up: UpArgs,
    bin_dir: PathBuf,
}

struct Role {
    name: &'static str,
    child: Child,
}

/// A free loopback port (bound and released; the role binds it next).
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn bin(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let p = dir.join(name);
    if !p.is_file() {
        anyhow::bail!("{} not found next to dflash (build the workspace: cargo build --release)", p.display());
    }
    Ok(p)
}

/// Forwards a child's output line by line with a role prefix.
fn prefix_lines(name: &'static str, stream: impl tokio::io::AsyncRead + Unpin + Send + 'static) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stream).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            println!("[{name:<11}] {line}");
        }
    });
}

impl Launcher {
    pub fn new(config: ConfigFlags, up: UpArgs) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating the dflash binary")?;
        let bin_dir = exe.parent().context("dflash has no parent folder")?.to_path_buf();
        Ok(Self { config, up, bin_dir })
    }

    fn spawn(&self, name: &'static str, program: &Path, args: &[String]) -> anyhow::Result<Role> {
        let mut cmd = Command::new(program);
        cmd.args(args)
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
        prefix_lines(name, child.stdout.take().expect("piped"));
        prefix_lines(name, child.stderr.take().expect("piped"));
        Ok(Role { name, child })
    }

    /// Runs a tool to completion, its output prefixed.
    async fn tool(&self, name: &'static str, program: &str, args: &[String]) -> anyhow::Result<()> {
        let mut role = self.spawn(name, &bin(&self.bin_dir, program)?, args)?;
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
                self.tool("prepare", "dflash-target", &args).await
            }
            Prepare::Smollm2Chitchat => {
                self.tool(
                    "prepare",
                    "dflash-target",
                    &[s("prepare-smollm2"), s("--out"), config.model.target_path.clone()],
                )
                .await?;
                let data_dir = Path::new(&config.data.train_path).parent().unwrap_or(Path::new(".")).to_path_buf();
                self.tool(
                    "prepare",
                    "dflash-target",
                    &[s("prepare-corpora"), s("--out"), data_dir.display().to_string()],
                )
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
                self.tool("regenerate", "dflash-target", &args).await
            }
        }
    }

    /// Acceptance length of the trained drafter next to an untrained one.
    async fn final_eval(&self) -> anyhow::Result<()> {
        let config = self.config.loader()?.load()?;
        let e = &config.eval;
        if self.up.no_final_eval || e.prompts_path.is_empty() {
            return Ok(());
        }
        let args = vec![
            "eval".to_string(),
            "--target".into(),
            config.model.target_path.clone(),
            "--drafter".into(),
            config.checkpoint.dir.clone(),
            "--prompts".into(),
            e.prompts_path.clone(),
            "--limit".into(),
            e.max_prompts.to_string(),
            "--max-new-tokens".into(),
            e.max_new_tokens.to_string(),
            "--baseline".into(),
            "--json".into(),
            self.up.workdir.join("eval.json").display().to_string(),
        ];
        self.tool("eval", "dflash-drafter", &args).await
    }

    /// Runs the roles until the run ends, one fails, or Ctrl-C. Returns the
    /// exit code.
    pub async fn run(self) -> anyhow::Result<i32> {
        self.prepare().await?;
        std::fs::create_dir_all(&self.up.workdir).with_context(|| format!("creating {}", self.up.workdir.display()))?;
        let ledger_path = self.up.workdir.join("ledger.sqlite");
        if ledger_path.is_file() {
            let counts = crate::ledger::Ledger::open(&ledger_path)?.counts()?;
            if counts.total() > 0 && counts.committed == counts.total() {
                eprintln!(
                    "[dflash     ] the run in {} is complete ({} batches committed); evaluating its last checkpoint. \
                     Remove the folder (make clean-runs) to train again.",
                    self.up.workdir.display(),
                    counts.total()
                );
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
        let coord_port = free_port()?;
        let drafter_port = free_port()?;
        let target_health = free_port()?;
        let sec = &self.up.security;
        let scheme = if sec.tls_cert.is_some() { "https" } else { "http" };
        let coord_url = format!("{scheme}://127.0.0.1:{coord_port}");
        // TLS files go to every role by flag; the token by environment.
        let mut tls_args: Vec<String> = Vec::new();
        for (flag, path) in [("--tls-cert", &sec.tls_cert), ("--tls-key", &sec.tls_key), ("--tls-ca", &sec.tls_ca)] {
            if let Some(p) = path {
                tls_args.extend([flag.to_string(), p.display().to_string()]);
            }
        }
        let mut metrics_urls = Vec::new();
        let mut metrics_args = |name: &str| -> anyhow::Result<Vec<String>> {
            if !self.up.metrics {
                return Ok(vec![]);
            }
            let port = free_port()?;
            metrics_urls.push(format!("{name} http://127.0.0.1:{port}/metrics"));
            Ok(vec!["--metrics-listen".into(), format!("127.0.0.1:{port}")])
        };
        let mut coord_args = self.config.to_args();
        coord_args.extend([
            "--listen".into(),
            format!("127.0.0.1:{coord_port}"),
            "--ledger".into(),
            self.up.workdir.join("ledger.sqlite").display().to_string(),
        ]);
        coord_args.extend(tls_args.iter().cloned());
        coord_args.extend(metrics_args("coordinator")?);
        let mut roles = vec![self.spawn("coordinator", &bin(&self.bin_dir, "dflash-coordinator")?, &coord_args)?];
        let mut drafter_args = vec![
            "serve".into(),
            "--coordinator".into(),
            coord_url.clone(),
            "--listen".into(),
            format!("127.0.0.1:{drafter_port}"),
            "--advertise".into(),
            format!("{scheme}://127.0.0.1:{drafter_port}"),
            "--threads".into(),
            self.up.drafter_threads.to_string(),
        ];
        drafter_args.extend(tls_args.iter().cloned());
        drafter_args.extend(metrics_args("drafter")?);
        roles.push(self.spawn("drafter", &bin(&self.bin_dir, "dflash-drafter")?, &drafter_args)?);
        let mut target_args = vec![
            "serve".into(),
            "--coordinator".into(),
            coord_url.clone(),
            "--health-listen".into(),
            format!("127.0.0.1:{target_health}"),
            "--threads".into(),
            self.up.target_threads.to_string(),
        ];
        target_args.extend(tls_args.iter().cloned());
        target_args.extend(metrics_args("target")?);
        roles.push(self.spawn("target", &bin(&self.bin_dir, "dflash-target")?, &target_args)?);
        if !metrics_urls.is_empty() {
            eprintln!("[dflash     ] metrics: {}", metrics_urls.join(", "));
        }
        let progress = (self.up.progress_every_s > 0).then(|| {
            let every = Duration::from_secs(self.up.progress_every_s);
            let security = self.up.security.load();
            tokio::spawn(async move {
                let Ok(security) = security else { return };
                crate::progress::report(&coord_url, &security, every).await
            })
        });
        let code = supervise(roles, Duration::from_secs(self.up.grace_s)).await?;
        if let Some(p) = progress {
            p.abort();
        }
        if code == 0 {
            self.final_eval().await?;
        }
        Ok(code)
    }
}

fn terminate(roles: &[Role]) {
    for r in roles {
        if let Some(pid) = r.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
    }
}

/// Waits for the roles. The coordinator ends the run; every other role
/// follows it. A failing role or Ctrl-C stops all of them (SIGTERM, then
/// SIGKILL after `grace`).
async fn supervise(mut roles: Vec<Role>, grace: Duration) -> anyhow::Result<i32> {
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
                    eprintln!("[dflash     ] {} did not stop within {grace:?}: killing it", r.name);
                    let _ = r.child.start_kill();
                }
                stopping = Some(tokio::time::Instant::now() + Duration::from_secs(3600));
            }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        let mut i = 0;
        while i < roles.len() {
            if let Some(status) = roles[i].child.try_wait()? {
                let r = roles.remove(i);
                if status.success() {
                    eprintln!("[dflash     ] {} exited", r.name);
                } else {
                    eprintln!("[dflash     ] {} exited with {status}", r.name);
                    failed = true;
                }
                if (r.name == "coordinator" || !status.success()) && stopping.is_none() {
                    // The run is over (or broken): give the others the grace
                    // period to notice and stop by themselves, then signal.
                    stopping = Some(tokio::time::Instant::now());
                    let others: Vec<&str> = roles.iter().map(|r| r.name).collect();
                    if !others.is_empty() && !status.success() {
                        terminate(&roles);
                    }
                }
            } else {
                i += 1;
            }
        }
    }
    Ok(if failed { 1 } else { 0 })
}
