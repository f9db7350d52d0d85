//! The wall clock schedules follow: the system's, moved by a test-only offset
//! (`--test-clock-offset`) so a test can put a real cluster next to a daylight-saving change.
//! Every replica reads it for the times it stamps on definitions, and the leader for its ticks.

use std::sync::atomic::{AtomicI64, Ordering};

static OFFSET_MS: AtomicI64 = AtomicI64::new(0);

/// Test hook: moves this process's schedule clock by `ms` (may be negative).
pub fn set_offset_ms(ms: i64) {
    OFFSET_MS.store(ms, Ordering::Relaxed);
}

/// Unix ms on the schedule clock.
pub fn now_ms() -> u64 {
    let wall = crate::jobs::records::now_ms() as i64;
    (wall + OFFSET_MS.load(Ordering::Relaxed)).max(0) as u64
}
