//! Fast failover, the follower's side: failover in milliseconds when the leader's process dies,
//! instead of when its lease expires.
//!
//! Why it is safe: every leader write is fenced by the election key, and jobs run under their
//! workers' own leases, so a replaced leader can do no harm; a false alarm costs a needless
//! leader change, which restarts nothing. Why false alarms stay rare and self-limiting:
//! - Each follower holds one stream to the leader (`WatchLeader`), dialled at the one socket
//!   address its advertise address resolves to. The leader's handshake must name the term and
//!   lease the follower read from etcd, the cluster, the replica, and its incarnation (drawn at
//!   process start); otherwise no stream is held.
//! - The stream's end is only a suspicion. Evidence ([`probe`]) is a refused connection at that
//!   exact socket, or another incarnation of the same replica answering there; anything else
//!   leaves the lease to expire as before.
//! - A revoke ([`act`]) names the recorded lease only, after etcd confirmed in one transaction
//!   that the key still holds it, at most once per TTL per cluster; a live leader that is
//!   revoked steps down at once and, when its term ends, records a false alarm that holds
//!   revokes back for 10 minutes ([`crate::election::revoked`]).

mod act;
mod probe;
pub mod target;

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::election::{CandidateRecord, Role};
use crate::metrics;
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::{Identity, WatchLeaderRequest};
use crate::retry::policies;
use crate::security::ClientSecurity;
use crate::store::{self, Keys, Store};
use probe::Finding;
use target::Target;

/// How long after the stream's end a finding still counts.
pub const PROBE_BOUND: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct Config {
    pub replica_id: String,
    /// The election TTL: how long one revoke holds the next back.
    pub ttl: Duration,
    pub peer: ClientSecurity,
}

/// The leader a follower watches: as etcd showed it when the stream opened, and as its
/// handshake named itself.
#[derive(Clone, Debug)]
pub struct Watched {
    pub key: Vec<u8>,
    pub term: i64,
    pub lease: i64,
    pub replica_id: String,
    pub cluster: String,
    pub target: Target,
    pub incarnation: String,
    pub pid: u32,
}

/// The election key's holder, read from etcd.
struct Holder {
    key: Vec<u8>,
    term: i64,
    lease: i64,
    record: CandidateRecord,
}

enum Held {
    /// The stream ended: a suspicion.
    Ended,
    /// This replica leads, the leader changed, or the replica stops.
    Moved,
}

/// Watches each leader while this replica follows, until `stop`.
pub async fn run(
    store: Store,
    keys: Keys,
    config: Config,
    mut role: watch::Receiver<Role>,
    stop: CancellationToken,
) {
    let mut retry = policies::LEADER_WATCH.backoff();
    let mut noted = 0;
    // Failed opens in a row for one term: a few are a leader still confirming its win.
    let mut refused = (0, 0);
    while !stop.is_cancelled() {
        if role.borrow().term().is_some() {
            tokio::select! {
                r = role.changed() => if r.is_err() { return },
                _ = stop.cancelled() => return,
            }
            continue;
        }
        let holder = match holder(&store, &keys).await {
            Ok(Some(h)) if h.record.replica_id != config.replica_id => h,
            _ => {
                pause(retry.next_delay(), &stop).await;
                continue;
            }
        };
        let target = match target::resolve(&holder.record.advertise).await {
            Ok(t) => t,
            Err(e) => {
                if noted != holder.term {
                    noted = holder.term;
                    inconclusive(e.reason());
                    tracing::warn!(term = holder.term, leader = %holder.record.replica_id, error = %e, "fast failover cannot watch this leader; its lease will expire as usual");
                }
                pause(config.ttl / 2, &stop).await;
                continue;
            }
        };
        let term = holder.term;
        let (watched, stream) = match open(&config, &keys, holder, target).await {
            Ok(w) => w,
            Err(why) => {
                // A leader between its win and its confirmation answers term 0 for a moment;
                // one that keeps refusing (TLS names, roles, an older release) is worth a look.
                refused = if refused.0 == term {
                    (term, refused.1 + 1)
                } else {
                    (term, 1)
                };
                if refused.1 == 5 {
                    inconclusive("no_stream");
                    tracing::warn!(term, %why, "no stream to the leader can be held: fast failover cannot watch it, its lease will expire as usual");
                }
                tracing::debug!(%why, "no stream to the leader held");
                pause(retry.next_delay(), &stop).await;
                continue;
            }
        };
        retry.reset();
        refused = (0, 0);
        tracing::info!(term = watched.term, leader = %watched.replica_id, incarnation = %watched.incarnation, "watching the leader");
        if let Held::Moved = hold(&store, &keys, &config, &watched, stream, &mut role, &stop).await
        {
            continue;
        }
        match probe::probe(&config.peer, &watched, PROBE_BOUND).await {
            Finding::Gone(evidence) => {
                match act::revoke(&store, &keys, &config, &watched, &evidence).await {
                    Ok(outcome) => {
                        tracing::info!(term = watched.term, leader = %watched.replica_id, evidence = evidence.name(), ?outcome, "the leader's process is gone")
                    }
                    Err(e) => {
                        tracing::warn!(term = watched.term, error = %e, "could not act on evidence; the lease expires as usual")
                    }
                }
            }
            Finding::Alive => {}
            Finding::Inconclusive(reason) => {
                inconclusive(reason);
                tracing::info!(term = watched.term, leader = %watched.replica_id, reason, "the stream to the leader ended without evidence; its lease decides");
            }
        }
    }
}

fn inconclusive(reason: &str) {
    metrics::get()
        .fast_failover_inconclusive
        .with_label_values(&[reason])
        .inc();
}

/// The election key that leads now, if any.
async fn holder(store: &Store, keys: &Keys) -> Result<Option<Holder>, store::Error> {
    let mut c = store.client();
    let resp = match store
        .timed("election leader", c.leader(keys.election()))
        .await
    {
        Err(store::Error::Etcd { source, .. }) if store::is_no_leader(&source) => return Ok(None),
        r => r?,
    };
    let Some(kv) = resp.kv() else { return Ok(None) };
    let Ok(record) = serde_json::from_slice::<CandidateRecord>(kv.value()) else {
        return Ok(None);
    };
    Ok(Some(Holder {
        key: kv.key().to_vec(),
        term: kv.create_revision(),
        lease: kv.lease(),
        record,
    }))
}

type Stream = tonic::Streaming<Identity>;

/// Opens the stream and checks the handshake against what etcd showed.
async fn open(
    config: &Config,
    keys: &Keys,
    holder: Holder,
    target: Target,
) -> Result<(Watched, Stream), String> {
    let opened = async {
        // Inside the bound: TLS has no handshake timeout of its own, and a stopped leader's
        // kernel still accepts the connection.
        let ch = config
            .peer
            .connect_exact(&target.host, target.addr, PROBE_BOUND)
            .await?;
        let mut stream = ClusterServiceClient::new(ch)
            .watch_leader(WatchLeaderRequest {})
            .await
            .map_err(|s| format!("WatchLeader: {s}"))?
            .into_inner();
        match stream.message().await {
            Ok(Some(id)) => Ok((id, stream)),
            Ok(None) => Err("the stream ended before the handshake".to_string()),
            Err(s) => Err(format!("WatchLeader: {s}")),
        }
    };
    let (id, stream) = tokio::time::timeout(PROBE_BOUND, opened)
        .await
        .map_err(|_| "no handshake in time".to_string())??;
    let expected = (
        keys.cluster(),
        holder.record.replica_id.as_str(),
        holder.term,
        holder.lease,
    );
    if (
        id.cluster.as_str(),
        id.replica_id.as_str(),
        id.term,
        id.lease_id,
    ) != expected
    {
        return Err(format!(
            "the handshake names {}/{} term {} lease {:x}, etcd {}/{} term {} lease {:x}",
            id.cluster,
            id.replica_id,
            id.term,
            id.lease_id,
            expected.0,
            expected.1,
            expected.2,
            expected.3
        ));
    }
    Ok((
        Watched {
            key: holder.key,
            term: holder.term,
            lease: holder.lease,
            replica_id: holder.record.replica_id,
            cluster: id.cluster,
            target,
            incarnation: id.incarnation,
            pid: id.pid,
        },
        stream,
    ))
}

/// Holds the stream until it ends, or until this replica leads, the leader changes (looked up
/// every half TTL, so a stream silently cut off is not held for a leader long gone) or `stop`.
async fn hold(
    store: &Store,
    keys: &Keys,
    config: &Config,
    watched: &Watched,
    mut stream: Stream,
    role: &mut watch::Receiver<Role>,
    stop: &CancellationToken,
) -> Held {
    let mut look = tokio::time::interval(config.ttl / 2);
    look.tick().await;
    loop {
        tokio::select! {
            // The stream first: on waking from a pause, its end is the suspicion to look into.
            biased;
            msg = stream.message() => match msg {
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return Held::Ended,
            },
            r = role.changed() => {
                if r.is_err() || role.borrow().term().is_some() {
                    return Held::Moved;
                }
            }
            _ = look.tick() => {
                if let Ok(h) = holder(store, keys).await {
                    if h.is_none_or(|h| h.term != watched.term) {
                        return Held::Moved;
                    }
                }
            }
            _ = stop.cancelled() => return Held::Moved,
        }
    }
}

async fn pause(delay: Duration, stop: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = stop.cancelled() => {}
    }
}
