//! The leader's view of the workers: which incarnations are alive, when this term saw the
//! others go, and when it made each assignment. Kept from the workers' keys (paged at the term's
//! start, then watched) and shared between the actor and the transitions.
//!
//! Guarantee: an incarnation is [`Liveness::Gone`] with a time no earlier than its key's
//! deletion as this term saw it (the term's start for one gone before the term), and no earlier
//! than this term's revocation of its lease, once it has revoked it. A started job of a gone
//! incarnation is restarted only after its lease was revoked (when its id is known) and a further
//! TTL and margin have passed: a key deleted while its lease lived (`etcdctl del`, etcd issue
//! 15247) cannot let its worker go on proving the lease and feeding the job's guard, even if the
//! worker never learns of the deletion (a lagging watch).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::jobs::work::WorkerRecord;

#[derive(Clone, Debug)]
pub(super) struct WorkerView {
    /// The key's create revision: the incarnation.
    pub(super) rev: i64,
    pub(super) mod_rev: i64,
    /// The lease its key is on.
    pub(super) lease: i64,
    pub(super) record: WorkerRecord,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Liveness {
    Alive,
    /// Gone no later than this (as this term saw it).
    Gone(Instant),
    /// Gone (seen so at this instant), and its lease must be revoked before any wait for its
    /// jobs starts.
    Unrevoked(Instant),
}

/// Revokes a gone worker incarnation's lease: from then on no keepalive of it is answered, so
/// its guards are fed no deadline past the revocation plus its TTL. Already gone counts too.
pub(super) async fn revoke_lease(
    store: &crate::store::Store,
    lease: i64,
) -> Result<(), crate::store::Error> {
    let mut c = store.client();
    match store.timed("lease revoke", c.lease_revoke(lease)).await {
        Err(e) if !e.is_lease_not_found() => Err(e),
        _ => Ok(()),
    }
}

/// A worker incarnation chosen for an assignment.
#[derive(Clone, Debug)]
pub(super) struct Pick {
    pub(super) id: String,
    pub(super) rev: i64,
    pub(super) mod_rev: i64,
    pub(super) lease: i64,
    /// Its lease TTL plus margin.
    pub(super) ttl_ms: u64,
    pub(super) labels: BTreeMap<String, String>,
}

/// How long an assignment's time is kept (far beyond any assign timeout).
const ASSIGNED_KEPT: Duration = Duration::from_secs(600);

/// A worker incarnation that went.
#[derive(Clone, Copy, Debug)]
pub(super) struct Went {
    pub(super) rev: i64,
}

impl Went {
    fn of(w: &WorkerView) -> Went {
        Went { rev: w.rev }
    }
}

/// The labels a job needs of its worker (usually none).
pub(super) type Selector = BTreeMap<String, String>;

pub(super) struct Fleet {
    pub(super) term_start: Instant,
    pub(super) workers: BTreeMap<String, WorkerView>,
    gone: HashMap<(String, i64), Instant>,
    /// Gone incarnations whose lease this term has revoked.
    revoked: HashSet<(String, i64)>,
    /// The leases of gone incarnations, from their last view (for entries without one).
    gone_leases: HashMap<(String, i64), i64>,
    /// Whether the workers have been read (a term's first recovery) and followed since.
    loaded: bool,
    /// Assignments this term made or first saw, by token, and when; with the same in time
    /// order, to forget the old ones in O(1) each.
    assigned_at: HashMap<i64, Instant>,
    assigned_order: VecDeque<(Instant, i64)>,
    /// Incarnations that let an assignment time out: given nothing until then, unless they
    /// record a start meanwhile.
    suspect: HashMap<(String, i64), Instant>,
}

impl Fleet {
    pub(super) fn new() -> Fleet {
        Fleet {
            term_start: Instant::now(),
            workers: BTreeMap::new(),
            loaded: false,
            gone: HashMap::new(),
            revoked: HashSet::new(),
            gone_leases: HashMap::new(),
            assigned_at: HashMap::new(),
            assigned_order: VecDeque::new(),
            suspect: HashMap::new(),
        }
    }

    /// Replaces the view with a fresh read: incarnations missing from it are gone as of now.
    pub(super) fn reset(&mut self, workers: Vec<WorkerView>) {
        let now = Instant::now();
        let fresh: BTreeMap<String, WorkerView> = workers
            .into_iter()
            .map(|w| (w.record.worker_id.clone(), w))
            .collect();
        for (id, old) in &self.workers {
            if fresh.get(id).is_none_or(|w| w.rev != old.rev) {
                self.gone.entry((id.clone(), old.rev)).or_insert(now);
                self.gone_leases.insert((id.clone(), old.rev), old.lease);
            }
        }
        self.workers = fresh;
        self.loaded = true;
    }

    /// Whether [`Fleet::workers`] is the term's read of the workers yet.
    pub(super) fn loaded(&self) -> bool {
        self.loaded
    }

    /// A worker's key was put. Returns the incarnation it replaced, if any.
    pub(super) fn put(&mut self, view: WorkerView) -> Option<Went> {
        let id = view.record.worker_id.clone();
        let replaced = self
            .workers
            .get(&id)
            .filter(|old| old.rev != view.rev)
            .map(Went::of);
        if let Some(w) = &replaced {
            self.gone
                .entry((id.clone(), w.rev))
                .or_insert_with(Instant::now);
        }
        if let Some(old) = self.workers.get(&id).filter(|old| old.rev != view.rev) {
            self.gone_leases.insert((id.clone(), old.rev), old.lease);
        }
        self.workers.insert(id, view);
        replaced
    }

    /// A worker's key was deleted. Returns the incarnation that went.
    pub(super) fn delete(&mut self, id: &str) -> Option<Went> {
        let old = self.workers.remove(id)?;
        self.gone
            .entry((id.to_string(), old.rev))
            .or_insert_with(Instant::now);
        self.gone_leases
            .insert((id.to_string(), old.rev), old.lease);
        Some(Went::of(&old))
    }

    pub(super) fn liveness(&self, id: &str, rev: i64) -> Liveness {
        if self.workers.get(id).is_some_and(|w| w.rev == rev) {
            return Liveness::Alive;
        }
        Liveness::Gone(
            self.gone
                .get(&(id.to_string(), rev))
                .copied()
                .unwrap_or(self.term_start),
        )
    }

    /// This term revoked the lease of gone incarnation `(id, rev)`: it counts as gone from now.
    pub(super) fn revoked(&mut self, id: &str, rev: i64) {
        let key = (id.to_string(), rev);
        self.gone.insert(key.clone(), Instant::now());
        self.revoked.insert(key);
    }

    /// The lease of gone incarnation `(id, rev)`, if this term saw it alive.
    pub(super) fn lease_of(&self, id: &str, rev: i64) -> Option<i64> {
        self.gone_leases.get(&(id.to_string(), rev)).copied()
    }

    /// Whether this term has revoked the lease of incarnation `(id, rev)`.
    pub(super) fn is_revoked(&self, id: &str, rev: i64) -> bool {
        self.revoked.contains(&(id.to_string(), rev))
    }

    pub(super) fn assigned(&mut self, token: i64) {
        self.saw_assignment(token);
    }

    /// Assignment `token`'s start is known: its deadline no longer matters.
    pub(super) fn started(&mut self, token: i64) {
        self.assigned_at.remove(&token);
    }

    fn saw_assignment(&mut self, token: i64) -> Instant {
        let now = Instant::now();
        // Long past any assign timeout: their start was recorded or they were reclaimed. One
        // forgotten too early only gets a later deadline (counted anew from its next look).
        while let Some((at, t)) = self.assigned_order.front().copied() {
            if now.duration_since(at) < ASSIGNED_KEPT {
                break;
            }
            self.assigned_order.pop_front();
            if self.assigned_at.get(&t) == Some(&at) {
                self.assigned_at.remove(&t);
            }
        }
        *self.assigned_at.entry(token).or_insert_with(|| {
            self.assigned_order.push_back((now, token));
            now
        })
    }

    /// When the assignment `token` to `worker` must have a `started` record by: counted from
    /// when this term made it, or first saw it (adopted, or an assignment whose commit answer
    /// was lost).
    pub(super) fn accept_due(&mut self, worker: &str, token: i64) -> Instant {
        let from = self.saw_assignment(token);
        let timeout = self
            .workers
            .get(worker)
            .map_or(Duration::from_secs(10), |w| {
                Duration::from_millis(w.record.assign_timeout_ms)
            });
        from + timeout
    }

    /// Worker incarnation `(id, rev)` let an assignment time out: it gets nothing for three
    /// assign timeouts.
    pub(super) fn distrust(&mut self, id: &str, rev: i64) {
        let timeout = self.workers.get(id).map_or(Duration::from_secs(10), |w| {
            Duration::from_millis(w.record.assign_timeout_ms)
        });
        self.suspect
            .insert((id.to_string(), rev), Instant::now() + timeout * 3);
    }

    /// Worker incarnation `(id, rev)` recorded a start: it answers.
    pub(super) fn trust(&mut self, id: &str, rev: i64) {
        if !self.suspect.is_empty() {
            self.suspect.remove(&(id.to_string(), rev));
        }
    }

    /// The live, non-draining worker that has every label of `selector` and the most free
    /// slots (ties by id), given the slots taken per incarnation; for a job with no selector,
    /// unlabelled workers first.
    pub(super) fn pick(
        &self,
        used: &HashMap<(String, i64), usize>,
        selector: &Selector,
    ) -> Option<Pick> {
        // A job that needs no label goes to an unlabelled worker while one has room, keeping the
        // labelled ones free for the jobs that need them.
        let mut best: Option<((bool, usize), &WorkerView)> = None;
        let now = Instant::now();
        for w in self.workers.values() {
            let distrusted = || {
                self.suspect
                    .get(&(w.record.worker_id.clone(), w.rev))
                    .is_some_and(|until| *until > now)
            };
            let fits = || {
                selector
                    .iter()
                    .all(|(k, v)| w.record.labels.get(k) == Some(v))
            };
            if !w.record.takes_work() || distrusted() || !fits() {
                continue;
            }
            let taken = used
                .get(&(w.record.worker_id.clone(), w.rev))
                .copied()
                .unwrap_or(0);
            let free = (w.record.capacity as usize).saturating_sub(taken);
            let rank = (selector.is_empty() && w.record.labels.is_empty(), free);
            if free > 0 && best.is_none_or(|(r, _)| rank > r) {
                best = Some((rank, w));
            }
        }
        best.map(|(_, w)| Pick {
            id: w.record.worker_id.clone(),
            rev: w.rev,
            mod_rev: w.mod_rev,
            lease: w.lease,
            ttl_ms: w.record.lease_ttl_ms.saturating_add(w.record.margin_ms),
            labels: w.record.labels.clone(),
        })
    }
}
