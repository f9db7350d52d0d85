//! Settings every command shares: etcd access, names and lease checks.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::store::EtcdConfig;

#[derive(Debug, Clone, Args)]
pub struct EtcdArgs {
    /// etcd client endpoints, comma-separated.
    #[arg(
        long,
        env = "BATON_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "127.0.0.1:2379"
    )]
    pub etcd_endpoints: Vec<String>,
    /// Bound on each single etcd call.
    #[arg(long, env = "BATON_ETCD_TIMEOUT", value_parser = humantime::parse_duration, default_value = "3s")]
    pub etcd_timeout: Duration,
    /// How long to wait for etcd at start before giving up.
    #[arg(long, env = "BATON_STARTUP_TIMEOUT", value_parser = humantime::parse_duration, default_value = "30s")]
    pub startup_timeout: Duration,
    /// CA certificate (PEM) of etcd's client port; turns on TLS to etcd.
    #[arg(long, env = "BATON_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd's `--client-cert-auth`.
    #[arg(
        long,
        env = "BATON_ETCD_CERT",
        requires = "etcd_key",
        requires = "etcd_ca"
    )]
    pub etcd_cert: Option<PathBuf>,
    /// The key of --etcd-cert (PEM).
    #[arg(long, env = "BATON_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (with etcd's auth enabled); the password comes from --etcd-password-file.
    #[arg(long, env = "BATON_ETCD_USER", requires = "etcd_password_file")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (trailing newline ignored).
    #[arg(long, env = "BATON_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
    /// Test hook: lease keepalives go to these endpoints instead.
    #[arg(
        long,
        env = "BATON_TEST_KEEPALIVE_ENDPOINTS",
        value_delimiter = ',',
        hide = true
    )]
    pub test_keepalive_endpoints: Option<Vec<String>>,
}

impl EtcdArgs {
    /// Reads the certificate and password files now, so a wrong path stops the start.
    pub fn etcd_config(&self) -> Result<EtcdConfig, ConfigError> {
        let read = |flag: &str, p: &PathBuf| {
            std::fs::read(p).map_err(|e| ConfigError(format!("{flag} {}: {e}", p.display())))
        };
        let mut c = EtcdConfig::new(self.etcd_endpoints.clone());
        c.keepalive_endpoints = self.test_keepalive_endpoints.clone();
        c.request_timeout = self.etcd_timeout;
        c.connect_timeout = self.etcd_timeout.min(Duration::from_secs(2));
        if let Some(ca) = &self.etcd_ca {
            let mut tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(read("--etcd-ca", ca)?));
            if let (Some(cert), Some(key)) = (&self.etcd_cert, &self.etcd_key) {
                tls = tls.identity(etcd_client::Identity::from_pem(
                    read("--etcd-cert", cert)?,
                    read("--etcd-key", key)?,
                ));
            }
            c.tls = Some(tls);
        }
        if let (Some(user), Some(file)) = (&self.etcd_user, &self.etcd_password_file) {
            if self.etcd_ca.is_none() {
                if let Some(far) = self
                    .etcd_endpoints
                    .iter()
                    .find(|e| !is_loopback_endpoint(e))
                {
                    return Err(ConfigError(format!(
                        "--etcd-user without --etcd-ca would send the password to {far} in clear; give --etcd-ca"
                    )));
                }
            }
            let password = String::from_utf8(read("--etcd-password-file", file)?)
                .map_err(|_| ConfigError("--etcd-password-file is not UTF-8".into()))?;
            c.user = Some((
                user.clone(),
                password.trim_end_matches(['\r', '\n']).to_string(),
            ));
        }
        Ok(c)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// Whether an etcd endpoint (`host:port` or a URL) names this machine.
fn is_loopback_endpoint(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let host = match rest.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => rest.rsplit_once(':').map_or(rest, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The host name, or `replica` when it cannot be read.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "replica".into())
}

/// A lease TTL etcd honours as given, and a margin that leaves keepalives room.
pub fn validate_lease(flag: &str, ttl: Duration, margin: Duration) -> Result<(), ConfigError> {
    if ttl < Duration::from_secs(2) {
        return Err(ConfigError(format!(
            "{flag} {} is below etcd's 2s minimum lease TTL (etcd would silently raise it); use 2s or more",
            humantime::format_duration(ttl)
        )));
    }
    if ttl.subsec_nanos() != 0 {
        return Err(ConfigError(format!(
            "{flag} {} is not a whole number of seconds; etcd leases have second granularity",
            humantime::format_duration(ttl)
        )));
    }
    if margin.is_zero() || margin >= ttl / 2 {
        return Err(ConfigError(format!(
            "--step-down-margin {} must be above 0 and below half the lease TTL ({}), or the leader would step down between keepalives",
            humantime::format_duration(margin),
            humantime::format_duration(ttl / 2)
        )));
    }
    Ok(())
}

/// Names that go into etcd keys and file names: `[A-Za-z0-9._-]`, 1 to 128 characters.
pub fn validate_name(flag: &str, v: &str) -> Result<(), ConfigError> {
    let ok = !v.is_empty()
        && v.len() <= 128
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(ConfigError(format!(
            "{flag} {v:?} must be 1 to 128 characters of [A-Za-z0-9._-]"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::is_loopback_endpoint;

    #[test]
    fn loopback_endpoints_are_told_from_remote_ones() {
        for e in [
            "127.0.0.1:2379",
            "localhost:2379",
            "http://127.0.0.5:2379",
            "[::1]:2379",
        ] {
            assert!(is_loopback_endpoint(e), "{e}");
        }
        for e in [
            "10.0.0.1:2379",
            "etcd-0.etcd:2379",
            "https://etcd:2379",
            "[2001:db8::1]:2379",
        ] {
            assert!(!is_loopback_endpoint(e), "{e}");
        }
    }
}
