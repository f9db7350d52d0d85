//! The gRPC surface of a replica: `baton.v1` services, standard health and reflection (v1 and
//! v1alpha).

mod cluster;
mod fleet;
mod health;
mod job_list;
mod jobs;
mod logs;
mod metrics;
mod schedules;
mod status;

pub use cluster::{leader_to_proto, ClusterApi};
pub use fleet::{worker_proto, FleetApi};
pub use health::{Ready, LIVENESS};
pub use jobs::{job_view, JobApi, MAX_REQUEST_BYTES};
pub use metrics::serve_metrics;
pub use schedules::{schedule_view, ScheduleApi};

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use crate::security::{AuthLayer, Security};
use crate::store::Store;

use crate::proto::cluster_service_server::ClusterServiceServer;
use crate::proto::fleet_service_server::FleetServiceServer;
use crate::proto::job_service_server::JobServiceServer;
use crate::proto::schedule_service_server::ScheduleServiceServer;
use crate::proto::worker_service_server::WorkerServiceServer;
use crate::worker::WorkerLogs;

/// What a replica serves.
pub struct Services {
    /// etcd, for the readiness probes, and the key they read.
    pub store: Store,
    pub probe_key: String,
    pub cluster: ClusterApi,
    pub jobs: JobApi,
    pub fleet: FleetApi,
    pub schedules: ScheduleApi,
    /// Its embedded worker's logs, if it runs one.
    pub worker: Option<WorkerLogs>,
    pub security: Security,
    /// What `/readyz` answers.
    pub ready: Ready,
}

/// Serves until `stop` fires, then drains in-flight calls. Readiness follows etcd's reach and
/// turns NOT_SERVING for good as soon as `draining` fires (the replica is handing over), so
/// load balancers stop sending work; liveness stays SERVING (see [`health`]).
pub async fn serve(
    listener: TcpListener,
    services: Services,
    draining: CancellationToken,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let Services {
        store,
        probe_key,
        cluster,
        jobs,
        fleet,
        schedules,
        worker,
        security,
        ready: ready_flag,
    } = services;
    let mut ready = vec![
        service_name::<ScheduleServiceServer<ScheduleApi>>(),
        service_name::<ClusterServiceServer<ClusterApi>>(),
        service_name::<JobServiceServer<JobApi>>(),
        service_name::<FleetServiceServer<FleetApi>>(),
    ];
    if worker.is_some() {
        ready.push(service_name::<WorkerServiceServer<WorkerLogs>>());
    }
    health::report(health, store, probe_key, ready, ready_flag, draining).await;
    // Both versions: grpcurl speaks v1, while Python's grpcio-reflection, Postman and older
    // grpcurl speak only v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .expect("the embedded descriptor sets are valid");
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .expect("the embedded descriptor sets are valid");
    let local: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(listen = ?local, tls = security.tls.is_some(), authentication = security.policy.enabled(), "gRPC API serving");
    let router = Server::builder()
        .layer(AuthLayer::new(security.policy))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(ClusterServiceServer::new(cluster))
        .add_service(JobServiceServer::new(jobs).max_decoding_message_size(jobs::MAX_REQUEST_BYTES))
        .add_service(FleetServiceServer::new(fleet))
        .add_service(
            ScheduleServiceServer::new(schedules)
                .max_decoding_message_size(jobs::MAX_REQUEST_BYTES),
        )
        .add_optional_service(worker.map(WorkerServiceServer::new));
    match security.tls {
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(
                    crate::security::incoming(listener, tls),
                    stop.cancelled_owned(),
                )
                .await
        }
        None => {
            router
                .serve_with_incoming_shutdown(plain(listener), stop.cancelled_owned())
                .await
        }
    }
}

/// What a worker serves: its job output, and readiness from etcd's reach.
pub struct WorkerServices {
    pub logs: WorkerLogs,
    pub store: Store,
    pub probe_key: String,
    pub security: Security,
    /// What `/readyz` answers.
    pub ready: Ready,
}

/// A worker's listener: `grpc.health.v1` (liveness; readiness while etcd answers, until
/// `draining` fires) and `baton.v1.WorkerService`, which the replicas read job output from.
pub async fn serve_worker(
    listener: TcpListener,
    services: WorkerServices,
    draining: CancellationToken,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let WorkerServices {
        logs,
        store,
        probe_key,
        security,
        ready: ready_flag,
    } = services;
    let (health, health_service) = tonic_health::server::health_reporter();
    let ready = vec![service_name::<WorkerServiceServer<WorkerLogs>>()];
    health::report(health, store, probe_key, ready, ready_flag, draining).await;
    let router = Server::builder()
        .layer(AuthLayer::new(security.policy))
        .add_service(health_service)
        .add_service(WorkerServiceServer::new(logs));
    match security.tls {
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(
                    crate::security::incoming(listener, tls),
                    stop.cancelled_owned(),
                )
                .await
        }
        None => {
            router
                .serve_with_incoming_shutdown(plain(listener), stop.cancelled_owned())
                .await
        }
    }
}

/// Plain TCP connections, with Nagle's algorithm off: an answer must not wait for the client's
/// delayed ACK (40 ms a request on an idle connection).
fn plain(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

fn service_name<S: NamedService>() -> &'static str {
    S::NAME
}
