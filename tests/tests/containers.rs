//! The Compose stack for real: builds the images (base made locally, no
//! registry), brings coordinator, target and a drafter group of two
//! (docker-compose.group.yml) up on CPU with SmolLM2, waits for health, then
//! `docker kill`s one member's container (the other re-forms the group
//! alone) and starts it again (the group grows back to two), cuts the target
//! off the network for longer than the instance timeout, and cuts a member
//! off for longer than the collective timeout. Training goes on through all
//! of it, the target container is never restarted, and every batch ends
//! committed exactly once in the ledger, trained by both members.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use dflash_coordinator::ledger::Ledger;
use dflash_tests::free_port;

fn root() -> PathBuf {
    dflash_tests::repo_root().canonicalize().unwrap()
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// One Compose project, taken down (with its volumes) when dropped.
struct Stack {
    project: String,
    data: PathBuf,
    coordinator_port: u16,
    metrics_port: u16,
}

impl Stack {
    fn compose(&self) -> Command {
        let mut c = Command::new("docker-compose");
        c.current_dir(root())
            .args(["-p", &self.project, "-f", "docker-compose.yml", "-f", "docker-compose.group.yml"])
            .env("DFLASH_DATA", &self.data)
            .env("DFLASH_IMAGE", "dflash:local")
            .env("DFLASH_COORDINATOR_PORT", self.coordinator_port.to_string())
            .env("DFLASH_COORDINATOR_METRICS_PORT", self.metrics_port.to_string())
            .env("DFLASH_TARGET_THREADS", "1")
            .env("DFLASH_DRAFTER_THREADS", "1");
        c
    }

    fn container(&self, service: &str) -> String {
        text(&run(self.compose().args(["ps", "-q", service])))
    }

    fn inspect(&self, id: &str, format: &str) -> String {
        text(&run(Command::new("docker").args(["inspect", "-f", format, id])))
    }

    fn logs(&self, service: &str) -> String {
        let out = self.compose().args(["logs", "--no-color", service]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn wait_for(&self, what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        while !ok() {
            assert!(
                Instant::now() < deadline,
                "{what} within {timeout:?}; logs:\n{}\n{}\n{}\n{}",
                self.logs("coordinator"),
                self.logs("target"),
                self.logs("drafter"),
                self.logs("drafter-1")
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The coordinator's log lines that announce a formed generation.
    fn generations(&self) -> Vec<String> {
        self.logs("coordinator")
            .lines()
            .filter(|l| l.contains("drafter group generation") && l.contains("formed"))
            .map(String::from)
            .collect()
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = self.compose().args(["down", "-v", "--timeout", "5"]).output();
    }
}

fn checkpoint_step(data: &Path) -> u64 {
    std::fs::read_to_string(data.join("state/checkpoints/latest"))
        .ok()
        .and_then(|l| l.trim().strip_prefix("step-").and_then(|s| s.parse().ok()))
        .unwrap_or(0)
}

#[test]
fn compose_group_survives_a_member_killed_a_member_cut_off_and_a_target_cut_off() {
    let docker = Command::new("docker").arg("info").output();
    assert!(
        docker.as_ref().is_ok_and(|o| o.status.success()),
        "this test needs a running Docker Engine with docker-compose"
    );
    let root = root();
    run(&mut Command::new(root.join("deploy/docker/build-images.sh")));

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    run(Command::new(root.join("deploy/compose/assets.sh")).arg(&data).args(["24", "48"]));
    // Small enough to finish quickly, long enough to do things midway.
    let config = std::fs::read_to_string(root.join("deploy/compose/run.toml"))
        .unwrap()
        .replace("epochs = 2", "epochs = 8")
        .replace("max_batch_size = 2", "max_batch_size = 1")
        .replace("interval_steps = 10", "interval_steps = 5");
    let group = std::fs::read_to_string(root.join("deploy/compose/group.toml")).unwrap();
    std::fs::write(data.join("run-group.toml"), config + &group).unwrap();

    let stack = Stack {
        project: format!("dflashci{}", std::process::id()),
        data: data.clone(),
        coordinator_port: free_port(),
        metrics_port: free_port(),
    };
    run(stack.compose().args(["up", "-d"]));
    for service in ["coordinator", "target", "drafter", "drafter-1"] {
        let id = stack.container(service);
        stack.wait_for(&format!("{service} healthy"), Duration::from_secs(180), || {
            stack.inspect(&id, "{{.State.Health.Status}}") == "healthy"
        });
    }
    let target = stack.container("target");
    let target_started = stack.inspect(&target, "{{.State.StartedAt}}");
    let member = stack.container("drafter-1");
    let network = format!("{}_default", stack.project);
    let formed_with = |n: usize| move |l: &String| l.contains(&format!("formed with {n} member(s)"));

    // Both members train one drafter; kill one after the first checkpoint.
    stack.wait_for("a first checkpoint of the group of two", Duration::from_secs(240), || {
        checkpoint_step(&data) >= 5 && stack.generations().iter().any(formed_with(2))
    });
    let before = stack.generations().len();
    run(Command::new("docker").args(["kill", &member]));
    let killed = Instant::now();
    // The survivor leaves its generation (exit 75) and Compose starts it
    // again; it trains alone until the killed member is back.
    stack.wait_for("a group of one", Duration::from_secs(120), || {
        stack.generations().iter().skip(before).any(formed_with(1))
    });
    println!("member kill -> group of one in {:.1} s", killed.elapsed().as_secs_f64());
    let step = checkpoint_step(&data);
    stack.wait_for("the group of one training on", Duration::from_secs(120), || checkpoint_step(&data) > step);
    let drafter = stack.container("drafter");
    assert_ne!(stack.inspect(&drafter, "{{.RestartCount}}"), "0", "the survivor re-formed without leaving");
    let before = stack.generations().len();
    run(stack.compose().args(["start", "drafter-1"]));
    stack.wait_for("the group growing back to two", Duration::from_secs(120), || {
        stack.generations().iter().skip(before).any(formed_with(2))
    });

    // Cut the target off for longer than the instance timeout, then back.
    run(Command::new("docker").args(["network", "disconnect", &network, &target]));
    std::thread::sleep(Duration::from_secs(8));
    run(Command::new("docker").args(["network", "connect", "--alias", "target", &network, &target]));

    // Cut a member off for longer than the collective timeout: the group
    // goes on without it, and takes it back once it is reachable again.
    let before = stack.generations().len();
    run(Command::new("docker").args(["network", "disconnect", &network, &member]));
    stack.wait_for("a group without the cut-off member", Duration::from_secs(120), || {
        stack.generations().iter().skip(before).any(formed_with(1))
    });
    run(Command::new("docker").args(["network", "connect", "--alias", "drafter-1", &network, &member]));

    let coordinator = stack.container("coordinator");
    stack.wait_for("the run to complete", Duration::from_secs(600), || {
        stack.inspect(&coordinator, "{{.State.Status}}") == "exited"
    });
    assert_eq!(stack.inspect(&coordinator, "{{.State.ExitCode}}"), "0", "{}", stack.logs("coordinator"));
    let coordinator_log = stack.logs("coordinator");
    assert!(coordinator_log.contains("completed: all"), "{coordinator_log}");

    // The target was never restarted: same container, same start.
    assert_eq!(stack.container("target"), target);
    assert_eq!(stack.inspect(&target, "{{.State.StartedAt}}"), target_started);
    assert_eq!(stack.inspect(&target, "{{.RestartCount}}"), "0");
    let target_log = stack.logs("target");
    assert!(target_log.contains("registering again"), "the coordinator never lost the target:\n{target_log}");

    // Every batch committed exactly once, and both members trained some.
    let ledger = Ledger::open(&data.join("state/ledger.sqlite")).unwrap();
    let audit = ledger.audit().unwrap();
    assert!(audit.len() >= 150, "{} batches", audit.len());
    for a in &audit {
        assert_eq!((a.state.as_str(), a.commits), ("committed", 1), "{a:?}");
    }
    let members: std::collections::BTreeSet<_> = audit.iter().filter_map(|a| a.member.clone()).collect();
    assert!(members.len() >= 2, "trained by {members:?}");
}
