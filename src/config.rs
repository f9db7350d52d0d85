//! Command-line configuration. Every flag can also come from a `BATON_*` environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::store::EtcdConfig;

#[derive(Debug, Parser)]
#[command(
    name = "baton",
    version,
    about = "High-availability job coordinator on etcd"
)]
pub struct Cli {
    /// Log output format.
    #[arg(long, global = true, env = "BATON_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log filter (tracing-subscriber's EnvFilter syntax).
    #[arg(long, global = true, env = "BATON_LOG", default_value = "info")]
    pub log: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one replica.
    Serve(ServeArgs),
    /// Run a private etcd and N replicas on loopback, for trying Baton out.
    Dev(DevArgs),
    /// Inspect or move leadership.
    Leader {
        #[command(subcommand)]
        command: LeaderCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum LeaderCommand {
    /// Show the current leader.
    Get(ClientArgs),
    /// Ask the current leader to step down and campaign again behind the others.
    Resign(ResignArgs),
}

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// Replica addresses, tried in turn.
    #[arg(
        long,
        env = "BATON_ENDPOINTS",
        value_delimiter = ',',
        default_value = "127.0.0.1:7600"
    )]
    pub endpoints: Vec<String>,
    /// Per-call timeout.
    #[arg(long, env = "BATON_TIMEOUT", value_parser = humantime::parse_duration, default_value = "5s")]
    pub timeout: Duration,
    /// Output format.
    #[arg(short = 'o', long, env = "BATON_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

#[derive(Debug, Args)]
pub struct ResignArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Resign only if this term is still current (default: whatever term is current).
    #[arg(long, env = "BATON_TERM", default_value_t = 0)]
    pub term: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

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

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Cluster name: all keys live under `/baton/<cluster>/`.
    #[arg(long, env = "BATON_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// This replica's id (default: the host name).
    #[arg(long, env = "BATON_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// gRPC listen address. Loopback by default: the API runs commands for whoever reaches it.
    #[arg(long, env = "BATON_LISTEN", default_value = "127.0.0.1:7600")]
    pub listen: SocketAddr,
    /// Address other replicas and clients should use (default: the listen address).
    #[arg(long, env = "BATON_ADVERTISE")]
    pub advertise: Option<String>,
    /// Election lease TTL, whole seconds, at least 2s (etcd's minimum).
    #[arg(long, env = "BATON_LEASE_TTL", value_parser = humantime::parse_duration, default_value = "5s")]
    pub lease_ttl: Duration,
    /// Step down once the lease is proven for less than this (default: max(ttl/4, 500ms)).
    #[arg(long, env = "BATON_STEP_DOWN_MARGIN", value_parser = humantime::parse_duration)]
    pub step_down_margin: Option<Duration>,
    /// Also append role events (JSON lines) to this file, for audits and drills.
    #[arg(long, env = "BATON_ROLE_LOG")]
    pub role_log: Option<PathBuf>,
    /// How long leader work may take to stop before the replica resigns anyway.
    #[arg(long, env = "BATON_SHUTDOWN_GRACE", value_parser = humantime::parse_duration, default_value = "10s")]
    pub shutdown_grace: Duration,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ServeArgs {
    pub fn replica_id(&self) -> String {
        self.replica_id.clone().unwrap_or_else(|| {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "replica".into())
        })
    }

    pub fn advertise(&self) -> String {
        self.advertise
            .clone()
            .unwrap_or_else(|| self.listen.to_string())
    }

    pub fn margin(&self) -> Duration {
        self.step_down_margin
            .unwrap_or_else(|| (self.lease_ttl / 4).max(Duration::from_millis(500)))
    }

    /// Rejects impossible settings with a sentence a human can act on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let ttl = self.lease_ttl;
        if ttl < Duration::from_secs(2) {
            return Err(ConfigError(format!(
                "--lease-ttl {} is below etcd's 2s minimum lease TTL (etcd would silently raise it); use 2s or more",
                humantime::format_duration(ttl)
            )));
        }
        if ttl.subsec_nanos() != 0 {
            return Err(ConfigError(format!(
                "--lease-ttl {} is not a whole number of seconds; etcd leases have second granularity",
                humantime::format_duration(ttl)
            )));
        }
        let margin = self.margin();
        if margin.is_zero() || margin >= ttl / 2 {
            return Err(ConfigError(format!(
                "--step-down-margin {} must be above 0 and below half the lease TTL ({}), or the leader would step down between keepalives",
                humantime::format_duration(margin),
                humantime::format_duration(ttl / 2)
            )));
        }
        validate_name("--cluster", &self.cluster)?;
        validate_name("--replica-id", &self.replica_id())?;
        if self.etcd.etcd_endpoints.iter().all(|e| e.trim().is_empty()) {
            return Err(ConfigError("--etcd-endpoints is empty".into()));
        }
        Ok(())
    }
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

#[derive(Debug, Clone, Args)]
pub struct DevArgs {
    /// Number of replicas.
    #[arg(long, env = "BATON_DEV_REPLICAS", default_value_t = 3)]
    pub replicas: usize,
    /// The etcd binary (default: `etcd` from PATH).
    #[arg(long, env = "BATON_ETCD_BIN", default_value = "etcd")]
    pub etcd_bin: PathBuf,
    /// Where etcd data, logs and role logs go (default: a temporary folder removed at exit).
    #[arg(long, env = "BATON_DEV_DIR")]
    pub dir: Option<PathBuf>,
    /// Election lease TTL of the replicas.
    #[arg(long, env = "BATON_LEASE_TTL", value_parser = humantime::parse_duration, default_value = "5s")]
    pub lease_ttl: Duration,
    /// First replica's gRPC port (then +1, +2, ...); 0 picks free ports.
    #[arg(long, env = "BATON_DEV_BASE_PORT", default_value_t = 7600)]
    pub base_port: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(args: &[&str]) -> ServeArgs {
        let mut v = vec!["baton", "serve", "--replica-id", "r1"];
        v.extend_from_slice(args);
        match Cli::parse_from(v).command {
            Command::Serve(s) => s,
            _ => unreachable!(),
        }
    }

    #[test]
    fn ttl_below_two_seconds_is_refused_with_a_reason() {
        let err = serve(&["--lease-ttl", "1s"]).validate().unwrap_err();
        assert!(err.0.contains("2s minimum"), "{err}");
    }

    #[test]
    fn defaults_are_valid_and_margin_follows_ttl() {
        let s = serve(&[]);
        s.validate().unwrap();
        assert_eq!(s.margin(), Duration::from_millis(1250));
        assert_eq!(
            serve(&["--lease-ttl", "2s"]).margin(),
            Duration::from_millis(500)
        );
        assert!(serve(&["--step-down-margin", "3s"]).validate().is_err());
        assert!(serve(&["--lease-ttl", "2500ms"]).validate().is_err());
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("--cluster", "prod-1.eu").is_ok());
        assert!(validate_name("--cluster", "a/b").is_err());
        assert!(validate_name("--cluster", "").is_err());
    }
}
