//! `baton serve` settings.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::retry::Policy;

use super::common::{host_name, validate_lease, validate_name, ConfigError, EtcdArgs};
use super::http::HttpArgs;
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
    /// How a failed cleanup step is retried (Flink's cleanup strategies): `exponential-delay`
    /// (--cleanup-initial-delay doubling to --cleanup-max-delay, with 10% jitter),
    /// `fixed-delay` (--cleanup-fixed-delay every time) or `none` (a failed step needs an
    /// operator at once).
    #[arg(long, env = "BATON_CLEANUP_STRATEGY", value_enum, default_value_t = CleanupStrategy::ExponentialDelay)]
    pub cleanup_strategy: CleanupStrategy,
    /// exponential-delay: the first pause after a failed step [default: 1s].
    #[arg(long, env = "BATON_CLEANUP_INITIAL_DELAY", value_parser = humantime::parse_duration)]
    pub cleanup_initial_delay: Option<Duration>,
    /// exponential-delay: the longest pause [default: 1h].
    #[arg(long, env = "BATON_CLEANUP_MAX_DELAY", value_parser = humantime::parse_duration)]
    pub cleanup_max_delay: Option<Duration>,
    /// fixed-delay: the pause after every failed step [default: 1s].
    #[arg(long, env = "BATON_CLEANUP_FIXED_DELAY", value_parser = humantime::parse_duration)]
    pub cleanup_fixed_delay: Option<Duration>,
    /// exponential-delay and fixed-delay: attempts of a step before the result needs an
    /// operator; 0: unlimited [default: 0].
    #[arg(long, env = "BATON_CLEANUP_MAX_ATTEMPTS")]
    pub cleanup_max_attempts: Option<u32>,
    /// Cleanup step commands running at once, over every dirty result.
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
    /// Followers revoke a leader's lease at once on evidence that its process is gone (its
    /// exact address refuses connections, or another incarnation answers there), instead of
    /// waiting for the lease to expire. Off (with a warning) for an unspecified advertise
    /// address or one that resolves to several.
    #[arg(long, env = "BATON_FAST_FAILOVER", default_value_t = true, action = clap::ArgAction::Set)]
    pub fast_failover: bool,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    /// Test and drill hook: stop each cleanup after recording this stage.
    #[arg(long, env = "BATON_CLEANUP_PAUSE_AFTER_STAGE", hide = true)]
    pub cleanup_pause_after_stage: Option<u32>,
    /// Test hook: the term that records this cleanup step done gives out no step after it.
    #[arg(long, env = "BATON_TEST_CLEANUP_PAUSE_AFTER_STEP", hide = true)]
    pub test_cleanup_pause_after_step: Option<String>,
    /// Test hook: while this file exists, the leader holds each assignment between its read
    /// of the job and its write (and says so in `<file>.<job>.reached`).
    #[arg(long, env = "BATON_TEST_PAUSE_BEFORE_ASSIGN", hide = true)]
    pub test_pause_before_assign: Option<PathBuf>,
    /// Test hook: moves this replica's schedule clock by this many ms (may be negative), so a
    /// test can put a real cluster next to a daylight-saving change.
    #[arg(
        long,
        env = "BATON_TEST_CLOCK_OFFSET_MS",
        hide = true,
        allow_hyphen_values = true,
        default_value_t = 0
    )]
    pub test_clock_offset_ms: i64,
}

/// `--cleanup-strategy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CleanupStrategy {
    ExponentialDelay,
    FixedDelay,
    None,
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

    /// The retry policy of cleanup steps. A strategy given with another strategy's flags is
    /// refused: the operator meant something this would not do.
    pub fn cleanup_policy(&self) -> Result<Policy, ConfigError> {
        let foreign = |flags: &[(&str, bool)], strategy: &str| -> Result<(), ConfigError> {
            match flags.iter().find(|(_, given)| *given) {
                Some((flag, _)) => Err(ConfigError(format!(
                    "{flag} does not apply to --cleanup-strategy {strategy}"
                ))),
                None => Ok(()),
            }
        };
        let attempts = match self.cleanup_max_attempts {
            None | Some(0) => None,
            Some(n) => Some(n),
        };
        let exponential = [
            (
                "--cleanup-initial-delay",
                self.cleanup_initial_delay.is_some(),
            ),
            ("--cleanup-max-delay", self.cleanup_max_delay.is_some()),
        ];
        let fixed = [("--cleanup-fixed-delay", self.cleanup_fixed_delay.is_some())];
        match self.cleanup_strategy {
            CleanupStrategy::ExponentialDelay => {
                foreign(&fixed, "exponential-delay")?;
                let initial = self.cleanup_initial_delay.unwrap_or(Duration::from_secs(1));
                let max = self.cleanup_max_delay.unwrap_or(Duration::from_secs(3600));
                if initial.is_zero() || initial > max {
                    return Err(ConfigError(
                        "--cleanup-initial-delay must be above 0 and at most --cleanup-max-delay"
                            .into(),
                    ));
                }
                Ok(Policy::Exponential {
                    initial,
                    max,
                    multiplier: 2.0,
                    jitter: 0.1,
                    attempts,
                })
            }
            CleanupStrategy::FixedDelay => {
                foreign(&exponential, "fixed-delay")?;
                let delay = self.cleanup_fixed_delay.unwrap_or(Duration::from_secs(1));
                if delay.is_zero() {
                    return Err(ConfigError("--cleanup-fixed-delay must be above 0".into()));
                }
                Ok(Policy::Fixed { delay, attempts })
            }
            CleanupStrategy::None => {
                foreign(&exponential, "none")?;
                foreign(&fixed, "none")?;
                foreign(
                    &[(
                        "--cleanup-max-attempts",
                        self.cleanup_max_attempts.is_some(),
                    )],
                    "none",
                )?;
                Ok(Policy::None)
            }
        }
    }

    /// Rejects impossible settings with a sentence a human can act on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_lease("--lease-ttl", self.lease_ttl, self.margin())?;
        validate_name("--cluster", &self.cluster)?;
        validate_name("--replica-id", &self.replica_id())?;
        self.run.validate()?;
        self.security.validate(self.listen)?;
        if let Some(addr) = self.http.http_listen {
            self.security.validate(addr)?;
        }
        self.http.validate()?;
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
        self.cleanup_policy()?;
        if self.etcd.etcd_endpoints.iter().all(|e| e.trim().is_empty()) {
            return Err(ConfigError("--etcd-endpoints is empty".into()));
        }
        Ok(())
    }
}
