//! The drill's schedules: fast ones (every 1-2 s), one per overlap policy, beside the job
//! workload, and invariant 8, from etcd, the schedule events of the role logs and the guards'
//! execution ledger: at most one job per (schedule, scheduled time), every tick accounted for,
//! and no two runs of a `forbid` or `replace` schedule at once.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::GetOptions;

use super::check::{Target, Verdict};
use crate::config::ClientArgs;
use crate::exec::record::LedgerEntry;
use crate::proto::schedule_service_client::ScheduleServiceClient;
use crate::proto::{
    CreateScheduleRequest, JobSpec, OverlapPolicy, PauseScheduleRequest, ScheduleDefinition,
};
use crate::schedule::record::{ScheduleRecord, ScheduleStatus, SCHEDULE_VERSION, STATUS_VERSION};
use crate::schedule::Timing;
use crate::store::codec;

/// (name suffix, cron, overlap, seconds each run lasts).
const SCHEDULES: [(&str, &str, OverlapPolicy, f32); 3] = [
    ("forbid", "*/2 * * * * *", OverlapPolicy::OverlapForbid, 3.0),
    ("allow", "* * * * * *", OverlapPolicy::OverlapAllow, 0.5),
    (
        "replace",
        "*/2 * * * * *",
        OverlapPolicy::OverlapReplace,
        3.0,
    ),
];

/// The drill's schedule names for this seed.
pub fn names(seed: u64) -> Vec<String> {
    SCHEDULES
        .iter()
        .map(|(s, ..)| format!("drill-{:04}-{s}", seed % 10_000))
        .collect()
}

fn client(c: &ClientArgs) -> ClientArgs {
    ClientArgs {
        timeout: Duration::from_secs(60),
        ..c.clone()
    }
}

/// Creates the schedules.
pub async fn start(c: &ClientArgs, seed: u64) -> anyhow::Result<()> {
    let c = client(c);
    for ((_, cron, overlap, secs), name) in SCHEDULES.iter().zip(names(seed)) {
        let def = ScheduleDefinition {
            cron: cron.to_string(),
            overlap: *overlap as i32,
            spec: Some(JobSpec {
                command: vec!["sh".into(), "-c".into(), format!("sleep {secs}")],
                max_attempts: 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        crate::cli::call_any(&c, |ch| {
            let req = CreateScheduleRequest {
                name: name.clone(),
                definition: Some(def.clone()),
            };
            async move {
                ScheduleServiceClient::new(ch)
                    .create_schedule(req)
                    .await
                    .map(|_| ())
            }
        })
        .await?;
    }
    Ok(())
}

/// Pauses the schedules, so the drill can drain.
pub async fn stop(c: &ClientArgs, seed: u64) -> anyhow::Result<()> {
    let c = client(c);
    for name in names(seed) {
        crate::cli::call_any(&c, |ch| {
            let req = PauseScheduleRequest {
                name: name.clone(),
                reason: "the drill is over".into(),
                if_revision: 0,
            };
            async move {
                ScheduleServiceClient::new(ch)
                    .pause_schedule(req)
                    .await
                    .map(|_| ())
            }
        })
        .await?;
    }
    Ok(())
}

/// What one schedule's status says against invariant 8: its counts add up to every tick between
/// its creation and its watermark, nothing `missed` or `conflict`, and, in a drill that ran to
/// its end, something fired.
fn ticks_checked(
    name: &str,
    timing: &Timing,
    created_at_ms: u64,
    status: Option<&ScheduleStatus>,
    interrupted: bool,
) -> Vec<String> {
    let mut ev = Vec::new();
    let Some(status) = status else {
        if !interrupted {
            ev.push(format!("{name}: no status: it never fired"));
        }
        return ev;
    };
    let ticks = timing.count(created_at_ms, status.watermark_ms, u64::MAX);
    let counted: u64 = status.counts.values().sum();
    if counted != ticks {
        ev.push(format!(
            "{name}: {counted} ticks decided ({:?}) of {ticks} up to the watermark",
            status.counts
        ));
    }
    if status.counts.get("fired").copied().unwrap_or(0) == 0 && !interrupted {
        ev.push(format!("{name}: nothing fired"));
    }
    for bad in ["conflict", "missed"] {
        if let Some(n) = status.counts.get(bad) {
            ev.push(format!("{name}: {n} ticks {bad}"));
        }
    }
    ev
}

async fn get_one(t: &Target, key: String) -> anyhow::Result<Option<etcd_client::KeyValue>> {
    let mut c = etcd_client::Client::connect(&t.etcd, None).await?;
    Ok(c.get(key, None::<GetOptions>).await?.kvs().first().cloned())
}

/// Invariant 8. `ledger`: the guards' executions (empty for a remote drill). `interrupted`: the
/// drill was stopped early, perhaps before a schedule's first tick came due, so that a schedule
/// fired nothing says nothing; every tick it did decide is still checked.
pub async fn check(
    t: &Target,
    seed: u64,
    ledger: &[LedgerEntry],
    interrupted: bool,
) -> anyhow::Result<Verdict> {
    let mut ev = Vec::new();
    let prefix = format!("/baton/{}/", t.cluster);
    for ((_, _, overlap, _), name) in SCHEDULES.iter().zip(names(seed)) {
        let Some(def) = get_one(t, format!("{prefix}schedules/{name}")).await? else {
            ev.push(format!("{name}: its definition is gone"));
            continue;
        };
        let rec: ScheduleRecord = codec::decode(def.key(), def.value(), SCHEDULE_VERSION)?;
        let status = match get_one(t, format!("{prefix}schedule-status/{name}")).await? {
            Some(kv) => Some(codec::decode::<ScheduleStatus>(
                kv.key(),
                kv.value(),
                STATUS_VERSION,
            )?),
            None => None,
        };
        let timing = Timing::new(&rec.cron, &rec.tz, rec.anchor_ms)?;
        let found = ticks_checked(
            &name,
            &timing,
            rec.created_at_ms,
            status.as_ref(),
            interrupted,
        );
        ev.extend(found);
        if status.is_none() {
            continue;
        }
        // No two runs at once, for forbid and replace.
        if *overlap == OverlapPolicy::OverlapAllow {
            continue;
        }
        let mut runs: BTreeMap<(String, i32, String), (u64, Option<u64>)> = BTreeMap::new();
        let mine = format!("{name}-");
        for e in ledger
            .iter()
            .filter(|e| e.job_id.starts_with(&mine) && e.name.starts_with("attempt-"))
        {
            let k = (e.job_id.clone(), e.pid, e.name.clone());
            let slot = runs.entry(k).or_insert((e.boottime_ns, None));
            match e.event.as_str() {
                "start" => slot.0 = e.boottime_ns,
                _ => slot.1 = Some(e.boottime_ns),
            }
        }
        let mut spans: Vec<(u64, u64, String)> = runs
            .into_iter()
            .map(|((id, ..), (s, e))| (s, e.unwrap_or(u64::MAX), id))
            .collect();
        spans.sort();
        for w in spans.windows(2) {
            if w[0].1 > w[1].0 {
                ev.push(format!(
                    "{name} ({}): {} ran until {} while {} started at {}",
                    match overlap {
                        OverlapPolicy::OverlapReplace => "replace",
                        _ => "forbid",
                    },
                    w[0].2,
                    w[0].1,
                    w[1].2,
                    w[1].0
                ));
            }
        }
    }
    // One fire per (schedule, scheduled time), whichever term decided it.
    let mut fired: BTreeMap<(String, String), usize> = BTreeMap::new();
    for (_, path) in &t.role_logs {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for l in text
            .lines()
            .filter(|l| l.contains(crate::coordinator::SCHEDULE_EVENTS))
        {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
                continue;
            };
            if v["outcome"] == "fired" {
                let key = (
                    v["schedule"].as_str().unwrap_or("").to_string(),
                    v["scheduled_time"].as_str().unwrap_or("").to_string(),
                );
                *fired.entry(key).or_default() += 1;
            }
        }
    }
    for ((s, at), n) in fired.iter().filter(|(_, n)| **n > 1) {
        ev.push(format!("{s}: the tick at {at} fired {n} times"));
    }
    Ok(super::check::verdict(
        8,
        "schedules: at most one job per tick, every tick accounted for, no forbid/replace runs at once",
        ev,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(watermark_ms: u64, counts: &[(&str, u64)]) -> ScheduleStatus {
        ScheduleStatus {
            watermark_ms,
            counts: counts.iter().map(|(k, n)| (k.to_string(), *n)).collect(),
            ..ScheduleStatus::new(1)
        }
    }

    #[test]
    fn an_interrupted_drill_demands_no_fire_but_checks_every_tick_decided() {
        let every_second = Timing::new("* * * * * *", "UTC", 0).unwrap();
        let created = 1_000_000;
        let check = |s: Option<&ScheduleStatus>, interrupted| {
            ticks_checked("s", &every_second, created, s, interrupted)
        };
        // Stopped before its first tick: nothing to say when interrupted, a failure otherwise.
        assert!(check(None, true).is_empty());
        assert_eq!(check(None, false), ["s: no status: it never fired"]);
        let none_fired = status(created + 2_000, &[("paused", 2)]);
        assert!(check(Some(&none_fired), true).is_empty());
        assert_eq!(check(Some(&none_fired), false), ["s: nothing fired"]);
        // The ticks decided are checked either way.
        let short = status(created + 3_000, &[("fired", 2)]);
        for interrupted in [true, false] {
            let found = check(Some(&short), interrupted);
            assert_eq!(found.len(), 1, "{found:?}");
            assert!(found[0].contains("2 ticks decided"), "{found:?}");
        }
        let missed = status(created + 2_000, &[("fired", 1), ("missed", 1)]);
        assert_eq!(check(Some(&missed), true), ["s: 1 ticks missed"]);
        assert!(check(Some(&status(created + 2_000, &[("fired", 2)])), false).is_empty());
    }
}
