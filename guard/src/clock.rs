//! Time on `CLOCK_BOOTTIME`.
//!
//! Lease deadlines are compared against this clock because, unlike `CLOCK_MONOTONIC` (what
//! `std::time::Instant` and tokio use), it keeps counting while the host is suspended: a leader
//! whose VM was frozen for a minute must see that a minute passed. The values are nanoseconds
//! since boot, comparable between processes on one host, which is what lets a test or a drill
//! line up the role logs of several replicas.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

use nix::time::{clock_gettime, ClockId};
use serde::{Deserialize, Serialize};

/// A point on `CLOCK_BOOTTIME`, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BootInstant(u64);

impl BootInstant {
    pub fn now() -> Self {
        let ts =
            clock_gettime(ClockId::CLOCK_BOOTTIME).expect("CLOCK_BOOTTIME is available on Linux");
        Self(ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64)
    }

    pub const fn from_nanos(ns: u64) -> Self {
        Self(ns)
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time from `self` until `later`, zero if `later` is not later.
    pub fn until(self, later: BootInstant) -> Duration {
        Duration::from_nanos(later.0.saturating_sub(self.0))
    }

    /// Time left from now until `self`, zero if it has passed.
    pub fn remaining(self) -> Duration {
        BootInstant::now().until(self)
    }

    pub fn elapsed(self) -> Duration {
        self.until(BootInstant::now())
    }
}

impl Add<Duration> for BootInstant {
    type Output = BootInstant;
    fn add(self, d: Duration) -> BootInstant {
        BootInstant(self.0.saturating_add(d.as_nanos() as u64))
    }
}

impl Sub<Duration> for BootInstant {
    type Output = BootInstant;
    fn sub(self, d: Duration) -> BootInstant {
        BootInstant(self.0.saturating_sub(d.as_nanos() as u64))
    }
}

impl fmt::Display for BootInstant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{:09}s",
            self.0 / 1_000_000_000,
            self.0 % 1_000_000_000
        )
    }
}

/// Wall-clock milliseconds since the Unix epoch, for records humans read (never for deadlines).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_and_orders() {
        let a = BootInstant::from_nanos(1_000);
        assert_eq!((a + Duration::from_nanos(500)).as_nanos(), 1_500);
        assert_eq!((a - Duration::from_secs(1)).as_nanos(), 0);
        assert_eq!(a.until(BootInstant::from_nanos(400)), Duration::ZERO);
        let now = BootInstant::now();
        assert!(BootInstant::now() >= now);
    }
}
