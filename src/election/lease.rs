//! The election lease and the thread that keeps it alive.
//!
//! Guarantees:
//! - Keepalives go out on a fixed schedule (every TTL/3), each bounded by TTL/4, from a thread
//!   with its own single-threaded runtime, so no burst of other work can delay them.
//! - The proven deadline is `sent + ttl` of the latest answered keepalive, on `CLOCK_BOOTTIME`:
//!   etcd started its countdown after we sent, so it cannot expire the lease before then.
//! - After a timeout or an error the stream is dropped and the next keepalive goes over a fresh
//!   connection (a blackholed connection looks open forever).
//! - When `valid_until - margin` is reached without a renewal, or etcd says the lease is gone,
//!   [`Lease::lost`] is cancelled; it is never un-cancelled. A lost lease is never reused.
//! - With a key to hold ([`Lease::hold_key`], a worker's own key), a renewal proves nothing
//!   unless that key is read back, with its create revision, after the keepalive was sent: a
//!   key deleted while the lease lives (`etcdctl del`) stops the proofs, so the owner's guards
//!   stop being fed even if its watch never delivers the deletion.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::Term;
use crate::clock::BootInstant;
use crate::metrics::{self, LeaseReading};
use crate::rolelog;
use crate::store::{self, EtcdConfig, Store};

/// What the step-down records of a term's keepalives: when the last answered one was sent
/// (what the lease's validity rests on) and the longest gap between two answered ones, or
/// between the last one and the step-down. Counted from the start of the term.
#[derive(Debug)]
pub struct KeepaliveStats {
    last_answered_ns: AtomicU64,
    longest_gap_ns: AtomicU64,
}

impl KeepaliveStats {
    fn new(at: BootInstant) -> KeepaliveStats {
        KeepaliveStats {
            last_answered_ns: AtomicU64::new(at.as_nanos()),
            longest_gap_ns: AtomicU64::new(0),
        }
    }

    fn answered(&self, at: BootInstant) {
        let before = self
            .last_answered_ns
            .fetch_max(at.as_nanos(), Ordering::SeqCst);
        self.longest_gap_ns
            .fetch_max(at.as_nanos().saturating_sub(before), Ordering::SeqCst);
    }

    /// Starts counting gaps afresh (a term begins); the last answer stays.
    fn reset(&self) {
        self.longest_gap_ns.store(0, Ordering::SeqCst);
    }

    /// When the last answered keepalive was sent.
    pub fn last_answered(&self) -> BootInstant {
        BootInstant::from_nanos(self.last_answered_ns.load(Ordering::SeqCst))
    }

    /// The longest time without an answer, counting the time since the last one up to `now`.
    pub fn longest_gap(&self, now: BootInstant) -> Duration {
        let open = self.last_answered().until(now);
        Duration::from_nanos(self.longest_gap_ns.load(Ordering::SeqCst)).max(open)
    }
}

/// A granted lease, renewed in the background until [`Lease::stop`] or drop.
pub struct Lease {
    id: i64,
    ttl: Duration,
    margin: Duration,
    valid_until: Arc<watch::Sender<BootInstant>>,
    lost: CancellationToken,
    stop: CancellationToken,
    term: Arc<OnceLock<Term>>,
    replica: String,
    keepalives: Arc<KeepaliveStats>,
    watchdog: Arc<OnceLock<Watchdog>>,
    held: Arc<OnceLock<(String, i64)>>,
}

/// A deadline the lease's owner must keep meeting: when its main loop misses it, the keeper
/// stops renewing, so a hung process loses its lease instead of holding its work forever.
#[derive(Clone, Debug)]
pub struct Watchdog {
    last_ns: Arc<AtomicU64>,
    limit: Duration,
}

impl Watchdog {
    /// The owner's main loop is alive.
    pub fn pet(&self) {
        self.last_ns
            .store(BootInstant::now().as_nanos(), Ordering::SeqCst);
    }

    fn missed(&self, now: BootInstant) -> bool {
        BootInstant::from_nanos(self.last_ns.load(Ordering::SeqCst)) + self.limit < now
    }
}

/// Proof that etcd had the lease alive: it answered a keepalive sent at `sent`.
#[derive(Clone, Copy, Debug)]
pub struct Proof {
    pub sent: BootInstant,
    pub valid_until: BootInstant,
}

impl Lease {
    /// Grants a new lease and starts renewing it.
    pub async fn grant(
        store: &Store,
        ttl: Duration,
        margin: Duration,
        replica: &str,
    ) -> Result<Lease, store::Error> {
        let sent = BootInstant::now();
        let mut client = store.client();
        let granted = store
            .timed(
                "lease grant",
                client.lease_grant(ttl.as_secs() as i64, None),
            )
            .await?;
        let ttl = Duration::from_secs(granted.ttl().max(0) as u64);
        let (tx, _) = watch::channel(sent + ttl);
        let lease = Lease {
            id: granted.id(),
            ttl,
            margin,
            valid_until: Arc::new(tx),
            lost: CancellationToken::new(),
            stop: CancellationToken::new(),
            term: Arc::new(OnceLock::new()),
            replica: replica.to_owned(),
            keepalives: Arc::new(KeepaliveStats::new(BootInstant::now())),
            watchdog: Arc::new(OnceLock::new()),
            held: Arc::new(OnceLock::new()),
        };
        let keeper = Keeper {
            term: lease.term.clone(),
            store: store.clone(),
            id: lease.id,
            ttl,
            margin,
            replica: replica.to_owned(),
            valid_until: lease.valid_until.clone(),
            lost: lease.lost.clone(),
            stop: lease.stop.clone(),
            keepalives: lease.keepalives.clone(),
            watchdog: lease.watchdog.clone(),
            held: lease.held.clone(),
        };
        std::thread::Builder::new()
            .name(format!("lease-{:x}", lease.id))
            .spawn(move || keeper.run())
            .expect("spawning the lease keeper thread");
        Ok(lease)
    }

    pub fn id(&self) -> i64 {
        self.id
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub fn margin(&self) -> Duration {
        self.margin
    }

    /// The latest proven deadline.
    pub fn valid_until(&self) -> BootInstant {
        *self.valid_until.borrow()
    }

    /// Follows every newly proven deadline (later: fed to job guards).
    pub fn subscribe(&self) -> watch::Receiver<BootInstant> {
        self.valid_until.subscribe()
    }

    /// When keepalives were answered.
    pub fn keepalives(&self) -> Arc<KeepaliveStats> {
        self.keepalives.clone()
    }

    /// Cancelled once the lease can no longer be proven alive within the margin.
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Records a proof obtained elsewhere (the post-campaign check), logged like the keeper's.
    pub fn record(&self, proof: Proof) {
        self.keepalives.answered(proof.sent);
        if proof.valid_until > self.valid_until() {
            rolelog::lease_proven(&self.replica, self.id, proof.sent, proof.valid_until);
            self.valid_until
                .send_modify(|v| *v = (*v).max(proof.valid_until));
        }
    }

    /// Binds the term this lease carries: when the lease is lost, the keeper thread itself ends
    /// the term, so the step-down is logged on time even while the main runtime is stalled.
    pub fn bind(&self, term: &Term) {
        self.keepalives.reset();
        let _ = self.term.set(term.clone());
    }

    /// Arms a watchdog: unless [`Watchdog::pet`] is called at least every `limit`, the keeper
    /// stops renewing and the lease is lost.
    pub fn watchdog(&self, limit: Duration) -> Watchdog {
        let w = Watchdog {
            last_ns: Arc::new(AtomicU64::new(BootInstant::now().as_nanos())),
            limit,
        };
        let _ = self.watchdog.set(w.clone());
        self.watchdog.get().cloned().unwrap_or(w)
    }

    /// From now on a renewal proves the lease only if `key` is read back after it with this
    /// create revision (see the module doc); once the key is gone the lease is lost.
    pub fn hold_key(&self, key: String, create_rev: i64) {
        let _ = self.held.set((key, create_rev));
    }

    /// Reports this lease's keepalive age and margin to the metrics (as `kind`), until another
    /// lease of the same kind replaces it.
    pub fn report_metrics(&self, kind: &'static str) {
        let stats = self.keepalives.clone();
        let valid = self.valid_until.clone();
        let margin = self.margin.as_secs_f64();
        metrics::get().track_lease(kind, move || {
            let now = BootInstant::now();
            let until = *valid.borrow();
            let left = (until.as_nanos() as f64 - now.as_nanos() as f64) / 1e9;
            LeaseReading {
                since_answer: stats.last_answered().until(now),
                margin_left: left - margin,
            }
        });
    }

    /// Stops renewing. The lease then expires unless revoked first.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Stops renewing and revokes the lease, best effort: revocation deletes the election key at
    /// once, so a stale key does not hold up the next election for a TTL.
    pub async fn revoke(&self, store: &Store) {
        self.stop();
        let mut c = store.client();
        if let Err(e) = store.timed("lease revoke", c.lease_revoke(self.id)).await {
            if !e.is_lease_not_found() {
                tracing::warn!(lease = self.id, error = %e, "could not revoke lease; it will expire");
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Sends one keepalive on a new stream and waits for its answer. `Ok(None)`: the lease is gone.
pub async fn prove_once(
    client: &mut Client,
    id: i64,
    ttl: Duration,
) -> Result<Option<Proof>, etcd_client::Error> {
    let sent = BootInstant::now();
    match client.lease_keep_alive(id).await {
        // etcd-client reads the first answer itself and refuses ttl <= 0 as "lease not found";
        // a positive answer means etcd restarted the lease's full TTL after we sent.
        Ok(_) => Ok(proof(sent, ttl.as_secs() as i64)),
        Err(e) if store::is_lease_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The one rule for a proven deadline: counted from when the answered keepalive was **sent**
/// (etcd restarted its countdown after that), never from the answer's arrival; `None` when etcd
/// said the lease is gone (TTL 0). The protocol model calls it for its keepalives.
pub fn proof(sent: BootInstant, ttl_secs: i64) -> Option<Proof> {
    (ttl_secs > 0).then(|| Proof {
        sent,
        valid_until: sent + Duration::from_secs(ttl_secs as u64),
    })
}

const RETRY_AFTER_FAILURE: Duration = Duration::from_millis(50);

struct Keeper {
    term: Arc<OnceLock<Term>>,
    store: Store,
    id: i64,
    ttl: Duration,
    margin: Duration,
    replica: String,
    valid_until: Arc<watch::Sender<BootInstant>>,
    lost: CancellationToken,
    stop: CancellationToken,
    keepalives: Arc<KeepaliveStats>,
    watchdog: Arc<OnceLock<Watchdog>>,
    held: Arc<OnceLock<(String, i64)>>,
}

enum Renewal {
    Proven(Proof),
    Gone,
    /// The key the lease holds is gone (or another incarnation's).
    KeyGone,
}

/// One etcd connection of the keeper's own, and the keepalive stream on it.
struct Conn {
    client: Client,
    stream: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
}

type Attempt = Pin<Box<dyn Future<Output = (Option<Conn>, Result<Renewal, String>)> + Send>>;

/// One keepalive, bounded by `per_call`; on a new connection when `conn` is `None`. A failed
/// attempt returns no connection, so the next one opens a fresh one.
fn attempt(
    config: EtcdConfig,
    conn: Option<Conn>,
    id: i64,
    ttl: Duration,
    per_call: Duration,
    held: Option<(String, i64)>,
) -> Attempt {
    Box::pin(async move {
        let sent = BootInstant::now();
        let work = async {
            let mut conn = match conn {
                Some(c) => c,
                None => Conn {
                    client: Store::fresh_client(&config)
                        .await
                        .map_err(|e| e.to_string())?,
                    stream: None,
                },
            };
            let r = renew(&mut conn.client, &mut conn.stream, id, ttl, sent).await;
            let r = match (r, held) {
                (Ok(Renewal::Proven(p)), Some((key, rev))) => {
                    // Read after the keepalive was sent: the key lived past `sent`.
                    match conn.client.get(key, None).await {
                        Ok(got)
                            if got
                                .kvs()
                                .first()
                                .is_some_and(|kv| kv.create_revision() == rev) =>
                        {
                            Ok(Renewal::Proven(p))
                        }
                        Ok(_) => Ok(Renewal::KeyGone),
                        Err(e) => Err(e),
                    }
                }
                (r, _) => r,
            };
            Ok::<_, String>((conn, r))
        };
        match tokio::time::timeout(per_call, work).await {
            Ok(Ok((conn, Ok(r)))) => (Some(conn), Ok(r)),
            Ok(Ok((_, Err(e)))) => (None, Err(e.to_string())),
            Ok(Err(e)) => (None, Err(e)),
            Err(_) => (None, Err(format!("unanswered within {per_call:?}"))),
        }
    })
}

impl Keeper {
    fn run(self) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("building the lease keeper runtime");
        rt.block_on(self.keep());
    }

    /// The lease can no longer be proven: end the bound term (logging its step-down from this
    /// thread, which nothing can starve), then mark the lease lost.
    fn lose(&self, reason: &str) {
        if let Some(term) = self.term.get() {
            term.end(reason);
        }
        self.lost.cancel();
    }

    async fn keep(self) {
        let period = self.ttl / 3;
        let per_call = self.ttl / 4;
        let mut config = self.store.config().clone();
        if let Some(eps) = config.keepalive_endpoints.clone() {
            config.endpoints = eps;
        }
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
        // Polled, not slept until the deadline: tokio's clock stops while the host is suspended,
        // CLOCK_BOOTTIME does not.
        let mut watchdog = tokio::time::interval((self.margin / 4).min(Duration::from_millis(50)));
        watchdog.set_missed_tick_behavior(MissedTickBehavior::Skip);
        // Every connection of the keeper is opened here, on its own runtime: a client made on
        // the main runtime would have its I/O driven by the main runtime's workers.
        let mut conn: Option<Conn> = None;
        let mut inflight: Option<Attempt> = None;
        let mut retry: Option<Pin<Box<tokio::time::Sleep>>> = None;
        let mut retried = false;
        loop {
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = watchdog.tick() => {
                    if self.watchdog.get().is_some_and(|w| w.missed(BootInstant::now())) {
                        tracing::warn!(lease = self.id, "the owner's main loop missed its watchdog; letting the lease go");
                        self.lose("the main loop missed its watchdog deadline");
                        return;
                    }
                    if BootInstant::now() + self.margin >= *self.valid_until.borrow() {
                        tracing::warn!(lease = self.id, "lease not proven within the step-down margin");
                        self.lose("lease not proven alive within the step-down margin");
                        return;
                    }
                }
                (back, outcome) = async { inflight.as_mut().expect("guarded").await }, if inflight.is_some() => {
                    inflight = None;
                    conn = back;
                    match outcome {
                        Ok(Renewal::Proven(p)) => {
                            self.keepalives.answered(p.sent);
                            if p.valid_until > *self.valid_until.borrow() {
                                // Logged before it is used, so the log bounds what the term relied on.
                                rolelog::lease_proven(&self.replica, self.id, p.sent, p.valid_until);
                                self.valid_until.send_modify(|v| *v = (*v).max(p.valid_until));
                            }
                        }
                        Ok(Renewal::Gone) => {
                            tracing::warn!(lease = self.id, "etcd says the lease is gone");
                            self.lose("etcd says the lease is gone");
                            return;
                        }
                        Ok(Renewal::KeyGone) => {
                            tracing::warn!(lease = self.id, "the key this lease holds is gone");
                            self.lose("the key this lease holds is gone");
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(lease = self.id, error = %e, "keepalive failed; retrying on a fresh connection");
                            // Once per period, retry at once rather than waiting for the next tick.
                            if !retried {
                                retried = true;
                                retry = Some(Box::pin(tokio::time::sleep(RETRY_AFTER_FAILURE)));
                            }
                        }
                    }
                }
                _ = async { retry.as_mut().expect("guarded").await }, if retry.is_some() && inflight.is_none() => {
                    retry = None;
                    inflight = Some(attempt(config.clone(), conn.take(), self.id, self.ttl, per_call, self.held.get().cloned()));
                }
                _ = ticker.tick(), if inflight.is_none() => {
                    retried = false;
                    retry = None;
                    inflight = Some(attempt(config.clone(), conn.take(), self.id, self.ttl, per_call, self.held.get().cloned()));
                }
            }
        }
    }
}

async fn renew(
    client: &mut Client,
    stream: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    id: i64,
    ttl: Duration,
    sent: BootInstant,
) -> Result<Renewal, etcd_client::Error> {
    let Some((keeper, answers)) = stream else {
        // Opening the stream sends the first keepalive and reads its (positive) answer.
        return match client.lease_keep_alive(id).await {
            Ok(opened) => {
                *stream = Some(opened);
                Ok(proof(sent, ttl.as_secs() as i64).map_or(Renewal::Gone, Renewal::Proven))
            }
            Err(e) if store::is_lease_not_found(&e) => Ok(Renewal::Gone),
            Err(e) => Err(e),
        };
    };
    keeper.keep_alive().await?;
    match answers.message().await? {
        Some(answer) => Ok(proof(sent, answer.ttl()).map_or(Renewal::Gone, Renewal::Proven)),
        None => Err(etcd_client::Error::LeaseKeepAliveError(
            "keepalive stream closed".into(),
        )),
    }
}
