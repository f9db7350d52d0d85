//! `baton drill` settings.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct DrillArgs {
    /// Baton replicas to run.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Separate workers (`baton worker`); the replicas then only coordinate
    /// (`--worker=false`). 0: every replica runs an embedded worker.
    #[arg(long, default_value_t = 0)]
    pub workers: usize,
    /// etcd members (3 allows the etcd-kill fault).
    #[arg(long, default_value_t = 1)]
    pub etcd_members: usize,
    #[arg(long, env = "BATON_ETCD_BIN", default_value = "etcd")]
    pub etcd_bin: PathBuf,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    pub lease_ttl: Duration,
    /// Comma-separated: kill, term, pause, partition (of the leader), etcd-kill, follower-kill,
    /// worker-kill, worker-term, worker-pause, worker-partition (default: all that fit the
    /// cluster).
    #[arg(long, value_delimiter = ',')]
    pub faults: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Jobs to submit, at most: all of them in a drill of rounds; a cap in soak mode, whose
    /// workload ends with its faults.
    #[arg(long, default_value_t = 60)]
    pub jobs: usize,
    /// Submissions per second.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// Seed for the workload mix and fault order (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Shuffle the faults of each round (soak mode).
    #[arg(long)]
    pub shuffle: bool,
    /// Soak mode: inject faults round after round for this long (counted from the start), then
    /// stop submitting, drain, check and report; overrides --rounds.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Where the cluster, ledgers and logs go (default: a temporary folder, kept on failure).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Drill an existing cluster through these replica addresses instead of a local one.
    #[arg(long, value_delimiter = ',')]
    pub endpoints: Vec<String>,
    /// The existing cluster's etcd (the checks read it).
    #[arg(long, value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// The existing cluster's name (`--cluster` of its replicas).
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// Command that SIGKILLs a replica, `{replica}` replaced by its id, e.g.
    /// `kubectl delete pod {replica} --grace-period=0 --force`.
    #[arg(long)]
    pub kill_cmd: Option<String>,
    /// Command that SIGTERMs a replica, e.g. `kubectl delete pod {replica}`.
    #[arg(long)]
    pub term_cmd: Option<String>,
    /// Existing cluster: how long to wait after a fault for every replica to campaign again
    /// (the orchestrator restarting the victim) before the next fault.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub recovery_wait: Duration,
    /// Write the drill's history here: every etcd revision and every execution's start and end,
    /// placed among them (JSON lines), for `modelcheck replay` to check against the protocol
    /// model. Local drills only.
    #[arg(long, env = "BATON_DRILL_HISTORY")]
    pub history: Option<PathBuf>,
    /// Run guards that ignore lease deadlines: the drill must then report overlapping executions.
    #[arg(long, hide = true)]
    pub negative_control: bool,
    /// Existing cluster: how to reach its secured API (`--token-file`, `--ca`, `--cert`, `--key`).
    #[command(flatten)]
    pub security: super::ClientSecurityArgs,
}

pub const ALL_FAULTS: &[&str] = &[
    "kill",
    "term",
    "pause",
    "partition",
    "etcd-kill",
    "follower-kill",
    "worker-kill",
    "worker-term",
    "worker-pause",
    "worker-partition",
];
