//! Schedules: recurring jobs that fire at most once per tick, whatever happens to the leader.
//!
//! A schedule's definition (`schedules/<name>`) is written by any replica ([`service`]); the
//! leader alone decides its ticks (`crate::coordinator`'s schedule task) and records them in
//! the schedule's status key. Each tick is guarded twice:
//! - the watermark: the fenced transaction that creates a tick's job also moves the status's
//!   watermark to the tick and compares the definition's revision, and no tick at or before the
//!   watermark fires again;
//! - the id: a tick's job id is `<name>-<YYYYMMDDTHHMMSSZ>` (UTC), created only if no job,
//!   registry entry or result of that id exists, so while its result is kept it cannot run
//!   twice whatever the watermark says.
//!
//! Triggers get `<name>-<YYYYMMDDTHHMMSS.mmm>Z`, which no tick can take.

pub mod clock;
pub mod expr;
pub mod fire;
pub mod record;
pub mod service;

use crate::jobs::spec::{self, Invalid};
use crate::store;
use crate::store::codec::Corrupt;

pub use crate::jobs::spec::TickOrigin;
pub use expr::Timing;
pub use record::{ScheduleRecord, ScheduleStatus};

/// Longest schedule name: its tick ids (`-` and 16 characters more) stay job ids.
pub const NAME_MAX: usize = 96;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid request: {0}")]
    Invalid(#[from] Invalid),
    #[error("no schedule {0}")]
    NotFound(String),
    #[error("schedule {0} already exists with a different definition")]
    AlreadyExists(String),
    /// The definition changed since the revision the caller read.
    #[error("schedule {name} changed since revision {expected} (now {actual}); read it again")]
    Changed {
        name: String,
        expected: i64,
        actual: i64,
    },
    /// Too many requests for one schedule in the same millisecond.
    #[error("too many requests at once for schedule {0}; retry")]
    Busy(String),
    #[error(transparent)]
    Store(#[from] store::Error),
    #[error(transparent)]
    Corrupt(#[from] Corrupt),
    #[error(transparent)]
    Jobs(#[from] crate::jobs::Error),
}

/// A schedule name: 1 to 96 characters of `[A-Za-z0-9._-]`, not `.` or `..`.
pub fn validate_name(name: &str) -> Result<(), Invalid> {
    let bad = |reason: &str| Invalid {
        field: "name",
        reason: reason.to_string(),
    };
    if name.is_empty() || name.len() > NAME_MAX {
        return Err(bad("must be 1 to 96 characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    {
        return Err(bad("may only contain [A-Za-z0-9._-]"));
    }
    if name == "." || name == ".." {
        return Err(bad("must not be . or .."));
    }
    Ok(())
}

/// The job id of the tick of `name` at `t_ms`.
pub fn tick_id(name: &str, t_ms: u64) -> String {
    format!("{name}-{}", expr::id_time(t_ms))
}

/// The job id of a trigger of `name` requested at `t_ms`: a tick's id never has milliseconds.
pub fn trigger_id(name: &str, t_ms: u64) -> String {
    let s = expr::id_time(t_ms);
    format!("{name}-{}.{:03}Z", &s[..s.len() - 1], t_ms % 1000)
}

/// Whether `id` has the form of a tick's or a trigger's id, which only the leader creates:
/// `<schedule name>-<YYYYMMDD>T<HHMMSS>[.<mmm>]Z`.
pub fn is_reserved_id(id: &str) -> bool {
    let Some((name, time)) = id.rsplit_once('-') else {
        return false;
    };
    let b = time.as_bytes();
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    let shape = match b.len() {
        16 => digits(0..8) && b[8] == b'T' && digits(9..15) && b[15] == b'Z',
        20 => {
            digits(0..8)
                && b[8] == b'T'
                && digits(9..15)
                && b[15] == b'.'
                && digits(16..19)
                && b[19] == b'Z'
        }
        _ => false,
    };
    shape && validate_name(name).is_ok()
}

/// Refuses a submission under an id only schedules may use.
pub fn check_submitted_id(id: &str) -> Result<(), Invalid> {
    spec::validate_id(id)?;
    if is_reserved_id(id) {
        return Err(Invalid {
            field: "job_id",
            reason: "ids of the form <name>-<YYYYMMDD>T<HHMMSS>Z are reserved for schedules' ticks"
                .into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_and_trigger_ids_are_reserved_and_distinct() {
        let t = expr::parse_rfc3339("t", "2026-12-05T20:30:00Z").unwrap();
        assert_eq!(tick_id("backup", t), "backup-20261205T203000Z");
        assert_eq!(trigger_id("backup", t + 7), "backup-20261205T203000.007Z");
        assert_eq!(trigger_id("backup", t), "backup-20261205T203000.000Z");
        for id in [tick_id("backup", t), trigger_id("a.b-c", t + 999)] {
            assert!(is_reserved_id(&id), "{id}");
            assert!(check_submitted_id(&id).is_err());
            assert!(spec::validate_id(&id).is_ok());
        }
        for id in [
            "backup",
            "backup-2026",
            "backup-20261205T2030Z",
            "-20261205T203000Z",
        ] {
            assert!(!is_reserved_id(id), "{id}");
        }
        let longest = tick_id(&"n".repeat(NAME_MAX), t);
        assert!(spec::validate_id(&trigger_id(&"n".repeat(NAME_MAX), t)).is_ok());
        assert!(spec::validate_id(&longest).is_ok());
        assert!(validate_name(&"n".repeat(NAME_MAX + 1)).is_err());
        assert!(validate_name("a/b").is_err());
    }
}
