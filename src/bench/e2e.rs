//! Scenario `e2e`: trivial jobs (`true`) from submission to a clean result, on coordinator-only
//! replicas and separate workers, with what each job cost etcd (from etcd's own counters).

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use etcd_client::{EventType, WatchOptions};
use futures_util::StreamExt;
use serde::Serialize;

use super::cluster::{BenchCluster, Shape};
use super::cost::{CpuPerJob, Meter};
use super::etcdstats::{self, Counts};
use super::submit::trivial;
use crate::config::BenchArgs;
use crate::exec::program::GuardKind;
use crate::proto;
use crate::store::Keys;

#[derive(Clone, Debug, Serialize)]
pub struct EndToEnd {
    pub jobs: usize,
    pub workers: usize,
    /// Jobs per second from the first submission until the last result was recorded (dirty).
    pub results_per_sec: f64,
    /// Jobs per second from the first submission until the last result was clean.
    pub clean_per_sec: f64,
    pub seconds: f64,
    /// What etcd answered and applied per job, submission and cleanup included.
    pub etcd_requests_per_job: f64,
    pub etcd_txns_per_job: f64,
    pub etcd_writes_per_job: f64,
    /// Ranges etcd's first member evaluated per job (reads and compares; see `Counts`).
    pub etcd_ranges_per_job: f64,
    /// Settings the run needed beyond the defaults.
    pub settings: String,
    /// The workers' guard (`small` or `legacy`).
    pub guard: String,
    /// What each job cost each kind of process in CPU (left out when a process could not be
    /// read).
    pub cpu: Option<CpuPerJob>,
}

/// Submitting clients.
const CLIENTS: usize = 64;

pub async fn run(args: &BenchArgs, dir: &Path, guard: GuardKind) -> anyhow::Result<EndToEnd> {
    Ok(measure(args, dir, None, guard).await?.0)
}

/// What console streams on a follower cost during an end-to-end run.
#[derive(Clone, Debug, Serialize)]
pub struct Consoles {
    pub consoles: usize,
    /// The follower's CPU from the first submission to the last clean result, of one core.
    pub follower_cpu_percent: f64,
    /// etcd's watchers (every member) with the consoles open.
    pub etcd_watchers: f64,
    /// Events the consoles received, together.
    pub events: u64,
}

/// The end-to-end run; with `consoles`, every replica serves HTTP and that many console
/// streams (`/api/v1/events`) stay open on the follower the jobs are submitted to.
pub async fn measure(
    args: &BenchArgs,
    dir: &Path,
    consoles: Option<usize>,
    guard: GuardKind,
) -> anyhow::Result<(EndToEnd, Option<Consoles>)> {
    let replica_args: Vec<String> = [
        "--max-starts-per-second",
        "10000",
        "--cleanup-concurrency",
        "256",
    ]
    .map(String::from)
    .to_vec();
    let mut worker_args = vec!["--max-running".to_string(), "128".into()];
    worker_args.extend(super::guards::guard_flag(guard));
    let settings = format!(
        "coordinators {}; workers {}",
        replica_args.join(" "),
        worker_args.join(" ")
    );
    let c = BenchCluster::start(
        args,
        dir,
        Shape {
            replicas: 3,
            workers: args.workers,
            replica_args,
            worker_args,
            http: consoles.is_some(),
        },
    )?;
    let (leader, _) = c.wait_leader(0, Duration::from_secs(60)).await?;
    let keys = Keys::new(super::cluster::CLUSTER);
    let store = c.store().await?;
    wait_workers(&store, &keys, args.workers).await?;
    let follower = (leader + 1) % c.replicas.len();
    c.wait_follows(follower, Duration::from_secs(60)).await?;
    let client = c.jobs_client(follower).await?;
    let streams = match consoles {
        Some(n) => Some(super::console::open_streams(c.http[follower], n).await?),
        None => None,
    };
    etcdstats::quiesce(&c.etcd, Duration::from_secs(30)).await;
    let watchers = etcdstats::watchers(&c.etcd).await;
    let follower_pid = c.replicas[follower].pid();
    let ticks = super::usage::cpu_ticks(follower_pid)?;

    let rev = {
        let mut kv = store.client();
        kv.get(keys.prefix(), None)
            .await?
            .header()
            .map_or(0, |h| h.revision())
    };
    let mut watcher = store.client();
    let opts = || {
        Some(
            WatchOptions::new()
                .with_prefix()
                .with_start_revision(rev + 1),
        )
    };
    let mut stream = watcher.watch(keys.dirty(), opts()).await?;
    stream.watch(keys.clean(), opts()).await?;

    let before = etcdstats::read(&c.etcd).await;
    let n = args.e2e_jobs;
    // The leader as the run begins (the one above may have lost its term meanwhile).
    let leading = c.wait_leader(0, Duration::from_secs(60)).await?;
    let meter = Meter::start(&c, leading.0);
    let started = Instant::now();
    let submitting = tokio::spawn({
        let client = client.clone();
        async move {
            futures_util::stream::iter(0..n)
                .for_each_concurrent(CLIENTS, |i| {
                    let mut client = client.clone();
                    async move {
                        for _ in 0..5 {
                            let r = client
                                .submit_job(proto::SubmitJobRequest {
                                    job_id: format!("e2e-{i}"),
                                    spec: Some(trivial()),
                                })
                                .await;
                            if r.is_ok() {
                                return;
                            }
                        }
                    }
                })
                .await
        }
    });
    let (mut dirty, mut clean) = (HashSet::new(), HashSet::new());
    let (mut results_at, mut clean_at) = (None, None);
    let bound = Duration::from_secs(120) + Duration::from_millis(50) * n as u32;
    let deadline = tokio::time::Instant::now() + bound;
    while clean.len() < n {
        let msg = tokio::time::timeout_at(deadline, stream.message()).await;
        let resp = match msg {
            Ok(Ok(Some(r))) => r,
            Ok(_) => return Err(anyhow!("the benchmark's watch on etcd ended")),
            Err(_) => {
                return Err(anyhow!(
                    "only {} of {n} jobs were clean after {bound:?} ({} with a result)",
                    clean.len(),
                    dirty.len()
                ))
            }
        };
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            if ev.event_type() != EventType::Put {
                continue;
            }
            if let Some(id) = Keys::id_in(&keys.dirty(), kv.key()) {
                dirty.insert(id.to_string());
                if dirty.len() == n {
                    results_at = Some(started.elapsed());
                }
            } else if let Some(id) = Keys::id_in(&keys.clean(), kv.key()) {
                clean.insert(id.to_string());
                if clean.len() == n {
                    clean_at = Some(started.elapsed());
                }
            }
        }
    }
    let mut used = meter.and_then(|m| m.per_job(n));
    if let Some(u) = &mut used {
        u.leader_moved = c.wait_leader(0, Duration::from_secs(10)).await.ok() != Some(leading);
    }
    let _ = submitting.await;
    let cpu = super::usage::cpu_percent(
        super::usage::cpu_ticks(follower_pid)?.saturating_sub(ticks),
        started.elapsed().as_secs_f64(),
    );
    let consoles = match (consoles, streams) {
        (Some(n), Some(s)) => Some(Consoles {
            consoles: n,
            follower_cpu_percent: cpu,
            etcd_watchers: watchers,
            events: s.close().await,
        }),
        _ => None,
    };
    let clean_at = clean_at.unwrap_or_else(|| started.elapsed());
    let results_at = results_at.unwrap_or(clean_at);
    let spent: Counts = etcdstats::read(&c.etcd).await - before;
    let per = |x: f64| x / n.max(1) as f64;
    let e = EndToEnd {
        jobs: n,
        workers: args.workers,
        results_per_sec: n as f64 / results_at.as_secs_f64(),
        clean_per_sec: n as f64 / clean_at.as_secs_f64(),
        seconds: clean_at.as_secs_f64(),
        etcd_requests_per_job: per(spent.requests),
        etcd_txns_per_job: per(spent.txns),
        etcd_writes_per_job: per(spent.writes),
        etcd_ranges_per_job: per(spent.ranges),
        settings,
        guard: guard.name().into(),
        cpu: used,
    };
    Ok((e, consoles))
}

/// Waits until `n` workers are registered.
pub async fn wait_workers(
    store: &crate::store::Store,
    keys: &Keys,
    n: usize,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut kv = store.client();
        let count = kv
            .get(
                keys.workers(),
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await
            .map(|r| r.count() as usize)
            .unwrap_or(0);
        if count >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(anyhow!("only {count} of {n} workers registered within 60s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
