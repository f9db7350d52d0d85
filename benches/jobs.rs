//! Job figures: submissions per second through one replica (sequential and 32 in flight), and
//! how long a new leader takes to recover 1,000 running jobs after a SIGKILL.
//!
//! `cargo bench --bench jobs` (env: SUBMITS, RECOVER_JOBS).

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

async fn recovery(n: usize) {
    let mut c = Cluster::start(Options {
        extra_args: vec!["--max-running".into(), n.to_string()],
        ..Options::default()
    });
    let l = c
        .wait_leader(&c.all_indices(), Duration::from_secs(30), |_| true)
        .await;
    let k = c.index_of(&l.replica_id);
    let f = (k + 1) % 3;
    let client = c.jobs(f).await;
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
    let start = Instant::now();
    while count(&mut cl, JobState::Running, false).await < n {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "jobs did not all start"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "{n} jobs running after {:.1} s",
        start.elapsed().as_secs_f64()
    );
    c.replicas[k].sigkill();
    let killed = Instant::now();
    let rest: Vec<usize> = c.all_indices().into_iter().filter(|&i| i != k).collect();
    c.wait_leader(&rest, Duration::from_secs(30), |t| t > l.term)
        .await;
    let elected = killed.elapsed();
    while count(&mut cl, JobState::Running, true).await < n {
        assert!(
            killed.elapsed() < Duration::from_secs(300),
            "jobs were not all recovered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let recovered = killed.elapsed();
    println!(
        "recovery of {n} running jobs after SIGKILL (TTL 2s): new leader after {} ms, all restarted after {} ms ({} ms after the election)",
        elected.as_millis(),
        recovered.as_millis(),
        (recovered - elected).as_millis()
    );
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
    rt.block_on(async {
        submissions(submits).await;
        recovery(jobs).await;
    });
}
