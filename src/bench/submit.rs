//! Scenario `submit`: `SubmitJob` to one replica from C clients, next to raw etcd-client
//! transactions of the same shape (put-if-absent of a spec and a registry entry, answering the
//! existing keys when they exist) at the same C, against the same etcd, one after the other.
//!
//! Three coordinator-only replicas and no worker: submitted jobs wait PENDING, so no job runs
//! while submissions are measured. Submissions go to a follower, as a load balancer would send
//! two thirds of them; the leader's reaction to each new job is part of the cost etcd sees.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::cluster::{BenchCluster, Shape};
use super::stats::Load;
use super::{etcdstats, load};
use crate::config::BenchArgs;
use crate::jobs::records::RegistryEntry;
use crate::jobs::spec::{JobRecord, JobSpec, JOB_RECORD_VERSION};
use crate::proto;
use crate::store::{codec, Keys, Write};

#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub concurrency: usize,
    pub raw: Load,
    pub baton: Load,
    /// Baton's submissions per second over raw transactions per second.
    pub ratio: f64,
    /// Baton's p99 over raw's.
    pub p99_ratio: f64,
}

/// The stored form of [`trivial`].
pub fn trivial_stored() -> JobSpec {
    JobSpec::resolve(vec!["true".into()], Default::default(), Vec::new(), 0, None)
        .expect("`true` is a valid spec")
}

/// The spec every benchmark job runs.
pub fn trivial() -> proto::JobSpec {
    proto::JobSpec {
        command: vec!["true".into()],
        ..Default::default()
    }
}

pub async fn run(args: &BenchArgs, dir: &Path) -> anyhow::Result<Vec<Point>> {
    let c = BenchCluster::start(args, dir, Shape::coordinators(3))?;
    let (leader, _) = c.wait_leader(0, Duration::from_secs(60)).await?;
    let follower = (leader + 1) % c.replicas.len();
    c.wait_follows(follower, Duration::from_secs(60)).await?;
    let client = c.jobs_client(follower).await?;
    let store = c.store().await?;
    let raw_keys = Keys::new("bench-raw");
    let record = codec::encode(&JobRecord {
        version: JOB_RECORD_VERSION,
        job_id: "raw".into(),
        spec: trivial_stored(),
        spec_hash: trivial_stored().hash(),
        submitted_at_ms: crate::clock::unix_ms(),
        submitted_by: Some("anonymous".into()),
        schedule: None,
    });
    let pending = codec::encode(&RegistryEntry::pending());
    let (record, pending, raw_keys) = (Arc::new(record), Arc::new(pending), Arc::new(raw_keys));
    let mut points = Vec::new();
    for &conc in &args.concurrency {
        etcdstats::quiesce(&c.etcd, Duration::from_secs(60)).await;
        let raw = {
            let (store, keys, record, pending) = (
                store.clone(),
                raw_keys.clone(),
                record.clone(),
                pending.clone(),
            );
            load::drive(conc, args.duration, move |i| {
                let (store, keys, record, pending) =
                    (store.clone(), keys.clone(), record.clone(), pending.clone());
                async move {
                    let k = keys.job(&format!("c{conc}-{i}"));
                    let write = Write::new()
                        .when_absent(k.spec.clone())
                        .when_absent(k.registry.clone())
                        .when_absent(k.dirty.clone())
                        .when_absent(k.clean.clone())
                        .put(k.spec.clone(), record.as_slice())
                        .put(k.registry.clone(), pending.as_slice())
                        .or_get(k.spec)
                        .or_get(k.registry)
                        .or_get(k.dirty)
                        .or_get(k.clean)
                        .or_get(k.cancel)
                        .or_get(k.cleanup_now)
                        .or_get_prefix(keys.attempts_of(&format!("c{conc}-{i}")));
                    let mut kv = store.client();
                    store
                        .timed("bench txn", kv.txn(write.into_txn()))
                        .await
                        .is_ok_and(|r| r.succeeded())
                }
            })
            .await
        };
        etcdstats::quiesce(&c.etcd, Duration::from_secs(60)).await;
        let baton = {
            let client = client.clone();
            load::drive(conc, args.duration, move |i| {
                let mut client = client.clone();
                async move {
                    client
                        .submit_job(proto::SubmitJobRequest {
                            job_id: format!("c{conc}-{i}"),
                            spec: Some(trivial()),
                        })
                        .await
                        .is_ok_and(|r| r.get_ref().created)
                }
            })
            .await
        };
        points.push(Point {
            concurrency: conc,
            ratio: baton.ops_per_sec / raw.ops_per_sec.max(1e-9),
            p99_ratio: baton.p99_ms / raw.p99_ms.max(1e-9),
            raw,
            baton,
        });
    }
    Ok(points)
}
