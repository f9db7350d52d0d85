//! One dirty result's cleanup, pass by pass: each pass reads the job (or knows it from its own
//! last write), looks at what runs on workers, decides, and records every decision of the pass
//! in one fenced write that compares the dirty entry's revision (and that no registry entry
//! stands beside the result).
//!
//! Guarantees:
//! - A step whose success is recorded never runs again; only a failed or unrun step is given
//!   again, after its own backoff. A step whose worker is gone is given again only once the
//!   worker's TTL and margin have passed since this term saw it go.
//! - A step is recorded in the entry in the same transaction that writes its assignment, so a
//!   new leader waits for its report instead of starting another.
//! - No step starts while a registry entry stands beside the result, nor before the attempts
//!   of one found there (`strays`) have ended or their workers have been gone for TTL + margin.
//! - An abandoned cleanup deletes the assignments of its running steps at once; the folder
//!   stage starts only once each of them has an end record or its worker has been gone for
//!   TTL + margin.
//! - Stages end in the write that starts the next where the two can share a transaction: steps
//!   done (with no run ending in the same pass) and the folder given; the folder removed and
//!   the result clean. The merged write is the two back to back, with nothing between them
//!   (one etcd revision and one round trip fewer for each).

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::place::{self, StepLease};
use super::{Next, On};
use crate::coordinator::Ctx;
use crate::election::{Commit, FenceError};
use crate::exec::record;
use crate::jobs::cleanup::{self, PlannedStep};
use crate::jobs::records::{
    self, Abandonment, CleanupAssigned, JobResult, StepProgress, StepState, TerminalStatus,
    RESULT_VERSION_STEPS,
};
use crate::jobs::spec::JobSpec;
use crate::jobs::work::{
    Assignment, AssignmentKind, AttemptRecord, AttemptState, ATTEMPT_VERSION,
    CLEANUP_ASSIGNMENT_VERSION, CLEANUP_STEP_ASSIGNMENT_VERSION,
};
use crate::jobs::{self, Snapshot};
use crate::metrics;
use crate::retry::policies;
use crate::store::group::Outcome;
use crate::store::{codec, Keys, Write};

/// What a look at something given to a worker found.
enum Seen {
    /// Still running; look again by this instant at the latest.
    Running(Option<Instant>),
    /// Ran to a good end; `true` if it ran a command.
    Done(bool),
    /// It failed, at this Unix ms.
    Failed(String, u64),
    /// It did not run.
    Again(String),
}

/// One thing on a worker to look at: its record and its worker's key.
struct Watched {
    record: String,
    worker: String,
    worker_rev: i64,
    /// Its worker incarnation's lease (0: unknown).
    lease: i64,
    /// How long its execution may outlive its worker's key.
    ttl: Duration,
    assign_timeout: Duration,
    /// Its assignment is deleted: it can no longer start, and only an execution that did
    /// start is waited for (its end record, its worker gone for `ttl`, or, while its worker
    /// lives without a word, this long from the first look).
    waiting_out: Option<Duration>,
}

/// Beyond a timeout, the time a guard takes to kill after it (its kill grace) and to report.
const REVOKED_SLACK: Duration = Duration::from_secs(60);

impl Watched {
    fn of(keys: &Keys, id: &str, a: &CleanupAssigned, waiting_out: Option<Duration>) -> Watched {
        Watched {
            record: keys.cleanup_record(id, &a.step),
            worker: a.worker.clone(),
            worker_rev: a.worker_rev,
            lease: a.worker_lease,
            ttl: Duration::from_millis(a.worker_ttl_ms),
            assign_timeout: Duration::from_millis(a.assign_timeout_ms),
            waiting_out,
        }
    }
}

/// The assignment key of a step given out as `a`.
pub(super) fn assignment_key(keys: &Keys, id: &str, a: &CleanupAssigned) -> String {
    match a.step.split_once('.') {
        Some((name, _)) => keys.cleanup_step_assignment(&a.worker, a.worker_rev, id, name),
        None => keys.cleanup_assignment(&a.worker, a.worker_rev, id),
    }
}

/// What a pass ended with.
enum Pass {
    /// It wrote; the job as it now stands.
    Wrote(Box<Snapshot>),
    /// Nothing to write now: look again at this Unix ms at the latest (or on a wake); `true`
    /// while something of the job runs on a worker (the task stays to see it end).
    Wait(Option<u64>, bool),
    /// Read again soon (a write that did not apply, a failed read).
    Reread,
    /// Out of attempts and nothing runs: waits for an operator.
    NeedsOperator,
    Finished(Next),
}

/// The state of one job's cleanup task across its passes.
pub(super) struct JobTask<'a> {
    ctx: &'a Ctx,
    on: &'a On<'a>,
    id: &'a str,
    /// Running step commands this task counts, by step name.
    leases: HashMap<String, StepLease>,
    /// Worker incarnations seen gone, and since when.
    gone: HashMap<(String, i64), Instant>,
    /// Records first looked at, and when: an unanswered assignment times out from there.
    looks: HashMap<String, Instant>,
    /// A step waits for a place among the running commands.
    want_slot: bool,
    /// Steps whose success this task recorded.
    recorded: Vec<String>,
    /// Gone worker incarnations whose lease this task revoked.
    revoked: std::collections::HashSet<(String, i64)>,
}

impl<'a> JobTask<'a> {
    pub(super) fn new(ctx: &'a Ctx, on: &'a On<'a>, id: &'a str) -> JobTask<'a> {
        JobTask {
            ctx,
            on,
            id,
            leases: HashMap::new(),
            gone: HashMap::new(),
            looks: HashMap::new(),
            want_slot: false,
            recorded: Vec::new(),
            revoked: Default::default(),
        }
    }

    /// Runs passes until the cleanup is done, waits for a later time with nothing running,
    /// needs an operator, or the term ends.
    pub(super) async fn run(mut self) -> Next {
        let term = self.on.writer.term();
        let wake = self.on.wakers.of(self.id);
        let mut known: Option<Snapshot> = None;
        loop {
            if term.check().is_err() {
                return Next::Stop;
            }
            let snap = match known.take() {
                Some(s) => s,
                None => match self.ctx.read(self.id).await {
                    Ok(s) => s,
                    Err(jobs::Error::Corrupt(_)) => return Next::Stop,
                    Err(e) => {
                        tracing::warn!(job_id = self.id, error = %e, "cannot read a dirty job");
                        if self.leases.is_empty() {
                            return Next::At(records::now_ms() + 1000);
                        }
                        self.wait(&wake, Some(records::now_ms() + 1000)).await;
                        continue;
                    }
                },
            };
            match self.pass(&snap).await {
                Pass::Wrote(s) => known = Some(*s),
                Pass::Reread => tokio::time::sleep(Duration::from_millis(100)).await,
                Pass::Finished(next) => return next,
                Pass::NeedsOperator if self.leases.is_empty() => return Next::NeedsOperator,
                Pass::Wait(at, false) if self.leases.is_empty() && !self.want_slot => {
                    return Next::At(at.unwrap_or_else(|| records::now_ms() + 1000));
                }
                Pass::NeedsOperator => self.wait(&wake, None).await,
                Pass::Wait(at, _) => self.wait(&wake, at).await,
            }
        }
    }

    /// Until a record of this job changes, a place frees up (when one is wanted), `at`, or a
    /// second: a worker's key going shows at the next look.
    async fn wait(&self, wake: &Notify, at: Option<u64>) {
        let second = records::now_ms() + 1000;
        let until = at.map_or(second, |a| a.min(second));
        let slots = self.on.slots.clone();
        let want = self.want_slot;
        tokio::select! {
            _ = wake.notified() => {}
            _ = records::sleep_until_ms(Some(until)) => {}
            _ = slots.released(), if want => {}
        }
    }

    /// One pass: see the module doc.
    async fn pass(&mut self, snap: &Snapshot) -> Pass {
        let ctx = self.ctx;
        let id = self.id;
        let term = self.on.writer.term();
        let Some(dirty) = snap.dirty.clone() else {
            return Pass::Finished(Next::Done);
        };
        if let Some(p) = ctx.config.cleanup.pause_after_stage {
            // Only the term that reached the stage pauses: a new leader resumes.
            let c = &dirty.cleanup;
            let here = c.stage_term == term.revision() || (p == 0 && c.stage == 0);
            if c.stage == p && p < 3 && here && self.leases.is_empty() {
                return Pass::Finished(Next::Stop);
            }
        }
        if snap.registry.is_some() {
            // A registry entry beside the result: removed (its attempt recorded for the steps
            // to wait out) by whichever of this task and the actor's transition comes first.
            crate::coordinator::transition::remove_stray(ctx, self.on.writer, snap).await;
            return Pass::Reread;
        }
        if dirty.cleanup.stage >= 2 {
            return Pass::Finished(finish(ctx, self.on, snap, dirty, Write::new()).await);
        }
        let spec = snap.spec.as_ref().map(|(r, _)| &r.spec);
        let plan = spec.map(cleanup::plan).unwrap_or_default();
        let k = ctx.keys.job(id);
        let now = records::now_ms();
        let mut result = dirty.clone();
        let mut write = Write::new();
        let mut changed = false;
        if snap.cleanup_now {
            write = write.delete(k.cleanup_now.clone());
            changed = true;
            tracing::info!(job_id = id, "operator asked for an immediate cleanup retry");
        }
        if let Some(req) = &snap.abandon {
            write = write.delete(k.abandon.clone());
            changed = true;
            if result.cleanup.abandoned.is_none() {
                tracing::warn!(target: "baton::audit", action = "abandon-cleanup", job_id = id, caller = %req.requested_by, reason = req.reason.as_deref().unwrap_or(""), "cleanup abandoned by an operator");
                result.cleanup.abandoned = Some(Abandonment {
                    reason: req.reason.clone(),
                    by: req.requested_by.clone(),
                    at_ms: now,
                });
                // An older leader must not clean it as if nothing had been abandoned.
                result.version = RESULT_VERSION_STEPS;
            }
        }
        let mut outcome = Decided::default();
        let job_timeout = spec.map_or(crate::jobs::spec::DEFAULT_TIMEOUT, |s| s.timeout);
        let hold = self.strays(&mut result, job_timeout, &mut outcome).await;
        if outcome.reread {
            tokio::time::sleep(Duration::from_millis(400)).await;
            return Pass::Reread;
        }
        if result.cleanup.stage == 0 {
            let (w, o) = (&mut write, &mut outcome);
            self.steps_phase(snap, spec, &plan, &mut result, w, o, hold)
                .await;
            // The steps ended without a run ending in this pass (no assignment deleted that
            // the folder's could reuse): the folder is given in the same write.
            if result.cleanup.stage == 1 && outcome.ended.is_empty() && self.may_pass(1) {
                self.folder_phase(snap, &mut result, &mut write, &mut outcome, hold)
                    .await;
            }
        } else {
            self.folder_phase(snap, &mut result, &mut write, &mut outcome, hold)
                .await;
        }
        if outcome.reread {
            drop(outcome.new_leases);
            tokio::time::sleep(Duration::from_millis(400)).await;
            return Pass::Reread;
        }
        changed |= outcome.changed;
        if !changed {
            for l in outcome.new_leases {
                drop(l);
            }
            if outcome.needs_operator {
                return Pass::NeedsOperator;
            }
            if outcome.paused && !outcome.running {
                return Pass::Finished(Next::Stop);
            }
            return Pass::Wait(outcome.next_at, outcome.running);
        }
        if result.cleanup.stage == 2 && outcome.new_leases.is_empty() && self.may_pass(2) {
            // The folder is done: the result goes clean in the same write, which deletes what
            // this pass would have (a delete twice is no conflict in one transaction). The
            // folder phase let go of every step's place.
            return Pass::Finished(finish(ctx, self.on, snap, result, write).await);
        }
        let commit = write
            .when_modified(k.dirty.clone(), snap.dirty_rev)
            .when_absent(k.registry.clone())
            .put(k.dirty.clone(), codec::encode(&result));
        let starts = outcome.starts;
        match self.on.writer.commit(commit).await {
            Ok(Commit::Applied { revision, .. }) => {
                for name in &outcome.ended {
                    self.leases.remove(name);
                }
                self.leases.extend(outcome.new_leases);
                for _ in 0..outcome.failures {
                    metrics::get().cleanup_failures.inc();
                }
                for (step, worker) in &outcome.assigned {
                    tracing::info!(job_id = id, worker = %worker, step = %step, "cleanup step assigned");
                }
                Pass::Wrote(Box::new(snap.after(result, revision)))
            }
            Ok(_) => {
                self.give_back(starts);
                Pass::Reread
            }
            Err(FenceError::Deposed { .. }) => {
                self.give_back(starts);
                Pass::Finished(Next::Stop)
            }
            Err(e) => {
                // Whether it applied is unknown: the next read knows.
                tracing::warn!(job_id = id, error = %e, "cannot record cleanup progress");
                self.give_back(starts);
                tokio::time::sleep(Duration::from_millis(400)).await;
                Pass::Reread
            }
        }
    }

    /// Whether a pass that reached `stage` may go on past it in the same write: not when the
    /// test hook holds the job there.
    fn may_pass(&self, stage: u32) -> bool {
        self.ctx.config.cleanup.pause_after_stage != Some(stage)
    }

    fn give_back(&self, starts: usize) {
        for _ in 0..starts {
            self.ctx.starts().give_back();
        }
    }

    /// Looks at the attempts of registry entries found beside the result; keeps those that
    /// may still run. Whether any remain (nothing new may start, and no stage may end, then).
    async fn strays(
        &mut self,
        result: &mut JobResult,
        job_timeout: Duration,
        out: &mut Decided,
    ) -> bool {
        if result.cleanup.strays.is_empty() {
            return false;
        }
        let ctx = self.ctx;
        let id = self.id;
        let watched: Vec<(Option<usize>, Watched)> = result
            .cleanup
            .strays
            .iter()
            .map(|s| {
                let w = Watched {
                    record: ctx.keys.attempt(id, s.token),
                    worker: s.worker.clone(),
                    worker_rev: s.worker_rev,
                    lease: s.worker_lease,
                    ttl: Duration::from_millis(s.worker_ttl_ms),
                    assign_timeout: Duration::MAX,
                    waiting_out: Some(job_timeout + REVOKED_SLACK),
                };
                (None, w)
            })
            .collect();
        let Some(seen) = self.look(&watched).await else {
            out.reread = true;
            return true;
        };
        let strays = std::mem::take(&mut result.cleanup.strays);
        for (stray, (seen, _)) in strays.into_iter().zip(seen) {
            match seen {
                Seen::Running(at) => {
                    out.recheck(at);
                    result.cleanup.strays.push(stray);
                }
                _ => {
                    tracing::info!(job_id = id, token = stray.token, worker = %stray.worker, "the attempt of the stray registry entry is over");
                    out.changed = true;
                }
            }
        }
        !result.cleanup.strays.is_empty()
    }

    /// Stage 0: the steps.
    #[allow(clippy::too_many_arguments)]
    async fn steps_phase(
        &mut self,
        snap: &Snapshot,
        spec: Option<&JobSpec>,
        plan: &[PlannedStep],
        result: &mut JobResult,
        write: &mut Write,
        out: &mut Decided,
        hold: bool,
    ) {
        let ctx = self.ctx;
        let id = self.id;
        let now = records::now_ms();
        let mut steps = cleanup::load(result, plan);
        let abandoned = result.cleanup.abandoned.is_some();
        self.want_slot = false;
        let named = result.version >= RESULT_VERSION_STEPS
            || cleanup::needs_steps_version(plan, &result.cleanup);
        if snap.cleanup_now {
            for s in &mut steps {
                if matches!(s.state, StepState::NeedsOperator | StepState::Retrying) {
                    s.state = StepState::Retrying;
                    s.next_retry_ms = 0;
                }
            }
        }
        // Steps abandoned by an earlier pass: their assignments are deleted, so only an
        // execution that started is waited for. Those abandoned now are looked at next pass.
        let mut fresh = vec![false; steps.len()];
        if abandoned {
            for (i, s) in steps.iter_mut().enumerate() {
                if matches!(s.state, StepState::Done | StepState::Abandoned) {
                    continue;
                }
                s.state = StepState::Abandoned;
                s.next_retry_ms = 0;
                fresh[i] = true;
                out.changed = true;
                if let Some(a) = &s.assigned {
                    *write = std::mem::take(write).delete(assignment_key(&ctx.keys, id, a));
                }
            }
        }
        self.adopt(&steps);
        let watched: Vec<(Option<usize>, Watched)> = steps
            .iter()
            .enumerate()
            .filter(|(i, _)| !fresh[*i])
            .filter_map(|(i, s)| {
                let a = s.assigned.as_ref()?;
                let bound = (s.state == StepState::Abandoned).then(|| self.step_bound());
                Some((Some(i), Watched::of(&ctx.keys, id, a, bound)))
            })
            .collect();
        let Some(seen) = self.look(&watched).await else {
            out.reread = true;
            return;
        };
        // Steps whose run ended in this pass are given again in a later one at the earliest:
        // one transaction must not delete and put the same assignment key.
        let mut ended = vec![false; steps.len()];
        for ((index, w), (seen, rec_rev)) in watched.iter().zip(seen) {
            let i = index.expect("steps only");
            let s = &mut steps[i];
            let asg = s.assigned.clone().expect("watched steps are assigned");
            let ended_key = assignment_key(&ctx.keys, id, &asg);
            if s.state == StepState::Abandoned {
                match seen {
                    Seen::Running(at) => out.recheck(at),
                    _ => {
                        tracing::info!(job_id = id, step = %s.name, "the abandoned step's run is over");
                        s.assigned = None;
                        out.end(&s.name);
                    }
                }
                continue;
            }
            match seen {
                Seen::Running(at) => {
                    out.recheck(at);
                    continue;
                }
                Seen::Done(ran) => {
                    s.state = StepState::Done;
                    s.attempts += u32::from(ran);
                    s.retries = 0;
                    s.last_error = None;
                    s.next_retry_ms = 0;
                    s.assigned = None;
                    tracing::info!(job_id = id, step = %s.name, "cleanup step done");
                    self.recorded.push(s.name.clone());
                }
                Seen::Failed(e, at_ms) => self.failed(s, e, at_ms.min(now), out),
                Seen::Again(why) => {
                    tracing::info!(job_id = id, step = %s.name, reason = %why, "cleanup step not run; giving it again");
                    self.unrun(s, why, now);
                    *write = match rec_rev {
                        Some(r) => std::mem::take(write).when_modified(w.record.clone(), r),
                        None => std::mem::take(write).when_absent(w.record.clone()),
                    };
                }
            }
            *write = std::mem::take(write).delete(ended_key);
            out.end(&steps[i].name);
            ended[i] = true;
        }
        let mut finished = false;
        if abandoned {
            finished = !hold && steps.iter().all(|s| s.assigned.is_none());
        } else if steps.iter().any(|s| s.state == StepState::NeedsOperator) {
            out.needs_operator = true;
        } else if !hold {
            let runnable = cleanup::runnable(plan, &steps);
            finished = runnable.is_empty();
            for i in runnable {
                if steps[i].assigned.is_some() {
                    continue;
                }
                if ended[i] || steps[i].next_retry_ms > now {
                    out.recheck_ms(steps[i].next_retry_ms.max(now));
                    continue;
                }
                if self.paused_after(plan, i) {
                    out.paused = true;
                    continue;
                }
                let placed = self
                    .give_step(spec, result, &plan[i], &steps[i], i, named)
                    .await;
                let s = &mut steps[i];
                match placed {
                    Placed::Yes(placed) => {
                        let (ops, asg, lease) = *placed;
                        *write = std::mem::take(write).merge(ops);
                        s.state = StepState::Running;
                        s.assigned = Some(asg.clone());
                        out.changed = true;
                        out.starts += 1;
                        out.assigned.push((s.name.clone(), asg.worker.clone()));
                        if let Some(lease) = lease {
                            out.new_leases.push((s.name.clone(), lease));
                        }
                    }
                    Placed::NoSlot | Placed::Gone => self.want_slot = true,
                    Placed::Not(why) => {
                        self.unrun(s, why, now);
                        out.changed = true;
                    }
                }
            }
        }
        cleanup::store(result, plan, steps);
        if finished {
            let c = &mut result.cleanup;
            c.stage = 1;
            c.stage_term = self.on.writer.term().revision();
            c.retries = 0;
            c.next_retry_ms = 0;
            c.last_error = None;
            c.needs_operator = false;
            out.changed = true;
            tracing::info!(job_id = id, "cleanup steps done");
        }
    }

    /// How long an execution whose assignment was deleted is waited for while its worker
    /// lives without reporting its end (a release that did not report revoked runs): the
    /// step's timeout, then its kill, have ended it by then.
    fn step_bound(&self) -> Duration {
        self.ctx.config.cleanup.timeout + REVOKED_SLACK
    }

    /// Test hook (`--test-cleanup-pause-after-step NAME`): the term that recorded step NAME
    /// done gives out no step after it (a new leader resumes).
    fn paused_after(&self, plan: &[PlannedStep], i: usize) -> bool {
        let Some(name) = &self.ctx.config.cleanup.pause_after_step else {
            return false;
        };
        self.recorded.contains(name)
            && plan
                .iter()
                .position(|p| &p.name == name)
                .is_some_and(|at| at < i)
    }

    /// A run that failed at Unix ms `at`: counted, and retried after the strategy's delay
    /// or, out of attempts, left for an operator.
    fn failed(&self, s: &mut StepProgress, e: String, at: u64, out: &mut Decided) {
        let id = self.id;
        s.attempts += 1;
        s.retries = 0;
        s.assigned = None;
        out.failures += 1;
        match self.ctx.config.cleanup.policy.delay(s.attempts) {
            Some(d) => {
                s.state = StepState::Retrying;
                s.next_retry_ms = at + d.as_millis() as u64;
                tracing::warn!(job_id = id, step = %s.name, attempts = s.attempts, retry_in = ?d, error = %e, "cleanup step failed");
            }
            None => {
                s.state = StepState::NeedsOperator;
                s.next_retry_ms = 0;
                tracing::error!(job_id = id, step = %s.name, attempts = s.attempts, error = %e, "cleanup step out of attempts; needs an operator (baton job cleanup ID --now or --abandon)");
            }
        }
        s.last_error = Some(e);
    }

    /// A try that ran nothing: backs off, uncounted.
    fn unrun(&self, s: &mut StepProgress, why: String, now: u64) {
        s.retries += 1;
        s.state = StepState::Retrying;
        s.assigned = None;
        s.last_error = Some(why);
        let d = policies::CLEANUP_UNRUN.delay(s.retries).unwrap_or_default();
        s.next_retry_ms = now + d.as_millis() as u64;
    }

    /// Counts the steps an earlier term (or an earlier pass that did not see its write)
    /// gave out, and forgets those no longer running.
    fn adopt(&mut self, steps: &[StepProgress]) {
        self.leases.retain(|name, _| {
            steps
                .iter()
                .any(|s| &s.name == name && s.assigned.is_some())
        });
        for s in steps {
            let Some(a) = &s.assigned else {
                continue;
            };
            if !self.leases.contains_key(&s.name) {
                let lease = self.on.slots.adopt(&a.worker, a.worker_rev);
                self.leases.insert(s.name.clone(), lease);
            }
        }
    }

    /// Stage 1: the job's folder, removed by the worker incarnation that ran its final
    /// attempt (at once done if that one is gone: it sweeps stale folders when it starts).
    async fn folder_phase(
        &mut self,
        snap: &Snapshot,
        result: &mut JobResult,
        write: &mut Write,
        out: &mut Decided,
        hold: bool,
    ) {
        let ctx = self.ctx;
        let id = self.id;
        let now = records::now_ms();
        self.leases.clear();
        if hold {
            // The attempt of a stray registry entry may still run in the folder.
            return;
        }
        let mut f = cleanup::folder(&result.cleanup);
        if snap.cleanup_now && matches!(f.state, StepState::NeedsOperator | StepState::Retrying) {
            f.state = StepState::Retrying;
            f.next_retry_ms = 0;
            out.changed = true;
        }
        let mut done = false;
        if let Some(a) = f.assigned.clone() {
            let w = Watched::of(&ctx.keys, id, &a, None);
            let Some(mut seen) = self.look(std::slice::from_ref(&(None, w))).await else {
                out.reread = true;
                return;
            };
            let (seen, rec_rev) = seen.remove(0);
            let key = assignment_key(&ctx.keys, id, &a);
            match seen {
                Seen::Running(at) => out.recheck(at),
                Seen::Done(_) => {
                    f.assigned = None;
                    *write = std::mem::take(write).delete(key);
                    done = true;
                }
                Seen::Failed(e, _) => {
                    // A host's own trouble, not the job's: retried, uncounted.
                    tracing::warn!(job_id = id, error = %e, "the job's folder could not be removed");
                    *write = std::mem::take(write).delete(key);
                    out.changed = true;
                    out.failures += 1;
                    self.unrun(&mut f, e, now);
                }
                Seen::Again(why) => {
                    self.unrun(&mut f, why, now);
                    *write = std::mem::take(write).delete(key);
                    let record = ctx.keys.cleanup_record(id, "folder");
                    *write = match rec_rev {
                        Some(r) => std::mem::take(write).when_modified(record, r),
                        None => std::mem::take(write).when_absent(record),
                    };
                    out.changed = true;
                }
            }
        } else if f.state == StepState::NeedsOperator && result.cleanup.abandoned.is_none() {
            out.needs_operator = true;
        } else if f.next_retry_ms > now {
            out.recheck_ms(f.next_retry_ms);
        } else {
            remove_local_folder(ctx, id);
            match self.give_folder(result, &f).await {
                Placed::Yes(placed) => {
                    let (ops, asg, _) = *placed;
                    *write = std::mem::take(write).merge(ops);
                    f.state = StepState::Running;
                    f.assigned = Some(asg.clone());
                    out.assigned.push(("folder".into(), asg.worker));
                    out.changed = true;
                }
                Placed::Gone | Placed::NoSlot => done = true,
                Placed::Not(why) => {
                    self.unrun(&mut f, why, now);
                    out.changed = true;
                }
            }
        }
        if done {
            f = StepProgress {
                attempts: f.attempts,
                ..StepProgress::default()
            };
            result.cleanup.stage = 2;
            result.cleanup.stage_term = self.on.writer.term().revision();
            out.changed = true;
        }
        cleanup::store_folder(&mut result.cleanup, f);
    }

    /// Reads the records and worker keys of `watched` in one batched read and judges each;
    /// `None` if etcd did not answer.
    async fn look(
        &mut self,
        watched: &[(Option<usize>, Watched)],
    ) -> Option<Vec<(Seen, Option<i64>)>> {
        if watched.is_empty() {
            return Some(Vec::new());
        }
        let read = watched.iter().fold(Write::new(), |r, (_, w)| {
            r.get(w.record.clone()).get(self.ctx.keys.worker(&w.worker))
        });
        let answers = match self.ctx.reads().commit(read).await {
            Ok(Outcome::Applied { response, .. }) => response.op_responses(),
            _ => return None,
        };
        let mut kvs = answers.into_iter().map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g.kvs().first().cloned(),
            _ => None,
        });
        let mut out = Vec::new();
        for (_, w) in watched {
            let (rec_kv, worker_kv) = (kvs.next().flatten(), kvs.next().flatten());
            let rec_rev = rec_kv.as_ref().map(|kv| kv.mod_revision());
            let rec = rec_kv.and_then(|kv| {
                codec::decode::<AttemptRecord>(kv.key(), kv.value(), ATTEMPT_VERSION).ok()
            });
            let alive = worker_kv.is_some_and(|kv| kv.create_revision() == w.worker_rev);
            let started = rec
                .as_ref()
                .is_some_and(|r| r.state == AttemptState::Started);
            let key = (w.worker.clone(), w.worker_rev);
            let lease = match w.lease {
                // An older release's record: the lease from the term's last view of it.
                0 => (self.on.fleet.lock().expect("fleet lock"))
                    .lease_of(&w.worker, w.worker_rev)
                    .unwrap_or(0),
                lease => lease,
            };
            if !alive && started && lease != 0 && !self.revoked.contains(&key) {
                // Its key is gone but its lease may live on: no wait starts before that lease
                // is revoked (see the fleet's guarantee).
                let store = &self.ctx.store;
                match crate::coordinator::fleet::revoke_lease(store, lease).await {
                    Ok(()) => {
                        tracing::warn!(record = %w.record, worker = %w.worker, lease, "its worker's key is gone: revoked the worker's lease before waiting out its TTL");
                        self.revoked.insert(key.clone());
                        self.gone.insert(key, Instant::now());
                    }
                    Err(e) => {
                        tracing::warn!(worker = %w.worker, error = %e, "cannot revoke a gone worker's lease yet");
                        let again = Instant::now() + Duration::from_millis(500);
                        out.push((Seen::Running(Some(again)), rec_rev));
                        continue;
                    }
                }
            }
            out.push((self.judge(w, rec, alive), rec_rev));
        }
        Some(out)
    }

    /// How one thing given to a worker stands, from its record and whether its worker lives.
    fn judge(&mut self, w: &Watched, rec: Option<AttemptRecord>, alive: bool) -> Seen {
        let folder = w.record.ends_with("/folder");
        match rec.as_ref().map(|r| r.state) {
            Some(AttemptState::Exited) => {
                let r = rec.expect("matched");
                self.looks.remove(&w.record);
                if r.exit_code == Some(0) && r.killed_by.is_none() {
                    return Seen::Done(!folder);
                }
                if r.killed_by.as_deref() == Some("revoked") {
                    return Seen::Again("the leader ended the assignment".into());
                }
                if folder {
                    let why = r
                        .reason
                        .unwrap_or_else(|| "cannot remove the folder".into());
                    return Seen::Failed(why, r.at_ms);
                }
                let tail = r.log_tail.lines().last().unwrap_or("").to_string();
                let why = match (r.killed_by.as_deref(), r.exit_code) {
                    (Some("timeout"), _) => format!(
                        "cleanup command timed out after {}",
                        humantime::format_duration(self.ctx.config.cleanup.timeout)
                    ),
                    (_, Some(c)) => format!("cleanup command exited with code {c}: {tail}"),
                    _ if r.start_error.is_some() => format!(
                        "cleanup command could not start: {}",
                        r.start_error.as_deref().unwrap_or_default()
                    ),
                    _ => format!("cleanup command killed by signal {}", r.signal.unwrap_or(0)),
                };
                Seen::Failed(why, r.at_ms)
            }
            Some(AttemptState::Lost | AttemptState::Preempted | AttemptState::Rejected) => {
                self.looks.remove(&w.record);
                let why = rec.and_then(|r| r.reason).unwrap_or_default();
                Seen::Again(format!("the worker did not run it: {why}"))
            }
            Some(AttemptState::Started) | None => {
                let started = rec.is_some();
                if w.waiting_out.is_some() && !started {
                    // Its assignment is gone: it can never start.
                    self.looks.remove(&w.record);
                    return Seen::Done(false);
                }
                let key = (w.worker.clone(), w.worker_rev);
                if alive {
                    self.gone.remove(&key);
                    let first = *self
                        .looks
                        .entry(w.record.clone())
                        .or_insert_with(Instant::now);
                    if let Some(bound) = w.waiting_out {
                        let due = first + bound;
                        if Instant::now() >= due {
                            tracing::warn!(record = %w.record, worker = %w.worker, "no end reported for a revoked run within its timeout and slack; taking it as over");
                            self.looks.remove(&w.record);
                            return Seen::Done(false);
                        }
                        return Seen::Running(Some(due));
                    }
                    if !started {
                        let due = first.checked_add(w.assign_timeout);
                        if due.is_some_and(|d| Instant::now() >= d) {
                            self.looks.remove(&w.record);
                            return Seen::Again("no start within the assign timeout".into());
                        }
                        return Seen::Running(due);
                    }
                    Seen::Running(None)
                } else {
                    let since = *self.gone.entry(key).or_insert_with(Instant::now);
                    let wait = if started { w.ttl } else { Duration::ZERO };
                    if since.elapsed() >= wait {
                        self.looks.remove(&w.record);
                        Seen::Again(format!("worker {} went away", w.worker))
                    } else {
                        Seen::Running(Some(since + wait))
                    }
                }
            }
        }
    }

    /// Gives step `step` (progress `s`, index `i` in the plan) to a worker.
    #[allow(clippy::too_many_arguments)]
    async fn give_step(
        &self,
        spec: Option<&JobSpec>,
        result: &JobResult,
        step: &PlannedStep,
        s: &StepProgress,
        i: usize,
        named: bool,
    ) -> Placed {
        let ctx = self.ctx;
        let id = self.id;
        let Some(spec) = spec else {
            return Placed::Not("the job's spec is gone".into());
        };
        if !self.on.slots.has_room() {
            return Placed::NoSlot;
        }
        let workers = match self.on.workers(ctx).await {
            Ok(w) => w,
            Err(e) => return Placed::Not(format!("cannot list workers: {e}")),
        };
        let own = result.worker.as_deref().map(|w| (w, result.worker_rev));
        let turn = s.retries as usize + i;
        let order = place::candidates(
            &workers,
            &self.on.slots,
            &spec.worker_selector,
            own,
            id,
            turn,
        );
        if order.is_empty() {
            return Placed::Not(
                "no live worker (matching the job's selector) to run the cleanup step".into(),
            );
        }
        let Some((pick, lease)) = order.iter().find_map(|w| {
            self.on
                .slots
                .try_take(&w.record.worker_id, w.rev, w.record.cleanup_capacity)
                .map(|l| (*w, l))
        }) else {
            return Placed::NoSlot;
        };
        let (wid, wrev, wmod, rec) = (
            &pick.record.worker_id,
            &pick.rev,
            &pick.mod_rev,
            &pick.record,
        );
        let attempt = s.attempts + 1;
        let record_step = if named {
            format!("{}.{attempt}", step.name)
        } else {
            attempt.to_string()
        };
        let mut env = spec.env.clone();
        env.insert("BATON_JOB_STATUS".into(), status_name(result.status).into());
        let assignment = Assignment {
            version: if named {
                CLEANUP_STEP_ASSIGNMENT_VERSION
            } else {
                CLEANUP_ASSIGNMENT_VERSION
            },
            kind: AssignmentKind::Cleanup,
            job_id: id.to_string(),
            attempt,
            recovered: false,
            spec: JobSpec {
                command: step.command.clone(),
                env,
                cleanup_command: Vec::new(),
                max_attempts: 1,
                timeout: ctx.config.cleanup.timeout,
                worker_selector: spec.worker_selector.clone(),
                cleanup_steps: Vec::new(),
            },
            term: self.on.writer.term().revision(),
            step: named.then(|| step.name.clone()),
        };
        let asg = CleanupAssigned {
            worker: wid.clone(),
            worker_rev: *wrev,
            worker_lease: pick.lease,
            worker_ttl_ms: rec.lease_ttl_ms.saturating_add(rec.margin_ms),
            assign_timeout_ms: rec.assign_timeout_ms,
            step: record_step.clone(),
        };
        ctx.take_start().await;
        let worker_key = ctx.keys.worker(wid);
        let ops = Write::new()
            .when_created(worker_key.clone(), *wrev)
            .when_modified(worker_key, *wmod)
            // A record left by an earlier run of this step is not this one's.
            .delete(ctx.keys.cleanup_record(id, &record_step))
            .put(
                assignment_key(&ctx.keys, id, &asg),
                codec::encode(&assignment),
            );
        Placed::Yes(Box::new((ops, asg, Some(lease))))
    }

    /// Gives the folder stage to the worker incarnation that ran the final attempt.
    async fn give_folder(&self, result: &JobResult, f: &StepProgress) -> Placed {
        let ctx = self.ctx;
        let id = self.id;
        let Some(w) = &result.worker else {
            return Placed::Gone;
        };
        let workers = match self.on.workers(ctx).await {
            Ok(w) => w,
            Err(e) => return Placed::Not(format!("cannot list workers: {e}")),
        };
        let Some(pick) = workers
            .iter()
            .find(|x| &x.record.worker_id == w && x.rev == result.worker_rev)
        else {
            // Gone: its next incarnation removes stale folders when it starts.
            return Placed::Gone;
        };
        let (wid, wrev, wmod, rec) = (
            &pick.record.worker_id,
            &pick.rev,
            &pick.mod_rev,
            &pick.record,
        );
        let assignment = Assignment {
            version: CLEANUP_ASSIGNMENT_VERSION,
            kind: AssignmentKind::Folder,
            job_id: id.to_string(),
            attempt: f.attempts + 1,
            recovered: false,
            spec: JobSpec {
                command: vec!["true".into()],
                env: Default::default(),
                cleanup_command: Vec::new(),
                max_attempts: 1,
                timeout: ctx.config.cleanup.timeout,
                worker_selector: Default::default(),
                cleanup_steps: Vec::new(),
            },
            term: self.on.writer.term().revision(),
            step: None,
        };
        let asg = CleanupAssigned {
            worker: wid.clone(),
            worker_rev: *wrev,
            worker_lease: pick.lease,
            worker_ttl_ms: rec.lease_ttl_ms.saturating_add(rec.margin_ms),
            assign_timeout_ms: rec.assign_timeout_ms,
            step: "folder".into(),
        };
        let worker_key = ctx.keys.worker(wid);
        let ops = Write::new()
            .when_created(worker_key.clone(), *wrev)
            .when_modified(worker_key, *wmod)
            .delete(ctx.keys.cleanup_record(id, "folder"))
            .put(
                assignment_key(&ctx.keys, id, &asg),
                codec::encode(&assignment),
            );
        Placed::Yes(Box::new((ops, asg, None)))
    }
}

/// Where a step went, or why it did not.
enum Placed {
    /// These ops give it out as this (a command holding this place; it took a start).
    Yes(Box<(Write, CleanupAssigned, Option<StepLease>)>),
    /// No place among the running commands now.
    NoSlot,
    /// The folder's worker incarnation is gone: nothing to remove there.
    Gone,
    /// It cannot be given out now: backs off, uncounted.
    Not(String),
}

/// What one pass decided, besides the entry itself.
#[derive(Default)]
struct Decided {
    changed: bool,
    /// Steps whose run ended in this pass: their places go once it is recorded.
    ended: Vec<String>,
    new_leases: Vec<(String, StepLease)>,
    assigned: Vec<(String, String)>,
    starts: usize,
    failures: u32,
    needs_operator: bool,
    /// Look again by this Unix ms at the latest.
    next_at: Option<u64>,
    /// Something of the job still runs on a worker.
    running: bool,
    /// etcd did not answer a look: nothing of the pass holds; read again.
    reread: bool,
    /// The test hook holds the next step.
    paused: bool,
}

impl Decided {
    fn end(&mut self, name: &str) {
        self.changed = true;
        self.ended.push(name.to_string());
    }

    fn recheck_ms(&mut self, at: u64) {
        self.next_at = Some(self.next_at.map_or(at, |n| n.min(at)));
    }

    /// Something still runs; look again by `at` at the latest.
    fn recheck(&mut self, at: Option<Instant>) {
        self.running = true;
        if let Some(at) = at {
            let wait = at.saturating_duration_since(Instant::now());
            self.recheck_ms(records::now_ms() + wait.as_millis() as u64 + 1);
        }
    }
}

/// The job's folder on the leader's own host, if a worker here used it (in its bucket, or
/// where a release before the buckets kept it).
fn remove_local_folder(ctx: &Ctx, id: &str) {
    let storage = &ctx.config.storage_dir;
    for dir in [
        record::job_dir(storage, id),
        record::legacy_job_dir(storage, id),
    ] {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(job_id = id, error = %e, "cannot remove the job's local folder");
            }
        }
    }
}

/// Stage 3: dirty becomes clean, and the job's other keys go, in one fenced transaction that
/// also requires no registry entry beside the result. `with` is the rest of the pass that
/// reached stage 2, committed with it (deletes and compares only: a put there could meet one
/// of the deletes here).
async fn finish(
    ctx: &Ctx,
    on: &On<'_>,
    snap: &Snapshot,
    mut result: JobResult,
    with: Write,
) -> Next {
    let k = ctx.keys.job(&snap.id);
    let leftovers: Vec<CleanupAssigned> = result
        .cleanup
        .assigned
        .iter()
        .chain(
            result
                .cleanup
                .steps
                .iter()
                .filter_map(|s| s.assigned.as_ref()),
        )
        .cloned()
        .collect();
    let c = &mut result.cleanup;
    c.stage = 3;
    c.done_ms = records::now_ms();
    c.next_retry_ms = 0;
    c.last_error = None;
    c.assigned = None;
    for s in &mut c.steps {
        s.assigned = None;
        s.next_retry_ms = 0;
    }
    if result.version < RESULT_VERSION_STEPS {
        result.version = records::RESULT_VERSION;
    }
    let mut write = with
        .when_modified(k.dirty.clone(), snap.dirty_rev)
        .when_absent(k.registry.clone());
    if let Some((_, incarnation)) = &snap.spec {
        write = write.when_created(k.spec.clone(), *incarnation);
    }
    write = write
        .delete(k.spec)
        .delete(k.cancel)
        .delete(k.cleanup_now)
        .delete(k.abandon)
        .delete(k.dirty)
        .delete_prefix(format!("{}{}/", ctx.keys.cleanups(), snap.id))
        .delete_prefix(ctx.keys.attempts_of(&snap.id))
        .put(k.clean, codec::encode(&result));
    // A step's assignment left over (a worker that never answered) goes too.
    for a in &leftovers {
        write = write.delete(assignment_key(&ctx.keys, &snap.id, a));
    }
    match on.writer.commit(write).await {
        Ok(c) if c.applied() => {
            tracing::info!(job_id = %snap.id, attempts = result.cleanup.attempts, abandoned = result.cleanup.abandoned.is_some(), "cleanup done; result is clean");
            Next::Done
        }
        Ok(_) => Next::At(records::now_ms() + 200),
        Err(FenceError::Deposed { .. }) => Next::Stop,
        Err(_) => Next::At(records::now_ms() + 500),
    }
}

fn status_name(s: TerminalStatus) -> &'static str {
    match s {
        TerminalStatus::Finished => "FINISHED",
        TerminalStatus::Failed => "FAILED",
        TerminalStatus::Canceled => "CANCELED",
    }
}
