//! Helpers for the integration tests: locate the built binaries, prepare
//! the synthetic target, write configs, start real processes on free ports,
//! and wait for them with deadlines.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use dflash_cluster::{LocalCluster, RoleCommand};

pub mod proxy;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A binary of the workspace, built in the same profile as the tests.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target profile folder");
    let p = dir.join(name);
    assert!(p.is_file(), "{} is missing: build the binaries first (cargo build --release --bins)", p.display());
    p
}

/// The body of `GET url` (plain HTTP/1.0, for the metrics endpoints).
pub fn http_get(url: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let (host, path) = rest.split_once('/').map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut s = std::net::TcpStream::connect(host)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text.split_once("\r\n\r\n").map_or(text.clone(), |(_, body)| body.to_string()))
}

/// The repository's root folder.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The reference venv's python (scripts/reference/venv.sh installs it on
/// first use, then it is cached in `.cache`).
pub fn reference_python() -> PathBuf {
    let out = Command::new(repo_root().join("scripts/reference/venv.sh")).output().expect("run venv.sh");
    assert!(out.status.success(), "scripts/reference/venv.sh failed:\n{}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Runs `scripts/reference/<script>` with the reference venv's python (one
/// torch thread) and returns the JSON object it prints on stdout.
pub fn reference_json<I, S>(script: &str, args: I) -> serde_json::Value
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = Command::new(reference_python())
        .arg(repo_root().join("scripts/reference").join(script))
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("run the reference python");
    assert!(out.status.success(), "{script} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{script} printed no JSON object ({e})"))
}

/// The value of one sample (`name{labels}`) in a Prometheus text page.
pub fn metric_value(page: &str, sample: &str) -> Option<f64> {
    page.lines().find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
}

/// A free loopback port.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("bind").port()
}

/// Set in a test run again by [`on_small_disk`]: the small disk's folder.
const SMALL_DISK: &str = "DFLASH_TEST_SMALL_DISK";

/// A disk that really fills, without root: runs the test `test` of this
/// test binary again inside a new user and mount namespace (`unshare
/// --user --map-root-user --mount`) in which a tmpfs of `size` (`8m`) is
/// mounted on a new folder. Here it returns None once that run passed
/// (and panics with its output if it failed, or if no namespace could be
/// made); in that run it returns the folder, and the test goes on: every
/// process it starts shares the mount, and the test (root of the
/// namespace) may resize it with [`resize_small_disk`].
pub fn on_small_disk(test: &str, size: &str) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(SMALL_DISK) {
        return Some(PathBuf::from(dir));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("test executable path");
    let script =
        r#"mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 97; exec "$3" --exact "$4" --nocapture --test-threads 1"#;
    let out = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", size])
        .arg(dir.path())
        .arg(&exe)
        .arg(test)
        .env(SMALL_DISK, dir.path())
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("running `unshare` (util-linux), which gives this test a small disk without root: {e}")
        });
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    match out.status.code() {
        Some(97) => {
            panic!("mounting a {size} tmpfs on {} in a new mount namespace failed:\n{text}", dir.path().display())
        }
        Some(0) => {}
        _ if !text.contains("running 1 test") => panic!(
            "`unshare --user --map-root-user --mount` failed ({}): this test needs unprivileged user namespaces \
             (or root) to give itself a small disk:\n{text}",
            out.status
        ),
        _ => panic!("{test} failed on a {size} disk ({}); its output is above", out.status),
    }
    // Not a run that matched no test.
    assert!(text.contains("test result: ok. 1 passed"), "{test} did not run on the small disk:\n{text}");
    None
}

/// Sets the size of the small disk of [`on_small_disk`] (mounted at
/// `dir`) to `bytes`, rounded up to pages: a size at or below what it
/// holds leaves no space (the kernel refuses one below it).
pub fn resize_small_disk(dir: &Path, bytes: u64) -> Result<(), String> {
    let out = Command::new("mount")
        // Named as a tmpfs, or mount(8) passes the options it holds again,
        // uid= among them, which a user namespace refuses.
        .args(["-t", "tmpfs", "-o", &format!("remount,size={}k", bytes.div_ceil(1024)), "tmpfs"])
        .arg(dir)
        .output()
        .map_err(|e| format!("mount: {e}"))?;
    if !out.status.success() {
        return Err(format!("resizing the tmpfs at {}: {}", dir.display(), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

/// Bytes in use on the filesystem at `dir` (as `df` counts them).
pub fn disk_used(dir: &Path) -> Result<u64, String> {
    let out = Command::new("df").args(["--output=used", "-B1"]).arg(dir).output().map_err(|e| format!("df: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().nth(1).and_then(|l| l.trim().parse().ok()).ok_or_else(|| format!("df {}: {text}", dir.display()))
}

/// A scratch folder with the synthetic target and dataset in it.
pub struct Workspace {
    pub dir: tempfile::TempDir,
}

impl Workspace {
    /// Writes the synthetic target (`layers` layers) and `samples` conversations.
    pub fn synthetic(samples: usize, layers: u32) -> Self {
        Self::prepare(samples, &["--layers", &layers.to_string()])
    }

    /// Like [`Workspace::synthetic`] with a target of a named shape (e.g.
    /// `tiny-moe`, the synthetic target as a Qwen3 MoE).
    pub fn synthetic_shape(samples: usize, shape: &str) -> Self {
        Self::prepare(samples, &["--shape", shape])
    }

    fn prepare(samples: usize, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = Command::new(bin("dflash"))
            .args(["prepare-synthetic", "--model-dir"])
            .arg(dir.path().join("model"))
            .arg("--dataset")
            .arg(dir.path().join("data.jsonl"))
            .args(["--samples", &samples.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run prepare-synthetic");
        assert!(status.success(), "prepare-synthetic {args:?} failed");
        Self { dir }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// A run config for the synthetic target with short fault timeouts;
    /// `extra` is TOML merged over it key by key.
    pub fn config(&self, name: &str, extra: &str) -> PathBuf {
        let text = format!(
            r#"
[run]
name = "{name}"
epochs = 1
max_steps = 12
log_every_steps = 1

[model]
target_path = "{model}"
dtype = "f32"

[drafter]
num_layers = 1
block_size = 8
mask_token_id = 3

[data]
train_path = "{data}"
max_seq_len = 256

[training]
lr = 1e-3
anchors_per_sequence = 8
max_blocks_per_micro_batch = 256

[pipeline]
token_budget = 1024
max_batch_size = 16

[devices]
target = "cpu"
drafter = "cpu"

[checkpoint]
dir = "{ckpt}"
interval_steps = 5

[faults]
heartbeat_interval_ms = 200
instance_timeout_ms = 2000
coordinator_timeout_ms = 3000
rpc_timeout_ms = 3000
shutdown_grace_ms = 5000
"#,
            model = self.path("model").display(),
            data = self.path("data.jsonl").display(),
            ckpt = self.path("checkpoints").display(),
        );
        let mut base: toml::Table = text.parse().expect("base config");
        let extra: toml::Table = extra.parse().expect("extra config");
        for (section, values) in extra {
            match (base.get_mut(&section), values) {
                (Some(toml::Value::Table(b)), toml::Value::Table(v)) => b.extend(v),
                (_, v) => {
                    base.insert(section, v);
                }
            }
        }
        let p = self.path(&format!("{name}.toml"));
        std::fs::write(&p, toml::to_string(&base).expect("toml")).expect("write config");
        p
    }
}

/// A process under test, its output in a log file.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `bin(program)` with `args`, output to `<log_dir>/<name>.log`.
    pub fn start(name: &str, program: &str, args: &[String], log_dir: &Path) -> Self {
        Self::start_with_env(name, program, args, &[], log_dir)
    }

    /// [`Proc::start`] with extra environment variables.
    pub fn start_with_env(name: &str, program: &str, args: &[String], env: &[(&str, &str)], log_dir: &Path) -> Self {
        Self::start_command(name, &RoleCommand { program: bin(program), args: args.to_vec() }, env, log_dir)
    }

    /// Starts a command line (see [`Cluster`]).
    pub fn start_command(name: &str, cmd: &RoleCommand, env: &[(&str, &str)], log_dir: &Path) -> Self {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = Command::new(&cmd.program)
            .args(&cmd.args)
            .envs(env.iter().copied())
            .env("DFLASH_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn");
        Self { name: name.to_string(), child, log }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_for(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for exit or panics with the log.
    pub fn expect_exit(&mut self, timeout: Duration) -> ExitStatus {
        match self.wait_for(timeout) {
            Some(s) => s,
            None => {
                let _ = self.child.kill();
                panic!("{} did not exit within {timeout:?}; log:\n{}", self.name, self.log_text())
            }
        }
    }

    pub fn signal(&self, sig: Signal) {
        let _ = kill(Pid::from_raw(self.pid()), sig);
    }

    /// Waits until the log contains `needle`.
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.log_text().contains(needle) {
                return true;
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                return self.log_text().contains(needle);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `dflash up` on `config` in `ws` (one libtorch thread per role), with
/// extra flags and environment; output in `<ws>/up.log`.
pub fn up(ws: &Workspace, config: &Path, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut args = vec![
        "up".to_string(),
        "--config".into(),
        config.display().to_string(),
        "--workdir".into(),
        ws.path("up").display().to_string(),
        "--target-threads".into(),
        "1".into(),
        "--drafter-threads".into(),
        "1".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::start_with_env("up", "dflash", &args, env, ws.dir.path())
}

/// The three roles of one run on loopback ports, their command lines from
/// the same [`LocalCluster`] `dflash up` uses. The ports are fixed for the
/// test's life (unlike `dflash up`'s port 0): tests restart a coordinator
/// on the address its peers know, and talk to the drafter's port directly.
pub struct Cluster {
    pub local: LocalCluster,
    pub coordinator_url: String,
    pub coordinator_port: u16,
    pub drafter_port: u16,
    pub config: PathBuf,
    pub ledger: PathBuf,
    pub logs: PathBuf,
}

impl Cluster {
    pub fn new(ws: &Workspace, config: PathBuf) -> Self {
        let coordinator_port = free_port();
        let ledger = ws.path("ledger.sqlite");
        let bin_dir = bin("dflash-coordinator").parent().expect("target profile folder").to_path_buf();
        let mut local = LocalCluster::new(&bin_dir, vec!["--config".into(), config.display().to_string()], &ledger);
        (local.drafter_threads, local.target_threads) = (1, 1);
        Self {
            local,
            coordinator_url: format!("http://127.0.0.1:{coordinator_port}"),
            coordinator_port,
            drafter_port: free_port(),
            config,
            ledger,
            logs: ws.path(""),
        }
    }

    pub fn coordinator(&self, extra: &[&str]) -> Proc {
        let mut cmd = self.local.coordinator(&format!("127.0.0.1:{}", self.coordinator_port));
        cmd.args.extend(extra.iter().map(|s| s.to_string()));
        Proc::start_command("coordinator", &cmd, &[], &self.logs)
    }

    pub fn drafter(&self, name: &str) -> Proc {
        let cmd = self.local.drafter(&self.coordinator_url, &format!("127.0.0.1:{}", self.drafter_port));
        Proc::start_command(name, &cmd, &[], &self.logs)
    }

    /// A drafter listening on `port` (another member of a drafter group).
    pub fn drafter_at(&self, name: &str, port: u16) -> Proc {
        let cmd = self.local.drafter(&self.coordinator_url, &format!("127.0.0.1:{port}"));
        Proc::start_command(name, &cmd, &[], &self.logs)
    }

    /// A drafter that tells targets to reach it at `advertise` (a proxy in
    /// front of its port).
    pub fn drafter_advertising(&self, name: &str, advertise: &str) -> Proc {
        self.drafter_at_advertising(name, self.drafter_port, advertise)
    }

    /// A drafter listening on `port` that tells targets to reach it at
    /// `advertise` (a member of a group, behind its own proxy).
    pub fn drafter_at_advertising(&self, name: &str, port: u16, advertise: &str) -> Proc {
        let mut cmd = self.local.drafter(&self.coordinator_url, &format!("127.0.0.1:{port}"));
        let i = cmd.args.iter().position(|a| a == "--advertise").expect("the drafter advertises") + 1;
        cmd.args[i] = advertise.to_string();
        Proc::start_command(name, &cmd, &[], &self.logs)
    }

    pub fn target(&self, name: &str) -> Proc {
        self.target_via(name, &self.coordinator_url)
    }

    /// A target that reaches the coordinator at `coordinator_url` (a proxy).
    pub fn target_via(&self, name: &str, coordinator_url: &str) -> Proc {
        let cmd = self.local.target(coordinator_url, Some(name), "127.0.0.1:0");
        Proc::start_command(name, &cmd, &[], &self.logs)
    }
}

/// Tensor names in a safetensors file.
pub fn safetensors_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).expect("read safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse safetensors");
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    names
}

/// The run's plan, read from the coordinator's ledger (it may be running).
pub fn plan(ledger: &Path) -> Vec<dflash_data::PlannedBatch> {
    dflash_coordinator::ledger::Ledger::open(ledger).expect("ledger").plan().expect("plan")
}

/// The lease token of `batch_id` leased to `target` in the run of `ledger`
/// (its key is in the ledger): what a target holding that lease carries.
pub fn lease_token(ledger: &Path, run_id: &str, batch_id: u64, target: &str) -> Vec<u8> {
    let key = dflash_coordinator::ledger::Ledger::open(ledger).expect("ledger").lease_key().expect("lease key");
    dflash_proto::lease_token::lease_token(&key, run_id, batch_id, target)
}

/// The messages of the plan's batch `planned` as a target named
/// `test-client` holding its lease in the run of `ledger` would send them:
/// f32 features all equal to `value` (one captured layer, layer 2, of width
/// `hidden`), with `edit` applied to the header before the payload is sized
/// (the token is of the batch id after the edit, unless the edit set one).
pub fn planned_batch(
    ledger: &Path,
    run_id: &str,
    planned: &dflash_data::PlannedBatch,
    hidden: u32,
    value: f32,
    edit: impl FnOnce(&mut dflash_proto::BatchHeader),
) -> Vec<dflash_proto::TargetMessage> {
    use dflash_proto as pb;
    let tokens: u32 = planned.sample_lengths.iter().sum();
    let mut header = pb::BatchHeader {
        batch_id: planned.batch_id,
        target_instance: "test-client".into(),
        // The run's layout (SPLIT, the default; one layer reads the same either way).
        layout: pb::Layout::Split as i32,
        dtype: pb::Dtype::F32 as i32,
        token_count: tokens,
        seq_lengths: planned.sample_lengths.clone(),
        input_ids: (0..tokens).map(|i| 20 + i % 100).collect(),
        loss_mask: vec![1u8; tokens as usize].into(),
        layer_ids: vec![2],
        hidden_size: hidden,
        payload_bytes: 0,
        epoch: planned.epoch,
        sample_ids: planned.sample_ids.clone(),
        trace_context: Default::default(),
        target_top_k: 0,
        lease_token: Default::default(),
    };
    edit(&mut header);
    if header.lease_token.is_empty() {
        header.lease_token = lease_token(ledger, run_id, header.batch_id, &header.target_instance).into();
    }
    let payload: Vec<u8> =
        std::iter::repeat_n(value.to_le_bytes(), header.token_count as usize * hidden as usize).flatten().collect();
    header.payload_bytes = payload.len() as u64;
    let batch_id = header.batch_id;
    // A header the drafter refuses at its arrival needs no checksum.
    let header_crc = dflash_wire::BatchMeta::from_header(header.clone()).map_or(0, |m| m.header_crc());
    let chunk = 4096;
    let mut out = vec![pb::TargetMessage { msg: Some(pb::target_message::Msg::Header(header)) }];
    for (i, c) in payload.chunks(chunk).enumerate() {
        out.push(pb::TargetMessage {
            msg: Some(pb::target_message::Msg::Chunk(pb::BatchChunk {
                batch_id,
                index: i as u32,
                data: c.to_vec().into(),
            })),
        });
    }
    out.push(pb::TargetMessage {
        msg: Some(pb::target_message::Msg::End(pb::BatchEnd {
            batch_id,
            chunk_count: payload.len().div_ceil(chunk) as u32,
            crc32c: crc32c::crc32c(&payload),
            header_crc32c: header_crc,
        })),
    });
    out
}
