//! The routes of `/api/v1`, each a call of the gRPC service code (see [`super::call`]).
//! Their roles are declared in [`crate::security::operations`].

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

use super::call::{json, unary, Input};
use super::error::{code_name, ApiError};
use crate::api::{ClusterApi, FleetApi, JobApi, ScheduleApi};
use crate::proto::cluster_service_server::ClusterService;
use crate::proto::fleet_service_server::FleetService;
use crate::proto::job_service_server::JobService;
use crate::proto::schedule_service_server::ScheduleService;
use crate::proto::{FollowJobLogsRequest, GetJobLogsRequest, WatchJobRequest};

/// What the routes call.
#[derive(Clone)]
pub struct Apis {
    pub jobs: JobApi,
    pub fleet: FleetApi,
    pub schedules: ScheduleApi,
    pub cluster: ClusterApi,
    pub replica_id: String,
    /// Whether callers are authenticated at all.
    pub authentication: bool,
    /// Live streams: one permit each.
    pub streams: Arc<Semaphore>,
    /// Fires when the listener stops: every stream ends.
    pub stop: CancellationToken,
    /// What the console's live streams read.
    pub hub: super::live::Hub,
    /// Who may call what.
    pub policy: Arc<crate::security::Policy>,
}

/// A route that calls `$svc`'s `$method` of trait `$trait`.
macro_rules! unary {
    ($svc:ident, $trait:ident, $method:ident) => {
        |State(s): State<Apis>, input: Input| async move {
            unary(input, |r| async move { $trait::$method(&s.$svc, r).await }).await
        }
    };
}

pub fn api(apis: Apis) -> Router {
    Router::new()
        .route(
            "/api/v1/jobs",
            get(unary!(jobs, JobService, list_jobs)).post(unary!(jobs, JobService, submit_job)),
        )
        .route(
            "/api/v1/jobs/{job_id}",
            get(unary!(jobs, JobService, get_job)),
        )
        .route(
            "/api/v1/jobs/{job_id}/cancel",
            post(unary!(jobs, JobService, cancel_job)),
        )
        .route(
            "/api/v1/jobs/{job_id}/cleanup/retry",
            post(unary!(jobs, JobService, retry_cleanup)),
        )
        .route(
            "/api/v1/jobs/{job_id}/cleanup/abandon",
            post(unary!(jobs, JobService, abandon_cleanup)),
        )
        .route("/api/v1/jobs/{job_id}/logs", get(job_logs))
        .route("/api/v1/jobs/{job_id}/logs/follow", get(follow_logs))
        .route("/api/v1/jobs/{job_id}/watch", get(watch_job))
        .route(
            "/api/v1/schedules",
            get(unary!(schedules, ScheduleService, list_schedules)).post(unary!(
                schedules,
                ScheduleService,
                create_schedule
            )),
        )
        .route(
            "/api/v1/schedules/{name}",
            get(unary!(schedules, ScheduleService, get_schedule))
                .put(unary!(schedules, ScheduleService, update_schedule))
                .delete(unary!(schedules, ScheduleService, delete_schedule)),
        )
        .route(
            "/api/v1/schedules/{name}/pause",
            post(unary!(schedules, ScheduleService, pause_schedule)),
        )
        .route(
            "/api/v1/schedules/{name}/resume",
            post(unary!(schedules, ScheduleService, resume_schedule)),
        )
        .route(
            "/api/v1/schedules/{name}/trigger",
            post(unary!(schedules, ScheduleService, trigger_schedule)),
        )
        .route(
            "/api/v1/schedules/{name}/backfill",
            post(unary!(schedules, ScheduleService, backfill_schedule)),
        )
        .route(
            "/api/v1/leader",
            get(unary!(cluster, ClusterService, get_leader)),
        )
        .route(
            "/api/v1/leader/history",
            get(unary!(cluster, ClusterService, get_leader_history)),
        )
        .route(
            "/api/v1/leader/resign",
            post(unary!(cluster, ClusterService, resign_leadership)),
        )
        .route(
            "/api/v1/workers",
            get(unary!(fleet, FleetService, list_workers)),
        )
        .route(
            "/api/v1/workers/{worker_id}/drain",
            post(unary!(fleet, FleetService, drain_worker)),
        )
        .route(
            "/api/v1/workers/{worker_id}/undrain",
            post(unary!(fleet, FleetService, undrain_worker)),
        )
        .route("/api/v1/whoami", get(whoami))
        .route("/api/v1/events", get(super::events::events))
        .with_state(apis)
}

/// The caller as the server sees it: what the console shows and which buttons it offers.
async fn whoami(State(s): State<Apis>, input: Input) -> Response {
    let (name, role) = match &input.caller {
        Some(c) => (c.name.clone(), c.role),
        None => ("anonymous".to_string(), crate::security::Role::Admin),
    };
    json(&serde_json::json!({
        "name": name,
        "role": role.as_str(),
        "authentication": s.authentication,
        "replica_id": s.replica_id,
    }))
}

/// The log as text: never HTML, whatever it holds.
async fn job_logs(State(s): State<Apis>, input: Input) -> Response {
    let req = match input.request::<GetJobLogsRequest>() {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match JobService::get_job_logs(&s.jobs, req).await {
        Ok(r) => {
            let r = r.into_inner();
            let mut resp = text(Body::from(r.content));
            resp.headers_mut()
                .insert("x-baton-attempt", HeaderValue::from(r.attempt));
            resp
        }
        Err(st) => ApiError::from(st).into_response(),
    }
}

fn text(body: Body) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        )],
        body,
    )
        .into_response()
}

/// A permit for one more stream, or 503.
pub(super) fn stream_permit(s: &Apis) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    s.streams.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            Code::Unavailable,
            "too many live streams on this replica (--http-max-streams); retry later",
        )
    })
}

/// What a stream starts with: its place among `--http-max-streams`, the credentials it checks
/// while it lasts, and its request.
fn open_stream<T: serde::de::DeserializeOwned>(
    s: &Apis,
    input: Input,
) -> Result<
    (
        tokio::sync::OwnedSemaphorePermit,
        Option<super::auth::Credentials>,
        tonic::Request<T>,
    ),
    ApiError,
> {
    let permit = stream_permit(s)?;
    let credentials = input.credentials.clone();
    Ok((permit, credentials, input.request()?))
}

/// The log as it grows, as text, until the attempt ends.
async fn follow_logs(State(s): State<Apis>, input: Input) -> Response {
    let (permit, revoked, req) = match open_stream::<FollowJobLogsRequest>(&s, input) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    match JobService::follow_job_logs(&s.jobs, req).await {
        Ok(r) => {
            let chunks = r
                .into_inner()
                .take_while(|c| std::future::ready(c.is_ok()))
                .map(move |c| {
                    let _held = &permit;
                    Ok::<_, std::convert::Infallible>(c.map(|c| c.content).unwrap_or_default())
                })
                .take_until(s.stop.clone().cancelled_owned())
                .take_until(ended(revoked));
            text(Body::from_stream(chunks))
        }
        Err(st) => ApiError::from(st).into_response(),
    }
}

/// The job each time it changes, as server-sent events (`data: <job>`); an error ends the
/// stream with `event: error`.
async fn watch_job(State(s): State<Apis>, input: Input) -> Response {
    let (permit, revoked, req) = match open_stream::<WatchJobRequest>(&s, input) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    match JobService::watch_job(&s.jobs, req).await {
        Ok(r) => events(
            r.into_inner().take_until(ended(revoked)),
            permit,
            s.stop.clone(),
        ),
        Err(st) => ApiError::from(st).into_response(),
    }
}

/// Resolves when `credentials` stop holding (never without them).
async fn ended(credentials: Option<super::auth::Credentials>) {
    match credentials {
        Some(c) => c.revoked().await,
        None => std::future::pending().await,
    }
}

/// One server-sent event.
pub fn event<T: Serialize>(name: Option<&str>, data: &T) -> axum::body::Bytes {
    let data = serde_json::to_string(data).unwrap_or_else(|_| "null".into());
    match name {
        Some(n) => format!("event: {n}\ndata: {data}\n\n").into(),
        None => format!("data: {data}\n\n").into(),
    }
}

fn error_event(s: &Status) -> axum::body::Bytes {
    event(
        Some("error"),
        &serde_json::json!({"code": code_name(s.code()), "message": s.message()}),
    )
}

/// Items of `stream` as events, until an error (sent, then the end) or the listener stops.
fn events<T, S>(
    stream: S,
    permit: tokio::sync::OwnedSemaphorePermit,
    stop: CancellationToken,
) -> Response
where
    T: Serialize + Send + 'static,
    S: Stream<Item = Result<T, Status>> + Send + 'static,
{
    let mut failed = false;
    let body = stream
        .take_while(move |item| {
            let go = !failed;
            failed |= item.is_err();
            std::future::ready(go)
        })
        .map(move |item| {
            let _held = &permit;
            Ok::<_, std::convert::Infallible>(match item {
                Ok(v) => event(None, &v),
                Err(s) => error_event(&s),
            })
        })
        .take_until(stop.cancelled_owned());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        )],
        Body::from_stream(body),
    )
        .into_response()
}
