//! A worker's writes, as pure functions: registration, the `started` record that lets a job
//! run, and the report of how it ended. The worker commits them; the protocol model applies
//! the very same writes to an in-memory etcd.
//!
//! Guarantees:
//! - Registration is put-if-absent on the incarnation's own lease.
//! - `started` requires this incarnation's key (its create revision), the assignment as given
//!   (its revision, the token) and no record yet: a worker that is no longer this incarnation,
//!   or an assignment taken back, starts nothing.
//! - A report requires only the assignment, so an exit recorded during a short etcd outage
//!   still lands unless the leader has moved on; a report over `started` (the assignment
//!   deleted) requires that record exactly as the worker wrote it.

use crate::jobs::work::{AttemptRecord, WorkerRecord};
use crate::store::{codec, Keys, Write};

/// Puts `workers/<id>` on `lease`, only if absent.
pub fn register(keys: &Keys, record: &WorkerRecord, lease: i64) -> Write {
    let key = keys.worker(&record.worker_id);
    Write::new()
        .when_absent(key.clone())
        .put_leased(key, codec::encode(record), lease)
}

/// The `started` record, before the go (reads the record back when a compare fails).
pub fn started(
    keys: &Keys,
    worker: &str,
    incarnation: i64,
    assignment: &str,
    token: i64,
    record: &str,
    rec: &AttemptRecord,
) -> Write {
    Write::new()
        .when_created(keys.worker(worker), incarnation)
        .when_modified(assignment.to_string(), token)
        .when_absent(record.to_string())
        .put(record.to_string(), codec::encode(rec))
        .or_get(record.to_string())
}

/// How an attempt ended, while its assignment stands.
pub fn report(assignment: &str, token: i64, record: &str, rec: &AttemptRecord) -> Write {
    Write::new()
        .when_modified(assignment.to_string(), token)
        .put(record.to_string(), codec::encode(rec))
}

/// How an execution whose assignment the leader deleted ended, over its own `started`.
pub fn report_over(record: &str, started_rev: i64, rec: &AttemptRecord) -> Write {
    Write::new()
        .when_modified(record.to_string(), started_rev)
        .put(record.to_string(), codec::encode(rec))
}
