//! The leader runs jobs.
//!
//! One actor per term ([`lead`]) owns every decision; etcd reads and fenced writes run as
//! per-job *transitions* (at most one in flight per job) whose outcome comes back to the actor.
//! Guarantees:
//! - A job is started only by a fenced write PENDING→RUNNING that also compares the job's
//!   incarnation, its registry entry's revision and the absence of a cancel request.
//! - A terminal result is written with the registry delete in one fenced transaction.
//! - Every side effect (spawn, signal) asks [`Term::check`] synchronously right before.
//! - When the term ends, every guard is abandoned at once (its job's process group is killed)
//!   and nothing more is written; the term's tracker waits for the guards before resign.
//! - Recovery reads the registry, cancel requests and dirty results in pages pinned to one
//!   revision R, then watches from R+1; each event is handled by re-reading that job.

pub mod guard;
pub mod spawn;
pub mod storage;
mod writer;

pub use writer::Writer;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, TxnOp, WatchOptions};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::election::{Commit, FenceError, Role, Term};
use crate::jobs::records::{self, JobResult, RegistryEntry, RegistryStatus, TerminalStatus};
use crate::jobs::{self, Snapshot};
use crate::store::codec;
use crate::store::{Keys, Store};
use guard::{ExitRecord, KilledBy};
use spawn::{GuardFeed, Launch};

/// How much of the final attempt's output a result keeps.
pub const LOG_TAIL_BYTES: u64 = 4096;

#[derive(Clone, Debug)]
pub struct RunnerConfig {
    pub replica_id: String,
    pub storage_dir: PathBuf,
    pub guard_bin: PathBuf,
    pub max_running: usize,
    pub max_recoveries: u32,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    pub kill_grace: Duration,
    pub margin: Duration,
    pub cleanup: crate::cleanup::CleanupConfig,
    /// Drills: every guard appends its executions here.
    pub execution_ledger: Option<PathBuf>,
    /// Negative control for drills: guards ignore lease deadlines.
    pub unsafe_ignore_deadlines: bool,
}

/// What every leader task of the runner shares.
pub struct Ctx {
    pub(crate) store: Store,
    pub(crate) keys: Keys,
    pub(crate) config: RunnerConfig,
}

/// Follows the role channel and leads every term this replica wins.
pub async fn run(store: Store, keys: Keys, config: RunnerConfig, mut role: watch::Receiver<Role>) {
    let ctx = Arc::new(Ctx {
        store,
        keys,
        config,
    });
    loop {
        let term = role.borrow_and_update().term().cloned();
        if let Some(term) = term.filter(|t| !t.has_ended()) {
            let span = tracing::info_span!("term", term = term.revision(), replica = %ctx.config.replica_id);
            let ctx = ctx.clone();
            let t = term.clone();
            // Tracked by the term, so the handover waits for the guards to be gone.
            term.tracker()
                .spawn(async move { lead(ctx, t).await }.instrument(span));
        }
        if role.changed().await.is_err() {
            return;
        }
    }
}

/// A job this term is running.
struct Local {
    attempt: u32,
    incarnation: i64,
    registry_rev: i64,
    feed: GuardFeed,
    cancel_sent: bool,
}

/// What a transition found or did.
enum Outcome {
    Idle,
    /// PENDING and due, but no slot was reserved for it.
    NeedSlot(i64),
    /// PENDING until this Unix ms.
    Later(u64),
    Started(Box<Local>, spawn::Guard),
    /// A running local job was asked to stop.
    CancelSent,
    /// etcd failed; try again soon.
    Retry,
}

enum Event {
    Exited { id: String, attempt: u32 },
}

async fn lead(ctx: Arc<Ctx>, term: Term) {
    let writer = Writer::start(&term);
    term.tracker()
        .spawn(crate::cleanup::run(ctx.clone(), writer.clone()).in_current_span());
    let mut actor = Actor {
        ctx: ctx.clone(),
        writer,
        running: HashMap::new(),
        inflight: HashSet::new(),
        recheck: HashSet::new(),
        waiting: BTreeSet::new(),
        timers: BTreeMap::new(),
        reserved: 0,
        tasks: JoinSet::new(),
        task_jobs: HashMap::new(),
        exits: HashMap::new(),
    };
    let (events_tx, mut events) = mpsc::unbounded_channel();
    'resync: loop {
        let (rev, ids, dirty) = tokio::select! {
            r = recover(&ctx, &term) => r,
            _ = term.ended() => break 'resync,
        };
        tracing::info!(
            revision = rev,
            jobs = ids.len(),
            dirty = dirty,
            "recovered registry"
        );
        for id in ids {
            actor.reconcile(id);
        }
        let mut client = ctx.store.client();
        let opts = || {
            WatchOptions::new()
                .with_prefix()
                .with_start_revision(rev + 1)
        };
        let watch = tokio::time::timeout(
            Duration::from_secs(5),
            client.watch(ctx.keys.registry(), Some(opts())),
        );
        let mut stream = match watch.await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot watch the registry; resyncing");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(_) => {
                tracing::warn!("watching the registry timed out; resyncing");
                continue;
            }
        };
        if let Err(e) = stream.watch(ctx.keys.cancel(), Some(opts())).await {
            tracing::warn!(error = %e, "cannot watch cancel requests; resyncing");
            continue;
        }
        loop {
            let next_timer = actor.timers.keys().next().copied();
            let sleep = records::sleep_until_ms(next_timer);
            tokio::select! {
                biased;
                _ = term.ended() => break 'resync,
                msg = stream.message() => match msg {
                    Ok(Some(resp)) => {
                        if resp.canceled() || resp.compact_revision() > 0 {
                            tracing::warn!(compacted = resp.compact_revision(), "watch cancelled; resyncing");
                            continue 'resync;
                        }
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            let id = Keys::id_in(&ctx.keys.registry(), kv.key())
                                .or_else(|| Keys::id_in(&ctx.keys.cancel(), kv.key()));
                            if let Some(id) = id {
                                actor.reconcile(id.to_string());
                            }
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::warn!("watch stream ended; resyncing");
                        continue 'resync;
                    }
                },
                Some(ev) = events.recv() => match ev {
                    Event::Exited { id, attempt } => actor.exited(id, attempt),
                },
                Some(done) = actor.tasks.join_next_with_id() => {
                    let (task, (id, slot, outcome)) = match done {
                        Ok((task, out)) => (task, out),
                        Err(e) => {
                            // A transition that panicked: free its job and slot, look again later.
                            let Some((id, slot)) = actor.task_jobs.get(&e.id()).cloned() else { continue };
                            tracing::error!(job_id = %id, error = %e, "job transition failed");
                            (e.id(), (id, slot, Outcome::Retry))
                        }
                    };
                    actor.task_jobs.remove(&task);
                    actor.settle(id, slot, outcome, &events_tx);
                }
                _ = sleep => actor.fire_timers(),
            }
        }
    }
    actor.abandon_all().await;
}

struct Actor {
    ctx: Arc<Ctx>,
    writer: Writer,
    running: HashMap<String, Local>,
    inflight: HashSet<String>,
    recheck: HashSet<String>,
    /// PENDING jobs waiting for a slot, in submission (incarnation) order.
    waiting: BTreeSet<(i64, String)>,
    timers: BTreeMap<u64, HashSet<String>>,
    reserved: usize,
    tasks: JoinSet<(String, bool, Outcome)>,
    /// Which job (and whether it holds a slot) each transition task is for.
    task_jobs: HashMap<tokio::task::Id, (String, bool)>,
    /// Exits that arrived while a transition for the job was in flight.
    exits: HashMap<String, LocalView>,
}

/// What a transition needs to know about a local run.
#[derive(Clone)]
struct LocalView {
    attempt: u32,
    incarnation: i64,
    registry_rev: i64,
    feed: GuardFeed,
    cancel_sent: bool,
}

impl Actor {
    fn free_slots(&self) -> usize {
        self.ctx
            .config
            .max_running
            .saturating_sub(self.running.len() + self.reserved)
    }

    /// Re-examines job `id` from its current state in etcd.
    fn reconcile(&mut self, id: String) {
        self.reconcile_with(id, None);
    }

    fn reconcile_with(&mut self, id: String, exited: Option<LocalView>) {
        if self.inflight.contains(&id) {
            match exited {
                Some(view) => {
                    self.exits.insert(id, view);
                }
                None => {
                    self.recheck.insert(id);
                }
            }
            return;
        }
        let local = self.running.get(&id).map(|l| LocalView {
            attempt: l.attempt,
            incarnation: l.incarnation,
            registry_rev: l.registry_rev,
            feed: l.feed.clone(),
            cancel_sent: l.cancel_sent,
        });
        let slot = local.is_none() && exited.is_none() && self.free_slots() > 0;
        if slot {
            self.reserved += 1;
        }
        self.inflight.insert(id.clone());
        let ctx = self.ctx.clone();
        let writer = self.writer.clone();
        let job = id.clone();
        let handle = self.tasks.spawn(async move {
            let outcome = transition(&ctx, &writer, &job, local, exited, slot).await;
            (job, slot, outcome)
        });
        self.task_jobs.insert(handle.id(), (id, slot));
    }

    fn settle(
        &mut self,
        id: String,
        slot: bool,
        outcome: Outcome,
        events: &mpsc::UnboundedSender<Event>,
    ) {
        self.inflight.remove(&id);
        if slot {
            self.reserved -= 1;
        }
        match outcome {
            Outcome::Idle => {}
            Outcome::CancelSent => {
                if let Some(l) = self.running.get_mut(&id) {
                    l.cancel_sent = true;
                }
            }
            Outcome::NeedSlot(incarnation) => {
                self.waiting.insert((incarnation, id.clone()));
            }
            Outcome::Later(at) => {
                self.timers.entry(at).or_default().insert(id.clone());
            }
            Outcome::Retry => {
                self.timers
                    .entry(records::now_ms() + 500)
                    .or_default()
                    .insert(id.clone());
            }
            Outcome::Started(local, guard) => {
                let attempt = local.attempt;
                self.running.insert(id.clone(), *local);
                let events = events.clone();
                let job = id.clone();
                // Each guard has its own feeder: renewals reach it even while the actor is busy
                // resyncing, and the first one cannot fall between spawn and registration.
                let mut deadlines = self.writer.term().deadlines();
                tokio::spawn(async move {
                    let spawn::Guard {
                        feed, mut exited, ..
                    } = guard;
                    feed.deadline(*deadlines.borrow_and_update());
                    loop {
                        tokio::select! {
                            _ = &mut exited => break,
                            changed = deadlines.changed() => match changed {
                                Ok(()) => feed.deadline(*deadlines.borrow_and_update()),
                                Err(_) => {
                                    let _ = (&mut exited).await;
                                    break;
                                }
                            },
                        }
                    }
                    let _ = events.send(Event::Exited { id: job, attempt });
                });
            }
        }
        if let Some(view) = self.exits.remove(&id) {
            self.recheck.remove(&id);
            self.reconcile_with(id, Some(view));
        } else if self.recheck.remove(&id) {
            self.reconcile(id);
        }
        self.fill_slots();
    }

    fn fill_slots(&mut self) {
        while self.free_slots() > 0 {
            let Some(first) = self.waiting.pop_first() else {
                break;
            };
            if !self.running.contains_key(&first.1) {
                self.reconcile(first.1);
            }
        }
    }

    fn exited(&mut self, id: String, attempt: u32) {
        let Some(l) = self.running.remove(&id) else {
            return;
        };
        if l.attempt != attempt {
            self.running.insert(id, l);
            return;
        }
        let view = LocalView {
            attempt: l.attempt,
            incarnation: l.incarnation,
            registry_rev: l.registry_rev,
            feed: l.feed,
            cancel_sent: l.cancel_sent,
        };
        self.reconcile_with(id, Some(view));
        self.fill_slots();
    }

    fn fire_timers(&mut self) {
        let now = records::now_ms();
        let due: Vec<u64> = self.timers.range(..=now).map(|(k, _)| *k).collect();
        for at in due {
            for id in self.timers.remove(&at).unwrap_or_default() {
                self.reconcile(id);
            }
        }
    }

    /// The term is over: kill every job at once, wait (bounded) until the guards are gone.
    async fn abandon_all(&mut self) {
        for l in self.running.values() {
            l.feed.abandon();
        }
        self.tasks.abort_all();
        // A transition may have spawned a guard just before the abort took effect.
        let mut late = Vec::new();
        while let Some(done) = self.tasks.join_next().await {
            if let Ok((_, _, Outcome::Started(_, g))) = done {
                g.feed.abandon();
                late.push(g.pid);
            }
        }
        let n = self.running.len();
        if n > 0 {
            tracing::info!(jobs = n, "term over: killed all running jobs");
        }
        // The guards exit within milliseconds of SIGHUP; their pipes are already closed.
        let mut pids: Vec<i32> = self.running.values().map(|l| l.feed.pid()).collect();
        pids.extend(late);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        for pid in pids {
            while nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Reads the registry, cancel requests and dirty results in pages pinned to one revision.
/// Returns that revision, the ids to reconcile, and how many dirty results there are.
async fn recover(ctx: &Ctx, term: &Term) -> (i64, Vec<String>, usize) {
    let mut pause = Duration::from_millis(100);
    loop {
        match read_pages(ctx).await {
            Ok(r) => return r,
            Err(e) => {
                if term.has_ended() {
                    return (0, Vec::new(), 0);
                }
                tracing::warn!(error = %e, "recovery read failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

const PAGE: i64 = 500;

async fn read_pages(ctx: &Ctx) -> Result<(i64, Vec<String>, usize), jobs::Error> {
    let mut rev = 0;
    // Registry entries are created with their job in the submit transaction: ordering by their
    // create revision restarts jobs in submission order.
    let mut ids: Vec<(i64, String)> = Vec::new();
    let mut dirty = 0;
    for (prefix, is_dirty) in [
        (ctx.keys.registry(), false),
        (ctx.keys.cancel(), false),
        (ctx.keys.dirty(), true),
    ] {
        let mut after = String::new();
        loop {
            let (kvs, r) = jobs::page_ids(&ctx.store, &prefix, &after, PAGE, rev).await?;
            rev = r;
            for kv in &kvs {
                if let Some(id) = Keys::id_in(&prefix, kv.key()) {
                    if is_dirty {
                        dirty += 1;
                    } else {
                        ids.push((kv.create_revision(), id.to_string()));
                    }
                    after = id.to_string();
                }
            }
            if (kvs.len() as i64) < PAGE {
                break;
            }
        }
    }
    ids.sort();
    let mut seen = HashSet::new();
    let ids = ids
        .into_iter()
        .filter(|(_, id)| seen.insert(id.clone()))
        .map(|(_, id)| id)
        .collect();
    Ok((rev, ids, dirty))
}

fn retry_delay(cfg: &RunnerConfig, failed: u32) -> Duration {
    let factor = 2u32.saturating_pow(failed.saturating_sub(1).min(20));
    (cfg.retry_initial * factor).min(cfg.retry_max)
}

/// Decides and does one step for job `id`. See the module doc.
async fn transition(
    ctx: &Ctx,
    writer: &Writer,
    id: &str,
    local: Option<LocalView>,
    exited: Option<LocalView>,
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
        let rec = guard::read_exit(&dir, &format!("attempt-{}", done.attempt));
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
            let rec = guard::read_exit(&dir, &format!("attempt-{}", entry.attempt));
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
            guard_bin: cfg.guard_bin.clone(),
            job_id: self.id().into(),
            attempt: entry.attempt,
            term: term.revision(),
            dir,
            name: format!("attempt-{}", entry.attempt),
            command: spec.command.clone(),
            env,
            margin: cfg.margin,
            timeout: spec.timeout,
            kill_grace: cfg.kill_grace,
            ledger: cfg.execution_ledger.clone(),
            unsafe_ignore_deadlines: cfg.unsafe_ignore_deadlines,
        };
        // The last synchronous check before the side effect.
        if term.check().is_err() {
            return Outcome::Idle;
        }
        match spawn::spawn(launch, term.valid_until()) {
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
            log_tail: log_tail(&guard::log_path(&dir, &format!("attempt-{}", e.attempt))),
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

/// The last [`LOG_TAIL_BYTES`] of a log file, lossily as UTF-8.
pub fn log_tail(path: &std::path::Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut buf = Vec::new();
    let _ = f.take(LOG_TAIL_BYTES).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}
