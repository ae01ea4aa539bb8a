//! A run's roles as processes on one machine: the command line of each
//! role (coordinator, drafter, target) written once, for the one-machine
//! launcher (`dflash up`) and the integration tests alike, and how their
//! addresses are read back from their log lines when they bind port 0.
//! Starting, supervising and stopping the processes stays with the caller
//! (the launcher restarts killed roles; tests kill them on purpose).

use std::path::{Path, PathBuf};

/// The log line a role writes once its server is bound ("... listening on ADDR").
pub const LISTENING: &str = "listening on ";
/// The log line of a role's Prometheus endpoint ("metrics on URL").
pub const METRICS: &str = "metrics on ";

/// The address after `marker` in a log line ("... listening on 127.0.0.1:4711 (plain)").
pub fn address_after<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    let rest = line.split_once(marker)?.1;
    Some(rest.split_whitespace().next()?.trim_end_matches(['.', ',']))
}

/// One of the three roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Coordinator,
    Drafter,
    Target,
}

impl Role {
    /// The role's binary.
    pub fn program(self) -> &'static str {
        match self {
            Role::Coordinator => "dflash-coordinator",
            Role::Drafter => "dflash-drafter",
            Role::Target => "dflash-target",
        }
    }
}

/// A process, ready to start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// The roles of one run on loopback.
#[derive(Clone, Debug)]
pub struct LocalCluster {
    /// Where the three binaries are.
    pub bin_dir: PathBuf,
    /// How the coordinator gets the run config (`--config FILE`, `--set K=V`, ...).
    pub config_args: Vec<String>,
    pub ledger: PathBuf,
    /// `https` when the roles speak TLS.
    pub scheme: &'static str,
    /// Flags every role gets (TLS files, a metrics endpoint).
    pub common_args: Vec<String>,
    /// libtorch threads per process (0: libtorch's default).
    pub drafter_threads: u32,
    pub target_threads: u32,
}

impl LocalCluster {
    /// Plain-text roles of `config_args` with their ledger at `ledger`.
    pub fn new(bin_dir: &Path, config_args: Vec<String>, ledger: &Path) -> Self {
        Self {
            bin_dir: bin_dir.to_path_buf(),
            config_args,
            ledger: ledger.to_path_buf(),
            scheme: "http",
            common_args: Vec::new(),
            drafter_threads: 0,
            target_threads: 0,
        }
    }

    /// The URL of a role listening on `addr`.
    pub fn url(&self, addr: &str) -> String {
        format!("{}://{addr}", self.scheme)
    }

    fn command(&self, role: Role, mut args: Vec<String>) -> RoleCommand {
        args.extend(self.common_args.iter().cloned());
        RoleCommand { program: self.bin_dir.join(role.program()), args }
    }

    /// The coordinator serving on `listen` (port 0: a free port, in its log).
    pub fn coordinator(&self, listen: &str) -> RoleCommand {
        let mut args = self.config_args.clone();
        args.extend(["--listen".into(), listen.into(), "--ledger".into(), self.ledger.display().to_string()]);
        self.command(Role::Coordinator, args)
    }

    /// A drafter of the coordinator at `coordinator_url`, serving targets on
    /// `listen`. It advertises `listen` (port 0: the port it bound).
    pub fn drafter(&self, coordinator_url: &str, listen: &str) -> RoleCommand {
        let args = vec![
            "serve".into(),
            "--coordinator".into(),
            coordinator_url.into(),
            "--listen".into(),
            listen.into(),
            "--advertise".into(),
            self.url(listen),
            "--threads".into(),
            self.drafter_threads.to_string(),
        ];
        self.command(Role::Drafter, args)
    }

    /// A target of the coordinator at `coordinator_url` with its health
    /// endpoint on `health_listen`; `instance_id` names it (else it names itself).
    pub fn target(&self, coordinator_url: &str, instance_id: Option<&str>, health_listen: &str) -> RoleCommand {
        let mut args = vec!["serve".into(), "--coordinator".into(), coordinator_url.into()];
        if let Some(id) = instance_id {
            args.extend(["--instance-id".into(), id.into()]);
        }
        args.extend([
            "--health-listen".into(),
            health_listen.into(),
            "--threads".into(),
            self.target_threads.to_string(),
        ]);
        self.command(Role::Target, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_read_from_the_roles_log_lines() {
        let line = "2026-01-01T00:00:00Z INFO coordinator listening on 127.0.0.1:40123 (plain)";
        assert_eq!(address_after(line, LISTENING), Some("127.0.0.1:40123"));
        let line = "INFO metrics on http://127.0.0.1:9999/metrics";
        assert_eq!(address_after(line, METRICS), Some("http://127.0.0.1:9999/metrics"));
        assert_eq!(address_after("nothing here", LISTENING), None);
    }

    #[test]
    fn every_role_gets_the_shared_flags_and_its_own() {
        let mut c = LocalCluster::new(Path::new("/bin"), vec!["--config".into(), "run.toml".into()], Path::new("l.db"));
        c.scheme = "https";
        c.common_args = vec!["--tls-ca".into(), "ca.pem".into()];
        c.drafter_threads = 2;
        let co = c.coordinator("127.0.0.1:0");
        assert_eq!(co.program, Path::new("/bin/dflash-coordinator"));
        assert_eq!(
            co.args,
            ["--config", "run.toml", "--listen", "127.0.0.1:0", "--ledger", "l.db", "--tls-ca", "ca.pem"]
        );
        let d = c.drafter("https://127.0.0.1:5", "127.0.0.1:0");
        assert!(d.args.windows(2).any(|w| w == ["--advertise", "https://127.0.0.1:0"]), "{:?}", d.args);
        assert!(d.args.windows(2).any(|w| w == ["--threads", "2"]));
        let t = c.target("https://127.0.0.1:5", Some("t-1"), "127.0.0.1:0");
        assert!(t.args.windows(2).any(|w| w == ["--instance-id", "t-1"]));
        assert_eq!(t.args.last().map(String::as_str), Some("ca.pem"));
    }
}
