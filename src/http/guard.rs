//! What keeps a browser from being turned against the API, checked before authentication:
//! a job is a shell on some host, and a page on another site, or under a rebound DNS name,
//! must not be able to start one.
//!
//! - The Host must be a loopback literal, `localhost`, the advertise host or an allowed name
//!   (421 otherwise: DNS rebinding).
//! - A request that changes something must say `Content-Type: application/json`, which no
//!   form or simple cross-site request can send (415 otherwise).
//! - An `Origin`, when sent, must be this server's own, and `Sec-Fetch-Site: cross-site` is
//!   refused (403: CSRF).
//! - No CORS header is ever sent; every answer carries a strict CSP, `nosniff`, and may not be
//!   framed or embedded by another site.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tonic::Code;

use super::error::ApiError;

/// The page may load only what this server serves, run no inline script or style, and be
/// framed by nobody.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; \
connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; \
frame-ancestors 'none'";

/// The names this listener answers to, and its scheme.
#[derive(Clone, Debug)]
pub struct Browser {
    hosts: Arc<HashSet<String>>,
    tls: bool,
}

impl Browser {
    /// `advertise` is `host:port` (or a bare host).
    pub fn new(advertise: &str, allowed: &[String], tls: bool) -> Self {
        let mut hosts: HashSet<String> = allowed.iter().map(|h| key(&normalize(h))).collect();
        hosts.insert("localhost".into());
        // An unspecified address (`0.0.0.0`, `[::]`) names no host to answer to.
        let named = host_of(advertise).filter(|h| !ip_of(h).is_some_and(|ip| ip.is_unspecified()));
        if let Some(h) = named {
            hosts.insert(key(&h));
        }
        Browser {
            hosts: Arc::new(hosts),
            tls,
        }
    }

    fn allowed_host(&self, host: &str) -> bool {
        let is_loopback = ip_of(host).is_some_and(|ip| ip.is_loopback());
        is_loopback || self.hosts.contains(&key(host))
    }

    /// Why `req` is refused, if it is.
    pub fn check(
        &self,
        method: &Method,
        headers: &HeaderMap,
        authority: Option<&str>,
    ) -> Result<(), ApiError> {
        let host_header = headers.get(header::HOST).and_then(|h| h.to_str().ok());
        if let (Some(h), Some(a)) = (host_header, authority) {
            if !h.eq_ignore_ascii_case(a) {
                return Err(ApiError::new(
                    StatusCode::MISDIRECTED_REQUEST,
                    Code::PermissionDenied,
                    "the Host header and the request's authority differ",
                ));
            }
        }
        let raw = host_header.or(authority).unwrap_or_default();
        let host = host_of(raw).unwrap_or_default();
        if !self.allowed_host(&host) {
            return Err(ApiError::new(
                StatusCode::MISDIRECTED_REQUEST,
                Code::PermissionDenied,
                format!("this server does not answer to the host {raw:?}; add it to --http-allowed-hosts if it is yours"),
            ));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let own = format!("{}://{}", if self.tls { "https" } else { "http" }, raw);
            let same = origin.to_str().is_ok_and(|o| o.eq_ignore_ascii_case(&own));
            if !same {
                return Err(forbidden("requests from another origin are refused"));
            }
        }
        if headers
            .get("sec-fetch-site")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"))
        {
            return Err(forbidden("cross-site requests are refused"));
        }
        if *method != Method::GET && *method != Method::HEAD {
            let json = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(';').next())
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
            if !json {
                return Err(ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    Code::InvalidArgument,
                    "a request that changes something must be sent as Content-Type: application/json",
                ));
            }
        }
        Ok(())
    }
}

fn forbidden(msg: &str) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, Code::PermissionDenied, msg)
}

fn ip_of(host: &str) -> Option<IpAddr> {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

/// One spelling per address: `[::1]` and `::1` are the same host.
fn key(host: &str) -> String {
    ip_of(host).map_or_else(|| host.to_string(), |ip| ip.to_string())
}

fn normalize(host: &str) -> String {
    host.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// The host of `host[:port]`, `[v6]:port` or a bare name, lower-cased, without a final dot.
pub fn host_of(authority: &str) -> Option<String> {
    let a = authority.trim();
    if a.is_empty() {
        return None;
    }
    let host = if let Some(rest) = a.strip_prefix('[') {
        &a[..rest.find(']')? + 2]
    } else {
        match a.rsplit_once(':') {
            Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) && !h.contains(':') => h,
            _ => a,
        }
    };
    Some(normalize(host))
}

/// The middleware: refuses what [`Browser::check`] refuses, and adds the headers every
/// answer carries.
pub async fn guard(State(browser): State<Browser>, req: Request, next: Next) -> Response {
    let checked = browser.check(
        req.method(),
        req.headers(),
        req.uri().authority().map(|a| a.as_str()),
    );
    let mut resp = match checked {
        Ok(()) => next.run(req).await,
        Err(e) => {
            tracing::info!(target: "baton::audit", path = req.uri().path(), reason = %e.message, "HTTP request refused");
            e.into_response()
        }
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn hosts_are_parsed_with_and_without_ports() {
        assert_eq!(host_of("127.0.0.1:80").as_deref(), Some("127.0.0.1"));
        assert_eq!(host_of("[::1]:7601").as_deref(), Some("[::1]"));
        assert_eq!(
            host_of("Baton.Example.:443").as_deref(),
            Some("baton.example")
        );
        assert_eq!(host_of("localhost").as_deref(), Some("localhost"));
        assert_eq!(host_of(""), None);
    }

    #[test]
    fn only_known_hosts_same_origins_and_json_writes_pass() {
        let b = Browser::new("10.0.0.7:7600", &["baton.internal".into()], false);
        let get = Method::GET;
        let post = Method::POST;
        for ok in [
            "127.0.0.1:7601",
            "127.9.9.9",
            "[::1]:7601",
            "localhost:7601",
            "10.0.0.7:7601",
            "baton.internal",
        ] {
            let h = headers(&[("host", ok)]);
            assert!(b.check(&get, &h, None).is_ok(), "{ok}");
        }
        for bad in ["evil.test:7601", "10.0.0.8", "", "localhost.evil.test"] {
            let h = headers(&[("host", bad)]);
            let e = b.check(&get, &h, None).unwrap_err();
            assert_eq!(e.status, StatusCode::MISDIRECTED_REQUEST, "{bad}");
        }
        let h = headers(&[
            ("host", "127.0.0.1:7601"),
            ("origin", "http://127.0.0.1:7601"),
            ("content-type", "application/json; charset=utf-8"),
        ]);
        assert!(b.check(&post, &h, None).is_ok());
        let h = headers(&[
            ("host", "127.0.0.1:7601"),
            ("origin", "http://127.0.0.1:7602"),
            ("content-type", "application/json"),
        ]);
        assert_eq!(
            b.check(&post, &h, None).unwrap_err().status,
            StatusCode::FORBIDDEN
        );
        let h = headers(&[
            ("host", "127.0.0.1:7601"),
            ("origin", "null"),
            ("content-type", "application/json"),
        ]);
        assert_eq!(
            b.check(&post, &h, None).unwrap_err().status,
            StatusCode::FORBIDDEN
        );
        let h = headers(&[("host", "127.0.0.1:7601"), ("sec-fetch-site", "cross-site")]);
        assert_eq!(
            b.check(&get, &h, None).unwrap_err().status,
            StatusCode::FORBIDDEN
        );
        let h = headers(&[("host", "127.0.0.1:7601"), ("content-type", "text/plain")]);
        assert_eq!(
            b.check(&post, &h, None).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        let h = headers(&[("host", "127.0.0.1:7601")]);
        assert_eq!(
            b.check(&Method::DELETE, &h, None).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        assert!(b
            .check(&get, &HeaderMap::new(), Some("127.0.0.1:7601"))
            .is_ok());
    }

    #[test]
    fn an_unspecified_advertise_address_and_a_split_authority_are_refused() {
        let b = Browser::new("0.0.0.0:7600", &[], false);
        let h = headers(&[("host", "0.0.0.0:7601")]);
        assert_eq!(
            b.check(&Method::GET, &h, None).unwrap_err().status,
            StatusCode::MISDIRECTED_REQUEST
        );
        let h = headers(&[("host", "127.0.0.1:7601")]);
        let e = b
            .check(&Method::GET, &h, Some("evil.test:7601"))
            .unwrap_err();
        assert_eq!(e.status, StatusCode::MISDIRECTED_REQUEST);
        assert!(b.check(&Method::GET, &h, Some("127.0.0.1:7601")).is_ok());
    }
}
