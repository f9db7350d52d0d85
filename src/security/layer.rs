//! The gRPC layer that authenticates every request and checks its role before any handler
//! runs. Handlers find the [`Caller`] in the request's extensions.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;

use super::files::Watched;
use super::operations::{self, Access};
use super::roles::{Caller, Role};
use super::tls::common_name;
use super::tokens::TokenTable;

/// Who may call: tokens, and client certificate CNs mapped to roles.
#[derive(Clone, Default)]
pub struct Policy {
    pub tokens: Option<Watched<TokenTable>>,
    /// Client certificates are verified by the TLS layer; this maps their CN to a role.
    pub cert_roles: HashMap<String, Role>,
    /// Client certificates are checked (`--tls-client-ca`): they authenticate their caller.
    pub mtls: bool,
}

impl Policy {
    /// False: everybody may call everything (loopback, or `--insecure-allow-unauthenticated`).
    pub fn enabled(&self) -> bool {
        self.tokens.is_some() || self.mtls
    }

    /// The caller of a request with these headers, over a connection whose verified client
    /// certificate has this CN.
    pub fn authenticate(
        &self,
        headers: &http::HeaderMap,
        peer_cn: Option<String>,
    ) -> Result<Caller, Status> {
        if let Some(value) = headers.get(http::header::AUTHORIZATION) {
            let token = value
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim)
                .ok_or_else(|| {
                    Status::unauthenticated("the authorization header must be `Bearer <token>`")
                })?;
            let table = self.tokens.as_ref().map(|t| t.get()).unwrap_or_default();
            return match table.lookup(token) {
                Some((name, role)) => Ok(Caller {
                    name: name.to_string(),
                    role,
                }),
                None => Err(Status::unauthenticated("invalid token")),
            };
        }
        match peer_cn {
            Some(cn) => match self.cert_roles.get(&cn) {
                Some(&role) => Ok(Caller { name: cn, role }),
                None => Err(Status::permission_denied(format!(
                    "the client certificate CN={cn} has no role (map it with --tls-client-roles)"
                ))),
            },
            None => Err(Status::unauthenticated(
                "credentials needed: send `authorization: Bearer <token>` or a client certificate",
            )),
        }
    }

    /// The caller, if allowed to call `what`, an operation that needs `access`. `None` when
    /// the operation is open or authentication is off.
    pub fn check(
        &self,
        what: &str,
        access: Access,
        headers: &http::HeaderMap,
        peer_cn: Option<String>,
    ) -> Result<Option<Caller>, Status> {
        let Access::Needs(need) = access else {
            return Ok(None);
        };
        if !self.enabled() {
            return Ok(None);
        }
        let caller = self.authenticate(headers, peer_cn)?;
        if caller.role < need {
            return Err(Status::permission_denied(format!(
                "{} has the role {}; {what} needs {need}",
                caller.name, caller.role
            )));
        }
        Ok(Some(caller))
    }
}

/// See the module doc.
#[derive(Clone)]
pub struct AuthLayer {
    policy: Arc<Policy>,
}

impl AuthLayer {
    pub fn new(policy: Policy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            policy: self.policy.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    policy: Arc<Policy>,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for Auth<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<ReqBody>) -> Self::Future {
        let path = req.uri().path();
        let cn = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.peer_certs())
            .and_then(|certs| certs.first().and_then(|c| common_name(c)));
        let checked = self
            .policy
            .check(path, operations::grpc(path), req.headers(), cn);
        match checked {
            Ok(caller) => {
                if let Some(c) = caller {
                    req.extensions_mut().insert(c);
                }
                // The clone is ready only after poll_ready; call the one that was polled.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                Box::pin(inner.call(req))
            }
            Err(status) => {
                tracing::info!(
                    target: "baton::audit",
                    path = req.uri().path(),
                    code = ?status.code(),
                    reason = status.message(),
                    "request refused"
                );
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}
