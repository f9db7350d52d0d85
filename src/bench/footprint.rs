//! Scenario `footprint`: resident memory and CPU of an idle follower, an idle worker and a
//! leader holding N jobs (all RUNNING on the benchmark's live worker), read from `/proc`.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::cluster::{BenchCluster, Shape};
use super::recovery::{self, FakeWorker, Mix};
use super::usage::{sample, Usage};
use crate::config::BenchArgs;

#[derive(Clone, Debug, Serialize)]
pub struct Footprint {
    pub idle_follower: Usage,
    pub idle_worker: Usage,
    pub leader_jobs: usize,
    pub leader: Usage,
    pub window_seconds: f64,
}

pub async fn run(args: &BenchArgs, dir: &Path, jobs: usize) -> anyhow::Result<Footprint> {
    let mut c = BenchCluster::etcd(args, dir)?;
    let store = c.store().await?;
    let keys = c.keys();
    let worker = FakeWorker::register(&store, &keys, jobs, args.lease_ttl).await?;
    recovery::preload(
        &store,
        &keys,
        &worker,
        Mix {
            live: jobs,
            dead: 0,
            dirty: 0,
        },
    )
    .await?;
    c.spawn(Shape {
        replicas: 2,
        workers: 1,
        ..Shape::default()
    })?;
    let bound = Duration::from_secs(120) + Duration::from_millis(2) * jobs as u32;
    let (leader, term) = c.wait_leader(0, bound).await?;
    recovery::wait_recovered(&c, term, bound).await?;
    super::e2e::wait_workers(&store, &keys, 2).await?;
    // Idle means after the start: connections made, first reads done.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let follower = (leader + 1) % c.replicas.len();
    let window = args.duration;
    let (f, w, l) = tokio::join!(
        sample(c.replicas[follower].pid(), window),
        sample(c.workers[0].pid(), window),
        sample(c.replicas[leader].pid(), window),
    );
    Ok(Footprint {
        idle_follower: f?,
        idle_worker: w?,
        leader_jobs: jobs,
        leader: l?,
        window_seconds: window.as_secs_f64(),
    })
}
