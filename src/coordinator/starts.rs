//! The start budget: at most `--max-starts-per-second` job starts, with a burst of one second's
//! worth, so that thousands of queued starts (a recovery, a burst of submissions) cannot load
//! the host enough to delay a keepalive. Jobs waiting for it stay PENDING, in submission order.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct StartBudget {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl StartBudget {
    /// A full budget of `rate` starts per second (at least one start may always be made).
    pub fn new(rate: f64, now: Instant) -> StartBudget {
        let rate = rate.max(0.001);
        let burst = rate.max(1.0);
        StartBudget {
            rate,
            burst,
            tokens: burst,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.at = now;
    }

    /// Takes one start if the budget has one.
    pub fn try_take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Returns a start that was taken but not made.
    pub fn give_back(&mut self) {
        self.tokens = (self.tokens + 1.0).min(self.burst);
    }

    /// When the next start will be available (`now` if one is).
    pub fn next_at(&mut self, now: Instant) -> Instant {
        self.refill(now);
        let missing = (1.0 - self.tokens).max(0.0);
        now + Duration::from_secs_f64(missing / self.rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_one_second_then_the_rate() {
        let t0 = Instant::now();
        let mut b = StartBudget::new(10.0, t0);
        assert_eq!((0..25).filter(|_| b.try_take(t0)).count(), 10);
        let later = t0 + Duration::from_millis(500);
        assert_eq!((0..25).filter(|_| b.try_take(later)).count(), 5);
        let wait = b.next_at(later) - later;
        assert!(wait > Duration::from_millis(90) && wait <= Duration::from_millis(100));
        b.give_back();
        assert!(b.try_take(later));
        assert!(!b.try_take(later));
    }

    #[test]
    fn a_slow_rate_still_allows_one_start() {
        let t0 = Instant::now();
        let mut b = StartBudget::new(0.5, t0);
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0 + Duration::from_secs(1)));
        assert!(b.try_take(t0 + Duration::from_secs(2)));
    }
}
