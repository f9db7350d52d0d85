//! `GET /api/v1/events`: what a console page needs to stay current, as server-sent events on
//! a `fetch()` stream (so the token travels in the Authorization header, never a URL).
//!
//! Each stream reads the replica's [`Hub`]; it never touches etcd. It sends a `snapshot`
//! first, then an `update` when something changed, at most [`MIN_GAP`] apart (4 a second),
//! a comment every [`KEEPALIVE`] so proxies keep it open, and ends within a second of its
//! token's removal (`event: error`, UNAUTHENTICATED).

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::{watch, OwnedSemaphorePermit};
use tokio::time::Instant;

use super::auth::{Credentials, RECHECK};
use super::call::Input;
use super::live::{Changed, Snapshot, Topics};
use super::routes::{event, stream_permit, Apis};

/// Updates to one stream come at least this far apart.
pub const MIN_GAP: Duration = Duration::from_millis(250);
/// A comment line this often keeps idle streams open through proxies.
pub const KEEPALIVE: Duration = Duration::from_secs(15);

/// What one stream has sent so far.
struct Sent {
    seq: u64,
    topics: Topics,
    at: Instant,
}

/// The body of an event: counts always; leader and workers when they changed; which other
/// things changed (the page re-reads those it shows).
fn message(s: &Snapshot, sent: Option<&Sent>) -> Value {
    let since = sent.map(|x| x.seq).unwrap_or(0);
    let old = sent.map(|x| x.topics).unwrap_or_default();
    let jobs = match sent {
        None => json!("all"),
        Some(_) => match s.changed_since(since) {
            Changed::All => json!("all"),
            Changed::Ids(ids) => json!(ids),
        },
    };
    let mut m = json!({
        "seq": s.seq,
        "revision": s.revision.to_string(),
        "healthy": s.healthy,
        "counts": s.counts,
        "changed": {
            "jobs": jobs,
            "schedules": sent.is_none() || s.topics.schedules > old.schedules,
            "history": sent.is_none() || s.topics.history > old.history,
            "workers": sent.is_none() || s.topics.workers > old.workers,
            "leader": sent.is_none() || s.topics.leader > old.leader,
        },
    });
    if sent.is_none() || s.topics.leader > old.leader {
        m["leader"] = serde_json::to_value(&s.leader).unwrap_or(Value::Null);
        m["replicas"] = serde_json::to_value(&s.replicas).unwrap_or(Value::Null);
    }
    if sent.is_none() || s.topics.workers > old.workers {
        m["workers"] = serde_json::to_value(&s.workers).unwrap_or(Value::Null);
    }
    m
}

/// The per-stream state the body is unfolded from.
struct Stream {
    rx: watch::Receiver<Arc<Snapshot>>,
    sent: Option<Sent>,
    /// What it was opened with, checked again every [`RECHECK`].
    credentials: Option<Credentials>,
    done: bool,
    _permit: OwnedSemaphorePermit,
}

impl Stream {
    fn token_holds(&self) -> bool {
        self.credentials.as_ref().is_none_or(Credentials::holds)
    }

    /// The next chunk of the body, or `None` at the end.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let Some(sent) = &self.sent else {
            // Nothing until the hub has read etcd once: no page shows made-up zeros.
            if self.rx.wait_for(|s| s.seq > 0).await.is_err() {
                self.done = true;
                return None;
            }
            let snap = self.rx.borrow_and_update().clone();
            let m = message(&snap, None);
            self.sent = Some(Sent {
                seq: snap.seq,
                topics: snap.topics,
                at: Instant::now(),
            });
            return Some(event(Some("snapshot"), &m));
        };
        let earliest = sent.at + MIN_GAP;
        let keepalive = tokio::time::sleep(KEEPALIVE);
        tokio::pin!(keepalive);
        let mut recheck = tokio::time::interval(RECHECK);
        loop {
            tokio::select! {
                r = self.rx.changed() => {
                    if r.is_err() {
                        self.done = true;
                        return None;
                    }
                    tokio::time::sleep_until(earliest).await;
                    if !self.token_holds() {
                        return Some(self.revoked());
                    }
                    let snap = self.rx.borrow_and_update().clone();
                    let m = message(&snap, self.sent.as_ref());
                    self.sent = Some(Sent { seq: snap.seq, topics: snap.topics, at: Instant::now() });
                    return Some(event(Some("update"), &m));
                }
                _ = &mut keepalive => return Some(Bytes::from_static(b": keepalive\n\n")),
                _ = recheck.tick() => {
                    if !self.token_holds() {
                        return Some(self.revoked());
                    }
                }
            }
        }
    }

    fn revoked(&mut self) -> Bytes {
        self.done = true;
        event(
            Some("error"),
            &json!({"code": "UNAUTHENTICATED", "message": "the token was revoked"}),
        )
    }
}

pub async fn events(State(s): State<Apis>, input: Input) -> Response {
    let permit = match stream_permit(&s) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let stream = Stream {
        rx: s.hub.subscribe(),
        sent: None,
        credentials: input.credentials,
        done: false,
        _permit: permit,
    };
    let body = futures_util::stream::unfold(stream, |mut st| async move {
        st.next()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), st))
    });
    let body = futures_util::StreamExt::take_until(body, s.stop.clone().cancelled_owned());
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (
                header::HeaderName::from_static("x-accel-buffering"),
                HeaderValue::from_static("no"),
            ),
        ],
        Body::from_stream(body),
    )
        .into_response()
}
