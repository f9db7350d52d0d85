//! The records the leader and the workers exchange through etcd, and nothing else: neither
//! side imports the other.
//! - `workers/<id>` ([`WorkerRecord`]): a live worker incarnation, on the worker's own lease;
//!   its create revision names the incarnation.
//! - `assignments/<worker>/<incarnation>/<job>` ([`Assignment`]): written by the leader in the
//!   transaction that sets the registry entry RUNNING; its revision is the attempt's fencing
//!   token (`BATON_TERM`). Never rewritten; deleted by whatever transaction ends it.
//! - `drains/<id>` ([`DrainRequest`]): an operator asked worker `<id>` to drain; written by
//!   any replica, read by the worker, which then marks its own record `draining`.
//! - `attempts/<job>/<token>` ([`AttemptRecord`]): written by the worker: `started` before the
//!   job execs, then `exited`, `lost` or `preempted` once its process group is gone, or
//!   `rejected` instead of starting.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::spec::JobSpec;

pub const WORKER_VERSION: u32 = 1;
/// Job assignments are version 1; cleanup steps are version 2, which a worker of the previous
/// release refuses (it would take them for jobs) instead of running; named cleanup steps are
/// version 3 (their keys and records carry the step's name).
pub const ASSIGNMENT_VERSION: u32 = 1;
pub const CLEANUP_ASSIGNMENT_VERSION: u32 = 2;
pub const CLEANUP_STEP_ASSIGNMENT_VERSION: u32 = 3;
pub const ASSIGNMENT_VERSIONS_READ: &[u32] = &[1, 2, 3];
pub const ATTEMPT_VERSION: u32 = 1;
pub const DRAIN_VERSION: u32 = 1;

/// `drains/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRequest {
    pub version: u32,
    pub requested_at_ms: u64,
    /// The replica that took the request.
    pub via: String,
}

/// `workers/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub version: u32,
    pub worker_id: String,
    pub advertise: String,
    /// Jobs it runs at once.
    pub capacity: u32,
    /// Cleanup commands it runs at once, besides its jobs.
    #[serde(default)]
    pub cleanup_capacity: u32,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub draining: bool,
    /// RFC 3339.
    pub started_at: String,
    /// Its lease TTL: how long after losing touch its guards may still run a job.
    pub lease_ttl_ms: u64,
    /// Its guards stop a job this long before the lease could expire.
    pub margin_ms: u64,
    /// The leader takes an assignment back when no `started` came within this.
    pub assign_timeout_ms: u64,
    /// Unix ms of registration.
    #[serde(default)]
    pub started_at_ms: u64,
    /// Why this worker takes no assignments although it lives (it cannot start guards); the
    /// leader assigns it nothing while set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unable: Option<String>,
}

impl WorkerRecord {
    /// Whether the leader may assign it anything: not draining, and able to start guards.
    pub fn takes_work(&self) -> bool {
        !self.draining && self.unable.is_none()
    }
}

/// What an assignment asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AssignmentKind {
    /// An attempt of the job.
    #[default]
    Job,
    /// A run of the job's cleanup command (`spec` holds it; `attempt` is the cleanup attempt).
    Cleanup,
    /// Removal of the job's folder on this worker.
    Folder,
}

/// `assignments/<worker>/<incarnation>/<job>` (or `.../cleanup/<job>`): everything the worker
/// needs to run it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub version: u32,
    #[serde(default)]
    pub kind: AssignmentKind,
    pub job_id: String,
    /// `BATON_ATTEMPT`.
    pub attempt: u32,
    /// This attempt restarts one that a lost worker was running (`BATON_RECOVERED=1`).
    #[serde(default)]
    pub recovered: bool,
    pub spec: JobSpec,
    /// The leader's term that assigned it.
    pub term: i64,
    /// Version 3: the cleanup step this runs (`BATON_CLEANUP_STEP`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptState {
    /// The worker accepted and is about to exec (written before the job starts).
    Started,
    /// The job ended on its own, by its timeout, or by a cancel.
    Exited,
    /// The worker could not prove its lease (or its key vanished) and killed the job.
    Lost,
    /// The worker was shut down and stopped the job; not the job's fault.
    Preempted,
    /// The worker refused the assignment (full, draining, could not start); nothing ran.
    Rejected,
}

/// `attempts/<job>/<token>`, and `cleanups/<job>/<step>` for cleanup steps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub version: u32,
    pub state: AttemptState,
    pub worker: String,
    pub worker_rev: i64,
    pub attempt: u32,
    /// The guard's pid on the worker's host.
    #[serde(default)]
    pub pid: i32,
    #[serde(default)]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub signal: Option<i32>,
    /// `timeout` or `cancel` when the guard ended the job for those.
    #[serde(default)]
    pub killed_by: Option<String>,
    /// The last 4 KiB of the attempt's output.
    #[serde(default)]
    pub log_tail: String,
    #[serde(default)]
    pub reason: Option<String>,
    /// The command could not be started (the guard's message, with the errno): nothing ran,
    /// which is not an exit code (not even 127).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_error: Option<String>,
    pub at_ms: u64,
}
