//! The descriptors a worker promises to hold: it raises its soft `RLIMIT_NOFILE` to the hard
//! limit at start, and refuses a `--max-running` it could not hold, instead of failing guard
//! spawns (`EMFILE`) once that many jobs run.

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// Descriptors the worker holds per running guard: its stdin pipe's write end and two pidfds
/// (one awaited for its exit, one for signals).
pub const PER_SLOT: u64 = 3;

/// Descriptors for everything else: etcd and peer connections, listeners, console streams,
/// log reads, the spawn in progress.
pub const HEADROOM: u64 = 512;

#[derive(Debug, thiserror::Error)]
#[error("--max-running {max_running} and --max-cleanups {max_cleanups} need {need} file descriptors, and the hard limit (RLIMIT_NOFILE) is {hard}: raise it (ulimit -Hn, LimitNOFILE=, the container runtime's nofile) or run fewer jobs at once")]
pub struct TooFew {
    pub max_running: usize,
    pub max_cleanups: usize,
    pub need: u64,
    pub hard: u64,
}

/// Descriptors `slots` guards at once need.
pub fn needed(slots: usize) -> u64 {
    (slots as u64)
        .saturating_mul(PER_SLOT)
        .saturating_add(HEADROOM)
}

/// The descriptor limits of a worker after [`hold`].
#[derive(Clone, Copy, Debug)]
pub struct Held {
    /// The soft limit now in force.
    pub limit: u64,
    /// The soft limit before it was raised: what jobs get.
    pub original: u64,
}

/// Raises the soft limit to the hard one and checks that it holds `max_running` jobs and
/// `max_cleanups` cleanups at once.
pub fn hold(max_running: usize, max_cleanups: usize) -> Result<Held, TooFew> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap_or((1024, 1024));
    if soft < hard {
        if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            tracing::warn!(error = %e, soft, hard, "cannot raise the descriptor limit");
        }
    }
    let (now, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap_or((soft, hard));
    let need = needed(max_running + max_cleanups);
    if now < need {
        return Err(TooFew {
            max_running,
            max_cleanups,
            need,
            hard,
        });
    }
    Ok(Held {
        limit: now,
        original: soft,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_holds_what_it_promises_or_says_why_not() {
        assert_eq!(needed(64), 64 * 3 + 512);
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let held = hold(1, 1).unwrap();
        assert_eq!(held.limit, hard, "the soft limit is raised to the hard one");
        assert!(held.original <= hard);
        let too_many = (hard as usize) / 3 + 1;
        let err = hold(too_many, 1).unwrap_err();
        assert!(err.to_string().contains("RLIMIT_NOFILE"), "{err}");
        assert_eq!(err.hard, hard);
    }
}
