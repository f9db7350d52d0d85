//! The leader's side of fast failover: a leader learns at once that its election key was
//! deleted (a follower revoked its lease on what it took for evidence, or an operator did), and
//! steps down then, not at its next keepalive. If a follower's revoke hit this live leader, it
//! records a false alarm that holds every follower's revokes back for 10 minutes, so a proxy
//! that refuses connections to a live leader costs one needless term, not one per TTL.
//!
//! What stays: between the deletion and this watch's event (milliseconds on a healthy host, up
//! to the step-down margin on a stalled one, when the lease keeper ends the term anyway), the
//! stale leader still answers what it answers from memory (`Identify`, the role it reports);
//! every write it tries fails on the fence, and no job stops.

use std::time::{Duration, SystemTime};

use etcd_client::{EventType, WatchOptions};
use serde::{Deserialize, Serialize};

use super::Term;
use crate::metrics;
use crate::retry::policies;
use crate::store::{codec, Keys, Store};

/// How long a false alarm holds revokes back.
pub const FALSE_ALARM_HOLD: Duration = Duration::from_secs(600);

/// `fast-failover/last`: the newest revoke on evidence (on its follower's lease of one TTL).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastRevoke {
    pub version: u32,
    /// The follower that revoked.
    pub by: String,
    pub leader: String,
    pub term: i64,
    pub lease: i64,
    /// `refused` or `restarted`.
    pub evidence: String,
    /// The process the follower watched.
    pub incarnation: String,
    pub pid: u32,
    /// RFC 3339.
    pub at: String,
}

pub const LAST_REVOKE_VERSION: u32 = 1;

/// `fast-failover/false-alarm`: a revoke on evidence hit a live leader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FalseAlarm {
    pub version: u32,
    /// The leader that was revoked while alive, and the term it lost.
    pub replica_id: String,
    pub term: i64,
    pub incarnation: String,
    /// The follower that revoked it, and on what.
    pub revoked_by: String,
    pub evidence: String,
    /// RFC 3339.
    pub at: String,
}

pub const FALSE_ALARM_VERSION: u32 = 1;

/// Ends `term` when its election key is deleted or replaced (reason `lease revoked`). Runs in
/// the term's tracker until the term ends, for whatever reason (a fenced write or the lease
/// keeper may notice the loss first); then, if `fast-failover/last` names this term, a follower
/// revoked this live process, and it records the false alarm.
pub async fn watch_own_key(term: Term, keys: Keys) {
    let store = term.store().clone();
    let mut retry = policies::RESYNC.backoff();
    loop {
        tokio::select! {
            gone = deleted(&store, &term) => match gone {
                Ok(()) => {
                    term.end("lease revoked");
                    break;
                }
                Err(e) => {
                    tracing::debug!(term = term.revision(), error = %e, "watch on the own election key failed; watching again");
                    let delay = retry.next_delay();
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => continue,
                        _ = term.ended() => break,
                    }
                }
            },
            _ = term.ended() => break,
        }
    }
    record_false_alarm(&store, &keys, &term).await;
}

/// Resolves once the term's key is gone or holds another term; `Err` when the watch failed.
async fn deleted(store: &Store, term: &Term) -> Result<(), crate::store::Error> {
    let mut c = store.client();
    let resp = store
        .timed("read own election key", c.get(term.key(), None))
        .await?;
    if resp
        .kvs()
        .first()
        .is_none_or(|kv| kv.create_revision() != term.revision())
    {
        return Ok(());
    }
    let from = resp.header().map_or(0, |h| h.revision()) + 1;
    let watch = c.watch(
        term.key(),
        Some(WatchOptions::new().with_start_revision(from)),
    );
    let mut stream = store.timed("watch own election key", watch).await?;
    loop {
        match stream.message().await {
            Ok(Some(resp)) if resp.canceled() => {
                return Err(ended("cancelled by etcd"));
            }
            Ok(Some(resp)) => {
                if resp
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete)
                {
                    return Ok(());
                }
            }
            Ok(None) => return Err(ended("ended")),
            Err(e) => return Err(crate::store::Error::etcd("watch own election key")(e)),
        }
    }
}

fn ended(how: &str) -> crate::store::Error {
    crate::store::Error::Shared {
        op: "watch own election key",
        reason: how.to_string(),
    }
}

/// If a follower's revoke on evidence ended this live term, holds revokes back for
/// [`FALSE_ALARM_HOLD`]. Best effort: etcd may be what failed.
async fn record_false_alarm(store: &Store, keys: &Keys, term: &Term) {
    let mut c = store.client();
    // Bounded by the margin: the hand-over waits for this task before it resigns.
    let read = tokio::time::timeout(
        term.margin(),
        store.timed("read last revoke", c.get(keys.fast_failover_last(), None)),
    );
    let last = match read.await.unwrap_or(Err(crate::store::Error::Timeout {
        op: "read last revoke",
        timeout: term.margin(),
    })) {
        Ok(r) => r.kvs().first().and_then(|kv| {
            codec::decode::<LastRevoke>(kv.key(), kv.value(), LAST_REVOKE_VERSION).ok()
        }),
        Err(e) => {
            tracing::debug!(term = term.revision(), error = %e, "cannot tell whether a revoke on evidence ended this term");
            None
        }
    };
    let Some(last) = last.filter(|l| l.term == term.revision()) else {
        return;
    };
    let alarm = FalseAlarm {
        version: FALSE_ALARM_VERSION,
        replica_id: term.info().replica_id.clone(),
        term: term.revision(),
        incarnation: crate::incarnation().to_string(),
        revoked_by: last.by.clone(),
        evidence: last.evidence.clone(),
        at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
    };
    let written = async {
        let lease = store
            .timed(
                "grant false-alarm lease",
                c.lease_grant(FALSE_ALARM_HOLD.as_secs() as i64, None),
            )
            .await?;
        store
            .timed(
                "record false alarm",
                c.put(
                    keys.fast_failover_false_alarm(),
                    codec::encode(&alarm),
                    Some(etcd_client::PutOptions::new().with_lease(lease.id())),
                ),
            )
            .await
    };
    match written.await {
        Ok(_) => {
            metrics::get().fast_failover_false_alarms.inc();
            tracing::error!(
                target: crate::rolelog::TARGET,
                event = "false_alarm",
                replica = %alarm.replica_id,
                term = alarm.term,
                lease = term.lease_id(),
                boottime_ns = crate::clock::BootInstant::now().as_nanos(),
                revoked_by = %alarm.revoked_by,
                evidence = %alarm.evidence,
                "a follower revoked this live leader's lease on false evidence; fast failover is held back for 10 minutes"
            );
        }
        Err(e) => {
            tracing::warn!(term = term.revision(), error = %e, "could not record the false alarm")
        }
    }
}
