//! `baton serve` settings.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::common::{host_name, validate_lease, validate_name, ConfigError, EtcdArgs};
use super::security::SecurityArgs;
use super::worker::RunArgs;

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
    /// Serve Prometheus metrics at `/metrics` on this address (off unless given).
    #[arg(long, env = "BATON_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
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
    /// Job starts per second, at most (a burst of one second's worth); the rest wait PENDING
    /// in submission order, so thousands of starts cannot starve the lease's keepalives.
    #[arg(long, env = "BATON_MAX_STARTS_PER_SECOND", default_value_t = 50.0)]
    pub max_starts_per_second: f64,
    /// Restarts after leader changes allowed per job, so a job that kills its host cannot
    /// crash-loop the cluster.
    #[arg(long, env = "BATON_MAX_RECOVERIES", default_value_t = 10)]
    pub max_recoveries: u32,
    /// First delay before retrying a failed attempt (doubles each time).
    #[arg(long, env = "BATON_RETRY_INITIAL_DELAY", value_parser = humantime::parse_duration, default_value = "1s")]
    pub retry_initial_delay: Duration,
    /// Longest delay between retries.
    #[arg(long, env = "BATON_RETRY_MAX_DELAY", value_parser = humantime::parse_duration, default_value = "5m")]
    pub retry_max_delay: Duration,
    /// First delay before retrying a failed cleanup stage (exponential, with jitter).
    #[arg(long, env = "BATON_CLEANUP_INITIAL_DELAY", value_parser = humantime::parse_duration, default_value = "1s")]
    pub cleanup_initial_delay: Duration,
    /// Longest delay between cleanup retries.
    #[arg(long, env = "BATON_CLEANUP_MAX_DELAY", value_parser = humantime::parse_duration, default_value = "1h")]
    pub cleanup_max_delay: Duration,
    /// Cleanup attempts before a result is marked as needing an operator; 0: unlimited.
    #[arg(long, env = "BATON_CLEANUP_MAX_ATTEMPTS", default_value_t = 0)]
    pub cleanup_max_attempts: u32,
    /// Cleanups running at once.
    #[arg(long, env = "BATON_CLEANUP_CONCURRENCY", default_value_t = 8)]
    pub cleanup_concurrency: usize,
    /// Bound on one run of a job's cleanup command.
    #[arg(long, env = "BATON_CLEANUP_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10m")]
    pub cleanup_timeout: Duration,
    /// How long clean results are kept (they answer GetJob and decide re-submissions).
    #[arg(long, env = "BATON_RESULT_RETENTION", value_parser = humantime::parse_duration, default_value = "7d")]
    pub result_retention: Duration,
    /// Also run a worker in this process, with the replica's id, so one `baton serve` is a
    /// whole system. With `false` this replica only coordinates.
    #[arg(long, env = "BATON_WORKER", default_value_t = true, action = clap::ArgAction::Set)]
    pub worker: bool,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub security: SecurityArgs,
    /// Test and drill hook: stop each cleanup after recording this stage.
    #[arg(long, env = "BATON_CLEANUP_PAUSE_AFTER_STAGE", hide = true)]
    pub cleanup_pause_after_stage: Option<u32>,
}

impl ServeArgs {
    pub fn replica_id(&self) -> String {
        self.replica_id.clone().unwrap_or_else(host_name)
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
        validate_lease("--lease-ttl", self.lease_ttl, self.margin())?;
        validate_name("--cluster", &self.cluster)?;
        validate_name("--replica-id", &self.replica_id())?;
        self.run.validate()?;
        self.security.validate(self.listen)?;
        if !(self.max_starts_per_second.is_finite() && self.max_starts_per_second > 0.0) {
            return Err(ConfigError(
                "--max-starts-per-second must be a number above 0".into(),
            ));
        }
        self.validate_rest()
    }

    fn validate_rest(&self) -> Result<(), ConfigError> {
        if self.retry_initial_delay.is_zero() || self.retry_initial_delay > self.retry_max_delay {
            return Err(ConfigError(
                "--retry-initial-delay must be above 0 and at most --retry-max-delay".into(),
            ));
        }
        if self.cleanup_concurrency == 0 {
            return Err(ConfigError(
                "--cleanup-concurrency must be at least 1".into(),
            ));
        }
        if self.cleanup_initial_delay.is_zero()
            || self.cleanup_initial_delay > self.cleanup_max_delay
        {
            return Err(ConfigError(
                "--cleanup-initial-delay must be above 0 and at most --cleanup-max-delay".into(),
            ));
        }
        if self.etcd.etcd_endpoints.iter().all(|e| e.trim().is_empty()) {
            return Err(ConfigError("--etcd-endpoints is empty".into()));
        }
        Ok(())
    }
}
