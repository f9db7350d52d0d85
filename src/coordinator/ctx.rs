//! What the leader's tasks share: settings and the etcd handles.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::starts::StartBudget;
use crate::jobs::{self, Snapshot};
use crate::store::group::Limits;
use crate::store::{GroupCommit, Keys, Store};

#[derive(Clone, Debug)]
pub struct CoordinatorConfig {
    pub replica_id: String,
    /// Job folders on this host (of its embedded worker) the folder stage also removes.
    pub storage_dir: PathBuf,
    pub max_recoveries: u32,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// Assignments and cleanup starts per second, at most (a burst of one second's worth).
    pub max_starts_per_second: f64,
    pub cleanup: CleanupConfig,
    /// Test hook: see `--test-pause-before-assign`.
    pub pause_before_assign: Option<PathBuf>,
}

/// What every task of the leader shares.
pub struct Ctx {
    pub(crate) store: Store,
    pub(crate) keys: Keys,
    pub(crate) config: CoordinatorConfig,
    /// One budget for every start: jobs and cleanup commands alike.
    starts: Mutex<StartBudget>,
    /// Reads of whole jobs by the leader's tasks, batched: hundreds of transitions at once
    /// cost etcd a few transactions.
    reads: GroupCommit,
}

impl Ctx {
    /// Must be called on the runtime: it starts the reads' committer.
    pub fn new(store: Store, keys: Keys, config: CoordinatorConfig) -> Ctx {
        let starts = Mutex::new(StartBudget::new(
            config.max_starts_per_second,
            Instant::now(),
        ));
        let (reads, run) = GroupCommit::new(store.clone(), None, "read job", Limits::default());
        tokio::spawn(run);
        Ctx {
            store,
            keys,
            config,
            starts,
            reads,
        }
    }

    /// The leader's batched reads: unfenced, so only for writes that change nothing.
    pub(crate) fn reads(&self) -> &GroupCommit {
        &self.reads
    }

    /// Everything etcd holds about job `id`, read at one revision.
    pub(crate) async fn read(&self, id: &str) -> Result<Snapshot, jobs::Error> {
        jobs::read_batched(&self.reads, &self.keys, id).await
    }

    pub(crate) fn starts(&self) -> MutexGuard<'_, StartBudget> {
        self.starts.lock().expect("start budget lock")
    }

    /// Waits until the start budget has a start, and takes it.
    pub(crate) async fn take_start(&self) {
        loop {
            let now = Instant::now();
            let at = {
                let mut b = self.starts();
                if b.try_take(now) {
                    return;
                }
                b.next_at(now)
            };
            tokio::time::sleep_until(at.into()).await;
        }
    }
}

#[derive(Clone, Debug)]
pub struct CleanupConfig {
    /// How a failed step is retried, and how often before it needs an operator.
    pub policy: crate::retry::Policy,
    /// Step commands running at once, over every dirty result.
    pub concurrency: usize,
    pub timeout: Duration,
    pub retention: Duration,
    /// Test and drill hook: the term that recorded this stage stops there (a new leader
    /// resumes). 0 holds every cleanup before it starts.
    pub pause_after_stage: Option<u32>,
    /// Test hook: the term that recorded this step done gives out no later step.
    pub pause_after_step: Option<String>,
}
