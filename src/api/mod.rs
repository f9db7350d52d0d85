//! The gRPC surface of a replica: `baton.v1` services, standard health and reflection (v1 and
//! v1alpha).

mod cluster;
mod jobs;
mod status;

pub use cluster::ClusterApi;
pub use jobs::{job_view, JobApi};

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic_health::server::HealthReporter;

use crate::proto::cluster_service_server::ClusterServiceServer;
use crate::proto::job_service_server::JobServiceServer;

/// Serves until `stop` fires, then drains in-flight calls. Health turns NOT_SERVING as soon as
/// `draining` fires (the replica is handing over), so load balancers stop sending work.
pub async fn serve(
    listener: TcpListener,
    cluster: ClusterApi,
    jobs: JobApi,
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
    Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(ClusterServiceServer::new(cluster))
        .add_service(JobServiceServer::new(jobs).max_decoding_message_size(jobs::MAX_REQUEST_BYTES))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.cancelled_owned())
        .await
}

/// A worker's listener: `grpc.health.v1` only, SERVING until `draining` fires.
pub async fn serve_health(
    listener: TcpListener,
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
