//! When a schedule fires: its expression and zone, and the pure tick calculator.
//!
//! Cron fields are matched by `croner` on local wall-clock times; which instants those local
//! times stand for is decided here, so the daylight-saving rule is Baton's own and tested:
//! - an expression whose hour field is a wildcard or a step fires at every instant whose local
//!   time matches: both passes of a repeated hour, none in a skipped one;
//! - a fixed-hour expression fires once per matching local time: at the first pass of a
//!   repeated time, and at the first valid instant after a skipped one (the end of the gap).
//!
//! `@every D` ignores the zone: its ticks are `anchor + k·D` (k ≥ 1) in Unix time.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, LocalResult, NaiveDateTime, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;

use crate::jobs::spec::Invalid;

/// How far a zone's offset can move local time at one transition, with room to spare: a
/// candidate local time further than this from another maps to instants in the same order.
const MAX_SHIFT_SECS: i64 = 3 * 3600;

/// Searches for a next tick look this far ahead at most (a cron that never matches, such as
/// `0 0 30 2 *`, has no next tick).
const HORIZON_SECS: i64 = 5 * 366 * 24 * 3600;

/// The latest time a tick may fall on (Unix ms, the end of year 9999): stored times beyond it
/// are corrupt.
pub const MAX_MS: u64 = 253_402_300_799_000;

/// Candidate local times one search looks at, at most (a pattern that matches rarely costs a
/// few; this bounds a pathological one).
const SEARCH_MAX: usize = 100_000;

/// The shortest `@every` period.
pub const EVERY_MIN: Duration = Duration::from_secs(1);

/// A parsed time expression.
#[derive(Clone, Debug)]
pub enum Expr {
    Cron {
        cron: Box<Cron>,
        /// The hour field is a wildcard or a step: every matching instant fires.
        every_pass: bool,
    },
    Every(Duration),
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Invalid {
    Invalid {
        field,
        reason: reason.into(),
    }
}

impl Expr {
    /// Parses a 5-field cron expression (an optional seconds field first makes 6), an
    /// `@hourly`-style macro, or `@every D` (humantime, at least 1s).
    pub fn parse(text: &str) -> Result<Expr, Invalid> {
        let text = text.trim();
        if text.is_empty() || text.len() > 256 {
            return Err(invalid("cron", "must be 1 to 256 characters"));
        }
        if let Some(d) = text.strip_prefix("@every") {
            let d = humantime::parse_duration(d.trim())
                .map_err(|e| invalid("cron", format!("@every: {e}")))?;
            if d < EVERY_MIN {
                return Err(invalid("cron", "@every must be at least 1s"));
            }
            if d.subsec_nanos() % 1_000_000 != 0 {
                return Err(invalid("cron", "@every takes whole milliseconds"));
            }
            return Ok(Expr::Every(d));
        }
        let lower = text.to_ascii_lowercase();
        let every_pass = match lower.as_str() {
            "@hourly" => true,
            "@daily" | "@midnight" | "@weekly" | "@monthly" | "@yearly" | "@annually" => false,
            m if m.starts_with('@') => {
                return Err(invalid(
                    "cron",
                    format!("unknown macro {m}: use @hourly, @daily, @weekly, @monthly, @yearly or @every D"),
                ))
            }
            _ => {
                let fields: Vec<&str> = text.split_whitespace().collect();
                let hour = match fields.len() {
                    5 => fields[1],
                    6 => fields[2],
                    n => {
                        return Err(invalid(
                            "cron",
                            format!("has {n} fields; 5 (minute hour day month weekday), or 6 with seconds first"),
                        ))
                    }
                };
                hour.contains('*') || hour.contains('/')
            }
        };
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build();
        let cron = parser
            .parse(text)
            .map_err(|e| invalid("cron", e.to_string()))?;
        Ok(Expr::Cron {
            cron: Box::new(cron),
            every_pass,
        })
    }
}

/// An IANA zone name, such as `Europe/Berlin` or `UTC`.
pub fn parse_tz(name: &str) -> Result<Tz, Invalid> {
    Tz::from_str(name).map_err(|_| invalid("tz", format!("{name:?} is not an IANA time zone")))
}

/// A schedule's timing: when its ticks fall.
#[derive(Clone, Debug)]
pub struct Timing {
    pub expr: Expr,
    pub tz: Tz,
    /// `@every`'s anchor, Unix ms (whole seconds).
    pub anchor_ms: u64,
}

impl Timing {
    pub fn new(expr: &str, tz: &str, anchor_ms: u64) -> Result<Timing, Invalid> {
        Ok(Timing {
            expr: Expr::parse(expr)?,
            tz: parse_tz(tz)?,
            anchor_ms,
        })
    }

    /// The first tick strictly after `after_ms` (Unix ms), if any within the horizon.
    pub fn next_after(&self, after_ms: u64) -> Option<u64> {
        if after_ms >= MAX_MS {
            return None;
        }
        match &self.expr {
            Expr::Every(d) => {
                let d = d.as_millis() as u64;
                if after_ms < self.anchor_ms {
                    return Some(self.anchor_ms + d);
                }
                let k = (after_ms - self.anchor_ms) / d + 1;
                Some(self.anchor_ms + k * d)
            }
            Expr::Cron { cron, every_pass } => next_cron(cron, *every_pass, self.tz, after_ms),
        }
    }

    /// The ticks in `(after_ms, until_ms]`, oldest first, at most `cap` of them, and whether
    /// more were left out.
    pub fn ticks(&self, after_ms: u64, until_ms: u64, cap: usize) -> (Vec<u64>, bool) {
        let mut out = Vec::new();
        let mut t = after_ms;
        while let Some(n) = self.next_after(t).filter(|n| *n <= until_ms) {
            if out.len() == cap {
                return (out, true);
            }
            out.push(n);
            t = n;
        }
        (out, false)
    }

    /// The newest of the ticks in `(after_ms, until_ms]` and how many there are, counting at
    /// most `cap` of them; with more, the newest of those counted and `true`.
    pub fn last_and_count(
        &self,
        after_ms: u64,
        until_ms: u64,
        cap: u64,
    ) -> (Option<u64>, u64, bool) {
        if let Expr::Every(d) = &self.expr {
            let d = d.as_millis() as u64;
            let n = self.count(after_ms, until_ms, u64::MAX);
            if n == 0 {
                return (None, 0, false);
            }
            let first = self.next_after(after_ms).unwrap_or(after_ms);
            let taken = n.min(cap);
            return (Some(first + (taken - 1) * d), taken, n > cap);
        }
        let (mut last, mut n) = (None, 0);
        let mut t = after_ms;
        while let Some(x) = self.next_after(t).filter(|x| *x <= until_ms) {
            if n == cap {
                return (last, n, true);
            }
            n += 1;
            last = Some(x);
            t = x;
        }
        (last, n, false)
    }

    /// How many ticks fall in `(after_ms, until_ms]`, counting at most `cap`.
    pub fn count(&self, after_ms: u64, until_ms: u64, cap: u64) -> u64 {
        if let Expr::Every(d) = &self.expr {
            let d = d.as_millis() as u64;
            let upto = |t: u64| {
                if t < self.anchor_ms + d {
                    0
                } else {
                    (t - self.anchor_ms) / d
                }
            };
            return upto(until_ms).saturating_sub(upto(after_ms)).min(cap);
        }
        let mut n = 0;
        let mut t = after_ms;
        while n < cap {
            match self.next_after(t).filter(|x| *x <= until_ms) {
                Some(x) => {
                    n += 1;
                    t = x;
                }
                None => break,
            }
        }
        n
    }
}

fn utc_ms(ms: u64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms as i64).unwrap_or_default()
}

/// The next local time after `after` (exclusive) that the pattern matches, as a naive time.
fn next_local(cron: &Cron, after: NaiveDateTime) -> Option<NaiveDateTime> {
    // Matching is field by field, so a naive time read as UTC matches as the local time.
    // Whole seconds: croner keeps the fraction it was given.
    let after = after.with_nanosecond(0).unwrap_or(after);
    cron.find_next_occurrence(&Utc.from_utc_datetime(&after), false)
        .ok()
        .map(|d| d.naive_utc().with_nanosecond(0).unwrap_or(d.naive_utc()))
}

/// The instants a matching local time stands for (see the module doc).
fn instants(tz: Tz, local: NaiveDateTime, every_pass: bool) -> Vec<i64> {
    match tz.from_local_datetime(&local) {
        LocalResult::Single(d) => vec![d.timestamp_millis()],
        LocalResult::Ambiguous(a, b) => {
            let (a, b) = (a.timestamp_millis(), b.timestamp_millis());
            let (first, second) = (a.min(b), a.max(b));
            if every_pass {
                vec![first, second]
            } else {
                vec![first]
            }
        }
        LocalResult::None if every_pass => Vec::new(),
        LocalResult::None => {
            // The first valid instant after the gap: its end, on a minute boundary.
            let mut m = local.with_second(0).unwrap_or(local);
            for _ in 0..(MAX_SHIFT_SECS / 60) {
                m += chrono::Duration::minutes(1);
                match tz.from_local_datetime(&m) {
                    LocalResult::Single(d) => return vec![d.timestamp_millis()],
                    LocalResult::Ambiguous(a, b) => {
                        return vec![a.timestamp_millis().min(b.timestamp_millis())]
                    }
                    LocalResult::None => {}
                }
            }
            Vec::new()
        }
    }
}

/// The zone's offset from UTC at Unix ms `ms`, in ms.
fn offset_ms(tz: Tz, ms: i64) -> i64 {
    use chrono::Offset;
    let at = DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .naive_utc();
    tz.offset_from_utc_datetime(&at).fix().local_minus_utc() as i64 * 1000
}

fn next_cron(cron: &Cron, every_pass: bool, tz: Tz, after_ms: u64) -> Option<u64> {
    let after = after_ms as i64;
    let shift = MAX_SHIFT_SECS * 1000;
    let local = utc_ms(after_ms).with_timezone(&tz).naive_local();
    // A later instant stands for an earlier local time only after the offset falls (the
    // second pass of a repeated hour): start the search back by that fall, if one is near.
    let fall = (offset_ms(tz, after) - offset_ms(tz, after + shift)).max(0);
    let mut cursor = local - chrono::Duration::milliseconds(fall + 1000);
    let limit = local
        .checked_add_signed(chrono::Duration::seconds(HORIZON_SECS))
        .unwrap_or(NaiveDateTime::MAX);
    let mut best: Option<(i64, NaiveDateTime)> = None;
    for _ in 0..SEARCH_MAX {
        let n = next_local(cron, cursor)?;
        if n > limit {
            break;
        }
        if let Some((b, at)) = best {
            // A later local time stands for an earlier instant only after the offset rose (a
            // skipped hour) between the two: look on only as far as that rise.
            let rise = (offset_ms(tz, b - shift) - offset_ms(tz, b)).max(0);
            if n > at + chrono::Duration::milliseconds(rise) {
                break;
            }
        }
        for t in instants(tz, n, every_pass) {
            if t > after && best.is_none_or(|(b, _)| t < b) {
                best = Some((t, n));
            }
        }
        cursor = n;
    }
    best.map(|(t, _)| t as u64)
}

/// `20261205T203000Z`: a tick's time in its job id.
pub fn id_time(ms: u64) -> String {
    utc_ms(ms).format("%Y%m%dT%H%M%SZ").to_string()
}

/// RFC 3339 in UTC (`2026-12-05T20:30:00Z`; milliseconds only when there are any).
pub fn rfc3339(ms: u64) -> String {
    let d = utc_ms(ms);
    if ms % 1000 == 0 {
        d.format("%Y-%m-%dT%H:%M:%SZ").to_string()
    } else {
        d.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
    }
}

/// Parses RFC 3339 (any offset) to Unix ms.
pub fn parse_rfc3339(field: &'static str, s: &str) -> Result<u64, Invalid> {
    DateTime::parse_from_rfc3339(s)
        .map_err(|e| invalid(field, format!("{s:?} is not an RFC 3339 time: {e}")))
        .and_then(|d| {
            u64::try_from(d.timestamp_millis()).map_err(|_| invalid(field, "is before 1970"))
        })
}

/// A time shown in the schedule's zone (`2026-03-29 03:00:00 CEST`).
pub fn local_display(ms: u64, tz: Tz) -> String {
    utc_ms(ms)
        .with_timezone(&tz)
        .format("%Y-%m-%d %H:%M:%S %Z")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> u64 {
        parse_rfc3339("t", s).unwrap()
    }

    /// The ticks of `expr` in `tz` from `from` (exclusive) to `to`, as RFC 3339 UTC.
    fn ticks(expr: &str, tz: &str, from: &str, to: &str) -> Vec<String> {
        let t = Timing::new(expr, tz, 0).unwrap();
        let (v, more) = t.ticks(at(from), at(to), 10_000);
        assert!(!more);
        v.into_iter().map(rfc3339).collect()
    }

    #[test]
    fn plain_cron_in_utc() {
        assert_eq!(
            ticks(
                "*/20 * * * *",
                "UTC",
                "2026-12-05T20:00:00Z",
                "2026-12-05T21:00:00Z"
            ),
            [
                "2026-12-05T20:20:00Z",
                "2026-12-05T20:40:00Z",
                "2026-12-05T21:00:00Z"
            ]
        );
        assert_eq!(
            ticks(
                "*/2 * * * * *",
                "UTC",
                "2026-12-05T20:00:00Z",
                "2026-12-05T20:00:05Z"
            ),
            ["2026-12-05T20:00:02Z", "2026-12-05T20:00:04Z"]
        );
        assert_eq!(
            ticks(
                "@daily",
                "UTC",
                "2026-12-05T20:00:00Z",
                "2026-12-07T00:00:00Z"
            ),
            ["2026-12-06T00:00:00Z", "2026-12-07T00:00:00Z"]
        );
    }

    // Europe/Berlin 2026: 29 March 02:00 CET -> 03:00 CEST; 25 October 03:00 CEST -> 02:00 CET.
    #[test]
    fn berlin_spring_forward() {
        // Fixed hour in the gap: once, at the gap's end (03:00 CEST = 01:00Z).
        assert_eq!(
            ticks(
                "30 2 * * *",
                "Europe/Berlin",
                "2026-03-28T12:00:00Z",
                "2026-03-30T12:00:00Z"
            ),
            ["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]
        );
        // Two fixed times in the gap fire once between them.
        assert_eq!(
            ticks(
                "0,30 2 * * *",
                "Europe/Berlin",
                "2026-03-29T00:00:00Z",
                "2026-03-29T12:00:00Z"
            ),
            ["2026-03-29T01:00:00Z"]
        );
        // A wildcard hour fires at every instant that matches: none in the gap.
        assert_eq!(
            ticks(
                "30 * * * *",
                "Europe/Berlin",
                "2026-03-29T00:00:00Z",
                "2026-03-29T02:00:00Z"
            ),
            ["2026-03-29T00:30:00Z", "2026-03-29T01:30:00Z"]
        );
    }

    #[test]
    fn berlin_fall_back() {
        // Fixed hour in the repeated hour: the first pass only (02:30 CEST = 00:30Z).
        assert_eq!(
            ticks(
                "30 2 * * *",
                "Europe/Berlin",
                "2026-10-24T12:00:00Z",
                "2026-10-26T12:00:00Z"
            ),
            ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]
        );
        // A wildcard hour: both passes, in time order.
        assert_eq!(
            ticks(
                "*/30 * * * *",
                "Europe/Berlin",
                "2026-10-24T23:45:00Z",
                "2026-10-25T02:10:00Z"
            ),
            [
                "2026-10-25T00:00:00Z", // 02:00 CEST
                "2026-10-25T00:30:00Z", // 02:30 CEST
                "2026-10-25T01:00:00Z", // 02:00 CET
                "2026-10-25T01:30:00Z", // 02:30 CET
                "2026-10-25T02:00:00Z", // 03:00 CET
            ]
        );
        // A step in the hour field counts as a wildcard.
        assert_eq!(
            ticks(
                "15 */2 * * *",
                "Europe/Berlin",
                "2026-10-25T00:00:00Z",
                "2026-10-25T01:30:00Z"
            ),
            ["2026-10-25T00:15:00Z", "2026-10-25T01:15:00Z"]
        );
    }

    // America/New_York 2026: 8 March 02:00 EST -> 03:00 EDT; 1 November 02:00 EDT -> 01:00 EST.
    #[test]
    fn new_york() {
        assert_eq!(
            ticks(
                "15 2 * * *",
                "America/New_York",
                "2026-03-07T00:00:00Z",
                "2026-03-09T12:00:00Z"
            ),
            [
                "2026-03-07T07:15:00Z",
                "2026-03-08T07:00:00Z",
                "2026-03-09T06:15:00Z"
            ]
        );
        assert_eq!(
            ticks(
                "30 1 * * *",
                "America/New_York",
                "2026-10-31T12:00:00Z",
                "2026-11-02T12:00:00Z"
            ),
            ["2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"]
        );
        assert_eq!(
            ticks(
                "30 * * * *",
                "America/New_York",
                "2026-11-01T04:00:00Z",
                "2026-11-01T07:00:00Z"
            ),
            [
                "2026-11-01T04:30:00Z", // 00:30 EDT
                "2026-11-01T05:30:00Z", // 01:30 EDT
                "2026-11-01T06:30:00Z", // 01:30 EST
            ]
        );
        // @hourly is a wildcard hour.
        assert_eq!(
            ticks(
                "@hourly",
                "America/New_York",
                "2026-11-01T04:30:00Z",
                "2026-11-01T07:00:00Z"
            ),
            [
                "2026-11-01T05:00:00Z",
                "2026-11-01T06:00:00Z",
                "2026-11-01T07:00:00Z"
            ]
        );
    }

    // Australia/Lord_Howe 2026: a half-hour shift. 5 April 02:00 (+11) -> 01:30 (+10:30);
    // 4 October 02:00 (+10:30) -> 02:30 (+11).
    #[test]
    fn lord_howe_half_hour_shift() {
        // 01:45 happens twice on 5 April: fixed hour fires at the first pass (14:45Z).
        assert_eq!(
            ticks(
                "45 1 * * *",
                "Australia/Lord_Howe",
                "2026-04-04T12:00:00Z",
                "2026-04-05T12:00:00Z"
            ),
            ["2026-04-04T14:45:00Z"]
        );
        assert_eq!(
            ticks(
                "45 * * * *",
                "Australia/Lord_Howe",
                "2026-04-04T14:00:00Z",
                "2026-04-04T16:00:00Z"
            ),
            [
                "2026-04-04T14:45:00Z", // 01:45 +11
                "2026-04-04T15:15:00Z", // 01:45 +10:30
            ]
        );
        // 02:15 does not exist on 4 October: fixed hour fires at 02:30 +11 (15:30Z).
        assert_eq!(
            ticks(
                "15 2 * * *",
                "Australia/Lord_Howe",
                "2026-10-03T12:00:00Z",
                "2026-10-04T12:00:00Z"
            ),
            ["2026-10-03T15:30:00Z"]
        );
        assert_eq!(
            ticks(
                "15 * * * *",
                "Australia/Lord_Howe",
                "2026-10-03T14:00:00Z",
                "2026-10-03T17:00:00Z"
            ),
            [
                "2026-10-03T14:45:00Z", // 01:15 +10:30
                "2026-10-03T16:15:00Z", // 03:15 +11
            ]
        );
    }

    #[test]
    fn every_counts_from_its_anchor() {
        let t = Timing::new("@every 90s", "UTC", at("2026-12-05T20:00:00Z")).unwrap();
        let (v, _) = t.ticks(at("2026-12-05T20:00:00Z"), at("2026-12-05T20:05:00Z"), 100);
        let v: Vec<String> = v.into_iter().map(rfc3339).collect();
        assert_eq!(
            v,
            [
                "2026-12-05T20:01:30Z",
                "2026-12-05T20:03:00Z",
                "2026-12-05T20:04:30Z"
            ]
        );
        assert_eq!(
            t.count(at("2026-12-05T20:00:00Z"), at("2026-12-05T21:00:00Z"), 1000),
            40
        );
        assert_eq!(
            t.count(at("2026-12-05T19:00:00Z"), at("2026-12-05T20:01:00Z"), 1000),
            0
        );
        // Ticks in a zone's gap are not an issue for @every: Unix time has none.
        let t = Timing::new("@every 1h", "Europe/Berlin", at("2026-03-29T00:00:00Z")).unwrap();
        assert_eq!(
            t.count(at("2026-03-29T00:00:00Z"), at("2026-03-29T03:00:00Z"), 10),
            3
        );
    }

    #[test]
    fn counting_matches_listing() {
        let t = Timing::new("*/7 * * * * *", "Europe/Berlin", 0).unwrap();
        let (a, b) = (at("2026-10-25T00:00:00Z"), at("2026-10-25T02:00:00Z"));
        assert_eq!(
            t.count(a, b, u64::MAX),
            t.ticks(a, b, usize::MAX).0.len() as u64
        );
    }

    #[test]
    fn bad_expressions_name_the_field() {
        for bad in [
            "",
            "* * *",
            "61 * * * *",
            "@every 500ms",
            "@every x",
            "@sometimes",
            "* * * * * * *",
        ] {
            let e = Expr::parse(bad).unwrap_err();
            assert_eq!(e.field, "cron", "{bad}");
        }
        assert_eq!(parse_tz("Mars/Olympus").unwrap_err().field, "tz");
        assert!(parse_tz("Australia/Lord_Howe").is_ok());
        // A date that never comes has no next tick.
        let t = Timing::new("0 0 30 2 *", "UTC", 0).unwrap();
        assert_eq!(t.next_after(at("2026-01-01T00:00:00Z")), None);
    }

    #[test]
    fn ticks_fall_on_whole_seconds_whatever_the_start() {
        let t = Timing::new("30 2 * * *", "Europe/Berlin", 0).unwrap();
        let from = at("2026-03-29T00:59:25Z") + 723;
        assert_eq!(rfc3339(t.next_after(from).unwrap()), "2026-03-29T01:00:00Z");
        let t = Timing::new("* * * * * *", "UTC", 0).unwrap();
        assert_eq!(
            t.next_after(at("2026-12-05T20:00:00Z") + 999),
            Some(at("2026-12-05T20:00:01Z"))
        );
        assert_eq!(
            t.next_after(at("2026-12-05T20:00:00Z")),
            Some(at("2026-12-05T20:00:01Z"))
        );
    }

    #[test]
    fn ids_and_times() {
        let t = at("2026-12-05T20:30:00Z");
        assert_eq!(id_time(t), "20261205T203000Z");
        assert_eq!(rfc3339(t), "2026-12-05T20:30:00Z");
        assert_eq!(rfc3339(t + 5), "2026-12-05T20:30:00.005Z");
        assert_eq!(
            local_display(
                at("2026-03-29T01:00:00Z"),
                parse_tz("Europe/Berlin").unwrap()
            ),
            "2026-03-29 03:00:00 CEST"
        );
    }
}
