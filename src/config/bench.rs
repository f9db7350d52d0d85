//! `baton bench` settings.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

/// The scenarios, in the order they run.
pub const ALL_SCENARIOS: [&str; 7] = [
    "submit",
    "e2e",
    "recovery",
    "failover",
    "footprint",
    "schedules",
    "console",
];

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Comma-separated scenarios: submit, e2e, recovery, failover, footprint, schedules,
    /// console (default: all).
    #[arg(long, env = "BATON_BENCH_SCENARIOS", value_delimiter = ',')]
    pub scenarios: Vec<String>,
    /// etcd members of the benchmark's own etcd.
    #[arg(long, env = "BATON_BENCH_ETCD_MEMBERS", default_value_t = 1)]
    pub etcd_members: usize,
    #[arg(long, env = "BATON_ETCD_BIN", default_value = "etcd")]
    pub etcd_bin: PathBuf,
    /// submit: concurrent clients, one run each.
    #[arg(long, env = "BATON_BENCH_CONCURRENCY", value_delimiter = ',', default_values_t = [1, 16, 64])]
    pub concurrency: Vec<usize>,
    /// submit: how long each run lasts.
    #[arg(long, env = "BATON_BENCH_DURATION", value_parser = humantime::parse_duration, default_value = "5s")]
    pub duration: Duration,
    /// e2e: trivial jobs (`true`) submitted, then waited for until clean.
    #[arg(long, env = "BATON_BENCH_E2E_JOBS", default_value_t = 5000)]
    pub e2e_jobs: usize,
    /// e2e: sleeping jobs on one worker (`--max-running` as many) whose guards' memory is read,
    /// once per kind of guard.
    #[arg(long, env = "BATON_BENCH_GUARD_MEMORY_JOBS", default_value_t = 1000)]
    pub guard_memory_jobs: usize,
    /// e2e: separate workers.
    #[arg(long, env = "BATON_BENCH_WORKERS", default_value_t = 2)]
    pub workers: usize,
    /// recovery: registry sizes to preload, one run each (a third RUNNING on live workers, a
    /// third on dead workers, a third dirty results).
    #[arg(long, env = "BATON_BENCH_RECOVERY_JOBS", value_delimiter = ',', default_values_t = [10_000, 100_000])]
    pub recovery_jobs: Vec<usize>,
    /// failover: leader SIGKILLs, and as many SIGTERMs and SIGSTOPs, at each TTL with fast
    /// failover on and off.
    #[arg(long, env = "BATON_BENCH_FAILOVERS", default_value_t = 25)]
    pub failovers: usize,
    /// failover: the lease TTLs to measure, one cluster each (with and without fast failover).
    #[arg(long, env = "BATON_BENCH_FAILOVER_TTLS", value_delimiter = ',', value_parser = humantime::parse_duration, default_values = ["2s", "5s"])]
    pub failover_ttls: Vec<Duration>,
    /// console: jobs preloaded for the paging views.
    #[arg(long, env = "BATON_BENCH_CONSOLE_JOBS", default_value_t = 100_000)]
    pub console_jobs: usize,
    /// schedules: schedules due at one instant.
    #[arg(long, env = "BATON_BENCH_SCHEDULES", default_value_t = 10_000)]
    pub schedules: usize,
    /// schedules: ticks of an every-second schedule measured on an idle cluster.
    #[arg(long, env = "BATON_BENCH_SCHEDULE_TICKS", default_value_t = 30)]
    pub schedule_ticks: usize,
    /// Election and worker lease TTL of the cluster under test.
    #[arg(long, env = "BATON_LEASE_TTL", value_parser = humantime::parse_duration, default_value = "2s")]
    pub lease_ttl: Duration,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw throughput-vs-concurrency and latency-CDF pictures (SVG) into this folder.
    #[arg(long, env = "BATON_BENCH_PLOT")]
    pub plot: Option<PathBuf>,
    /// Where etcd data and the processes' logs go (default: a temporary folder, removed).
    #[arg(long, env = "BATON_BENCH_DIR")]
    pub dir: Option<PathBuf>,
}

impl BenchArgs {
    /// The scenarios to run, checked.
    pub fn scenarios(&self) -> Result<Vec<&'static str>, super::ConfigError> {
        if self.scenarios.is_empty() {
            return Ok(ALL_SCENARIOS.to_vec());
        }
        self.scenarios
            .iter()
            .map(|s| {
                ALL_SCENARIOS
                    .iter()
                    .find(|a| **a == s.as_str())
                    .copied()
                    .ok_or_else(|| {
                        super::ConfigError(format!(
                            "--scenarios: unknown scenario {s:?} (known: {})",
                            ALL_SCENARIOS.join(", ")
                        ))
                    })
            })
            .collect()
    }

    pub fn validate(&self) -> Result<(), super::ConfigError> {
        self.scenarios()?;
        let bad = |m: &str| Err(super::ConfigError(m.to_string()));
        if self.concurrency.iter().any(|c| *c == 0 || *c > 1024) {
            return bad("--concurrency: each value from 1 to 1024");
        }
        if self.etcd_members == 0 || self.etcd_members > 5 {
            return bad("--etcd-members: from 1 to 5");
        }
        if self.lease_ttl < Duration::from_secs(2) {
            return bad("--lease-ttl is below etcd's 2s minimum");
        }
        if self.duration < Duration::from_millis(100) {
            return bad("--duration: at least 100ms");
        }
        if self.schedules == 0 || self.schedules > 100_000 || self.schedule_ticks == 0 {
            return bad("--schedules: from 1 to 100,000; --schedule-ticks: at least 1");
        }
        if self.workers == 0 {
            return bad("--workers: at least 1");
        }
        Ok(())
    }
}
