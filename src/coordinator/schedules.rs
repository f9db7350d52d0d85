//! The leader's schedule task: one timer structure for every schedule of the cluster, ticks
//! decided and their jobs created in fenced transactions through the term's writer (so ticks
//! due at one instant share transactions).
//!
//! Guarantees (see [`crate::schedule`] for the two guards):
//! - A tick's job is created in the transaction that moves the schedule's watermark past it,
//!   compares the definition's revision and the status's, and creates the job only if no job,
//!   registry entry or result of its id exists.
//! - Overlap is decided from etcd: the status lists the schedule's live jobs; `forbid` fires
//!   only while each one the leader found ended is still absent from the registry, `replace`
//!   cancels those still there and makes the new job wait for their entries to go.
//! - Ticks follow the schedule clock, read again at least every second. A watermark more than
//!   a minute ahead of it is kept (nothing fires twice) and the skipped ticks recorded
//!   `clock-skew`.
//! - Every decided tick is a `baton::schedule` event and counted by outcome.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, TxnOpResponse, WatchOptions};
use tokio::task::JoinSet;
use tracing::Instrument;

use super::{Ctx, Writer};
use crate::election::{Commit, FenceError};
use crate::jobs::records;
use crate::metrics;
use crate::schedule::expr::{self, Timing};
use crate::schedule::fire::{self, Fire, Known, Plan};
use crate::schedule::record::{
    Catchup, Overlap, RequestKind, ScheduleRecord, ScheduleRequest, ScheduleStatus,
    REQUEST_VERSION, SCHEDULE_VERSION,
};
use crate::schedule::{clock, service, tick_id, trigger_id};
use crate::store::{codec, Keys, Write};

pub const EVENT_TARGET: &str = "baton::schedule";

/// A watermark this far ahead of the clock is a clock skew, not a fresh tick.
const SKEW_MS: u64 = 60_000;
/// Schedules decided at once; the rest wait for a place.
const STEPS_AT_ONCE: usize = 512;
/// Ticks of `--catchup all` run in one step at most (the rest in the next).
const CATCHUP_ALL_MAX: usize = 100;
/// Ticks counted in one go when a long outage is recorded (the rest in the next step).
const COUNT_MAX: u64 = 1_000_000;

/// One schedule as this term knows it.
#[derive(Clone)]
struct Sched {
    rec: ScheduleRecord,
    rev: i64,
    create: i64,
    /// The status of this definition (an empty one if etcd holds none, or a stale one).
    status: ScheduleStatus,
    /// The mod revision of the status key, whatever it holds (0: absent).
    status_rev: i64,
    /// Pending requests by key, with their mod revisions.
    requests: BTreeMap<String, (ScheduleRequest, i64)>,
}

/// Why a step stopped early.
enum Stop {
    Deposed,
    /// etcd failed; the step is tried again shortly.
    Retry,
}

/// What a step changed, for the loop to take in.
struct Done {
    name: String,
    create: i64,
    status: Option<(ScheduleStatus, i64)>,
    rec: Option<(ScheduleRecord, i64)>,
    /// Requests the step is done with, at the revision it last knew of each.
    handled: Vec<(String, i64)>,
    again_ms: Option<u64>,
    deposed: bool,
}

/// Runs the term's schedules until the term ends.
pub(super) async fn run(ctx: Arc<Ctx>, writer: Writer) {
    let term = writer.term().clone();
    let mut pause = crate::retry::policies::RESYNC.backoff();
    let mut sweeping: Option<tokio::task::JoinHandle<()>> = None;
    'resync: loop {
        let loaded = tokio::select! {
            r = load(&ctx) => r,
            _ = term.ended() => return,
        };
        let (mut scheds, rev, orphans) = match loaded {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the schedules; trying again");
                pause.pause().await;
                continue;
            }
        };
        recheck_windows(&ctx, &writer, &mut scheds).await;
        // Statuses and requests of schedules deleted while no leader was there.
        for name in orphans {
            let (writer, keys) = (writer.clone(), ctx.keys.clone());
            tokio::spawn(async move { forget(&writer, &keys, &name).await }.in_current_span());
        }
        let mut client = ctx.store.client();
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(rev + 1);
        let mut stream = match client.watch(ctx.keys.schedules(), Some(opts.clone())).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the schedules; resyncing");
                pause.pause().await;
                continue;
            }
        };
        if let Err(e) = stream.watch(ctx.keys.schedule_requests(), Some(opts)).await {
            tracing::warn!(error = %e, "cannot watch schedule requests; resyncing");
            pause.pause().await;
            continue;
        }
        pause.reset();
        let mut timers: BTreeSet<(u64, String)> = BTreeSet::new();
        let mut due_at: HashMap<String, u64> = HashMap::new();
        let now = clock::now_ms();
        for name in scheds.keys() {
            timers.insert((now, name.clone()));
            due_at.insert(name.clone(), now);
        }
        let mut steps: JoinSet<Done> = JoinSet::new();
        let mut busy: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut busy_names: BTreeSet<String> = BTreeSet::new();
        // Its first sweep a minute into the term: catch-up goes first.
        let mut sweep = tokio::time::interval_at(
            tokio::time::Instant::now() + Duration::from_secs(60),
            Duration::from_secs(60),
        );
        loop {
            // Start what is due, while there is room.
            let now = clock::now_ms();
            while steps.len() < STEPS_AT_ONCE {
                let Some((at, name)) = timers.first().cloned() else {
                    break;
                };
                if at > now {
                    break;
                }
                timers.pop_first();
                due_at.remove(&name);
                let Some(s) = scheds.get(&name) else { continue };
                if !busy_names.insert(name.clone()) {
                    // Its step in flight plans it again when it ends.
                    continue;
                }
                let (ctx, writer, s) = (ctx.clone(), writer.clone(), s.clone());
                let h = steps.spawn(async move { step(&ctx, &writer, s).await }.in_current_span());
                busy.insert(h.id(), name);
            }
            // The clock is read again at least every second: a step of it must not make a
            // tick wait for a long sleep.
            let next = timers.first().map(|(at, _)| *at).unwrap_or(u64::MAX);
            // With every place taken, a step's end (not a timer) frees the next one.
            let next = if steps.len() >= STEPS_AT_ONCE {
                now + 1000
            } else {
                next
            };
            let wait = Duration::from_millis(next.saturating_sub(now).min(1000));
            tokio::select! {
                biased;
                _ = term.ended() => break 'resync,
                Some(done) = steps.join_next_with_id() => {
                    let (id, done) = match done {
                        Ok((id, done)) => (id, Some(done)),
                        Err(e) => (e.id(), None),
                    };
                    let Some(name) = busy.remove(&id) else { continue };
                    busy_names.remove(&name);
                    let Some(done) = done else {
                        tracing::error!(schedule = %name, "a schedule step failed; looking again in a second");
                        plan(&mut timers, &mut due_at, name, clock::now_ms() + 1000);
                        continue;
                    };
                    if done.deposed {
                        break 'resync;
                    }
                    if let Some(at) = take(&mut scheds, done) {
                        plan(&mut timers, &mut due_at, at.0, at.1);
                    }
                }
                msg = stream.message() => match msg {
                    Ok(Some(resp)) => {
                        if resp.canceled() || resp.compact_revision() > 0 {
                            tracing::warn!("schedule watch cancelled; resyncing");
                            steps.abort_all();
                            continue 'resync;
                        }
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            if let Some(name) = event(&ctx, &writer, &mut scheds, ev.event_type(), kv) {
                                plan(&mut timers, &mut due_at, name, clock::now_ms());
                            }
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::warn!("schedule watch ended; resyncing");
                        steps.abort_all();
                        continue 'resync;
                    }
                },
                _ = sweep.tick() => {
                    // One sweep at a time, beside the ticks.
                    if sweeping.as_ref().is_none_or(|h| h.is_finished()) {
                        let (ctx, writer) = (ctx.clone(), writer.clone());
                        let kept: Vec<(String, u32)> = scheds
                            .values()
                            .map(|s| (s.rec.name.clone(), s.rec.keep_results))
                            .collect();
                        sweeping = Some(tokio::spawn(
                            async move { keep_results(&ctx, &writer, &kept).await }.in_current_span(),
                        ));
                    }
                }
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
    if let Some(h) = sweeping {
        h.abort();
    }
}

/// Sets `name`'s timer to `at` (earlier wins over a later one already set).
fn plan(
    timers: &mut BTreeSet<(u64, String)>,
    due_at: &mut HashMap<String, u64>,
    name: String,
    at: u64,
) {
    if let Some(old) = due_at.get(&name).copied() {
        if old <= at {
            return;
        }
        timers.remove(&(old, name.clone()));
    }
    timers.insert((at, name.clone()));
    due_at.insert(name, at);
}

/// Takes a step's changes in; returns when the schedule is due next.
fn take(scheds: &mut BTreeMap<String, Sched>, done: Done) -> Option<(String, u64)> {
    let s = scheds.get_mut(&done.name)?;
    if s.create != done.create {
        // Deleted and created again meanwhile: the new one is planned already.
        return Some((done.name, clock::now_ms()));
    }
    // One step per schedule at a time, and only steps write the status: the step's is the
    // newest.
    if let Some((status, rev)) = done.status {
        s.status = status;
        s.status_rev = rev;
    }
    if let Some((rec, rev)) = done.rec {
        if rev > s.rev {
            s.rec = rec;
            s.rev = rev;
        }
    }
    // A request changed since (a newer progress, or a new request under the same key) stays.
    for (k, rev) in &done.handled {
        if s.requests.get(k).is_some_and(|(_, r)| r <= rev) {
            s.requests.remove(k);
        }
    }
    let at = done.again_ms.or_else(|| next_due(s)).unwrap_or(u64::MAX);
    (at != u64::MAX).then_some((done.name, at))
}

/// When schedule `s` has something to do next. A paused one has nothing: its resume counts
/// the ticks it slept through.
fn next_due(s: &Sched) -> Option<u64> {
    if !s.requests.is_empty() {
        return Some(clock::now_ms());
    }
    if s.rec.paused {
        return None;
    }
    let timing = Timing::new(&s.rec.cron, &s.rec.tz, s.rec.anchor_ms).ok()?;
    let from = s.status.watermark_ms.max(s.rec.floor_ms);
    timing.next_after(from)
}

/// A key-value of etcd's answer, by position.
fn kv_at(resp: &etcd_client::TxnResponse, i: usize) -> Option<etcd_client::KeyValue> {
    match resp.op_responses().into_iter().nth(i)? {
        TxnOpResponse::Get(g) => g.kvs().first().cloned(),
        _ => None,
    }
}

/// Every definition, status and request, read at one revision.
async fn load(
    ctx: &Ctx,
) -> Result<(BTreeMap<String, Sched>, i64, BTreeSet<String>), crate::jobs::Error> {
    let keys = &ctx.keys;
    let mut all: Vec<Vec<etcd_client::KeyValue>> = Vec::new();
    let mut rev = 0;
    for prefix in [
        keys.schedules(),
        keys.schedule_statuses(),
        keys.schedule_requests(),
    ] {
        let mut kvs = Vec::new();
        let mut after = String::new();
        loop {
            let (page, r) = crate::jobs::page_ids(&ctx.store, &prefix, &after, 500, rev).await?;
            rev = r;
            let full = page.len() == 500;
            if let Some(id) = page.last().and_then(|kv| Keys::id_in(&prefix, kv.key())) {
                after = id.to_string();
            }
            kvs.extend(page);
            if !full {
                break;
            }
        }
        all.push(kvs);
    }
    let requests = all.pop().unwrap_or_default();
    let statuses = all.pop().unwrap_or_default();
    let defs = all.pop().unwrap_or_default();
    let mut scheds = BTreeMap::new();
    for kv in &defs {
        if let Some(s) = sched_of(keys, kv) {
            scheds.insert(s.rec.name.clone(), s);
        }
    }
    let mut orphans = BTreeSet::new();
    let defined: BTreeSet<String> = defs
        .iter()
        .filter_map(|kv| Keys::id_in(&keys.schedules(), kv.key()).map(str::to_string))
        .collect();
    for kv in &statuses {
        let Some(name) = Keys::id_in(&keys.schedule_statuses(), kv.key()) else {
            continue;
        };
        if let Some(s) = scheds.get_mut(name) {
            s.status = service::fresh_status(Some(kv), s.create);
            s.status_rev = kv.mod_revision();
        } else if !defined.contains(name) {
            orphans.insert(name.to_string());
        }
    }
    for kv in &requests {
        if request_event(keys, &mut scheds, false, kv).is_none() {
            let name = Keys::id_in(&keys.schedule_requests(), kv.key())
                .and_then(|r| r.split_once('/'))
                .map(|(n, _)| n.to_string());
            if let Some(n) = name.filter(|n| !defined.contains(n)) {
                orphans.insert(n);
            }
        }
    }
    Ok((scheds, rev, orphans))
}

/// A definition as a watch or a page shows it; `None` if it does not decode (reported).
fn sched_of(keys: &Keys, kv: &etcd_client::KeyValue) -> Option<Sched> {
    let name = Keys::id_in(&keys.schedules(), kv.key())?;
    let rec: ScheduleRecord = codec::decode(kv.key(), kv.value(), SCHEDULE_VERSION).ok()?;
    if rec.name != name || Timing::new(&rec.cron, &rec.tz, rec.anchor_ms).is_err() {
        tracing::error!(
            schedule = name,
            "a schedule definition does not hold; skipping it"
        );
        codec::note_corrupt();
        return None;
    }
    Some(Sched {
        rec,
        rev: kv.mod_revision(),
        create: kv.create_revision(),
        status: ScheduleStatus::new(kv.create_revision()),
        status_rev: 0,
        requests: BTreeMap::new(),
    })
}

fn request_event(
    keys: &Keys,
    scheds: &mut BTreeMap<String, Sched>,
    deleted: bool,
    kv: &etcd_client::KeyValue,
) -> Option<String> {
    let rest = Keys::id_in(&keys.schedule_requests(), kv.key())?;
    let (name, _) = rest.split_once('/')?;
    let s = scheds.get_mut(name)?;
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    if deleted {
        s.requests.remove(&key);
        return None;
    }
    let req: ScheduleRequest = codec::decode(kv.key(), kv.value(), REQUEST_VERSION).ok()?;
    s.requests.insert(key, (req, kv.mod_revision()));
    Some(name.to_string())
}

/// Takes a watch event in; returns the schedule to look at now, if any.
fn event(
    ctx: &Ctx,
    writer: &Writer,
    scheds: &mut BTreeMap<String, Sched>,
    kind: EventType,
    kv: &etcd_client::KeyValue,
) -> Option<String> {
    let keys = &ctx.keys;
    let deleted = kind == EventType::Delete;
    if Keys::id_in(&keys.schedule_requests(), kv.key()).is_some() {
        return request_event(keys, scheds, deleted, kv);
    }
    let name = Keys::id_in(&keys.schedules(), kv.key())?.to_string();
    if deleted {
        let gone = scheds.remove(&name);
        let (w, k, n) = (writer.clone(), keys.clone(), name.clone());
        tokio::spawn(async move { forget(&w, &k, &n).await }.in_current_span());
        tracing::info!(schedule = %name, had_status = gone.is_some(), "schedule deleted");
        return None;
    }
    let Some(mut fresh) = sched_of(keys, kv) else {
        scheds.remove(&name);
        return None;
    };
    if let Some(old) = scheds.remove(&name) {
        fresh.status_rev = old.status_rev;
        fresh.requests = old.requests;
        if old.create == fresh.create {
            fresh.status = old.status;
        }
    }
    fresh
        .requests
        .retain(|_, (r, _)| r.schedule_rev == fresh.create);
    scheds.insert(name.clone(), fresh);
    Some(name)
}

/// Removes a deleted schedule's status and requests, unless the name was created again.
async fn forget(writer: &Writer, keys: &Keys, name: &str) {
    let write = Write::new()
        .when_absent(keys.schedule(name))
        .delete(keys.schedule_status(name))
        .delete_prefix(format!("{}{name}/", keys.schedule_requests()));
    if let Err(e) = writer.commit(write).await {
        tracing::warn!(schedule = name, error = %e, "cannot remove a deleted schedule's status yet");
    }
}

/// A schedule whose catch-up window no longer fits the result retention of this leader is
/// paused, with the reason: a tick caught up after its result expired could run twice.
async fn recheck_windows(ctx: &Ctx, writer: &Writer, scheds: &mut BTreeMap<String, Sched>) {
    let retention = ctx.config.cleanup.retention;
    for s in scheds.values_mut() {
        if s.rec.paused || s.rec.catchup_window <= retention {
            continue;
        }
        let mut rec = s.rec.clone();
        rec.paused = true;
        rec.pause_reason = Some(format!(
            "its catch-up window ({}) is longer than the leader's result retention ({})",
            humantime::format_duration(rec.catchup_window),
            humantime::format_duration(retention)
        ));
        let key = ctx.keys.schedule(&rec.name);
        let write = Write::new()
            .when_modified(key.clone(), s.rev)
            .put(key, codec::encode(&rec));
        if let Ok(Commit::Applied { revision, .. }) = writer.commit(write).await {
            tracing::warn!(schedule = %rec.name, reason = rec.pause_reason.as_deref().unwrap_or(""), "schedule paused");
            s.rec = rec;
            s.rev = revision;
        }
    }
}

/// One look at schedule `s`: its requests, then its due ticks.
async fn step(ctx: &Ctx, writer: &Writer, mut s: Sched) -> Done {
    let mut done = Done {
        name: s.rec.name.clone(),
        create: s.create,
        status: None,
        rec: None,
        handled: Vec::new(),
        again_ms: None,
        deposed: false,
    };
    let before = (s.rev, s.status_rev);
    let r = async {
        requests(ctx, writer, &mut s, &mut done.handled).await?;
        ticks(ctx, writer, &mut s).await
    }
    .await;
    let changed = s.rev != before.0 || s.status_rev != before.1 || !done.handled.is_empty();
    match r {
        // Again at once only if the step learned something: a definition that went or was
        // replaced waits for its watch event, not in a loop of writes.
        Ok(again) => {
            done.again_ms = again.then(|| clock::now_ms() + if changed { 0 } else { 1000 })
        }
        Err(Stop::Deposed) => done.deposed = true,
        Err(Stop::Retry) => done.again_ms = Some(clock::now_ms() + 1000),
    }
    if s.status_rev != before.1 {
        done.status = Some((s.status.clone(), s.status_rev));
    }
    if s.rev != before.0 {
        done.rec = Some((s.rec.clone(), s.rev));
    }
    done
}

/// What a fire did.
enum Fired {
    Created,
    Skipped,
    Conflict,
    /// The definition or the status changed under it (now taken in): decide again.
    Replan,
}

async fn requests(
    ctx: &Ctx,
    writer: &Writer,
    s: &mut Sched,
    handled: &mut Vec<(String, i64)>,
) -> Result<(), Stop> {
    let pending: Vec<(String, (ScheduleRequest, i64))> = s
        .requests
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (key, (req, rev)) in pending {
        if req.schedule_rev != s.create {
            let w = Write::new()
                .when_modified(key.clone(), rev)
                .delete(key.clone());
            commit(writer, w).await?;
            handled.push((key, rev));
            continue;
        }
        match req.kind {
            RequestKind::Trigger => {
                let t = req.requested_at_ms;
                let fire = Fire {
                    t,
                    id: trigger_id(&s.rec.name, t),
                    kind: "trigger",
                    overlap: Overlap::Allow,
                    pre: Vec::new(),
                    watermark: None,
                    request: Some((key.clone(), rev)),
                };
                match fire_one(ctx, writer, s, fire).await? {
                    Fired::Replan => return Ok(()),
                    _ => handled.push((key, rev)),
                }
            }
            RequestKind::Backfill { from_ms, to_ms, .. } => {
                let from = from_ms.max(req.progress_ms);
                let Some(last) = backfill(ctx, writer, s, (&key, rev, &req), from, to_ms).await?
                else {
                    // The request changed or went under it: the watch brings what it is now.
                    handled.push((key, rev));
                    continue;
                };
                let w = Write::new()
                    .when_modified(key.clone(), last)
                    .delete(key.clone());
                commit(writer, w).await?;
                handled.push((key, last));
            }
        }
    }
    Ok(())
}

/// Creates the jobs of the ticks in `(from, to]` whose ids are free (at most
/// [`service::BACKFILL_MAX`]); a tick whose job or result is there has already run. Each tick's
/// write also records the request's progress, so a new term resumes after it (results the
/// sweep removes meanwhile cannot make a tick run twice). Returns the request's revision after
/// the last write, or `None` if the request changed under it.
async fn backfill(
    ctx: &Ctx,
    writer: &Writer,
    s: &mut Sched,
    (key, mut rev, req): (&str, i64, &ScheduleRequest),
    from: u64,
    to: u64,
) -> Result<Option<i64>, Stop> {
    let Ok(timing) = Timing::new(&s.rec.cron, &s.rec.tz, s.rec.anchor_ms) else {
        return Ok(Some(rev));
    };
    let (ticks, _) = timing.ticks(from, to, service::BACKFILL_MAX as usize);
    let mut created = 0;
    for t in ticks {
        let id = tick_id(&s.rec.name, t);
        let progress = ScheduleRequest {
            progress_ms: t,
            ..req.clone()
        };
        let (job, _) = fire::job_write(
            &ctx.keys,
            &s.known(),
            &id,
            t,
            "backfill",
            Vec::new(),
            records::now_ms(),
        );
        let w = Write::new()
            .when_modified(key.to_string(), rev)
            .put(key.to_string(), codec::encode(&progress))
            .merge(job)
            .or_get(key.to_string());
        match writer.commit(w).await {
            Ok(Commit::Applied { revision, .. }) => {
                rev = revision;
                created += 1;
                emit(s, t, "fired", Some(&id), 1, "backfill");
            }
            Ok(Commit::Conflict(resp)) => {
                if kv_at(&resp, 0).map(|kv| kv.mod_revision()) != Some(rev) {
                    return Ok(None);
                }
                // Already run: only the progress moves.
                let w = Write::new()
                    .when_modified(key.to_string(), rev)
                    .put(key.to_string(), codec::encode(&progress));
                match writer.commit(w).await {
                    Ok(Commit::Applied { revision, .. }) => rev = revision,
                    Ok(Commit::Conflict(_)) => return Ok(None),
                    Err(FenceError::Deposed { .. }) => return Err(Stop::Deposed),
                    Err(FenceError::Store { .. }) => return Err(Stop::Retry),
                }
            }
            Err(FenceError::Deposed { .. }) => return Err(Stop::Deposed),
            Err(FenceError::Store { .. }) => return Err(Stop::Retry),
        }
    }
    tracing::info!(schedule = %s.rec.name, created, "backfill done");
    Ok(Some(rev))
}

/// Decides the due ticks of `s`. `Ok(true)`: look again at once.
async fn ticks(ctx: &Ctx, writer: &Writer, s: &mut Sched) -> Result<bool, Stop> {
    let Ok(timing) = Timing::new(&s.rec.cron, &s.rec.tz, s.rec.anchor_ms) else {
        return Ok(false);
    };
    if s.rec.paused {
        return Ok(false);
    }
    let now = clock::now_ms();
    let wm = s.status.watermark_ms;
    if wm > now + SKEW_MS {
        // Those ticks were decided (and counted) by the leader whose clock ran ahead: none
        // fires again; the skip is noted once, whichever term finds it.
        if s.status.skew_at != wm {
            let (_, n, _) = counted(&timing, now, wm).await;
            tracing::warn!(schedule = %s.rec.name, watermark = %expr::rfc3339(wm), now = %expr::rfc3339(now), skipped = n, "the schedule's watermark is ahead of this leader's clock: keeping it (no tick fires twice); check the replicas' NTP");
            metrics::get().schedule_clock_skews.inc();
            let mut st = status_with(s, &[], None);
            st.skew_at = wm;
            st.note(wm, "clock-skew", None, n, now);
            status_only(writer, &ctx.keys, s, st).await?;
        }
        return Ok(false);
    }
    let mut pre: Vec<(u64, &'static str, u64)> = Vec::new();
    let mut from = wm.max(s.rec.created_at_ms);
    // A resume or a change of timing moved the floor: the ticks below it are accounted for,
    // never fired.
    if s.rec.floor_ms > from {
        let outcome = if s.rec.resumed {
            "paused"
        } else {
            "superseded"
        };
        let (last, n, more) = counted(&timing, from, s.rec.floor_ms).await;
        match last {
            Some(last) if more => {
                let st = status_with(s, &[(last, outcome, n)], Some(last));
                status_only(writer, &ctx.keys, s, st).await?;
                return Ok(true);
            }
            Some(last) => pre.push((last, outcome, n)),
            None => {}
        }
        from = s.rec.floor_ms;
    }
    let window_start = now.saturating_sub(s.rec.catchup_window.as_millis() as u64);
    if window_start > from + 1 {
        let (last, n, more) = counted(&timing, from, window_start - 1).await;
        if let Some(last) = last {
            pre.push((last, "missed", n));
            if more {
                let top = pre.iter().map(|p| p.0).max();
                let st = status_with(s, &pre, top);
                status_only(writer, &ctx.keys, s, st).await?;
                return Ok(true);
            }
            from = last;
        }
    }
    let (run, more): (Vec<u64>, bool) = match s.rec.catchup {
        Catchup::Latest => match counted(&timing, from, now).await {
            (Some(latest), n, more) if more => {
                // Too many to count at once: these are superseded whatever comes next.
                pre.push((latest, "superseded", n));
                let top = pre.iter().map(|p| p.0).max();
                let st = status_with(s, &pre, top);
                status_only(writer, &ctx.keys, s, st).await?;
                return Ok(true);
            }
            (Some(latest), n, _) => {
                if n > 1 {
                    if let (Some(prev), _, _) = counted(&timing, from, latest - 1).await {
                        pre.push((prev, "superseded", n - 1));
                    }
                }
                (vec![latest], false)
            }
            (None, ..) => (Vec::new(), false),
        },
        Catchup::All => timing.ticks(from, now, CATCHUP_ALL_MAX),
    };
    if run.is_empty() {
        if pre.is_empty() {
            return Ok(false);
        }
        let top = pre.iter().map(|p| p.0).max();
        let st = status_with(s, &pre, top);
        return status_only(writer, &ctx.keys, s, st).await;
    }
    for (i, t) in run.iter().enumerate() {
        let fire = Fire {
            t: *t,
            id: tick_id(&s.rec.name, *t),
            kind: "tick",
            overlap: s.rec.overlap,
            pre: if i == 0 {
                std::mem::take(&mut pre)
            } else {
                Vec::new()
            },
            watermark: Some(*t),
            request: None,
        };
        if let Fired::Replan = fire_one(ctx, writer, s, fire).await? {
            return Ok(true);
        }
    }
    Ok(more)
}

/// [`Timing::last_and_count`] off the runtime's threads (a 1-second cron after a long outage
/// is many ticks), at most [`COUNT_MAX`] at once.
async fn counted(timing: &Timing, after: u64, until: u64) -> (Option<u64>, u64, bool) {
    let t = timing.clone();
    tokio::task::spawn_blocking(move || t.last_and_count(after, until, COUNT_MAX))
        .await
        .unwrap_or((None, 0, false))
}

/// Commits a write that needs no answer but success or failure.
async fn commit(writer: &Writer, w: Write) -> Result<bool, Stop> {
    match writer.commit(w).await {
        Ok(c) => Ok(c.applied()),
        Err(FenceError::Deposed { .. }) => Err(Stop::Deposed),
        Err(FenceError::Store { source, .. }) => {
            tracing::warn!(error = %source, "schedule write failed");
            Err(Stop::Retry)
        }
    }
}

/// Writes only a new status (outcomes without a job). `Ok(true)`: something changed under it.
async fn status_only(
    writer: &Writer,
    keys: &Keys,
    s: &mut Sched,
    st: ScheduleStatus,
) -> Result<bool, Stop> {
    let key = keys.schedule_status(&s.rec.name);
    let w = fire::guarded(keys, &s.known())
        .put(key.clone(), codec::encode(&st))
        .or_get(keys.schedule(&s.rec.name))
        .or_get(key);
    match writer.commit(w).await {
        Ok(Commit::Applied { revision, .. }) => {
            emit_new(s, &st);
            s.status = st;
            s.status_rev = revision;
            Ok(false)
        }
        Ok(Commit::Conflict(resp)) => {
            refresh(keys, s, &resp, 0, 1);
            Ok(true)
        }
        Err(FenceError::Deposed { .. }) => Err(Stop::Deposed),
        Err(FenceError::Store { source, .. }) => {
            tracing::warn!(schedule = %s.rec.name, error = %source, "cannot record a schedule's status");
            Err(Stop::Retry)
        }
    }
}

/// Takes in the definition and status a failed write read (answers `def_at`, `status_at`).
fn refresh(
    keys: &Keys,
    s: &mut Sched,
    resp: &etcd_client::TxnResponse,
    def_at: usize,
    status_at: usize,
) {
    match kv_at(resp, def_at) {
        Some(kv) if kv.create_revision() == s.create => {
            if let Some(fresh) = sched_of(keys, &kv) {
                s.rec = fresh.rec;
                s.rev = fresh.rev;
            }
        }
        // Deleted or created again: the watch tells the loop.
        _ => {}
    }
    match kv_at(resp, status_at) {
        Some(kv) => {
            s.status = service::fresh_status(Some(&kv), s.create);
            s.status_rev = kv.mod_revision();
        }
        None => {
            s.status = ScheduleStatus::new(s.create);
            s.status_rev = 0;
        }
    }
}

/// Events for the outcomes `st` records that `s`'s status did not.
fn emit_new(s: &Sched, st: &ScheduleStatus) {
    let old = &s.status.recent;
    for d in st.recent.iter().filter(|d| !old.contains(d)) {
        let kind = d.k.as_deref().unwrap_or("tick");
        emit(
            s,
            d.t,
            &d.o,
            d.job_id(&s.rec.name).as_deref(),
            d.n.max(1),
            kind,
        );
    }
}

/// The `baton::schedule` event and the counter of one decided outcome.
fn emit(s: &Sched, t: u64, outcome: &str, job: Option<&str>, n: u64, kind: &str) {
    metrics::get()
        .schedule_ticks
        .with_label_values(&[outcome])
        .inc_by(n);
    tracing::info!(
        target: EVENT_TARGET,
        event = "tick",
        schedule = %s.rec.name,
        schedule_rev = s.create,
        scheduled_time = %expr::rfc3339(t),
        scheduled_ms = t,
        outcome,
        job_id = job.unwrap_or(""),
        ticks = n,
        kind,
        decided_ms = clock::now_ms(),
        "schedule tick decided"
    );
}

/// Which of these jobs still have a registry entry (read through the leader's batched reads).
async fn alive(ctx: &Ctx, ids: &[String]) -> Result<Vec<String>, Stop> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    // Within etcd's operations per transaction (128 by default).
    for chunk in ids.chunks(100) {
        let w = chunk
            .iter()
            .fold(Write::new(), |w, id| w.get(ctx.keys.job(id).registry));
        match ctx.reads().commit(w).await {
            Ok(crate::store::group::Outcome::Applied { response, .. }) => out.extend(
                chunk
                    .iter()
                    .zip(response.op_responses())
                    .filter(|(_, r)| matches!(r, TxnOpResponse::Get(g) if !g.kvs().is_empty()))
                    .map(|(id, _)| id.clone()),
            ),
            _ => return Err(Stop::Retry),
        }
    }
    Ok(out)
}

/// Deletes the clean results of each schedule's ticks beyond its newest `keep_results`
/// (keys only: no value is read).
async fn keep_results(ctx: &Ctx, writer: &Writer, scheds: &[(String, u32)]) {
    for (name, keep) in scheds {
        let prefix = format!("{}{name}-", ctx.keys.clean());
        let mut found: Vec<(Vec<u8>, i64)> = Vec::new();
        let mut after = String::new();
        loop {
            let range = crate::jobs::Range::after(&prefix, &after);
            let Ok((page, _)) = crate::jobs::page(&ctx.store, range, 1000, 0, true).await else {
                return;
            };
            for kv in &page {
                let Some(rest) = Keys::id_in(&prefix, kv.key()) else {
                    continue;
                };
                after = rest.to_string();
                let id = format!("{name}-{rest}");
                if crate::schedule::is_reserved_id(&id)
                    && id.rsplit_once('-').map(|(n, _)| n) == Some(name.as_str())
                {
                    found.push((kv.key().to_vec(), kv.mod_revision()));
                }
            }
            if page.len() < 1000 {
                break;
            }
        }
        let keep = *keep as usize;
        if found.len() <= keep {
            continue;
        }
        let extra = found.len() - keep;
        for batch in found[..extra].chunks(50) {
            let w = batch
                .iter()
                .fold(Write::new(), |w, (k, rev)| w.when_modified(k.clone(), *rev));
            let w = batch.iter().fold(w, |w, (k, _)| w.delete(k.clone()));
            if writer.commit(w).await.is_err() {
                return;
            }
        }
        tracing::info!(schedule = %name, deleted = extra, keep, "removed tick results beyond --keep-results");
    }
}

/// Fires one tick (or trigger) of `s` under its overlap policy, in one fenced write with the
/// status (see [`fire::plan`]).
async fn fire_one(ctx: &Ctx, writer: &Writer, s: &mut Sched, f: Fire) -> Result<Fired, Stop> {
    let keys = &ctx.keys;
    let live_now = alive(ctx, &s.status.live).await?;
    let now = clock::now_ms();
    let (write, st, replaced) = match fire::plan(keys, &s.known(), &f, &live_now, now) {
        Plan::Skip { write, status } => {
            return match writer.commit(write).await {
                Ok(Commit::Applied { revision, .. }) => {
                    emit_new(s, &status);
                    s.status = status;
                    s.status_rev = revision;
                    Ok(Fired::Skipped)
                }
                Ok(Commit::Conflict(resp)) => {
                    refresh(keys, s, &resp, 0, 1);
                    Ok(Fired::Replan)
                }
                Err(FenceError::Deposed { .. }) => Err(Stop::Deposed),
                Err(FenceError::Store { .. }) => Err(Stop::Retry),
            };
        }
        Plan::Create {
            write,
            status,
            replaced,
        } => (write, status, replaced),
    };
    match writer.commit(write).await {
        Ok(Commit::Applied { revision, .. }) => {
            if f.kind == "tick" {
                let lag = clock::now_ms().saturating_sub(f.t);
                metrics::get()
                    .schedule_lag_seconds
                    .observe(lag as f64 / 1000.0);
            }
            for id in &replaced {
                tracing::info!(schedule = %s.rec.name, job_id = %id, replaced_by = %f.id, "cancelled a live run for the schedule's replace");
            }
            emit_new(s, &st);
            s.status = st;
            s.status_rev = revision;
            Ok(Fired::Created)
        }
        Ok(Commit::Conflict(resp)) => {
            let (rev, status_rev) = (s.rev, s.status_rev);
            refresh(keys, s, &resp, 0, 1);
            let taken = (2..6).any(|i| kv_at(&resp, i).is_some());
            if s.rev != rev || s.status_rev != status_rev || !taken {
                return Ok(Fired::Replan);
            }
            // The id is taken by a job this tick did not make: recorded, never run.
            let (w, st) = fire::conflict(keys, &s.known(), &f, now);
            tracing::warn!(schedule = %s.rec.name, job_id = %f.id, "the tick's job id is taken by another job; recorded as a conflict");
            match writer.commit(w).await {
                Ok(Commit::Applied { revision, .. }) => {
                    emit_new(s, &st);
                    s.status = st;
                    s.status_rev = revision;
                    Ok(Fired::Conflict)
                }
                Ok(Commit::Conflict(_)) => Ok(Fired::Replan),
                Err(FenceError::Deposed { .. }) => Err(Stop::Deposed),
                Err(FenceError::Store { .. }) => Err(Stop::Retry),
            }
        }
        Err(FenceError::Deposed { .. }) => Err(Stop::Deposed),
        Err(FenceError::Store { source, .. }) => {
            tracing::warn!(schedule = %s.rec.name, job_id = %f.id, error = %source, "cannot fire yet");
            Err(Stop::Retry)
        }
    }
}

impl Sched {
    fn known(&self) -> Known<'_> {
        Known {
            rec: &self.rec,
            rev: self.rev,
            create: self.create,
            status: &self.status,
            status_rev: self.status_rev,
        }
    }
}

/// [`fire::status_with`] at the schedule clock's now.
fn status_with(
    s: &Sched,
    outcomes: &[(u64, &'static str, u64)],
    watermark: Option<u64>,
) -> ScheduleStatus {
    fire::status_with(&s.known(), outcomes, watermark, clock::now_ms())
}
