//! One step for one job: read from etcd, decided and written by [`super::protocol`] (pure, and
//! what the protocol model checks), committed through the term's fenced writer.
//! Guarantees (besides the writes' own, see [`super::protocol`]):
//! - A RUNNING entry is never rewritten while its attempt runs.
//! - An attempt with no end record is rescheduled only once its worker incarnation has been
//!   gone for the worker's TTL plus margin, counted from this term's revocation of its lease
//!   (see [`super::fleet`]), or reclaimed when it has no `started` record within the worker's
//!   `--assign-timeout`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::fleet::{Fleet, Liveness, Pick, Selector};
use super::protocol::{self, Decision, Ending, Job, Requeue, Seen, Target, Verdict};
use super::{CoordinatorConfig, Ctx, Writer};
use crate::election::{Commit, FenceError};
use crate::jobs::records::{self, RegistryEntry, TerminalStatus};
use crate::jobs::work::{AttemptRecord, AttemptState};
use crate::jobs::{self, Snapshot};
use crate::metrics::{self, Restart};
use crate::store::{codec, Write};
use protocol::Outcome as Ended;

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
    // What adoption found, when the decision is to wait.
    let mut waiting: Option<Outcome> = None;
    let decision = protocol::decide(&snap, records::now_ms(), |entry, started| {
        let (Some(worker), Some((_, registry_rev))) = (&entry.worker, &snap.registry) else {
            return Verdict::Gone;
        };
        let mut f = fleet.lock().expect("fleet lock");
        match adopt(&mut f, worker, entry, *registry_rev, started) {
            Ok(outcome) => {
                waiting = Some(outcome);
                Verdict::Wait
            }
            Err(Liveness::Alive) => Verdict::NoStart,
            Err(Liveness::Unrevoked(_)) => Verdict::Unrevoked,
            Err(Liveness::Gone(_)) => Verdict::Gone,
        }
    });
    if decision == Decision::Stray {
        return remove_stray(ctx, writer, &snap).await;
    }
    let Some(job) = Job::of(&ctx.keys, &snap) else {
        if snap.registry.is_some() {
            tracing::error!(
                job_id = id,
                "registry entry without a spec; leaving it alone"
            );
            codec::note_corrupt();
        }
        return Outcome::Idle;
    };
    let job = JobCtx { ctx, writer, job };
    let worker = job.job.entry.worker.clone().unwrap_or_default();
    let worker_rev = job.job.entry.worker_rev;
    match decision {
        Decision::Idle | Decision::Stray => Outcome::Idle,
        Decision::Later(at) => Outcome::Later(at),
        Decision::Assign => {
            if let Some(at) = job.after_pending().await {
                return Outcome::Later(at);
            }
            match pick {
                Some(p) if job.job.record.spec.selects(&p.labels) => job.assign(fleet, p).await,
                _ => Outcome::NeedSlot(
                    job.job.incarnation,
                    job.job.record.spec.worker_selector.clone(),
                ),
            }
        }
        Decision::Legacy => job.legacy().await,
        Decision::Cancel(why) => {
            let entry = job.job.entry.clone();
            job.terminal(&entry, &Ended::canceled(why)).await
        }
        Decision::Ended(rec) => job.finish(&rec).await,
        Decision::Requeue(why, distrust) => {
            if distrust {
                // It could not start it: give it nothing for a while (Nomad's ineligible).
                fleet
                    .lock()
                    .expect("fleet lock")
                    .distrust(&worker, worker_rev);
            }
            match (why, job.job.attempt.as_ref().map(|(r, _)| r.state)) {
                (Requeue::Unstarted, None | Some(AttemptState::Started)) if distrust => {
                    tracing::warn!(job_id = id, worker = %worker, "no start within the assign timeout; taking the job back");
                }
                (Requeue::Unstarted, None) => {
                    tracing::info!(job_id = id, worker = %worker, "its worker went away before starting it");
                }
                (Requeue::Lost, Some(AttemptState::Started)) => {
                    tracing::warn!(job_id = id, worker = %worker, "its worker is gone; restarting the job elsewhere");
                }
                _ => {}
            }
            job.requeue(why).await
        }
        Decision::Wait => waiting.unwrap_or(Outcome::Retry),
        Decision::Revoke => {
            let lease = worker_lease(&fleet.lock().expect("fleet lock"), &worker, &job.job.entry);
            match super::fleet::revoke_lease(&ctx.store, lease).await {
                Ok(()) => {
                    tracing::warn!(job_id = id, worker = %worker, lease, "its worker's key is gone: revoked the worker's lease before waiting out its TTL");
                    fleet
                        .lock()
                        .expect("fleet lock")
                        .revoked(&worker, worker_rev);
                    let wait = Duration::from_millis(job.job.entry.worker_ttl_ms);
                    Outcome::Running {
                        worker,
                        rev: worker_rev,
                        token: job.job.registry_rev,
                        recheck: Some(Instant::now() + wait),
                        fresh: false,
                    }
                }
                Err(e) => {
                    tracing::warn!(job_id = id, worker = %worker, error = %e, "cannot revoke a gone worker's lease yet");
                    Outcome::Retry
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
    let (seen, due) = match fleet.liveness(worker, entry.worker_rev) {
        Liveness::Alive if started => (Seen::Alive { timed_out: false }, None),
        Liveness::Alive => {
            let due = fleet.accept_due(worker, registry_rev);
            (
                Seen::Alive {
                    timed_out: now >= due,
                },
                Some(due),
            )
        }
        Liveness::Gone(since) | Liveness::Unrevoked(since) => {
            let due = since + Duration::from_millis(entry.worker_ttl_ms);
            let seen = Seen::Gone {
                lease_known: worker_lease(fleet, worker, entry) != 0,
                revoked: fleet.is_revoked(worker, entry.worker_rev),
                waited: now >= due,
            };
            (seen, Some(due))
        }
    };
    match protocol::verdict(seen, started) {
        Verdict::Wait => Ok(running(due)),
        Verdict::NoStart => Err(Liveness::Alive),
        Verdict::Unrevoked => Err(Liveness::Unrevoked(now)),
        Verdict::Gone => Err(Liveness::Gone(now)),
    }
}

/// The lease of a RUNNING entry's worker incarnation: from the entry, or, for an entry of an
/// older release, from the fleet's last view of that incarnation (0: unknown).
fn worker_lease(fleet: &Fleet, worker: &str, entry: &RegistryEntry) -> i64 {
    match entry.worker_lease {
        0 => fleet.lease_of(worker, entry.worker_rev).unwrap_or(0),
        lease => lease,
    }
}

/// A registry entry beside a result (a stale writer's, an operator's `etcdctl put`, an older
/// release's): the result is the last word. One fenced write ([`protocol::remove_stray`])
/// removes the entry and its assignment (its worker then kills the attempt, which it reports
/// over its own `started`); for a dirty result it also records the attempt, so the cleanup's
/// first step waits until it has ended or its worker has been gone for TTL + margin.
pub(in crate::coordinator) async fn remove_stray(
    ctx: &Ctx,
    writer: &Writer,
    snap: &Snapshot,
) -> Outcome {
    let id = snap.id.as_str();
    let Some(write) = protocol::remove_stray(&ctx.keys, snap) else {
        return Outcome::Idle;
    };
    let entry = snap.registry.as_ref().map(|(e, _)| e);
    match writer.commit(write).await {
        Ok(Commit::Applied { .. }) => {
            metrics::get().stray_registry_entries.inc();
            tracing::warn!(
                job_id = id,
                status = ?entry.map(|e| e.status),
                worker = entry.and_then(|e| e.worker.as_deref()).unwrap_or(""),
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

/// One job's step against etcd: [`protocol::Job`]'s writes, committed fenced.
struct JobCtx<'a> {
    ctx: &'a Ctx,
    writer: &'a Writer,
    job: Job<'a>,
}

impl JobCtx<'_> {
    fn id(&self) -> &str {
        self.job.id()
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

    /// When to look again at a job that must wait for runs it replaces (a schedule's
    /// `replace`), while one of them still has its registry entry: it waits holding no slot.
    /// The assignment's own compares are what guarantee the order; this only spares slots and
    /// writes that would fail.
    async fn after_pending(&self) -> Option<u64> {
        let after = &self.job.entry.after;
        for chunk in after.chunks(100) {
            let w = chunk
                .iter()
                .fold(Write::new(), |w, id| w.get(self.ctx.keys.job(id).registry));
            match self.ctx.reads().commit(w).await {
                Ok(crate::store::group::Outcome::Applied { response, .. }) => {
                    let waiting = response.op_responses().into_iter().any(
                        |r| matches!(r, etcd_client::TxnOpResponse::Get(g) if !g.kvs().is_empty()),
                    );
                    if waiting {
                        return Some(records::now_ms() + 500);
                    }
                }
                _ => return Some(records::now_ms() + 1000),
            }
        }
        None
    }

    /// PENDING → RUNNING on worker `p`, with its assignment, in one transaction.
    async fn assign(&self, fleet: &Mutex<Fleet>, p: Pick) -> Outcome {
        let term = self.writer.term().revision();
        let to = Target {
            id: p.id.clone(),
            rev: p.rev,
            mod_rev: p.mod_rev,
            lease: p.lease,
            ttl_ms: p.ttl_ms,
        };
        let (write, entry, assignment) = self.job.assign(&to, term, records::now_ms());
        pause_before_assign(&self.ctx.config, self.id()).await;
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
        let term = self.writer.term().revision();
        let write = match self.job.requeue(why, term, self.ctx.config.max_recoveries) {
            Ok(w) => w,
            Err(gave_up) => {
                let (entry, msg) = *gave_up;
                let failed = Ended {
                    status: TerminalStatus::Failed,
                    exit_code: None,
                    signal: None,
                    error: Some(msg),
                };
                return self.terminal(&entry, &failed).await;
            }
        };
        match self.write(write).await {
            Ok(_) => {
                tracing::info!(job_id = self.id(), attempt = self.job.entry.attempt, reason = ?why, "attempt given back; the job waits for a worker again");
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
        let term = self.writer.term().revision();
        let failed = self.job.entry.failed_attempts + 1;
        let delay = retry_delay(&self.ctx.config, failed);
        let now = records::now_ms();
        match self.job.ending(rec, term, now, delay.as_millis() as u64) {
            Ending::Result(ended, entry) => self.terminal(&entry, &ended).await,
            Ending::Retry(entry, error) => {
                tracing::info!(job_id = self.id(), attempt = self.job.entry.attempt, error = %error, retry_in = ?delay, "attempt failed; will retry");
                match self.write(self.job.retry(&entry)).await {
                    Ok(_) => {
                        metrics::get().restarted(Restart::FailedAttempt);
                        Outcome::Later(entry.not_before_ms)
                    }
                    Err(o) => o,
                }
            }
        }
    }

    /// Writes the dirty result, removes the registry entry, the assignment and the attempt
    /// records, in one fenced transaction.
    async fn terminal(&self, entry: &RegistryEntry, ended: &Ended) -> Outcome {
        let term = self.writer.term().revision();
        let write = self.job.terminal(entry, ended, term, records::now_ms());
        match self.write(write).await {
            Ok(_) => {
                tracing::info!(job_id = self.id(), status = ?ended.status, exit_code = ended.exit_code, "job result recorded");
                Outcome::Idle
            }
            Err(o) => o,
        }
    }

    /// A version 1 RUNNING entry: an older leader ran it itself, and its term is over. Its
    /// guard may have left the exit in the old shared folder (where still mounted).
    async fn legacy(&self) -> Outcome {
        let id = self.id();
        let entry = &self.job.entry;
        let dir = crate::exec::record::legacy_job_dir(&self.ctx.config.storage_dir, id);
        let old = crate::exec::record::read_exit(&dir, &format!("attempt-{}", entry.attempt))
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
                start_error: r.start_error.map(|e| e.message),
                at_ms: records::now_ms(),
            };
            tracing::info!(
                job_id = id,
                "recording the exit an older leader's guard left"
            );
            return self.finish(&rec).await;
        }
        if self.job.snap.cancel.is_some() {
            let why = "cancelled; the leader running it went away";
            return self.terminal(entry, &Ended::canceled(why)).await;
        }
        self.requeue(Requeue::Lost).await
    }
}
