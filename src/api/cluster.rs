//! `baton.v1.ClusterService`: who leads, and planned handover.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tonic::{Request, Response, Status};

use crate::election::{self, Command, LeaderInfo, Role};
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::{self, cluster_service_server::ClusterService};
use crate::security::ClientSecurity;
use crate::store::{Keys, Store};

/// Marks a call one replica forwarded to the leader: the leader answers it itself or refuses,
/// never forwards it again.
const FORWARDED: &str = "x-baton-forwarded-by";

#[derive(Clone)]
pub struct ClusterApi {
    store: Store,
    keys: Keys,
    replica_id: String,
    role: watch::Receiver<Role>,
    commands: mpsc::Sender<Command>,
    /// How this replica calls the leader to forward what only the leader can do.
    peer: ClientSecurity,
}

impl ClusterApi {
    pub fn new(
        store: Store,
        keys: Keys,
        replica_id: String,
        role: watch::Receiver<Role>,
        commands: mpsc::Sender<Command>,
        peer: ClientSecurity,
    ) -> Self {
        Self {
            store,
            keys,
            replica_id,
            role,
            commands,
            peer,
        }
    }

    /// Asks the current leader to resign `term`, with this replica's peer credentials (the
    /// caller was authenticated here). One hop: the leader does not forward again.
    async fn forward_resign(
        &self,
        term: i64,
        caller: &str,
    ) -> Result<proto::ResignLeadershipResponse, Status> {
        let leader = election::current_leader(&self.store, &self.keys).await?;
        if leader.replica_id == self.replica_id {
            // etcd names this replica, which has not confirmed its term yet (or is stepping
            // down): calling itself would only come back here.
            return Err(Status::unavailable(
                "this replica is between terms; retry shortly",
            ));
        }
        let ch = self
            .peer
            .connect(
                &leader.advertise,
                Duration::from_secs(2),
                Duration::from_secs(35),
            )
            .await
            .map_err(Status::unavailable)?;
        let mut req = Request::new(proto::ResignLeadershipRequest { term });
        // A replica id is a validated name, so always a valid header value.
        let by = self
            .replica_id
            .parse()
            .map_err(|_| Status::internal("a replica id that is not a header value"))?;
        req.metadata_mut().insert(FORWARDED, by);
        tracing::info!(target: "baton::audit", action = "resign-forward", caller = %caller, replica = %self.replica_id, leader = %leader.replica_id, "resignation forwarded to the leader");
        let resp = ClusterServiceClient::new(ch)
            .resign_leadership(req)
            .await
            .map_err(|s| {
                Status::new(
                    s.code(),
                    format!("the leader {} answered: {}", leader.replica_id, s.message()),
                )
            })?;
        Ok(resp.into_inner())
    }
}

type IdentityStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<proto::Identity, Status>> + Send>>;

impl ClusterApi {
    /// Which process answers, and the term it leads (0 while it follows).
    fn identity(&self, term: Option<&election::Term>) -> proto::Identity {
        proto::Identity {
            cluster: self.keys.cluster().to_string(),
            replica_id: self.replica_id.clone(),
            incarnation: crate::incarnation().to_string(),
            term: term.map_or(0, |t| t.revision()),
            lease_id: term.map_or(0, |t| t.lease_id()),
            pid: std::process::id(),
        }
    }
}

pub fn leader_to_proto(l: &LeaderInfo) -> proto::LeaderInfo {
    proto::LeaderInfo {
        replica_id: l.replica_id.clone(),
        advertise: l.advertise.clone(),
        term: l.term,
        elected_at: l
            .elected_at
            .map(|t| pbjson_types::Timestamp::from(chrono::DateTime::<chrono::Utc>::from(t))),
        lease_id: l.lease_id,
    }
}

#[tonic::async_trait]
impl ClusterService for ClusterApi {
    async fn identify(
        &self,
        _req: Request<proto::IdentifyRequest>,
    ) -> Result<Response<proto::Identity>, Status> {
        let term = self.role.borrow().term().cloned();
        Ok(Response::new(self.identity(term.as_ref())))
    }

    type WatchLeaderStream = IdentityStream;

    async fn watch_leader(
        &self,
        _req: Request<proto::WatchLeaderRequest>,
    ) -> Result<Response<IdentityStream>, Status> {
        let term = self.role.borrow().term().cloned();
        let (tx, rx) = mpsc::channel(1);
        let _ = tx.try_send(Ok(self.identity(term.as_ref())));
        if let Some(term) = term {
            // Held while the term lasts (or the watcher goes): its end tells followers to look.
            tokio::spawn(async move {
                tokio::select! {
                    _ = term.ended() => {}
                    _ = tx.closed() => {}
                }
            });
        }
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_leader_history(
        &self,
        req: Request<proto::GetLeaderHistoryRequest>,
    ) -> Result<Response<proto::GetLeaderHistoryResponse>, Status> {
        let limit = match req.into_inner().limit {
            0 => 100,
            n if n > 1000 => return Err(Status::invalid_argument("limit: at most 1000")),
            n => n as usize,
        };
        let terms = election::history::read(&self.store, &self.keys, limit)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(proto::GetLeaderHistoryResponse {
            terms: terms
                .into_iter()
                .map(|t| proto::TermInfo {
                    term: t.term,
                    replica_id: t.replica_id,
                    advertise: t.advertise,
                    elected_at: t.elected_at,
                    followed: t.followed,
                    ended_reason: t
                        .ended
                        .as_ref()
                        .map(|e| e.reason.clone())
                        .unwrap_or_default(),
                    ended_at: t.ended.map(|e| e.at).unwrap_or_default(),
                })
                .collect(),
        }))
    }

    async fn get_leader(
        &self,
        _req: Request<proto::GetLeaderRequest>,
    ) -> Result<Response<proto::GetLeaderResponse>, Status> {
        let leader = election::current_leader(&self.store, &self.keys).await?;
        let mine = self.role.borrow().term().map(|t| t.revision());
        Ok(Response::new(proto::GetLeaderResponse {
            answered_by_leader: mine == Some(leader.term),
            leader: Some(leader_to_proto(&leader)),
            answered_by: self.replica_id.clone(),
        }))
    }

    async fn resign_leadership(
        &self,
        req: Request<proto::ResignLeadershipRequest>,
    ) -> Result<Response<proto::ResignLeadershipResponse>, Status> {
        let mut caller = crate::security::caller_name(&req);
        let forwarded = req
            .metadata()
            .get(FORWARDED)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if let Some(by) = &forwarded {
            caller = format!("{caller} (forwarded by {by})");
        }
        tracing::info!(target: "baton::audit", action = "resign", caller = %caller, replica = %self.replica_id, "resignation requested");
        if self.role.borrow().term().is_none() {
            if forwarded.is_none() {
                let term = req.into_inner().term;
                return self.forward_resign(term, &caller).await.map(Response::new);
            }
            let hint = match election::current_leader(&self.store, &self.keys).await {
                Ok(l) => format!("; the leader is {} at {}", l.replica_id, l.advertise),
                Err(_) => String::new(),
            };
            return Err(Status::failed_precondition(format!(
                "replica {} is not the leader{hint}",
                self.replica_id
            )));
        }
        let (reply, answer) = oneshot::channel();
        let cmd = Command::Resign {
            term: req.into_inner().term,
            reply,
        };
        self.commands
            .send(cmd)
            .await
            .map_err(|_| Status::unavailable("the replica is shutting down"))?;
        let resigned = tokio::time::timeout(Duration::from_secs(30), answer)
            .await
            .map_err(|_| {
                Status::deadline_exceeded("the leader did not finish stepping down within 30s")
            })?
            .map_err(|_| Status::unavailable("the replica is shutting down"))??;
        Ok(Response::new(proto::ResignLeadershipResponse {
            resigned_term: resigned,
            replica_id: self.replica_id.clone(),
        }))
    }
}
