//! Every retry and backoff of the project, in one place: cleanup steps, job attempts, the
//! election's campaign, the CLI's rounds over endpoints, workers' reconnects and reports, the
//! leader's recovery reads.
//!
//! A [`Policy`] is a pure function of the failure count: `delay_with(n, unit)` is the pause
//! after the `n`-th failure in a row (1 = the first), or `None` when no further attempt is
//! allowed. Jitter is drawn by the caller (`unit` in `[0, 1)`), so the arithmetic is tested
//! for exact values; [`Policy::delay`] draws it. Loops keep only a counter ([`Backoff`]).
//!
//! The names follow Flink's restart and cleanup strategies (`exponential-delay`,
//! `fixed-delay`, `none`).

use std::time::Duration;

/// How a failed operation is retried.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    /// `initial`, doubling (`multiplier`) up to `max`; each delay scaled by a factor drawn
    /// from `1 ± jitter`, then capped at `max`.
    Exponential {
        initial: Duration,
        max: Duration,
        multiplier: f64,
        jitter: f64,
        /// Failures allowed before giving up; `None`: unlimited.
        attempts: Option<u32>,
    },
    /// The same `delay` after every failure.
    Fixed {
        delay: Duration,
        attempts: Option<u32>,
    },
    /// No retry: the first failure is final.
    None,
}

impl Policy {
    /// Exponential doubling without jitter and without a limit: loops that must go on.
    pub const fn doubling(initial: Duration, max: Duration) -> Policy {
        Policy::Exponential {
            initial,
            max,
            multiplier: 2.0,
            jitter: 0.0,
            attempts: None,
        }
    }

    /// The same policy with jitter (a fraction of each delay, both ways).
    pub fn with_jitter(self, jitter: f64) -> Policy {
        match self {
            Policy::Exponential {
                initial,
                max,
                multiplier,
                attempts,
                ..
            } => Policy::Exponential {
                initial,
                max,
                multiplier,
                jitter,
                attempts,
            },
            other => other,
        }
    }

    /// The pause after failure number `failures` (1 = the first), with the jitter `unit`
    /// picks (`0.0` the shortest, `0.5` none, towards `1.0` the longest); `None` once
    /// `failures` has reached the allowed attempts. Failure 0 (nothing failed yet) waits
    /// nothing.
    pub fn delay_with(&self, failures: u32, unit: f64) -> Option<Duration> {
        if failures == 0 {
            return Some(Duration::ZERO);
        }
        match *self {
            Policy::None => None,
            Policy::Fixed { delay, attempts } => {
                (attempts.is_none_or(|a| failures < a)).then_some(delay)
            }
            Policy::Exponential {
                initial,
                max,
                multiplier,
                jitter,
                attempts,
            } => {
                if attempts.is_some_and(|a| failures >= a) {
                    return None;
                }
                let exp = (failures - 1).min(1024) as i32;
                let base =
                    (initial.as_secs_f64() * multiplier.max(1.0).powi(exp)).min(max.as_secs_f64());
                let j = jitter.clamp(0.0, 1.0);
                let factor = 1.0 - j + 2.0 * j * unit.clamp(0.0, 1.0);
                let secs = (base * factor).min(max.as_secs_f64()).max(0.0);
                Some(Duration::from_secs_f64(secs))
            }
        }
    }

    /// [`Self::delay_with`] with a random jitter.
    pub fn delay(&self, failures: u32) -> Option<Duration> {
        self.delay_with(failures, fastrand::f64())
    }

    /// Whether another attempt is allowed after `failures` failures.
    pub fn allows(&self, failures: u32) -> bool {
        self.delay_with(failures, 0.5).is_some()
    }

    /// A counter over this policy, for loops that retry until they succeed.
    pub fn backoff(self) -> Backoff {
        Backoff {
            policy: self,
            failures: 0,
        }
    }
}

/// A loop's position in its [`Policy`]: how many failures in a row so far.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: Policy,
    failures: u32,
}

impl Backoff {
    /// Counts a failure and returns the pause before the next try; for a policy that gives
    /// up, its longest pause (loops built on this never give up).
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.policy
            .delay(self.failures)
            .unwrap_or_else(|| self.policy.delay_with(1, 1.0).unwrap_or_default())
    }

    /// After a success: the next failure waits the initial delay again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Counts a failure and sleeps its pause.
    pub async fn pause(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }
}

/// The retry settings of the whole project, named where they are used.
pub mod policies {
    use super::Policy;
    use std::time::Duration;

    /// The election: granting a lease, campaigning, confirming a win.
    pub const ELECTION: Policy =
        Policy::doubling(Duration::from_millis(100), Duration::from_secs(2));
    /// A follower opening its stream to the leader again (fast failover): short at first, since
    /// a new leader confirms its term within milliseconds of winning.
    pub const LEADER_WATCH: Policy =
        Policy::doubling(Duration::from_millis(50), Duration::from_secs(1));
    /// A follower probing a leader whose stream ended, when a connection was taken and dropped
    /// unanswered (a process closing its sockets as it dies): again soon, within the bound.
    pub const PROBE_AGAIN: Policy =
        Policy::doubling(Duration::from_millis(10), Duration::from_millis(100));
    /// A worker that cannot start guards trying a spawn again (it takes no assignments
    /// meanwhile).
    pub const GUARD_PROBE: Policy =
        Policy::doubling(Duration::from_millis(500), Duration::from_secs(10));
    /// The CLI's rounds over the endpoints it was given.
    pub const CLIENT_ROUNDS: Policy =
        Policy::doubling(Duration::from_millis(100), Duration::from_secs(1));
    /// A worker granting its lease and registering after losing its incarnation.
    pub const WORKER_RECONNECT: Policy =
        Policy::doubling(Duration::from_millis(200), Duration::from_secs(2));
    /// A worker's report of an attempt's end, until etcd takes it.
    pub const WORKER_REPORT: Policy =
        Policy::doubling(Duration::from_millis(100), Duration::from_secs(2));
    /// Reading and watching again after a watch failed (the leader's, the cleaner's, a
    /// worker's).
    pub const RESYNC: Policy = Policy::doubling(Duration::from_millis(300), Duration::from_secs(2));
    /// A worker's loop reading its assignments again: short, since its watchdog (TTL/2,
    /// at least 1 s) is not fed while it pauses.
    pub const WORKER_RESYNC: Policy =
        Policy::doubling(Duration::from_millis(150), Duration::from_millis(300));
    /// The leader's recovery reads.
    pub const RECOVERY: Policy =
        Policy::doubling(Duration::from_millis(100), Duration::from_secs(2));
    /// A cleanup step that ran nothing (no worker, rejected, lost, unanswered): uncounted
    /// tries, 1 s doubling to 32 s.
    pub const CLEANUP_UNRUN: Policy =
        Policy::doubling(Duration::from_secs(1), Duration::from_secs(32));
    /// A leader transition that etcd failed: 0.5 to 1.5 s, so jobs that failed together
    /// come back apart.
    pub const TRANSITION: Policy = Policy::Exponential {
        initial: Duration::from_secs(1),
        max: Duration::from_millis(1500),
        multiplier: 1.0,
        jitter: 0.5,
        attempts: None,
    };
    /// A failed job attempt: `initial` doubling to `max` (`--retry-initial-delay`,
    /// `--retry-max-delay`); how many attempts is the job's own `max_attempts`.
    pub fn job_retry(initial: Duration, max: Duration) -> Policy {
        Policy::doubling(initial, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    fn exp(initial: f64, max: f64, jitter: f64, attempts: Option<u32>) -> Policy {
        Policy::Exponential {
            initial: s(initial),
            max: s(max),
            multiplier: 2.0,
            jitter,
            attempts,
        }
    }

    #[test]
    fn exponential_starts_at_the_initial_delay_doubles_and_stops_at_the_cap() {
        let p = exp(1.0, 4.0, 0.0, None);
        let got: Vec<Duration> = (1..=6).map(|n| p.delay_with(n, 0.7).unwrap()).collect();
        assert_eq!(got, [1.0, 2.0, 4.0, 4.0, 4.0, 4.0].map(s));
        let p = exp(3.0, 3600.0, 0.0, None);
        assert_eq!(
            p.delay_with(1, 0.0),
            Some(s(3.0)),
            "the first retry waits 3 s"
        );
        assert_eq!(p.delay_with(2, 0.0), Some(s(6.0)));
        assert_eq!(p.delay_with(13, 0.0), Some(s(3600.0)));
        assert_eq!(p.delay_with(u32::MAX, 0.0), Some(s(3600.0)), "no overflow");
        assert_eq!(p.delay_with(0, 0.3), Some(Duration::ZERO));
    }

    #[test]
    fn jitter_stays_within_its_bounds_and_never_passes_the_cap() {
        let p = exp(1.0, 4.0, 0.1, None);
        assert_eq!(p.delay_with(1, 0.0), Some(s(0.9)));
        assert_eq!(p.delay_with(1, 0.5), Some(s(1.0)));
        assert_eq!(p.delay_with(2, 1.0), Some(s(2.2)));
        assert_eq!(p.delay_with(3, 1.0), Some(s(4.0)), "capped after jitter");
        assert_eq!(p.delay_with(3, 0.0), Some(s(3.6)));
        for n in 1..=8 {
            for _ in 0..200 {
                let d = p.delay(n).unwrap();
                let base = (2f64.powi(n as i32 - 1)).min(4.0);
                assert!(
                    d >= s(base * 0.9) && d <= s((base * 1.1).min(4.0)),
                    "{n}: {d:?}"
                );
            }
        }
    }

    #[test]
    fn attempts_limit_the_retries_of_every_policy() {
        let p = exp(1.0, 10.0, 0.0, Some(3));
        assert!(p.delay_with(2, 0.5).is_some());
        assert_eq!(p.delay_with(3, 0.5), None, "the third failure is the last");
        assert!(!p.allows(3));
        let f = Policy::Fixed {
            delay: s(2.0),
            attempts: None,
        };
        assert_eq!(
            (1..=5).map(|n| f.delay_with(n, 0.9)).collect::<Vec<_>>(),
            vec![Some(s(2.0)); 5]
        );
        let f = Policy::Fixed {
            delay: s(2.0),
            attempts: Some(2),
        };
        assert_eq!(f.delay_with(1, 0.0), Some(s(2.0)));
        assert_eq!(f.delay_with(2, 0.0), None);
        assert_eq!(Policy::None.delay_with(1, 0.5), None);
        assert!(!Policy::None.allows(1));
        assert!(Policy::None.allows(0));
    }

    #[test]
    fn named_policies_yield_their_documented_delays() {
        let e = policies::ELECTION;
        assert_eq!(e.delay_with(1, 0.5), Some(Duration::from_millis(100)));
        assert_eq!(e.delay_with(2, 0.5), Some(Duration::from_millis(200)));
        assert_eq!(e.delay_with(6, 0.5), Some(Duration::from_secs(2)));
        assert_eq!(
            policies::CLIENT_ROUNDS.delay_with(5, 0.5),
            Some(Duration::from_secs(1))
        );
        let w = policies::LEADER_WATCH;
        assert_eq!(
            (1..=6)
                .map(|n| w.delay_with(n, 0.5).unwrap())
                .collect::<Vec<_>>(),
            [0.05, 0.1, 0.2, 0.4, 0.8, 1.0].map(s)
        );
        assert_eq!(
            policies::PROBE_AGAIN.delay_with(5, 0.5),
            Some(Duration::from_millis(100))
        );
        let g = policies::GUARD_PROBE;
        assert_eq!(
            (1..=7)
                .map(|n| g.delay_with(n, 0.5).unwrap())
                .collect::<Vec<_>>(),
            [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0].map(s)
        );
        let u = policies::CLEANUP_UNRUN;
        assert_eq!(
            (1..=7)
                .map(|n| u.delay_with(n, 0.5).unwrap())
                .collect::<Vec<_>>(),
            [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 32.0].map(s)
        );
        let t = policies::TRANSITION;
        assert_eq!(t.delay_with(1, 0.0), Some(s(0.5)));
        assert_eq!(t.delay_with(9, 0.5), Some(s(1.0)), "it does not grow");
        assert_eq!(t.delay_with(9, 1.0), Some(s(1.5)));
        let j = policies::job_retry(s(1.0), s(300.0));
        assert_eq!(j.delay_with(3, 0.9), Some(s(4.0)));
        assert_eq!(j.delay_with(20, 0.9), Some(s(300.0)));
    }

    #[test]
    fn a_backoff_counts_failures_and_starts_over_after_a_reset() {
        let mut b =
            Policy::doubling(Duration::from_millis(100), Duration::from_millis(400)).backoff();
        let got: Vec<u128> = (0..4).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 400]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
        let mut none = Policy::None.backoff();
        assert_eq!(none.next_delay(), Duration::ZERO);
    }
}
