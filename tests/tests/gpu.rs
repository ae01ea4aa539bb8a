//! Tests that need GPUs (ignored elsewhere; run on GPU hosts with
//! `--ignored`, `scripts/device/gpu-tests.sh`). They start the real binaries.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::time::Duration;

use dflash_tests::{Proc, Workspace};

fn up_on_gpus(ws: &Workspace, name: &str, drafter_devices: &str, steps: &str) -> (bool, String) {
    let config = ws.config(name, "[model]\ndtype = \"auto\"\n[checkpoint]\ninterval_steps = 5");
    let args: Vec<String> = [
        "up",
        "--config",
        &config.display().to_string(),
        "--workdir",
        &ws.path("up").display().to_string(),
        "--target-devices",
        "0",
        "--drafter-devices",
        drafter_devices,
        "--max-steps",
        steps,
        "--set",
        "devices.share_gpus=true",
    ]
    .map(String::from)
    .to_vec();
    let mut up = Proc::start(name, "dflash", &args, ws.dir.path());
    let status = up.expect_exit(Duration::from_secs(240));
    (status.success(), up.log_text())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn services_train_on_one_gpu() {
    let ws = Workspace::synthetic(300, 4);
    let (ok, log) = up_on_gpus(&ws, "gpu1", "0", "12");
    assert!(ok, "{log}");
    assert!(log.contains("pinned buffers") && log.contains("BFloat16"), "{log}");
    assert!(log.contains("step 12/12"), "{log}");
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn data_parallel_replicas_keep_identical_weights() {
    let ws = Workspace::synthetic(400, 4);
    let (ok, log) = up_on_gpus(&ws, "gpu2", "0,1", "15");
    assert!(ok, "{log}");
    assert!(log.contains("data-parallel training on 2 rank(s) of 1 member(s)"), "{log}");
    // Checked at steps 5, 10 and 15 (checkpoint interval), exactly.
    let checks = log.lines().filter(|l| l.contains("weights identical on all 2 replicas")).count();
    assert!(checks >= 3, "{checks} identity checks:\n{log}");
    assert!(!log.contains("diverged"), "{log}");
}
