//! `baton bench`: Baton measured against raw etcd in the same run, on clusters it starts itself
//! (like `baton dev`), one fresh cluster per scenario:
//! - [`submit`]: `SubmitJob` from C clients next to raw transactions of the same shape;
//! - [`e2e`]: trivial jobs from submission to a clean result, their cost in etcd requests and,
//!   with [`cost`], in each kind of process's CPU;
//!   with [`guards`], the bare spawn rate, the legacy guard's rate and each guard's memory;
//! - [`recovery`]: a new leader taking in N preloaded jobs, next to a raw paged read;
//! - [`failover`]: leader SIGKILLs and SIGTERMs;
//! - [`footprint`]: memory and CPU of idle processes and of a leader holding N jobs;
//! - [`schedules`]: tick lag, a leader killed at a tick, N schedules due at one instant;
//! - [`console`]: pages of the HTTP API over N jobs, and 50 console streams during `e2e`.
//!
//! Baton's limit is what etcd can commit, so figures come as ratios to raw etcd where there
//! is one. Only loopback addresses are used.

mod cluster;
mod console;
mod cost;
mod e2e;
mod etcdstats;
mod failover;
mod footprint;
mod guards;
mod load;
mod plot;
mod recovery;
mod report;
mod schedules;
mod stats;
mod submit;
mod usage;

use anyhow::Context;

use crate::config::BenchArgs;
pub use report::{Report, Target};

/// Runs the scenarios asked for and prints the report.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    args.validate()?;
    let scenarios = args.scenarios()?;
    let (_tmp, dir) = crate::devcluster::workdir(args.dir.as_deref(), "baton-bench-")
        .context("creating a temporary folder")?;
    let mut report = Report {
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        etcd_members: args.etcd_members,
        lease_ttl_ms: args.lease_ttl.as_millis() as u64,
        submit_seconds: args.duration.as_secs_f64(),
        ..Report::default()
    };
    for s in scenarios {
        eprintln!("bench: {s} ...");
        let at = dir.join(s);
        match s {
            "submit" => report.submit = Some(submit::run(&args, &at).await?),
            "e2e" => {
                use crate::exec::program::GuardKind;
                // The bare rate is sampled around both runs: this VM's speed drifts within a
                // minute, and one sample taken before them made the ratios swing.
                let window = std::time::Duration::from_secs(3);
                let mut bare = vec![guards::bare_spawn_rate(window).await?];
                let legacy = e2e::run(&args, &at.join("legacy"), GuardKind::Legacy).await?;
                bare.push(guards::bare_spawn_rate(window).await?);
                report.e2e = Some(e2e::run(&args, &at.join("small"), GuardKind::Small).await?);
                bare.push(guards::bare_spawn_rate(window).await?);
                let n = args.guard_memory_jobs;
                let mut memory = Vec::new();
                for kind in [GuardKind::Legacy, GuardKind::Small] {
                    let at = at.join(format!("memory-{}", kind.name()));
                    memory.push(guards::memory(&args, &at, kind, n).await?);
                }
                report.guards = Some(guards::Guards {
                    bare_spawns_per_sec: guards::median(&bare),
                    bare_spawn_samples: bare,
                    legacy,
                    memory,
                });
            }
            "recovery" => {
                let mut all = Vec::new();
                for &n in &args.recovery_jobs {
                    all.push(recovery::run(&args, &at.join(n.to_string()), n).await?);
                }
                report.recovery = Some(all);
            }
            "failover" => report.failover = Some(failover::run(&args, &at).await?),
            "footprint" => {
                let n = args.recovery_jobs.iter().copied().max().unwrap_or(0);
                report.footprint = Some(footprint::run(&args, &at, n).await?);
            }
            "schedules" => report.schedules = Some(schedules::run(&args, &at).await?),
            "console" => report.console = Some(console::run(&args, &at, args.console_jobs).await?),
            _ => unreachable!("checked by scenarios()"),
        }
    }
    report.judge();
    if let (Some(plots), Some(points)) = (&args.plot, &report.submit) {
        for p in plot::draw(points, plots)? {
            eprintln!("bench: drew {}", p.display());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
