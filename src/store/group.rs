//! Group commit: independent [`Write`]s that arrive together share one etcd transaction, each
//! nested with its own compares, so etcd commits many for the price of one round trip and one
//! raft entry.
//!
//! Guarantees:
//! - Each write keeps its own outcome: its compares decide whether *it* applies; a write whose
//!   compares fail never fails its batch-mates.
//! - Writes whose footprints meet (one changes a key another changes or compares) never share a
//!   transaction; the later one goes in a later batch (which may be in flight beside the
//!   first: no order is kept between concurrent writes). etcd evaluates every nested compare
//!   before applying anything, so writes that share a transaction must not see each other.
//!   Reads (`get`) are not part of a footprint: a read may see a batch-mate's write.
//! - A batch stays within etcd's limits: [`Limits::max_ops`] (etcd's `--max-txn-ops`, 128 by
//!   default, bounds the nested writes *plus* the most operations of any one of them: a nested
//!   transaction gets what its parent level left) and about [`Limits::max_bytes`] of keys and
//!   values (its default request limit is 1.5 MiB). A batch etcd still refuses as malformed is
//!   committed again write by write, so one oversized write fails alone.
//! - With a fence, the batch applies only while the fence holds; otherwise nothing of it does
//!   and every write answers [`Outcome::Fenced`].
//! - Nobody waits for company: a write that arrives while nothing is in flight is sent at once.
//!   Batches form from what queues while earlier ones are in flight, plus an optional linger
//!   ([`Limits::linger`]) only while others are in flight. The default is none: a 1 ms linger
//!   was measured (`baton bench`) and cost more latency at 16 clients than it gained at 64.
//! - After a timeout a write may or may not have committed, exactly as a single transaction:
//!   every write of that batch gets the error, and a retry is safe only if its compares make a
//!   second commit a no-op.

use std::collections::VecDeque;
use std::time::Duration;

use etcd_client::{Compare, KvClient, Txn, TxnOp, TxnOpResponse, TxnResponse};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};

use super::write::Footprints;
use super::{Error, Store, Write};

/// What happened to one write.
#[derive(Debug)]
pub enum Outcome {
    /// Its compares held and its operations were applied at `revision`.
    Applied {
        revision: i64,
        response: TxnResponse,
    },
    /// Its compares failed; nothing of it was written; `response` holds its `or_get` answers,
    /// read at `revision`.
    Conflict {
        revision: i64,
        response: TxnResponse,
    },
    /// The fence failed: nothing of the batch was written.
    Fenced,
}

/// Bounds of one batch.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Nested writes plus the largest branch of any of them.
    pub max_ops: usize,
    pub max_bytes: usize,
    pub linger: Duration,
    /// Batches in flight at once.
    pub in_flight: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_ops: 128,
            max_bytes: 1024 * 1024,
            linger: Duration::ZERO,
            in_flight: 4,
        }
    }
}

/// Answers can hold many writes' reads: allow more than the client's default 4 MiB.
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

struct Pending {
    write: Write,
    reply: oneshot::Sender<Result<Outcome, Error>>,
}

/// The condition every batch of a fenced committer is written under.
pub struct Fence {
    /// Compared in every transaction.
    pub compare: Compare,
    /// Asked right before each batch is sent (a batch may wait in the queue): `false` answers
    /// every write of it [`Outcome::Fenced`] without sending anything.
    pub valid: Box<dyn Fn() -> bool + Send + Sync>,
}

/// A handle on one group committer. Cheap to clone.
#[derive(Clone)]
pub struct GroupCommit {
    tx: mpsc::Sender<Pending>,
}

impl GroupCommit {
    /// A committer and the future that runs it, for the caller to spawn where its lifetime
    /// belongs. The future ends once every handle is gone and what was queued is answered;
    /// dropping it earlier answers queued writes with [`Error::Stopped`]. `op` names its
    /// transactions in metrics and errors.
    pub fn new(
        store: Store,
        fence: Option<Fence>,
        op: &'static str,
        limits: Limits,
    ) -> (
        GroupCommit,
        impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let (tx, rx) = mpsc::channel(4096);
        let committer = Committer {
            kv: store
                .client()
                .kv_client()
                .max_decoding_message_size(MAX_ANSWER_BYTES),
            store,
            fence,
            op,
            limits,
        };
        (GroupCommit { tx }, async move { committer.run(rx).await })
    }

    /// Commits `write`, alone or with others.
    pub async fn commit(&self, write: Write) -> Result<Outcome, Error> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Pending { write, reply })
            .await
            .map_err(|_| Error::Stopped)?;
        answer.await.map_err(|_| Error::Stopped)?
    }
}

struct Committer {
    store: Store,
    kv: KvClient,
    fence: Option<Fence>,
    op: &'static str,
    limits: Limits,
}

/// Writes gathered for one transaction.
struct Batch {
    items: Vec<Pending>,
    footprints: Footprints,
    bytes: usize,
    /// The most operations of any branch of any write in.
    widest: usize,
}

impl Batch {
    fn new(first: Pending) -> Batch {
        let mut footprints = Footprints::default();
        footprints.add(&first.write);
        Batch {
            bytes: first.write.bytes(),
            widest: first.write.ops(),
            items: vec![first],
            footprints,
        }
    }

    fn full(&self, limits: &Limits) -> bool {
        self.items.len() + self.widest >= limits.max_ops || self.bytes >= limits.max_bytes
    }

    /// Whether `p` may join: room left and a footprint apart from everyone already in.
    fn admits(&self, p: &Pending, limits: &Limits) -> bool {
        self.items.len() + 1 + self.widest.max(p.write.ops()) <= limits.max_ops
            && self.bytes + p.write.bytes() <= limits.max_bytes
            && !self
                .footprints
                .meets(&p.write, self.items.iter().map(|q| &q.write))
    }

    fn add(&mut self, p: Pending) {
        self.footprints.add(&p.write);
        self.bytes += p.write.bytes();
        self.widest = self.widest.max(p.write.ops());
        self.items.push(p);
    }
}

/// Writes passed over for a batch, in arrival order.
#[derive(Default)]
struct Passed {
    items: VecDeque<Pending>,
    footprints: Footprints,
}

impl Committer {
    async fn run(&self, mut rx: mpsc::Receiver<Pending>) {
        // Writes passed over for a conflict or for room, in arrival order: they go first next.
        let mut held: VecDeque<Pending> = VecDeque::new();
        let mut in_flight = FuturesUnordered::new();
        let mut open = true;
        loop {
            while in_flight.len() >= self.limits.in_flight.max(1) {
                in_flight.next().await;
            }
            let first = match held.pop_front() {
                Some(p) => p,
                None if !open => break,
                None => tokio::select! {
                    p = rx.recv() => match p {
                        Some(p) => p,
                        None => { open = false; continue; }
                    },
                    Some(()) = in_flight.next(), if !in_flight.is_empty() => continue,
                },
            };
            let mut batch = Batch::new(first);
            let mut passed = Passed::default();
            let offer = |p: Pending, batch: &mut Batch, passed: &mut Passed| {
                // A write behind one passed over that it conflicts with keeps its order.
                if batch.admits(&p, &self.limits)
                    && !passed
                        .footprints
                        .meets(&p.write, passed.items.iter().map(|q| &q.write))
                {
                    batch.add(p);
                } else {
                    passed.footprints.add(&p.write);
                    passed.items.push_back(p);
                }
            };
            while let Some(p) = held.pop_front() {
                offer(p, &mut batch, &mut passed);
            }
            while !batch.full(&self.limits) {
                match rx.try_recv() {
                    Ok(p) => offer(p, &mut batch, &mut passed),
                    Err(_) => break,
                }
            }
            if !in_flight.is_empty() && open {
                let until = tokio::time::Instant::now() + self.limits.linger;
                while !batch.full(&self.limits) {
                    tokio::select! {
                        p = rx.recv() => match p {
                            Some(p) => offer(p, &mut batch, &mut passed),
                            None => { open = false; break; }
                        },
                        _ = tokio::time::sleep_until(until) => break,
                    }
                }
            }
            held = passed.items;
            in_flight.push(self.commit(batch.items));
        }
        while in_flight.next().await.is_some() {}
    }

    async fn commit(&self, items: Vec<Pending>) {
        crate::metrics::get().group_commit(self.op, items.len());
        let (writes, replies): (Vec<Write>, Vec<_>) =
            items.into_iter().map(|p| (p.write, p.reply)).unzip();
        let single = writes.len() == 1;
        // A batch's writes are kept in case etcd refuses it as a whole and each must go alone:
        // the request gets copies of their operations only.
        let (copies, sent) = if single {
            (None, self.send(writes).await)
        } else {
            let nested = writes.iter().map(|w| TxnOp::txn(w.to_txn())).collect();
            (Some(writes), self.send_nested(nested).await)
        };
        match sent {
            Ok(outcomes) => {
                for (reply, o) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(Ok(o));
                }
            }
            Err(e) if e.is_malformed_request() && !single => {
                let alone = copies.unwrap_or_default().into_iter().map(|w| async move {
                    let mut answer = self.send(vec![w]).await?;
                    answer.pop().ok_or(Error::Shared {
                        op: self.op,
                        reason: "etcd answered no nested write".into(),
                    })
                });
                // No more at once than batches would be.
                let answers: Vec<_> = futures_util::stream::iter(alone)
                    .buffered(self.limits.in_flight.max(1))
                    .collect()
                    .await;
                for (reply, a) in replies.into_iter().zip(answers) {
                    let _ = reply.send(a);
                }
            }
            Err(e) => {
                let shared = e.to_string();
                for reply in replies {
                    let _ = reply.send(Err(e.shared(&shared)));
                }
            }
        }
    }

    /// One transaction for `writes`; one outcome per write, in order.
    async fn send(&self, writes: Vec<Write>) -> Result<Vec<Outcome>, Error> {
        let nested = writes
            .into_iter()
            .map(|w| TxnOp::txn(w.into_txn()))
            .collect();
        self.send_nested(nested).await
    }

    /// One transaction of these nested writes; one outcome per write, in order.
    async fn send_nested(&self, nested: Vec<TxnOp>) -> Result<Vec<Outcome>, Error> {
        let n = nested.len();
        let mut txn = Txn::new();
        if let Some(f) = &self.fence {
            if !(f.valid)() {
                return Ok((0..n).map(|_| Outcome::Fenced).collect());
            }
            txn = txn.when([f.compare.clone()]);
        }
        let txn = txn.and_then(nested);
        let mut kv = self.kv.clone();
        let resp = self.store.timed(self.op, kv.txn(txn)).await?;
        if !resp.succeeded() {
            return Ok((0..n).map(|_| Outcome::Fenced).collect());
        }
        let revision = resp.header().map_or(0, |h| h.revision());
        let answers = resp.op_responses();
        if answers.len() != n {
            return Err(Error::Shared {
                op: self.op,
                reason: format!("etcd answered {} of {n} nested writes", answers.len()),
            });
        }
        answers
            .into_iter()
            .map(|a| match a {
                TxnOpResponse::Txn(inner) if inner.succeeded() => Ok(Outcome::Applied {
                    revision,
                    response: inner,
                }),
                TxnOpResponse::Txn(inner) => Ok(Outcome::Conflict {
                    revision,
                    response: inner,
                }),
                _ => Err(Error::Shared {
                    op: self.op,
                    reason: "etcd answered a nested write with something else".into(),
                }),
            })
            .collect()
    }
}
