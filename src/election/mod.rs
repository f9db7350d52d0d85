//! Leader election on etcd's election API, published as a [`Role`] on one `watch` channel.
//!
//! Nothing here knows what a job is. The loop grants a lease, campaigns with it, confirms the
//! win, publishes [`Role::Leader`] with a fenced [`Term`], and on any end of that term publishes
//! [`Role::Follower`], waits (bounded) for the term's leader work, resigns, revokes the lease and
//! campaigns again with a **new** lease.
//!
//! A win is confirmed before it is published, because etcd-client's `campaign` can return for a
//! key that lease expiry already deleted: a fenced write of the leader record (the fence compares
//! the key's create revision) and a keepalive answered after the campaign returned must both
//! succeed.

pub mod history;
mod lease;
mod observer;
pub mod revoked;
mod term;

pub use lease::{proof, prove_once, Lease, Proof, Watchdog};
pub use observer::observe;
pub use term::{Commit, FenceError, Term};

use std::time::{Duration, SystemTime};

use etcd_client::{LeaderKey, ResignOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::clock::BootInstant;
use crate::metrics;
use crate::rolelog;
use crate::store::{self, Keys, Store, Write};

/// Who this replica is right now. Every leader task selects on changes of this value.
#[derive(Clone, Debug)]
pub enum Role {
    Follower,
    Leader(Term),
}

impl Role {
    pub fn term(&self) -> Option<&Term> {
        match self {
            Role::Leader(t) => Some(t),
            Role::Follower => None,
        }
    }
}

/// The value of an election key: who leads and where to reach it. Versioned JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateRecord {
    pub version: u32,
    pub replica_id: String,
    pub advertise: String,
    /// RFC 3339; set by the fenced write that confirms a win, absent while campaigning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elected_at: Option<String>,
}

pub const RECORD_VERSION: u32 = 1;

/// The leader as etcd sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderInfo {
    pub replica_id: String,
    pub advertise: String,
    pub term: i64,
    pub lease_id: i64,
    pub elected_at: Option<SystemTime>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no leader is elected right now")]
    NoLeader,
    #[error("the election key holds an unreadable record")]
    CorruptRecord(#[source] serde_json::Error),
    #[error(transparent)]
    Store(#[from] store::Error),
    #[error("this replica is not the leader")]
    NotLeader,
    #[error("term {requested} is not the current term {current}")]
    WrongTerm { requested: i64, current: i64 },
    #[error("campaign won for a key that no longer holds the election")]
    PhantomWin,
    #[error("the replica is shutting down")]
    ShuttingDown,
}

#[derive(Clone, Debug)]
pub struct ElectionConfig {
    pub replica_id: String,
    pub advertise: String,
    pub ttl: Duration,
    pub margin: Duration,
    /// How long to wait for a term's leader work to stop before resigning anyway.
    pub work_grace: Duration,
}

/// Requests to the election loop from the API.
pub enum Command {
    /// Step down from `term` (0: the current one) and campaign again.
    Resign {
        term: i64,
        reply: oneshot::Sender<Result<i64, Error>>,
    },
}

/// Reads who leads from etcd (any replica can answer).
pub async fn current_leader(store: &Store, keys: &Keys) -> Result<LeaderInfo, Error> {
    let mut c = store.client();
    let resp = match store
        .timed("election leader", c.leader(keys.election()))
        .await
    {
        Err(store::Error::Etcd { source, .. }) if store::is_no_leader(&source) => {
            return Err(Error::NoLeader)
        }
        r => r?,
    };
    let kv = resp.kv().ok_or(Error::NoLeader)?;
    let rec: CandidateRecord = serde_json::from_slice(kv.value()).map_err(Error::CorruptRecord)?;
    Ok(LeaderInfo {
        replica_id: rec.replica_id,
        advertise: rec.advertise,
        term: kv.create_revision(),
        lease_id: kv.lease(),
        elected_at: rec
            .elected_at
            .and_then(|t| humantime::parse_rfc3339(&t).ok()),
    })
}

/// The election loop of one replica. Returns after `shutdown` fires and any term it held has
/// been handed over (work stopped, resigned, lease revoked).
pub async fn run(
    store: Store,
    keys: Keys,
    config: ElectionConfig,
    role: watch::Sender<Role>,
    mut commands: mpsc::Receiver<Command>,
    shutdown: CancellationToken,
) {
    let mut retry = crate::retry::policies::ELECTION.backoff();
    while !shutdown.is_cancelled() {
        let lease = match Lease::grant(&store, config.ttl, config.margin, &config.replica_id).await
        {
            Ok(l) => {
                l.report_metrics("election");
                l
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot grant an election lease; retrying");
                pause(&mut retry, &shutdown).await;
                continue;
            }
        };
        let won = tokio::select! {
            won = campaign(&store, &keys, &config, &lease, &mut commands) => won,
            _ = lease.lost().cancelled() => {
                tracing::warn!(lease = lease.id(), "lease lost while campaigning; starting over with a new lease");
                Err(Error::PhantomWin)
            }
            _ = shutdown.cancelled() => Err(Error::ShuttingDown),
        };
        let key = match won {
            Ok(k) => k,
            Err(e) => {
                lease.revoke(&store).await;
                if !matches!(e, Error::ShuttingDown) {
                    tracing::warn!(error = %e, "campaign failed; retrying");
                    pause(&mut retry, &shutdown).await;
                }
                continue;
            }
        };
        let followed = history::newest(&store, &keys, config.ttl / 4).await;
        let term = match confirm(&store, &keys, &config, &lease, key, followed).await {
            Ok(t) if !shutdown.is_cancelled() && t.is_valid() => t,
            Ok(t) => {
                // Confirmed too late to use, or shutting down: hand the key back unannounced.
                t.end("not published");
                lease.revoke(&store).await;
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, lease = lease.id(), "campaign win not confirmed; campaigning again with a new lease");
                lease.revoke(&store).await;
                pause(&mut retry, &shutdown).await;
                continue;
            }
        };
        retry.reset();
        lease.bind(&term);
        term.publish();
        rolelog::became_leader(
            &config.replica_id,
            term.revision(),
            term.lease_id(),
            &String::from_utf8_lossy(term.key()),
            BootInstant::now(),
            term.valid_until(),
            config.margin,
        );
        let m = metrics::get();
        m.is_leader.set(1);
        m.term.set(term.revision());
        role.send_replace(Role::Leader(term.clone()));
        {
            let (t, s, k) = (term.clone(), store.clone(), keys.clone());
            term.tracker()
                .spawn(async move { history::trim(&t, &s, &k).await });
        }
        term.tracker()
            .spawn(revoked::watch_own_key(term.clone(), keys.clone()));
        let (reason, resign_reply) = hold(&term, &mut commands, &shutdown).await;
        if term.is_valid() {
            // Stepping down in order: the history says why, while the term still holds.
            history::record_end(
                &term,
                &keys,
                &term_record(&config, &term, followed),
                &reason,
            )
            .await;
        }
        term.end(&reason);
        m.is_leader.set(0);
        role.send_replace(Role::Follower);
        hand_over(&store, &config, &lease, &term).await;
        if let Some(reply) = resign_reply {
            let _ = reply.send(Ok(term.revision()));
        }
    }
}

/// Campaigns until this replica's key is the oldest. Answers commands meanwhile (as a follower).
async fn campaign(
    store: &Store,
    keys: &Keys,
    config: &ElectionConfig,
    lease: &Lease,
    commands: &mut mpsc::Receiver<Command>,
) -> Result<LeaderKey, Error> {
    let record = CandidateRecord {
        version: RECORD_VERSION,
        replica_id: config.replica_id.clone(),
        advertise: config.advertise.clone(),
        elected_at: None,
    };
    let value = serde_json::to_vec(&record).expect("a candidate record serializes");
    // A connection of its own per campaign: a campaign answer lost on a half-dead shared
    // connection would leave etcd naming a leader that does not know it leads.
    let mut client = Store::fresh_client(store.config()).await?;
    let campaign = client.campaign(keys.election(), value, lease.id());
    tokio::pin!(campaign);
    loop {
        tokio::select! {
            won = &mut campaign => {
                let mut won = won.map_err(store::Error::etcd("campaign"))?;
                return won.take_leader().ok_or(Error::PhantomWin);
            }
            Some(cmd) = commands.recv() => refuse(cmd, Error::NotLeader),
        }
    }
}

/// This term's history record.
fn term_record(config: &ElectionConfig, term: &Term, followed: i64) -> history::TermRecord {
    history::TermRecord {
        version: history::TERM_RECORD_VERSION,
        term: term.revision(),
        replica_id: config.replica_id.clone(),
        advertise: config.advertise.clone(),
        elected_at: term
            .info()
            .elected_at
            .map(|t| humantime::format_rfc3339_millis(t).to_string())
            .unwrap_or_default(),
        followed,
        ended: None,
    }
}

/// Turns a campaign win into a term, or refuses a phantom win ([`Error::PhantomWin`]). The
/// confirming write also records the term in the history (`followed`: the newest term the
/// history held before), with no compare on it.
pub async fn confirm(
    store: &Store,
    keys: &Keys,
    config: &ElectionConfig,
    lease: &Lease,
    key: LeaderKey,
    followed: i64,
) -> Result<Term, Error> {
    let elected_at = SystemTime::now();
    let info = LeaderInfo {
        replica_id: config.replica_id.clone(),
        advertise: config.advertise.clone(),
        term: key.rev(),
        lease_id: lease.id(),
        elected_at: Some(elected_at),
    };
    let term = Term::new(
        info,
        key.key().to_vec(),
        config.margin,
        lease.subscribe(),
        lease.keepalives(),
        lease.lost(),
        store.clone(),
    );
    let mut client = store.client();
    let per_call = lease.ttl() / 4;
    let proven = async {
        match tokio::time::timeout(per_call, prove_once(&mut client, lease.id(), lease.ttl())).await
        {
            Ok(r) => r.map_err(store::Error::etcd("keepalive")),
            Err(_) => Err(store::Error::Timeout {
                op: "keepalive",
                timeout: per_call,
            }),
        }
    };
    let record = CandidateRecord {
        version: RECORD_VERSION,
        replica_id: config.replica_id.clone(),
        advertise: config.advertise.clone(),
        elected_at: Some(humantime::format_rfc3339_millis(elected_at).to_string()),
    };
    let write = Write::new()
        .when_leased(key.key(), lease.id())
        .put_leased(
            key.key(),
            serde_json::to_vec(&record).expect("a candidate record serializes"),
            lease.id(),
        )
        .merge(history::record_put(
            keys,
            &term_record(config, &term, followed),
        ));
    let written = term.commit(write);
    let (proven, written) = tokio::join!(proven, written);
    match proven? {
        Some(p) => lease.record(p),
        None => return Err(Error::PhantomWin),
    }
    match written {
        Ok(c) if c.applied() => Ok(term),
        Ok(_) | Err(FenceError::Deposed { .. }) => Err(Error::PhantomWin),
        Err(FenceError::Store { source, .. }) => Err(source.into()),
    }
}

/// Serves the term until it ends; returns why, and the resign request to answer afterwards.
async fn hold(
    term: &Term,
    commands: &mut mpsc::Receiver<Command>,
    shutdown: &CancellationToken,
) -> (String, Option<oneshot::Sender<Result<i64, Error>>>) {
    // Its own deadline check too: the term ends on time even if the keeper thread died.
    let mut deadline = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = term.ended() => {
                let reason = if term.valid_until() <= BootInstant::now() + term.margin() {
                    "lease not proven alive within the step-down margin"
                } else {
                    "term ended"
                };
                return (reason.into(), None);
            }
            _ = deadline.tick() => {
                if term.check().is_err() {
                    continue;
                }
            }
            _ = shutdown.cancelled() => return ("shutdown".into(), None),
            Some(cmd) = commands.recv() => match cmd {
                Command::Resign { term: t, reply } if t == 0 || t == term.revision() => {
                    return ("resign requested".into(), Some(reply));
                }
                Command::Resign { term: t, reply } => {
                    let _ = reply.send(Err(Error::WrongTerm { requested: t, current: term.revision() }));
                }
            },
        }
    }
}

/// After a term ended: wait (bounded) for its work, resign, revoke. Best effort throughout:
/// etcd may be unreachable, and then the lease simply expires.
async fn hand_over(store: &Store, config: &ElectionConfig, lease: &Lease, term: &Term) {
    term.tracker().close();
    if tokio::time::timeout(config.work_grace, term.tracker().wait())
        .await
        .is_err()
    {
        tracing::warn!(
            term = term.revision(),
            "leader work did not stop within the grace period"
        );
    }
    lease.stop();
    let key = LeaderKey::new()
        .with_key(term.key())
        .with_rev(term.revision())
        .with_lease(lease.id());
    let mut c = store.client();
    let resign = c.resign(Some(ResignOptions::new().with_leader(key)));
    if let Err(e) = store.timed("resign", resign).await {
        tracing::debug!(error = %e, "resign failed; revoking the lease instead");
    }
    lease.revoke(store).await;
}

fn refuse(cmd: Command, err: Error) {
    match cmd {
        Command::Resign { reply, .. } => {
            let _ = reply.send(Err(err));
        }
    }
}

async fn pause(retry: &mut crate::retry::Backoff, shutdown: &CancellationToken) {
    let delay = retry.next_delay();
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = shutdown.cancelled() => {}
    }
}
