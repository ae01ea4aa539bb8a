//! Transport security of every gRPC endpoint: optional TLS, mutual TLS,
//! and a shared token on control RPCs.
//!
//! These settings are per process (flags or environment), not part of the
//! run config: a role needs them to reach the coordinator that hands out
//! the run config. Health checks stay reachable without the token so that
//! probes work; with TLS on, `--health-listen` serves them in plain text for
//! probes that cannot speak TLS (Kubernetes' native gRPC probe).

use std::path::{Path, PathBuf};

use anyhow::Context;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};
use tonic::{Request, Status};

/// Command-line settings of transport security.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SecurityArgs {
    /// PEM certificate this process serves with (turns TLS on for its gRPC
    /// servers) and presents to servers that require client certificates.
    #[arg(long, env = "DFLASH_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "DFLASH_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate: clients verify servers against it, and servers
    /// with a certificate require clients to present one it signed (mTLS).
    #[arg(long, env = "DFLASH_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Shared token: servers require `authorization: Bearer <token>` on
    /// control and data RPCs, and clients send it.
    #[arg(long, env = "DFLASH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Loaded security settings.
#[derive(Clone, Debug, Default)]
pub struct Security {
    server_tls: Option<ServerTlsConfig>,
    client_tls: Option<ClientTlsConfig>,
    token: Option<MetadataValue<Ascii>>,
    summary: String,
}

fn read_pem(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    let bytes = std::fs::read(path).with_context(|| format!("{what} {}", path.display()))?;
    anyhow::ensure!(
        bytes.windows(11).any(|w| w == b"-----BEGIN "),
        "{what} {}: not a PEM file (no -----BEGIN line)",
        path.display()
    );
    Ok(bytes)
}

impl SecurityArgs {
    /// Reads the certificate files, with errors that name them.
    pub fn load(&self) -> anyhow::Result<Security> {
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some(Identity::from_pem(read_pem(c, "--tls-cert")?, read_pem(k, "--tls-key")?)),
            _ => None,
        };
        let ca = self.tls_ca.as_deref().map(|p| read_pem(p, "--tls-ca")).transpose()?.map(Certificate::from_pem);
        let server_tls = identity.clone().map(|id| {
            let tls = ServerTlsConfig::new().identity(id);
            match &ca {
                Some(ca) => tls.client_ca_root(ca.clone()),
                None => tls,
            }
        });
        let client_tls = (identity.is_some() || ca.is_some()).then(|| {
            let mut tls = ClientTlsConfig::new().with_enabled_roots();
            if let Some(ca) = &ca {
                tls = tls.ca_certificate(ca.clone());
            }
            if let Some(id) = identity {
                tls = tls.identity(id);
            }
            tls
        });
        let token = match self.token.as_deref().filter(|t| !t.is_empty()) {
            Some(t) => {
                Some(format!("Bearer {t}").parse::<MetadataValue<Ascii>>().context("--token must be printable ASCII")?)
            }
            None => None,
        };
        let summary = format!(
            "TLS {}, token {}",
            match (&server_tls, &ca) {
                (Some(_), Some(_)) => "on with client certificates (mTLS)",
                (Some(_), None) => "on",
                (None, Some(_)) => "client only (verifies servers)",
                (None, None) => "off",
            },
            if token.is_some() { "required" } else { "off" }
        );
        Ok(Security { server_tls, client_tls, token, summary })
    }
}

impl Security {
    /// One line for the startup log.
    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// URL scheme of this process's own gRPC servers.
    pub fn scheme(&self) -> &'static str {
        if self.server_tls.is_some() { "https" } else { "http" }
    }

    /// Applies TLS to a server builder when this process has a certificate.
    pub fn server(&self, builder: Server) -> anyhow::Result<Server> {
        match &self.server_tls {
            Some(tls) => builder.tls_config(tls.clone()).context("TLS settings of the gRPC server"),
            None => Ok(builder),
        }
    }

    /// Applies client TLS to an endpoint whose URL is `https://`.
    pub fn endpoint(&self, endpoint: Endpoint) -> anyhow::Result<Endpoint> {
        let https = endpoint.uri().scheme_str() == Some("https");
        match (&self.client_tls, https) {
            (Some(tls), true) => endpoint.tls_config(tls.clone()).context("client TLS settings"),
            (None, true) => {
                endpoint.tls_config(ClientTlsConfig::new().with_enabled_roots()).context("client TLS settings")
            }
            (_, false) => Ok(endpoint),
        }
    }

    /// Client side: adds the token to every request.
    pub fn client_auth(&self) -> ClientAuth {
        ClientAuth(self.token.clone())
    }

    /// Server side: refuses requests without the token.
    pub fn server_auth(&self) -> ServerAuth {
        ServerAuth(self.token.clone())
    }
}

/// Adds `authorization: Bearer <token>` to outgoing requests.
#[derive(Clone, Debug)]
pub struct ClientAuth(Option<MetadataValue<Ascii>>);

impl Interceptor for ClientAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut().insert("authorization", t.clone());
        }
        Ok(req)
    }
}

/// Checks `authorization: Bearer <token>` on incoming requests.
#[derive(Clone, Debug)]
pub struct ServerAuth(Option<MetadataValue<Ascii>>);

impl Interceptor for ServerAuth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.0 else { return Ok(req) };
        match req.metadata().get("authorization") {
            // Constant-time enough for a shared secret compared once per RPC:
            // compare every byte regardless of where the first mismatch is.
            Some(got) if constant_time_eq(got.as_bytes(), want.as_bytes()) => Ok(req),
            Some(_) => Err(Status::unauthenticated("wrong token")),
            None => Err(Status::unauthenticated("missing token (authorization: Bearer ...)")),
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_required_when_set() {
        let sec = SecurityArgs { token: Some("s3cret".into()), ..Default::default() }.load().expect("load");
        let mut server = sec.server_auth();
        assert_eq!(server.call(Request::new(())).expect_err("no token").code(), tonic::Code::Unauthenticated);
        let with = sec.client_auth().call(Request::new(())).expect("client");
        assert!(server.call(with).is_ok());
        let wrong = SecurityArgs { token: Some("other".into()), ..Default::default() }.load().expect("load");
        let req = wrong.client_auth().call(Request::new(())).expect("client");
        assert_eq!(server.call(req).expect_err("wrong").message(), "wrong token");
    }

    #[test]
    fn no_token_lets_requests_through_and_bad_files_are_named() {
        let sec = SecurityArgs::default().load().expect("load");
        assert!(sec.server_auth().call(Request::new(())).is_ok());
        assert_eq!(sec.summary(), "TLS off, token off");
        let dir = tempfile::tempdir().expect("tempdir");
        let not_pem = dir.path().join("cert.pem");
        std::fs::write(&not_pem, "hello").expect("write");
        let args = SecurityArgs { tls_cert: Some(not_pem.clone()), tls_key: Some(not_pem), ..Default::default() };
        let err = format!("{:#}", args.load().expect_err("not pem"));
        assert!(err.contains("--tls-cert") && err.contains("cert.pem") && err.contains("not a PEM file"), "{err}");
    }
}
