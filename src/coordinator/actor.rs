//! The job actor of one term: it owns every decision about which job goes to which worker,
//! while etcd reads and fenced writes run as per-job transitions (at most one in flight per
//! job) whose outcome comes back to it. It assigns within the workers' free slots (the most
//! free first, as counted in its own table until an attempt's end is consumed) and the start
//! budget, in submission order.
//!
//! The actor runs no process: a term that ends stops nothing. The workers keep running what
//! they were given; the next term adopts it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{EventType, WatchOptions};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::Instrument;

use super::fleet::{Fleet, Pick, Selector, WorkerView};
use super::transition::{transition, Outcome};
use super::{cleanup, recovery, Ctx, Writer};
use crate::election::Term;
use crate::jobs::records;
use crate::jobs::work::{WorkerRecord, WORKER_VERSION};
use crate::metrics;
use crate::store::{codec, Keys};

/// Leads one term: recovery, then the watches, until the term ends.
pub(super) async fn lead(ctx: Arc<Ctx>, term: Term) {
    let writer = Writer::start(&term);
    term.tracker()
        .spawn(cleanup::run(ctx.clone(), writer.clone()).in_current_span());
    let mut actor = Actor {
        ctx: ctx.clone(),
        writer,
        fleet: Arc::new(Mutex::new(Fleet::new())),
        assigned: HashMap::new(),
        used: HashMap::new(),
        inflight: HashSet::new(),
        recheck: HashSet::new(),
        waiting: BTreeSet::new(),
        selectors: HashMap::new(),
        budget_blocked: false,
        timers: BTreeMap::new(),
        tasks: JoinSet::new(),
        task_jobs: HashMap::new(),
        limit: Arc::new(Semaphore::new(TRANSITIONS_AT_ONCE)),
    };
    'resync: loop {
        let (rev, ids, dirty, workers) = tokio::select! {
            r = recovery::recover(&ctx, &term) => r,
            _ = term.ended() => break 'resync,
        };
        tracing::info!(
            revision = rev,
            jobs = ids.len(),
            dirty = dirty,
            workers = workers.len(),
            "recovered registry"
        );
        actor.fleet.lock().expect("fleet lock").reset(workers);
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
        let mut more = true;
        for prefix in [ctx.keys.cancel(), ctx.keys.attempts(), ctx.keys.workers()] {
            if let Err(e) = stream.watch(prefix, Some(opts())).await {
                tracing::warn!(error = %e, "cannot watch; resyncing");
                more = false;
                break;
            }
        }
        if !more {
            continue;
        }
        // Slots also free up without an event (a distrusted worker's time runs out).
        let mut sweep = tokio::time::interval(Duration::from_secs(1));
        let mut sweeps: u64 = 0;
        loop {
            let next_timer = actor.timers.keys().next().copied();
            let sleep = records::sleep_until_ms(next_timer);
            let budget = actor.budget_wakeup();
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
                            actor.event(ev.event_type(), kv);
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::warn!("watch stream ended; resyncing");
                        continue 'resync;
                    }
                },
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

struct Actor {
    ctx: Arc<Ctx>,
    writer: Writer,
    fleet: Arc<Mutex<Fleet>>,
    /// RUNNING jobs and the worker incarnation each runs on, until their end is consumed.
    assigned: HashMap<String, Incarnation>,
    /// Slots taken per worker incarnation: assigned jobs plus reservations in flight.
    used: HashMap<Incarnation, usize>,
    inflight: HashSet<String>,
    recheck: HashSet<String>,
    /// PENDING jobs waiting for a slot or the start budget, in submission (incarnation) order.
    waiting: BTreeSet<(i64, String)>,
    /// The selectors of waiting jobs that have one: those wait only for matching workers, and
    /// never hold up the jobs behind them.
    selectors: HashMap<String, Selector>,
    /// The last fill stopped at the start budget with a job that could take a slot.
    budget_blocked: bool,
    timers: BTreeMap<u64, HashSet<String>>,
    tasks: JoinSet<(String, Option<Pick>, Outcome)>,
    /// Which job (and which reserved slot) each transition task is for.
    task_jobs: HashMap<tokio::task::Id, (String, Option<Pick>)>,
    /// Transitions talking to etcd at once: a lost worker with hundreds of jobs, or a
    /// recovery, queues its reads here instead of sending them all at once, which timed etcd
    /// out and cost leases.
    limit: Arc<Semaphore>,
}

/// See [`Actor::limit`].
const TRANSITIONS_AT_ONCE: usize = 64;

/// A random delay below `max_ms`.
fn jitter_ms(max_ms: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(records::now_ms());
    h.finish() % max_ms.max(1)
}

impl Actor {
    fn event(&mut self, kind: EventType, kv: &etcd_client::KeyValue) {
        let keys = &self.ctx.keys;
        if let Some(wid) = Keys::id_in(&keys.workers(), kv.key()) {
            let wid = wid.to_string();
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
                        record,
                    };
                    self.fleet.lock().expect("fleet lock").put(view)
                }
                EventType::Delete => self.fleet.lock().expect("fleet lock").delete(&wid),
            };
            if let Some(rev) = went {
                tracing::info!(worker = %wid, incarnation = rev, "worker gone");
                let jobs: Vec<String> = self
                    .assigned
                    .iter()
                    .filter(|(_, inc)| inc.0 == wid && inc.1 == rev)
                    .map(|(j, _)| j.clone())
                    .collect();
                for j in jobs {
                    self.reconcile(j);
                }
            }
            self.fill_slots();
            return;
        }
        let id = Keys::id_in(&keys.registry(), kv.key())
            .or_else(|| Keys::id_in(&keys.cancel(), kv.key()))
            .or_else(|| {
                Keys::id_in(&keys.attempts(), kv.key()).and_then(|rest| rest.split('/').next())
            });
        if let Some(id) = id {
            self.reconcile(id.to_string());
        }
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
        let ctx = self.ctx.clone();
        let writer = self.writer.clone();
        let fleet = self.fleet.clone();
        let job = id.clone();
        let p = pick.clone();
        let limit = self.limit.clone();
        let handle = self.tasks.spawn(
            async move {
                let outcome = match limit.acquire_owned().await {
                    Ok(_permit) => transition(&ctx, &writer, &fleet, &job, p.clone()).await,
                    Err(_) => Outcome::Retry,
                };
                (job, p, outcome)
            }
            .in_current_span(),
        );
        self.task_jobs.insert(handle.id(), (id, pick));
    }

    fn release(&mut self, inc: &Incarnation) {
        if let Some(n) = self.used.get_mut(inc) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.used.remove(inc);
            }
        }
    }

    fn settle(&mut self, id: String, pick: Option<Pick>, outcome: Outcome) {
        self.inflight.remove(&id);
        if let Some(p) = &pick {
            self.release(&(p.id.clone(), p.rev));
            if !matches!(outcome, Outcome::Running { fresh: true, .. }) {
                self.ctx.starts().give_back();
            }
        }
        let previous = match &outcome {
            Outcome::Retry => None,
            Outcome::Running { worker, rev, .. } => {
                let inc = (worker.clone(), *rev);
                let prev = self.assigned.insert(id.clone(), inc.clone());
                *self.used.entry(inc).or_default() += 1;
                prev
            }
            _ => self.assigned.remove(&id),
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
                self.waiting.insert((incarnation, id.clone()));
            }
            Outcome::Later(at) => {
                self.timers.entry(at).or_default().insert(id.clone());
            }
            Outcome::Retry => {
                // Spread out: jobs that failed together (etcd overloaded) must not come back
                // together.
                self.timers
                    .entry(records::now_ms() + 500 + jitter_ms(1000))
                    .or_default()
                    .insert(id.clone());
            }
            Outcome::Running { recheck, .. } => {
                if let Some(at) = recheck {
                    let wait = at.saturating_duration_since(Instant::now());
                    let ms = records::now_ms() + wait.as_millis() as u64 + 1;
                    self.timers.entry(ms).or_default().insert(id.clone());
                }
            }
        }
        if self.recheck.remove(&id) {
            self.reconcile(id);
        }
        self.fill_slots();
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
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
