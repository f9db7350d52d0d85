//! Dirty-job cleanup: the leader turns every dirty result clean, whatever fails and however
//! often leadership moves (Flink's FLINK-11813 and FLIP-194, standalone).
//!
//! A cleanup is a pipeline, each part idempotent (safe to repeat, safe to interrupt anywhere):
//! 1. the job's steps ([`crate::jobs::cleanup`]): `cleanup_command` as the ordered step
//!    `command`, the spec's ordered steps one after another, then its concurrent steps
//!    together; each run by a live worker under a lease guard like jobs, with a timeout, its
//!    outcome reported in `cleanups/<id>/<step>`; attempts and backoff per step (the
//!    `--cleanup-strategy`), and the result needs an operator as soon as one step is out of
//!    attempts;
//! 2. `folder`: removal of the job's folder by the worker incarnation that ran its final
//!    attempt (done at once if that incarnation is gone: a worker removes stale folders when it
//!    starts);
//! 3. `finish`: one fenced transaction that deletes `jobs/<id>`, `cancel/<id>`, the request
//!    keys and `results/dirty/<id>`, and puts `results/clean/<id>`.
//!
//! Progress is recorded by step name in the dirty entry (a fenced write comparing the entry's
//! revision), so a new leader resumes where the last one stopped; see [`job`] for what each
//! pass guarantees. At most `--cleanup-concurrency` step commands run at once over every
//! dirty result, and no more on one worker than its `--max-cleanups`. Clean results are
//! deleted after `--result-retention`, in small fenced batches.

mod job;
mod place;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::WatchOptions;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::fleet::Fleet;
use super::{Ctx, Writer};
use crate::jobs;
use crate::jobs::records::{self, JobResult};
use crate::jobs::work::{AttemptState, WorkerRecord, WORKER_VERSION};
use crate::metrics;
use crate::rolelog;
use crate::store::{codec, Keys, Write};
use place::{LiveWorker, Slots};

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
        slots: Slots::new(ctx.config.cleanup.concurrency),
    };
    let mut first = true;
    let mut report = tokio::time::interval(Duration::from_secs(1));
    let mut retention = tokio::time::interval(
        (ctx.config.cleanup.retention / 4)
            .clamp(Duration::from_millis(500), Duration::from_secs(60)),
    );
    let mut pause = crate::retry::policies::RESYNC.backoff();
    'resync: loop {
        let (rev, ids) = tokio::select! {
            r = read_pages(&ctx) => match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read dirty results; retrying");
                    pause.pause().await;
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
            pause.pause().await;
            continue;
        };
        let mut more = true;
        for prefix in [
            ctx.keys.cleanup_now(),
            ctx.keys.cleanup_abandon(),
            ctx.keys.cleanups(),
            ctx.keys.attempts(),
        ] {
            more = more && stream.watch(prefix, Some(opts())).await.is_ok();
        }
        if !more {
            pause.pause().await;
            continue;
        }
        pause.reset();
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
    /// The step commands running, over every job.
    slots: Arc<Slots>,
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

    /// Starts queued jobs' tasks: twice as many as commands may run, so jobs in their folder
    /// or finish stage are not held up behind ones waiting for a place.
    fn pump(&mut self) {
        while self.tasks.len() < 2 * self.ctx.config.cleanup.concurrency.max(1) {
            let Some(id) = self.queue.pop_front() else {
                return;
            };
            let (ctx, writer, wakers) =
                (self.ctx.clone(), self.writer.clone(), self.wakers.clone());
            let (fleet, slots) = (self.fleet.clone(), self.slots.clone());
            self.tasks.spawn(async move {
                let on = On {
                    writer: &writer,
                    wakers: &wakers,
                    fleet: &fleet,
                    slots,
                };
                let next = job::JobTask::new(&ctx, &on, &id).run().await;
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
        } else if let Some(id) = Keys::id_in(&keys.cleanup_now(), kv.key())
            .or_else(|| Keys::id_in(&keys.cleanup_abandon(), kv.key()))
        {
            if self.inflight.contains(id) {
                self.wakers.wake(id);
            }
            self.schedule(id.to_string());
        } else if let Some((id, _step)) =
            Keys::id_in(&keys.cleanups(), kv.key()).and_then(|r| r.split_once('/'))
        {
            if only_started(kv.value()) {
                // Nothing for the task to act on: a step that runs is looked at again within
                // a second, and its end wakes the task.
                return;
            }
            if self.inflight.contains(id) {
                self.wakers.wake(id);
            } else {
                // A report for a job not being looked at (its task waits for a timer).
                self.schedule(id.to_string());
            }
        } else if let Some((id, _token)) =
            Keys::id_in(&keys.attempts(), kv.key()).and_then(|r| r.split_once('/'))
        {
            // The end of a stray registry entry's attempt a cleanup may wait for.
            if self.inflight.contains(id) {
                self.wakers.wake(id);
            }
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

/// Whether a step's record says only that it started (anything unreadable says more).
fn only_started(value: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct State {
        state: AttemptState,
    }
    serde_json::from_slice::<State>(value).is_ok_and(|s| s.state == AttemptState::Started)
}

async fn read_pages(ctx: &Ctx) -> Result<(i64, Vec<String>), jobs::Error> {
    let mut rev = 0;
    let mut ids = Vec::new();
    for prefix in [
        ctx.keys.dirty(),
        ctx.keys.cleanup_now(),
        ctx.keys.cleanup_abandon(),
    ] {
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

/// What one job's cleanup task works with besides the term's settings.
struct On<'a> {
    writer: &'a Writer,
    wakers: &'a Wakers,
    /// The term's view of the workers, once the actor has read them.
    fleet: &'a Mutex<Fleet>,
    slots: Arc<Slots>,
}

impl On<'_> {
    /// Live workers, from the term's view when it has one (no read), else from etcd.
    async fn workers(&self, ctx: &Ctx) -> Result<Vec<LiveWorker>, crate::store::Error> {
        {
            let f = self.fleet.lock().expect("fleet lock");
            if f.loaded() {
                return Ok(f.workers.values().cloned().collect());
            }
        }
        live_workers(ctx).await
    }
}

/// Live workers, read from etcd.
async fn live_workers(ctx: &Ctx) -> Result<Vec<LiveWorker>, crate::store::Error> {
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
            let record: WorkerRecord = codec::decode(kv.key(), kv.value(), WORKER_VERSION).ok()?;
            Some(LiveWorker {
                rev: kv.create_revision(),
                mod_rev: kv.mod_revision(),
                lease: kv.lease(),
                record,
            })
        })
        .collect())
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
