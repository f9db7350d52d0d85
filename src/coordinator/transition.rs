//! One step for one job, decided from its current state in etcd: start it, record how its
//! attempt ended, retry it after a backoff, or cancel it. Guarantees:
//! - A job is started only by a fenced write PENDING→RUNNING that also compares the job's
//!   incarnation, its registry entry's revision and the absence of a cancel request.
//! - A terminal result is written with the registry delete in one fenced transaction.
//! - Every side effect (spawn, signal) asks [`Term::check`] synchronously right before.
//!
//! [`Term::check`]: crate::election::Term::check

use std::time::Duration;

use etcd_client::{Compare, CompareOp, TxnOp};

use super::{proven, storage, CoordinatorConfig, Ctx, Writer};
use crate::election::{Commit, FenceError};
use crate::exec::record::{self, ExitRecord, KilledBy};
use crate::exec::spawner::{self, Guard, GuardFeed, Launch};
use crate::jobs::records::{self, JobResult, RegistryEntry, RegistryStatus, TerminalStatus};
use crate::jobs::{self, Snapshot};
use crate::store::codec;

/// A job this term is running.
#[derive(Clone)]
pub(super) struct Local {
    pub(super) attempt: u32,
    pub(super) incarnation: i64,
    pub(super) registry_rev: i64,
    pub(super) feed: GuardFeed,
    pub(super) cancel_sent: bool,
}

/// What a transition found or did.
pub(super) enum Outcome {
    Idle,
    /// PENDING and due, but no slot was reserved for it.
    NeedSlot(i64),
    /// PENDING until this Unix ms.
    Later(u64),
    Started(Box<Local>, Guard),
    /// A running local job was asked to stop.
    CancelSent,
    /// etcd failed; try again soon.
    Retry,
}

fn retry_delay(cfg: &CoordinatorConfig, failed: u32) -> Duration {
    let factor = 2u32.saturating_pow(failed.saturating_sub(1).min(20));
    (cfg.retry_initial * factor).min(cfg.retry_max)
}

/// Decides and does one step for job `id`. See the module doc.
pub(super) async fn transition(
    ctx: &Ctx,
    writer: &Writer,
    id: &str,
    local: Option<Local>,
    exited: Option<Local>,
    slot: bool,
) -> Outcome {
    let term = writer.term();
    if term.has_ended() {
        return Outcome::Idle;
    }
    let snap = match jobs::read(&ctx.store, &ctx.keys, id).await {
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
    };

    if let Some(done) = exited {
        if done.incarnation != incarnation {
            return Outcome::Idle;
        }
        if done.registry_rev != registry_rev {
            // Someone else wrote the entry meanwhile: look again, as a job not running here.
            return Outcome::Retry;
        }
        let dir = storage::job_dir(&ctx.config.storage_dir, id);
        let rec = record::read_exit(&dir, &format!("attempt-{}", done.attempt));
        return job.finish(done.attempt, rec).await;
    }

    if let Some(l) = local {
        if snap.cancel.is_some() && !l.cancel_sent {
            if term.check().is_ok() {
                tracing::info!(
                    job_id = id,
                    attempt = l.attempt,
                    "cancel requested: stopping the job"
                );
                l.feed.terminate();
            }
            return Outcome::CancelSent;
        }
        return Outcome::Idle;
    }

    match entry.status {
        RegistryStatus::Pending if snap.cancel.is_some() => {
            job.terminal(
                TerminalStatus::Canceled,
                None,
                Some("cancelled before it ran".into()),
            )
            .await
        }
        RegistryStatus::Running => {
            // Started by an earlier leader (or by this term, which lost track of it).
            let dir = storage::job_dir(&ctx.config.storage_dir, id);
            let rec = record::read_exit(&dir, &format!("attempt-{}", entry.attempt));
            match rec {
                Some(r)
                    if matches!(r.killed_by, None | Some(KilledBy::Timeout))
                        || snap.cancel.is_some() =>
                {
                    tracing::info!(
                        job_id = id,
                        attempt = entry.attempt,
                        "recording the exit its guard left"
                    );
                    job.finish(entry.attempt, Some(r)).await
                }
                _ if snap.cancel.is_some() => {
                    job.terminal(
                        TerminalStatus::Canceled,
                        None,
                        Some("cancelled; the leader running it went away".into()),
                    )
                    .await
                }
                _ if !slot => Outcome::NeedSlot(incarnation),
                _ => job.start(true).await,
            }
        }
        RegistryStatus::Pending => {
            if entry.not_before_ms > records::now_ms() {
                Outcome::Later(entry.not_before_ms)
            } else if !slot {
                Outcome::NeedSlot(incarnation)
            } else {
                job.start(false).await
            }
        }
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
}

impl JobCtx<'_> {
    fn id(&self) -> &str {
        &self.snap.id
    }

    fn same_job(&self) -> Vec<Compare> {
        let k = self.ctx.keys.job(self.id());
        vec![
            Compare::create_revision(k.spec, CompareOp::Equal, self.incarnation),
            Compare::mod_revision(k.registry, CompareOp::Equal, self.registry_rev),
        ]
    }

    /// Fenced write; maps the outcome for the actor.
    async fn write(&self, compares: Vec<Compare>, ops: Vec<TxnOp>) -> Result<i64, Outcome> {
        match self.writer.commit(compares, ops).await {
            Ok(Commit::Applied { revision, .. }) => Ok(revision),
            Ok(Commit::Conflict(_)) => Err(Outcome::Retry),
            Err(FenceError::Deposed { .. }) => Err(Outcome::Idle),
            Err(FenceError::Store { source, .. }) => {
                tracing::warn!(job_id = self.id(), error = %source, "fenced write failed");
                Err(Outcome::Retry)
            }
        }
    }

    /// PENDING (or an interrupted RUNNING) → RUNNING, then spawn under a guard.
    async fn start(&self, recovered: bool) -> Outcome {
        let cfg = &self.ctx.config;
        let term = self.writer.term();
        let mut entry = self.entry.clone();
        entry.attempt += 1;
        if recovered {
            entry.recoveries += 1;
            if entry.recoveries > cfg.max_recoveries {
                let msg = format!(
                    "restarted {} times after leader changes (--max-recoveries {}); giving up",
                    entry.recoveries - 1,
                    cfg.max_recoveries
                );
                return self.terminal(TerminalStatus::Failed, None, Some(msg)).await;
            }
        }
        entry.status = RegistryStatus::Running;
        entry.term = term.revision();
        entry.not_before_ms = 0;
        if entry.first_started_ms == 0 {
            entry.first_started_ms = records::now_ms();
        }
        let k = self.ctx.keys.job(self.id());
        let mut compares = self.same_job();
        compares.push(Compare::version(k.cancel.clone(), CompareOp::Equal, 0));
        let rev = match self
            .write(
                compares,
                vec![TxnOp::put(k.registry, codec::encode(&entry), None)],
            )
            .await
        {
            Ok(rev) => rev,
            Err(o) => return o,
        };
        let dir = storage::job_dir(&cfg.storage_dir, self.id());
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::error!(job_id = self.id(), error = %e, "cannot create the job folder");
        }
        let spec = &self.record.spec;
        let mut env = spec.env.clone();
        env.insert("BATON_JOB_ID".into(), self.id().into());
        env.insert("BATON_ATTEMPT".into(), entry.attempt.to_string());
        env.insert("BATON_JOB_DIR".into(), dir.display().to_string());
        env.insert("BATON_TERM".into(), term.revision().to_string());
        if recovered {
            env.insert("BATON_RECOVERED".into(), "1".into());
        }
        let launch = Launch {
            guard: cfg.guard.clone(),
            job_id: self.id().into(),
            attempt: entry.attempt,
            term: term.revision(),
            dir,
            name: format!("attempt-{}", entry.attempt),
            command: spec.command.clone(),
            env,
            timeout: spec.timeout,
        };
        // The last synchronous check before the side effect.
        if term.check().is_err() {
            return Outcome::Idle;
        }
        match spawner::spawn(launch, proven(term)).await {
            Ok(g) => {
                tracing::info!(
                    job_id = self.id(),
                    attempt = entry.attempt,
                    recovered,
                    guard = g.pid,
                    "job started"
                );
                let local = Local {
                    attempt: entry.attempt,
                    incarnation: self.incarnation,
                    registry_rev: rev,
                    feed: g.feed.clone(),
                    cancel_sent: false,
                };
                Outcome::Started(Box::new(local), g)
            }
            Err(e) => {
                tracing::error!(job_id = self.id(), error = %e, "cannot start the guard");
                // Back to PENDING after a pause; the next reconcile will try again.
                let mut back = self.entry.clone();
                back.status = RegistryStatus::Pending;
                back.term = term.revision();
                back.not_before_ms = records::now_ms() + 1000;
                back.last_error = Some(format!("cannot start the guard: {e}"));
                let k = self.ctx.keys.job(self.id());
                let compares = vec![
                    Compare::create_revision(k.spec.clone(), CompareOp::Equal, self.incarnation),
                    Compare::mod_revision(k.registry.clone(), CompareOp::Equal, rev),
                ];
                let _ = self
                    .write(
                        compares,
                        vec![TxnOp::put(k.registry, codec::encode(&back), None)],
                    )
                    .await;
                Outcome::Retry
            }
        }
    }

    /// An attempt ended (its guard's exit record, if any): record the outcome.
    async fn finish(&self, attempt: u32, rec: Option<ExitRecord>) -> Outcome {
        let term = self.writer.term();
        if self.snap.cancel.is_some()
            || rec
                .as_ref()
                .is_some_and(|r| r.killed_by == Some(KilledBy::Cancel))
        {
            let (code, signal) = rec
                .as_ref()
                .map_or((None, None), |r| (r.exit_code, r.signal));
            return self
                .terminal_with(
                    TerminalStatus::Canceled,
                    code,
                    signal,
                    Some("cancelled".into()),
                )
                .await;
        }
        let rec = match rec {
            Some(r) if matches!(r.killed_by, None | Some(KilledBy::Timeout)) => r,
            other => {
                // The guard did not run the job to its end (no deadline, leader gone): not the
                // job's fault, so no failure is counted. Put it back to PENDING.
                if term.check().is_err() {
                    return Outcome::Idle;
                }
                tracing::warn!(job_id = self.id(), attempt, killed_by = ?other.map(|r| r.killed_by), "attempt interrupted; will run again");
                let mut back = self.entry.clone();
                back.status = RegistryStatus::Pending;
                back.term = term.revision();
                let k = self.ctx.keys.job(self.id());
                return match self
                    .write(
                        self.same_job(),
                        vec![TxnOp::put(k.registry, codec::encode(&back), None)],
                    )
                    .await
                {
                    Ok(_) | Err(Outcome::Idle) => Outcome::Idle,
                    Err(o) => o,
                };
            }
        };
        if rec.exit_code == Some(0) && rec.killed_by.is_none() {
            return self
                .terminal_with(TerminalStatus::Finished, Some(0), None, None)
                .await;
        }
        let error = if rec.killed_by == Some(KilledBy::Timeout) {
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
                .terminal_with(
                    TerminalStatus::Failed,
                    rec.exit_code,
                    rec.signal,
                    Some(error),
                )
                .await;
        }
        let delay = retry_delay(&self.ctx.config, entry.failed_attempts);
        entry.status = RegistryStatus::Pending;
        entry.term = term.revision();
        entry.not_before_ms = records::now_ms() + delay.as_millis() as u64;
        entry.last_error = Some(error.clone());
        tracing::info!(job_id = self.id(), attempt, error = %error, retry_in = ?delay, "attempt failed; will retry");
        let k = self.ctx.keys.job(self.id());
        match self
            .write(
                self.same_job(),
                vec![TxnOp::put(k.registry, codec::encode(&entry), None)],
            )
            .await
        {
            Ok(_) => Outcome::Later(entry.not_before_ms),
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
        }
    }

    async fn terminal(
        &self,
        status: TerminalStatus,
        code: Option<i32>,
        error: Option<String>,
    ) -> Outcome {
        self.terminal_with(status, code, None, error).await
    }

    /// Writes the dirty result and removes the registry entry, in one fenced transaction.
    async fn terminal_with(
        &self,
        status: TerminalStatus,
        exit_code: Option<i32>,
        signal: Option<i32>,
        error: Option<String>,
    ) -> Outcome {
        let term = self.writer.term();
        let e = &self.entry;
        let dir = storage::job_dir(&self.ctx.config.storage_dir, self.id());
        let result = JobResult {
            version: records::RESULT_VERSION,
            job_id: self.id().into(),
            status,
            exit_code,
            signal,
            error,
            attempts: e.attempt,
            failed_attempts: e.failed_attempts,
            recoveries: e.recoveries,
            submitted_at_ms: self.record.submitted_at_ms,
            started_at_ms: e.first_started_ms,
            finished_at_ms: records::now_ms(),
            spec_hash: self.record.spec_hash.clone(),
            log_tail: record::log_tail(&record::log_path(&dir, &format!("attempt-{}", e.attempt))),
            term: term.revision(),
            cleanup: Default::default(),
        };
        let k = self.ctx.keys.job(self.id());
        let ops = vec![
            TxnOp::delete(k.registry, None),
            TxnOp::put(k.dirty, codec::encode(&result), None),
        ];
        match self.write(self.same_job(), ops).await {
            Ok(_) => {
                tracing::info!(job_id = self.id(), status = ?status, exit_code, "job result recorded");
                Outcome::Idle
            }
            Err(o) => o,
        }
    }
}
