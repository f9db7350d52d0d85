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

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::clock::BootInstant;
use crate::rolelog;
use crate::store::{self, Store};

/// A granted lease, renewed in the background until [`Lease::stop`] or drop.
pub struct Lease {
    id: i64,
    ttl: Duration,
    margin: Duration,
    valid_until: Arc<watch::Sender<BootInstant>>,
    lost: CancellationToken,
    stop: CancellationToken,
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
        };
        let keeper = Keeper {
            store: store.clone(),
            id: lease.id,
            ttl,
            margin,
            replica: replica.to_owned(),
            valid_until: lease.valid_until.clone(),
            lost: lease.lost.clone(),
            stop: lease.stop.clone(),
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

    /// Cancelled once the lease can no longer be proven alive within the margin.
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Records a proof obtained elsewhere (the post-campaign check).
    pub fn record(&self, proof: Proof) {
        self.valid_until.send_if_modified(|v| {
            let newer = proof.valid_until > *v;
            if newer {
                *v = proof.valid_until;
            }
            newer
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

fn proof(sent: BootInstant, ttl_secs: i64) -> Option<Proof> {
    (ttl_secs > 0).then(|| Proof {
        sent,
        valid_until: sent + Duration::from_secs(ttl_secs as u64),
    })
}

const RETRY_AFTER_ERROR: Duration = Duration::from_millis(100);

struct Keeper {
    store: Store,
    id: i64,
    ttl: Duration,
    margin: Duration,
    replica: String,
    valid_until: Arc<watch::Sender<BootInstant>>,
    lost: CancellationToken,
    stop: CancellationToken,
}

enum Renewal {
    Proven(Proof),
    Gone,
}

impl Keeper {
    fn run(self) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("building the lease keeper runtime");
        rt.block_on(self.keep());
    }

    async fn keep(self) {
        let period = self.ttl / 3;
        let per_call = self.ttl / 4;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
        // Polled, not slept until the deadline: tokio's clock stops while the host is suspended,
        // CLOCK_BOOTTIME does not.
        let mut watchdog = tokio::time::interval((self.margin / 4).min(Duration::from_millis(50)));
        watchdog.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let mut client = self.store.client();
        let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
        let mut fresh = false;
        loop {
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = watchdog.tick() => {
                    if BootInstant::now() + self.margin >= *self.valid_until.borrow() {
                        tracing::warn!(lease = self.id, "lease not proven within the step-down margin");
                        self.lost.cancel();
                        return;
                    }
                }
                _ = ticker.tick() => {
                    if fresh {
                        match tokio::time::timeout(per_call, Store::fresh_client(self.store.config())).await {
                            Ok(Ok(c)) => { client = c; fresh = false; }
                            Ok(Err(e)) => { tracing::warn!(lease = self.id, error = %e, "reconnect for keepalive failed"); continue; }
                            Err(_) => { tracing::warn!(lease = self.id, "reconnect for keepalive timed out"); continue; }
                        }
                    }
                    let sent = BootInstant::now();
                    let attempt = renew(&mut client, &mut stream, self.id, self.ttl, sent);
                    match tokio::time::timeout(per_call, attempt).await {
                        Ok(Ok(Renewal::Proven(p))) => {
                            let newer = self.valid_until.send_if_modified(|v| {
                                let newer = p.valid_until > *v;
                                if newer { *v = p.valid_until; }
                                newer
                            });
                            if newer {
                                rolelog::lease_proven(&self.replica, self.id, p.sent, p.valid_until);
                            }
                        }
                        Ok(Ok(Renewal::Gone)) => {
                            tracing::warn!(lease = self.id, "etcd says the lease is gone");
                            self.lost.cancel();
                            return;
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(lease = self.id, error = %e, "keepalive failed; retrying on a fresh connection");
                            stream = None;
                            fresh = true;
                            // An error (unlike a timeout) arrives early: retry at once instead
                            // of losing a whole period.
                            ticker.reset_after(RETRY_AFTER_ERROR);
                        }
                        Err(_) => {
                            tracing::warn!(lease = self.id, timeout = ?per_call, "keepalive unanswered; next one on a fresh connection");
                            stream = None;
                            fresh = true;
                        }
                    }
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
