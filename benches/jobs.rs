//! Job figures: submissions per second through one replica (sequential and 32 in flight); how
//! long 1,000 jobs take to start at TTL 2 s, with the longest keepalive gap, the peak load
//! average and the step-downs meanwhile (the goal is none); and how long a new leader takes to
//! recover them after a SIGKILL.
//!
//! `./scripts/build-guard --release && cargo bench --bench jobs` (env: SUBMITS, RECOVER_JOBS,
//! MAX_STARTS_PER_SECOND): the workers run the guard next to the release `baton`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use baton::proto::ListJobsRequest;
use futures_util::StreamExt;
use support::*;

async fn count(c: &mut Jobs, state: JobState, recovered: bool) -> usize {
    let mut n = 0;
    let mut token = String::new();
    loop {
        let Ok(page) = c
            .list_jobs(ListJobsRequest {
                state: state as i32,
                page_size: 1000,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
        else {
            return 0;
        };
        let page = page.into_inner();
        n += page
            .jobs
            .iter()
            .filter(|j| !recovered || j.recoveries > 0)
            .count();
        if page.next_page_token.is_empty() {
            return n;
        }
        token = page.next_page_token;
    }
}

async fn submissions(n: usize) {
    let c = Cluster::start(Options {
        extra_args: vec!["--max-running".into(), "8".into()],
        ..Options::default()
    });
    c.wait_leader(&c.all_indices(), Duration::from_secs(30), |_| true)
        .await;
    let client = c.jobs(0).await;
    for (label, inflight) in [("sequential", 1usize), ("32 in flight", 32)] {
        let start = Instant::now();
        futures_util::stream::iter(0..n)
            .for_each_concurrent(inflight, |i| {
                let mut cl = client.clone();
                async move {
                    cl.submit_job(SubmitJobRequest {
                        job_id: format!("s{inflight}-{i}"),
                        spec: Some(sh("true")),
                    })
                    .await
                    .unwrap();
                }
            })
            .await;
        let secs = start.elapsed().as_secs_f64();
        println!(
            "submissions through one replica, {label}: {:.0}/s ({n} in {:.2} s)",
            n as f64 / secs,
            secs
        );
    }
}

/// The longest time between two answered keepalives of any lease, from the role logs.
fn longest_keepalive_gap(c: &Cluster) -> Duration {
    let mut by_lease: std::collections::HashMap<i64, Vec<u64>> = Default::default();
    for e in c.role_events() {
        if e.event == "lease_proven" {
            by_lease.entry(e.lease).or_default().push(e.boottime_ns);
        }
    }
    by_lease
        .values_mut()
        .flat_map(|v| {
            v.sort();
            v.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
        })
        .max()
        .map_or(Duration::ZERO, Duration::from_nanos)
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// `n` jobs on two workers (coordinators at `--worker=false`): started, then a leader SIGKILL
/// (which must restart none), then a worker SIGKILL (whose jobs move to the other).
async fn recovery(n: usize, starts_per_second: Option<String>) {
    let mut extra = Vec::new();
    if let Some(rate) = starts_per_second {
        extra.extend(["--max-starts-per-second".to_string(), rate]);
    }
    let mut c = Cluster::start(Options {
        extra_args: extra,
        embedded: false,
        workers: 2,
        worker_args: vec!["--max-running".to_string(), n.to_string()],
        ..Options::default()
    });
    c.wait_workers(&["w1", "w2"]).await;
    let l = c
        .wait_leader(&c.all_indices(), Duration::from_secs(30), |_| true)
        .await;
    let k = c.index_of(&l.replica_id);
    let f = (k + 1) % 3;
    let client = c.jobs(f).await;
    let start = Instant::now();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                let load = (load_average() * 100.0) as u64;
                peak.fetch_max(load, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    futures_util::stream::iter(0..n)
        .for_each_concurrent(32, |i| {
            let mut cl = client.clone();
            async move {
                cl.submit_job(SubmitJobRequest {
                    job_id: format!("r-{i}"),
                    spec: Some(sh("sleep 600")),
                })
                .await
                .unwrap();
            }
        })
        .await;
    let mut cl = client.clone();
    while count(&mut cl, JobState::Running, false).await < n {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "jobs did not all start"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let started = start.elapsed();
    sampler.abort();
    let peak_load = peak.load(std::sync::atomic::Ordering::Relaxed) as f64 / 100.0;
    let downs: Vec<String> = c
        .role_events()
        .into_iter()
        .filter(|e| e.event == "stepped_down")
        .map(|e| format!("{} ({:?})", e.replica, e.reason))
        .collect();
    println!(
        "{n} jobs (sleep 600) submitted and started in {:.1} s at TTL 2s: longest keepalive gap {} ms, peak load average {peak_load:.1}, step-downs {} {downs:?}",
        started.as_secs_f64(),
        longest_keepalive_gap(&c).as_millis(),
        downs.len()
    );
    c.replicas[k].sigkill();
    let killed = Instant::now();
    let rest: Vec<usize> = c.all_indices().into_iter().filter(|&i| i != k).collect();
    c.wait_leader(&rest, Duration::from_secs(30), |t| t > l.term)
        .await;
    let elected = killed.elapsed();
    // Adopted, not restarted: every job still RUNNING, none recovered.
    let mut cl = c.jobs(f).await;
    let adopted = count(&mut cl, JobState::Running, false).await;
    let restarted = count(&mut cl, JobState::Running, true).await;
    println!(
        "leader SIGKILL with {n} jobs on 2 workers (TTL 2s): new leader after {} ms; {adopted} still running, {restarted} restarted",
        elected.as_millis()
    );
    let on_w1 = count_on(&c, "w1").await;
    c.workers[0].sigkill();
    let killed = Instant::now();
    while count(&mut cl, JobState::Running, true).await < on_w1 {
        assert!(
            killed.elapsed() < Duration::from_secs(300),
            "the killed worker's jobs were not all restarted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "worker SIGKILL: its {on_w1} jobs restarted on the other worker {} ms after the kill (key expiry <= TTL, then TTL + margin)",
        killed.elapsed().as_millis()
    );
}

/// RUNNING registry entries on worker `w`.
async fn count_on(c: &Cluster, w: &str) -> usize {
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    let resp = client
        .get(
            "/baton/test/registry/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    resp.kvs()
        .iter()
        .filter(|kv| {
            serde_json::from_slice::<serde_json::Value>(kv.value())
                .is_ok_and(|v| v["worker"] == w && v["status"] == "RUNNING")
        })
        .count()
}

fn main() {
    let submits = std::env::var("SUBMITS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let jobs = std::env::var("RECOVER_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let rate = std::env::var("MAX_STARTS_PER_SECOND").ok();
    rt.block_on(async {
        submissions(submits).await;
        recovery(jobs, rate).await;
    });
}
