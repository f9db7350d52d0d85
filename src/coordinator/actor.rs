//! The job actor of one term: it owns every decision about which job runs, while etcd reads
//! and fenced writes run as per-job transitions (at most one in flight per job) whose outcome
//! comes back to it. It keeps at most `--max-running` jobs running and starts them within the
//! start budget, in submission order.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::WatchOptions;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::Instrument;

use super::transition::{transition, Local, Outcome};
use super::{cleanup, recovery, Ctx, Writer};
use crate::election::Term;
use crate::exec::spawner::Guard;
use crate::jobs::records;
use crate::store::Keys;

enum Event {
    Exited { id: String, attempt: u32 },
}

/// Leads one term: recovery, then the watch, until the term ends; then every guard is abandoned.
pub(super) async fn lead(ctx: Arc<Ctx>, term: Term) {
    let writer = Writer::start(&term);
    term.tracker()
        .spawn(cleanup::run(ctx.clone(), writer.clone()).in_current_span());
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
            r = recovery::recover(&ctx, &term) => r,
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
                _ = sleep_until_opt(budget), if budget.is_some() => actor.fill_slots(),
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
    /// PENDING jobs waiting for a slot or the start budget, in submission (incarnation) order.
    waiting: BTreeSet<(i64, String)>,
    timers: BTreeMap<u64, HashSet<String>>,
    reserved: usize,
    tasks: JoinSet<(String, bool, Outcome)>,
    /// Which job (and whether it holds a slot) each transition task is for.
    task_jobs: HashMap<tokio::task::Id, (String, bool)>,
    /// Exits that arrived while a transition for the job was in flight.
    exits: HashMap<String, Local>,
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
        self.reconcile_with(id, None, false);
    }

    /// `queued`: the job comes off the waiting set, whose order decides who starts next; any
    /// other job may take a slot only while nobody waits, or it would overtake them.
    fn reconcile_with(&mut self, id: String, exited: Option<Local>, queued: bool) {
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
        let local = self.running.get(&id).cloned();
        let slot = local.is_none()
            && exited.is_none()
            && (queued || self.waiting.is_empty())
            && self.free_slots() > 0
            && self.ctx.starts().try_take(Instant::now());
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
            if !matches!(outcome, Outcome::Started(..)) {
                self.ctx.starts().give_back();
            }
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
                    let Guard {
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
            self.reconcile_with(id, Some(view), false);
        } else if self.recheck.remove(&id) {
            self.reconcile(id);
        }
        self.fill_slots();
    }

    /// When the start budget next allows a waiting job to start, if one waits for it alone.
    fn budget_wakeup(&mut self) -> Option<Instant> {
        (self.free_slots() > 0 && !self.waiting.is_empty())
            .then(|| self.ctx.starts().next_at(Instant::now()))
    }

    fn fill_slots(&mut self) {
        while self.free_slots() > 0 && self.ctx.starts().next_at(Instant::now()) <= Instant::now() {
            let Some(first) = self.waiting.pop_first() else {
                break;
            };
            if !self.running.contains_key(&first.1) {
                self.reconcile_with(first.1, None, true);
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
        self.reconcile_with(id, Some(l), false);
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
                late.push(g.feed);
            }
        }
        let n = self.running.len();
        if n > 0 {
            tracing::info!(jobs = n, "term over: killed all running jobs");
        }
        // The guards exit within milliseconds of SIGHUP; their pipes are already closed.
        let mut feeds: Vec<_> = self.running.values().map(|l| l.feed.clone()).collect();
        feeds.extend(late);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while feeds.iter().any(|f| f.is_running()) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
