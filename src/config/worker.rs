//! `baton worker` settings, and the ones `baton serve` shares for its embedded worker.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::common::{host_name, validate_lease, validate_name, ConfigError, EtcdArgs};
use super::security::SecurityArgs;

/// How a worker runs jobs: shared by `baton worker` and the worker embedded in `baton serve`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Local scratch: one folder per job (`<dir>/jobs/<id>`: logs, exit records), for one
    /// attempt at a time. Relative paths are taken from the working directory.
    #[arg(long, env = "BATON_STORAGE_DIR", default_value = "/tmp/baton")]
    pub storage_dir: PathBuf,
    /// Jobs this worker runs at once; the leader assigns no more.
    #[arg(long, env = "BATON_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,
    /// Cleanup commands this worker runs at once, besides its jobs.
    #[arg(long, env = "BATON_MAX_CLEANUPS", default_value_t = 2)]
    pub max_cleanups: usize,
    /// Niceness of jobs and cleanup commands (0 to 19); Baton and the guards keep their own.
    #[arg(long, env = "BATON_JOB_NICE", default_value_t = 10, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub job_nice: i32,
    /// After a cancel's SIGTERM, how long a job has before SIGKILL.
    #[arg(long, env = "BATON_KILL_GRACE", value_parser = humantime::parse_duration, default_value = "10s")]
    pub kill_grace: Duration,
    /// The leader takes an assignment back when the worker has not recorded its start by then.
    #[arg(long, env = "BATON_ASSIGN_TIMEOUT", value_parser = humantime::parse_duration, default_value = "10s")]
    pub assign_timeout: Duration,
    /// On SIGTERM or `baton worker drain`, how long running jobs may go on before they are
    /// stopped and rescheduled elsewhere (recorded `preempted`). Jobs longer than the interval
    /// between worker rollouts need a drain timeout to match.
    #[arg(long, env = "BATON_DRAIN_TIMEOUT", value_parser = humantime::parse_duration, default_value = "60s")]
    pub drain_timeout: Duration,
    /// Labels of this worker, `key=value`, comma-separated; jobs select workers by them.
    #[arg(long, env = "BATON_LABELS", value_delimiter = ',', value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Append every job and cleanup execution (start and end, from the guards) to this file.
    #[arg(long, env = "BATON_EXECUTION_LEDGER")]
    pub execution_ledger: Option<PathBuf>,
    /// The lease guard program (default: `baton-guard` next to `baton`). Opened at start and
    /// checked for this release's protocol; replacing the file takes effect at the next start.
    #[arg(long, env = "BATON_GUARD_BIN")]
    pub guard_bin: Option<PathBuf>,
    /// Which guard runs jobs: `small` (baton-guard) or `legacy` (`baton __guard`, the whole
    /// binary; kept for `baton bench` to compare against).
    #[arg(long, env = "BATON_GUARD", value_enum, default_value_t = crate::exec::program::GuardKind::Small, hide = true)]
    pub guard: crate::exec::program::GuardKind,
    /// Negative control for drills: guards ignore lease deadlines. Breaks the no-overlap promise.
    #[arg(long, hide = true)]
    pub unsafe_ignore_guard_deadlines: bool,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("label {s:?} is not key=value"))?;
    Ok((k.trim().to_string(), v.trim().to_string()))
}

impl RunArgs {
    pub fn labels(&self) -> BTreeMap<String, String> {
        self.labels.iter().cloned().collect()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_running == 0 {
            return Err(ConfigError("--max-running must be at least 1".into()));
        }
        if self.max_cleanups == 0 {
            return Err(ConfigError("--max-cleanups must be at least 1".into()));
        }
        if self.drain_timeout > Duration::from_secs(24 * 3600) {
            return Err(ConfigError("--drain-timeout must be at most 24h".into()));
        }
        if self.assign_timeout < Duration::from_secs(1) {
            return Err(ConfigError(
                "--assign-timeout must be at least 1s: a worker needs time to record a start"
                    .into(),
            ));
        }
        for (k, v) in &self.labels {
            validate_name("--labels key", k)?;
            validate_name("--labels value", v)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub security: SecurityArgs,
    /// Cluster name: all keys live under `/baton/<cluster>/`.
    #[arg(long, env = "BATON_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// This worker's id (default: the host name). One live incarnation per id.
    #[arg(long, env = "BATON_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Serve `grpc.health.v1` (for probes) and `baton.v1.WorkerService` (replicas read job
    /// output from it) here. Loopback by default; in a pod, `0.0.0.0:7071` with
    /// `--advertise` set to the pod's address.
    #[arg(long, env = "BATON_LISTEN", default_value = "127.0.0.1:7071")]
    pub listen: std::net::SocketAddr,
    /// Serve Prometheus metrics at `/metrics` on this address (off unless given).
    #[arg(long, env = "BATON_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Where replicas reach this worker (default: the listen address).
    #[arg(long, env = "BATON_ADVERTISE")]
    pub advertise: Option<String>,
    /// Worker lease TTL, whole seconds, at least 2s.
    #[arg(long, env = "BATON_LEASE_TTL", value_parser = humantime::parse_duration, default_value = "5s")]
    pub lease_ttl: Duration,
    /// Jobs are killed once the lease is proven for less than this (default: max(ttl/4, 500ms)).
    #[arg(long, env = "BATON_STEP_DOWN_MARGIN", value_parser = humantime::parse_duration)]
    pub step_down_margin: Option<Duration>,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(subcommand)]
    pub command: Option<WorkerCommand>,
}

/// `baton worker <command>`: operate the fleet through any replica.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum WorkerCommand {
    /// List the live workers: address, load, draining, labels.
    List(super::ClientArgs),
    /// Drain a worker: no new jobs; running ones get its --drain-timeout, then move elsewhere.
    Drain(WorkerIdArgs),
    /// Take a drained worker back.
    Undrain(WorkerIdArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct WorkerIdArgs {
    #[command(flatten)]
    pub client: super::ClientArgs,
    pub id: String,
}

impl WorkerArgs {
    pub fn advertise(&self) -> String {
        self.advertise
            .clone()
            .unwrap_or_else(|| self.listen.to_string())
    }

    pub fn worker_id(&self) -> String {
        self.worker_id.clone().unwrap_or_else(host_name)
    }

    pub fn margin(&self) -> Duration {
        self.step_down_margin
            .unwrap_or_else(|| (self.lease_ttl / 4).max(Duration::from_millis(500)))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_lease("--lease-ttl", self.lease_ttl, self.margin())?;
        validate_name("--cluster", &self.cluster)?;
        validate_name("--worker-id", &self.worker_id())?;
        self.security.validate(self.listen)?;
        if self.etcd.etcd_endpoints.iter().all(|e| e.trim().is_empty()) {
            return Err(ConfigError("--etcd-endpoints is empty".into()));
        }
        self.run.validate()
    }
}
