//! The Kubernetes manifests: every overlay renders with `kubectl kustomize`
//! and every rendered object passes strict schema validation offline
//! (kubernetes-validate from PyPI, installed into a cached virtualenv),
//! with the resources, probes and policies the design needs.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::process::Command;

const KUBERNETES_VERSION: &str = "1.32.0";

/// A command running the validator, installed on first use into a cached
/// folder (`pip --target`, then an atomic rename: tests run in parallel).
fn validator() -> Command {
    let dir = dflash_tests::repo_root().join(".cache/kubernetes-validate-1.37.0");
    if !dir.is_dir() {
        let tmp = dflash_tests::repo_root().join(format!(".cache/kubernetes-validate.tmp-{}", std::process::id()));
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
        .arg(dflash_tests::repo_root().join("deploy/k8s/overlays").join(overlay))
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
        "nvidia.com/gpu: \"1\"",
        "kind: NetworkPolicy",
        "kind: PersistentVolumeClaim",
        "terminationGracePeriodSeconds: 120",
        "grpc:\n            port: 50062",
        "value: http://jaeger:4317",
        "name: dflash-run-config",
        "target = \"0,1,2,3,4\"",
        "drafter = \"0\"",
        "image: registry.example.com/dflash:cuda",
    ] {
        assert!(y.contains(want), "gpu overlay lacks {want:?}:\n{y}");
    }
    the_drafter_is_a_group_of(&y, "base/run.toml", 3);
}

#[test]
fn the_cpu_demo_overlay_requests_no_gpus_and_validates() {
    let y = render("cpu-demo");
    validate("cpu-demo", &y);
    assert!(!y.contains("nvidia.com/gpu"), "{y}");
    assert!(y.contains("prepare-synthetic") && y.contains("target = \"cpu\""), "{y}");
    the_drafter_is_a_group_of(&y, "overlays/cpu-demo/run.toml", 2);
}

/// The rendered objects as JSON (PyYAML comes with the validator).
fn objects(rendered: &str) -> Vec<serde_json::Value> {
    validator(); // installs the cached folder on first use
    let dir = dflash_tests::repo_root().join(".cache/kubernetes-validate-1.37.0");
    let mut child = Command::new("python3")
        .env("PYTHONPATH", &dir)
        .args(["-c", "import json,sys,yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(rendered.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The drafter is a StatefulSet of `members` pods, one GPU (or the CPU)
/// each, behind a headless Service that publishes members before they are
/// ready (the group meets before its members report ready), allowed to
/// reach each other on any port; and the run config the overlay ships
/// parses, validates and names the same group size.
fn the_drafter_is_a_group_of(rendered: &str, run_config: &str, members: u32) {
    let objects = objects(rendered);
    let of = |kind: &str, name: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in:\n{rendered}"))
    };
    assert!(!objects.iter().any(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "drafter"));
    let set = &of("StatefulSet", "drafter")["spec"];
    assert_eq!(set["replicas"], members);
    assert_eq!(set["serviceName"], "drafter");
    assert_eq!(set["podManagementPolicy"], "Parallel");
    let container = &set["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["command"].as_array().unwrap().iter().filter_map(|a| a.as_str()).collect();
    assert!(args.contains(&"--advertise=http://$(POD_NAME).drafter:50052"), "{args:?}");
    let pod_name = container["env"].as_array().unwrap().iter().find(|e| e["name"] == "POD_NAME").unwrap();
    assert_eq!(pod_name["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
    let gpus = &container["resources"]["limits"]["nvidia.com/gpu"];
    // The shipped overlays run each member on one GPU (devices.drafter = "0"):
    // a member of several GPUs asks for as many here and names them there.
    assert!(gpus.is_null() || *gpus == "1", "the overlays give each member one GPU: {gpus}");

    let service = &of("Service", "drafter")["spec"];
    assert_eq!(service["clusterIP"], "None");
    assert_eq!(service["publishNotReadyAddresses"], true);
    let policy = &of("NetworkPolicy", "drafter-from-targets-and-its-group")["spec"];
    let any_port_from_members = policy["ingress"].as_array().unwrap().iter().any(|rule| {
        rule["ports"].is_null()
            && rule["from"].as_array().is_some_and(|f| {
                f.iter().any(|p| p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "drafter")
            })
    });
    assert!(any_port_from_members, "the members must reach each other on any port: {policy}");

    let path = dflash_tests::repo_root().join("deploy/k8s").join(run_config);
    let config = dflash_config::from_toml_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    config.validate().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(config.group.size, members, "{}: group.size must equal the StatefulSet's replicas", path.display());
}
