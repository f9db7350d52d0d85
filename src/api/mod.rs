//! The gRPC surface of a replica: `baton.v1` services, standard health and reflection (v1 and
//! v1alpha).

mod cluster;
mod fleet;
mod jobs;
mod logs;
mod status;

pub use cluster::ClusterApi;
pub use fleet::FleetApi;
pub use jobs::{job_view, JobApi};

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic_health::server::HealthReporter;

use crate::proto::cluster_service_server::ClusterServiceServer;
use crate::proto::fleet_service_server::FleetServiceServer;
use crate::proto::job_service_server::JobServiceServer;
use crate::proto::worker_service_server::WorkerServiceServer;
use crate::worker::WorkerLogs;

/// What a replica serves.
pub struct Services {
    pub cluster: ClusterApi,
    pub jobs: JobApi,
    pub fleet: FleetApi,
    /// Its embedded worker's logs, if it runs one.
    pub worker: Option<WorkerLogs>,
}

/// Serves until `stop` fires, then drains in-flight calls. Health turns NOT_SERVING as soon as
/// `draining` fires (the replica is handing over), so load balancers stop sending work.
pub async fn serve(
    listener: TcpListener,
    services: Services,
    draining: CancellationToken,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (health, health_service) = tonic_health::server::health_reporter();
    mark_serving(&health).await;
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
    tracing::info!(listen = ?local, "gRPC API serving");
    tokio::spawn(async move {
        draining.cancelled().await;
        health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        health.set_not_serving::<JobServiceServer<JobApi>>().await;
    });
    let Services {
        cluster,
        jobs,
        fleet,
        worker,
    } = services;
    Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(ClusterServiceServer::new(cluster))
        .add_service(JobServiceServer::new(jobs).max_decoding_message_size(jobs::MAX_REQUEST_BYTES))
        .add_service(FleetServiceServer::new(fleet))
        .add_optional_service(worker.map(WorkerServiceServer::new))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.cancelled_owned())
        .await
}

/// A worker's listener: `grpc.health.v1` (SERVING until `draining` fires) and
/// `baton.v1.WorkerService`, which the replicas read job output from.
pub async fn serve_worker(
    listener: TcpListener,
    logs: WorkerLogs,
    draining: CancellationToken,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    tokio::spawn(async move {
        draining.cancelled().await;
        health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
    });
    Server::builder()
        .add_service(health_service)
        .add_service(WorkerServiceServer::new(logs))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.cancelled_owned())
        .await
}

async fn mark_serving(health: &HealthReporter) {
    health
        .set_serving::<ClusterServiceServer<ClusterApi>>()
        .await;
    health.set_serving::<JobServiceServer<JobApi>>().await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
}
