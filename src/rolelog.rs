//! The role log: every role transition and every newly proven lease deadline, as structured
//! `tracing` events on the target [`TARGET`], stamped on `CLOCK_BOOTTIME`.
//!
//! It exists so that leadership can be audited after the fact on one host. A term starts when
//! its replica logged `became_leader` and ends at the earlier of its logged `stepped_down` and
//! its last proven `valid_until - margin`. The second bound holds for a replica that was
//! SIGKILLed and never logged an end: it had promised to stop acting by then.
//! [`check_terms`] verifies that no two terms overlap.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::clock::BootInstant;

pub const TARGET: &str = "baton::role";

#[allow(clippy::too_many_arguments)]
pub fn became_leader(
    replica: &str,
    term: i64,
    lease: i64,
    key: &str,
    at: BootInstant,
    valid_until: BootInstant,
    margin: Duration,
) {
    tracing::info!(
        target: TARGET,
        event = "became_leader",
        replica,
        term,
        lease,
        key,
        boottime_ns = at.as_nanos(),
        valid_until_ns = valid_until.as_nanos(),
        margin_ns = margin.as_nanos() as u64,
        "became leader"
    );
}

/// A term's end, with what its keepalives looked like: when the last one was answered and the
/// longest time the lease went without an answer (up to the step-down).
pub fn stepped_down(
    replica: &str,
    term: i64,
    lease: i64,
    at: BootInstant,
    reason: &str,
    last_keepalive: BootInstant,
    longest_gap: Duration,
) {
    tracing::info!(
        target: TARGET,
        event = "stepped_down",
        replica,
        term,
        lease,
        boottime_ns = at.as_nanos(),
        reason,
        last_keepalive_ns = last_keepalive.as_nanos(),
        longest_keepalive_gap_ms = longest_gap.as_millis() as u64,
        "stepped down"
    );
}

/// A new term has taken in what it found at its start: `part` is `registry` (every entry
/// adopted, waiting for a slot, or due for a later look) or `cleanups` (every dirty result
/// queued for cleanup). `entries`: how many.
pub fn recovered(replica: &str, term: i64, lease: i64, part: &str, entries: usize) {
    tracing::info!(
        target: TARGET,
        event = "recovered",
        replica,
        term,
        lease,
        part,
        entries = entries as u64,
        boottime_ns = BootInstant::now().as_nanos(),
        "recovered"
    );
}

pub fn lease_proven(replica: &str, lease: i64, sent: BootInstant, valid_until: BootInstant) {
    tracing::info!(
        target: TARGET,
        event = "lease_proven",
        replica,
        lease,
        boottime_ns = sent.as_nanos(),
        valid_until_ns = valid_until.as_nanos(),
        "lease proven alive"
    );
}

/// A follower revoked the lease of term `term` on evidence that its leader's process is gone:
/// `evidence` says which (`refused`: its exact address refused a connection; `restarted`:
/// another incarnation answered there), `incarnation` and `pid` name the process it watched.
#[allow(clippy::too_many_arguments)]
pub fn leader_process_gone(
    replica: &str,
    leader: &str,
    term: i64,
    lease: i64,
    at: BootInstant,
    evidence: &str,
    incarnation: &str,
    pid: u32,
) {
    tracing::info!(
        target: TARGET,
        event = "leader_process_gone",
        replica,
        leader,
        term,
        lease,
        boottime_ns = at.as_nanos(),
        evidence,
        incarnation,
        pid,
        "revoked the lease of a leader whose process is gone"
    );
}

/// One line of a role log, as written by the JSON formatter.
#[derive(Clone, Debug, Deserialize)]
pub struct RoleEvent {
    pub event: String,
    pub replica: String,
    #[serde(default)]
    pub term: Option<i64>,
    pub lease: i64,
    /// The election key (on `became_leader`).
    #[serde(default)]
    pub key: Option<String>,
    pub boottime_ns: u64,
    #[serde(default)]
    pub valid_until_ns: Option<u64>,
    #[serde(default)]
    pub margin_ns: Option<u64>,
    #[serde(default)]
    pub reason: Option<String>,
    /// On `stepped_down`: when the last keepalive was answered.
    #[serde(default)]
    pub last_keepalive_ns: Option<u64>,
    /// On `stepped_down`: the longest time without an answered keepalive.
    #[serde(default)]
    pub longest_keepalive_gap_ms: Option<u64>,
    /// On `recovered`: `registry` or `cleanups`.
    #[serde(default)]
    pub part: Option<String>,
    /// On `recovered`: how many entries.
    #[serde(default)]
    pub entries: Option<u64>,
    /// On `leader_process_gone`: the leader whose lease was revoked, the evidence, and the pid
    /// of the process watched.
    #[serde(default)]
    pub leader: Option<String>,
    #[serde(default)]
    pub evidence: Option<String>,
    #[serde(default)]
    pub pid: Option<u32>,
}

/// Reads the role events out of JSON log text; lines of other targets are skipped. A role line
/// that does not parse is an error (it could hide a term), except an unterminated last line,
/// which a writer may still be appending.
pub fn parse(text: &str) -> Result<Vec<RoleEvent>, String> {
    let complete = match text.rfind('\n') {
        Some(i) => &text[..i],
        None => "",
    };
    complete
        .lines()
        .filter(|l| l.contains(TARGET))
        .map(|l| {
            serde_json::from_str(l).map_err(|e| format!("unreadable role log line ({e}): {l}"))
        })
        .collect()
}

/// One leadership interval, reconstructed from a role log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TermInterval {
    pub replica: String,
    pub term: i64,
    pub lease: i64,
    pub start: BootInstant,
    /// The earlier of the logged step-down and the last proven deadline minus the margin.
    pub end: BootInstant,
    pub step_down_reason: Option<String>,
}

/// Reconstructs every term from the events of all replicas (in any order).
pub fn terms(events: &[RoleEvent]) -> Vec<TermInterval> {
    let mut by_lease: BTreeMap<(String, i64), Vec<&RoleEvent>> = BTreeMap::new();
    for e in events {
        by_lease
            .entry((e.replica.clone(), e.lease))
            .or_default()
            .push(e);
    }
    let mut out = Vec::new();
    for ((replica, lease), evs) in by_lease {
        let Some(start) = evs.iter().find(|e| e.event == "became_leader") else {
            continue;
        };
        let margin = Duration::from_nanos(start.margin_ns.unwrap_or(0));
        let last_valid = evs
            .iter()
            .filter_map(|e| e.valid_until_ns)
            .max()
            .unwrap_or(start.boottime_ns);
        let promised_end = BootInstant::from_nanos(last_valid) - margin;
        let step_down = evs.iter().find(|e| e.event == "stepped_down");
        let end = match step_down {
            Some(s) => promised_end.min(BootInstant::from_nanos(s.boottime_ns)),
            None => promised_end,
        };
        out.push(TermInterval {
            replica,
            term: start.term.unwrap_or_default(),
            lease,
            start: BootInstant::from_nanos(start.boottime_ns),
            end,
            step_down_reason: step_down.and_then(|s| s.reason.clone()),
        });
    }
    out.sort_by_key(|t| t.start);
    out
}

/// A process seen to exit (by `waitid` in whoever started it), on `CLOCK_BOOTTIME`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exit {
    pub replica: String,
    pub at: BootInstant,
}

/// [`terms`], each also ended by the first observed exit of its replica's process after it
/// began: a process that is gone acts no more, whatever its lease promised. (A leader revoked on
/// evidence of its death is replaced before its promise runs out.)
pub fn terms_until_exits(events: &[RoleEvent], exits: &[Exit]) -> Vec<TermInterval> {
    let mut out = terms(events);
    for t in &mut out {
        let exit = exits
            .iter()
            .filter(|x| x.replica == t.replica && x.at >= t.start)
            .map(|x| x.at)
            .min();
        if let Some(x) = exit {
            t.end = t.end.min(x);
        }
    }
    out
}

/// Every revoke on evidence (`leader_process_gone`) of a process not seen to exit before it:
/// the revoked term's replica must have an observed exit between the term's start and the
/// revoke. Empty when all hold.
pub fn unproven_revokes(events: &[RoleEvent], exits: &[Exit]) -> Vec<String> {
    let began = |leader: &str, term: Option<i64>| {
        events
            .iter()
            .find(|e| e.event == "became_leader" && e.replica == leader && e.term == term)
            .map(|e| BootInstant::from_nanos(e.boottime_ns))
    };
    events
        .iter()
        .filter(|e| e.event == "leader_process_gone")
        .filter_map(|e| {
            let leader = e.leader.as_deref().unwrap_or_default();
            let at = BootInstant::from_nanos(e.boottime_ns);
            let from = began(leader, e.term).unwrap_or(BootInstant::from_nanos(0));
            let seen = exits
                .iter()
                .any(|x| x.replica == leader && x.at >= from && x.at <= at);
            (!seen).then(|| {
                format!(
                    "{} revoked term {} of {leader} (evidence {}) at {at} before its process was seen to exit",
                    e.replica,
                    e.term.unwrap_or_default(),
                    e.evidence.as_deref().unwrap_or("?")
                )
            })
        })
        .collect()
}

/// Two terms that were both in force at once.
#[derive(Debug, thiserror::Error)]
#[error("term {} of {} ({}..{}) overlaps term {} of {} starting at {}", .earlier.term, .earlier.replica, .earlier.start, .earlier.end, .later.term, .later.replica, .later.start)]
pub struct Overlap {
    pub earlier: TermInterval,
    pub later: TermInterval,
}

/// Checks that the terms, sorted by start, never overlap and that terms only grow.
pub fn check_terms(terms: &[TermInterval]) -> Result<(), Box<Overlap>> {
    if let Some(t) = terms.iter().find(|t| t.end < t.start) {
        // A term published after its own promised end: it was used while already invalid.
        return Err(Box::new(Overlap {
            earlier: t.clone(),
            later: t.clone(),
        }));
    }
    for pair in terms.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.start < a.end || b.term <= a.term {
            return Err(Box::new(Overlap {
                earlier: a.clone(),
                later: b.clone(),
            }));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(
        event: &str,
        replica: &str,
        term: i64,
        lease: i64,
        at: u64,
        valid: Option<u64>,
    ) -> RoleEvent {
        RoleEvent {
            event: event.into(),
            replica: replica.into(),
            term: Some(term),
            lease,
            key: None,
            boottime_ns: at,
            valid_until_ns: valid,
            margin_ns: Some(100),
            reason: None,
            last_keepalive_ns: None,
            longest_keepalive_gap_ms: None,
            part: None,
            entries: None,
            leader: None,
            evidence: None,
            pid: None,
        }
    }

    #[test]
    fn a_killed_leader_ends_at_its_promise() {
        let events = vec![
            ev("became_leader", "a", 10, 1, 1_000, Some(2_000)),
            ev("lease_proven", "a", 0, 1, 1_500, Some(3_000)),
            ev("became_leader", "b", 20, 2, 2_950, Some(5_000)),
        ];
        let t = terms(&events);
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].end.as_nanos(), 2_900);
        assert!(check_terms(&t).is_ok());
    }

    #[test]
    fn overlap_is_reported() {
        let events = vec![
            ev("became_leader", "a", 10, 1, 1_000, Some(3_000)),
            ev("became_leader", "b", 20, 2, 2_000, Some(5_000)),
        ];
        let err = check_terms(&terms(&events)).unwrap_err();
        assert_eq!(err.later.replica, "b");
    }

    #[test]
    fn step_down_ends_a_term_early() {
        let events = vec![
            ev("became_leader", "a", 10, 1, 1_000, Some(9_000)),
            ev("stepped_down", "a", 10, 1, 1_200, None),
            ev("became_leader", "b", 20, 2, 1_300, Some(5_000)),
        ];
        assert!(check_terms(&terms(&events)).is_ok());
    }
}
