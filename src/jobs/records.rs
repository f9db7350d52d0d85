//! The values the leader and the submitters keep per job, besides the spec:
//! `registry/<id>` (RunningJobRegistry: PENDING or RUNNING only), `results/{dirty,clean}/<id>`
//! (JobResultStore), and `cancel/<id>` (a cancel request, a key of its own so that no replica
//! ever rewrites a value the leader owns).

use serde::{Deserialize, Serialize};

/// Version 2: RUNNING entries name the worker incarnation that runs them. A version 1 RUNNING
/// entry was run by an older leader itself; it is rescheduled (that leader's term is over).
pub const REGISTRY_VERSION: u32 = 2;
/// Version 3: the entry names runs it must wait for (`after`, a schedule's `replace`), which a
/// version 2 reader would not wait for; it reads version 3 as unknown instead.
pub const REGISTRY_VERSION_AFTER: u32 = 3;
pub const REGISTRY_VERSIONS_READ: &[u32] = &[1, 2, 3];
/// Version 2: the dirty entry may record a cleanup step given to a worker, which a version 1
/// reader (an older leader) would not see and would run itself; it reads version 2 as corrupt.
pub const RESULT_VERSION: u32 = 2;
/// Version 3: progress by step name, an abandonment, or attempts to outlive before the first
/// step; a version 2 reader would skip what it cannot see, so it reads version 3 as unknown.
pub const RESULT_VERSION_STEPS: u32 = 3;
pub const RESULT_VERSIONS_READ: &[u32] = &[1, 2, 3];
pub const CANCEL_VERSION: u32 = 1;
pub const ABANDON_VERSION: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RegistryStatus {
    Pending,
    Running,
}

/// `registry/<id>`. There is no DONE: done-ness lives in the result store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryEntry {
    pub version: u32,
    pub status: RegistryStatus,
    /// Launches so far, recoveries included (`BATON_ATTEMPT` of the latest one).
    pub attempt: u32,
    /// Attempts that failed (counted against `max_attempts`).
    pub failed_attempts: u32,
    /// Launches that restarted a job another leader was running.
    pub recoveries: u32,
    /// Attempts stopped by their worker's drain or shutdown: rescheduled at once, counted
    /// against nothing.
    #[serde(default)]
    pub preemptions: u32,
    /// The term that wrote this entry.
    pub term: i64,
    /// Unix ms before which a PENDING job must not start (retry backoff).
    #[serde(default)]
    pub not_before_ms: u64,
    /// Unix ms of the first launch.
    #[serde(default)]
    pub first_started_ms: u64,
    #[serde(default)]
    pub last_error: Option<String>,
    /// RUNNING: the worker running it and the create revision of its key (its incarnation).
    #[serde(default)]
    pub worker: Option<String>,
    #[serde(default)]
    pub worker_rev: i64,
    /// That worker incarnation's lease: revoked before a wait for its jobs starts, so a key
    /// deleted while its lease lived cannot let the worker go on proving it (0: unknown, an
    /// older release's entry).
    #[serde(default)]
    pub worker_lease: i64,
    /// That worker's lease TTL and margin when it was assigned: how long its guards may run
    /// the job after its key is gone.
    #[serde(default)]
    pub worker_ttl_ms: u64,
    /// The next assignment restarts an attempt a lost worker ran (`BATON_RECOVERED=1`).
    #[serde(default)]
    pub recovered_next: bool,
    /// Jobs whose registry entries must be gone before this one is assigned: the runs a
    /// schedule's `replace` cancelled for it. Every assignment compares them absent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<String>,
}

impl RegistryEntry {
    pub fn pending() -> RegistryEntry {
        RegistryEntry {
            version: REGISTRY_VERSION,
            status: RegistryStatus::Pending,
            attempt: 0,
            failed_attempts: 0,
            recoveries: 0,
            preemptions: 0,
            term: 0,
            not_before_ms: 0,
            first_started_ms: 0,
            last_error: None,
            worker: None,
            worker_rev: 0,
            worker_lease: 0,
            worker_ttl_ms: 0,
            recovered_next: false,
            after: Vec::new(),
        }
    }

    /// A PENDING entry that starts only once these jobs' entries are gone.
    pub fn pending_after(after: Vec<String>) -> RegistryEntry {
        RegistryEntry {
            version: if after.is_empty() {
                REGISTRY_VERSION
            } else {
                REGISTRY_VERSION_AFTER
            },
            after,
            ..RegistryEntry::pending()
        }
    }

    /// The version this entry is written with: the oldest that can say all of it.
    pub fn stored_version(&self) -> u32 {
        if self.after.is_empty() {
            REGISTRY_VERSION
        } else {
            REGISTRY_VERSION_AFTER
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TerminalStatus {
    Finished,
    Failed,
    Canceled,
}

/// Where the dirty-to-clean cleanup of a result stands.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupProgress {
    /// Stages completed (0: none).
    #[serde(default)]
    pub stage: u32,
    /// The term that recorded the latest stage.
    #[serde(default)]
    pub stage_term: i64,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(default)]
    pub next_retry_ms: u64,
    #[serde(default)]
    pub needs_operator: bool,
    #[serde(default)]
    pub done_ms: u64,
    /// Tries of the current stage that ran nothing (no worker, rejected, lost): they back off,
    /// uncounted.
    #[serde(default)]
    pub retries: u32,
    /// The cleanup step a worker has been given, if any (recorded before it may start).
    /// Version 3: only the folder stage's (each step keeps its own).
    #[serde(default)]
    pub assigned: Option<CleanupAssigned>,
    /// Version 3: each step's progress, in the order they run (the `command` step first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<StepProgress>,
    /// Version 3: an operator ended the cleanup by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abandoned: Option<Abandonment>,
    /// Version 3: attempts of a registry entry found beside this result, which the first step
    /// waits out (their end record, or their worker gone for its TTL and margin).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub strays: Vec<StrayAttempt>,
}

/// Where one cleanup step stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    #[default]
    Pending,
    /// Given to a worker (`assigned`); its report decides.
    Running,
    /// Failed, or did not run; tried again at `next_retry_ms`.
    Retrying,
    Done,
    /// Out of attempts: waits for `baton job cleanup ID --now` or `--abandon`.
    NeedsOperator,
    /// Ended by an operator; while `assigned` is set its command may still be dying.
    Abandoned,
}

impl StepState {
    pub fn as_str(self) -> &'static str {
        match self {
            StepState::Pending => "pending",
            StepState::Running => "running",
            StepState::Retrying => "retrying",
            StepState::Done => "done",
            StepState::NeedsOperator => "needs-operator",
            StepState::Abandoned => "abandoned",
        }
    }
}

/// One cleanup step's progress (the folder stage's lives in the entry's own fields).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepProgress {
    pub name: String,
    #[serde(default)]
    pub mode: super::spec::StepMode,
    pub state: StepState,
    /// Runs of its command that ended (counted against the strategy's attempts).
    #[serde(default)]
    pub attempts: u32,
    /// Tries that ran nothing (no worker, rejected, lost): they back off, uncounted.
    #[serde(default)]
    pub retries: u32,
    #[serde(default)]
    pub next_retry_ms: u64,
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(default)]
    pub assigned: Option<CleanupAssigned>,
}

/// How an operator ended a cleanup (`baton job cleanup ID --abandon`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abandonment {
    #[serde(default)]
    pub reason: Option<String>,
    pub by: String,
    pub at_ms: u64,
}

/// `cleanup-abandon/<id>`: an operator's request to end a job's cleanup, a key of its own
/// (the dirty entry belongs to the leader).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbandonRequest {
    pub version: u32,
    #[serde(default)]
    pub reason: Option<String>,
    pub requested_by: String,
    pub requested_at_ms: u64,
}

/// An attempt of a registry entry that was found beside a result and removed: its execution
/// may still be dying on `worker`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StrayAttempt {
    pub worker: String,
    pub worker_rev: i64,
    #[serde(default)]
    pub worker_lease: i64,
    /// The assignment's revision: its record is `attempts/<job>/<token>`.
    pub token: i64,
    pub worker_ttl_ms: u64,
}

/// A cleanup step assigned to a worker: where, and how long its guards may outlive its key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupAssigned {
    pub worker: String,
    pub worker_rev: i64,
    /// Its lease (see [`RegistryEntry::worker_lease`]).
    #[serde(default)]
    pub worker_lease: i64,
    pub worker_ttl_ms: u64,
    pub assign_timeout_ms: u64,
    /// `<n>` (the `command` step's attempt, version 2), `<name>.<n>` (a step's attempt,
    /// version 3) or `folder`: the last part of the step's record key.
    pub step: String,
}

/// `results/dirty/<id>` and `results/clean/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobResult {
    pub version: u32,
    pub job_id: String,
    pub status: TerminalStatus,
    #[serde(default)]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub signal: Option<i32>,
    #[serde(default)]
    pub error: Option<String>,
    pub attempts: u32,
    pub failed_attempts: u32,
    pub recoveries: u32,
    #[serde(default)]
    pub preemptions: u32,
    pub submitted_at_ms: u64,
    /// See [`crate::jobs::spec::JobRecord::submitted_by`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_by: Option<String>,
    #[serde(default)]
    pub started_at_ms: u64,
    pub finished_at_ms: u64,
    pub spec_hash: String,
    /// The last few KiB of the final attempt's output.
    #[serde(default)]
    pub log_tail: String,
    /// The term that recorded it.
    pub term: i64,
    #[serde(default)]
    pub cleanup: CleanupProgress,
    /// The worker incarnation that ran the final attempt (its folder is there).
    #[serde(default)]
    pub worker: Option<String>,
    #[serde(default)]
    pub worker_rev: i64,
}

/// `cancel/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRequest {
    pub version: u32,
    pub requested_at_ms: u64,
    pub requested_via: String,
}

/// Unix milliseconds now.
pub use crate::clock::unix_ms as now_ms;

/// Sleeps until Unix ms `at`; forever for `None` (a `select!` branch with nothing scheduled).
pub async fn sleep_until_ms(at: Option<u64>) {
    match at {
        Some(at) => {
            tokio::time::sleep(std::time::Duration::from_millis(
                at.saturating_sub(now_ms()),
            ))
            .await
        }
        None => std::future::pending().await,
    }
}
