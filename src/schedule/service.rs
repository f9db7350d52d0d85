//! What any replica does with schedules, for every interface (gRPC, CLI through gRPC, HTTP):
//! definitions created, changed, paused, resumed and deleted under the revision the caller
//! read, reads with the leader's status, and requests (trigger, backfill) for the leader.
//! None of this needs the leader.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{GetOptions, TxnOpResponse};

use super::expr::{self, Timing};
use super::record::{
    Catchup, Overlap, RequestKind, ScheduleRecord, ScheduleRequest, ScheduleStatus,
    REQUEST_VERSION, SCHEDULE_VERSION, STATUS_VERSION,
};
use super::{validate_name, Error};
use crate::jobs::records::{self, RegistryEntry, RegistryStatus};
use crate::jobs::spec::{Invalid, JobSpec};
use crate::jobs::{self, State};
use crate::store::{codec, Keys, Store, Write};

pub const DEFAULT_CATCHUP_WINDOW: Duration = Duration::from_secs(600);
pub const DEFAULT_KEEP_RESULTS: u32 = 1000;
pub const KEEP_RESULTS_MAX: u32 = 100_000;
/// Ticks one backfill request may ask for.
pub const BACKFILL_MAX: u64 = 1000;
/// Schedules one list answers with at most.
pub const LIST_MAX: usize = 10_000;

/// What the leader of this cluster keeps, for checks of a definition.
#[derive(Clone, Copy, Debug)]
pub struct Retention {
    /// How long clean results are kept (`--result-retention`).
    pub results: Duration,
}

/// A schedule's definition as a caller gives it (0 or empty: the default).
#[derive(Clone, Debug)]
pub struct Definition {
    pub spec: JobSpec,
    pub cron: String,
    pub tz: String,
    pub overlap: Overlap,
    pub catchup: Catchup,
    pub catchup_window: Duration,
    pub keep_results: u32,
}

/// A change of some fields of a definition.
#[derive(Clone, Debug, Default)]
pub struct Changes {
    pub spec: Option<JobSpec>,
    pub cron: Option<String>,
    pub tz: Option<String>,
    pub overlap: Option<Overlap>,
    pub catchup: Option<Catchup>,
    pub catchup_window: Option<Duration>,
    pub keep_results: Option<u32>,
}

/// A schedule as read: its definition, the leader's status (if it is about this definition),
/// its next fire times and the state of the jobs its recent outcomes name.
#[derive(Clone, Debug)]
pub struct View {
    pub record: ScheduleRecord,
    /// The definition's mod revision: pass it back as `if_revision`.
    pub revision: i64,
    pub create_revision: i64,
    pub status: ScheduleStatus,
    pub next: Vec<u64>,
    pub jobs: BTreeMap<String, State>,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Invalid {
    Invalid {
        field,
        reason: reason.into(),
    }
}

/// Checks a whole definition (after defaults), as stored.
fn check(r: &ScheduleRecord, retention: Retention) -> Result<(), Invalid> {
    validate_name(&r.name)?;
    Timing::new(&r.cron, &r.tz, r.anchor_ms)?;
    if r.catchup == Catchup::All && r.overlap != Overlap::Allow {
        return Err(invalid(
            "catchup",
            format!(
                "all runs every missed tick in order, which overlap {} cannot promise; use --overlap allow or --catchup latest",
                r.overlap.as_str()
            ),
        ));
    }
    if r.catchup_window < Duration::from_secs(1) {
        return Err(invalid("catchup_window", "must be at least 1s"));
    }
    if r.catchup_window > retention.results {
        return Err(invalid(
            "catchup_window",
            format!(
                "{} is longer than the result retention ({}): a tick caught up that late could run twice",
                humantime::format_duration(r.catchup_window),
                humantime::format_duration(retention.results)
            ),
        ));
    }
    if r.keep_results == 0 || r.keep_results > KEEP_RESULTS_MAX {
        return Err(invalid(
            "keep_results",
            format!("must be 1 to {KEEP_RESULTS_MAX}"),
        ));
    }
    Ok(())
}

fn default_window(d: Duration) -> Duration {
    if d.is_zero() {
        DEFAULT_CATCHUP_WINDOW
    } else {
        d
    }
}

fn default_keep(n: u32) -> u32 {
    if n == 0 {
        DEFAULT_KEEP_RESULTS
    } else {
        n
    }
}

/// The `@every` period of an expression, if it is one.
fn every(cron: &str) -> Option<Duration> {
    match expr::Expr::parse(cron) {
        Ok(expr::Expr::Every(d)) => Some(d),
        _ => None,
    }
}

/// Whole seconds: `@every` ticks then never share a second, so their ids differ.
fn anchor(now_ms: u64) -> u64 {
    now_ms - now_ms % 1000
}

/// Creates schedule `name`. A create repeated with the same definition (a client retrying after
/// a lost answer) is answered with the schedule as it stands; `ALREADY_EXISTS` if the name holds
/// a different one.
pub async fn create(
    store: &Store,
    keys: &Keys,
    name: &str,
    def: Definition,
    by: &str,
    retention: Retention,
) -> Result<View, Error> {
    validate_name(name)?;
    let now = super::clock::now_ms();
    let record = ScheduleRecord {
        tz: if def.tz.is_empty() {
            "UTC".into()
        } else {
            def.tz
        },
        catchup: def.catchup,
        catchup_window: default_window(def.catchup_window),
        keep_results: default_keep(def.keep_results),
        ..ScheduleRecord::new(name, def.spec, &def.cron, def.overlap, by, now)
    };
    check(&record, retention)?;
    let key = keys.schedule(name);
    let write = Write::new()
        .when_absent(key.clone())
        .put(key, codec::encode(&record));
    let mut c = store.client();
    let resp = store
        .timed("create schedule", c.txn(write.into_txn()))
        .await?;
    if !resp.succeeded() {
        let (existing, ..) = read(store, keys, name).await?;
        if !existing.same_definition(&record) {
            return Err(Error::AlreadyExists(name.to_string()));
        }
    }
    get(store, keys, name).await
}

/// The definition and its revisions, and the status if it is about this definition.
async fn read(
    store: &Store,
    keys: &Keys,
    name: &str,
) -> Result<(ScheduleRecord, i64, i64, ScheduleStatus), Error> {
    validate_name(name)?;
    let txn = Write::new()
        .get(keys.schedule(name))
        .get(keys.schedule_status(name))
        .into_txn();
    let mut c = store.client();
    let resp = store.timed("read schedule", c.txn(txn)).await?;
    let mut kvs = resp.op_responses().into_iter().map(|r| match r {
        TxnOpResponse::Get(g) => g.kvs().first().cloned(),
        _ => None,
    });
    let Some(kv) = kvs.next().flatten() else {
        return Err(Error::NotFound(name.to_string()));
    };
    let record: ScheduleRecord = codec::decode(kv.key(), kv.value(), SCHEDULE_VERSION)?;
    let status = fresh_status(kvs.next().flatten().as_ref(), kv.create_revision());
    Ok((record, kv.mod_revision(), kv.create_revision(), status))
}

/// The status a key holds if it is about the definition created at `create_rev`; else an
/// empty one (a stale or corrupt status is the leader's to replace).
pub fn fresh_status(kv: Option<&etcd_client::KeyValue>, create_rev: i64) -> ScheduleStatus {
    kv.and_then(|kv| {
        let s = codec::decode::<ScheduleStatus>(kv.key(), kv.value(), STATUS_VERSION).ok()?;
        if s.watermark_ms > expr::MAX_MS || s.skew_at > expr::MAX_MS {
            codec::note_corrupt();
            tracing::error!(key = %String::from_utf8_lossy(kv.key()), "a schedule status holds times out of range; replacing it");
            return None;
        }
        Some(s)
    })
    .filter(|s| s.schedule_rev == create_rev)
    .unwrap_or_else(|| ScheduleStatus::new(create_rev))
}

/// One schedule as it stands, with its next 5 fire times and its recent jobs' states.
pub async fn get(store: &Store, keys: &Keys, name: &str) -> Result<View, Error> {
    let (record, revision, create_revision, status) = read(store, keys, name).await?;
    let mut views = views(
        store,
        keys,
        vec![(record, revision, create_revision, status)],
    )
    .await?;
    Ok(views.remove(0))
}

/// The job ids a status's recent outcomes and live list name.
fn named_jobs(name: &str, s: &ScheduleStatus) -> Vec<String> {
    let mut ids: Vec<String> = s
        .recent
        .iter()
        .filter(|d| d.o == "fired")
        .filter_map(|d| d.job_id(name))
        .chain(s.live.iter().cloned())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// Completes read definitions with their next fire times and their jobs' states.
async fn views(
    store: &Store,
    keys: &Keys,
    found: Vec<(ScheduleRecord, i64, i64, ScheduleStatus)>,
) -> Result<Vec<View>, Error> {
    let now = super::clock::now_ms();
    let mut ids: Vec<String> = Vec::new();
    for (r, _, _, s) in &found {
        ids.extend(named_jobs(&r.name, s));
    }
    let states = job_states(store, keys, &ids).await?;
    Ok(found
        .into_iter()
        .map(|(record, revision, create_revision, status)| {
            let next = Timing::new(&record.cron, &record.tz, record.anchor_ms)
                .map(|t| {
                    let from = now.max(status.watermark_ms).max(record.floor_ms);
                    t.ticks(from, u64::MAX, 5).0
                })
                .unwrap_or_default();
            let jobs = named_jobs(&record.name, &status)
                .into_iter()
                .filter_map(|id| Some((id.clone(), *states.get(&id)?)))
                .collect();
            View {
                record,
                revision,
                create_revision,
                status,
                next,
                jobs,
            }
        })
        .collect())
}

/// The states of these jobs (those that exist), in transactions of at most 40 jobs.
async fn job_states(
    store: &Store,
    keys: &Keys,
    ids: &[String],
) -> Result<BTreeMap<String, State>, Error> {
    let mut out = BTreeMap::new();
    for chunk in ids.chunks(40) {
        let write = chunk.iter().fold(Write::new(), |w, id| {
            let k = keys.job(id);
            w.get(k.registry).get(k.dirty).get(k.clean)
        });
        let mut c = store.client();
        let resp = store.timed("read jobs", c.txn(write.into_txn())).await?;
        let answers: Vec<Option<etcd_client::KeyValue>> = resp
            .op_responses()
            .into_iter()
            .map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().cloned(),
                _ => None,
            })
            .collect();
        for (id, three) in chunk.iter().zip(answers.chunks(3)) {
            let result = three[1].as_ref().or(three[2].as_ref()).and_then(|kv| {
                codec::decode_any::<records::JobResult>(
                    kv.key(),
                    kv.value(),
                    records::RESULT_VERSIONS_READ,
                )
                .ok()
            });
            let state = match (result, &three[0]) {
                (Some(r), _) => Some(r.status.into()),
                (None, Some(kv)) => codec::decode_any::<RegistryEntry>(
                    kv.key(),
                    kv.value(),
                    records::REGISTRY_VERSIONS_READ,
                )
                .ok()
                .map(|e| match e.status {
                    RegistryStatus::Pending => State::Pending,
                    RegistryStatus::Running => State::Running,
                }),
                (None, None) => None,
            };
            if let Some(s) = state {
                out.insert(id.clone(), s);
            }
        }
    }
    Ok(out)
}

/// Every schedule (at most [`LIST_MAX`]), read at one revision, in name order.
pub async fn list(store: &Store, keys: &Keys) -> Result<Vec<View>, Error> {
    let mut defs = Vec::new();
    let (mut after, mut rev) = (String::new(), 0);
    loop {
        let (page, r) = jobs::page_ids(store, &keys.schedules(), &after, 500, rev).await?;
        rev = r;
        for kv in &page {
            match codec::decode::<ScheduleRecord>(kv.key(), kv.value(), SCHEDULE_VERSION) {
                Ok(rec) => defs.push((rec, kv.mod_revision(), kv.create_revision())),
                Err(_) => continue, // counted and logged; the others are still listed
            }
        }
        match page.last() {
            Some(kv) if page.len() == 500 && defs.len() < LIST_MAX => {
                after = Keys::id_in(&keys.schedules(), kv.key())
                    .unwrap_or_default()
                    .to_string();
            }
            _ => break,
        }
    }
    let opts = GetOptions::new().with_prefix().with_revision(rev);
    let mut c = store.client();
    let statuses = store
        .timed("list", c.get(keys.schedule_statuses(), Some(opts)))
        .await?;
    let by_name: BTreeMap<&str, &etcd_client::KeyValue> = statuses
        .kvs()
        .iter()
        .filter_map(|kv| Some((Keys::id_in(&keys.schedule_statuses(), kv.key())?, kv)))
        .collect();
    let found = defs
        .into_iter()
        .map(|(rec, rev, create)| {
            let status = fresh_status(by_name.get(rec.name.as_str()).copied(), create);
            (rec, rev, create, status)
        })
        .collect();
    views(store, keys, found).await
}

/// Why a write that compared revision `expected` failed: the schedule went, or changed.
async fn changed(store: &Store, keys: &Keys, name: &str, expected: i64) -> Error {
    match read(store, keys, name).await {
        Ok((_, actual, _, _)) => Error::Changed {
            name: name.to_string(),
            expected,
            actual,
        },
        Err(e) => e,
    }
}

/// Reads the definition, changes it with `f`, and writes it only if nobody changed it since
/// (or since `if_revision`, when not 0).
async fn modify(
    store: &Store,
    keys: &Keys,
    name: &str,
    if_revision: i64,
    f: impl FnOnce(&mut ScheduleRecord) -> Result<(), Invalid>,
) -> Result<View, Error> {
    let (mut record, rev, _, _) = read(store, keys, name).await?;
    if if_revision != 0 && if_revision != rev {
        return Err(Error::Changed {
            name: name.to_string(),
            expected: if_revision,
            actual: rev,
        });
    }
    f(&mut record)?;
    record.updated_at_ms = super::clock::now_ms();
    let key = keys.schedule(name);
    let write = Write::new()
        .when_modified(key.clone(), rev)
        .put(key, codec::encode(&record));
    let mut c = store.client();
    let resp = store
        .timed("update schedule", c.txn(write.into_txn()))
        .await?;
    if !resp.succeeded() {
        return Err(changed(store, keys, name, rev).await);
    }
    get(store, keys, name).await
}

/// Changes some fields. The floor moves to now: no tick of the past fires for the change.
pub async fn update(
    store: &Store,
    keys: &Keys,
    name: &str,
    changes: Changes,
    if_revision: i64,
    retention: Retention,
) -> Result<View, Error> {
    modify(store, keys, name, if_revision, |r| {
        let now = super::clock::now_ms();
        let old_every = every(&r.cron);
        let old_timing = (r.cron.clone(), r.tz.clone());
        if let Some(spec) = changes.spec {
            r.spec = spec;
        }
        if let Some(c) = changes.cron {
            r.cron = c.trim().to_string();
        }
        if let Some(tz) = changes.tz {
            r.tz = if tz.is_empty() { "UTC".into() } else { tz };
        }
        if let Some(o) = changes.overlap {
            r.overlap = o;
        }
        if let Some(c) = changes.catchup {
            r.catchup = c;
        }
        if let Some(w) = changes.catchup_window {
            r.catchup_window = default_window(w);
        }
        if let Some(n) = changes.keep_results {
            r.keep_results = default_keep(n);
        }
        if every(&r.cron) != old_every {
            r.anchor_ms = anchor(now);
        }
        // New timing starts now: ticks of the past, under either timing, never fire for it
        // (the leader counts those it had not decided as superseded).
        if (r.cron.clone(), r.tz.clone()) != old_timing {
            r.floor_ms = r.floor_ms.max(now);
            r.resumed = false;
        }
        check(r, retention)
    })
    .await
}

/// Pauses: ticks until the resume are recorded `paused` and never run later.
pub async fn pause(
    store: &Store,
    keys: &Keys,
    name: &str,
    reason: Option<String>,
    if_revision: i64,
) -> Result<View, Error> {
    if let Some(r) = &reason {
        if r.len() > 256 || r.contains('\0') {
            return Err(invalid("reason", "at most 256 bytes, without NUL").into());
        }
    }
    modify(store, keys, name, if_revision, |r| {
        r.paused = true;
        r.pause_reason = reason;
        Ok(())
    })
    .await
}

/// Resumes: the floor moves to now, so nothing of the paused time fires. A definition that
/// no longer fits the result retention (a leader paused it for that) stays paused.
pub async fn resume(
    store: &Store,
    keys: &Keys,
    name: &str,
    if_revision: i64,
    retention: Retention,
) -> Result<View, Error> {
    modify(store, keys, name, if_revision, |r| {
        if r.paused {
            r.floor_ms = r.floor_ms.max(super::clock::now_ms());
            r.resumed = true;
        }
        r.paused = false;
        r.pause_reason = None;
        check(r, retention)
    })
    .await
}

/// Deletes the definition (its running jobs go on unless `cancel_running`); returns the jobs
/// it asked to cancel. The status and requests are left for the leader to remove.
pub async fn delete(
    store: &Store,
    keys: &Keys,
    name: &str,
    if_revision: i64,
    cancel_running: bool,
    via: &str,
) -> Result<Vec<String>, Error> {
    let (_, rev, _, status) = read(store, keys, name).await?;
    if if_revision != 0 && if_revision != rev {
        return Err(Error::Changed {
            name: name.to_string(),
            expected: if_revision,
            actual: rev,
        });
    }
    let key = keys.schedule(name);
    let write = Write::new().when_modified(key.clone(), rev).delete(key);
    let mut c = store.client();
    let resp = store
        .timed("delete schedule", c.txn(write.into_txn()))
        .await?;
    if !resp.succeeded() {
        return Err(changed(store, keys, name, rev).await);
    }
    let mut cancelled = Vec::new();
    if cancel_running {
        for id in &status.live {
            match jobs::cancel(store, keys, id, via).await {
                Ok(_) => cancelled.push(id.clone()),
                Err(jobs::Error::NotFound(_) | jobs::Error::Terminal(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(cancelled)
}

/// Puts a request for the leader, under an id made from the time (one ms later on a clash).
async fn request(
    store: &Store,
    keys: &Keys,
    name: &str,
    kind: RequestKind,
    by: &str,
) -> Result<u64, Error> {
    let trigger = kind == RequestKind::Trigger;
    let (_, _, create_rev, _) = read(store, keys, name).await?;
    let first = super::clock::now_ms();
    for at in first..first + 100 {
        let req = ScheduleRequest {
            version: REQUEST_VERSION,
            kind: kind.clone(),
            schedule_rev: create_rev,
            requested_by: by.to_string(),
            requested_at_ms: at,
            progress_ms: 0,
        };
        let key = keys.schedule_request(name, &at.to_string());
        let mut write = Write::new()
            .when_created(keys.schedule(name), create_rev)
            .when_absent(key.clone());
        if trigger {
            // The id the caller is told must be free: no job or result of it, ever kept.
            let k = keys.job(&super::trigger_id(name, at));
            write = write
                .when_absent(k.spec)
                .when_absent(k.registry)
                .when_absent(k.dirty)
                .when_absent(k.clean);
        }
        let write = write.put(key, codec::encode(&req));
        let mut c = store.client();
        let resp = store
            .timed("schedule request", c.txn(write.into_txn()))
            .await?;
        if resp.succeeded() {
            return Ok(at);
        }
        let (_, _, now_rev, _) = read(store, keys, name).await?;
        if now_rev != create_rev {
            return Err(Error::NotFound(name.to_string()));
        }
    }
    Err(Error::Busy(name.to_string()))
}

/// The oldest tick whose run is still known: results older than the result retention are
/// gone, and with `keep_results` of them kept the sweep may have removed older ones.
async fn kept_since(
    store: &Store,
    keys: &Keys,
    record: &ScheduleRecord,
    retention: Retention,
) -> Result<u64, Error> {
    let by_time = super::clock::now_ms().saturating_sub(retention.results.as_millis() as u64);
    let prefix = format!("{}{}-", keys.clean(), record.name);
    let mut first: Option<u64> = None;
    let mut n: u64 = 0;
    let mut after = String::new();
    loop {
        let range = jobs::Range::after(&prefix, &after);
        let (page, _) = jobs::page(store, range, 1000, 0, true).await?;
        for kv in &page {
            let Some(rest) = Keys::id_in(&prefix, kv.key()) else {
                continue;
            };
            after = rest.to_string();
            let id = format!("{}-{rest}", record.name);
            if !super::is_reserved_id(&id)
                || id.rsplit_once('-').map(|(n, _)| n) != Some(&record.name)
            {
                continue;
            }
            n += 1;
            if first.is_none() {
                let t = rest.trim_end_matches('Z').replace('.', "");
                first = chrono::NaiveDateTime::parse_from_str(&t[..15], "%Y%m%dT%H%M%S")
                    .ok()
                    .map(|d| d.and_utc().timestamp_millis() as u64);
            }
        }
        if page.len() < 1000 {
            break;
        }
    }
    Ok(match first {
        Some(f) if n >= record.keep_results as u64 => by_time.max(f),
        _ => by_time,
    })
}

/// Asks the leader for one run now; returns the job id it will have.
pub async fn trigger(store: &Store, keys: &Keys, name: &str, by: &str) -> Result<String, Error> {
    let at = request(store, keys, name, RequestKind::Trigger, by).await?;
    Ok(super::trigger_id(name, at))
}

/// Asks the leader to run the ticks in `(from_ms, to_ms]` that have not run; returns how many
/// ticks that range holds.
/// A backfill's range `(from_ms, to_ms]`; `force`: also ticks older than the kept results.
#[derive(Clone, Copy, Debug)]
pub struct Range {
    pub from_ms: u64,
    pub to_ms: u64,
    pub force: bool,
}

pub async fn backfill(
    store: &Store,
    keys: &Keys,
    name: &str,
    range: Range,
    by: &str,
    retention: Retention,
) -> Result<u64, Error> {
    let Range {
        from_ms,
        to_ms,
        force,
    } = range;
    let (record, _, _, _) = read(store, keys, name).await?;
    if to_ms <= from_ms {
        return Err(invalid("to", "must be after from").into());
    }
    let kept_since = kept_since(store, keys, &record, retention).await?;
    if from_ms < kept_since && !force {
        return Err(invalid(
            "from",
            format!(
                "ticks before {} are older than the kept results (--result-retention {}, --keep-results {}), so whether they ran is not known; --force runs them anyway (at least once, not at most once)",
                expr::rfc3339(kept_since),
                humantime::format_duration(retention.results),
                record.keep_results
            ),
        )
        .into());
    }
    if to_ms > super::clock::now_ms() {
        return Err(invalid("to", "must not be in the future").into());
    }
    let timing = Timing::new(&record.cron, &record.tz, record.anchor_ms)?;
    let n = timing.count(from_ms, to_ms, BACKFILL_MAX + 1);
    if n > BACKFILL_MAX {
        return Err(invalid(
            "from",
            format!("the range holds more than {BACKFILL_MAX} ticks; split it"),
        )
        .into());
    }
    if n == 0 {
        return Err(invalid("from", "the range holds no tick").into());
    }
    let kind = RequestKind::Backfill {
        from_ms,
        to_ms,
        force,
    };
    request(store, keys, name, kind, by).await?;
    Ok(n)
}
