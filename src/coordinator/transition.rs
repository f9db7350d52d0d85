//! One step for one job, decided from its current state in etcd and the leader's view of the
//! workers: assign it, adopt it, record how its attempt ended, reschedule it, or cancel it.
//! Guarantees:
//! - A job is assigned only by a fenced write PENDING→RUNNING that also compares the job's
//!   incarnation, its registry entry's revision, the absence of a cancel request, and the
//!   chosen worker key's create and mod revisions; the same transaction writes the assignment.
//! - A RUNNING entry is never rewritten while its attempt runs. Every write that ends an
//!   attempt compares the attempt record it acted on (or its absence), so an `exited` and a
//!   reschedule exclude each other, and deletes the assignment key.
//! - An attempt with no end record is rescheduled only once its worker incarnation has been
//!   gone for the worker's TTL plus margin (see [`super::fleet`]), or reclaimed when it has no
//!   `started` record within the worker's `--assign-timeout`.
//! - A terminal result is written with the registry delete in one fenced transaction.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::fleet::{Fleet, Liveness, Pick, Selector};
use super::{CoordinatorConfig, Ctx, Writer};
use crate::election::{Commit, FenceError};
use crate::jobs::records::{self, JobResult, RegistryEntry, RegistryStatus, TerminalStatus};
use crate::jobs::work::{
    Assignment, AssignmentKind, AttemptRecord, AttemptState, ASSIGNMENT_VERSION,
};
use crate::jobs::{self, Snapshot};
use crate::metrics::{self, Restart};
use crate::store::{codec, Write};

/// What a transition found or did.
pub(super) enum Outcome {
    /// Nothing runs for this job here (gone, terminal, or written back to PENDING).
    Idle,
    /// PENDING and due, but no worker slot (on a worker its selector matches) was reserved
    /// for it: it waits in submission (incarnation) order.
    NeedSlot(i64, Selector),
    /// PENDING until this Unix ms.
    Later(u64),
    /// RUNNING on this worker incarnation under assignment `token` (the registry entry's
    /// revision); look again at `recheck` if set. `fresh`: this transition assigned it (it
    /// took a start).
    Running {
        worker: String,
        rev: i64,
        token: i64,
        recheck: Option<Instant>,
        fresh: bool,
    },
    /// etcd failed; try again soon.
    Retry,
}

fn retry_delay(cfg: &CoordinatorConfig, failed: u32) -> Duration {
    crate::retry::policies::job_retry(cfg.retry_initial, cfg.retry_max)
        .delay(failed)
        .unwrap_or(cfg.retry_max)
}

/// Why an attempt is given back without a result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Requeue {
    /// Its worker was lost: a recovery (`BATON_RECOVERED=1`), counted.
    Lost,
    /// Its worker shut down: restarted, not counted.
    Preempted,
    /// Nothing ran (rejected, or reclaimed for want of a `started`): not an attempt.
    Unstarted,
}

/// Decides and does one step for job `id`. See the module doc.
pub(super) async fn transition(
    ctx: &Ctx,
    writer: &Writer,
    fleet: &Mutex<Fleet>,
    id: &str,
    pick: Option<Pick>,
) -> Outcome {
    let term = writer.term();
    if term.has_ended() {
        return Outcome::Idle;
    }
    let snap = match ctx.read(id).await {
        Ok(s) => s,
        Err(jobs::Error::Corrupt(_)) => return Outcome::Idle,
        Err(e) => {
            tracing::warn!(job_id = id, error = %e, "cannot read job");
            return Outcome::Retry;
        }
    };
    let Some((entry, registry_rev)) = snap.registry.clone() else {
        return Outcome::Idle;
    };
    if snap.result().is_some() {
        return remove_stray(ctx, writer, &snap, &entry, registry_rev).await;
    }
    let Some((record, incarnation)) = snap.spec.clone() else {
        tracing::error!(
            job_id = id,
            "registry entry without a spec; leaving it alone"
        );
        codec::note_corrupt();
        return Outcome::Idle;
    };
    let job = JobCtx {
        ctx,
        writer,
        snap: &snap,
        incarnation,
        registry_rev,
        entry: entry.clone(),
        record: &record,
        attempt: None,
    };
    let cancelled = snap.cancel.is_some();

    match entry.status {
        RegistryStatus::Pending if cancelled => {
            job.terminal(
                TerminalStatus::Canceled,
                None,
                None,
                Some("cancelled before it ran".into()),
            )
            .await
        }
        RegistryStatus::Pending if entry.not_before_ms > records::now_ms() => {
            Outcome::Later(entry.not_before_ms)
        }
        RegistryStatus::Pending => match pick {
            Some(p) if record.spec.selects(&p.labels) => job.assign(fleet, p).await,
            _ => Outcome::NeedSlot(incarnation, record.spec.worker_selector.clone()),
        },
        RegistryStatus::Running => {
            let Some(worker) = entry.worker.clone() else {
                // A version 1 entry: an older leader ran it itself, and its term is over. Its
                // guard may have left the exit in the old shared folder (where still mounted).
                let dir = crate::exec::record::job_dir(&ctx.config.storage_dir, id);
                let old =
                    crate::exec::record::read_exit(&dir, &format!("attempt-{}", entry.attempt))
                        .filter(|r| r.term == entry.term && r.attempt == entry.attempt);
                if let Some(r) = old.filter(|r| {
                    matches!(
                        r.killed_by,
                        None | Some(crate::exec::record::KilledBy::Timeout)
                    )
                }) {
                    let rec = AttemptRecord {
                        version: crate::jobs::work::ATTEMPT_VERSION,
                        state: AttemptState::Exited,
                        worker: String::new(),
                        worker_rev: 0,
                        attempt: r.attempt,
                        pid: r.pid,
                        exit_code: r.exit_code,
                        signal: r.signal,
                        killed_by: r.killed_by.map(|_| "timeout".to_string()),
                        log_tail: crate::exec::record::log_tail(&crate::exec::record::log_path(
                            &dir,
                            &format!("attempt-{}", r.attempt),
                        )),
                        reason: None,
                        at_ms: records::now_ms(),
                    };
                    tracing::info!(
                        job_id = id,
                        "recording the exit an older leader's guard left"
                    );
                    return job.finish(&rec).await;
                }
                if cancelled {
                    return job
                        .terminal(
                            TerminalStatus::Canceled,
                            None,
                            None,
                            Some("cancelled; the leader running it went away".into()),
                        )
                        .await;
                }
                return job.requeue(Requeue::Lost).await;
            };
            let rec = snap.attempts.get(&registry_rev).cloned();
            let job = JobCtx {
                attempt: rec.as_ref().map(|(r, rev)| (r.clone(), *rev)),
                ..job
            };
            let state = rec.as_ref().map(|(r, _)| r.state);
            match state {
                Some(AttemptState::Exited) => {
                    let (r, _) = rec.expect("matched");
                    job.finish(&r).await
                }
                Some(
                    s @ (AttemptState::Lost | AttemptState::Preempted | AttemptState::Rejected),
                ) if cancelled => {
                    let why = if s == AttemptState::Rejected {
                        "cancelled before it ran"
                    } else {
                        "cancelled; its worker went away"
                    };
                    job.terminal(TerminalStatus::Canceled, None, None, Some(why.into()))
                        .await
                }
                Some(AttemptState::Lost) => job.requeue(Requeue::Lost).await,
                Some(AttemptState::Preempted) => job.requeue(Requeue::Preempted).await,
                Some(AttemptState::Rejected) => {
                    // Its own local failures (a folder, the guard binary), not load or etcd.
                    let broken = rec
                        .as_ref()
                        .and_then(|(r, _)| r.reason.as_deref())
                        .is_some_and(|r| r.starts_with("cannot"));
                    if broken {
                        // It could not start it: give it nothing for a while (Nomad's ineligible).
                        fleet
                            .lock()
                            .expect("fleet lock")
                            .distrust(&worker, entry.worker_rev);
                    }
                    job.requeue(Requeue::Unstarted).await
                }
                Some(AttemptState::Started) | None => {
                    let started = state.is_some();
                    let liveness = {
                        let mut f = fleet.lock().expect("fleet lock");
                        match adopt(&mut f, &worker, &entry, registry_rev, started) {
                            Ok(outcome) => return outcome,
                            Err(liveness) => liveness,
                        }
                    };
                    match liveness {
                        Liveness::Alive => {
                            tracing::warn!(job_id = id, worker = %worker, "no start within the assign timeout; taking the job back");
                            fleet
                                .lock()
                                .expect("fleet lock")
                                .distrust(&worker, entry.worker_rev);
                            job.requeue(Requeue::Unstarted).await
                        }
                        Liveness::Gone(_) if cancelled => {
                            job.terminal(
                                TerminalStatus::Canceled,
                                None,
                                None,
                                Some("cancelled; its worker went away".into()),
                            )
                            .await
                        }
                        Liveness::Gone(_) if !started => {
                            tracing::info!(job_id = id, worker = %worker, "its worker went away before starting it");
                            job.requeue(Requeue::Unstarted).await
                        }
                        Liveness::Gone(_) => {
                            tracing::warn!(job_id = id, worker = %worker, "its worker is gone; restarting the job elsewhere");
                            job.requeue(Requeue::Lost).await
                        }
                    }
                }
            }
        }
    }
}

/// A RUNNING entry on `worker` whose current attempt has not ended (`started`: it has a
/// `started` record): `Ok` when nothing needs writing now (its worker lives and started it
/// or still may; or its worker went less than a TTL and margin ago: look again then), or
/// `Err` with the worker's liveness when the job must be taken back or restarted. Pure but
/// for the fleet's bookkeeping, so recovery decides most jobs from its pages alone.
pub(super) fn adopt(
    fleet: &mut Fleet,
    worker: &str,
    entry: &RegistryEntry,
    registry_rev: i64,
    started: bool,
) -> Result<Outcome, Liveness> {
    if started {
        fleet.trust(worker, entry.worker_rev);
    }
    let running = |recheck| Outcome::Running {
        worker: worker.to_string(),
        rev: entry.worker_rev,
        token: registry_rev,
        recheck,
        fresh: false,
    };
    let now = Instant::now();
    match fleet.liveness(worker, entry.worker_rev) {
        Liveness::Alive if started => Ok(running(None)),
        Liveness::Alive => {
            let due = fleet.accept_due(worker, registry_rev);
            if now < due {
                Ok(running(Some(due)))
            } else {
                Err(Liveness::Alive)
            }
        }
        Liveness::Gone(since) => {
            let due = since + Duration::from_millis(entry.worker_ttl_ms);
            if now < due {
                Ok(running(Some(due)))
            } else {
                Err(Liveness::Gone(since))
            }
        }
    }
}

/// A registry entry beside a result (a stale writer's, an operator's `etcdctl put`, an older
/// release's): the result is the last word. One fenced write removes the entry and its
/// assignment (its worker then kills the attempt, which it reports over its own `started`);
/// for a dirty result it also records the attempt, so the cleanup's first step waits until it
/// has ended or its worker has been gone for TTL + margin.
pub(in crate::coordinator) async fn remove_stray(
    ctx: &Ctx,
    writer: &Writer,
    snap: &Snapshot,
    entry: &RegistryEntry,
    registry_rev: i64,
) -> Outcome {
    let id = snap.id.as_str();
    let k = ctx.keys.job(id);
    let mut write = Write::new()
        .when_modified(k.registry.clone(), registry_rev)
        .delete(k.registry);
    let running = match (&entry.worker, entry.status) {
        (Some(w), RegistryStatus::Running) => Some(w.clone()),
        _ => None,
    };
    if let Some(w) = &running {
        write = write.delete(ctx.keys.assignment(w, entry.worker_rev, id));
    }
    match (&snap.dirty, &running) {
        (Some(dirty), Some(w)) => {
            let mut dirty = dirty.clone();
            dirty.cleanup.strays.push(records::StrayAttempt {
                worker: w.clone(),
                worker_rev: entry.worker_rev,
                token: registry_rev,
                worker_ttl_ms: entry.worker_ttl_ms,
            });
            dirty.version = records::RESULT_VERSION_STEPS;
            write = write
                .when_modified(k.dirty.clone(), snap.dirty_rev)
                .put(k.dirty, codec::encode(&dirty));
        }
        (None, Some(_)) => {
            // Clean: nobody waits for the attempt; its records go with the entry.
            write = write.delete_prefix(ctx.keys.attempts_of(id));
        }
        _ => {}
    }
    match writer.commit(write).await {
        Ok(Commit::Applied { .. }) => {
            metrics::get().stray_registry_entries.inc();
            tracing::warn!(
                job_id = id,
                status = ?entry.status,
                worker = entry.worker.as_deref().unwrap_or(""),
                clean = snap.dirty.is_none(),
                "a registry entry stood beside the job's result; removed it (a recorded result never runs again)"
            );
            Outcome::Idle
        }
        Ok(Commit::Conflict(_)) => Outcome::Retry,
        Err(FenceError::Deposed { .. }) => Outcome::Idle,
        Err(FenceError::Store { source, .. }) => {
            tracing::warn!(job_id = id, error = %source, "cannot remove a stray registry entry yet");
            Outcome::Retry
        }
    }
}

/// Test hook (`--test-pause-before-assign PATH`): while PATH exists, an assignment waits
/// after its read, having said so in `PATH.<job>.reached`, so a test can write into the gap.
async fn pause_before_assign(cfg: &CoordinatorConfig, id: &str) {
    let Some(gate) = &cfg.pause_before_assign else {
        return;
    };
    if !gate.exists() {
        return;
    }
    let mut reached = gate.as_os_str().to_owned();
    reached.push(format!(".{id}.reached"));
    let _ = std::fs::write(&reached, b"");
    let until = Instant::now() + Duration::from_secs(120);
    while gate.exists() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct JobCtx<'a> {
    ctx: &'a Ctx,
    writer: &'a Writer,
    snap: &'a Snapshot,
    incarnation: i64,
    registry_rev: i64,
    entry: RegistryEntry,
    record: &'a jobs::spec::JobRecord,
    /// The current attempt's record and its mod revision, if any.
    attempt: Option<(AttemptRecord, i64)>,
}

impl JobCtx<'_> {
    fn id(&self) -> &str {
        &self.snap.id
    }

    /// A write that requires the job's incarnation and registry entry as read.
    fn same_job(&self) -> Write {
        let k = self.ctx.keys.job(self.id());
        Write::new()
            .when_created(k.spec, self.incarnation)
            .when_modified(k.registry, self.registry_rev)
    }

    /// [`Self::same_job`], and the current attempt's record exactly as it was read (or its
    /// absence).
    fn same_attempt(&self) -> Write {
        let w = self.same_job();
        if self.entry.status != RegistryStatus::Running || self.entry.worker.is_none() {
            return w;
        }
        let key = self.ctx.keys.attempt(self.id(), self.registry_rev);
        match &self.attempt {
            Some((_, rev)) => w.when_modified(key, *rev),
            None => w.when_absent(key),
        }
    }

    /// Adds the deletion of the current assignment's key, if there is one.
    fn end_assignment(&self, w: Write) -> Write {
        match (&self.entry.worker, self.entry.status) {
            (Some(worker), RegistryStatus::Running) => w.delete(self.ctx.keys.assignment(
                worker,
                self.entry.worker_rev,
                self.id(),
            )),
            _ => w,
        }
    }

    /// Fenced write; maps the outcome for the actor.
    async fn write(&self, write: Write) -> Result<i64, Outcome> {
        match self.writer.commit(write).await {
            Ok(Commit::Applied { revision, .. }) => Ok(revision),
            Ok(Commit::Conflict(_)) => Err(Outcome::Retry),
            Err(FenceError::Deposed { .. }) => Err(Outcome::Idle),
            Err(FenceError::Store { source, .. }) => {
                tracing::warn!(job_id = self.id(), error = %source, "fenced write failed");
                Err(Outcome::Retry)
            }
        }
    }

    /// PENDING → RUNNING on worker `p`, with its assignment, in one transaction.
    async fn assign(&self, fleet: &Mutex<Fleet>, p: Pick) -> Outcome {
        let term = self.writer.term();
        let mut entry = self.entry.clone();
        entry.version = records::REGISTRY_VERSION;
        entry.attempt += 1;
        entry.status = RegistryStatus::Running;
        entry.term = term.revision();
        entry.not_before_ms = 0;
        entry.worker = Some(p.id.clone());
        entry.worker_rev = p.rev;
        entry.worker_ttl_ms = p.ttl_ms;
        entry.recovered_next = false;
        if entry.first_started_ms == 0 {
            entry.first_started_ms = records::now_ms();
        }
        let assignment = Assignment {
            version: ASSIGNMENT_VERSION,
            kind: AssignmentKind::Job,
            job_id: self.id().into(),
            attempt: entry.attempt,
            recovered: self.entry.recovered_next,
            spec: self.record.spec.clone(),
            term: term.revision(),
            step: None,
        };
        let k = self.ctx.keys.job(self.id());
        let worker_key = self.ctx.keys.worker(&p.id);
        pause_before_assign(&self.ctx.config, self.id()).await;
        // The result store is the last word: no result, no run.
        let write = self
            .same_job()
            .when_absent(k.cancel)
            .when_absent(k.dirty)
            .when_absent(k.clean)
            .when_created(worker_key.clone(), p.rev)
            .when_modified(worker_key, p.mod_rev)
            .put(k.registry, codec::encode(&entry))
            .put(
                self.ctx.keys.assignment(&p.id, p.rev, self.id()),
                codec::encode(&assignment),
            );
        match self.write(write).await {
            Ok(token) => {
                let due = {
                    let mut f = fleet.lock().expect("fleet lock");
                    f.assigned(token);
                    f.accept_due(&p.id, token)
                };
                tracing::info!(job_id = self.id(), attempt = entry.attempt, worker = %p.id, token, recovered = assignment.recovered, "job assigned");
                Outcome::Running {
                    worker: p.id,
                    rev: p.rev,
                    token,
                    recheck: Some(due),
                    fresh: true,
                }
            }
            Err(o) => o,
        }
    }

    /// Back to PENDING without a result.
    async fn requeue(&self, why: Requeue) -> Outcome {
        let term = self.writer.term();
        let cfg = &self.ctx.config;
        let mut back = self.entry.clone();
        back.version = records::REGISTRY_VERSION;
        back.status = RegistryStatus::Pending;
        back.term = term.revision();
        back.worker = None;
        back.worker_rev = 0;
        back.worker_ttl_ms = 0;
        match why {
            Requeue::Lost => {
                back.recoveries += 1;
                back.recovered_next = true;
                if back.recoveries > cfg.max_recoveries {
                    let msg = format!(
                        "restarted {} times after its worker or leader was lost (--max-recoveries {}); giving up",
                        back.recoveries - 1,
                        cfg.max_recoveries
                    );
                    let job = JobCtx {
                        entry: RegistryEntry {
                            recoveries: back.recoveries - 1,
                            ..self.entry.clone()
                        },
                        ..self.clone_ref()
                    };
                    return job
                        .terminal(TerminalStatus::Failed, None, None, Some(msg))
                        .await;
                }
            }
            Requeue::Preempted => {
                back.preemptions += 1;
                back.recovered_next = true;
            }
            Requeue::Unstarted => back.attempt = back.attempt.saturating_sub(1),
        }
        let k = self.ctx.keys.job(self.id());
        let write = self.same_attempt().put(k.registry, codec::encode(&back));
        match self.write(self.end_assignment(write)).await {
            Ok(_) => {
                tracing::info!(job_id = self.id(), attempt = self.entry.attempt, reason = ?why, "attempt given back; the job waits for a worker again");
                match why {
                    Requeue::Lost => metrics::get().restarted(Restart::WorkerLost),
                    Requeue::Preempted => metrics::get().restarted(Restart::Preempted),
                    Requeue::Unstarted => {}
                }
                Outcome::Idle
            }
            Err(o) => o,
        }
    }

    /// The attempt exited (record `rec`): record the result, or retry after a backoff.
    async fn finish(&self, rec: &AttemptRecord) -> Outcome {
        let term = self.writer.term();
        let attempt = self.entry.attempt;
        let killed_by = rec.killed_by.as_deref();
        if self.snap.cancel.is_some() || killed_by == Some("cancel") {
            return self
                .terminal(
                    TerminalStatus::Canceled,
                    rec.exit_code,
                    rec.signal,
                    Some("cancelled".into()),
                )
                .await;
        }
        if rec.exit_code == Some(0) && killed_by.is_none() {
            return self
                .terminal(TerminalStatus::Finished, Some(0), None, None)
                .await;
        }
        let error = if killed_by == Some("timeout") {
            format!(
                "attempt {attempt} timed out after {}",
                humantime::format_duration(self.record.spec.timeout)
            )
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
            let job = JobCtx {
                entry,
                ..self.clone_ref()
            };
            return job
                .terminal(
                    TerminalStatus::Failed,
                    rec.exit_code,
                    rec.signal,
                    Some(error),
                )
                .await;
        }
        let delay = retry_delay(&self.ctx.config, entry.failed_attempts);
        entry.version = records::REGISTRY_VERSION;
        entry.status = RegistryStatus::Pending;
        entry.term = term.revision();
        entry.worker = None;
        entry.worker_rev = 0;
        entry.worker_ttl_ms = 0;
        entry.not_before_ms = records::now_ms() + delay.as_millis() as u64;
        entry.last_error = Some(error.clone());
        tracing::info!(job_id = self.id(), attempt, error = %error, retry_in = ?delay, "attempt failed; will retry");
        let k = self.ctx.keys.job(self.id());
        let write = self.same_attempt().put(k.registry, codec::encode(&entry));
        match self.write(self.end_assignment(write)).await {
            Ok(_) => {
                metrics::get().restarted(Restart::FailedAttempt);
                Outcome::Later(entry.not_before_ms)
            }
            Err(o) => o,
        }
    }

    fn clone_ref(&self) -> JobCtx<'_> {
        JobCtx {
            ctx: self.ctx,
            writer: self.writer,
            snap: self.snap,
            incarnation: self.incarnation,
            registry_rev: self.registry_rev,
            entry: self.entry.clone(),
            record: self.record,
            attempt: self.attempt.clone(),
        }
    }

    /// Writes the dirty result, removes the registry entry, the assignment and the attempt
    /// records, in one fenced transaction.
    async fn terminal(
        &self,
        status: TerminalStatus,
        exit_code: Option<i32>,
        signal: Option<i32>,
        error: Option<String>,
    ) -> Outcome {
        let term = self.writer.term();
        let e = &self.entry;
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
            attempts: e.attempt,
            failed_attempts: e.failed_attempts,
            recoveries: e.recoveries,
            preemptions: e.preemptions,
            submitted_at_ms: self.record.submitted_at_ms,
            submitted_by: self.record.submitted_by.clone(),
            started_at_ms: e.first_started_ms,
            finished_at_ms: records::now_ms(),
            spec_hash: self.record.spec_hash.clone(),
            log_tail: self
                .attempt
                .as_ref()
                .map(|(r, _)| r.log_tail.clone())
                .unwrap_or_default(),
            term: term.revision(),
            cleanup: Default::default(),
            worker: e.worker.clone(),
            worker_rev: e.worker_rev,
        };
        let k = self.ctx.keys.job(self.id());
        let write = self
            .same_attempt()
            .when_absent(k.dirty.clone())
            .when_absent(k.clean)
            .delete(k.registry)
            .put(k.dirty, codec::encode(&result))
            .delete_prefix(self.ctx.keys.attempts_of(self.id()));
        match self.write(self.end_assignment(write)).await {
            Ok(_) => {
                tracing::info!(job_id = self.id(), status = ?status, exit_code, "job result recorded");
                Outcome::Idle
            }
            Err(o) => o,
        }
    }
}
