//! The HTTP listener (`--http-listen`): the JSON API under `/api/v1`, its OpenAPI document
//! and the web console at `/`, on the hyper/tower stack tonic uses, with the gRPC listener's
//! TLS, tokens and roles.
//!
//! Layers, outermost first: [`guard`] (browser safety, before any credential is looked at,
//! and the headers every answer carries), then [`auth`] on each route (its role from
//! [`crate::security::operations`]), then the route, which calls the gRPC service code.

mod auth;
mod call;
mod console;
mod error;
mod events;
mod guard;
mod listener;
mod live;
mod openapi;
mod routes;

pub use error::{code_name, http_status};
pub use guard::CSP;
pub use routes::Apis;

use std::sync::Arc;

use axum::response::IntoResponse;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::config::HttpArgs;
use crate::security::Security;

/// What the HTTP listener serves and how.
pub struct HttpServices {
    pub apis: Apis,
    pub security: Security,
    /// This replica's advertise address: its host is one the listener answers to.
    pub advertise: String,
    pub args: HttpArgs,
}

impl HttpServices {
    /// The HTTP face of `services`: the same service values, so both transports share them.
    pub fn new(
        services: &crate::api::Services,
        keys: crate::store::Keys,
        replica_id: String,
        advertise: String,
        args: HttpArgs,
        stop: CancellationToken,
    ) -> Self {
        let security = services.security.clone();
        let apis = Apis {
            jobs: services.jobs.clone(),
            fleet: services.fleet.clone(),
            schedules: services.schedules.clone(),
            cluster: services.cluster.clone(),
            replica_id,
            authentication: security.policy.enabled(),
            streams: Arc::new(Semaphore::new(args.http_max_streams)),
            hub: live::Hub::start(services.store.clone(), keys, stop.clone()),
            policy: Arc::new(security.policy.clone()),
            stop,
        };
        HttpServices {
            apis,
            security,
            advertise,
            args,
        }
    }
}

/// The whole application, layers included.
pub fn app(s: &HttpServices) -> Router {
    let browser = guard::Browser::new(
        &s.advertise,
        &s.args.http_allowed_hosts,
        s.security.tls.is_some(),
    );
    let policy = s.apis.policy.clone();
    routes::api(s.apis.clone())
        .merge(openapi::routes())
        .merge(console::routes(s.apis.authentication))
        .route_layer(axum::middleware::from_fn_with_state(
            policy,
            auth::authorize,
        ))
        .fallback(|| async {
            error::ApiError::new(
                axum::http::StatusCode::NOT_FOUND,
                Code::NotFound,
                "no such route",
            )
            .into_response()
        })
        .layer(axum::middleware::from_fn_with_state(browser, guard::guard))
}

/// Serves until `stop` fires; streams end then too.
pub async fn serve(listener: TcpListener, s: HttpServices) -> std::io::Result<()> {
    let app = app(&s);
    let stop = s.apis.stop.clone();
    let local = listener.local_addr()?;
    tracing::info!(listen = %local, tls = s.security.tls.is_some(), "HTTP API and console serving");
    let make = app.into_make_service_with_connect_info::<listener::Peer>();
    match s.security.tls {
        Some(tls) => {
            let l = listener::TlsListener {
                streams: crate::security::incoming_http(listener, tls).into_inner(),
                local,
            };
            axum::serve(l, make)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        }
        None => {
            axum::serve(listener::PlainListener(listener), make)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        }
    }
}
