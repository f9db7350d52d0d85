//! Plain HTTP on `--metrics-listen`: `/metrics` for Prometheus, and `/livez` and `/readyz` for
//! probes that cannot reach the gRPC health service (kubelet cannot once it speaks TLS).

use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use tokio::net::TcpListener;

use super::health::Ready;
use crate::metrics;

/// Serves until the process ends: `/metrics`; `/livez`, 200 while the process answers (a drain
/// included); `/readyz`, 200 while `ready` holds (etcd answers and no drain), else 503.
pub async fn serve_metrics(listener: TcpListener, ready: Ready) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(|| async {
                (
                    [(CONTENT_TYPE, metrics::CONTENT_TYPE)],
                    metrics::get().render(),
                )
            }),
        )
        .route("/livez", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/readyz",
            axum::routing::get(move || async move {
                if ready.get() {
                    (StatusCode::OK, "ok\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                }
            }),
        );
    tracing::info!(listen = ?listener.local_addr().ok(), "metrics serving at /metrics, probes at /livez and /readyz");
    axum::serve(listener, app).await
}
