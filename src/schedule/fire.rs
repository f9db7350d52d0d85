//! The leader's decision and write for one fire of a schedule, as pure functions of what it
//! knows (the definition and the status as read, with their revisions) and which live jobs
//! still have a registry entry. The coordinator commits them fenced; the protocol model
//! (`model/`) applies the very same writes to its in-memory etcd.
//!
//! Guarantees of the writes:
//! - every one compares the definition's mod revision and the status's (or its absence), so a
//!   decision made from an older definition or status never lands;
//! - a fire moves the watermark to its tick in the transaction that creates the job, and
//!   creates it only if no job, registry entry or result of its id exists;
//! - `forbid` fires only while each live job found ended is still absent from the registry,
//!   and skips only while the others are still there; `replace` cancels the live jobs (each
//!   still registered) and the new job's entry waits `after` them.

use super::record::{Overlap, ScheduleRecord, ScheduleStatus, LIVE_MAX, STATUS_VERSION};
use super::{expr, TickOrigin};
use crate::jobs::records::{self, CancelRequest, RegistryEntry};
use crate::jobs::spec::JobRecord;
use crate::store::{codec, Keys, Write};

/// What the leader knows of a schedule.
#[derive(Clone, Copy, Debug)]
pub struct Known<'a> {
    pub rec: &'a ScheduleRecord,
    /// The definition's mod revision.
    pub rev: i64,
    /// Its create revision.
    pub create: i64,
    /// The status of this definition (empty if none or stale).
    pub status: &'a ScheduleStatus,
    /// The status key's mod revision, whatever it holds (0: absent).
    pub status_rev: i64,
}

/// One job to create for a schedule.
#[derive(Clone, Debug)]
pub struct Fire {
    pub t: u64,
    pub id: String,
    /// `tick`, `trigger` or `backfill`.
    pub kind: &'static str,
    pub overlap: Overlap,
    /// Outcomes of earlier ticks recorded in the same write: (newest tick, outcome, count).
    pub pre: Vec<(u64, &'static str, u64)>,
    pub watermark: Option<u64>,
    /// The request this fire answers (deleted with it), with its mod revision.
    pub request: Option<(String, i64)>,
}

/// What to write for a fire.
#[derive(Clone, Debug)]
pub enum Plan {
    /// `forbid` with a live run: the tick is recorded `skipped`.
    Skip {
        write: Write,
        status: ScheduleStatus,
    },
    /// The job is created; `replaced`: live runs cancelled for it.
    Create {
        write: Write,
        status: ScheduleStatus,
        replaced: Vec<String>,
    },
}

/// The compares every write about a schedule makes: its definition and its status as known.
pub fn guarded(keys: &Keys, k: &Known) -> Write {
    let w = Write::new().when_modified(keys.schedule(&k.rec.name), k.rev);
    let status = keys.schedule_status(&k.rec.name);
    if k.status_rev == 0 {
        w.when_absent(status)
    } else {
        w.when_modified(status, k.status_rev)
    }
}

/// The status after recording `outcomes`, the watermark moved to `watermark` if later.
pub fn status_with(
    k: &Known,
    outcomes: &[(u64, &'static str, u64)],
    watermark: Option<u64>,
    now_ms: u64,
) -> ScheduleStatus {
    let mut st = k.status.clone();
    st.version = STATUS_VERSION;
    st.schedule_rev = k.create;
    for (t, o, n) in outcomes {
        st.record(*t, o, *n, now_ms);
    }
    if let Some(w) = watermark {
        st.watermark_ms = st.watermark_ms.max(w);
    }
    st
}

/// Records what became of a fire: a tick's outcome is counted, a trigger's only shown (it is
/// not a tick).
pub fn record_fire(st: &mut ScheduleStatus, f: &Fire, outcome: &str, now_ms: u64) {
    if f.kind == "tick" {
        st.record(f.t, outcome, 1, now_ms);
    } else {
        st.note(f.t, outcome, Some(f.kind), 1, now_ms);
    }
}

/// The write that creates job `id` for time `t` of the schedule if its id is free (no
/// compares on the schedule), and the job's record. Its environment gains `BATON_SCHEDULE`
/// and `BATON_SCHEDULED_TIME`.
pub fn job_write(
    keys: &Keys,
    k: &Known,
    id: &str,
    t: u64,
    kind: &str,
    after: Vec<String>,
    now_ms: u64,
) -> (Write, JobRecord) {
    let mut spec = k.rec.spec.clone();
    spec.env.insert("BATON_SCHEDULE".into(), k.rec.name.clone());
    spec.env
        .insert("BATON_SCHEDULED_TIME".into(), expr::rfc3339(t));
    let record = JobRecord {
        version: spec.record_version(),
        job_id: id.to_string(),
        spec_hash: spec.hash(),
        spec,
        submitted_at_ms: now_ms,
        submitted_by: Some(format!("schedule:{}", k.rec.name)),
        schedule: Some(TickOrigin {
            schedule: k.rec.name.clone(),
            schedule_revision: k.rev,
            scheduled_time: t,
            kind: kind.to_string(),
        }),
    };
    let j = keys.job(id);
    let w = Write::new()
        .when_absent(j.spec.clone())
        .when_absent(j.registry.clone())
        .when_absent(j.dirty.clone())
        .when_absent(j.clean.clone())
        .put(j.spec, codec::encode(&record))
        .put(
            j.registry,
            codec::encode(&RegistryEntry::pending_after(after)),
        );
    (w, record)
}

/// The fire `f` of the schedule `k`, given which of its live jobs still have a registry entry
/// (`alive`, as read). The write's `or_get` answers, on a conflict: the definition, the status,
/// then the job's spec, registry entry, dirty and clean result.
pub fn plan(keys: &Keys, k: &Known, f: &Fire, alive: &[String], now_ms: u64) -> Plan {
    let ended: Vec<&String> = k
        .status
        .live
        .iter()
        .filter(|id| !alive.contains(id))
        .collect();
    let mut st = status_with(k, &f.pre, f.watermark, now_ms);
    let status_key = keys.schedule_status(&k.rec.name);
    if f.overlap == Overlap::Forbid && !alive.is_empty() {
        st.live = alive.to_vec();
        st.record(f.t, "skipped", 1, now_ms);
        // Only while those runs are still there: had one ended meanwhile, the tick could run.
        let w = alive.iter().fold(guarded(keys, k), |w, id| {
            w.when_present(keys.job(id).registry)
        });
        let write = w
            .put(status_key.clone(), codec::encode(&st))
            .or_get(keys.schedule(&k.rec.name))
            .or_get(status_key);
        return Plan::Skip { write, status: st };
    }
    let replaced = if f.overlap == Overlap::Replace {
        alive.to_vec()
    } else {
        Vec::new()
    };
    let (job, _) = job_write(keys, k, &f.id, f.t, f.kind, replaced.clone(), now_ms);
    let mut w = guarded(keys, k);
    if f.overlap != Overlap::Allow {
        for id in &ended {
            w = w.when_absent(keys.job(id).registry);
        }
    }
    let cancel = CancelRequest {
        version: records::CANCEL_VERSION,
        requested_at_ms: now_ms,
        requested_via: format!("schedule {} (replace)", k.rec.name),
    };
    for id in &replaced {
        let j = keys.job(id);
        w = w
            .when_present(j.registry)
            .put(j.cancel, codec::encode(&cancel));
    }
    if let Some((rk, rrev)) = &f.request {
        w = w.when_modified(rk.clone(), *rrev).delete(rk.clone());
    }
    st.live = alive.to_vec();
    st.live.push(f.id.clone());
    if k.rec.overlap == Overlap::Allow && st.live.len() > LIVE_MAX {
        // Nobody waits for them under the schedule's `allow`: the oldest drop off, so the
        // status stays small. (A trigger fires as `allow` whatever the schedule's policy: under
        // `forbid` and `replace` every live run stays listed, so later ticks see it.)
        let extra = st.live.len() - LIVE_MAX;
        st.live.drain(..extra);
    }
    record_fire(&mut st, f, "fired", now_ms);
    let j = keys.job(&f.id);
    let write = w
        .merge(job)
        .put(status_key.clone(), codec::encode(&st))
        .or_get(keys.schedule(&k.rec.name))
        .or_get(status_key)
        .or_get(j.spec)
        .or_get(j.registry)
        .or_get(j.dirty)
        .or_get(j.clean);
    Plan::Create {
        write,
        status: st,
        replaced,
    }
}

/// A fire whose job id another job took: the tick is recorded `conflict`, never run.
pub fn conflict(keys: &Keys, k: &Known, f: &Fire, now_ms: u64) -> (Write, ScheduleStatus) {
    let mut st = status_with(k, &f.pre, f.watermark, now_ms);
    record_fire(&mut st, f, "conflict", now_ms);
    let mut w = guarded(keys, k).put(keys.schedule_status(&k.rec.name), codec::encode(&st));
    if let Some((rk, rrev)) = &f.request {
        w = w.when_modified(rk.clone(), *rrev).delete(rk.clone());
    }
    (w, st)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(overlap: Overlap) -> ScheduleRecord {
        let spec = crate::jobs::spec::JobSpec::resolve(
            vec!["true".into()],
            Default::default(),
            Vec::new(),
            0,
            None,
        )
        .unwrap();
        ScheduleRecord::new("s", spec, "@every 1s", overlap, "t", 0)
    }

    fn trigger(t: u64) -> Fire {
        Fire {
            t,
            id: crate::schedule::trigger_id("s", t),
            kind: "trigger",
            overlap: Overlap::Allow,
            pre: Vec::new(),
            watermark: None,
            request: None,
        }
    }

    /// Triggers fire as `allow`; only an `allow` schedule lets the oldest live runs drop off
    /// its list, so a running tick of a `forbid` or `replace` schedule stays seen.
    #[test]
    fn triggers_never_push_a_live_tick_off_a_forbid_or_replace_list() {
        let keys = Keys::new("t");
        let tick = crate::schedule::tick_id("s", 1000);
        for (overlap, keeps_tick) in [
            (Overlap::Forbid, true),
            (Overlap::Replace, true),
            (Overlap::Allow, false),
        ] {
            let rec = record(overlap);
            let mut status = ScheduleStatus::new(7);
            status.live = vec![tick.clone()];
            for i in 1..=LIVE_MAX as u64 {
                status.live.push(crate::schedule::trigger_id("s", 1000 + i));
            }
            let k = Known {
                rec: &rec,
                rev: 7,
                create: 7,
                status: &status,
                status_rev: 8,
            };
            let alive = status.live.clone();
            let Plan::Create { status: st, .. } = plan(&keys, &k, &trigger(9000), &alive, 9000)
            else {
                panic!("a trigger is created whatever the policy");
            };
            assert_eq!(
                st.live.contains(&tick),
                keeps_tick,
                "{overlap:?}: {:?}",
                st.live
            );
            assert!(st.live.contains(&crate::schedule::trigger_id("s", 9000)));
            if !keeps_tick {
                assert_eq!(st.live.len(), LIVE_MAX);
            }
            // Not a tick: shown, not counted.
            assert!(st.counts.is_empty(), "{:?}", st.counts);
        }
    }

    /// `forbid` with a live run skips, and only while that run is still registered.
    #[test]
    fn forbid_skips_only_while_the_live_run_is_registered() {
        let keys = Keys::new("t");
        let rec = record(Overlap::Forbid);
        let live = crate::schedule::tick_id("s", 1000);
        let mut status = ScheduleStatus::new(7);
        status.live = vec![live.clone()];
        let k = Known {
            rec: &rec,
            rev: 7,
            create: 7,
            status: &status,
            status_rev: 8,
        };
        let tick = Fire {
            t: 2000,
            id: crate::schedule::tick_id("s", 2000),
            kind: "tick",
            overlap: Overlap::Forbid,
            pre: Vec::new(),
            watermark: Some(2000),
            request: None,
        };
        let Plan::Skip { write, status: st } =
            plan(&keys, &k, &tick, std::slice::from_ref(&live), 9000)
        else {
            panic!("a live run means skip");
        };
        assert_eq!(st.counts["skipped"], 1);
        assert_eq!(st.watermark_ms, 2000);
        let registry = keys.job(&live).registry.into_bytes();
        assert!(write
            .conds()
            .iter()
            .any(|c| matches!(c, crate::store::Cond::Present(k) if *k == registry)));
        let Plan::Create {
            write, status: st, ..
        } = plan(&keys, &k, &tick, &[], 9000)
        else {
            panic!("an ended run lets the tick fire");
        };
        assert_eq!(st.counts["fired"], 1);
        assert!(write
            .conds()
            .iter()
            .any(|c| matches!(c, crate::store::Cond::Absent(k) if *k == registry)));
    }
}
