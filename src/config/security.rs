//! Security settings of the listeners (`serve`, `worker`) and of the CLI.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

use super::common::ConfigError;

#[derive(Debug, Clone, Default, Args)]
pub struct SecurityArgs {
    /// Serve gRPC over TLS with this certificate chain (PEM); re-read when it changes.
    #[arg(long, env = "BATON_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "BATON_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Verify client certificates against this CA (mTLS). Without --auth-tokens-file a
    /// client certificate is required; with it, a token will do instead.
    #[arg(long, env = "BATON_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Roles of client certificates by subject CN, `CN=role` (read, submit, admin),
    /// comma-separated.
    #[arg(
        long,
        env = "BATON_TLS_CLIENT_ROLES",
        value_delimiter = ',',
        requires = "tls_client_ca"
    )]
    pub tls_client_roles: Vec<String>,
    /// Bearer tokens, one `token role [name]` per line (`sha256:<hex>` instead of a token
    /// keeps only its digest on disk); re-read when it changes.
    #[arg(long, env = "BATON_AUTH_TOKENS_FILE")]
    pub auth_tokens_file: Option<PathBuf>,
    /// Listen on a non-loopback address without TLS and authentication (behind a mesh that
    /// does both, say). Logged as a warning.
    #[arg(long, env = "BATON_INSECURE_ALLOW_UNAUTHENTICATED")]
    pub insecure_allow_unauthenticated: bool,
    /// The token this process sends to workers' WorkerService (coordinators reading logs).
    #[arg(long, env = "BATON_PEER_TOKEN_FILE")]
    pub peer_token_file: Option<PathBuf>,
    /// Call workers over TLS, verifying them against this CA; --tls-cert and --tls-key, if
    /// given, are presented as the client certificate.
    #[arg(long, env = "BATON_PEER_CA")]
    pub peer_ca: Option<PathBuf>,
}

impl SecurityArgs {
    /// Refuses to expose an unauthenticated or cleartext API beyond loopback: the API runs
    /// commands for whoever reaches it.
    pub fn validate(&self, listen: SocketAddr) -> Result<(), ConfigError> {
        if listen.ip().is_loopback() {
            return Ok(());
        }
        let tls = self.tls_cert.is_some();
        let auth = self.auth_tokens_file.is_some() || self.tls_client_ca.is_some();
        if tls && auth {
            return Ok(());
        }
        if self.insecure_allow_unauthenticated {
            tracing::warn!(%listen, tls, authentication = auth, "listening beyond loopback without TLS and authentication (--insecure-allow-unauthenticated): anyone who reaches this address can run commands");
            return Ok(());
        }
        let missing = match (tls, auth) {
            (false, false) => "TLS (--tls-cert, --tls-key) and authentication (--auth-tokens-file or --tls-client-ca)",
            (false, true) => "TLS (--tls-cert, --tls-key): tokens would cross the network in clear",
            _ => "authentication (--auth-tokens-file or --tls-client-ca)",
        };
        Err(ConfigError(format!(
            "refusing to listen on {listen} without {missing}; give them, listen on loopback, or pass --insecure-allow-unauthenticated"
        )))
    }
}

/// How the CLI reaches a secured cluster, like etcdctl's and kubectl's flags.
#[derive(Debug, Clone, Default, Args)]
pub struct ClientSecurityArgs {
    /// File holding the bearer token to send.
    #[arg(long, env = "BATON_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// CA certificate (PEM) to verify the replicas with; turns on TLS.
    #[arg(long, env = "BATON_CA")]
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM) for mTLS.
    #[arg(long, env = "BATON_CERT", requires = "key")]
    pub cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, env = "BATON_KEY", requires = "cert")]
    pub key: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beyond_loopback_needs_tls_and_authentication() {
        let any: SocketAddr = "0.0.0.0:7600".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:7600".parse().unwrap();
        let none = SecurityArgs::default();
        assert!(none.validate(lo).is_ok());
        let e = none.validate(any).unwrap_err();
        assert!(e.0.contains("--insecure-allow-unauthenticated"), "{e}");
        let tokens_only = SecurityArgs {
            auth_tokens_file: Some("t".into()),
            ..Default::default()
        };
        assert!(tokens_only
            .validate(any)
            .unwrap_err()
            .0
            .contains("in clear"));
        let both = SecurityArgs {
            tls_cert: Some("c".into()),
            tls_key: Some("k".into()),
            ..tokens_only.clone()
        };
        assert!(both.validate(any).is_ok());
        let insecure = SecurityArgs {
            insecure_allow_unauthenticated: true,
            ..Default::default()
        };
        assert!(insecure.validate(any).is_ok());
    }
}
