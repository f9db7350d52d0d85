//! The main loop of one worker incarnation: it follows this incarnation's assignments, the
//! cancel requests of its jobs and its own key, and starts or stops attempts accordingly.
//!
//! It never starts an assignment twice: tokens it has seen are remembered until the
//! assignment's key is deleted. When the incarnation ends (stop, lease lost, key gone), every
//! attempt is told at once; on a stop, the loop waits (bounded) for their `preempted` records.

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
use super::WorkerConfig;
use crate::election::Lease;
use crate::jobs::work::{Assignment, ASSIGNMENT_VERSIONS_READ};
use crate::store::{codec, Keys, Store};

pub(super) enum End {
    Stopped,
    Lost(&'static str),
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
}

/// Serves incarnation `rev` until it ends.
pub(super) async fn serve(
    store: &Store,
    keys: &Keys,
    config: &WorkerConfig,
    lease: &Lease,
    rev: i64,
    stop: &CancellationToken,
) -> End {
    let watchdog = lease.watchdog(config.lease_ttl / 2);
    let mut lp = Loop {
        inc: Arc::new(Incarnation {
            store: store.clone(),
            keys: keys.clone(),
            config: config.clone(),
            rev,
            deadlines: lease.subscribe(),
            processes: Arc::new(AtomicUsize::new(0)),
            cleanups: Arc::new(AtomicUsize::new(0)),
        }),
        slots: HashMap::new(),
        tasks: TaskTracker::new(),
    };
    let prefix = keys.assignments_of(&config.worker_id, rev);
    let me = keys.worker(&config.worker_id);
    let mut pet = tokio::time::interval(config.lease_ttl / 6);
    let end = 'resync: loop {
        watchdog.pet();
        if stop.is_cancelled() {
            break End::Stopped;
        }
        if lease.lost().is_cancelled() {
            break End::Lost("the lease could not be proven");
        }
        // The watchdog guards against a hung runtime, not a slow etcd: fed while waiting.
        let feeding = async {
            loop {
                pet.tick().await;
                watchdog.pet();
            }
        };
        let read = tokio::select! {
            r = read_state(store, keys, &prefix, &me, &lp) => r,
            _ = feeding => unreachable!("feeds forever"),
            _ = stop.cancelled() => break End::Stopped,
            _ = lease.lost().cancelled() => break End::Lost("the lease could not be proven"),
        };
        let (at, assignments, cancelled, mine) = match read {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read this worker's assignments; retrying");
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
        };
        if mine != Some(rev) {
            break End::Lost("this incarnation's key is gone");
        }
        let present: HashMap<String, i64> = assignments
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
        for kv in &assignments {
            if let Some(slot) = Keys::id_in(&prefix, kv.key()) {
                lp.assigned(slot, kv);
            }
        }
        for job in cancelled {
            lp.cancel(&job);
        }
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
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        };
        if stream
            .watch(keys.cancel(), Some(opts().with_prefix()))
            .await
            .is_err()
            || stream.watch(me.clone(), Some(opts())).await.is_err()
        {
            continue;
        }
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break 'resync End::Stopped,
                _ = lease.lost().cancelled() => break 'resync End::Lost("the lease could not be proven"),
                _ = pet.tick() => watchdog.pet(),
                msg = stream.message() => match msg {
                    Ok(Some(resp)) if !resp.canceled() && resp.compact_revision() == 0 => {
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            if kv.key() == me.as_bytes() {
                                if ev.event_type() == EventType::Delete || kv.create_revision() != rev {
                                    break 'resync End::Lost("this incarnation's key is gone");
                                }
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
            super::registration::mark_draining(store, keys, config, rev).await;
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

type State = (i64, Vec<etcd_client::KeyValue>, Vec<String>, Option<i64>);

/// This incarnation's assignments, its key, and which of its jobs have a cancel request, at one
/// revision.
async fn read_state(
    store: &Store,
    keys: &Keys,
    prefix: &str,
    me: &str,
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
    Ok((at, assignments, cancelled, mine))
}
