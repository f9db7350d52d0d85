//! Command-line configuration. Every flag can also come from a `BATON_*` environment variable.
//!
//! Nothing here imports the commands it configures: `serve` and `drill` settings live in
//! submodules of their own, and the commands import them.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod bench;
mod common;
mod drill;
mod http;
mod security;
mod serve;
mod worker;

pub use bench::{BenchArgs, ALL_SCENARIOS};
pub use common::{validate_name, ConfigError, EtcdArgs};
pub use drill::{DrillArgs, ALL_FAULTS};
pub use http::HttpArgs;
pub use security::{ClientSecurityArgs, SecurityArgs};
pub use serve::ServeArgs;
pub use worker::{RunArgs, WorkerArgs, WorkerCommand, WorkerIdArgs};

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
    /// Run one replica (a coordinator, and by default an embedded worker).
    Serve(Box<ServeArgs>),
    /// Run a worker (it runs the jobs the leader assigns to it, under a lease of its own), or
    /// operate workers: `baton worker list|drain|undrain`.
    Worker(Box<WorkerArgs>),
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
    /// Recurring jobs: each tick runs at most once, whatever happens to the leader.
    Schedule {
        #[command(subcommand)]
        command: ScheduleCommand,
    },
    /// Run a failover drill: workload, faults, then every invariant checked.
    Drill(Box<DrillArgs>),
    /// Measure Baton against raw etcd on a private cluster: submissions, end-to-end jobs,
    /// recovery, failover, footprint.
    Bench(Box<BenchArgs>),
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
    /// Steer a job's cleanup: `--now` retries it at once; `--abandon` ends it by hand.
    Cleanup(CleanupArgs),
}

#[derive(Debug, Args)]
pub struct CleanupArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub id: String,
    /// Retry a pending or exhausted cleanup now.
    #[arg(long, required_unless_present = "abandon", conflicts_with = "abandon")]
    pub now: bool,
    /// End the cleanup by hand (admin role): the remaining steps are marked abandoned and
    /// running ones killed; then the folder goes and the result becomes clean.
    #[arg(long)]
    pub abandon: bool,
    /// Why, kept in the clean result (with --abandon).
    #[arg(long, requires = "abandon")]
    pub reason: Option<String>,
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// The job id (default: a new unique one, chosen before the first try so retries are safe).
    #[arg(long)]
    pub id: Option<String>,
    /// Wait for the result after submitting, like `baton job wait`.
    #[arg(long)]
    pub wait: bool,
    #[command(flatten)]
    pub job: JobSpecArgs,
}

/// What a job runs, as `job submit` and `schedule create` take it.
#[derive(Debug, Clone, Args)]
pub struct JobSpecArgs {
    /// Environment for the job, `K=V`; repeatable.
    #[arg(long = "env", value_name = "K=V")]
    pub env: Vec<String>,
    /// Cleanup command, run once the job is terminal, as the ordered step `command` (split on
    /// whitespace; use a script for more).
    #[arg(long, value_name = "COMMAND")]
    pub cleanup_command: Option<String>,
    /// A named cleanup step, `NAME=COMMAND`; repeatable, run one after another in the given
    /// order (after --cleanup-command). NAME: 1-32 of [a-z0-9-]. COMMAND is split on whitespace.
    #[arg(long = "cleanup", value_name = "NAME=COMMAND")]
    pub cleanup: Vec<String>,
    /// A named cleanup step run together with the other concurrent ones, after the ordered
    /// steps; `NAME=COMMAND`, repeatable.
    #[arg(long = "cleanup-concurrent", value_name = "NAME=COMMAND")]
    pub cleanup_concurrent: Vec<String>,
    /// Failed attempts allowed (0: the default, 3).
    #[arg(long, default_value_t = 0)]
    pub max_attempts: u32,
    /// Run only on workers with this label, `key=value`; repeatable, all must match.
    #[arg(long = "selector", value_name = "K=V", value_delimiter = ',')]
    pub selector: Vec<String>,
    /// Per-attempt timeout (default 24h).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub attempt_timeout: Option<Duration>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum ScheduleCommand {
    /// Create a schedule: `baton schedule create NAME --cron EXPR [--tz Z] -- CMD ARGS...`.
    Create(ScheduleCreateArgs),
    /// Show one schedule: its policies, next 5 fire times and last 20 outcomes.
    Get(ScheduleNameArgs),
    /// List the schedules.
    List(ClientArgs),
    /// Change some of a schedule's settings; the next tick is the first after the change.
    Update(ScheduleUpdateArgs),
    /// Pause: ticks until the resume are recorded `paused` and never run later.
    Pause(SchedulePauseArgs),
    /// Resume a paused schedule from now on.
    Resume(ScheduleRevisionArgs),
    /// Delete a schedule (its running jobs go on unless --cancel-running).
    Delete(ScheduleDeleteArgs),
    /// Run the schedule's job once now, under an id no tick can take.
    Trigger(ScheduleTriggerArgs),
    /// Run the ticks in (--from, --to] that have not run (at most 1000 a request).
    Backfill(ScheduleBackfillArgs),
}

/// A schedule's timing and policies, as `create` takes them and `update` changes them.
#[derive(Debug, Clone, Args)]
pub struct SchedulePolicyArgs {
    /// IANA zone the expression is read in (default UTC).
    #[arg(long)]
    pub tz: Option<String>,
    /// forbid (skip a tick while a run is live), allow, or replace (cancel the live runs; the
    /// new one starts once they have ended). Default forbid.
    #[arg(long)]
    pub overlap: Option<String>,
    /// Missed ticks older than this when the leader reaches them are recorded `missed`
    /// (default 10m).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub catchup_window: Option<Duration>,
    /// latest (run the latest missed tick inside the window) or all (each, in order; overlap
    /// allow only). Default latest.
    #[arg(long)]
    pub catchup: Option<String>,
    /// Tick results kept, newest first (default 1000).
    #[arg(long)]
    pub keep_results: Option<u32>,
}

#[derive(Debug, Args)]
pub struct ScheduleCreateArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// 1-96 characters of [A-Za-z0-9._-].
    pub name: String,
    /// Cron (5 fields, or 6 with seconds first), @hourly, @daily, @weekly, @monthly,
    /// @yearly, or `@every 30s`.
    #[arg(long)]
    pub cron: String,
    #[command(flatten)]
    pub policy: SchedulePolicyArgs,
    #[command(flatten)]
    pub job: JobSpecArgs,
}

#[derive(Debug, Args)]
pub struct ScheduleUpdateArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub name: String,
    #[arg(long)]
    pub cron: Option<String>,
    #[command(flatten)]
    pub policy: SchedulePolicyArgs,
    /// Only if the schedule is still at this revision (`schedule get` shows it).
    #[arg(long, default_value_t = 0)]
    pub if_revision: i64,
    /// A new job command and arguments (with its job flags: env, attempts, timeout...).
    #[arg(last = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ScheduleNameArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub name: String,
}

#[derive(Debug, Args)]
pub struct ScheduleRevisionArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub name: String,
    /// Only if the schedule is still at this revision.
    #[arg(long, default_value_t = 0)]
    pub if_revision: i64,
}

#[derive(Debug, Args)]
pub struct SchedulePauseArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub name: String,
    /// Why (shown by `schedule get`).
    #[arg(long)]
    pub reason: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub if_revision: i64,
}

#[derive(Debug, Args)]
pub struct ScheduleDeleteArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub name: String,
    #[arg(long, default_value_t = 0)]
    pub if_revision: i64,
    /// Also cancel the schedule's live jobs.
    #[arg(long)]
    pub cancel_running: bool,
}

#[derive(Debug, Args)]
pub struct ScheduleTriggerArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub name: String,
    /// Wait for the run's result; exit with its exit code.
    #[arg(long)]
    pub wait: bool,
}

#[derive(Debug, Args)]
pub struct ScheduleBackfillArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    pub name: String,
    /// RFC 3339, exclusive.
    #[arg(long)]
    pub from: String,
    /// RFC 3339, inclusive.
    #[arg(long)]
    pub to: String,
    /// Also run ticks older than the kept results (at least once, not at most once).
    #[arg(long)]
    pub force: bool,
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
    /// Only jobs whose id starts with this.
    #[arg(long)]
    pub prefix: Option<String>,
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
    /// Follow the attempt's output as it is written, from its start, until the attempt ends
    /// (waiting for the first attempt if none has started).
    #[arg(short = 'f', long)]
    pub follow: bool,
}

#[derive(Debug, Subcommand)]
pub enum LeaderCommand {
    /// Show the current leader.
    Get(ClientArgs),
    /// Ask the current leader to step down and campaign again behind the others.
    Resign(ResignArgs),
    /// The history of terms, newest first: who led, since when, after which term, and how it
    /// ended when its leader stepped down in order.
    History(HistoryArgs),
}

#[derive(Debug, Args)]
pub struct HistoryArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// At most this many terms (up to 1000).
    #[arg(long, default_value_t = 20)]
    pub limit: u32,
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
    #[command(flatten)]
    pub security: ClientSecurityArgs,
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
    /// First replica's gRPC port (then +1, +2, ...); 0 picks free ports. Separate workers
    /// listen from base port + 100 on, metrics from + 200, the replicas' HTTP API and console
    /// from + 400.
    #[arg(long, env = "BATON_DEV_BASE_PORT", default_value_t = 7600)]
    pub base_port: u16,
    /// Separate `baton worker` processes (labelled `pool=workers`), besides the worker
    /// embedded in each replica.
    #[arg(long, env = "BATON_DEV_WORKERS", default_value_t = 2)]
    pub workers: usize,
    /// Submit no demo job at start.
    #[arg(long)]
    pub no_demo: bool,
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
