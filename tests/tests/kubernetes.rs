//! The Kubernetes manifests: every overlay renders with `kubectl kustomize`
//! and every rendered object passes strict schema validation offline
//! (kubernetes-validate from PyPI, installed into a cached virtualenv),
//! with the resources, probes and policies the design needs.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::PathBuf;
use std::process::Command;

const KUBERNETES_VERSION: &str = "1.32.0";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A command running the validator, installed on first use into a cached
/// folder (`pip --target`, then an atomic rename: tests run in parallel).
fn validator() -> Command {
    let dir = root().join(".cache/kubernetes-validate-1.37.0");
    if !dir.is_dir() {
        let tmp = root().join(format!(".cache/kubernetes-validate.tmp-{}", std::process::id()));
        let ok = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--target"])
            .arg(&tmp)
            .arg("kubernetes-validate==1.37.0")
            .status()
            .unwrap()
            .success();
        assert!(ok, "pip install kubernetes-validate failed");
        if std::fs::rename(&tmp, &dir).is_err() {
            // Another test installed it first.
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    let mut c = Command::new("python3");
    c.env("PYTHONPATH", &dir).args(["-m", "kubernetes_validate"]);
    c
}

fn render(overlay: &str) -> String {
    let out = Command::new("kubectl")
        .args(["kustomize"])
        .arg(root().join("deploy/k8s/overlays").join(overlay))
        .output()
        .expect("kubectl is needed to render the manifests");
    assert!(out.status.success(), "{overlay}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn validate(overlay: &str, rendered: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(format!("{overlay}.yaml"));
    std::fs::write(&file, rendered).unwrap();
    let out = validator().args(["--strict", "-k", KUBERNETES_VERSION]).arg(&file).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{overlay} failed validation:\n{text}");
    let passed = text.matches(" passed for resource ").count();
    assert_eq!(passed, rendered.matches("\nkind: ").count() + usize::from(rendered.starts_with("kind: ")), "{text}");
}

#[test]
fn the_gpu_overlay_renders_the_design_topology_and_validates() {
    let y = render("gpu");
    validate("gpu", &y);
    for want in [
        "nvidia.com/gpu: \"5\"",
        "nvidia.com/gpu: \"3\"",
        "kind: NetworkPolicy",
        "kind: PersistentVolumeClaim",
        "terminationGracePeriodSeconds: 120",
        "grpc:\n            port: 50062",
        "value: http://jaeger:4317",
        "name: dflash-run-config",
        "target = \"0,1,2,3,4\"",
        "drafter = \"0,1,2\"",
        "image: registry.example.com/dflash:cuda",
    ] {
        assert!(y.contains(want), "gpu overlay lacks {want:?}:\n{y}");
    }
}

#[test]
fn the_cpu_demo_overlay_requests_no_gpus_and_validates() {
    let y = render("cpu-demo");
    validate("cpu-demo", &y);
    assert!(!y.contains("nvidia.com/gpu"), "{y}");
    assert!(y.contains("prepare-synthetic") && y.contains("target = \"cpu\""), "{y}");
}
