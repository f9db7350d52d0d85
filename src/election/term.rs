//! A term of leadership and its fence.
//!
//! A [`Term`] is `(lease id, leader key, create revision)`. Every write a leader makes as leader
//! goes through [`Term::commit`], which commits only while the leader key still exists with the
//! term's create revision. When that fence fails the term is over for good: the term ends itself
//! and the caller gets [`FenceError::Deposed`]. A failure of the caller's own compares is an
//! ordinary [`Commit::Conflict`], not a lost term.
//!
//! Channels are noticed late (a task woken after a pause may run before it sees the role change),
//! so every side effect also asks [`Term::check`] synchronously right before it happens.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, TxnOpResponse, TxnResponse};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::lease::KeepaliveStats;
use super::LeaderInfo;
use crate::clock::BootInstant;
use crate::rolelog;
use crate::store::{self, Store, Write};

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("term {term} is over")]
    Deposed { term: i64 },
    #[error("fenced write in term {term} failed")]
    Store {
        term: i64,
        #[source]
        source: store::Error,
    },
}

/// What a fenced transaction did when the fence held.
#[derive(Debug)]
pub enum Commit {
    /// The caller's compares held and its operations were applied at `revision`.
    Applied {
        revision: i64,
        response: TxnResponse,
    },
    /// The caller's compares failed; nothing was written. The term goes on.
    Conflict(TxnResponse),
}

impl Commit {
    pub fn applied(&self) -> bool {
        matches!(self, Commit::Applied { .. })
    }
}

/// One term of leadership. Cheap to clone; all clones end together.
#[derive(Clone)]
pub struct Term(Arc<Inner>);

struct Inner {
    info: LeaderInfo,
    key: Vec<u8>,
    margin: Duration,
    valid_until: watch::Receiver<BootInstant>,
    keepalives: Arc<KeepaliveStats>,
    ended: CancellationToken,
    ended_once: AtomicBool,
    published: AtomicBool,
    work: TaskTracker,
    store: Store,
}

impl std::fmt::Debug for Term {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Term")
            .field("term", &self.0.info.term)
            .field("lease", &self.0.info.lease_id)
            .field("replica", &self.0.info.replica_id)
            .finish()
    }
}

impl Term {
    /// `lease_lost` ends the term too: the term's token is its child.
    pub(crate) fn new(
        info: LeaderInfo,
        key: Vec<u8>,
        margin: Duration,
        valid_until: watch::Receiver<BootInstant>,
        keepalives: Arc<KeepaliveStats>,
        lease_lost: &CancellationToken,
        store: Store,
    ) -> Term {
        Term(Arc::new(Inner {
            info,
            key,
            margin,
            valid_until,
            keepalives,
            ended: lease_lost.child_token(),
            ended_once: AtomicBool::new(false),
            published: AtomicBool::new(false),
            work: TaskTracker::new(),
            store,
        }))
    }

    /// The term number: the create revision of the election key. Only grows across terms.
    pub fn revision(&self) -> i64 {
        self.0.info.term
    }

    pub fn lease_id(&self) -> i64 {
        self.0.info.lease_id
    }

    pub fn info(&self) -> &LeaderInfo {
        &self.0.info
    }

    pub fn key(&self) -> &[u8] {
        &self.0.key
    }

    pub fn margin(&self) -> Duration {
        self.0.margin
    }

    /// The latest proven lease deadline.
    pub fn valid_until(&self) -> BootInstant {
        *self.0.valid_until.borrow()
    }

    /// Follows the proven lease deadline (what job guards are fed).
    pub fn deadlines(&self) -> watch::Receiver<BootInstant> {
        self.0.valid_until.clone()
    }

    /// True while the term has not ended and its lease is proven beyond the margin.
    pub fn is_valid(&self) -> bool {
        !self.0.ended.is_cancelled() && BootInstant::now() + self.0.margin < self.valid_until()
    }

    /// The synchronous guard before every side effect. A lease that is no longer proven ends
    /// the term here and then, so the term can never become valid again (one-way).
    pub fn check(&self) -> Result<(), FenceError> {
        if self.is_valid() {
            return Ok(());
        }
        if !self.has_ended() {
            self.end("lease not proven alive within the step-down margin");
        }
        Err(FenceError::Deposed {
            term: self.revision(),
        })
    }

    /// Marks the term as announced (its `became_leader` is logged); only a published term logs
    /// its step-down.
    pub(crate) fn publish(&self) {
        self.0.published.store(true, Ordering::SeqCst);
    }

    /// Resolves when the term has ended, for whatever reason.
    pub async fn ended(&self) {
        self.0.ended.cancelled().await
    }

    pub fn has_ended(&self) -> bool {
        self.0.ended.is_cancelled()
    }

    /// A token cancelled when the term ends, for tasks that take one.
    pub fn token(&self) -> CancellationToken {
        self.0.ended.clone()
    }

    /// Leader work of this term; the election waits for it (bounded) before it resigns.
    pub fn tracker(&self) -> &TaskTracker {
        &self.0.work
    }

    /// The fence compare: the election key exists with this term's create revision.
    pub fn fence(&self) -> Compare {
        Compare::create_revision(self.0.key.clone(), CompareOp::Equal, self.revision())
    }

    /// Commits `write` if the fence and its own compares hold, as a transaction of its own.
    /// See the module doc for the outcomes. After a timeout the write may or may not have
    /// committed: a retry is safe only if its compares make a second commit a no-op. (The
    /// leader's job writes go through the coordinator's group committer instead.)
    pub async fn commit(&self, write: Write) -> Result<Commit, FenceError> {
        self.check()?;
        let txn = write.into_fenced_txn(self.fence());
        let mut client = self.0.store.client();
        let resp = self
            .0
            .store
            .timed("fenced txn", client.txn(txn))
            .await
            .map_err(|source| FenceError::Store {
                term: self.revision(),
                source,
            })?;
        if !resp.succeeded() {
            return Err(self.fenced_out());
        }
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        match resp.op_responses().into_iter().next() {
            Some(TxnOpResponse::Txn(inner)) if inner.succeeded() => Ok(Commit::Applied {
                revision,
                response: inner,
            }),
            Some(TxnOpResponse::Txn(inner)) => Ok(Commit::Conflict(inner)),
            _ => Err(FenceError::Store {
                term: self.revision(),
                source: store::Error::Shared {
                    op: "fenced txn",
                    reason: "etcd answered a nested write with something else".into(),
                },
            }),
        }
    }

    /// The fence compare failed: the term is over for good.
    pub(crate) fn fenced_out(&self) -> FenceError {
        self.end("fence compare failed: the election key is gone or was replaced");
        FenceError::Deposed {
            term: self.revision(),
        }
    }

    /// The etcd handle the term writes through.
    pub(crate) fn store(&self) -> &Store {
        &self.0.store
    }

    /// Ends the term: one-way, idempotent, logged once with its reason. Returns whether this
    /// call was the one that ended it.
    pub fn end(&self, reason: &str) -> bool {
        if self.0.ended_once.swap(true, Ordering::SeqCst) {
            return false;
        }
        self.0.ended.cancel();
        if !self.0.published.load(Ordering::SeqCst) {
            return true;
        }
        let info = &self.0.info;
        let now = BootInstant::now();
        rolelog::stepped_down(
            &info.replica_id,
            info.term,
            info.lease_id,
            now,
            reason,
            self.0.keepalives.last_answered(),
            self.0.keepalives.longest_gap(now),
        );
        true
    }
}
