//! `/metrics` over HTTP for Prometheus, on `--metrics-listen`.

use axum::http::header::CONTENT_TYPE;
use tokio::net::TcpListener;

use crate::metrics;

/// Serves `/metrics` until the process ends.
pub async fn serve_metrics(listener: TcpListener) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(|| async {
            (
                [(CONTENT_TYPE, metrics::CONTENT_TYPE)],
                metrics::get().render(),
            )
        }),
    );
    tracing::info!(listen = ?listener.local_addr().ok(), "metrics serving at /metrics");
    axum::serve(listener, app).await
}
