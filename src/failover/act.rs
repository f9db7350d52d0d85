//! Acting on evidence: revoke the lease the follower recorded when its stream opened, and no
//! other, in this order:
//! 1. One transaction creates `fast-failover/last` on a lease of the follower's own (one
//!    election TTL), and only if `last` is absent (one revoke per TTL per cluster, however
//!    many followers saw the same death), no false alarm is recorded, and the election key
//!    still has the recorded create revision and lease. Etcd evaluates those compares
//!    linearizably, so a leader that resigned, or one restarted in place that already won
//!    again (a new key), keeps its term.
//! 2. Only then the recorded lease is revoked. The dead process's leader writes were fenced by
//!    that key, so none lands after it; worker leases are never touched.

use std::time::SystemTime;

use super::probe::Evidence;
use super::{Config, Watched};
use crate::clock::BootInstant;
use crate::election::revoked::{FalseAlarm, LastRevoke, FALSE_ALARM_VERSION, LAST_REVOKE_VERSION};
use crate::metrics;
use crate::rolelog;
use crate::store::{codec, Keys, Store, Write};

/// What came of the evidence.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Revoked,
    /// A false alarm is recorded: no revoke for its 10 minutes.
    HeldBack,
    /// Another follower revoked within the TTL, or the key changed (resigned, expired, won
    /// again): nothing to do.
    NotNeeded,
}

pub async fn revoke(
    store: &Store,
    keys: &Keys,
    config: &Config,
    watched: &Watched,
    evidence: &Evidence,
) -> Result<Outcome, crate::store::Error> {
    let (incarnation, pid) = (&watched.incarnation, watched.pid);
    let mut c = store.client();
    let own = store
        .timed(
            "grant fast-failover lease",
            c.lease_grant(config.ttl.as_secs_f64().ceil().max(1.0) as i64, None),
        )
        .await?;
    let record = LastRevoke {
        version: LAST_REVOKE_VERSION,
        by: config.replica_id.clone(),
        leader: watched.replica_id.clone(),
        term: watched.term,
        lease: watched.lease,
        evidence: evidence.name().to_string(),
        incarnation: incarnation.clone(),
        pid,
        at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
    };
    let write = Write::new()
        .when_absent(keys.fast_failover_last())
        .when_absent(keys.fast_failover_false_alarm())
        .when_created(watched.key.clone(), watched.term)
        .when_leased(watched.key.clone(), watched.lease)
        .put_leased(keys.fast_failover_last(), codec::encode(&record), own.id())
        .or_get(keys.fast_failover_false_alarm())
        .or_get(keys.fast_failover_last());
    let resp = store
        .timed("claim fast-failover revoke", c.txn(write.into_txn()))
        .await?;
    if !resp.succeeded() {
        let _ = c.lease_revoke(own.id()).await;
        let mut got = resp.op_responses().into_iter().map(|r| match r {
            etcd_client::TxnOpResponse::Get(g) => g.kvs().first().cloned(),
            _ => None,
        });
        let alarm = got
            .next()
            .flatten()
            .map(|kv| codec::decode::<FalseAlarm>(kv.key(), kv.value(), FALSE_ALARM_VERSION));
        let claimed = got.next().flatten().and_then(|kv| {
            codec::decode::<LastRevoke>(kv.key(), kv.value(), LAST_REVOKE_VERSION).ok()
        });
        return Ok(match alarm {
            None if claimed.is_some_and(|l| (l.term, l.lease) == (watched.term, watched.lease)) => {
                // Another follower claimed this very death. Its revoke follows within a round
                // trip; if the key still holds the lease a while later, that follower crashed
                // or timed out, and revoking the same dead lease is harmless.
                tokio::time::sleep(super::PROBE_BOUND).await;
                if !still_holds(store, watched).await? {
                    return Ok(Outcome::NotNeeded);
                }
                revoke_lease(store, watched.lease).await?;
                gone(config, watched, evidence);
                Outcome::Revoked
            }
            Some(a) => {
                metrics::get().fast_failover_held_back.inc();
                tracing::warn!(
                    leader = %watched.replica_id,
                    term = watched.term,
                    evidence = evidence.name(),
                    false_alarm = ?a.ok(),
                    "evidence that the leader's process is gone, but a false alarm is recorded: not revoking (its lease expires as usual)"
                );
                Outcome::HeldBack
            }
            None => Outcome::NotNeeded,
        });
    }
    revoke_lease(store, watched.lease).await?;
    gone(config, watched, evidence);
    Ok(Outcome::Revoked)
}

/// Counts and logs a revoke on evidence (after it was made).
fn gone(config: &Config, watched: &Watched, evidence: &Evidence) {
    metrics::get().fast_failover_revokes.inc();
    rolelog::leader_process_gone(
        &config.replica_id,
        &watched.replica_id,
        watched.term,
        watched.lease,
        BootInstant::now(),
        evidence.name(),
        &watched.incarnation,
        watched.pid,
    );
}

/// Whether the election key still has the watched term's create revision and lease.
async fn still_holds(store: &Store, watched: &Watched) -> Result<bool, crate::store::Error> {
    let mut c = store.client();
    let resp = store
        .timed("read the election key", c.get(watched.key.clone(), None))
        .await?;
    Ok(resp
        .kvs()
        .first()
        .is_some_and(|kv| (kv.create_revision(), kv.lease()) == (watched.term, watched.lease)))
}

/// Revokes the dead leader's lease; one already gone is no error.
async fn revoke_lease(store: &Store, lease: i64) -> Result<(), crate::store::Error> {
    let mut c = store.client();
    store
        .timed("revoke the dead leader's lease", c.lease_revoke(lease))
        .await
        .map(|_| ())
        .or_else(|e| {
            if e.is_lease_not_found() {
                Ok(())
            } else {
                Err(e)
            }
        })
}
