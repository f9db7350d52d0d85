//! The leader's decisions and writes for one job, as pure functions of what etcd holds, the
//! fleet's verdict on the job's worker and the time. [`super::transition`] runs them against
//! etcd; the protocol model (`model/`) runs the very same functions against an in-memory
//! etcd ([`crate::store::mem`]), so a compare taken out of here fails the model.
//!
//! Guarantees of the writes:
//! - An assignment is a PENDING→RUNNING write that compares the job's incarnation, its
//!   registry entry's revision, the absence of a cancel request and of any result (the result
//!   store is the last word), and the chosen worker key's create and mod revisions; the same
//!   transaction writes the assignment.
//! - Every write that ends an attempt compares the attempt record it acted on (or its
//!   absence) and deletes the assignment key, so an `exited` and a reschedule exclude each
//!   other.
//! - A result is written only while no result exists, with the registry delete.
//! - An entry that names jobs it runs `after` is assigned only while their registry entries
//!   are absent (a schedule's `replace`: the old run has ended before the new one starts).

use crate::jobs::records::{self, JobResult, RegistryEntry, RegistryStatus, TerminalStatus};
use crate::jobs::spec::JobRecord;
use crate::jobs::work::{
    Assignment, AssignmentKind, AttemptRecord, AttemptState, ASSIGNMENT_VERSION,
};
use crate::jobs::Snapshot;
use crate::store::{codec, Keys, Write};

/// Why an attempt is given back without a result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Requeue {
    /// Its worker was lost: a recovery (`BATON_RECOVERED=1`), counted.
    Lost,
    /// Its worker shut down: restarted, not counted.
    Preempted,
    /// Nothing ran (rejected, or reclaimed for want of a `started`): not an attempt.
    Unstarted,
}

/// The fleet's verdict on the worker incarnation of a RUNNING job whose attempt has not
/// ended, given whether it has a `started` record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing to do yet: it runs, may still start, or its worker went less than a TTL and
    /// margin ago (counted from the revocation of its lease).
    Wait,
    /// Alive, without a start within the assign timeout.
    NoStart,
    /// Gone with a started attempt, its lease not revoked by this term yet.
    Unrevoked,
    /// Gone, for TTL and margin since its lease was revoked if it had started.
    Gone,
}

/// What the fleet knows of the worker incarnation of a RUNNING attempt that has not ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Its key is there; `timed_out`: the assignment's accept timeout has passed.
    Alive { timed_out: bool },
    /// Its key is gone. `lease_known`: its lease id is known (from the entry or the fleet);
    /// `revoked`: this term has revoked it; `waited`: its TTL and margin have passed since
    /// (since the deletion, when not revoked).
    Gone {
        lease_known: bool,
        revoked: bool,
        waited: bool,
    },
}

/// The rule for an attempt that has not ended (`started`: it has a `started` record). A
/// started attempt of a gone incarnation waits only once its lease is revoked, when its id is
/// known: from then on no keepalive of it is answered, so its guards stop feeding the job.
pub fn verdict(seen: Seen, started: bool) -> Verdict {
    match seen {
        Seen::Alive { timed_out: true } if !started => Verdict::NoStart,
        Seen::Alive { .. } => Verdict::Wait,
        Seen::Gone {
            lease_known: true,
            revoked: false,
            ..
        } if started => Verdict::Unrevoked,
        Seen::Gone { waited: false, .. } => Verdict::Wait,
        Seen::Gone { .. } => Verdict::Gone,
    }
}

/// What the leader does next about one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Nothing (no entry, or nothing the leader can act on).
    Idle,
    /// A registry entry stands beside a result: remove it.
    Stray,
    /// PENDING until this Unix ms.
    Later(u64),
    /// PENDING and due: assign it if a slot was reserved for it, else it waits for one.
    Assign,
    /// A version 1 entry (an older leader ran it itself): the code's own path.
    Legacy,
    /// Cancelled: the result is CANCELED, with this reason.
    Cancel(&'static str),
    /// The attempt exited: record its result, or retry.
    Ended(AttemptRecord),
    /// Give the attempt back; `distrust`: the worker failed at starting it.
    Requeue(Requeue, bool),
    /// It runs (or may start): look again later.
    Wait,
    /// Revoke the gone worker's lease before waiting out its TTL.
    Revoke,
}

/// Decides job `snap`'s next step. `verdict` answers for the worker of a RUNNING attempt
/// that has not ended (given whether it started).
pub fn decide(
    snap: &Snapshot,
    now_ms: u64,
    verdict: impl FnOnce(&RegistryEntry, bool) -> Verdict,
) -> Decision {
    let Some((entry, registry_rev)) = &snap.registry else {
        return Decision::Idle;
    };
    if snap.result().is_some() {
        return Decision::Stray;
    }
    if snap.spec.is_none() {
        return Decision::Idle;
    }
    let cancelled = snap.cancel.is_some();
    match entry.status {
        RegistryStatus::Pending if cancelled => Decision::Cancel("cancelled before it ran"),
        RegistryStatus::Pending if entry.not_before_ms > now_ms => {
            Decision::Later(entry.not_before_ms)
        }
        RegistryStatus::Pending => Decision::Assign,
        RegistryStatus::Running if entry.worker.is_none() => Decision::Legacy,
        RegistryStatus::Running => {
            let rec = snap.attempts.get(registry_rev).map(|(r, _)| r);
            match rec.map(|r| r.state) {
                Some(AttemptState::Exited) => Decision::Ended(rec.expect("matched").clone()),
                Some(AttemptState::Rejected) if cancelled => {
                    Decision::Cancel("cancelled before it ran")
                }
                Some(AttemptState::Lost | AttemptState::Preempted) if cancelled => {
                    Decision::Cancel("cancelled; its worker went away")
                }
                Some(AttemptState::Lost) => Decision::Requeue(Requeue::Lost, false),
                Some(AttemptState::Preempted) => Decision::Requeue(Requeue::Preempted, false),
                Some(AttemptState::Rejected) => {
                    // Its own local failures (a folder, the guard binary), not load or etcd.
                    let broken = rec
                        .and_then(|r| r.reason.as_deref())
                        .is_some_and(|r| r.starts_with("cannot"));
                    Decision::Requeue(Requeue::Unstarted, broken)
                }
                Some(AttemptState::Started) | None => {
                    let started = rec.is_some();
                    match verdict(entry, started) {
                        Verdict::Wait => Decision::Wait,
                        Verdict::Unrevoked => Decision::Revoke,
                        Verdict::NoStart => Decision::Requeue(Requeue::Unstarted, true),
                        Verdict::Gone if cancelled => {
                            Decision::Cancel("cancelled; its worker went away")
                        }
                        Verdict::Gone if !started => Decision::Requeue(Requeue::Unstarted, false),
                        Verdict::Gone => Decision::Requeue(Requeue::Lost, false),
                    }
                }
            }
        }
    }
}

/// The worker incarnation an assignment goes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub id: String,
    pub rev: i64,
    pub mod_rev: i64,
    pub lease: i64,
    /// Its lease TTL plus margin, in ms.
    pub ttl_ms: u64,
}

/// What a result says of how the job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub status: TerminalStatus,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub error: Option<String>,
}

impl Outcome {
    pub fn canceled(why: &str) -> Outcome {
        Outcome {
            status: TerminalStatus::Canceled,
            exit_code: None,
            signal: None,
            error: Some(why.into()),
        }
    }
}

/// How an exited attempt ends.
pub enum Ending {
    /// A result, and the entry it counts from.
    Result(Outcome, RegistryEntry),
    /// Retried: the PENDING entry to write (its backoff set) and why it failed.
    Retry(RegistryEntry, String),
}

/// One job as read, and the writes about it.
pub struct Job<'a> {
    pub keys: &'a Keys,
    pub snap: &'a Snapshot,
    /// The spec's create revision.
    pub incarnation: i64,
    pub registry_rev: i64,
    pub entry: RegistryEntry,
    pub record: &'a JobRecord,
    /// The current attempt's record and its mod revision, if any.
    pub attempt: Option<(AttemptRecord, i64)>,
}

impl<'a> Job<'a> {
    /// The job as `snap` shows it; `None` without a registry entry or a spec.
    pub fn of(keys: &'a Keys, snap: &'a Snapshot) -> Option<Job<'a>> {
        let (entry, registry_rev) = snap.registry.clone()?;
        let (record, incarnation) = snap.spec.as_ref()?;
        let attempt = snap.attempts.get(&registry_rev).cloned();
        Some(Job {
            keys,
            snap,
            incarnation: *incarnation,
            registry_rev,
            entry,
            record,
            attempt: if entry_runs_on_worker(&snap.registry) {
                attempt
            } else {
                None
            },
        })
    }

    pub fn id(&self) -> &str {
        &self.snap.id
    }

    /// A write that requires the job's incarnation and registry entry as read.
    pub fn same_job(&self) -> Write {
        let k = self.keys.job(self.id());
        Write::new()
            .when_created(k.spec, self.incarnation)
            .when_modified(k.registry, self.registry_rev)
    }

    /// [`Self::same_job`], and the current attempt's record exactly as it was read (or its
    /// absence).
    pub fn same_attempt(&self) -> Write {
        let w = self.same_job();
        if self.entry.status != RegistryStatus::Running || self.entry.worker.is_none() {
            return w;
        }
        let key = self.keys.attempt(self.id(), self.registry_rev);
        match &self.attempt {
            Some((_, rev)) => w.when_modified(key, *rev),
            None => w.when_absent(key),
        }
    }

    /// Adds the deletion of the current assignment's key, if there is one.
    pub fn end_assignment(&self, w: Write) -> Write {
        match (&self.entry.worker, self.entry.status) {
            (Some(worker), RegistryStatus::Running) => w.delete(self.keys.assignment(
                worker,
                self.entry.worker_rev,
                self.id(),
            )),
            _ => w,
        }
    }

    /// PENDING → RUNNING on `to`, with its assignment, in one write; and what it writes.
    pub fn assign(
        &self,
        to: &Target,
        term: i64,
        now_ms: u64,
    ) -> (Write, RegistryEntry, Assignment) {
        let mut entry = self.entry.clone();
        entry.version = entry.stored_version();
        entry.attempt += 1;
        entry.status = RegistryStatus::Running;
        entry.term = term;
        entry.not_before_ms = 0;
        entry.worker = Some(to.id.clone());
        entry.worker_rev = to.rev;
        entry.worker_lease = to.lease;
        entry.worker_ttl_ms = to.ttl_ms;
        entry.recovered_next = false;
        if entry.first_started_ms == 0 {
            entry.first_started_ms = now_ms;
        }
        let assignment = Assignment {
            version: ASSIGNMENT_VERSION,
            kind: AssignmentKind::Job,
            job_id: self.id().into(),
            attempt: entry.attempt,
            recovered: self.entry.recovered_next,
            spec: self.record.spec.clone(),
            term,
            step: None,
        };
        let k = self.keys.job(self.id());
        let worker_key = self.keys.worker(&to.id);
        // The result store is the last word: no result, no run.
        // Runs a schedule's `replace` cancelled for this one must have ended, whichever term
        // cancelled them.
        let write = self.entry.after.iter().fold(self.same_job(), |w, a| {
            w.when_absent(self.keys.job(a).registry)
        });
        let write = write
            .when_absent(k.cancel)
            .when_absent(k.dirty)
            .when_absent(k.clean)
            .when_created(worker_key.clone(), to.rev)
            .when_modified(worker_key, to.mod_rev)
            .put(k.registry, codec::encode(&entry))
            .put(
                self.keys.assignment(&to.id, to.rev, self.id()),
                codec::encode(&assignment),
            );
        (write, entry, assignment)
    }

    /// Back to PENDING without a result: `Ok` with the write, or `Err` with the entry to record
    /// a FAILED result from and why (too many recoveries).
    pub fn requeue(
        &self,
        why: Requeue,
        term: i64,
        max_recoveries: u32,
    ) -> Result<Write, Box<(RegistryEntry, String)>> {
        let mut back = self.entry.clone();
        back.version = back.stored_version();
        back.status = RegistryStatus::Pending;
        back.term = term;
        back.worker = None;
        back.worker_rev = 0;
        back.worker_lease = 0;
        back.worker_ttl_ms = 0;
        match why {
            Requeue::Lost => {
                back.recoveries += 1;
                back.recovered_next = true;
                if back.recoveries > max_recoveries {
                    let msg = format!(
                        "restarted {} times after its worker or leader was lost (--max-recoveries {max_recoveries}); giving up",
                        back.recoveries - 1,
                    );
                    let entry = RegistryEntry {
                        recoveries: back.recoveries - 1,
                        ..self.entry.clone()
                    };
                    return Err(Box::new((entry, msg)));
                }
            }
            Requeue::Preempted => {
                back.preemptions += 1;
                back.recovered_next = true;
            }
            Requeue::Unstarted => back.attempt = back.attempt.saturating_sub(1),
        }
        let k = self.keys.job(self.id());
        let write = self.same_attempt().put(k.registry, codec::encode(&back));
        Ok(self.end_assignment(write))
    }

    /// How the exited attempt `rec` ends the job or its attempt (retry after `delay_ms`).
    pub fn ending(&self, rec: &AttemptRecord, term: i64, now_ms: u64, delay_ms: u64) -> Ending {
        let attempt = self.entry.attempt;
        let killed_by = rec.killed_by.as_deref();
        if self.snap.cancel.is_some() || killed_by == Some("cancel") {
            let outcome = Outcome {
                exit_code: rec.exit_code,
                signal: rec.signal,
                ..Outcome::canceled("cancelled")
            };
            return Ending::Result(outcome, self.entry.clone());
        }
        if rec.exit_code == Some(0) && killed_by.is_none() {
            let outcome = Outcome {
                status: TerminalStatus::Finished,
                exit_code: Some(0),
                signal: None,
                error: None,
            };
            return Ending::Result(outcome, self.entry.clone());
        }
        let error = if killed_by == Some("timeout") {
            format!(
                "attempt {attempt} timed out after {}",
                humantime::format_duration(self.record.spec.timeout)
            )
        } else if let Some(e) = &rec.start_error {
            format!("attempt {attempt} could not start: {e}")
        } else if let Some(code) = rec.exit_code {
            format!("attempt {attempt} exited with code {code}")
        } else {
            format!(
                "attempt {attempt} was killed by signal {}",
                rec.signal.unwrap_or(0)
            )
        };
        let mut entry = self.entry.clone();
        entry.failed_attempts += 1;
        if entry.failed_attempts >= self.record.spec.max_attempts {
            let outcome = Outcome {
                status: TerminalStatus::Failed,
                exit_code: rec.exit_code,
                signal: rec.signal,
                error: Some(error),
            };
            return Ending::Result(outcome, entry);
        }
        entry.version = entry.stored_version();
        entry.status = RegistryStatus::Pending;
        entry.term = term;
        entry.worker = None;
        entry.worker_rev = 0;
        entry.worker_lease = 0;
        entry.worker_ttl_ms = 0;
        entry.not_before_ms = now_ms + delay_ms;
        entry.last_error = Some(error.clone());
        Ending::Retry(entry, error)
    }

    /// The write of a PENDING entry after a failed attempt (see [`Self::ending`]).
    pub fn retry(&self, entry: &RegistryEntry) -> Write {
        let k = self.keys.job(self.id());
        let write = self.same_attempt().put(k.registry, codec::encode(entry));
        self.end_assignment(write)
    }

    /// The dirty result, with the registry entry, the assignment and the attempt records
    /// deleted, in one write that requires that no result exists yet.
    pub fn terminal(
        &self,
        entry: &RegistryEntry,
        outcome: &Outcome,
        term: i64,
        now_ms: u64,
    ) -> Write {
        let Outcome {
            status,
            exit_code,
            signal,
            error,
        } = outcome.clone();
        let result = JobResult {
            // A spec with steps gets an entry an older leader reads as unknown.
            version: if self.record.spec.cleanup_steps.is_empty() {
                records::RESULT_VERSION
            } else {
                records::RESULT_VERSION_STEPS
            },
            job_id: self.id().into(),
            status,
            exit_code,
            signal,
            error,
            attempts: entry.attempt,
            failed_attempts: entry.failed_attempts,
            recoveries: entry.recoveries,
            preemptions: entry.preemptions,
            submitted_at_ms: self.record.submitted_at_ms,
            submitted_by: self.record.submitted_by.clone(),
            started_at_ms: entry.first_started_ms,
            finished_at_ms: now_ms,
            spec_hash: self.record.spec_hash.clone(),
            log_tail: self
                .attempt
                .as_ref()
                .map(|(r, _)| r.log_tail.clone())
                .unwrap_or_default(),
            term,
            cleanup: Default::default(),
            worker: entry.worker.clone(),
            worker_rev: entry.worker_rev,
        };
        let k = self.keys.job(self.id());
        let write = self
            .same_attempt()
            .when_absent(k.dirty.clone())
            .when_absent(k.clean)
            .delete(k.registry)
            .put(k.dirty, codec::encode(&result))
            .delete_prefix(self.keys.attempts_of(self.id()));
        self.end_assignment(write)
    }
}

fn entry_runs_on_worker(registry: &Option<(RegistryEntry, i64)>) -> bool {
    registry
        .as_ref()
        .is_some_and(|(e, _)| e.status == RegistryStatus::Running && e.worker.is_some())
}

/// A registry entry beside a result, removed with its assignment in one write; for a dirty
/// result the attempt is recorded in it, for its cleanup to wait out. `None` without both.
pub fn remove_stray(keys: &Keys, snap: &Snapshot) -> Option<Write> {
    let (entry, registry_rev) = snap.registry.as_ref()?;
    snap.result()?;
    let id = snap.id.as_str();
    let k = keys.job(id);
    let mut write = Write::new()
        .when_modified(k.registry.clone(), *registry_rev)
        .delete(k.registry);
    let running = match (&entry.worker, entry.status) {
        (Some(w), RegistryStatus::Running) => Some(w.clone()),
        _ => None,
    };
    if let Some(w) = &running {
        write = write.delete(keys.assignment(w, entry.worker_rev, id));
    }
    match (&snap.dirty, &running) {
        (Some(dirty), Some(w)) => {
            let mut dirty = dirty.clone();
            dirty.cleanup.strays.push(records::StrayAttempt {
                worker: w.clone(),
                worker_rev: entry.worker_rev,
                worker_lease: entry.worker_lease,
                token: *registry_rev,
                worker_ttl_ms: entry.worker_ttl_ms,
            });
            dirty.version = records::RESULT_VERSION_STEPS;
            write = write
                .when_modified(k.dirty.clone(), snap.dirty_rev)
                .put(k.dirty, codec::encode(&dirty));
        }
        (None, Some(_)) => {
            // Clean: nobody waits for the attempt; its records go with the entry.
            write = write.delete_prefix(keys.attempts_of(id));
        }
        _ => {}
    }
    Some(write)
}
