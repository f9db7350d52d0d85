//! Schedules on a real etcd with real `baton` processes: each tick at most once across leader
//! kills, stops and terms; `replace` never overlaps; names reused; updates, pauses, backfills;
//! a daylight-saving change through a test-only clock offset; a watermark ahead of the clock;
//! bad input.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use baton::proto::schedule_service_client::ScheduleServiceClient;
use baton::proto::{
    BackfillScheduleRequest, CatchupPolicy, CreateScheduleRequest, DeleteScheduleRequest,
    GetScheduleRequest, OverlapPolicy, PauseScheduleRequest, ResumeScheduleRequest, Schedule,
    ScheduleDefinition, TriggerScheduleRequest, UpdateScheduleRequest,
};
use baton::schedule::expr::{parse_rfc3339, rfc3339};
use baton::schedule::{tick_id, Timing};
use support::*;

type Schedules = ScheduleServiceClient<tonic::transport::Channel>;

async fn schedules(c: &Cluster, i: usize) -> Schedules {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", c.replicas[i].listen()))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    ScheduleServiceClient::new(ch)
}

/// A cluster of `replicas` (embedded workers) with a leader, its scratch folder and all its
/// replicas' indices.
async fn small_cluster(replicas: usize) -> (Cluster, std::path::PathBuf, Vec<usize>) {
    let c = Cluster::start(Options {
        replicas,
        ..Options::default()
    });
    let out = scratch(&c);
    let all = c.all_indices();
    c.leader_index().await;
    (c, out, all)
}

/// Reads schedule `name` through the first of `via` that answers.
async fn get(c: &Cluster, via: &[usize], name: &str) -> Schedule {
    wait_for(
        &format!("schedule {name} to be readable"),
        Duration::from_secs(20),
        || async {
            for &i in via {
                let ch = tonic::transport::Endpoint::from_shared(format!(
                    "http://{}",
                    c.replicas[i].listen()
                ))
                .ok()?
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(10))
                .connect()
                .await;
                let Ok(ch) = ch else { continue };
                let r = ScheduleServiceClient::new(ch)
                    .get_schedule(GetScheduleRequest { name: name.into() })
                    .await;
                if let Ok(r) = r {
                    return Some(r.into_inner());
                }
            }
            None
        },
    )
    .await
}

fn def(cron: &str, overlap: OverlapPolicy, spec: JobSpec) -> ScheduleDefinition {
    ScheduleDefinition {
        cron: cron.into(),
        overlap: overlap as i32,
        spec: Some(spec),
        ..Default::default()
    }
}

async fn create(c: &Cluster, name: &str, d: ScheduleDefinition) -> Schedule {
    schedules(c, 0)
        .await
        .create_schedule(CreateScheduleRequest {
            name: name.into(),
            definition: Some(d),
        })
        .await
        .unwrap_or_else(|s| panic!("create {name}: {s}"))
        .into_inner()
}

/// A job that notes `<schedule> <scheduled time> <job id> <attempt>` in `out/ledger`, and its
/// start and end (`start|end <job id> <unix ms>`) in `out/spans`, and runs `secs`.
fn ledgered(out: &std::path::Path, secs: f32) -> JobSpec {
    let mut spec = sh(&format!(
        "now() {{ date +%s%3N; }}; \
         echo \"$BATON_SCHEDULE $BATON_SCHEDULED_TIME $BATON_JOB_ID $BATON_ATTEMPT\" >> \"$OUT/ledger\"; \
         echo \"start $BATON_JOB_ID $(now)\" >> \"$OUT/spans\"; \
         trap 'echo \"end $BATON_JOB_ID $(now)\" >> \"$OUT/spans\"; exit 143' TERM; \
         sleep {secs} & wait; \
         echo \"end $BATON_JOB_ID $(now)\" >> \"$OUT/spans\""
    ));
    spec.env.insert("OUT".into(), out.display().to_string());
    spec
}

/// `(schedule, scheduled time, job id, attempt)` of each execution the ledger noted.
fn ledger(out: &std::path::Path) -> Vec<(String, String, String, u32)> {
    lines(&out.join("ledger"))
        .iter()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((
                f.next()?.to_string(),
                f.next()?.to_string(),
                f.next()?.to_string(),
                f.next()?.parse().ok()?,
            ))
        })
        .collect()
}

/// At most one job id per scheduled time, and it is the tick's own id.
fn check_one_job_per_tick(name: &str, runs: &[(String, String, String, u32)]) -> usize {
    let mut by_time: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (s, t, id, _) in runs {
        assert_eq!(s, name);
        by_time.entry(t.as_str()).or_default().insert(id.as_str());
    }
    for (t, ids) in &by_time {
        assert_eq!(ids.len(), 1, "tick {t} ran as {ids:?}");
        let ms = parse_rfc3339("t", t).unwrap();
        assert_eq!(*ids.iter().next().unwrap(), tick_id(name, ms), "tick {t}");
    }
    by_time.len()
}

/// Each job's executions, `(start, end)` in Unix ms, from the spans file (an execution killed
/// without its trap has no end: it counts as running until `open_until`).
fn spans(out: &std::path::Path, open_until: u64) -> Vec<(String, u64, u64)> {
    let mut open: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut done = Vec::new();
    for l in lines(&out.join("spans")) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let [what, id, at] = f[..] else { continue };
        let Ok(at) = at.parse::<u64>() else { continue };
        match what {
            "start" => open.entry(id.to_string()).or_default().push(at),
            _ => {
                if let Some(s) = open.get_mut(id).and_then(|v| v.pop()) {
                    done.push((id.to_string(), s, at));
                }
            }
        }
    }
    for (id, starts) in open {
        for s in starts {
            done.push((id.clone(), s, open_until));
        }
    }
    done
}

/// Every tick of the status is accounted for: its counts add up to the ticks between the
/// schedule's creation and its watermark.
fn check_accounted(s: &Schedule, cron: &str) {
    let timing = Timing::new(cron, "UTC", 0).unwrap();
    let wm = parse_rfc3339("wm", &s.watermark).unwrap();
    let expected = timing.count(s.created_unix_ms as u64, wm, u64::MAX);
    let total: u64 = s.counts.values().sum();
    assert_eq!(
        total, expected,
        "counts {:?} against ticks up to {}",
        s.counts, s.watermark
    );
}

async fn wait_fired(c: &Cluster, via: &[usize], name: &str, at_least: u64, within: Duration) {
    wait_for(
        &format!("{name} to fire {at_least} times"),
        within,
        || async {
            let s = get(c, via, name).await;
            (s.counts.get("fired").copied().unwrap_or(0) >= at_least).then_some(())
        },
    )
    .await
}

/// Pauses schedule `name` and waits until each job it fired has ended.
async fn quiesce(c: &Cluster, via: &[usize], name: &str) -> Schedule {
    let mut cl = schedules(c, via[0]).await;
    cl.pause_schedule(PauseScheduleRequest {
        name: name.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let s = get(c, via, name).await;
    for id in &s.live_jobs {
        c.wait_job(via, id, Duration::from_secs(90), "terminal", terminal)
            .await;
    }
    get(c, via, name).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_every_second_fires_each_tick_at_most_once_across_leader_faults() {
    let mut c = Cluster::start(Options::default());
    let out = scratch(&c);
    let (mut leader, _) = c.leader_index().await;
    let cron = "* * * * * *";
    create(
        &c,
        "tick",
        def(cron, OverlapPolicy::OverlapAllow, ledgered(&out, 0.3)),
    )
    .await;
    let all = c.all_indices();
    wait_fired(&c, &all, "tick", 3, Duration::from_secs(30)).await;

    // SIGKILL the leader (its embedded worker dies with it).
    let term = c.get_leader(leader).await.unwrap().leader.unwrap().term;
    c.replicas[leader].sigkill();
    let (next, l) = c.wait_new_leader(&c.others(leader), term).await;
    let fired = get(&c, &[next], "tick").await.counts["fired"];
    wait_fired(&c, &[next], "tick", fired + 3, Duration::from_secs(30)).await;
    c.replicas[leader].restart().unwrap();
    leader = next;

    // SIGTERM the next one: it hands over.
    c.replicas[leader].sigterm();
    c.replicas[leader].wait_exit(Duration::from_secs(30));
    let (next, l2) = c.wait_new_leader(&c.others(leader), l.term).await;
    let fired = get(&c, &[next], "tick").await.counts["fired"];
    wait_fired(&c, &[next], "tick", fired + 3, Duration::from_secs(30)).await;
    c.replicas[leader].restart().unwrap();
    leader = next;

    // SIGSTOP the next one beyond its lease, then let it go on.
    c.replicas[leader].pause();
    // A new term means its lease ran out while it was stopped.
    let (next, _) = c.wait_new_leader(&c.others(leader), l2.term).await;
    c.replicas[leader].resume();
    let fired = get(&c, &[next], "tick").await.counts["fired"];
    wait_fired(&c, &[next], "tick", fired + 3, Duration::from_secs(30)).await;

    let s = quiesce(&c, &all, "tick").await;
    let runs = ledger(&out);
    let ticks = check_one_job_per_tick("tick", &runs);
    assert_eq!(
        ticks as u64, s.counts["fired"],
        "every fired tick ran: {:?}",
        s.counts
    );
    assert_eq!(
        s.counts.get("missed"),
        None,
        "coordinator faults miss nothing"
    );
    assert_eq!(s.counts.get("conflict"), None);
    check_accounted(&s, cron);
    // The events name each fired tick once, whichever term decided it.
    let mut fired_events = BTreeMap::new();
    for r in &c.replicas {
        let text = std::fs::read_to_string(r.role_log_path()).unwrap_or_default();
        for l in text.lines().filter(|l| l.contains("baton::schedule")) {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            if v["outcome"] == "fired" {
                let t = v["scheduled_time"].as_str().unwrap().to_string();
                *fired_events.entry(t).or_insert(0) += 1;
            }
        }
    }
    assert!(fired_events.len() >= 9, "{fired_events:?}");
    assert!(fired_events.values().all(|n| *n == 1), "{fired_events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replace_never_overlaps_even_when_the_leader_dies_right_after_a_fire() {
    let c = Cluster::start(worker_opts(2, &[]));
    c.wait_workers(&["w1", "w2"]).await;
    let out = scratch(&c);
    let (leader, l) = c.leader_index().await;
    create(
        &c,
        "rep",
        def(
            "*/3 * * * * *",
            OverlapPolicy::OverlapReplace,
            ledgered(&out, 10.0),
        ),
    )
    .await;
    let all = c.all_indices();
    wait_fired(&c, &all, "rep", 2, Duration::from_secs(30)).await;
    // Right after a fire that replaced a live run: the new job waits for the old one's end.
    let mut c = c;
    c.replicas[leader].sigkill();
    let others = c.others(leader);
    let (_, _) = c.wait_new_leader(&others, l.term).await;
    let fired = get(&c, &others, "rep").await.counts["fired"];
    wait_fired(&c, &others, "rep", fired + 2, Duration::from_secs(40)).await;
    let s = quiesce(&c, &others, "rep").await;
    check_one_job_per_tick("rep", &ledger(&out));
    let mut spans = spans(&out, baton::jobs::records::now_ms());
    spans.sort_by_key(|s| s.1);
    assert!(spans.len() >= 3, "{spans:?}");
    for w in spans.windows(2) {
        assert!(w[0].2 <= w[1].1, "runs overlap: {:?} and {:?}", w[0], w[1]);
    }
    assert!(s.counts["fired"] >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_operations_keep_their_promises() {
    let (c, out, all) = small_cluster(2).await;
    let mut cl = schedules(&c, 1).await;

    // A name deleted and created again starts from a fresh status.
    create(
        &c,
        "again",
        def(
            "* * * * * *",
            OverlapPolicy::OverlapAllow,
            ledgered(&out, 0.0),
        ),
    )
    .await;
    wait_fired(&c, &all, "again", 2, Duration::from_secs(30)).await;
    cl.delete_schedule(DeleteScheduleRequest {
        name: "again".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let status = cl
        .get_schedule(GetScheduleRequest {
            name: "again".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound);
    let fresh = create(
        &c,
        "again",
        def("@every 1h", OverlapPolicy::OverlapForbid, sh("true")),
    )
    .await;
    assert!(
        fresh.counts.is_empty() && fresh.recent.is_empty(),
        "{fresh:?}"
    );
    assert_ne!(fresh.create_revision, 0);

    // A create retried after a lost answer gets the schedule it made; a different definition
    // under the name is refused and changes nothing.
    let retried = create(
        &c,
        "again",
        def("@every 1h", OverlapPolicy::OverlapForbid, sh("true")),
    )
    .await;
    assert_eq!(
        (retried.create_revision, retried.revision),
        (fresh.create_revision, fresh.revision)
    );
    let other = cl
        .create_schedule(CreateScheduleRequest {
            name: "again".into(),
            definition: Some(def("@every 2h", OverlapPolicy::OverlapForbid, sh("true"))),
        })
        .await
        .unwrap_err();
    assert_eq!(other.code(), tonic::Code::AlreadyExists, "{other:?}");
    assert_eq!(get(&c, &all, "again").await.revision, fresh.revision);

    // An update that would put a tick in the past fires nothing early.
    let slow = create(
        &c,
        "slow",
        def(
            "0 0 1 1 *",
            OverlapPolicy::OverlapForbid,
            ledgered(&out, 0.0),
        ),
    )
    .await;
    let updated = cl
        .update_schedule(UpdateScheduleRequest {
            name: "slow".into(),
            fields: vec!["cron".into()],
            definition: Some(ScheduleDefinition {
                cron: "*/20 * * * * *".into(),
                ..Default::default()
            }),
            if_revision: slow.revision,
        })
        .await
        .unwrap()
        .into_inner();
    // The revision it read is gone: a second update with it is refused.
    let stale = cl
        .update_schedule(UpdateScheduleRequest {
            name: "slow".into(),
            fields: vec!["tz".into()],
            definition: Some(ScheduleDefinition::default()),
            if_revision: slow.revision,
        })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), tonic::Code::FailedPrecondition, "{stale}");
    // Its next tick is up to 20 s away.
    wait_fired(&c, &all, "slow", 1, Duration::from_secs(60)).await;
    let s = get(&c, &all, "slow").await;
    let first = s.recent.iter().find(|r| r.outcome == "fired").unwrap();
    let t = parse_rfc3339("t", &first.scheduled_time).unwrap();
    assert!(
        t > updated.updated_unix_ms as u64,
        "{first:?} fired before the update"
    );

    // Pause: ticks are recorded paused and never run later; resume fires from then on.
    cl.pause_schedule(PauseScheduleRequest {
        name: "again".into(),
        reason: "maintenance".into(),
        if_revision: 0,
    })
    .await
    .unwrap();
    let p = create(
        &c,
        "pz",
        def(
            "* * * * * *",
            OverlapPolicy::OverlapAllow,
            ledgered(&out, 0.0),
        ),
    )
    .await;
    let _ = p;
    wait_fired(&c, &all, "pz", 1, Duration::from_secs(30)).await;
    cl.pause_schedule(PauseScheduleRequest {
        name: "pz".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    // Time passes with a leader at work: a witness fires three times meanwhile.
    create(
        &c,
        "witness",
        def("* * * * * *", OverlapPolicy::OverlapAllow, sh("true")),
    )
    .await;
    wait_fired(&c, &all, "witness", 3, Duration::from_secs(30)).await;
    let paused_at = get(&c, &all, "pz").await;
    let fired_before = paused_at.counts["fired"];
    let resumed = cl
        .resume_schedule(ResumeScheduleRequest {
            name: "pz".into(),
            if_revision: 0,
        })
        .await
        .unwrap()
        .into_inner();
    wait_fired(&c, &all, "pz", fired_before + 2, Duration::from_secs(30)).await;
    let s = get(&c, &all, "pz").await;
    assert!(
        s.counts["paused"] >= 2,
        "the paused ticks are counted: {:?}",
        s.counts
    );
    check_accounted(&s, "* * * * * *");
    for r in s.recent.iter().filter(|r| r.outcome == "fired") {
        let t = parse_rfc3339("t", &r.scheduled_time).unwrap();
        let in_pause = t > parse_rfc3339("w", &paused_at.watermark).unwrap()
            && t <= resumed.updated_unix_ms as u64;
        assert!(!in_pause, "a tick of the pause ran: {r:?}");
    }

    // Trigger: one run now, an id no tick can take, and the job's environment names it.
    let t = cl
        .trigger_schedule(TriggerScheduleRequest {
            name: "slow".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        t.job_id.starts_with("slow-") && t.job_id.contains('.'),
        "{t:?}"
    );
    c.wait_job(
        &all,
        &t.job_id,
        Duration::from_secs(30),
        "finished",
        terminal,
    )
    .await;
    assert!(
        ledger(&out)
            .iter()
            .any(|(s, _, id, _)| s == "slow" && id == &t.job_id),
        "the trigger ran"
    );

    // Backfill over a range that partly ran runs only the rest.
    let s = quiesce(&c, &all, "pz").await;
    let before = ledger(&out);
    let ran: BTreeSet<String> = before
        .iter()
        .filter(|r| r.0 == "pz")
        .map(|r| r.2.clone())
        .collect();
    let from = s.created_unix_ms as u64 - 3000;
    let to = parse_rfc3339("w", &s.watermark).unwrap();
    let n = cl
        .backfill_schedule(BackfillScheduleRequest {
            name: "pz".into(),
            from: rfc3339(from - from % 1000),
            to: rfc3339(to),
            force: false,
        })
        .await
        .unwrap()
        .into_inner()
        .ticks;
    let timing = Timing::new("* * * * * *", "UTC", 0).unwrap();
    let (all_ticks, _) = timing.ticks(from - from % 1000, to, 10_000);
    assert_eq!(n as usize, all_ticks.len());
    for t in &all_ticks {
        let id = tick_id("pz", *t);
        c.wait_job(&all, &id, Duration::from_secs(60), "terminal", terminal)
            .await;
    }
    let runs = ledger(&out);
    check_one_job_per_tick(
        "pz",
        &runs
            .iter()
            .filter(|r| r.0 == "pz")
            .cloned()
            .collect::<Vec<_>>(),
    );
    for id in &ran {
        let n = runs.iter().filter(|r| &r.2 == id).count();
        assert_eq!(n, 1, "{id} ran again in the backfill");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daylight_saving_gap_fires_a_fixed_hour_once_at_its_end() {
    // The schedule clock just before Berlin's 2026 spring-forward (01:00Z: 02:00 CET becomes
    // 03:00 CEST): `30 2 * * *` has no 02:30 that night and fires at 03:00 CEST.
    let target = parse_rfc3339("t", "2026-03-29T00:59:25Z").unwrap() as i64;
    let offset = target - baton::jobs::records::now_ms() as i64;
    let c = Cluster::start(Options {
        replicas: 2,
        extra_args: vec!["--test-clock-offset-ms".into(), offset.to_string()],
        ..Options::default()
    });
    let out = scratch(&c);
    let all = c.all_indices();
    c.leader_index().await;
    let mut d = def(
        "30 2 * * *",
        OverlapPolicy::OverlapForbid,
        ledgered(&out, 0.0),
    );
    d.tz = "Europe/Berlin".into();
    let s = create(&c, "dst", d.clone()).await;
    assert_eq!(s.next_fire_times[0], "2026-03-29T01:00:00Z", "{s:?}");
    assert_eq!(s.next_fire_times[1], "2026-03-30T00:30:00Z", "{s:?}");
    let mut hourly = def(
        "0 */30 * * * *",
        OverlapPolicy::OverlapAllow,
        ledgered(&out, 0.0),
    );
    hourly.tz = "Europe/Berlin".into();
    create(&c, "half-hourly", hourly).await;
    wait_fired(&c, &all, "dst", 1, Duration::from_secs(90)).await;
    let id = "dst-20260329T010000Z";
    c.wait_job(&all, id, Duration::from_secs(30), "finished", terminal)
        .await;
    let runs = ledger(&out);
    assert!(
        runs.iter()
            .any(|r| r.2 == id && r.1 == "2026-03-29T01:00:00Z"),
        "{runs:?}"
    );
    wait_fired(&c, &all, "half-hourly", 1, Duration::from_secs(20)).await;
    let h = get(&c, &all, "half-hourly").await;
    assert_eq!(h.recent[0].scheduled_time, "2026-03-29T01:00:00Z", "{h:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watermark_ahead_of_the_clock_is_kept_and_recorded_as_clock_skew() {
    let (c, out, all) = small_cluster(2).await;
    let s = create(
        &c,
        "skew",
        def(
            "* * * * * *",
            OverlapPolicy::OverlapAllow,
            ledgered(&out, 0.0),
        ),
    )
    .await;
    wait_fired(&c, &all, "skew", 1, Duration::from_secs(30)).await;
    // Another leader's clock ran an hour ahead: its watermark is there.
    let ahead = baton::jobs::records::now_ms() + 3_600_000;
    let mut etcd = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    let key = format!("/baton/{}/schedule-status/skew", c.cluster);
    let status = serde_json::json!({
        "version": 1, "schedule_rev": s.create_revision, "watermark_ms": ahead,
        "live": [], "counts": {"fired": 1}, "recent": [], "last_trigger_ms": 0,
    });
    etcd.put(key, status.to_string(), None).await.unwrap();
    let noted = wait_for(
        "clock-skew to be noted",
        Duration::from_secs(30),
        || async {
            let s = get(&c, &all, "skew").await;
            s.recent
                .iter()
                .any(|r| r.outcome == "clock-skew" && r.ticks > 3000)
                .then_some(s)
        },
    )
    .await;
    // The ticks it skips were decided by the leader whose clock ran ahead: not counted again.
    assert_eq!(noted.counts.get("clock-skew"), None, "{:?}", noted.counts);
    let before = ledger(&out).iter().filter(|r| r.0 == "skew").count();
    // Time passes with a leader at work: a second schedule fires three times meanwhile.
    create(
        &c,
        "witness",
        def("* * * * * *", OverlapPolicy::OverlapAllow, sh("true")),
    )
    .await;
    wait_fired(&c, &all, "witness", 3, Duration::from_secs(30)).await;
    let s = get(&c, &all, "skew").await;
    assert_eq!(
        s.counts["fired"], 1,
        "nothing fires below the kept watermark: {s:?}"
    );
    assert_eq!(parse_rfc3339("w", &s.watermark).unwrap(), ahead);
    assert_eq!(
        ledger(&out).iter().filter(|r| r.0 == "skew").count(),
        before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_naming_the_field_and_writes_nothing() {
    let c = Cluster::start(Options {
        replicas: 1,
        ..Options::default()
    });
    c.leader_index().await;
    let mut cl = schedules(&c, 0).await;
    let long = "n".repeat(97);
    let cases: Vec<(&str, ScheduleDefinition, &str)> = vec![
        (
            "bad-cron",
            def("61 * * * *", OverlapPolicy::OverlapForbid, sh("true")),
            "cron",
        ),
        (
            "bad-every",
            def("@every 100ms", OverlapPolicy::OverlapForbid, sh("true")),
            "cron",
        ),
        (
            "bad-tz",
            ScheduleDefinition {
                tz: "Mars/Olympus".into(),
                ..def("@hourly", OverlapPolicy::OverlapForbid, sh("true"))
            },
            "tz",
        ),
        (
            "bad-all",
            ScheduleDefinition {
                catchup: CatchupPolicy::CatchupAll as i32,
                ..def("@hourly", OverlapPolicy::OverlapForbid, sh("true"))
            },
            "catchup",
        ),
        (
            "bad-window",
            ScheduleDefinition {
                catchup_window: Some(pbjson_types::Duration {
                    seconds: 30 * 24 * 3600,
                    nanos: 0,
                }),
                ..def("@hourly", OverlapPolicy::OverlapForbid, sh("true"))
            },
            "catchup_window",
        ),
        (
            "bad-spec",
            def("@hourly", OverlapPolicy::OverlapForbid, JobSpec::default()),
            "spec.command",
        ),
        (
            &long,
            def("@hourly", OverlapPolicy::OverlapForbid, sh("true")),
            "name",
        ),
    ];
    for (name, d, field) in cases {
        let e = cl
            .create_schedule(CreateScheduleRequest {
                name: name.into(),
                definition: Some(d),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}: {e}");
        assert!(e.message().contains(field), "{name}: {e}");
    }
    let mut etcd = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    let prefix = format!("/baton/{}/schedules/", c.cluster);
    let n = etcd
        .get(
            prefix,
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        )
        .await
        .unwrap()
        .count();
    assert_eq!(n, 0, "nothing was written");
    // Submissions may not take a tick's id.
    let e = c
        .jobs(0)
        .await
        .submit_job(SubmitJobRequest {
            job_id: "backup-20261205T203000Z".into(),
            spec: Some(sh("true")),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    let e = cl
        .get_schedule(GetScheduleRequest {
            name: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    // A corrupt definition is reported and skipped; the others still tick.
    etcd.put(
        format!("/baton/{}/schedules/broken", c.cluster),
        "{not json",
        None,
    )
    .await
    .unwrap();
    create(
        &c,
        "fine",
        def("* * * * * *", OverlapPolicy::OverlapAllow, sh("true")),
    )
    .await;
    wait_fired(&c, &[0], "fine", 2, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_manages_schedules_like_etcdctl() {
    let c = Cluster::start(Options {
        replicas: 1,
        ..Options::default()
    });
    c.leader_index().await;
    let ep = c.replicas[0].listen().to_string();
    let t = Duration::from_secs(30);
    let (code, out, err) = run_cli(
        &[
            "schedule",
            "create",
            "nightly",
            "--cron",
            "30 2 * * *",
            "--tz",
            "Europe/Berlin",
            "--endpoints",
            &ep,
            "--",
            "true",
        ],
        t,
    );
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("created schedule nightly"), "{out}");
    let (code, out, _) = run_cli(
        &[
            "schedule",
            "get",
            "nightly",
            "-o",
            "json",
            "--endpoints",
            &ep,
        ],
        t,
    );
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tz"], "Europe/Berlin");
    assert_eq!(v["next_fire_times"].as_array().unwrap().len(), 5);
    let (code, out, _) = run_cli(&["schedule", "list", "--endpoints", &ep], t);
    assert_eq!(code, Some(0));
    assert!(out.contains("nightly"), "{out}");
    let (code, _, err) = run_cli(
        &[
            "schedule",
            "create",
            "x",
            "--cron",
            "nope",
            "--endpoints",
            &ep,
            "--",
            "true",
        ],
        t,
    );
    assert_eq!(code, Some(1));
    assert!(err.contains("cron"), "{err}");
    let (code, out, err) = run_cli(
        &[
            "schedule",
            "trigger",
            "nightly",
            "--wait",
            "--endpoints",
            &ep,
        ],
        t,
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, out, _) = run_cli(
        &[
            "schedule",
            "pause",
            "nightly",
            "--reason",
            "freeze",
            "--endpoints",
            &ep,
        ],
        t,
    );
    assert_eq!(code, Some(0), "{out}");
    let (_, out, _) = run_cli(&["schedule", "get", "nightly", "--endpoints", &ep], t);
    assert!(out.contains("paused (freeze)"), "{out}");
    let (code, _, _) = run_cli(&["schedule", "delete", "nightly", "--endpoints", &ep], t);
    assert_eq!(code, Some(0));
    let (code, _, err) = run_cli(&["schedule", "get", "nightly", "--endpoints", &ep], t);
    assert_eq!(code, Some(1));
    assert!(err.contains("NotFound"), "{err}");
}
