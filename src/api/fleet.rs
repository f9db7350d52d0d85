//! `baton.v1.FleetService`: the workers as etcd tells them, and operators' drain requests.
//! Served by every replica; needs no leader.

use tonic::{Request, Response, Status};

use crate::jobs::{self, fleet::LiveWorker};
use crate::proto::{self, fleet_service_server::FleetService};
use crate::store::{Keys, Store};

#[derive(Clone)]
pub struct FleetApi {
    store: Store,
    keys: Keys,
    replica_id: String,
}

impl FleetApi {
    pub fn new(store: Store, keys: Keys, replica_id: String) -> Self {
        Self {
            store,
            keys,
            replica_id,
        }
    }

    /// The worker's view right after a drain request changed, read afresh.
    async fn one(&self, id: &str) -> Result<proto::WorkerInfo, Status> {
        let fleet = jobs::fleet::read(&self.store, &self.keys).await?;
        fleet
            .get(id)
            .map(|w| worker_proto(w, jobs::records::now_ms()))
            .ok_or_else(|| jobs::Error::NoWorker(id.to_string()).into())
    }
}

pub fn worker_proto(w: &LiveWorker, now_ms: u64) -> proto::WorkerInfo {
    let r = &w.record;
    proto::WorkerInfo {
        worker_id: r.worker_id.clone(),
        address: r.advertise.clone(),
        running: w.running,
        capacity: r.capacity,
        cleanups: w.cleanups,
        cleanup_capacity: r.cleanup_capacity,
        draining: r.draining,
        drain_requested: w.drain_requested,
        labels: r.labels.clone().into_iter().collect(),
        started_unix_ms: r.started_at_ms as i64,
        age_ms: now_ms.saturating_sub(r.started_at_ms) as i64,
        incarnation: w.incarnation,
        unable: r.unable.clone().unwrap_or_default(),
    }
}

#[tonic::async_trait]
impl FleetService for FleetApi {
    async fn list_workers(
        &self,
        _req: Request<proto::ListWorkersRequest>,
    ) -> Result<Response<proto::ListWorkersResponse>, Status> {
        let fleet = jobs::fleet::read(&self.store, &self.keys).await?;
        let now = jobs::records::now_ms();
        Ok(Response::new(proto::ListWorkersResponse {
            workers: fleet.workers.iter().map(|w| worker_proto(w, now)).collect(),
            revision: fleet.revision,
        }))
    }

    async fn drain_worker(
        &self,
        req: Request<proto::DrainWorkerRequest>,
    ) -> Result<Response<proto::WorkerInfo>, Status> {
        let caller = crate::security::caller_name(&req);
        let id = req.into_inner().worker_id;
        jobs::fleet::drain(&self.store, &self.keys, &id, &self.replica_id).await?;
        tracing::info!(target: "baton::audit", action = "drain", worker = %id, caller = %caller, replica = %self.replica_id, "drain requested");
        Ok(Response::new(self.one(&id).await?))
    }

    async fn undrain_worker(
        &self,
        req: Request<proto::UndrainWorkerRequest>,
    ) -> Result<Response<proto::WorkerInfo>, Status> {
        let caller = crate::security::caller_name(&req);
        let id = req.into_inner().worker_id;
        jobs::fleet::undrain(&self.store, &self.keys, &id).await?;
        tracing::info!(target: "baton::audit", action = "undrain", worker = %id, caller = %caller, replica = %self.replica_id, "drain withdrawn");
        match self.one(&id).await {
            Err(s) if s.code() == tonic::Code::NotFound => Ok(Response::new(proto::WorkerInfo {
                worker_id: id,
                ..Default::default()
            })),
            other => other.map(Response::new),
        }
    }
}
