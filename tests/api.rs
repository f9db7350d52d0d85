//! The standard gRPC surface every replica serves: health, and reflection in both versions that
//! clients speak (v1 for grpcurl, v1alpha for grpcio-reflection, Postman and older grpcurl).

mod support;

use std::time::Duration;

use support::*;

async fn channel(c: &Cluster) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{}", c.replicas[0].listen()))
        .unwrap()
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_services_in_v1_and_v1alpha() {
    let c = Cluster::start(Options {
        replicas: 1,
        ..Options::default()
    });
    c.leader_index().await;
    let ch = channel(&c).await;

    use tonic_reflection::pb::v1;
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(ch.clone());
    let req = v1::ServerReflectionRequest {
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
        ..Default::default()
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        answer.message_response
    else {
        panic!("v1: not a service list: {answer:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for service in ["baton.v1.JobService", "baton.v1.ScheduleService"] {
        assert!(names.contains(&service.to_string()), "{names:?}");
    }

    use tonic_reflection::pb::v1alpha;
    let mut client = v1alpha::server_reflection_client::ServerReflectionClient::new(ch.clone());
    let req = v1alpha::ServerReflectionRequest {
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
        ..Default::default()
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .expect("v1alpha reflection is served")
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        answer.message_response
    else {
        panic!("v1alpha: not a service list: {answer:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"baton.v1.ClusterService".to_string())
            && names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );

    let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}
