//! Authentication and roles on the HTTP routes, from the same table and policy as gRPC.

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tonic::Code;

use super::error::ApiError;
use super::listener::Peer;
use crate::security::operations;
use crate::security::Policy;

/// How often a long request checks that its credentials still hold.
pub const RECHECK: std::time::Duration = std::time::Duration::from_millis(250);

/// What a request was authenticated with, to check again while a stream lasts: a token
/// removed from the tokens file, or a certificate's CN whose role is gone, ends it.
#[derive(Clone)]
pub struct Credentials {
    policy: std::sync::Arc<Policy>,
    authorization: Option<axum::http::HeaderValue>,
    cn: Option<String>,
}

impl Credentials {
    pub fn holds(&self) -> bool {
        if !self.policy.enabled() {
            return true;
        }
        let mut h = axum::http::HeaderMap::new();
        if let Some(a) = &self.authorization {
            h.insert(header::AUTHORIZATION, a.clone());
        }
        self.policy.authenticate(&h, self.cn.clone()).is_ok()
    }

    /// Resolves once they no longer hold.
    pub async fn revoked(self) {
        loop {
            tokio::time::sleep(RECHECK).await;
            if !self.holds() {
                return;
            }
        }
    }
}

/// Refuses a route with no role declared in [`operations::OPERATIONS`] (403), and a caller
/// without the role it needs; puts the [`crate::security::Caller`] in the request. A client
/// certificate alone authenticates only requests without an `Origin`: a browser sends its
/// certificate to any page that asks, so the console uses a token.
pub async fn authorize(
    State(policy): State<std::sync::Arc<Policy>>,
    matched: Option<MatchedPath>,
    mut req: Request,
    next: Next,
) -> Response {
    let route = matched
        .as_ref()
        .map(MatchedPath::as_str)
        .unwrap_or_default();
    // HEAD is a GET without its body.
    let method = match req.method().as_str() {
        "HEAD" => "GET".to_string(),
        m => m.to_string(),
    };
    let Some(access) = operations::http(&method, route) else {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            Code::PermissionDenied,
            format!("no role is declared for {method} {route}"),
        )
        .into_response();
    };
    let from_browser = req.headers().contains_key(header::ORIGIN);
    let peer = req
        .extensions()
        .get::<axum::extract::ConnectInfo<Peer>>()
        .map(|p| p.0.clone())
        .unwrap_or_default();
    let cn = peer.cn.clone().filter(|_| !from_browser);
    let what = format!("{method} {route}");
    let credentials = Credentials {
        policy: policy.clone(),
        authorization: req.headers().get(header::AUTHORIZATION).cloned(),
        cn: cn.clone(),
    };
    match policy.check(&what, access, req.headers(), cn) {
        Ok(caller) => {
            if let Some(c) = caller {
                req.extensions_mut().insert(c);
            }
            req.extensions_mut().insert(credentials);
            next.run(req).await
        }
        Err(status) => {
            tracing::info!(target: "baton::audit", path = req.uri().path(), peer = ?peer.addr, code = ?status.code(), reason = status.message(), "HTTP request refused");
            ApiError::from(status).into_response()
        }
    }
}
