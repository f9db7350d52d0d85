//! Scenario `failover`: the leader of three replicas SIGKILLed, SIGTERMed and SIGSTOPped, at
//! each TTL of `--failover-ttls`, with fast failover on and off, in one run: how long the
//! cluster had no leader, how long until the new leader answered as leader, and when a job on
//! the killed leader's own embedded worker ran again (its worker's lease is never revoked on
//! evidence, so that still waits for the TTL and margin). Each term ends at the earliest of its
//! step-down, its lease promise and its process's exit as seen here (`waitid`,
//! `CLOCK_BOOTTIME`); a revoke on evidence of a process not yet seen to exit fails the bench.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use super::cluster::{boot_now, ms_between, BenchCluster, Shape};
use super::stats::Spread;
use crate::config::BenchArgs;
use crate::proto::{CancelJobRequest, GetJobRequest, JobSpec, JobState, SubmitJobRequest};
use crate::rolelog;

#[derive(Clone, Debug, Serialize)]
pub struct Failover {
    pub runs: Vec<FailoverRun>,
}

#[derive(Clone, Debug, Serialize)]
pub struct FailoverRun {
    pub lease_ttl_ms: u64,
    pub fast_failover: bool,
    /// SIGKILL: from the kill to the new term's start (role log).
    pub kill_leaderless: Spread,
    /// SIGKILL: from the kill until the new leader answers as leader.
    pub kill_serving: Spread,
    /// SIGKILL: from the kill until a job on the killed replica's embedded worker runs again.
    pub kill_job_rerun: Spread,
    /// SIGTERM: from the old leader's step-down to the new term's start (role logs).
    pub term_leaderless: Spread,
    /// SIGTERM: from the signal until the new leader answers as leader.
    pub term_serving: Spread,
    /// SIGSTOP: from the signal until the new leader answers as leader (lease expiry, always).
    pub stop_serving: Spread,
    /// Leases revoked on evidence (`leader_process_gone`).
    pub revokes: usize,
    /// Terms that overlapped, each ended at its process's exit at the latest (must be 0).
    pub overlapping_terms: usize,
    /// Revokes on evidence of a process not seen to exit first (must be 0).
    pub unproven_revokes: Vec<String>,
}

pub async fn run(args: &BenchArgs, dir: &Path) -> anyhow::Result<Failover> {
    let mut runs = Vec::new();
    for &ttl in &args.failover_ttls {
        for fast in [true, false] {
            let at = dir.join(format!("ttl{}s-fast-{fast}", ttl.as_secs()));
            let run = one(args, &at, ttl, fast).await?;
            anyhow::ensure!(
                run.unproven_revokes.is_empty(),
                "a revoke on evidence came before its leader's exit: {:?} (logs in {})",
                run.unproven_revokes,
                at.display()
            );
            runs.push(run);
        }
    }
    Ok(Failover { runs })
}

/// Waits until every replica knows the leader of `term` and, with fast failover, every other
/// replica watches it: a round that kills the leader before a follower holds its stream would
/// measure the lease TTL, not the fast path. A replica that never does within 30 s is left to
/// show in the round's figures (a revoke missing, a TTL-long failover) rather than end the run.
async fn settle(c: &BenchCluster, leader: usize, term: i64, fast: bool) {
    for i in 0..c.replicas.len() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let watches =
            |c: &BenchCluster| !fast || i == leader || c.replicas[i].watches_leader_of(term);
        while !(watches(c) && c.follows(i).await) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn one(
    args: &BenchArgs,
    dir: &Path,
    ttl: Duration,
    fast: bool,
) -> anyhow::Result<FailoverRun> {
    let args = BenchArgs {
        lease_ttl: ttl,
        ..args.clone()
    };
    let mut c = BenchCluster::etcd(&args, dir)?;
    for i in 1..=3 {
        c.spawn(Shape {
            replicas: 1,
            replica_args: vec![
                "--fast-failover".into(),
                fast.to_string(),
                "--labels".into(),
                format!("replica=r{i}"),
            ],
            ..Shape::default()
        })?;
    }
    let bound = ttl * 4 + Duration::from_secs(20);
    let (mut leader, mut term) = c.wait_leader(0, Duration::from_secs(60)).await?;
    let (mut kill, mut rerun, mut stop, mut paused) = (
        (Vec::new(), Vec::new()),
        Vec::new(),
        (Vec::new(), Vec::new()),
        Vec::new(),
    );
    for round in 0..args.failovers * 3 {
        settle(&c, leader, term, fast).await;
        let job = format!("pinned-{round}");
        if round % 3 == 0 {
            pin_job(&c, &job, &format!("r{}", leader + 1)).await?;
        }
        let (at, t0) = (boot_now(), Instant::now());
        match round % 3 {
            0 => c.replicas[leader].sigkill(),
            1 => c.replicas[leader].sigterm(),
            _ => c.replicas[leader].pause(),
        }
        let skip = (round % 3 == 2).then_some(leader);
        let (next, next_term) = c.wait_leader_except(term, bound, skip).await?;
        let serving = t0.elapsed().as_secs_f64() * 1e3;
        let began = began(&c, next_term).unwrap_or(at);
        match round % 3 {
            0 => {
                c.replicas[leader].restart()?;
                rerun.push(rerun_ms(&c, &job, t0, bound).await?);
                kill.0.push(ms_between(at, began));
                kill.1.push(serving);
            }
            1 => {
                let down = stepped_down(&c, term).unwrap_or(at);
                stop.0.push(ms_between(down, began));
                stop.1.push(serving);
                c.replicas[leader].wait_exit(Duration::from_secs(30));
                c.replicas[leader].restart()?;
            }
            _ => {
                paused.push(serving);
                c.replicas[leader].resume();
            }
        }
        (leader, term) = (next, next_term);
    }
    let events = c.role_events();
    let exits: Vec<rolelog::Exit> = c.replicas.iter().flat_map(|r| r.exits()).collect();
    let terms = rolelog::terms_until_exits(&events, &exits);
    let overlapping_terms = terms
        .windows(2)
        .filter(|w| rolelog::check_terms(w).is_err())
        .count();
    Ok(FailoverRun {
        lease_ttl_ms: ttl.as_millis() as u64,
        fast_failover: fast,
        kill_leaderless: Spread::of(kill.0),
        kill_serving: Spread::of(kill.1),
        kill_job_rerun: Spread::of(rerun),
        term_leaderless: Spread::of(stop.0),
        term_serving: Spread::of(stop.1),
        stop_serving: Spread::of(paused),
        revokes: events
            .iter()
            .filter(|e| e.event == "leader_process_gone")
            .count(),
        overlapping_terms,
        unproven_revokes: rolelog::unproven_revokes(&events, &exits),
    })
}

fn began(c: &BenchCluster, term: i64) -> Option<u64> {
    event(c, "became_leader", term)
}

fn stepped_down(c: &BenchCluster, term: i64) -> Option<u64> {
    event(c, "stepped_down", term)
}

fn event(c: &BenchCluster, ev: &str, term: i64) -> Option<u64> {
    c.role_events()
        .iter()
        .find(|e| e.event == ev && e.term == Some(term))
        .map(|e| e.boottime_ns)
}

/// Submits a long job only replica `id`'s embedded worker may run, and waits until it has
/// started there (assigned is not enough: a worker killed before its start runs nothing).
async fn pin_job(c: &BenchCluster, job: &str, id: &str) -> anyhow::Result<()> {
    let mut jobs = c.jobs_client(0).await?;
    jobs.submit_job(SubmitJobRequest {
        job_id: job.to_string(),
        spec: Some(JobSpec {
            command: vec!["sleep".into(), "3600".into()],
            worker_selector: HashMap::from([("replica".to_string(), id.to_string())]),
            max_attempts: 3,
            ..Default::default()
        }),
    })
    .await
    .context("submitting the pinned job")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let j = jobs
            .get_job(GetJobRequest {
                job_id: job.to_string(),
            })
            .await?
            .into_inner();
        if started(&j, 1) && j.worker == id {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "job {job} never ran on {id}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// From the kill (`t0`) until the pinned job runs again (on the restarted replica's worker);
/// then cancels it.
async fn rerun_ms(
    c: &BenchCluster,
    job: &str,
    t0: Instant,
    bound: Duration,
) -> anyhow::Result<f64> {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(mut jobs) = ran_again(c, job).await {
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            let _ = jobs
                .cancel_job(CancelJobRequest {
                    job_id: job.to_string(),
                })
                .await;
            return Ok(ms);
        }
        anyhow::ensure!(Instant::now() < deadline, "job {job} never ran again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client of the first replica that answers, if it says the job runs its second attempt.
async fn ran_again(
    c: &BenchCluster,
    job: &str,
) -> Option<crate::proto::job_service_client::JobServiceClient<crate::security::AuthChannel>> {
    for i in 0..c.replicas.len() {
        let Ok(mut jobs) = c.jobs_client(i).await else {
            continue;
        };
        let Ok(j) = jobs
            .get_job(GetJobRequest {
                job_id: job.to_string(),
            })
            .await
        else {
            continue;
        };
        return started(&j.into_inner(), 2).then_some(jobs);
    }
    None
}

/// Whether an execution of attempt `attempt` or later has started and runs.
fn started(j: &crate::proto::Job, attempt: u32) -> bool {
    j.state == JobState::Running as i32
        && j.history
            .iter()
            .any(|a| a.attempt >= attempt && a.state == "started")
}
