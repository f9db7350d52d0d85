//! Scenario `console`: the HTTP API and the console's live streams under load.
//! - Paging: N jobs preloaded (as in `recovery`), then full pages of each view through a
//!   follower's `/api/v1/jobs`, timed from the request to the last byte of the answer.
//! - Consoles: the end-to-end run twice, without and with 50 console streams
//!   (`/api/v1/events`) on the follower the jobs are submitted to: that follower's CPU, etcd's
//!   watcher count, and the throughput.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

use super::cluster::{BenchCluster, Shape};
use super::e2e::{self, Consoles, EndToEnd};
use super::recovery::{self, FakeWorker, Mix};
use crate::config::BenchArgs;
use crate::exec::program::GuardKind;

/// Console streams in the second end-to-end run.
pub const CONSOLES: usize = 50;
/// Requests timed per view.
const SAMPLES: usize = 10;

#[derive(Clone, Debug, Serialize)]
pub struct View {
    pub query: String,
    pub jobs_on_page: usize,
    pub p50_ms: f64,
    pub max_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ConsoleBench {
    pub jobs: usize,
    pub views: Vec<View>,
    pub without: EndToEnd,
    pub with: EndToEnd,
    pub idle: Consoles,
    pub busy: Consoles,
}

type HttpClient =
    Client<hyper_util::client::legacy::connect::HttpConnector, Empty<axum::body::Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// GET `path` on `addr`: the status and the whole body.
async fn get(c: &HttpClient, addr: SocketAddr, path: &str) -> anyhow::Result<(u16, Vec<u8>)> {
    let uri: http::Uri = format!("http://{addr}{path}").parse()?;
    let resp = c.get(uri).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes().to_vec();
    Ok((status, body))
}

/// Console streams held open, counting the events they receive.
pub struct Streams {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    events: Arc<AtomicU64>,
}

impl Streams {
    /// Stops them; the events received.
    pub async fn close(self) -> u64 {
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
        self.events.load(Ordering::Relaxed)
    }
}

/// Opens `n` event streams on `addr` and waits until each has its first snapshot.
pub async fn open_streams(addr: SocketAddr, n: usize) -> anyhow::Result<Streams> {
    let events = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::channel(n.max(1));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (events, tx) = (events.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            let Ok(uri) = format!("http://{addr}/api/v1/events").parse::<http::Uri>() else {
                return;
            };
            let Ok(resp) = c.get(uri).await else { return };
            let mut body = resp.into_body();
            let mut told = false;
            while let Some(Ok(frame)) = body.frame().await {
                if let Some(data) = frame.data_ref() {
                    let n = data.windows(7).filter(|w| w == b"event: ").count() as u64;
                    events.fetch_add(n, Ordering::Relaxed);
                    if n > 0 && !told {
                        told = true;
                        let _ = tx.send(()).await;
                    }
                }
            }
        }));
    }
    drop(tx);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for i in 0..n {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(())) => {}
            _ => return Err(anyhow!("only {i} of {n} console streams opened")),
        }
    }
    Ok(Streams { tasks, events })
}

pub async fn run(args: &BenchArgs, dir: &Path, n: usize) -> anyhow::Result<ConsoleBench> {
    let views = paging(args, &dir.join("paging"), n).await?;
    let (without, idle) =
        e2e::measure(args, &dir.join("without"), Some(0), GuardKind::Small).await?;
    let (with, busy) =
        e2e::measure(args, &dir.join("with"), Some(CONSOLES), GuardKind::Small).await?;
    Ok(ConsoleBench {
        jobs: n,
        views,
        without,
        with,
        idle: idle.ok_or_else(|| anyhow!("no console figures"))?,
        busy: busy.ok_or_else(|| anyhow!("no console figures"))?,
    })
}

/// Full pages of each view of `n` preloaded jobs through a follower.
async fn paging(args: &BenchArgs, dir: &Path, n: usize) -> anyhow::Result<Vec<View>> {
    let mix = Mix::thirds(n);
    let mut c = BenchCluster::etcd(args, dir)?;
    let store = c.store().await?;
    let keys = c.keys();
    let worker = FakeWorker::register(&store, &keys, mix.live, args.lease_ttl).await?;
    recovery::preload(&store, &keys, &worker, mix).await?;
    c.spawn(Shape {
        http: true,
        ..Shape::coordinators(2)
    })?;
    let bound = Duration::from_secs(120) + Duration::from_millis(2) * n as u32;
    let (leader, term) = c.wait_leader(0, bound).await?;
    recovery::wait_recovered(&c, term, bound).await?;
    c.wait_follows((leader + 1) % c.replicas.len(), bound)
        .await?;
    let follower = c.http[(leader + 1) % c.http.len()];
    let http = client();
    let mid = |kind: &str, count: usize| format!("{kind}-{:04}", count / 2 / 100);
    let queries = vec![
        "page_size=100".to_string(),
        "page_size=1000".to_string(),
        format!("page_size=100&id_prefix={}", mid("live", mix.live)),
        format!("page_size=100&id_prefix={}", mid("done", mix.dirty)),
        "page_size=100&state=RUNNING".to_string(),
        "page_size=100&state=PENDING".to_string(),
        "page_size=100&state=FINISHED".to_string(),
        "page_size=100&cleanup=CLEANUP_PENDING".to_string(),
        "page_size=100&cleanup=CLEANUP_DONE".to_string(),
    ];
    let mut views = Vec::new();
    for q in queries {
        let path = format!("/api/v1/jobs?{q}");
        let mut times = Vec::new();
        let mut on_page = 0;
        for _ in 0..SAMPLES {
            let t = Instant::now();
            let (status, body) = get(&http, follower, &path).await?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            if status != 200 {
                return Err(anyhow!("{path}: {status}"));
            }
            let v: serde_json::Value = serde_json::from_slice(&body)?;
            on_page = v["jobs"].as_array().map_or(0, |a| a.len());
        }
        times.sort_by(f64::total_cmp);
        views.push(View {
            query: q,
            jobs_on_page: on_page,
            p50_ms: times[times.len() / 2],
            max_ms: *times.last().unwrap_or(&0.0),
        });
    }
    drop(worker);
    Ok(views)
}
