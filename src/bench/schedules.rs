//! Scenario `schedules`, on three coordinator-only replicas (jobs stay PENDING: what is measured
//! is when their tick's job is created, from the benchmark's own watch of `jobs/`):
//! - the lag of a schedule firing every second on an idle cluster;
//! - leader SIGKILLs at a tick: when that tick's job appears, after the kill and after the new
//!   term's `became_leader`;
//! - N schedules due at one instant: when the last of their jobs appears, step-downs, the
//!   leader's memory afterwards, and etcd's database size.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use etcd_client::{EventType, WatchOptions};
use serde::Serialize;

use super::cluster::{boot_now, BenchCluster, Shape};
use super::stats::Spread;
use super::usage::sample;
use crate::config::BenchArgs;
use crate::jobs::records::now_ms;
use crate::jobs::spec::{JobRecord, JobSpec, JOB_RECORD_VERSIONS_READ};
use crate::schedule::record::{Overlap, ScheduleRecord};
use crate::store::{codec, Keys, Store, Write};

#[derive(Clone, Debug, Serialize)]
pub struct Schedules {
    pub lease_ttl_ms: u64,
    /// Every-second ticks on an idle cluster: from the scheduled time to the job's creation.
    pub idle_lag: Spread,
    /// Leader SIGKILLed at a tick: from the kill to that tick's job.
    pub kill_to_job: Spread,
    /// The same, from the new term's `became_leader`.
    pub leader_to_job: Spread,
    pub burst_schedules: usize,
    /// Jobs of the burst that appeared.
    pub burst_created: usize,
    /// From the instant to the burst's median and last job.
    pub burst_p50_ms: f64,
    pub burst_last_ms: f64,
    /// Leaders that stepped down during the burst (must be 0).
    pub burst_step_downs: usize,
    pub leader_rss_mb: f64,
    pub etcd_db_mb: f64,
}

/// Job creations the watch saw: job id → (scheduled time, Unix ms seen).
type Seen = Arc<Mutex<HashMap<String, (u64, u64)>>>;

/// Watches `jobs/` from now on and notes each schedule-made job's creation.
async fn watch_jobs(store: &Store, keys: &Keys) -> anyhow::Result<Seen> {
    let seen: Seen = Arc::default();
    let mut client = store.client();
    let mut stream = client
        .watch(keys.jobs(), Some(WatchOptions::new().with_prefix()))
        .await
        .context("watching jobs/")?;
    let out = seen.clone();
    tokio::spawn(async move {
        while let Ok(Some(resp)) = stream.message().await {
            let at = now_ms();
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                if ev.event_type() != EventType::Put || kv.version() != 1 {
                    continue;
                }
                let Ok(rec) =
                    codec::decode_any::<JobRecord>(kv.key(), kv.value(), JOB_RECORD_VERSIONS_READ)
                else {
                    continue;
                };
                if let Some(o) = rec.schedule {
                    out.lock()
                        .expect("seen lock")
                        .insert(rec.job_id, (o.scheduled_time, at));
                }
            }
        }
    });
    Ok(seen)
}

/// A definition as a replica would store it, firing by `cron` (UTC), overlap allow.
fn definition(name: &str, cron: &str) -> ScheduleRecord {
    let spec = JobSpec::resolve(vec!["true".into()], Default::default(), Vec::new(), 0, None)
        .expect("a valid spec");
    ScheduleRecord::new(name, spec, cron, Overlap::Allow, "bench", now_ms())
}

/// A 6-field cron firing once, at the whole second `t_ms` (UTC).
fn once_at(t_ms: u64) -> String {
    let d = chrono::DateTime::from_timestamp_millis(t_ms as i64).unwrap_or_default();
    use chrono::{Datelike, Timelike};
    format!(
        "{} {} {} {} {} *",
        d.second(),
        d.minute(),
        d.hour(),
        d.day(),
        d.month()
    )
}

async fn put_definitions(
    store: &Store,
    keys: &Keys,
    defs: &[ScheduleRecord],
) -> anyhow::Result<()> {
    for chunk in defs.chunks(100) {
        let w = chunk.iter().fold(Write::new(), |w, d| {
            w.put(keys.schedule(&d.name), codec::encode(d))
        });
        let mut c = store.client();
        store.timed("preload", c.txn(w.into_txn())).await?;
    }
    Ok(())
}

/// Waits until the watch has seen job `id`; its (scheduled time, seen at).
async fn wait_seen(seen: &Seen, id: &str, within: Duration) -> anyhow::Result<(u64, u64)> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = seen.lock().expect("seen lock").get(id).copied() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(anyhow!("job {id} did not appear within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Sleeps until Unix ms `t`.
async fn sleep_until_ms(t: u64) {
    let now = now_ms();
    if t > now {
        tokio::time::sleep(Duration::from_millis(t - now)).await;
    }
}

/// The next whole second at least `ahead` from now, Unix ms.
fn second_after(ahead: Duration) -> u64 {
    let t = now_ms() + ahead.as_millis() as u64;
    t - t % 1000 + 1000
}

pub async fn run(args: &BenchArgs, dir: &Path) -> anyhow::Result<Schedules> {
    let mut c = BenchCluster::start(args, dir, Shape::coordinators(3))?;
    let store = c.store().await?;
    let keys = c.keys();
    let (mut leader, mut term) = c.wait_leader(0, Duration::from_secs(60)).await?;
    let seen = watch_jobs(&store, &keys).await?;

    // Idle lag: one schedule every second.
    put_definitions(&store, &keys, &[definition("idle", "* * * * * *")]).await?;
    let until = Instant::now() + Duration::from_secs(args.schedule_ticks as u64 * 2 + 30);
    let idle: Vec<f64> = loop {
        let lags: Vec<f64> = seen
            .lock()
            .expect("seen lock")
            .iter()
            .filter(|(id, _)| id.starts_with("idle-"))
            .map(|(_, (t, at))| at.saturating_sub(*t) as f64)
            .collect();
        if lags.len() >= args.schedule_ticks {
            break lags;
        }
        if Instant::now() > until {
            return Err(anyhow!("the idle schedule fired {} times", lags.len()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut cl = store.client();
    store
        .timed("delete", cl.delete(keys.schedule("idle"), None))
        .await?;

    // Leader SIGKILLs at a tick.
    let (mut kill_to_job, mut leader_to_job) = (Vec::new(), Vec::new());
    for round in 0..args.failovers.clamp(1, 5) {
        let t = second_after(Duration::from_secs(3));
        let name = format!("kill-{round}");
        put_definitions(&store, &keys, &[definition(&name, &once_at(t))]).await?;
        // Just before the tick: the tick falls to the next term.
        sleep_until_ms(t - 50).await;
        let (killed_wall, killed_boot) = (now_ms(), boot_now());
        c.replicas[leader].sigkill();
        let id = crate::schedule::tick_id(&name, t);
        let (_, at) = wait_seen(&seen, &id, args.lease_ttl * 4 + Duration::from_secs(20)).await?;
        kill_to_job.push(at.saturating_sub(killed_wall) as f64);
        let (next, next_term) = c.wait_leader(term, Duration::from_secs(30)).await?;
        if let Some(e) = c
            .role_events()
            .into_iter()
            .find(|e| e.event == "became_leader" && e.term == Some(next_term))
        {
            // The boot clock of the role log, placed on the wall clock by the kill's two readings.
            let began_wall =
                killed_wall as i64 + (e.boottime_ns as i64 - killed_boot as i64) / 1_000_000;
            leader_to_job.push((at as i64 - began_wall) as f64);
        }
        c.replicas[leader].restart()?;
        (leader, term) = (next, next_term);
        for i in 0..c.replicas.len() {
            c.wait_follows(i, Duration::from_secs(30)).await?;
        }
    }

    // N schedules due at one instant.
    let n = args.schedules;
    let t = second_after(Duration::from_secs(10 + n as u64 / 1000));
    let cron = once_at(t);
    let defs: Vec<ScheduleRecord> = (0..n)
        .map(|i| definition(&format!("burst-{i:05}"), &cron))
        .collect();
    put_definitions(&store, &keys, &defs).await?;
    if now_ms() + 2000 > t {
        return Err(anyhow!(
            "preloading {n} schedules took too long for the instant"
        ));
    }
    let downs_before = stepped_down(&c);
    let deadline = Instant::now() + Duration::from_millis(t - now_ms()) + Duration::from_secs(60);
    let burst: Vec<f64> = loop {
        let at: Vec<f64> = seen
            .lock()
            .expect("seen lock")
            .iter()
            .filter(|(id, _)| id.starts_with("burst-"))
            .map(|(_, (_, at))| at.saturating_sub(t) as f64)
            .collect();
        if at.len() >= n || Instant::now() > deadline {
            break at;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let step_downs = stepped_down(&c) - downs_before;
    let rss = sample(c.replicas[leader].pid(), Duration::from_millis(500))
        .await?
        .rss_mb;
    let mut cl = store.client();
    let status = store.timed("status", cl.status()).await?;
    let burst_spread = Spread::of(burst.clone());
    Ok(Schedules {
        lease_ttl_ms: args.lease_ttl.as_millis() as u64,
        idle_lag: Spread::of(idle),
        kill_to_job: Spread::of(kill_to_job),
        leader_to_job: Spread::of(leader_to_job),
        burst_schedules: n,
        burst_created: burst.len(),
        burst_p50_ms: burst_spread.p50_ms,
        burst_last_ms: burst_spread.max_ms,
        burst_step_downs: step_downs,
        leader_rss_mb: rss,
        etcd_db_mb: status.db_size() as f64 / (1024.0 * 1024.0),
    })
}

fn stepped_down(c: &BenchCluster) -> usize {
    c.role_events()
        .iter()
        .filter(|e| e.event == "stepped_down")
        .count()
}
