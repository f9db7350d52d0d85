//! The web console: a page and its script and style, compiled into the binary (no CDN), served
//! to anybody; everything they show comes from the API, with the caller's token.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tonic::Code;

use super::error::ApiError;

const INDEX: &str = include_str!("../../console/index.html");

/// `(name, content type, content)`.
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_str!("../../console/app.js"),
    ),
    (
        "favicon.svg",
        "image/svg+xml",
        include_str!("../../console/favicon.svg"),
    ),
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("../../console/style.css"),
    ),
];

/// The page says whether it needs a token, so it asks for one before calling anything (no
/// 401 in the browser's console).
pub fn routes(authentication: bool) -> Router {
    let index = if authentication {
        INDEX.replacen(
            "<html lang=\"en\">",
            "<html lang=\"en\" data-auth=\"token\">",
            1,
        )
    } else {
        INDEX.to_string()
    };
    Router::new()
        .route(
            "/",
            get(move || {
                let index = index.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            HeaderValue::from_static("text/html; charset=utf-8"),
                        )],
                        index,
                    )
                }
            }),
        )
        .route("/assets/{file}", get(asset))
}

fn page(content_type: &'static str, body: &'static str) -> Response {
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))],
        body,
    )
        .into_response()
}

async fn asset(Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|(name, _, _)| *name == file) {
        Some((_, ty, body)) => page(ty, body),
        None => {
            ApiError::new(StatusCode::NOT_FOUND, Code::NotFound, "no such file").into_response()
        }
    }
}
