//! `baton worker list|drain|undrain`: the fleet, through any replica.

use serde_json::json;

use super::call_any;
use crate::config::{ClientArgs, Output, WorkerIdArgs};
use crate::proto::fleet_service_client::FleetServiceClient;
use crate::proto::{DrainWorkerRequest, ListWorkersRequest, UndrainWorkerRequest, WorkerInfo};

pub fn worker_json(w: &WorkerInfo) -> serde_json::Value {
    json!({
        "worker_id": w.worker_id,
        "address": w.address,
        "running": w.running,
        "capacity": w.capacity,
        "cleanups": w.cleanups,
        "cleanup_capacity": w.cleanup_capacity,
        "draining": w.draining,
        "drain_requested": w.drain_requested,
        "labels": w.labels,
        "started_unix_ms": w.started_unix_ms,
        "age_ms": w.age_ms,
        "incarnation": w.incarnation,
        "unable": w.unable,
    })
}

fn labels(w: &WorkerInfo) -> String {
    let mut l: Vec<String> = w.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    l.sort();
    if l.is_empty() {
        "-".into()
    } else {
        l.join(",")
    }
}

fn status(w: &WorkerInfo) -> &'static str {
    if !w.unable.is_empty() {
        return "unable";
    }
    match (w.draining, w.drain_requested) {
        (true, true) => "drained",
        (true, false) => "draining",
        (false, true) => "drain-requested",
        (false, false) => "ready",
    }
}

fn age(ms: i64) -> String {
    let s = (ms.max(0) / 1000) as u64;
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        _ => format!("{}h", s / 3600),
    }
}

pub async fn list(c: &ClientArgs) -> anyhow::Result<()> {
    let resp = call_any(c, |ch| async move {
        Ok(FleetServiceClient::new(ch)
            .list_workers(ListWorkersRequest {})
            .await?
            .into_inner())
    })
    .await?;
    match c.output {
        Output::Json => println!(
            "{}",
            json!({
                "revision": resp.revision,
                "workers": resp.workers.iter().map(worker_json).collect::<Vec<_>>(),
            })
        ),
        Output::Text => {
            println!(
                "{:<20} {:<22} {:>9} {:>8} {:<16} {:>5}  LABELS",
                "WORKER", "ADDRESS", "RUNNING", "CLEANUP", "STATUS", "AGE"
            );
            for w in &resp.workers {
                println!(
                    "{:<20} {:<22} {:>9} {:>8} {:<16} {:>5}  {}",
                    w.worker_id,
                    w.address,
                    format!("{}/{}", w.running, w.capacity),
                    format!("{}/{}", w.cleanups, w.cleanup_capacity),
                    status(w),
                    age(w.age_ms),
                    labels(w)
                );
            }
            for w in resp.workers.iter().filter(|w| !w.unable.is_empty()) {
                println!("{} takes no assignments: {}", w.worker_id, w.unable);
            }
        }
    }
    Ok(())
}

/// `drain` (true) or `undrain` (false).
pub async fn drain(a: &WorkerIdArgs, drain: bool) -> anyhow::Result<()> {
    let id = a.id.clone();
    let w = call_any(&a.client, |ch| {
        let id = id.clone();
        async move {
            let mut c = FleetServiceClient::new(ch);
            Ok(if drain {
                c.drain_worker(DrainWorkerRequest { worker_id: id }).await?
            } else {
                c.undrain_worker(UndrainWorkerRequest { worker_id: id })
                    .await?
            }
            .into_inner())
        }
    })
    .await?;
    match a.client.output {
        Output::Json => println!("{}", worker_json(&w)),
        Output::Text if drain => println!(
            "worker {} draining: no new jobs; running ones ({}) get its --drain-timeout, then move",
            w.worker_id, w.running
        ),
        Output::Text => println!("worker {} takes jobs again", w.worker_id),
    }
    Ok(())
}
