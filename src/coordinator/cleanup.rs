//! Dirty-job cleanup: the leader turns every dirty result clean, whatever fails and however
//! often leadership moves (Flink's FLINK-11813, standalone).
//!
//! Stages, in order, each idempotent (safe to repeat, safe to interrupt anywhere):
//! 1. the job's `cleanup_command`, if any, run by a live worker under a lease guard like jobs,
//!    with a timeout, its outcome reported in `cleanups/<id>/<attempt>`;
//! 2. removal of the job's folder by the worker incarnation that ran its final attempt (done
//!    at once if that incarnation is gone: a worker removes stale folders when it starts);
//! 3. one fenced transaction: delete `jobs/<id>`, `cancel/<id>`, `cleanup-now/<id>` and
//!    `results/dirty/<id>`, put `results/clean/<id>`.
//!
//! Progress is recorded in the dirty entry after each stage (a fenced write comparing the
//! entry's revision), so a new leader resumes at the first unfinished stage. A step given to a
//! worker is recorded in the entry in the same transaction that writes its assignment, so a
//! new leader waits for that step's report instead of starting another; a step whose worker is
//! gone is given again only after the worker's TTL and margin. A failed stage is
//! retried with exponential backoff and jitter; when attempts run out the entry stays dirty and
//! is marked as needing an operator, never dropped. At most `--cleanup-concurrency` cleanups
//! run at once. Clean results are deleted after `--result-retention`, in small fenced batches.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backoff::backoff::Backoff;
use etcd_client::WatchOptions;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::fleet::Fleet;
use super::{CleanupConfig, Ctx, Writer};
use crate::election::Commit;
use crate::exec::record;
use crate::jobs::records::{self, CleanupAssigned, JobResult, TerminalStatus};
use crate::jobs::work::{
    Assignment, AssignmentKind, AttemptRecord, AttemptState, WorkerRecord, ATTEMPT_VERSION,
    CLEANUP_ASSIGNMENT_VERSION, WORKER_VERSION,
};
use crate::jobs::{self, Snapshot};
use crate::metrics;
use crate::rolelog;
use crate::store::group::Outcome;
use crate::store::{codec, Keys, Write};

/// What one cleanup run ended with.
enum Next {
    Done,
    /// Retry at this Unix ms.
    At(u64),
    /// Its attempts are exhausted: waits for `baton job cleanup ID --now`.
    NeedsOperator,
    /// Stopped: paused by the hook, term over, or nothing to do.
    Stop,
}

/// Cleans every dirty result for as long as the writer's term lasts.
pub(super) async fn run(ctx: Arc<Ctx>, writer: Writer, fleet: Arc<Mutex<Fleet>>) {
    let term = writer.term().clone();
    let mut c = Cleaner {
        ctx: ctx.clone(),
        writer,
        wakers: Wakers::default(),
        fleet,
        tasks: JoinSet::new(),
        queue: VecDeque::new(),
        inflight: HashSet::new(),
        recheck: HashSet::new(),
        timers: BTreeMap::new(),
        needs_operator: HashSet::new(),
    };
    let mut first = true;
    let mut report = tokio::time::interval(Duration::from_secs(1));
    let mut retention = tokio::time::interval(
        (ctx.config.cleanup.retention / 4)
            .clamp(Duration::from_millis(500), Duration::from_secs(60)),
    );
    'resync: loop {
        let (rev, ids) = tokio::select! {
            r = read_pages(&ctx) => match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read dirty results; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            },
            _ = term.ended() => break 'resync,
        };
        if !ids.is_empty() {
            tracing::info!(dirty = ids.len(), "resuming dirty cleanups");
        }
        let found = ids.len();
        for id in ids {
            c.schedule(id);
        }
        if std::mem::take(&mut first) {
            rolelog::recovered(
                &ctx.config.replica_id,
                term.revision(),
                term.lease_id(),
                "cleanups",
                found,
            );
        }
        let mut client = ctx.store.client();
        let opts = || {
            WatchOptions::new()
                .with_prefix()
                .with_start_revision(rev + 1)
        };
        let Ok(mut stream) = client.watch(ctx.keys.dirty(), Some(opts())).await else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        let mut more = true;
        for prefix in [ctx.keys.cleanup_now(), ctx.keys.cleanups()] {
            more = more && stream.watch(prefix, Some(opts())).await.is_ok();
        }
        if !more {
            continue;
        }
        loop {
            let next_timer = c.timers.keys().next().copied();
            let sleep = records::sleep_until_ms(next_timer);
            tokio::select! {
                biased;
                _ = term.ended() => break 'resync,
                Some(done) = c.tasks.join_next() => {
                    let Ok((id, next)) = done else { continue };
                    c.finished(id, next);
                }
                msg = stream.message() => match msg {
                    Ok(Some(resp)) if !resp.canceled() && resp.compact_revision() == 0 => {
                        for ev in resp.events() {
                            if ev.event_type() != etcd_client::EventType::Put {
                                continue;
                            }
                            if let Some(kv) = ev.kv() {
                                c.event(kv);
                            }
                        }
                    }
                    _ => {
                        tracing::warn!("cleanup watch ended; resyncing");
                        continue 'resync;
                    }
                },
                _ = sleep => {
                    let now = records::now_ms();
                    let due: Vec<u64> = c.timers.range(..=now).map(|(k, _)| *k).collect();
                    for at in due {
                        for id in c.timers.remove(&at).unwrap_or_default() {
                            c.schedule(id);
                        }
                    }
                }
                _ = retention.tick() => expire_clean(&ctx, &c.writer).await,
                _ = report.tick() => c.report(),
            }
        }
    }
    // The steps on workers go on; the next leader waits for their reports.
    c.tasks.abort_all();
    while c.tasks.join_next().await.is_some() {}
    metrics::get().clear_cleanup_gauges();
}

/// Wakes a job's cleanup task when its step's record changes, instead of it polling etcd.
/// A wake with nobody waiting is kept for the next wait (`notify_one`), so none is lost
/// between a read and the wait after it.
#[derive(Clone, Default)]
struct Wakers(Arc<std::sync::Mutex<HashMap<String, Arc<Notify>>>>);

impl Wakers {
    fn of(&self, id: &str) -> Arc<Notify> {
        self.0
            .lock()
            .expect("wakers lock")
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    fn wake(&self, id: &str) {
        if let Some(n) = self.0.lock().expect("wakers lock").get(id) {
            n.notify_one();
        }
    }

    fn forget(&self, id: &str) {
        self.0.lock().expect("wakers lock").remove(id);
    }
}

/// The cleaner of one term: a queue of dirty results, at most `--cleanup-concurrency` cleaned
/// at once (queued ones hold no task), one at a time per job.
struct Cleaner {
    ctx: Arc<Ctx>,
    writer: Writer,
    wakers: Wakers,
    fleet: Arc<Mutex<Fleet>>,
    tasks: JoinSet<(String, Next)>,
    queue: VecDeque<String>,
    /// Jobs queued or being cleaned.
    inflight: HashSet<String>,
    recheck: HashSet<String>,
    timers: BTreeMap<u64, HashSet<String>>,
    needs_operator: HashSet<String>,
}

impl Cleaner {
    fn schedule(&mut self, id: String) {
        if !self.inflight.insert(id.clone()) {
            self.recheck.insert(id);
            return;
        }
        self.queue.push_back(id);
        self.pump();
    }

    fn pump(&mut self) {
        while self.tasks.len() < self.ctx.config.cleanup.concurrency.max(1) {
            let Some(id) = self.queue.pop_front() else {
                return;
            };
            let (ctx, writer, wakers) =
                (self.ctx.clone(), self.writer.clone(), self.wakers.clone());
            let fleet = self.fleet.clone();
            self.tasks.spawn(async move {
                let on = On {
                    writer: &writer,
                    wakers: &wakers,
                    fleet: &fleet,
                };
                let next = clean(&ctx, &on, &id).await;
                wakers.forget(&id);
                (id, next)
            });
        }
    }

    fn finished(&mut self, id: String, next: Next) {
        self.inflight.remove(&id);
        self.needs_operator.remove(&id);
        match next {
            Next::At(at) => {
                self.timers.entry(at).or_default().insert(id.clone());
            }
            Next::NeedsOperator => {
                self.needs_operator.insert(id.clone());
            }
            Next::Done | Next::Stop => {}
        }
        if self.recheck.remove(&id) {
            self.schedule(id);
        }
        self.pump();
    }

    fn event(&mut self, kv: &etcd_client::KeyValue) {
        let keys = &self.ctx.keys;
        if let Some(id) = Keys::id_in(&keys.dirty(), kv.key()) {
            // Only a new result needs a look: later versions are this term's own progress,
            // which the job's task (or its timer) already acts on.
            if kv.version() == 1 {
                self.schedule(id.to_string());
            }
        } else if let Some(id) = Keys::id_in(&keys.cleanup_now(), kv.key()) {
            self.schedule(id.to_string());
        } else if let Some((id, _step)) =
            Keys::id_in(&keys.cleanups(), kv.key()).and_then(|r| r.split_once('/'))
        {
            self.wakers.wake(id);
        }
    }

    fn report(&self) {
        let pending: HashSet<&String> = self
            .inflight
            .iter()
            .chain(self.timers.values().flatten())
            .chain(self.needs_operator.iter())
            .collect();
        let m = metrics::get();
        m.cleanups_pending.set(pending.len() as i64);
        m.cleanups_needing_operator
            .set(self.needs_operator.len() as i64);
    }
}

async fn read_pages(ctx: &Ctx) -> Result<(i64, Vec<String>), jobs::Error> {
    let mut rev = 0;
    let mut ids = Vec::new();
    for prefix in [ctx.keys.dirty(), ctx.keys.cleanup_now()] {
        let mut after = String::new();
        loop {
            let range = jobs::Range::after(&prefix, &after);
            let (kvs, r) = jobs::page(&ctx.store, range, 1000, rev, true).await?;
            rev = r;
            for kv in &kvs {
                if let Some(id) = Keys::id_in(&prefix, kv.key()) {
                    ids.push(id.to_string());
                    after = id.to_string();
                }
            }
            if kvs.len() < 1000 {
                break;
            }
        }
    }
    Ok((rev, ids))
}

/// The delay before cleanup attempt `attempts + 1`: exponential with jitter, capped.
fn delay(cfg: &CleanupConfig, attempts: u32) -> Duration {
    let mut b = backoff::ExponentialBackoff {
        initial_interval: cfg.initial_delay,
        max_interval: cfg.max_delay,
        randomization_factor: 0.1,
        multiplier: 2.0,
        max_elapsed_time: None,
        ..Default::default()
    };
    let mut d = cfg.initial_delay;
    for _ in 0..attempts.max(1) {
        d = b.next_backoff().unwrap_or(cfg.max_delay);
    }
    d.min(cfg.max_delay)
}

/// Runs the remaining stages of one job's cleanup.
async fn clean(ctx: &Ctx, on: &On<'_>, id: &str) -> Next {
    let writer = on.writer;
    let term = writer.term();
    // After a write of its own the job's state is known without a read.
    let mut known: Option<Snapshot> = None;
    // A step it has just given out has no report yet: no need to look before a wake.
    let mut just_assigned = false;
    loop {
        if term.check().is_err() {
            return Next::Stop;
        }
        let snap = match known.take() {
            Some(s) => s,
            None => match ctx.read(id).await {
                Ok(s) => s,
                Err(jobs::Error::Corrupt(_)) => return Next::Stop,
                Err(e) => {
                    tracing::warn!(job_id = id, error = %e, "cannot read a dirty job");
                    return Next::At(records::now_ms() + 1000);
                }
            },
        };
        let Some(mut result) = snap.dirty.clone() else {
            return Next::Done;
        };
        let progress = &mut result.cleanup;
        if snap.cleanup_now && (progress.needs_operator || progress.next_retry_ms > 0) {
            tracing::info!(job_id = id, "operator asked for an immediate cleanup retry");
            progress.needs_operator = false;
            progress.next_retry_ms = 0;
        } else if progress.needs_operator {
            return Next::NeedsOperator;
        } else if progress.next_retry_ms > records::now_ms() {
            return Next::At(progress.next_retry_ms);
        }
        if let Some(p) = ctx.config.cleanup.pause_after_stage {
            // Only the term that reached the stage pauses: a new leader resumes.
            let here = progress.stage_term == term.revision() || (p == 0 && progress.stage == 0);
            if progress.stage == p && p < 3 && here {
                return Next::Stop;
            }
        }
        let stage = progress.stage;
        if stage >= 2 {
            return finish(ctx, writer, &snap, result).await;
        }
        let has_command = snap
            .spec
            .as_ref()
            .is_some_and(|(r, _)| !r.spec.cleanup_command.is_empty());
        let mut next = result.clone();
        next.version = records::RESULT_VERSION;
        let outcome = if stage == 0 && !has_command {
            Step::Done(false)
        } else {
            if stage == 1 {
                remove_local_folder(ctx, id);
            }
            let fresh = std::mem::take(&mut just_assigned);
            stage_on_worker(ctx, on, &snap, &result, &mut next, fresh).await
        };
        let assigned = next
            .cleanup
            .assigned
            .take()
            .or(result.cleanup.assigned.clone());
        let mut compares = Write::new();
        let mut failed = false;
        let p = &mut next.cleanup;
        match outcome {
            Step::Assigned(rev, written) => {
                known = Some(snap.after(*written, rev));
                just_assigned = true;
                continue;
            }
            Step::TermOver => return Next::Stop,
            Step::Done(ran) => {
                p.attempts += u32::from(ran);
                p.retries = 0;
                p.stage += 1;
                p.stage_term = term.revision();
                p.last_error = None;
                p.next_retry_ms = 0;
            }
            Step::Again(why, rec_rev) => {
                tracing::info!(job_id = id, reason = %why, "cleanup step not run; giving it again");
                p.last_error = Some(why);
                p.retries += 1;
                let backoff = Duration::from_secs(1) * 2u32.pow(p.retries.min(6) - 1);
                p.next_retry_ms = records::now_ms() + backoff.as_millis() as u64;
                if let Some(a) = &assigned {
                    let key = ctx.keys.cleanup_record(id, &a.step);
                    compares = match rec_rev {
                        Some(r) => compares.when_modified(key, r),
                        None => compares.when_absent(key),
                    };
                }
            }
            Step::Failed(e) => {
                failed = true;
                p.retries = 0;
                p.attempts += 1;
                p.last_error = Some(e.clone());
                let cfg = &ctx.config.cleanup;
                if cfg.max_attempts > 0 && p.attempts >= cfg.max_attempts {
                    p.needs_operator = true;
                    tracing::error!(job_id = id, attempts = p.attempts, error = %e, "cleanup attempts exhausted; needs an operator (baton job cleanup ID --now)");
                } else {
                    let d = delay(cfg, p.attempts);
                    p.next_retry_ms = records::now_ms() + d.as_millis() as u64;
                    tracing::warn!(job_id = id, stage = p.stage + 1, attempts = p.attempts, retry_in = ?d, error = %e, "cleanup stage failed");
                }
            }
        }
        next.cleanup.assigned = None;
        let ended = assigned.map(|a| ctx.keys.cleanup_assignment(&a.worker, a.worker_rev, id));
        match record(ctx, writer, &snap, &next, compares, ended).await {
            Ok(rev) => known = Some(snap.after(next, rev)),
            Err(()) => return Next::At(records::now_ms() + 500),
        }
        // Counted once it is recorded: an unrecorded failure is read and met again.
        if failed {
            metrics::get().cleanup_failures.inc();
        }
    }
}

/// The job's folder on the leader's own host, if a worker here used it.
fn remove_local_folder(ctx: &Ctx, id: &str) {
    let dir = record::job_dir(&ctx.config.storage_dir, id);
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(job_id = id, error = %e, "cannot remove the job's local folder");
        }
    }
}

/// How one cleanup step on a worker went.
enum Step {
    /// Recorded in the dirty entry (as this, at this revision) and assigned: look again.
    Assigned(i64, Box<JobResult>),
    /// It ran to a good end; `true` if it ran a command (counted as an attempt).
    Done(bool),
    Failed(String),
    /// It did not run (rejected, lost, preempted, unanswered, no worker): give it again soon,
    /// uncounted; the record it ended with, to compare.
    Again(String, Option<i64>),
    TermOver,
}

/// Stages 1 and 2: the cleanup command, and the folder, on a worker. Loops until the step ends
/// or must be recorded.
async fn stage_on_worker(
    ctx: &Ctx,
    on: &On<'_>,
    snap: &Snapshot,
    result: &JobResult,
    next: &mut JobResult,
    just_assigned: bool,
) -> Step {
    let term = on.writer.term();
    let id = snap.id.as_str();
    let folder = result.cleanup.stage == 1;
    let Some(a) = result.cleanup.assigned.clone() else {
        return assign_step(ctx, on, snap, result, next, folder).await;
    };
    let record_key = ctx.keys.cleanup_record(id, &a.step);
    let worker_key = ctx.keys.worker(&a.worker);
    let first_look = tokio::time::Instant::now();
    let mut gone_at: Option<tokio::time::Instant> = None;
    let wake = on.wakers.of(id);
    if just_assigned {
        wait(&wake).await;
    }
    loop {
        if term.check().is_err() {
            return Step::TermOver;
        }
        let read = Write::new().get(record_key.clone()).get(worker_key.clone());
        let answers = match ctx.reads().commit(read).await {
            Ok(Outcome::Applied { response, .. }) => response.op_responses(),
            _ => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut kvs = answers.into_iter().map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g.kvs().first().cloned(),
            _ => None,
        });
        let (rec_kv, worker_kv) = (kvs.next().flatten(), kvs.next().flatten());
        let rec_rev = rec_kv.as_ref().map(|kv| kv.mod_revision());
        let rec = rec_kv.and_then(|kv| {
            codec::decode::<AttemptRecord>(kv.key(), kv.value(), ATTEMPT_VERSION).ok()
        });
        let alive = worker_kv.is_some_and(|kv| kv.create_revision() == a.worker_rev);
        match rec.as_ref().map(|r| r.state) {
            Some(AttemptState::Exited) => {
                let r = rec.expect("matched");
                if r.exit_code == Some(0) && r.killed_by.is_none() {
                    return Step::Done(!folder);
                }
                if folder {
                    return Step::Failed(
                        r.reason
                            .unwrap_or_else(|| "cannot remove the folder".into()),
                    );
                }
                let tail = r.log_tail.lines().last().unwrap_or("").to_string();
                return Step::Failed(match (r.killed_by.as_deref(), r.exit_code) {
                    (Some("timeout"), _) => format!(
                        "cleanup command timed out after {}",
                        humantime::format_duration(ctx.config.cleanup.timeout)
                    ),
                    (_, Some(c)) => format!("cleanup command exited with code {c}: {tail}"),
                    _ => format!("cleanup command killed by signal {}", r.signal.unwrap_or(0)),
                });
            }
            Some(AttemptState::Lost | AttemptState::Preempted | AttemptState::Rejected) => {
                let why = rec.and_then(|r| r.reason).unwrap_or_default();
                return Step::Again(format!("the worker did not run it: {why}"), rec_rev);
            }
            Some(AttemptState::Started) | None => {
                let started = rec.is_some();
                if alive {
                    gone_at = None;
                    let timeout = Duration::from_millis(a.assign_timeout_ms);
                    if !started && first_look.elapsed() >= timeout {
                        return Step::Again("no start within the assign timeout".into(), rec_rev);
                    }
                } else {
                    let since = *gone_at.get_or_insert_with(tokio::time::Instant::now);
                    let wait = if started {
                        Duration::from_millis(a.worker_ttl_ms)
                    } else {
                        Duration::ZERO
                    };
                    if since.elapsed() >= wait {
                        return Step::Again(format!("worker {} went away", a.worker), rec_rev);
                    }
                }
            }
        }
        wait(&wake).await;
    }
}

/// Until the step's record changes (it wakes this at once), or a second: a worker's key going
/// shows at the next look.
async fn wait(wake: &Notify) {
    tokio::select! {
        _ = wake.notified() => {}
        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
    }
}

/// Gives the step to a worker: recorded in the dirty entry with the assignment, one fenced
/// transaction that also compares the worker's key.
async fn assign_step(
    ctx: &Ctx,
    on: &On<'_>,
    snap: &Snapshot,
    result: &JobResult,
    next: &mut JobResult,
    folder: bool,
) -> Step {
    let id = snap.id.as_str();
    let writer = on.writer;
    let workers = match on.workers(ctx).await {
        Ok(w) => w,
        Err(e) => return Step::Again(format!("cannot list workers: {e}"), None),
    };
    let pick = if folder {
        match &result.worker {
            None => return Step::Done(false),
            Some(w) => match workers
                .iter()
                .find(|x| &x.0 == w && x.1 == result.worker_rev)
            {
                Some(x) => x.clone(),
                // Gone: its next incarnation removes stale folders when it starts.
                None => return Step::Done(false),
            },
        }
    } else {
        // The command runs where the job could: on workers its selector matches.
        let fits = |labels: &std::collections::BTreeMap<String, String>| {
            snap.spec
                .as_ref()
                .is_none_or(|(r, _)| r.spec.selects(labels))
        };
        let open: Vec<_> = workers
            .iter()
            .filter(|w| !w.3.draining && w.3.cleanup_capacity > 0 && fits(&w.3.labels))
            .collect();
        if open.is_empty() {
            return Step::Again(
                "no live worker (matching the job's selector) to run the cleanup command".into(),
                None,
            );
        }
        // The worker that ran the job first (its folder is there); another on each retry.
        let own = open
            .iter()
            .position(|w| Some(&w.0) == result.worker.as_ref() && w.1 == result.worker_rev);
        let retries = result.cleanup.retries as usize;
        let spread = id
            .bytes()
            .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
        let at = own.unwrap_or(spread) + retries;
        open[at % open.len()].clone()
    };
    let (wid, wrev, wmod, rec) = pick;
    let attempt = result.cleanup.attempts + 1;
    let step = if folder {
        "folder".to_string()
    } else {
        attempt.to_string()
    };
    let spec = match (&snap.spec, folder) {
        (_, true) => None,
        (Some((r, _)), false) => Some(r.spec.clone()),
        (None, false) => return Step::Done(false),
    };
    let (kind, spec) = match spec {
        None => (
            AssignmentKind::Folder,
            crate::jobs::spec::JobSpec {
                command: vec!["true".into()],
                env: Default::default(),
                cleanup_command: Vec::new(),
                max_attempts: 1,
                timeout: ctx.config.cleanup.timeout,
                worker_selector: Default::default(),
            },
        ),
        Some(s) => {
            let mut env = s.env.clone();
            env.insert("BATON_JOB_STATUS".into(), status_name(result.status).into());
            (
                AssignmentKind::Cleanup,
                crate::jobs::spec::JobSpec {
                    command: s.cleanup_command.clone(),
                    env,
                    cleanup_command: Vec::new(),
                    max_attempts: 1,
                    timeout: ctx.config.cleanup.timeout,
                    worker_selector: s.worker_selector.clone(),
                },
            )
        }
    };
    if kind == AssignmentKind::Cleanup {
        ctx.take_start().await;
    }
    let assignment = Assignment {
        version: CLEANUP_ASSIGNMENT_VERSION,
        kind,
        job_id: id.to_string(),
        attempt,
        recovered: false,
        spec,
        term: writer.term().revision(),
    };
    let mut written = next.clone();
    written.cleanup.assigned = Some(CleanupAssigned {
        worker: wid.clone(),
        worker_rev: wrev,
        worker_ttl_ms: rec.lease_ttl_ms.saturating_add(rec.margin_ms),
        assign_timeout_ms: rec.assign_timeout_ms,
        step: step.clone(),
    });
    let k = ctx.keys.job(id);
    let worker_key = ctx.keys.worker(&wid);
    let record_key = ctx.keys.cleanup_record(id, &step);
    let mut write = Write::new()
        .when_modified(k.dirty.clone(), snap.dirty_rev)
        .when_created(worker_key.clone(), wrev)
        .when_modified(worker_key, wmod)
        .put(k.dirty, codec::encode(&written))
        // A record left by an earlier run of this step (a folder removal, say) is not this one's.
        .delete(record_key)
        .put(
            ctx.keys.cleanup_assignment(&wid, wrev, id),
            codec::encode(&assignment),
        );
    if snap.cleanup_now {
        write = write.delete(k.cleanup_now);
    }
    let committed = writer.commit(write).await;
    if !matches!(&committed, Ok(c) if c.applied()) && kind == AssignmentKind::Cleanup {
        ctx.starts().give_back();
    }
    match committed {
        Ok(Commit::Applied { revision, .. }) => {
            tracing::info!(job_id = id, worker = %wid, step = %step, "cleanup step assigned");
            Step::Assigned(revision, Box::new(written))
        }
        Ok(_) => Step::Again(
            "the worker or the result changed; trying again".into(),
            None,
        ),
        Err(crate::election::FenceError::Deposed { .. }) => Step::TermOver,
        // Whether it applied is unknown: the next pass reads the entry and knows.
        Err(e) => Step::Again(format!("cannot record the assignment: {e}"), None),
    }
}

/// What one job's cleanup task works with besides the term's settings.
struct On<'a> {
    writer: &'a Writer,
    wakers: &'a Wakers,
    /// The term's view of the workers, once the actor has read them.
    fleet: &'a Mutex<Fleet>,
}

impl On<'_> {
    /// Live workers: id, incarnation, mod revision, record; from the term's view when it has
    /// one (no read), else from etcd.
    async fn workers(
        &self,
        ctx: &Ctx,
    ) -> Result<Vec<(String, i64, i64, WorkerRecord)>, crate::store::Error> {
        {
            let f = self.fleet.lock().expect("fleet lock");
            if f.loaded() {
                return Ok(f
                    .workers
                    .values()
                    .map(|w| {
                        (
                            w.record.worker_id.clone(),
                            w.rev,
                            w.mod_rev,
                            w.record.clone(),
                        )
                    })
                    .collect());
            }
        }
        live_workers(ctx).await
    }
}

/// Live workers: id, incarnation, mod revision, record.
async fn live_workers(
    ctx: &Ctx,
) -> Result<Vec<(String, i64, i64, WorkerRecord)>, crate::store::Error> {
    let mut c = ctx.store.client();
    let get = c.get(
        ctx.keys.workers(),
        Some(etcd_client::GetOptions::new().with_prefix()),
    );
    let resp = ctx.store.timed("list workers", get).await?;
    Ok(resp
        .kvs()
        .iter()
        .filter_map(|kv| {
            let r: WorkerRecord = codec::decode(kv.key(), kv.value(), WORKER_VERSION).ok()?;
            Some((
                r.worker_id.clone(),
                kv.create_revision(),
                kv.mod_revision(),
                r,
            ))
        })
        .collect())
}

/// Records progress in the dirty entry (fenced, and only if nobody changed it meanwhile).
/// Also deletes `ended` (the step's assignment) and requires what `extra` compares.
async fn record(
    ctx: &Ctx,
    writer: &Writer,
    snap: &Snapshot,
    next: &JobResult,
    extra: Write,
    ended: Option<String>,
) -> Result<i64, ()> {
    let k = ctx.keys.job(&snap.id);
    let mut write = extra
        .when_modified(k.dirty.clone(), snap.dirty_rev)
        .put(k.dirty, codec::encode(next));
    if let Some(key) = ended {
        write = write.delete(key);
    }
    if snap.cleanup_now {
        write = write.delete(k.cleanup_now);
    }
    match writer.commit(write).await {
        Ok(Commit::Applied { revision, .. }) => Ok(revision),
        _ => Err(()),
    }
}

/// Stage 3: dirty becomes clean, and the job's other keys go, in one fenced transaction.
async fn finish(ctx: &Ctx, writer: &Writer, snap: &Snapshot, mut result: JobResult) -> Next {
    let k = ctx.keys.job(&snap.id);
    result.cleanup.stage = 3;
    result.cleanup.done_ms = records::now_ms();
    result.cleanup.next_retry_ms = 0;
    result.cleanup.last_error = None;
    result.cleanup.assigned = None;
    result.version = records::RESULT_VERSION;
    let mut write = Write::new().when_modified(k.dirty.clone(), snap.dirty_rev);
    if let Some((_, incarnation)) = &snap.spec {
        write = write.when_created(k.spec.clone(), *incarnation);
    }
    write = write
        .delete(k.spec)
        .delete(k.cancel)
        .delete(k.cleanup_now)
        .delete(k.dirty)
        .delete_prefix(format!("{}{}/", ctx.keys.cleanups(), snap.id))
        .put(k.clean, codec::encode(&result));
    // A step's assignment left over (a worker that never answered) goes too.
    let leftover = snap
        .dirty
        .as_ref()
        .and_then(|d| d.cleanup.assigned.as_ref());
    if let Some(a) = leftover {
        write = write.delete(
            ctx.keys
                .cleanup_assignment(&a.worker, a.worker_rev, &snap.id),
        );
    }
    match writer.commit(write).await {
        Ok(c) if c.applied() => {
            tracing::info!(job_id = %snap.id, attempts = result.cleanup.attempts, "cleanup done; result is clean");
            Next::Done
        }
        Ok(_) => Next::At(records::now_ms()),
        Err(crate::election::FenceError::Deposed { .. }) => Next::Stop,
        Err(_) => Next::At(records::now_ms() + 500),
    }
}

/// Deletes clean results older than the retention, in small fenced batches.
async fn expire_clean(ctx: &Ctx, writer: &Writer) {
    let retention = ctx.config.cleanup.retention.as_millis() as u64;
    let cutoff = records::now_ms().saturating_sub(retention);
    let prefix = ctx.keys.clean();
    let mut after = String::new();
    let mut expired: Vec<(Vec<u8>, i64)> = Vec::new();
    loop {
        let Ok((kvs, _)) = jobs::page_ids(&ctx.store, &prefix, &after, 500, 0).await else {
            return;
        };
        for kv in &kvs {
            if let Some(id) = Keys::id_in(&prefix, kv.key()) {
                after = id.to_string();
            }
            let Ok(r) =
                codec::decode_any::<JobResult>(kv.key(), kv.value(), records::RESULT_VERSIONS_READ)
            else {
                continue;
            };
            if r.cleanup.done_ms <= cutoff {
                expired.push((kv.key().to_vec(), kv.mod_revision()));
            }
        }
        if kvs.len() < 500 {
            break;
        }
    }
    for batch in expired.chunks(50) {
        let write = batch
            .iter()
            .fold(Write::new(), |w, (k, rev)| w.when_modified(k.clone(), *rev));
        let write = batch.iter().fold(write, |w, (k, _)| w.delete(k.clone()));
        match writer.commit(write).await {
            Ok(c) if c.applied() => tracing::info!(
                results = batch.len(),
                "expired clean results past retention"
            ),
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

fn status_name(s: TerminalStatus) -> &'static str {
    match s {
        TerminalStatus::Finished => "FINISHED",
        TerminalStatus::Failed => "FAILED",
        TerminalStatus::Canceled => "CANCELED",
    }
}
