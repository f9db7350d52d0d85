//! Whether this worker can start guards at all.
//!
//! A failed guard spawn rejects its assignment (not counted against the job) and never runs the
//! job any other way. After [`FAILURES_IN_A_ROW`] failures in a row the worker is *unable*: its
//! record says why (the leader assigns it nothing, `worker list` shows it), and a probe spawns
//! the guard program the way guards are spawned, on the [`GUARD_PROBE`] backoff, until one
//! succeeds; then the mark goes and assignments come again.
//!
//! [`GUARD_PROBE`]: crate::retry::policies::GUARD_PROBE

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::exec::program::GuardProgram;
use crate::exec::spawner;

/// Spawn failures in a row that make a worker unable.
pub const FAILURES_IN_A_ROW: u32 = 3;

/// Shared by every attempt of a worker process, across its incarnations.
pub struct GuardHealth {
    failures: AtomicU32,
    /// Times the worker became unable since a job's guard last started: the probe's backoff
    /// goes on from there, so a failure the probe does not reproduce cannot make the worker
    /// flap at the probe's first pause.
    episodes: AtomicU32,
    /// Why the worker is unable, if it is.
    unable: watch::Sender<Option<String>>,
    program: Arc<GuardProgram>,
}

impl GuardHealth {
    pub fn new(program: Arc<GuardProgram>) -> Arc<GuardHealth> {
        Arc::new(GuardHealth {
            failures: AtomicU32::new(0),
            episodes: AtomicU32::new(0),
            unable: watch::Sender::new(None),
            program,
        })
    }

    /// Why the worker cannot take assignments now, if it cannot.
    pub fn unable(&self) -> Option<String> {
        self.unable.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<String>> {
        self.unable.subscribe()
    }

    /// A job's guard was spawned.
    pub fn spawned(&self) {
        self.failures.store(0, Ordering::SeqCst);
        self.episodes.store(0, Ordering::SeqCst);
        self.clear();
    }

    fn clear(&self) {
        self.unable.send_if_modified(|u| u.take().is_some());
    }

    /// A guard could not be spawned (or failed at once): the third failure in a row makes the
    /// worker unable and starts the probe.
    pub fn failed(self: &Arc<Self>, error: &std::io::Error) {
        let n = self.failures.fetch_add(1, Ordering::SeqCst) + 1;
        if n < FAILURES_IN_A_ROW {
            return;
        }
        let why = format!(
            "cannot start the guard {}: {error}",
            self.program.path().display()
        );
        let newly = self.unable.send_if_modified(|u| {
            let was = u.is_none();
            if was {
                *u = Some(why.clone());
            }
            was
        });
        if newly {
            let episode = self.episodes.fetch_add(1, Ordering::SeqCst);
            tracing::error!(reason = %why, "this worker takes no assignments until a guard can be started");
            tokio::spawn(self.clone().probe(episode));
        }
    }

    /// Spawns the guard program as guards are spawned until it works, then clears the mark.
    async fn probe(self: Arc<Self>, episode: u32) {
        let policy = crate::retry::policies::GUARD_PROBE;
        let mut n = episode;
        while self.unable().is_some() {
            n += 1;
            tokio::time::sleep(policy.delay(n).unwrap_or(Duration::from_secs(10))).await;
            match spawner::probe(&self.program).await {
                Ok(()) => {
                    tracing::info!("a guard can be started again: taking assignments");
                    self.failures.store(0, Ordering::SeqCst);
                    self.clear();
                }
                Err(e) => tracing::warn!(error = %e, "the guard still cannot be started"),
            }
        }
    }
}
