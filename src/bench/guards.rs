//! Part of scenario `e2e`: what the lease guard costs, in one run: the machine's bare spawn
//! rate (trivial processes, two at a time, through the worker's own spawner thread), the
//! end-to-end rate to clean with the legacy guard (`--guard legacy`: the guard's code in the
//! whole `baton` binary) and with `baton-guard`, and each guard's memory per running job.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use serde::Serialize;

use super::cluster::{BenchCluster, Shape};
use super::e2e::EndToEnd;
use crate::config::BenchArgs;
use crate::exec::program::GuardKind;
use crate::exec::spawner;
use crate::proto;

#[derive(Clone, Debug, Serialize)]
pub struct Guards {
    /// `/bin/true` spawned and reaped per second, two at a time, through the spawner thread:
    /// the median of `bare_spawn_samples`, which the ratios use.
    pub bare_spawns_per_sec: f64,
    /// The bare rate over 3 s before the legacy guard's run, between the runs and after the
    /// small guard's.
    pub bare_spawn_samples: Vec<f64>,
    /// End to end with the legacy guard (the small one's figures are the report's `e2e`).
    pub legacy: EndToEnd,
    pub memory: Vec<GuardMemory>,
}

/// Memory of one kind of guard with `running` jobs running on one worker.
#[derive(Clone, Debug, Serialize)]
pub struct GuardMemory {
    pub guard: String,
    pub running: usize,
    /// `Private_Clean + Private_Dirty` (smaps_rollup) summed over the guards, per running job.
    pub private_kib_per_job: f64,
    /// PSS of the worker and its guards together.
    pub worker_and_guards_pss_mib: f64,
}

/// Spawns `/bin/true` two at a time for `window`; returns processes per second.
pub async fn bare_spawn_rate(window: Duration) -> anyhow::Result<f64> {
    let done = AtomicUsize::new(0);
    let started = Instant::now();
    let lane = || async {
        while started.elapsed() < window {
            let status = spawner::run_to_end({
                let mut cmd = Command::new("/bin/true");
                cmd.stdin(std::process::Stdio::null());
                cmd
            })
            .await
            .context("spawning /bin/true")?;
            if !status.success() {
                return Err(anyhow!("/bin/true exited with {status}"));
            }
            done.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    };
    let (a, b) = tokio::join!(lane(), lane());
    a?;
    b?;
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// The median of unsorted `samples` (nearest rank; 0 for none).
pub fn median(samples: &[f64]) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    super::stats::quantile(&v, 0.5)
}

/// `--guard <kind>` for a worker.
pub fn guard_flag(kind: GuardKind) -> Vec<String> {
    vec!["--guard".into(), kind.name().into()]
}

/// Runs `n` sleeping jobs on one worker with `kind` of guard and reads the guards' memory.
pub async fn memory(
    args: &BenchArgs,
    dir: &Path,
    kind: GuardKind,
    n: usize,
) -> anyhow::Result<GuardMemory> {
    let mut worker_args = vec!["--max-running".to_string(), n.to_string()];
    worker_args.extend(guard_flag(kind));
    let c = BenchCluster::start(
        args,
        dir,
        Shape {
            replicas: 1,
            workers: 1,
            replica_args: vec!["--max-starts-per-second".into(), "10000".into()],
            worker_args,
            http: false,
        },
    )?;
    c.wait_leader(0, Duration::from_secs(60)).await?;
    let store = c.store().await?;
    super::e2e::wait_workers(&store, &c.keys(), 1).await?;
    let client = c.jobs_client(0).await?;
    for i in 0..n {
        let mut client = client.clone();
        client
            .submit_job(proto::SubmitJobRequest {
                job_id: format!("mem-{i}"),
                spec: Some(proto::JobSpec {
                    command: vec!["sleep".into(), "600".into()],
                    ..Default::default()
                }),
            })
            .await
            .with_context(|| format!("submitting mem-{i}"))?;
    }
    let worker = c.workers[0].pid();
    let deadline = Instant::now() + Duration::from_secs(120) + Duration::from_millis(50) * n as u32;
    let guards = loop {
        // A guard counts once its job runs: it has a child of its own.
        let guards: Vec<i32> = children(worker)
            .into_iter()
            .filter(|g| !children(*g).is_empty())
            .collect();
        if guards.len() >= n {
            break guards;
        }
        if Instant::now() > deadline {
            return Err(anyhow!("only {} of {n} jobs ran", guards.len()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut private_kib = 0u64;
    let mut pss_kib = rollup(worker, &["Pss"])?;
    for g in &guards {
        private_kib += rollup(*g, &["Private_Clean", "Private_Dirty"])?;
        pss_kib += rollup(*g, &["Pss"])?;
    }
    Ok(GuardMemory {
        guard: kind.name().into(),
        running: guards.len(),
        private_kib_per_job: private_kib as f64 / guards.len() as f64,
        worker_and_guards_pss_mib: pss_kib as f64 / 1024.0,
    })
}

/// The children of `pid` (every thread's).
fn children(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// The sum of `fields` (kB) in `/proc/<pid>/smaps_rollup`.
fn rollup(pid: i32, fields: &[&str]) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .with_context(|| format!("reading /proc/{pid}/smaps_rollup"))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            fields
                .contains(&name)
                .then(|| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
                .flatten()
        })
        .sum())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_is_the_middle_sample_whatever_their_order() {
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&[1.0, 5.0, 3.0]), 3.0);
        assert_eq!(median(&[3.0, 5.0, 1.0]), 3.0);
        // Nearest rank: the lower of the middle two.
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.0);
        assert_eq!(median(&[]), 0.0);
    }
}
