//! The job actor of one term: it owns every decision about which job goes to which worker,
//! while etcd reads and fenced writes run as per-job transitions (at most one in flight per
//! job, at most [`TRANSITIONS_AT_ONCE`] at all) whose outcome comes back to it. It assigns
//! within the workers' free slots (the most free first, as counted in its own table until an
//! attempt's end is consumed) and the start budget, in submission order.
//!
//! Watch events cost a read only when they can need a write: the echo of the actor's own
//! assignment, a `started` record of an assignment it knows, and deletions (a job's end, which
//! this term wrote) are taken as they are. Recovery hands over what its pages show, so
//! adopting a running job costs no read of its own.
//!
//! The actor runs no process: a term that ends stops nothing. The workers keep running what
//! they were given; the next term adopts it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{EventType, WatchOptions};
use tokio::task::JoinSet;
use tracing::Instrument;

use super::fleet::{Fleet, Liveness, Pick, Selector, WorkerView};
use super::recovery::{self, Found, FoundJob};
use super::transition::{self, transition, Outcome};
use super::{cleanup, Ctx, Writer};
use crate::election::Term;
use crate::jobs::records::{self, RegistryEntry, RegistryStatus};
use crate::jobs::work::{
    AttemptRecord, AttemptState, WorkerRecord, ATTEMPT_VERSION, WORKER_VERSION,
};
use crate::metrics;
use crate::rolelog;
use crate::store::{codec, Keys};

/// Leads one term: recovery, then the watches, until the term ends.
pub(super) async fn lead(ctx: Arc<Ctx>, term: Term) {
    let writer = Writer::start(&term);
    let fleet = Arc::new(Mutex::new(Fleet::new()));
    term.tracker()
        .spawn(cleanup::run(ctx.clone(), writer.clone(), fleet.clone()).in_current_span());
    term.tracker()
        .spawn(super::schedules::run(ctx.clone(), writer.clone()).in_current_span());
    let mut actor = Actor {
        ctx: ctx.clone(),
        writer,
        fleet,
        assigned: HashMap::new(),
        used: HashMap::new(),
        inflight: HashSet::new(),
        recheck: HashSet::new(),
        ready: VecDeque::new(),
        waiting: BTreeSet::new(),
        selectors: HashMap::new(),
        budget_blocked: false,
        timers: BTreeMap::new(),
        rechecks: BTreeMap::new(),
        tasks: JoinSet::new(),
        task_jobs: HashMap::new(),
        recovery: Some(Recovering::default()),
        early_starts: HashMap::new(),
    };
    let mut resync = crate::retry::policies::RESYNC.backoff();
    'resync: loop {
        let mut take = |found| actor.take(found);
        let recovered = tokio::select! {
            r = recovery::recover(&ctx, &term, &mut take) => r,
            _ = term.ended() => break 'resync,
        };
        let Some(rev) = recovered else {
            break 'resync;
        };
        tracing::info!(
            revision = rev,
            running = actor.assigned.len(),
            waiting = actor.waiting.len(),
            looking = actor.inflight.len(),
            "recovered registry"
        );
        actor.pages_done();
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
                resync.pause().await;
                continue;
            }
            Err(_) => {
                tracing::warn!("watching the registry timed out; resyncing");
                continue;
            }
        };
        let mut more = true;
        for prefix in [ctx.keys.cancel(), ctx.keys.attempts(), ctx.keys.workers()] {
            if let Err(e) = stream.watch(prefix, Some(opts())).await {
                tracing::warn!(error = %e, "cannot watch; resyncing");
                more = false;
                break;
            }
        }
        if !more {
            resync.pause().await;
            continue;
        }
        resync.reset();
        // Slots also free up without an event (a distrusted worker's time runs out).
        let mut sweep = tokio::time::interval(Duration::from_secs(1));
        let mut sweeps: u64 = 0;
        loop {
            let next_timer = [
                actor.timers.keys().next().copied(),
                actor.rechecks.keys().next().copied(),
            ]
            .into_iter()
            .flatten()
            .min();
            let sleep = records::sleep_until_ms(next_timer);
            let budget = actor.budget_wakeup();
            // Outcomes before events: the echo of a write is then known as its own.
            tokio::select! {
                biased;
                _ = term.ended() => break 'resync,
                Some(done) = actor.tasks.join_next_with_id() => {
                    let (task, (id, pick, outcome)) = match done {
                        Ok((task, out)) => (task, out),
                        Err(e) => {
                            // A transition that panicked: free its job and slot, look again later.
                            let Some((id, pick)) = actor.task_jobs.get(&e.id()).cloned() else { continue };
                            tracing::error!(job_id = %id, error = %e, "job transition failed");
                            (e.id(), (id, pick, Outcome::Retry))
                        }
                    };
                    actor.task_jobs.remove(&task);
                    actor.settle(id, pick, outcome);
                }
                msg = stream.message() => match msg {
                    Ok(Some(resp)) => {
                        if resp.canceled() || resp.compact_revision() > 0 {
                            tracing::warn!(compacted = resp.compact_revision(), "watch cancelled; resyncing");
                            continue 'resync;
                        }
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            actor.event(ev.event_type(), kv);
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::warn!("watch stream ended; resyncing");
                        continue 'resync;
                    }
                },
                _ = sleep => actor.fire_timers(),
                _ = sweep.tick() => {
                    actor.fill_slots();
                    // O(jobs): every 5th second, so 100,000 jobs cost the actor ~1 ms/s.
                    if sweeps % 5 == 0 {
                        actor.report();
                    }
                    sweeps += 1;
                }
                _ = sleep_until_opt(budget), if budget.is_some() => actor.fill_slots(),
            }
        }
    }
    actor.tasks.abort_all();
    while actor.tasks.join_next().await.is_some() {}
    metrics::get().clear_registry_gauges();
}

type Incarnation = (String, i64);

/// A RUNNING job as the actor counts it: its worker incarnation and assignment token.
struct Assigned {
    inc: Incarnation,
    token: i64,
}

/// The first recovery of a term, until every entry it found has been decided.
#[derive(Default)]
struct Recovering {
    entries: usize,
    /// Entries whose first transition has not settled yet.
    open: HashSet<String>,
    pages_done: bool,
}

struct Actor {
    ctx: Arc<Ctx>,
    writer: Writer,
    fleet: Arc<Mutex<Fleet>>,
    /// RUNNING jobs, until their end is consumed.
    assigned: HashMap<String, Assigned>,
    /// Slots taken per worker incarnation: assigned jobs plus reservations in flight.
    used: HashMap<Incarnation, usize>,
    /// Jobs with a transition queued or running.
    inflight: HashSet<String>,
    recheck: HashSet<String>,
    /// Transitions waiting for one of the [`TRANSITIONS_AT_ONCE`] places, in order.
    ready: VecDeque<(String, Option<Pick>)>,
    /// PENDING jobs waiting for a slot or the start budget, in submission (incarnation) order.
    waiting: BTreeSet<(i64, String)>,
    /// The selectors of waiting jobs that have one: those wait only for matching workers, and
    /// never hold up the jobs behind them.
    selectors: HashMap<String, Selector>,
    /// The last fill stopped at the start budget with a job that could take a slot.
    budget_blocked: bool,
    /// Looks at PENDING jobs (backoff) and retries, by Unix ms.
    timers: BTreeMap<u64, HashSet<String>>,
    /// Looks at RUNNING jobs (assign timeout, a gone worker's TTL), by Unix ms, for one
    /// assignment token each: moot once that assignment has ended.
    rechecks: BTreeMap<u64, Vec<(String, i64)>>,
    tasks: JoinSet<(String, Option<Pick>, Outcome)>,
    /// Which job (and which reserved slot) each transition task is for.
    task_jobs: HashMap<tokio::task::Id, (String, Option<Pick>)>,
    recovery: Option<Recovering>,
    /// `started` records that came while their job's transition was in flight, by token.
    early_starts: HashMap<String, i64>,
}

/// Transitions at once. Their reads and writes are batched (a few transactions in flight
/// whatever their number), so a lost worker with hundreds of jobs, or a recovery, cannot
/// storm etcd; the rest queue, holding no task, so 100,000 of them cost little memory.
const TRANSITIONS_AT_ONCE: usize = 512;

impl Actor {
    /// Takes in what recovery's pages show.
    fn take(&mut self, found: Found) {
        match found {
            Found::Workers(workers) => self.fleet.lock().expect("fleet lock").reset(workers),
            Found::Jobs(page) => {
                for job in page {
                    self.take_job(job);
                }
                self.fill_slots();
            }
        }
    }

    /// Decides a recovered entry from the pages alone when no write is needed.
    fn take_job(&mut self, j: FoundJob) {
        if let Some(r) = &mut self.recovery {
            r.entries += 1;
        }
        if self.inflight.contains(&j.id) {
            self.recheck.insert(j.id);
            return;
        }
        let decided = match (j.entry.status, &j.entry.worker) {
            _ if j.cancelled || j.has_result => None,
            (RegistryStatus::Pending, _) if j.entry.not_before_ms > records::now_ms() => {
                Some(Outcome::Later(j.entry.not_before_ms))
            }
            // Its selector, if any, is met when a slot is offered (the spec is read then).
            (RegistryStatus::Pending, _) => Some(Outcome::NeedSlot(j.incarnation, Selector::new())),
            (RegistryStatus::Running, Some(worker))
                if matches!(j.attempt, None | Some(AttemptState::Started)) =>
            {
                let mut f = self.fleet.lock().expect("fleet lock");
                let started = j.attempt.is_some();
                transition::adopt(&mut f, worker, &j.entry, j.registry_rev, started).ok()
            }
            _ => None,
        };
        match decided {
            Some(outcome) => self.apply(j.id, outcome),
            None => {
                if let Some(r) = &mut self.recovery {
                    r.open.insert(j.id.clone());
                }
                self.reconcile(j.id);
            }
        }
    }

    /// Every recovery page has been taken.
    fn pages_done(&mut self) {
        if let Some(r) = &mut self.recovery {
            r.pages_done = true;
        }
        self.report_recovered();
    }

    /// Logs the role event once every entry of the term's first recovery is decided.
    fn report_recovered(&mut self) {
        let Some(r) = &self.recovery else { return };
        if !r.pages_done || !r.open.is_empty() {
            return;
        }
        let term = self.writer.term();
        rolelog::recovered(
            &self.ctx.config.replica_id,
            term.revision(),
            term.lease_id(),
            "registry",
            r.entries,
        );
        self.recovery = None;
    }

    fn event(&mut self, kind: EventType, kv: &etcd_client::KeyValue) {
        let keys = &self.ctx.keys;
        if let Some(wid) = Keys::id_in(&keys.workers(), kv.key()) {
            let wid = wid.to_string();
            self.worker_event(kind, wid, kv);
            return;
        }
        if kind == EventType::Delete {
            // Only this term deletes registry entries and attempt records (with a job's result)
            // and cancel requests (with its cleanup): nothing to look at.
            return;
        }
        if let Some(id) = Keys::id_in(&keys.registry(), kv.key()) {
            let own_echo = self
                .assigned
                .get(id)
                .is_some_and(|a| a.token == kv.mod_revision());
            if !own_echo && !self.queue_pending(id, kv) {
                self.reconcile(id.to_string());
            }
        } else if let Some(id) = Keys::id_in(&keys.cancel(), kv.key()) {
            self.reconcile(id.to_string());
        } else if let Some((id, token)) = Keys::id_in(&keys.attempts(), kv.key())
            .and_then(|rest| rest.split_once('/'))
            .and_then(|(id, t)| Some((id.to_string(), t.parse::<i64>().ok()?)))
        {
            if self.started_as_known(&id, token, kv) {
                return;
            }
            if self.inflight.contains(&id) && is_started(kv) {
                // Most likely the start of the assignment in flight: settled with it.
                self.early_starts.insert(id, token);
            } else {
                self.reconcile(id);
            }
        }
    }

    /// A PENDING entry that could not start now anyway (others wait before it, or no slot is
    /// free) waits without a read: its spec is read when a slot is offered. Whether it did.
    fn queue_pending(&mut self, id: &str, kv: &etcd_client::KeyValue) -> bool {
        if self.inflight.contains(id) || self.assigned.contains_key(id) {
            return false;
        }
        let Ok(entry) = codec::decode_any::<RegistryEntry>(
            kv.key(),
            kv.value(),
            records::REGISTRY_VERSIONS_READ,
        ) else {
            return false;
        };
        if entry.status != RegistryStatus::Pending {
            return false;
        }
        let outcome = if entry.not_before_ms > records::now_ms() {
            Outcome::Later(entry.not_before_ms)
        } else if self.waiting.is_empty() && self.has_free_slot() {
            return false;
        } else {
            Outcome::NeedSlot(kv.create_revision(), Selector::new())
        };
        self.apply(id.to_string(), outcome);
        true
    }

    /// A `started` record of an assignment this term counts as running changes nothing but
    /// the worker's standing.
    fn started_as_known(&mut self, id: &str, token: i64, kv: &etcd_client::KeyValue) -> bool {
        let Some(a) = self.assigned.get(id).filter(|a| a.token == token) else {
            return false;
        };
        if !is_started(kv) {
            return false;
        }
        let mut f = self.fleet.lock().expect("fleet lock");
        f.trust(&a.inc.0, a.inc.1);
        f.started(token);
        true
    }

    fn worker_event(&mut self, kind: EventType, wid: String, kv: &etcd_client::KeyValue) {
        let went = match kind {
            EventType::Put => {
                let Ok(record) =
                    codec::decode::<WorkerRecord>(kv.key(), kv.value(), WORKER_VERSION)
                else {
                    return;
                };
                let view = WorkerView {
                    rev: kv.create_revision(),
                    mod_rev: kv.mod_revision(),
                    lease: kv.lease(),
                    record,
                };
                self.fleet.lock().expect("fleet lock").put(view)
            }
            EventType::Delete => self.fleet.lock().expect("fleet lock").delete(&wid),
        };
        if let Some(went) = went {
            // Look at its jobs now: a started one's wait starts once the worker's lease is
            // revoked (its transition does that), and runs for its TTL and margin.
            tracing::info!(worker = %wid, incarnation = went.rev, "worker gone");
            let at = records::now_ms();
            let jobs: Vec<(String, i64)> = self
                .assigned
                .iter()
                .filter(|(_, a)| a.inc.0 == wid && a.inc.1 == went.rev)
                .map(|(j, a)| (j.clone(), a.token))
                .collect();
            self.rechecks.entry(at).or_default().extend(jobs);
        }
        self.fill_slots();
        // Workers come and go rarely: the gauges follow at once.
        self.report();
    }

    /// Re-examines job `id` from its current state in etcd.
    fn reconcile(&mut self, id: String) {
        self.reconcile_with(id, false);
    }

    /// `queued`: the job comes off the waiting set, whose order decides who starts next; any
    /// other job may take a slot only while nobody waits, or it would overtake them.
    fn reconcile_with(&mut self, id: String, queued: bool) {
        if self.inflight.contains(&id) {
            self.recheck.insert(id);
            return;
        }
        let mut pick = None;
        if !self.assigned.contains_key(&id) && (queued || self.waiting.is_empty()) {
            let selector = self.selectors.get(&id).cloned().unwrap_or_default();
            let candidate = self
                .fleet
                .lock()
                .expect("fleet lock")
                .pick(&self.used, &selector);
            if let Some(p) = candidate {
                if self.ctx.starts().try_take(Instant::now()) {
                    *self.used.entry((p.id.clone(), p.rev)).or_default() += 1;
                    pick = Some(p);
                }
            }
        }
        self.inflight.insert(id.clone());
        // One holding a slot and a start goes first: a backlog of looks must not hold starts
        // back and release them in a burst.
        if pick.is_some() {
            self.ready.push_front((id, pick));
        } else {
            self.ready.push_back((id, pick));
        }
        self.pump();
    }

    /// Starts queued transitions while there is room.
    fn pump(&mut self) {
        while self.tasks.len() < TRANSITIONS_AT_ONCE {
            let Some((id, pick)) = self.ready.pop_front() else {
                return;
            };
            let ctx = self.ctx.clone();
            let writer = self.writer.clone();
            let fleet = self.fleet.clone();
            let (job, p) = (id.clone(), pick.clone());
            let handle = self.tasks.spawn(
                async move {
                    let outcome = transition(&ctx, &writer, &fleet, &job, p.clone()).await;
                    (job, p, outcome)
                }
                .in_current_span(),
            );
            self.task_jobs.insert(handle.id(), (id, pick));
        }
    }

    fn release(&mut self, inc: &Incarnation) {
        if let Some(n) = self.used.get_mut(inc) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.used.remove(inc);
            }
        }
    }

    /// A transition of `id` ended with `outcome`.
    fn settle(&mut self, id: String, pick: Option<Pick>, outcome: Outcome) {
        self.inflight.remove(&id);
        if let Some(token) = self.early_starts.remove(&id) {
            match &outcome {
                Outcome::Running {
                    token: t,
                    worker,
                    rev,
                    ..
                } if *t == token => self.fleet.lock().expect("fleet lock").trust(worker, *rev),
                _ => {
                    self.recheck.insert(id.clone());
                }
            }
        }
        if let Some(p) = &pick {
            self.release(&(p.id.clone(), p.rev));
            if !matches!(outcome, Outcome::Running { fresh: true, .. }) {
                self.ctx.starts().give_back();
            }
        }
        self.apply(id.clone(), outcome);
        if let Some(r) = &mut self.recovery {
            if r.open.remove(&id) {
                self.report_recovered();
            }
        }
        if self.recheck.remove(&id) {
            self.reconcile(id);
        }
        self.pump();
        self.fill_slots();
    }

    /// Books what is now known of job `id`.
    fn apply(&mut self, id: String, outcome: Outcome) {
        let previous = match &outcome {
            Outcome::Retry => None,
            Outcome::Running {
                worker, rev, token, ..
            } => {
                let inc = (worker.clone(), *rev);
                *self.used.entry(inc.clone()).or_default() += 1;
                self.assigned
                    .insert(id.clone(), Assigned { inc, token: *token })
                    .map(|a| a.inc)
            }
            _ => self.assigned.remove(&id).map(|a| a.inc),
        };
        if let Some(prev) = previous {
            self.release(&prev);
        }
        if !matches!(outcome, Outcome::NeedSlot(..)) {
            self.selectors.remove(&id);
        }
        match outcome {
            Outcome::Idle => {}
            Outcome::NeedSlot(incarnation, selector) => {
                if selector.is_empty() {
                    self.selectors.remove(&id);
                } else {
                    self.selectors.insert(id.clone(), selector);
                }
                self.waiting.insert((incarnation, id));
            }
            Outcome::Later(at) => {
                self.timers.entry(at).or_default().insert(id);
            }
            Outcome::Retry => {
                // Spread out: jobs that failed together (etcd overloaded) must not come back
                // together.
                self.timers
                    .entry(records::now_ms() + retry_ms(crate::retry::policies::TRANSITION))
                    .or_default()
                    .insert(id);
            }
            Outcome::Running {
                recheck,
                token,
                worker,
                rev,
                ..
            } => {
                // Its worker may have gone while the transition ran (its deletion collected the
                // jobs counted then, not this one): with no look planned, look again now.
                let gone = || {
                    let f = self.fleet.lock().expect("fleet lock");
                    matches!(f.liveness(&worker, rev), Liveness::Gone(_))
                };
                let at = match recheck {
                    None if gone() => Some(records::now_ms()),
                    Some(at) => {
                        let wait = at.saturating_duration_since(Instant::now());
                        Some(records::now_ms().saturating_add(wait.as_millis() as u64 + 1))
                    }
                    None => None,
                };
                if let Some(ms) = at {
                    self.rechecks.entry(ms).or_default().push((id, token));
                }
            }
        }
    }

    /// When the start budget next allows a waiting job to start, if one waits for it alone.
    fn budget_wakeup(&mut self) -> Option<Instant> {
        self.budget_blocked
            .then(|| self.ctx.starts().next_at(Instant::now()))
    }

    fn has_free_slot(&self) -> bool {
        self.free_slot_for(&Selector::new())
    }

    fn free_slot_for(&self, selector: &Selector) -> bool {
        self.fleet
            .lock()
            .expect("fleet lock")
            .pick(&self.used, selector)
            .is_some()
    }

    /// Starts waiting jobs in submission order while slots and the start budget allow,
    /// passing over those whose selector no free worker matches.
    fn fill_slots(&mut self) {
        let mut passed: Vec<(i64, String)> = Vec::new();
        let mut blocked: Vec<Selector> = Vec::new();
        self.budget_blocked = false;
        while self.has_free_slot() {
            let Some(first) = self.waiting.pop_first() else {
                break;
            };
            if self.assigned.contains_key(&first.1) {
                continue;
            }
            // A look at it is in flight: it stays queued, and the fill after that look settles
            // offers it the slot. Turned into a recheck it would come back unqueued, held back
            // by its own place in the queue, and never get a pick (a livelock of looks).
            if self.inflight.contains(&first.1) {
                passed.push(first);
                continue;
            }
            if let Some(sel) = self.selectors.get(&first.1) {
                if blocked.contains(sel) || !self.free_slot_for(sel) {
                    if !blocked.contains(sel) {
                        blocked.push(sel.clone());
                    }
                    passed.push(first);
                    continue;
                }
            }
            if self.ctx.starts().next_at(Instant::now()) > Instant::now() {
                self.budget_blocked = true;
                passed.push(first);
                break;
            }
            self.reconcile_with(first.1, true);
        }
        self.waiting.extend(passed);
    }

    /// Publishes the registry's states and the fleet as this term knows them.
    fn report(&self) {
        let m = metrics::get();
        // Waiting jobs are neither assigned nor in flight; a timer or a transition of a job
        // not assigned is a PENDING job's backoff or look (an id with both counts once).
        let later = self
            .timers
            .values()
            .flatten()
            .filter(|id| !self.assigned.contains_key(*id) && !self.inflight.contains(*id))
            .count();
        let looked_at = self
            .inflight
            .iter()
            .filter(|id| !self.assigned.contains_key(*id))
            .count();
        m.jobs
            .with_label_values(&["pending"])
            .set((self.waiting.len() + later + looked_at) as i64);
        m.jobs
            .with_label_values(&["running"])
            .set(self.assigned.len() as i64);
        let fleet = self.fleet.lock().expect("fleet lock");
        let draining = fleet.workers.values().filter(|w| w.record.draining).count();
        m.workers
            .with_label_values(&["live"])
            .set(fleet.workers.len() as i64);
        m.workers
            .with_label_values(&["draining"])
            .set(draining as i64);
    }

    fn fire_timers(&mut self) {
        let now = records::now_ms();
        let due: Vec<u64> = self.timers.range(..=now).map(|(k, _)| *k).collect();
        for at in due {
            for id in self.timers.remove(&at).unwrap_or_default() {
                self.reconcile(id);
            }
        }
        let due: Vec<u64> = self.rechecks.range(..=now).map(|(k, _)| *k).collect();
        for at in due {
            for (id, token) in self.rechecks.remove(&at).unwrap_or_default() {
                if self.assigned.get(&id).is_some_and(|a| a.token == token) {
                    self.reconcile(id);
                }
            }
        }
    }
}

/// Whether an attempt record says `started`.
fn is_started(kv: &etcd_client::KeyValue) -> bool {
    codec::decode::<AttemptRecord>(kv.key(), kv.value(), ATTEMPT_VERSION)
        .is_ok_and(|r| r.state == AttemptState::Started)
}

/// The pause of a policy's first retry, in ms.
fn retry_ms(p: crate::retry::Policy) -> u64 {
    p.delay(1).unwrap_or_default().as_millis() as u64
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
