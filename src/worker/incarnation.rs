//! The main loop of one worker incarnation: it follows this incarnation's assignments, the
//! cancel requests of its jobs and its own key, and starts or stops attempts accordingly.
//!
//! It never starts an assignment twice: tokens it has seen are remembered until the
//! assignment's key is deleted. A stop (SIGTERM) or an operator's drain request first marks
//! the record `draining` and lets running attempts go on for `--drain-timeout`, then preempts
//! the rest; a stop ends the incarnation once every attempt has reported. When the lease is
//! lost or the key gone, every attempt is told at once.

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::attempt::{self, Control, Incarnation};
use super::registration::Marks;
use super::WorkerConfig;
use crate::election::Lease;
use crate::jobs::work::{Assignment, ASSIGNMENT_VERSIONS_READ};
use crate::metrics;
use crate::store::group::{GroupCommit, Limits};
use crate::store::{codec, Keys, Store};

pub(super) enum End {
    Stopped,
    Lost(&'static str),
}

/// A drain in progress: no new jobs (the record says `draining`); running ones go on until
/// `until`, then are preempted. `exit`: the worker stops once its attempts are done (SIGTERM);
/// otherwise (an operator's drain) it stays registered, drained, until undrained.
struct Drain {
    until: tokio::time::Instant,
    exit: bool,
    preempted: bool,
}

impl Drain {
    fn begin(drain: &mut Option<Drain>, config: &WorkerConfig, exit: bool) {
        match drain {
            Some(d) => d.exit |= exit,
            None => {
                tracing::info!(exit, timeout = ?config.drain_timeout, "draining: no new jobs; running ones may finish");
                *drain = Some(Drain {
                    until: tokio::time::Instant::now() + config.drain_timeout,
                    exit,
                    preempted: false,
                });
            }
        }
    }
}

fn exiting(drain: &Option<Drain>) -> bool {
    drain.as_ref().is_some_and(|d| d.exit)
}

struct Slot {
    token: i64,
    ctl: watch::Sender<Control>,
}

struct Loop {
    inc: Arc<Incarnation>,
    slots: HashMap<String, Slot>,
    tasks: TaskTracker,
}

impl Loop {
    /// An assignment (put) seen at revision `token`, under `slot` (`<job>` or `cleanup/<job>`).
    fn assigned(&mut self, slot: &str, kv: &etcd_client::KeyValue) {
        let Ok(a) = codec::decode_any::<Assignment>(kv.key(), kv.value(), ASSIGNMENT_VERSIONS_READ)
        else {
            return;
        };
        let token = kv.mod_revision();
        if let Some(s) = self.slots.get(slot) {
            if s.token == token {
                return;
            }
            s.ctl.send_replace(Control::Revoked);
        }
        let (ctl, rx) = watch::channel(Control::Run);
        self.slots.insert(slot.to_string(), Slot { token, ctl });
        let span = tracing::info_span!("attempt", job_id = %a.job_id, token);
        self.tasks
            .spawn(attempt::run_reported(self.inc.clone(), a, token, rx).instrument(span));
    }

    fn unassigned(&mut self, job: &str, token: Option<i64>) {
        if let Some(s) = self.slots.get(job) {
            if token.is_none_or(|t| t >= s.token) {
                s.ctl.send_replace(Control::Revoked);
                self.slots.remove(job);
            }
        }
    }

    fn cancel(&self, job: &str) {
        if let Some(s) = self.slots.get(job) {
            s.ctl.send_if_modified(|c| {
                if *c == Control::Run {
                    *c = Control::Cancel;
                    true
                } else {
                    false
                }
            });
        }
    }

    fn end_all(&self, why: Control) {
        for s in self.slots.values() {
            s.ctl.send_replace(why);
        }
    }

    /// A drain's time is up: every attempt still running is stopped and recorded `preempted`
    /// (a cancel in progress goes on as a cancel).
    fn preempt_running(&self) {
        // Cleanup commands and folder removals are not the drain's to move.
        for (_, s) in self.slots.iter().filter(|(slot, _)| !slot.contains('/')) {
            s.ctl.send_if_modified(|c| {
                let run = *c == Control::Run;
                if run {
                    *c = Control::Preempt;
                }
                run
            });
        }
    }
}

/// Serves incarnation `rev` until it ends.
pub(super) async fn serve(
    store: &Store,
    keys: &Keys,
    config: &WorkerConfig,
    lease: &Lease,
    rev: i64,
    guards: &Arc<super::guards::GuardHealth>,
    stop: &CancellationToken,
) -> End {
    let watchdog = lease.watchdog(config.lease_ttl / 2);
    let (reports, committer) =
        GroupCommit::new(store.clone(), None, "report attempt", Limits::default());
    tokio::spawn(committer);
    let mut lp = Loop {
        inc: Arc::new(Incarnation {
            reports,
            keys: keys.clone(),
            config: config.clone(),
            rev,
            deadlines: lease.subscribe(),
            processes: Arc::new(AtomicUsize::new(0)),
            cleanups: Arc::new(AtomicUsize::new(0)),
            draining: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            guards: guards.clone(),
        }),
        slots: HashMap::new(),
        tasks: TaskTracker::new(),
    };
    report_metrics(config, lp.inc.processes.clone());
    let prefix = keys.assignments_of(&config.worker_id, rev);
    let me = keys.worker(&config.worker_id);
    let drain_key = keys.drain(&config.worker_id);
    let mut pet = tokio::time::interval(config.lease_ttl / 6);
    let mut drain: Option<Drain> = None;
    // What this incarnation's record says about draining and guards, as far as it knows;
    // unknown at first (it registers drained when an operator's request stands), so checked once.
    let mut marked: Option<Marks> = None;
    let mut marking: Option<tokio::task::JoinHandle<(Marks, bool)>> = None;
    let mut unable = guards.subscribe();
    let tracker = lp.tasks.clone();
    let mut resync = crate::retry::policies::WORKER_RESYNC.backoff();
    let end = 'resync: loop {
        watchdog.pet();
        if lease.lost().is_cancelled() {
            break End::Lost("the lease could not be proven");
        }
        if stop.is_cancelled() && !exiting(&drain) {
            Drain::begin(&mut drain, config, true);
            lp.inc
                .draining
                .store(true, std::sync::atomic::Ordering::SeqCst);
            lp.tasks.close();
        }
        if exiting(&drain) && lp.tasks.is_empty() {
            break End::Stopped;
        }
        // The watchdog guards against a hung runtime, not a slow etcd: fed while waiting.
        let feeding = async {
            loop {
                pet.tick().await;
                watchdog.pet();
            }
        };
        let read = tokio::select! {
            r = read_state(store, keys, &prefix, &me, &drain_key, &lp) => r,
            _ = feeding => unreachable!("feeds forever"),
            _ = stop.cancelled(), if !exiting(&drain) => continue 'resync,
            _ = lease.lost().cancelled() => break End::Lost("the lease could not be proven"),
        };
        let state = match read {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read this worker's assignments; retrying");
                resync.pause().await;
                continue;
            }
        };
        if state.mine != Some(rev) {
            break End::Lost("this incarnation's key is gone");
        }
        let at = state.at;
        let present: HashMap<String, i64> = state
            .assignments
            .iter()
            .filter_map(|kv| {
                Some((
                    Keys::id_in(&prefix, kv.key())?.to_string(),
                    kv.mod_revision(),
                ))
            })
            .collect();
        let gone: Vec<String> = lp
            .slots
            .iter()
            .filter(|(job, s)| present.get(*job) != Some(&s.token))
            .map(|(job, _)| job.clone())
            .collect();
        for job in gone {
            lp.unassigned(&job, None);
        }
        for kv in &state.assignments {
            if let Some(slot) = Keys::id_in(&prefix, kv.key()) {
                lp.assigned(slot, kv);
            }
        }
        for job in state.cancelled {
            lp.cancel(&job);
        }
        requested(&mut drain, config, state.drain_requested);
        lp.inc
            .draining
            .store(drain.is_some(), std::sync::atomic::Ordering::SeqCst);
        let opts = || WatchOptions::new().with_start_revision(at + 1);
        let mut client = store.client();
        let watched = tokio::time::timeout(
            Duration::from_secs(5),
            client.watch(prefix.clone(), Some(opts().with_prefix())),
        );
        let watched = tokio::select! {
            w = watched => w,
            _ = async { loop { pet.tick().await; watchdog.pet(); } } => unreachable!("feeds forever"),
        };
        let Ok(Ok(mut stream)) = watched else {
            tracing::warn!("cannot watch this worker's assignments; resyncing");
            resync.pause().await;
            continue;
        };
        if stream
            .watch(keys.cancel(), Some(opts().with_prefix()))
            .await
            .is_err()
            || stream.watch(me.clone(), Some(opts())).await.is_err()
            || stream.watch(drain_key.clone(), Some(opts())).await.is_err()
        {
            resync.pause().await;
            continue;
        }
        resync.reset();
        loop {
            // The record follows the drain state and whether guards start, written off the
            // loop so a slow etcd never starves the watchdog.
            let want = Marks {
                draining: drain.is_some(),
                unable: unable.borrow_and_update().clone(),
            };
            lp.inc
                .draining
                .store(want.draining, std::sync::atomic::Ordering::SeqCst);
            if marked.as_ref() != Some(&want) && marking.is_none() {
                let (store, keys, config) = (store.clone(), keys.clone(), config.clone());
                marking = Some(tokio::spawn(async move {
                    let done =
                        super::registration::set_marks(&store, &keys, &config, rev, &want).await;
                    (want, done)
                }));
            }
            let deadline = drain.as_ref().filter(|d| !d.preempted).map(|d| d.until);
            tokio::select! {
                biased;
                _ = stop.cancelled(), if !exiting(&drain) => {
                    Drain::begin(&mut drain, config, true);
            lp.inc.draining.store(true, std::sync::atomic::Ordering::SeqCst);
                    lp.tasks.close();
                }
                _ = lease.lost().cancelled() => break 'resync End::Lost("the lease could not be proven"),
                _ = tracker.wait(), if exiting(&drain) => break 'resync End::Stopped,
                _ = unable.changed() => {}
                done = async { marking.as_mut().expect("guarded").await }, if marking.is_some() => {
                    marking = None;
                    match done {
                        Ok((want, true)) => marked = Some(want),
                        _ => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
                _ = sleep_until_opt(deadline), if deadline.is_some() => {
                    if let Some(d) = drain.as_mut() {
                        d.preempted = true;
                        tracing::info!(running = lp.slots.len(), "drain timeout: preempting what still runs");
                    }
                    lp.preempt_running();
                }
                _ = pet.tick() => {
                    watchdog.pet();
                    if let Some(d) = &drain {
                        if d.preempted {
                            // An assignment that raced the draining mark goes too.
                            lp.preempt_running();
                            let bound = d.until + config.guard.kill_grace + Duration::from_secs(15);
                            if d.exit && tokio::time::Instant::now() > bound {
                                break 'resync End::Stopped;
                            }
                        }
                    }
                }
                msg = stream.message() => match msg {
                    Ok(Some(resp)) if !resp.canceled() && resp.compact_revision() == 0 => {
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            if kv.key() == me.as_bytes() {
                                if ev.event_type() == EventType::Delete || kv.create_revision() != rev {
                                    break 'resync End::Lost("this incarnation's key is gone");
                                }
                            } else if kv.key() == drain_key.as_bytes() {
                                requested(&mut drain, config, ev.event_type() == EventType::Put);
                                lp.inc.draining.store(drain.is_some(), std::sync::atomic::Ordering::SeqCst);
                            } else if let Some(job) = Keys::id_in(&prefix, kv.key()) {
                                match ev.event_type() {
                                    EventType::Put => lp.assigned(job, kv),
                                    EventType::Delete => {
                                        let job = job.to_string();
                                        lp.unassigned(&job, Some(kv.mod_revision()));
                                    }
                                }
                            } else if let Some(job) = Keys::id_in(&keys.cancel(), kv.key()) {
                                if ev.event_type() == EventType::Put {
                                    lp.cancel(job);
                                }
                            }
                        }
                    }
                    _ => {
                        tracing::warn!("worker watch ended; resyncing");
                        continue 'resync;
                    }
                },
            }
        }
    };
    match end {
        End::Stopped => {
            let last = Marks {
                draining: true,
                unable: guards.unable(),
            };
            if marked.as_ref() != Some(&last) {
                super::registration::set_marks(store, keys, config, rev, &last).await;
            }
            lp.end_all(Control::Preempt);
            lp.tasks.close();
            let bound = config.guard.kill_grace + Duration::from_secs(15);
            if tokio::time::timeout(bound, lp.tasks.wait()).await.is_err() {
                tracing::warn!("some attempts did not report in time; their jobs are stopped");
            }
        }
        End::Lost(_) => {
            // The attempts kill their jobs now and report `lost` (or a real exit) in the
            // background, comparing only their assignments.
            lp.end_all(Control::Lost);
            lp.tasks.close();
        }
    }
    end
}

/// An operator's drain request appeared (`true`) or went: a drain begins, or one that was not
/// a shutdown ends (jobs it already preempted stay moved).
fn requested(drain: &mut Option<Drain>, config: &WorkerConfig, wanted: bool) {
    match (wanted, drain.as_ref()) {
        (true, None) => Drain::begin(drain, config, false),
        (false, Some(d)) if !d.exit => {
            tracing::info!("undrained: taking jobs again");
            *drain = None;
        }
        _ => {}
    }
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

struct State {
    at: i64,
    assignments: Vec<etcd_client::KeyValue>,
    cancelled: Vec<String>,
    /// The create revision of this worker's key.
    mine: Option<i64>,
    drain_requested: bool,
}

/// This incarnation's assignments, its key, and which of its jobs have a cancel request, at one
/// revision.
async fn read_state(
    store: &Store,
    keys: &Keys,
    prefix: &str,
    me: &str,
    drain_key: &str,
    lp: &Loop,
) -> Result<State, crate::store::Error> {
    let mut c = store.client();
    let resp = store
        .timed(
            "read assignments",
            c.get(prefix, Some(GetOptions::new().with_prefix())),
        )
        .await?;
    let at = resp.header().map_or(0, |h| h.revision());
    let assignments = resp.kvs().to_vec();
    let pinned = || GetOptions::new().with_revision(at);
    let own = store
        .timed("read worker key", c.get(me, Some(pinned())))
        .await?;
    let mine = own.kvs().first().map(|kv| kv.create_revision());
    let drain = store
        .timed(
            "read drain request",
            c.get(drain_key, Some(pinned().with_count_only())),
        )
        .await?;
    let jobs: std::collections::HashSet<String> = assignments
        .iter()
        .filter_map(|kv| Keys::id_in(prefix, kv.key()).map(str::to_owned))
        .chain(lp.slots.keys().cloned())
        .filter(|slot| !slot.contains('/'))
        .collect();
    let mut cancelled = Vec::new();
    if !jobs.is_empty() {
        let cancels = store
            .timed(
                "read cancels",
                c.get(keys.cancel(), Some(pinned().with_prefix().with_keys_only())),
            )
            .await?;
        cancelled = cancels
            .kvs()
            .iter()
            .filter_map(|kv| Keys::id_in(&keys.cancel(), kv.key()))
            .filter(|id| jobs.contains(*id))
            .map(str::to_owned)
            .collect();
    }
    Ok(State {
        at,
        assignments,
        cancelled,
        mine,
        drain_requested: drain.count() > 0,
    })
}

/// Reports this incarnation's running jobs and capacity at every scrape.
fn report_metrics(config: &WorkerConfig, running: Arc<AtomicUsize>) {
    let id = config.worker_id.clone();
    let capacity = config.capacity as i64;
    metrics::get().on_scrape(format!("worker/{id}"), move |m| {
        let n = running.load(std::sync::atomic::Ordering::Relaxed) as i64;
        m.worker_running.with_label_values(&[&id]).set(n);
        m.worker_capacity.with_label_values(&[&id]).set(capacity);
    });
}
