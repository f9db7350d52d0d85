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
    Serve(Box<ServeArgs>),
    /// Run a private etcd and N replicas on loopback, for trying Baton out.
    Dev(DevArgs),
    /// Inspect or move leadership.
    Leader {
        #[command(subcommand)]
        command: LeaderCommand,
    },
    /// Submit, inspect and cancel jobs.
    Job {
        #[command(subcommand)]
        command: JobCommand,
    },
    /// Run a failover drill: workload, faults, then every invariant checked.
    Drill(Box<crate::drill::DrillArgs>),
    /// The lease guard that runs each job (started by the leader, not by hand).
    #[command(name = "__guard", hide = true)]
    Guard(crate::runner::guard::GuardArgs),
}

#[derive(Debug, Subcommand)]
pub enum JobCommand {
    /// Submit a job: `baton job submit [--id ID] -- CMD ARGS...`.
    Submit(SubmitArgs),
    /// Show one job.
    Get(JobIdArgs),
    /// List jobs.
    List(ListArgs),
    /// Request cancellation of a pending or running job.
    Cancel(JobIdArgs),
    /// Wait until the job's result is recorded; exit with the job's exit code.
    Wait(JobIdArgs),
    /// Print the output of an attempt (default: the latest).
    Logs(LogsArgs),
    /// Steer a job's cleanup: `baton job cleanup ID --now` retries it at once.
    Cleanup(CleanupArgs),
}

#[derive(Debug, Args)]
pub struct CleanupArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub id: String,
    /// Retry a pending or exhausted cleanup now.
    #[arg(long, required = true)]
    pub now: bool,
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// The job id (default: a new unique one, chosen before the first try so retries are safe).
    #[arg(long)]
    pub id: Option<String>,
    /// Environment for the job, `K=V`; repeatable.
    #[arg(long = "env", value_name = "K=V")]
    pub env: Vec<String>,
    /// Cleanup command, run once the job is terminal (split on whitespace; use a script for more).
    #[arg(long)]
    pub cleanup: Option<String>,
    /// Failed attempts allowed (0: the default, 3).
    #[arg(long, default_value_t = 0)]
    pub max_attempts: u32,
    /// Per-attempt timeout (default 24h).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub attempt_timeout: Option<Duration>,
    /// Wait for the result after submitting, like `baton job wait`.
    #[arg(long)]
    pub wait: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct JobIdArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub id: String,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// pending, running, finished, failed or canceled.
    #[arg(long)]
    pub state: Option<String>,
    /// pending, needs-operator or done.
    #[arg(long)]
    pub cleanup: Option<String>,
    /// At most this many jobs (all pages are read up to it).
    #[arg(long, default_value_t = 1000)]
    pub limit: usize,
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub id: String,
    /// Attempt number (default: the latest).
    #[arg(long, default_value_t = 0)]
    pub attempt: u32,
}

#[derive(Debug, Subcommand)]
pub enum LeaderCommand {
    /// Show the current leader.
    Get(ClientArgs),
    /// Ask the current leader to step down and campaign again behind the others.
    Resign(ResignArgs),
}

#[derive(Debug, Clone, Args)]
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
    /// Per-job folders (logs, exit records, checkpoints). Must be the same folder for every
    /// replica of the cluster: the same path on one host, a shared volume on Kubernetes.
    #[arg(long, env = "BATON_STORAGE_DIR", default_value = "baton-storage")]
    pub storage_dir: PathBuf,
    /// Jobs running at once; the rest stay PENDING in submission order.
    #[arg(long, env = "BATON_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,
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
    /// After a cancel's SIGTERM, how long a job has before SIGKILL.
    #[arg(long, env = "BATON_KILL_GRACE", value_parser = humantime::parse_duration, default_value = "10s")]
    pub kill_grace: Duration,
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
    /// Append every job and cleanup execution (start and end, from the guards) to this file.
    #[arg(long, env = "BATON_EXECUTION_LEDGER")]
    pub execution_ledger: Option<PathBuf>,
    /// Negative control for drills: guards ignore lease deadlines. Breaks the no-overlap promise.
    #[arg(long, hide = true)]
    pub unsafe_ignore_guard_deadlines: bool,
    /// Test and drill hook: stop each cleanup after recording this stage.
    #[arg(long, env = "BATON_CLEANUP_PAUSE_AFTER_STAGE", hide = true)]
    pub cleanup_pause_after_stage: Option<u32>,
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
        if self.max_running == 0 {
            return Err(ConfigError("--max-running must be at least 1".into()));
        }
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
            Command::Serve(s) => *s,
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
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("--cluster", "prod-1.eu").is_ok());
        assert!(validate_name("--cluster", "a/b").is_err());
        assert!(validate_name("--cluster", "").is_err());
    }
}
