//! What etcd holds about a schedule: `schedules/<name>` (the definition, written by any
//! replica), `schedule-status/<name>` (what the leader decided, written by it alone, fenced)
//! and `schedule-requests/<name>/<id>` (triggers and backfills for the leader to decide).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::jobs::spec::JobSpec;

pub const SCHEDULE_VERSION: u32 = 1;
pub const STATUS_VERSION: u32 = 1;
pub const REQUEST_VERSION: u32 = 1;

/// Outcomes kept in a status, newest last.
pub const RECENT_MAX: usize = 20;
/// Live jobs a status lists at most: under `forbid` and `replace` there is one at a time;
/// under `allow` the oldest drop off the list (they are neither waited for nor cancelled).
pub const LIVE_MAX: usize = 4;

/// When a new tick may start while earlier runs of the schedule are still live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Skip the tick (recorded `skipped`).
    #[default]
    Forbid,
    Allow,
    /// Cancel the live runs; the new one starts once they have ended.
    Replace,
}

impl Overlap {
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Forbid => "forbid",
            Overlap::Allow => "allow",
            Overlap::Replace => "replace",
        }
    }

    pub fn parse(s: &str) -> Option<Overlap> {
        match s {
            "forbid" | "" => Some(Overlap::Forbid),
            "allow" => Some(Overlap::Allow),
            "replace" => Some(Overlap::Replace),
            _ => None,
        }
    }
}

/// Which missed ticks inside the catch-up window run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Catchup {
    /// The latest; earlier ones are `superseded`.
    #[default]
    Latest,
    /// Each, in order.
    All,
}

impl Catchup {
    pub fn as_str(self) -> &'static str {
        match self {
            Catchup::Latest => "latest",
            Catchup::All => "all",
        }
    }

    pub fn parse(s: &str) -> Option<Catchup> {
        match s {
            "latest" | "" => Some(Catchup::Latest),
            "all" => Some(Catchup::All),
            _ => None,
        }
    }
}

/// `schedules/<name>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleRecord {
    pub version: u32,
    pub name: String,
    /// The job each tick runs (its environment gains `BATON_SCHEDULE` and
    /// `BATON_SCHEDULED_TIME`).
    pub spec: JobSpec,
    /// Cron (5 fields, or 6 with seconds first), a macro, or `@every D`.
    pub cron: String,
    pub tz: String,
    pub overlap: Overlap,
    pub catchup: Catchup,
    #[serde(with = "crate::jobs::spec::duration_secs")]
    pub catchup_window: Duration,
    /// Tick results kept: the newest this many.
    pub keep_results: u32,
    /// `@every`'s anchor, Unix ms: the creation, reset when the period changes.
    pub anchor_ms: u64,
    /// No tick at or before this Unix ms fires: the time of the latest create, update or
    /// resume, so a change never fires the past.
    pub floor_ms: u64,
    #[serde(default)]
    pub paused: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_reason: Option<String>,
    /// The floor was set by a resume: the ticks below it were `paused`.
    #[serde(default)]
    pub resumed: bool,
    pub created_by: String,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl ScheduleRecord {
    /// A definition created at `now_ms` by `by`, with the default zone (UTC) and policies
    /// (catch-up `latest` within 10 minutes, 1,000 results kept).
    pub fn new(
        name: &str,
        spec: JobSpec,
        cron: &str,
        overlap: Overlap,
        by: &str,
        now_ms: u64,
    ) -> ScheduleRecord {
        ScheduleRecord {
            version: SCHEDULE_VERSION,
            name: name.to_string(),
            spec,
            cron: cron.trim().to_string(),
            tz: "UTC".into(),
            overlap,
            catchup: Catchup::Latest,
            catchup_window: Duration::from_secs(600),
            keep_results: 1000,
            // Whole seconds: `@every` ticks then never share a second, so their ids differ.
            anchor_ms: now_ms - now_ms % 1000,
            floor_ms: now_ms,
            paused: false,
            pause_reason: None,
            resumed: false,
            created_by: by.to_string(),
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
        }
    }

    /// Whether `other` defines the same ticks and jobs: what a create compares, so a create
    /// retried after a lost answer is not refused.
    pub fn same_definition(&self, other: &ScheduleRecord) -> bool {
        self.spec == other.spec
            && self.cron == other.cron
            && self.tz == other.tz
            && self.overlap == other.overlap
            && self.catchup == other.catchup
            && self.catchup_window == other.catchup_window
            && self.keep_results == other.keep_results
    }
}

/// One decided tick (or trigger or backfill), as the status keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decided {
    /// The scheduled time, Unix ms.
    pub t: u64,
    /// `fired`, `skipped`, `missed`, `superseded`, `paused`, `conflict`, `clock-skew`.
    pub o: String,
    /// `trigger` for a trigger (its job id is [`crate::schedule::trigger_id`] of `t`); a
    /// tick's is [`crate::schedule::tick_id`] of `t`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k: Option<String>,
    /// How many ticks this entry stands for (older ones of the same outcome), when more than 1.
    #[serde(default, skip_serializing_if = "is_one")]
    pub n: u64,
    /// When it was decided, Unix ms.
    pub d: u64,
}

impl Decided {
    /// The job this outcome is about, if it names one.
    pub fn job_id(&self, schedule: &str) -> Option<String> {
        match (self.k.as_deref(), self.o.as_str()) {
            (Some("trigger"), _) => Some(super::trigger_id(schedule, self.t)),
            (_, "fired" | "conflict") => Some(super::tick_id(schedule, self.t)),
            _ => None,
        }
    }
}

fn is_one(n: &u64) -> bool {
    *n <= 1
}

/// `schedule-status/<name>`: the leader's bookkeeping, under 2 KiB.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleStatus {
    pub version: u32,
    /// The create revision of the schedule this status is about: a status naming another one
    /// (the name was deleted and created again) is stale.
    pub schedule_rev: i64,
    /// The latest tick decided, Unix ms: no tick at or before it fires again.
    pub watermark_ms: u64,
    /// Jobs of this schedule that may still be live (pruned when their registry entry is gone).
    #[serde(default)]
    pub live: Vec<String>,
    /// Ticks by outcome, since the schedule was created: they add up to the ticks between its
    /// creation and the watermark (triggers and clock skews are not ticks, and not counted).
    #[serde(default)]
    pub counts: BTreeMap<String, u64>,
    #[serde(default)]
    pub recent: Vec<Decided>,
    /// The watermark a clock skew was last noted at (noted once, whichever term finds it).
    #[serde(default)]
    pub skew_at: u64,
}

impl ScheduleStatus {
    pub fn new(schedule_rev: i64) -> Self {
        Self {
            version: STATUS_VERSION,
            schedule_rev,
            ..Default::default()
        }
    }

    /// Records an outcome standing for `n` ticks, the newest at `t`.
    pub fn record(&mut self, t: u64, outcome: &str, n: u64, now_ms: u64) {
        if n == 0 {
            return;
        }
        *self.counts.entry(outcome.to_string()).or_default() += n;
        self.note(t, outcome, None, n, now_ms);
    }

    /// Shows an outcome among the recent ones without counting it as ticks (`kind`: a
    /// trigger's).
    pub fn note(&mut self, t: u64, outcome: &str, kind: Option<&str>, n: u64, now_ms: u64) {
        self.recent.push(Decided {
            t,
            o: outcome.to_string(),
            k: kind.map(str::to_string),
            n,
            d: now_ms,
        });
        if self.recent.len() > RECENT_MAX {
            let extra = self.recent.len() - RECENT_MAX;
            self.recent.drain(..extra);
        }
    }
}

/// What a request asks of the leader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum RequestKind {
    /// One run now, with an id no tick can take.
    Trigger,
    /// The ticks in `(from_ms, to_ms]` not run yet; `force`: also those older than the kept
    /// results (at least once, not at most once).
    Backfill {
        from_ms: u64,
        to_ms: u64,
        #[serde(default)]
        force: bool,
    },
}

/// `schedule-requests/<name>/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleRequest {
    pub version: u32,
    #[serde(flatten)]
    pub kind: RequestKind,
    /// The create revision of the schedule it is for.
    pub schedule_rev: i64,
    pub requested_by: String,
    pub requested_at_ms: u64,
    /// A backfill's progress: its ticks up to this Unix ms are done (written by the leader with
    /// each tick's job).
    #[serde(default)]
    pub progress_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_status_stays_under_2_kib() {
        let mut s = ScheduleStatus::new(123_456_789);
        s.watermark_ms = 1_790_000_000_000;
        for i in 0..100u64 {
            s.record(
                1_790_000_000_000 + i,
                "superseded",
                1000 + i,
                1_790_000_000_123,
            );
        }
        s.live = vec![format!("{}-20261205T203000.000Z", "n".repeat(96)); 3];
        let bytes = crate::store::codec::encode(&s).len();
        assert!(bytes < 2048, "{bytes} bytes");
        assert_eq!(s.recent.len(), RECENT_MAX);
        assert_eq!(s.counts["superseded"], (1000..1100).sum::<u64>());
    }
}
