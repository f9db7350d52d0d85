//! Scenario `recovery`: N jobs preloaded into etcd (a third RUNNING on a live worker, a third
//! RUNNING on workers that are gone, a third dirty results), a leader that takes them in, then
//! a SIGKILL of that leader: the time from the next term's start until every registry entry is
//! adopted, waiting, or due for a later look and every dirty result is queued for cleanup (the
//! leader's own `recovered` role events), next to a raw paged read of the same keys.
//!
//! The live worker is the benchmark's: a key on a lease it keeps alive and a `started` record
//! per job, with no free slot, so the cluster adopts its jobs and starts nothing.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use futures_util::StreamExt;
use serde::Serialize;

use super::cluster::{ms_between, BenchCluster, Shape};
use super::usage::{self, Usage};
use crate::config::BenchArgs;
use crate::jobs::records::{
    self, JobResult, RegistryEntry, RegistryStatus, TerminalStatus, REGISTRY_VERSION,
    RESULT_VERSION,
};
use crate::jobs::spec::{JobRecord, JOB_RECORD_VERSION};
use crate::jobs::work::{
    Assignment, AssignmentKind, AttemptRecord, AttemptState, WorkerRecord, ASSIGNMENT_VERSION,
    ATTEMPT_VERSION, WORKER_VERSION,
};
use crate::store::{codec, Keys, Store, Write};

#[derive(Clone, Debug, Serialize)]
pub struct Recovery {
    pub jobs: usize,
    pub running_live: usize,
    pub running_dead: usize,
    pub dirty: usize,
    /// From the new term's start until the registry was taken in.
    pub registry_ms: f64,
    /// From the new term's start until every dirty result was queued for cleanup.
    pub cleanups_ms: f64,
    /// The larger of the two: the recovery time.
    pub recovery_ms: f64,
    /// A raw paged read (pages of 1,000 pinned to one revision) of the registry, the attempt
    /// records and the dirty results, from the benchmark.
    pub raw_read_ms: f64,
    pub preload_seconds: f64,
    /// The new leader once it recovered, holding these jobs.
    pub leader: Usage,
}

/// How many of each kind to preload.
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    pub live: usize,
    pub dead: usize,
    pub dirty: usize,
}

impl Mix {
    pub fn thirds(n: usize) -> Mix {
        let live = n / 3;
        let dead = n / 3;
        Mix {
            live,
            dead,
            dirty: n - live - dead,
        }
    }
}

/// The benchmark's live worker.
pub const LIVE_WORKER: &str = "bench-live";

pub async fn run(args: &BenchArgs, dir: &Path, n: usize) -> anyhow::Result<Recovery> {
    let mix = Mix::thirds(n);
    let mut c = BenchCluster::etcd(args, dir)?;
    let store = c.store().await?;
    let keys = c.keys();
    let worker = FakeWorker::register(&store, &keys, mix.live, args.lease_ttl).await?;
    let t = Instant::now();
    preload(&store, &keys, &worker, mix).await?;
    let preload_seconds = t.elapsed().as_secs_f64();
    c.spawn(Shape::coordinators(2))?;
    let bound = Duration::from_secs(120) + Duration::from_millis(2) * n as u32;
    let (first, term) = c.wait_leader(0, bound).await?;
    wait_recovered(&c, term, bound).await?;
    c.replicas[first].sigkill();
    let (leader, term) = c.wait_leader(term, bound).await?;
    let (registry, cleanups) = wait_recovered(&c, term, bound).await?;
    let began = c
        .role_events()
        .into_iter()
        .find(|e| e.event == "became_leader" && e.term == Some(term))
        .ok_or_else(|| anyhow!("no became_leader event for term {term}"))?
        .boottime_ns;
    let registry_ms = ms_between(began, registry);
    let cleanups_ms = ms_between(began, cleanups);
    let leader_usage = usage::sample(c.replicas[leader].pid(), args.duration).await?;
    let t = Instant::now();
    raw_read(&store, &keys).await?;
    let raw_read_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(Recovery {
        jobs: n,
        running_live: mix.live,
        running_dead: mix.dead,
        dirty: mix.dirty,
        registry_ms,
        cleanups_ms,
        recovery_ms: registry_ms.max(cleanups_ms),
        raw_read_ms,
        preload_seconds,
        leader: leader_usage,
    })
}

/// Waits for term `term`'s two `recovered` events; returns when each was logged (boot ns).
pub async fn wait_recovered(
    c: &BenchCluster,
    term: i64,
    within: Duration,
) -> anyhow::Result<(u64, u64)> {
    let mut at = Vec::new();
    for part in ["registry", "cleanups"] {
        let e = c
            .wait_event(within, &format!("term {term}'s {part} recovery"), |e| {
                e.event == "recovered" && e.term == Some(term) && e.part.as_deref() == Some(part)
            })
            .await?;
        at.push(e.boottime_ns);
    }
    Ok((at[0], at[1]))
}

/// A worker key on a lease the benchmark keeps alive; it runs nothing.
pub struct FakeWorker {
    /// Its incarnation.
    pub rev: i64,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

impl FakeWorker {
    pub async fn register(
        store: &Store,
        keys: &Keys,
        capacity: usize,
        ttl: Duration,
    ) -> anyhow::Result<FakeWorker> {
        let mut client = store.client();
        let lease = client.lease_grant(ttl.as_secs() as i64, None).await?.id();
        let record = WorkerRecord {
            version: WORKER_VERSION,
            worker_id: LIVE_WORKER.into(),
            advertise: "127.0.0.1:1".into(),
            capacity: capacity as u32,
            cleanup_capacity: 0,
            labels: Default::default(),
            draining: false,
            started_at: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
            lease_ttl_ms: ttl.as_millis() as u64,
            margin_ms: 500,
            assign_timeout_ms: 10_000,
            started_at_ms: records::now_ms(),
            unable: None,
        };
        let put = client
            .put(
                keys.worker(LIVE_WORKER),
                codec::encode(&record),
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )
            .await?;
        let rev = put.header().map_or(0, |h| h.revision());
        let (mut keeper, mut answers) = client.lease_keep_alive(lease).await?;
        let every = ttl / 4;
        let keeper = tokio::spawn(async move {
            loop {
                if keeper.keep_alive().await.is_err() {
                    return;
                }
                let _ = answers.message().await;
                tokio::time::sleep(every).await;
            }
        });
        Ok(FakeWorker { rev, keeper })
    }
}

/// Jobs per preload transaction: 3 puts each, within etcd's 128 operations.
const PER_TXN: usize = 40;

/// Writes `mix` into etcd as a cluster would have left it.
pub async fn preload(
    store: &Store,
    keys: &Keys,
    live: &FakeWorker,
    mix: Mix,
) -> anyhow::Result<()> {
    let kinds = [("live", mix.live), ("dead", mix.dead), ("done", mix.dirty)];
    let mut batches = Vec::new();
    for (kind, count) in kinds {
        for start in (0..count).step_by(PER_TXN) {
            batches.push((kind, start, (start + PER_TXN).min(count)));
        }
    }
    let results: Vec<anyhow::Result<()>> = futures_util::stream::iter(batches)
        .map(|(kind, from, to)| load_batch(store, keys, live.rev, kind, from, to))
        .buffer_unordered(8)
        .collect()
        .await;
    results.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    Ok(())
}

async fn load_batch(
    store: &Store,
    keys: &Keys,
    live_rev: i64,
    kind: &str,
    from: usize,
    to: usize,
) -> anyhow::Result<()> {
    let now = records::now_ms();
    let spec = super::submit::trivial_stored();
    let (worker, worker_rev) = match kind {
        "live" => (LIVE_WORKER, live_rev),
        _ => ("bench-gone", 1),
    };
    let ids: Vec<String> = (from..to).map(|i| format!("{kind}-{i:06}")).collect();
    let mut w = Write::new();
    for id in &ids {
        let k = keys.job(id);
        let record = JobRecord {
            version: JOB_RECORD_VERSION,
            job_id: id.clone(),
            spec: spec.clone(),
            spec_hash: spec.hash(),
            submitted_at_ms: now,
            submitted_by: Some("bench".into()),
            schedule: None,
        };
        w = w.put(k.spec, codec::encode(&record));
        if kind == "done" {
            let result = JobResult {
                version: RESULT_VERSION,
                job_id: id.clone(),
                status: TerminalStatus::Finished,
                exit_code: Some(0),
                signal: None,
                error: None,
                attempts: 1,
                failed_attempts: 0,
                recoveries: 0,
                preemptions: 0,
                submitted_at_ms: now,
                submitted_by: Some("bench".into()),
                started_at_ms: now,
                finished_at_ms: now,
                spec_hash: spec.hash(),
                log_tail: String::new(),
                term: 1,
                cleanup: Default::default(),
                worker: Some(worker.into()),
                worker_rev,
            };
            w = w.put(k.dirty, codec::encode(&result));
            continue;
        }
        let mut entry = RegistryEntry::pending();
        entry.version = REGISTRY_VERSION;
        entry.status = RegistryStatus::Running;
        entry.attempt = 1;
        entry.term = 1;
        entry.first_started_ms = now;
        entry.worker = Some(worker.into());
        entry.worker_rev = worker_rev;
        entry.worker_ttl_ms = 2_500;
        let assignment = Assignment {
            version: ASSIGNMENT_VERSION,
            kind: AssignmentKind::Job,
            job_id: id.clone(),
            attempt: 1,
            recovered: false,
            spec: spec.clone(),
            term: 1,
            step: None,
        };
        w = w.put(k.registry, codec::encode(&entry)).put(
            keys.assignment(worker, worker_rev, id),
            codec::encode(&assignment),
        );
    }
    let mut kv = store.client();
    let resp = store
        .timed("preload", kv.txn(w.into_txn()))
        .await
        .context("preloading jobs")?;
    if kind == "done" {
        return Ok(());
    }
    // The attempt records are keyed by the assignment's revision.
    let token = resp.header().map_or(0, |h| h.revision());
    let mut w = Write::new();
    for id in &ids {
        let started = AttemptRecord {
            version: ATTEMPT_VERSION,
            state: AttemptState::Started,
            worker: worker.into(),
            worker_rev,
            attempt: 1,
            pid: 1,
            exit_code: None,
            signal: None,
            killed_by: None,
            log_tail: String::new(),
            reason: None,
            start_error: None,
            at_ms: now,
        };
        w = w.put(keys.attempt(id, token), codec::encode(&started));
    }
    store
        .timed("preload", kv.txn(w.into_txn()))
        .await
        .context("preloading attempt records")?;
    Ok(())
}

/// Reads the registry, the attempt records and the dirty results in pinned pages of 1,000.
async fn raw_read(store: &Store, keys: &Keys) -> anyhow::Result<usize> {
    let mut rev = 0;
    let mut n = 0;
    for prefix in [keys.registry(), keys.attempts(), keys.dirty()] {
        let mut after = String::new();
        loop {
            let (kvs, r) = crate::jobs::page_ids(store, &prefix, &after, 1000, rev).await?;
            rev = r;
            n += kvs.len();
            match kvs.last().and_then(|kv| Keys::id_in(&prefix, kv.key())) {
                Some(last) if kvs.len() == 1000 => after = last.to_string(),
                _ => break,
            }
        }
    }
    Ok(n)
}
