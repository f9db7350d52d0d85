//! What the console shows live, kept by one task per replica, whatever the number of consoles:
//! one etcd watch stream (a watch per prefix on it), counts kept from the events (never a scan
//! per event), the leader and the workers re-read at most [`PUBLISH_EVERY`], and a snapshot
//! published through a `watch` channel that every console stream reads.
//!
//! A console far behind never queues anything: it reads the newest snapshot, and the ids of
//! jobs changed since it last sent ([`Snapshot::changed_since`]) or, when those have rolled off
//! [`RECENT`], a resync.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::jobs::records::{self, JobResult, RegistryEntry, RegistryStatus};
use crate::proto;
use crate::store::{codec, Keys, Store};

/// How often the hub publishes, at most.
pub const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// Changed job ids remembered for consoles that are behind.
pub const RECENT: usize = 2_000;

/// More changed ids than this in one update: the page reloads instead.
pub const MAX_IDS: usize = 200;

/// How often the workers are re-read, at most.
const WORKERS_EVERY: Duration = Duration::from_secs(1);

/// Jobs by what the console shows of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub pending: u64,
    pub running: u64,
    /// Results whose cleanup is under way or waiting for a retry.
    pub cleanup_pending: u64,
    /// Results whose cleanup ran out of attempts.
    pub needs_operator: u64,
    /// Clean results (kept for `--result-retention`).
    pub done: u64,
}

/// A replica as its election key shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Replica {
    pub replica_id: String,
    pub advertise: String,
    pub leader: bool,
}

/// The sequence number at which each kind of thing last changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Topics {
    pub jobs: u64,
    pub workers: u64,
    pub leader: u64,
    pub schedules: u64,
    pub history: u64,
}

/// What the hub knows now.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Grows with every publication.
    pub seq: u64,
    /// The etcd revision it reflects.
    pub revision: i64,
    /// The hub re-read everything at this seq (a start, or a watch lost): consoles reload.
    pub resync: u64,
    pub counts: Counts,
    pub topics: Topics,
    pub leader: Option<proto::LeaderInfo>,
    /// The replicas in the election (each holds a live lease, so it reaches etcd), the leader
    /// first.
    pub replicas: Vec<Replica>,
    pub workers: Vec<proto::WorkerInfo>,
    /// `(seq, job id)` of the newest job changes, oldest first.
    pub recent: Arc<VecDeque<(u64, String)>>,
    /// The newest seq whose changes [`Self::recent`] no longer holds in full.
    pub forgotten: u64,
    /// Whether etcd answered the last read.
    pub healthy: bool,
}

/// The jobs changed after `seq`.
#[derive(Debug, PartialEq, Eq)]
pub enum Changed {
    Ids(Vec<String>),
    /// More than [`RECENT`] changed since: reload.
    All,
}

impl Snapshot {
    pub fn changed_since(&self, seq: u64) -> Changed {
        if seq < self.resync || self.forgotten > seq {
            return Changed::All;
        }
        let mut ids: Vec<String> = self
            .recent
            .iter()
            .filter(|(s, _)| *s > seq)
            .map(|(_, id)| id.clone())
            .collect();
        ids.sort();
        ids.dedup();
        if ids.len() > MAX_IDS {
            return Changed::All;
        }
        Changed::Ids(ids)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Active {
    Pending,
    Running,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dirty {
    Cleaning,
    NeedsOperator,
}

/// The hub's own state between publications.
struct State {
    registry: HashMap<Box<str>, Active>,
    dirty: HashMap<Box<str>, Dirty>,
    counts: Counts,
    snap: Snapshot,
    recent: VecDeque<(u64, String)>,
    workers_changed: bool,
    workers_read: tokio::time::Instant,
    leader_changed: bool,
    changed: bool,
}

impl State {
    fn count(&mut self, active: Option<Active>, dirty: Option<Dirty>, up: bool) {
        let c = &mut self.counts;
        let n = match (active, dirty) {
            (Some(Active::Pending), _) => &mut c.pending,
            (Some(Active::Running), _) => &mut c.running,
            (_, Some(Dirty::Cleaning)) => &mut c.cleanup_pending,
            (_, Some(Dirty::NeedsOperator)) => &mut c.needs_operator,
            (None, None) => return,
        };
        *n = if up { *n + 1 } else { n.saturating_sub(1) };
    }

    fn set_active(&mut self, id: &str, now: Option<Active>) {
        let old = match now {
            Some(a) => self.registry.insert(id.into(), a),
            None => self.registry.remove(id),
        };
        self.count(old, None, false);
        self.count(now, None, true);
    }

    fn set_dirty(&mut self, id: &str, now: Option<Dirty>) {
        let old = match now {
            Some(d) => self.dirty.insert(id.into(), d),
            None => self.dirty.remove(id),
        };
        self.count(None, old, false);
        self.count(None, now, true);
    }
}

fn active(key: &[u8], value: &[u8]) -> Option<Active> {
    let e: RegistryEntry = codec::decode_any(key, value, records::REGISTRY_VERSIONS_READ).ok()?;
    Some(match e.status {
        RegistryStatus::Pending => Active::Pending,
        RegistryStatus::Running => Active::Running,
    })
}

fn dirty(key: &[u8], value: &[u8]) -> Option<Dirty> {
    let r: JobResult = codec::decode_any(key, value, records::RESULT_VERSIONS_READ).ok()?;
    Some(
        if r.cleanup.needs_operator && r.cleanup.abandoned.is_none() {
            Dirty::NeedsOperator
        } else {
            Dirty::Cleaning
        },
    )
}

/// The hub: start it once per replica; [`Hub::subscribe`] for each console.
#[derive(Clone)]
pub struct Hub {
    rx: watch::Receiver<Arc<Snapshot>>,
}

impl Hub {
    pub fn start(store: Store, keys: Keys, stop: CancellationToken) -> Hub {
        let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(100);
            loop {
                let seq = tx.borrow().seq;
                let r = tokio::select! {
                    r = run(&store, &keys, &tx) => r,
                    _ = stop.cancelled() => return,
                };
                if tx.borrow().seq > seq {
                    // It ran a while: the next failure starts from a short pause again.
                    pause = Duration::from_millis(100);
                }
                if let Err(e) = r {
                    tracing::warn!(error = %e, "the console's live view lost etcd; re-reading");
                    tx.send_modify(|s| {
                        let mut n = (**s).clone();
                        n.healthy = false;
                        *s = Arc::new(n);
                    });
                }
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.cancelled() => return,
                }
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        });
        Hub { rx }
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.rx.clone()
    }
}

/// Every value under `prefix` at `rev`, in pages.
async fn read_all(
    store: &Store,
    prefix: &str,
    rev: i64,
    mut each: impl FnMut(&[u8], &[u8]),
) -> Result<(), String> {
    let mut after = String::new();
    loop {
        let range = crate::jobs::Range::after(prefix, &after);
        let (kvs, _) = crate::jobs::page(store, range, 1000, rev, false)
            .await
            .map_err(|e| e.to_string())?;
        for kv in &kvs {
            each(kv.key(), kv.value());
        }
        match kvs.last().and_then(|kv| Keys::id_in(prefix, kv.key())) {
            Some(last) if kvs.len() == 1000 => after = last.to_string(),
            _ => return Ok(()),
        }
    }
}

/// One life of the hub: read everything at one revision, publish, then follow the watch
/// from the next revision until it fails.
async fn run(store: &Store, keys: &Keys, tx: &watch::Sender<Arc<Snapshot>>) -> Result<(), String> {
    let mut c = store.client();
    let head = c
        .get(keys.prefix(), Some(GetOptions::new().with_count_only()))
        .await
        .map_err(|e| e.to_string())?;
    let rev = head.header().map_or(0, |h| h.revision());
    let prev = tx.borrow().clone();
    let seq = prev.seq + 1;
    let mut st = State {
        registry: HashMap::new(),
        dirty: HashMap::new(),
        counts: Counts::default(),
        snap: Snapshot {
            seq: prev.seq,
            revision: rev,
            resync: seq,
            topics: Topics {
                jobs: seq,
                workers: seq,
                leader: seq,
                schedules: seq,
                history: seq,
            },
            healthy: true,
            ..Snapshot::default()
        },
        recent: VecDeque::new(),
        workers_changed: true,
        workers_read: tokio::time::Instant::now() - WORKERS_EVERY,
        leader_changed: true,
        changed: true,
    };
    let mut found = Vec::new();
    read_all(store, &keys.registry(), rev, |k, v| {
        if let Some(id) = Keys::id_in(&keys.registry(), k) {
            found.push((id.to_string(), active(k, v)));
        }
    })
    .await?;
    for (id, a) in found.drain(..) {
        st.set_active(&id, a);
    }
    let mut found = Vec::new();
    read_all(store, &keys.dirty(), rev, |k, v| {
        if let Some(id) = Keys::id_in(&keys.dirty(), k) {
            found.push((id.to_string(), dirty(k, v)));
        }
    })
    .await?;
    for (id, d) in found {
        st.set_dirty(&id, d);
    }
    st.counts.done = c
        .get(
            keys.clean(),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_count_only()
                    .with_revision(rev),
            ),
        )
        .await
        .map_err(|e| e.to_string())?
        .count() as u64;
    refresh(store, keys, &mut st).await;
    publish(tx, &mut st);

    let from = rev + 1;
    let opts = || Some(WatchOptions::new().with_prefix().with_start_revision(from));
    let mut stream = c
        .watch(keys.registry(), opts())
        .await
        .map_err(|e| e.to_string())?;
    let topics = [
        keys.dirty(),
        keys.clean(),
        keys.election(),
        keys.workers(),
        keys.assignments(),
        keys.drains(),
        keys.schedules(),
        keys.schedule_statuses(),
        keys.terms(),
    ];
    for p in &topics {
        stream
            .watch(p.clone(), opts())
            .await
            .map_err(|e| e.to_string())?;
    }
    let mut tick = tokio::time::interval(PUBLISH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = stream.message() => {
                let resp = match msg {
                    Ok(Some(r)) => r,
                    Ok(None) => return Err("the watch stream ended".into()),
                    Err(e) => return Err(e.to_string()),
                };
                if resp.canceled() || resp.compact_revision() > 0 {
                    return Err(format!("the watch was cancelled (compacted at {})", resp.compact_revision()));
                }
                if let (Some(h), false) = (resp.header(), resp.events().is_empty()) {
                    st.snap.revision = st.snap.revision.max(h.revision());
                }
                for ev in resp.events() {
                    if let Some(kv) = ev.kv() {
                        apply(keys, &mut st, ev.event_type(), kv);
                    }
                }
            }
            _ = tick.tick() => {
                // Nobody reads but the hub's own handle: keep counting, read nothing more.
                let watched = tx.receiver_count() > 1;
                let pending = st.changed || st.workers_changed || st.leader_changed;
                if pending && watched {
                    refresh(store, keys, &mut st).await;
                    if st.changed {
                        publish(tx, &mut st);
                    }
                }
            }
        }
    }
}

/// Folds one event into the state.
fn apply(keys: &Keys, st: &mut State, ty: EventType, kv: &etcd_client::KeyValue) {
    let key = kv.key();
    let next = st.snap.seq + 1;
    let job = |st: &mut State, id: &str| {
        st.recent.push_back((next, id.to_string()));
        // Bounded even while nobody watches and nothing is published.
        while st.recent.len() > RECENT {
            if let Some((s, _)) = st.recent.pop_front() {
                st.snap.forgotten = st.snap.forgotten.max(s);
            }
        }
        st.snap.topics.jobs = next;
        st.changed = true;
    };
    let put = ty == EventType::Put;
    if let Some(id) = Keys::id_in(&keys.registry(), key) {
        let now = if put { active(key, kv.value()) } else { None };
        st.set_active(id, now);
        job(st, id);
    } else if let Some(id) = Keys::id_in(&keys.dirty(), key) {
        let now = if put { dirty(key, kv.value()) } else { None };
        st.set_dirty(id, now);
        job(st, id);
    } else if let Some(id) = Keys::id_in(&keys.clean(), key) {
        // A clean result is written once (version 1) and deleted once.
        let done = &mut st.counts.done;
        if put && kv.version() == 1 {
            *done += 1;
        } else if !put {
            *done = done.saturating_sub(1);
        }
        job(st, id);
    } else {
        // The leader and the workers are re-read by `refresh`, which marks them changed.
        let s = std::str::from_utf8(key).unwrap_or_default();
        if s.starts_with(&keys.election()) {
            st.leader_changed = true;
        } else if s.starts_with(&keys.terms()) {
            st.snap.topics.history = next;
            st.changed = true;
        } else if s.starts_with(&keys.schedules()) || s.starts_with(&keys.schedule_statuses()) {
            st.snap.topics.schedules = next;
            st.changed = true;
        } else {
            st.workers_changed = true;
        }
    }
}

/// Re-reads the leader and the workers if they changed: once per publication, however many
/// events and consoles.
async fn refresh(store: &Store, keys: &Keys, st: &mut State) {
    if st.leader_changed {
        let leader = match crate::election::current_leader(store, keys).await {
            Ok(l) => Some(crate::api::leader_to_proto(&l)),
            Err(crate::election::Error::NoLeader) => None,
            // Unknown: keep what was shown and read again at the next publication.
            Err(_) => return,
        };
        let mut c = store.client();
        let opts = GetOptions::new().with_prefix().with_sort(
            etcd_client::SortTarget::Create,
            etcd_client::SortOrder::Ascend,
        );
        let Ok(resp) = c.get(keys.election(), Some(opts)).await else {
            return;
        };
        {
            st.snap.replicas = resp
                .kvs()
                .iter()
                .filter_map(|kv| {
                    let r: crate::election::CandidateRecord =
                        serde_json::from_slice(kv.value()).ok()?;
                    Some(Replica {
                        leader: leader
                            .as_ref()
                            .is_some_and(|l| l.term == kv.create_revision()),
                        replica_id: r.replica_id,
                        advertise: r.advertise,
                    })
                })
                .collect();
        }
        st.snap.leader = leader;
        st.leader_changed = false;
        st.snap.topics.leader = st.snap.seq + 1;
        st.changed = true;
    }
    // Assignments change with every job: the workers are read at most once a second.
    if st.workers_changed && st.workers_read.elapsed() >= WORKERS_EVERY {
        st.workers_read = tokio::time::Instant::now();
        if let Ok(fleet) = crate::jobs::fleet::read(store, keys).await {
            let now = records::now_ms();
            st.snap.workers = fleet
                .workers
                .iter()
                .map(|w| crate::api::worker_proto(w, now))
                .collect();
            st.workers_changed = false;
            st.snap.topics.workers = st.snap.seq + 1;
            st.changed = true;
        }
    }
}

/// Ids were stamped with the seq this publication gets.
fn publish(tx: &watch::Sender<Arc<Snapshot>>, st: &mut State) {
    st.snap.seq += 1;
    st.snap.counts = st.counts;
    st.snap.recent = Arc::new(st.recent.clone());
    st.changed = false;
    tx.send_replace(Arc::new(st.snap.clone()));
}
