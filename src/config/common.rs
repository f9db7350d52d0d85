//! Settings every command shares: etcd access, names and lease checks.

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
}

impl EtcdArgs {
    pub fn etcd_config(&self) -> EtcdConfig {
        let mut c = EtcdConfig::new(self.etcd_endpoints.clone());
        c.request_timeout = self.etcd_timeout;
        c.connect_timeout = self.etcd_timeout.min(Duration::from_secs(2));
        c
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

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
