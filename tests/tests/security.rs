//! Transport security: a whole run over mutual TLS with a shared token,
//! and a coordinator that refuses clients without a certificate, without
//! the token, with a wrong token, or in plain text -- while its plain-text
//! health port still answers probes.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use dflash_tests::{Cluster, Workspace, bin, free_port};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// A CA and one leaf certificate (server and client) for 127.0.0.1.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn pki(dir: &Path) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "dflash test CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    leaf.distinguished_name.push(DnType::CommonName, "dflash role");
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer).unwrap();
    let p = Pki { ca: dir.join("ca.pem"), cert: dir.join("role.pem"), key: dir.join("role.key") };
    std::fs::write(&p.ca, ca_cert.pem()).unwrap();
    std::fs::write(&p.cert, leaf_cert.pem()).unwrap();
    std::fs::write(&p.key, leaf_key.serialize_pem()).unwrap();
    p
}

fn tls_args(p: &Pki) -> Vec<String> {
    vec![
        "--tls-cert".into(),
        p.cert.display().to_string(),
        "--tls-key".into(),
        p.key.display().to_string(),
        "--tls-ca".into(),
        p.ca.display().to_string(),
    ]
}

#[test]
fn a_run_over_mutual_tls_with_a_token_trains_to_the_end() {
    let ws = Workspace::synthetic(200, 4);
    let p = pki(ws.dir.path());
    let config = ws.config("mtls", "[run]\nmax_steps = 6\n");
    let mut extra = vec!["--token".to_string(), "s3cret-token".into()];
    extra.extend(tls_args(&p));
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut up = dflash_tests::up(&ws, &config, &extra, &[]);
    let status = up.expect_exit(Duration::from_secs(180));
    let log = up.log_text();
    assert!(status.success(), "{log}");
    assert!(log.contains("TLS on with client certificates (mTLS), token required"), "{log}");
    assert!(log.contains("https://127.0.0.1:"), "{log}");
    assert!(log.contains("run completed"), "{log}");
}

/// `dflash status` against the coordinator with the given extra flags.
fn status(url: &str, extra: &[String]) -> (bool, String) {
    let out = Command::new(bin("dflash"))
        .args(["status", "--coordinator", url])
        .args(extra)
        .env_remove("DFLASH_TOKEN")
        .output()
        .unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn the_coordinator_refuses_clients_without_certificate_or_token() {
    let ws = Workspace::synthetic(40, 4);
    let p = pki(ws.dir.path());
    let config = ws.config("refuse", "");
    let cluster = Cluster::new(&ws, config);
    let health = free_port();
    let mut extra = tls_args(&p);
    extra.extend(["--token".into(), "right".into(), "--health-listen".into(), format!("127.0.0.1:{health}")]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut coordinator = cluster.coordinator(&extra);
    assert!(coordinator.wait_for_log("coordinator listening", Duration::from_secs(30)), "{}", coordinator.log_text());
    let https = format!("https://127.0.0.1:{}", cluster.coordinator_port);

    // Plain-text health for probes answers; the health subcommand says so.
    let out = Command::new(bin("dflash-coordinator"))
        .args(["health", "--url", &format!("http://127.0.0.1:{health}")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "SERVING");

    let ca_only = vec!["--tls-ca".to_string(), p.ca.display().to_string(), "--token".into(), "right".into()];
    let (ok, text) = status(&https, &ca_only);
    assert!(!ok, "a client without a certificate got through: {text}");

    let mut wrong = tls_args(&p);
    wrong.extend(["--token".into(), "wrong".into()]);
    let (ok, text) = status(&https, &wrong);
    assert!(!ok && text.contains("wrong token"), "{text}");

    let (ok, text) = status(&https, &tls_args(&p));
    assert!(!ok && text.contains("missing token"), "{text}");

    let (ok, text) = status(&format!("http://127.0.0.1:{}", cluster.coordinator_port), &[]);
    assert!(!ok, "plain text reached a TLS server: {text}");

    let mut right = tls_args(&p);
    right.extend(["--token".into(), "right".into()]);
    let (ok, text) = status(&https, &right);
    assert!(ok && text.contains("RUN_STATE_RUNNING"), "{text}");
    drop(coordinator);
}
