//! The cluster one scenario measures: a private etcd, replicas and workers on loopback, all
//! children of the benchmark, stopped when it is dropped.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};

use crate::clock::BootInstant;
use crate::config::BenchArgs;
use crate::devcluster::{free_port, EtcdCluster, ReplicaProcess, ReplicaSpec};
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::job_service_client::JobServiceClient;
use crate::proto::GetLeaderRequest;
use crate::rolelog::RoleEvent;
use crate::security::AuthChannel;
use crate::store::{EtcdConfig, Keys, Store};

/// The cluster name every scenario uses.
pub const CLUSTER: &str = "bench";

pub struct BenchCluster {
    pub etcd: EtcdCluster,
    pub replicas: Vec<ReplicaProcess>,
    /// Each replica's HTTP API, with [`Shape::http`].
    pub http: Vec<std::net::SocketAddr>,
    pub workers: Vec<ReplicaProcess>,
    dir: PathBuf,
    ttl: Duration,
    bin: PathBuf,
}

/// What to start besides etcd.
#[derive(Default)]
pub struct Shape {
    pub replicas: usize,
    pub workers: usize,
    pub replica_args: Vec<String>,
    pub worker_args: Vec<String>,
    /// Give each replica `--http-listen` on a free port.
    pub http: bool,
}

impl Shape {
    /// `n` replicas that only coordinate (no embedded worker: nothing runs jobs).
    pub fn coordinators(n: usize) -> Shape {
        Shape {
            replicas: n,
            replica_args: vec!["--worker".into(), "false".into()],
            ..Shape::default()
        }
    }
}

impl BenchCluster {
    /// Starts etcd only; [`BenchCluster::spawn`] adds the processes (so a scenario can fill
    /// etcd before any replica reads it).
    pub fn etcd(args: &BenchArgs, dir: &Path) -> anyhow::Result<BenchCluster> {
        let bin = std::env::current_exe().context("locating the baton binary")?;
        let _ = std::fs::remove_dir_all(dir);
        let etcd = EtcdCluster::start(&args.etcd_bin, &dir.join("etcd"), args.etcd_members)?;
        Ok(BenchCluster {
            etcd,
            replicas: Vec::new(),
            http: Vec::new(),
            workers: Vec::new(),
            dir: dir.to_path_buf(),
            ttl: args.lease_ttl,
            bin,
        })
    }

    /// Starts etcd and the processes of `shape`.
    pub fn start(args: &BenchArgs, dir: &Path, shape: Shape) -> anyhow::Result<BenchCluster> {
        let mut c = Self::etcd(args, dir)?;
        c.spawn(shape)?;
        Ok(c)
    }

    /// Starts replicas (coordinators only when there are separate workers) and workers.
    pub fn spawn(&mut self, shape: Shape) -> anyhow::Result<()> {
        for i in 0..shape.replicas {
            let mut extra = vec![
                "--storage-dir".to_string(),
                self.dir.join("storage").display().to_string(),
            ];
            if shape.workers > 0 {
                extra.extend(["--worker".into(), "false".into()]);
            }
            extra.extend(shape.replica_args.iter().cloned());
            if shape.http {
                let addr: std::net::SocketAddr = ([127, 0, 0, 1], free_port()).into();
                extra.extend(["--http-listen".into(), addr.to_string()]);
                self.http.push(addr);
            }
            let id = format!("r{}", self.replicas.len() + i + 1);
            let p =
                ReplicaProcess::spawn(self.spec(id, extra, false)).context("starting a replica")?;
            self.replicas.push(p);
        }
        for i in 0..shape.workers {
            let id = format!("w{}", self.workers.len() + i + 1);
            let mut extra = vec![
                "--storage-dir".to_string(),
                self.dir.join("storage").join(&id).display().to_string(),
            ];
            extra.extend(shape.worker_args.iter().cloned());
            let p =
                ReplicaProcess::spawn(self.spec(id, extra, true)).context("starting a worker")?;
            self.workers.push(p);
        }
        Ok(())
    }

    fn spec(&self, id: String, mut extra_args: Vec<String>, worker: bool) -> ReplicaSpec {
        // Every process serves /metrics, for a look at what it did (`baton bench --dir`).
        let metrics = format!("127.0.0.1:{}", free_port());
        extra_args.extend(["--metrics-listen".into(), metrics]);
        ReplicaSpec {
            id,
            bin: self.bin.clone(),
            etcd_endpoints: self.etcd.endpoints(),
            cluster: CLUSTER.into(),
            listen: ([127, 0, 0, 1], free_port()).into(),
            lease_ttl: self.ttl,
            dir: self.dir.join("logs"),
            extra_args,
            worker,
        }
    }

    pub fn keys(&self) -> Keys {
        Keys::new(CLUSTER)
    }

    /// A fresh etcd handle on the cluster's etcd.
    pub async fn store(&self) -> anyhow::Result<Store> {
        let mut config = EtcdConfig::new(self.etcd.endpoints());
        config.request_timeout = Duration::from_secs(10);
        let store = Store::connect(config).await?;
        store
            .wait_reachable(self.keys().prefix(), Duration::from_secs(30))
            .await?;
        Ok(store)
    }

    pub async fn jobs_client(&self, i: usize) -> anyhow::Result<JobServiceClient<AuthChannel>> {
        let ch = channel(&self.replicas[i].listen().to_string()).await?;
        Ok(JobServiceClient::new(ch))
    }

    /// Waits until replica `i`'s own answer names a leader whose term is above `above`, and
    /// that leader itself answers as leader. Returns the leader's index and term.
    pub async fn wait_leader(&self, above: i64, within: Duration) -> anyhow::Result<(usize, i64)> {
        self.wait_leader_except(above, within, None).await
    }

    /// [`BenchCluster::wait_leader`] without asking replica `skip` (a paused one, whose
    /// unanswered calls would only add their timeouts to what is measured).
    pub async fn wait_leader_except(
        &self,
        above: i64,
        within: Duration,
        skip: Option<usize>,
    ) -> anyhow::Result<(usize, i64)> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(found) = self.serving_leader_except(above, skip).await {
                return Ok(found);
            }
            if Instant::now() >= deadline {
                return Err(anyhow!(
                    "no replica led a term above {above} within {within:?} (logs in {})",
                    self.dir.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The replica that answers as leader of a term above `above`, if one does now.
    async fn serving_leader_except(&self, above: i64, skip: Option<usize>) -> Option<(usize, i64)> {
        for (i, r) in self.replicas.iter().enumerate() {
            if Some(i) == skip {
                continue;
            }
            let Ok(ch) = channel(&r.listen().to_string()).await else {
                continue;
            };
            let Ok(resp) = ClusterServiceClient::new(ch)
                .get_leader(GetLeaderRequest {})
                .await
            else {
                continue;
            };
            let resp = resp.into_inner();
            match resp.leader {
                Some(l) if resp.answered_by_leader && l.term > above => return Some((i, l.term)),
                _ => {}
            }
        }
        None
    }

    /// Whether replica `i` answers at all and knows some leader (it follows the election).
    pub async fn follows(&self, i: usize) -> bool {
        let Ok(ch) = channel(&self.replicas[i].listen().to_string()).await else {
            return false;
        };
        matches!(
            ClusterServiceClient::new(ch).get_leader(GetLeaderRequest {}).await,
            Ok(r) if r.get_ref().leader.is_some()
        )
    }

    /// Waits until replica `i` [follows](BenchCluster::follows): a replica whose leader already
    /// serves may itself still be starting, and refuses connections until it listens.
    pub async fn wait_follows(&self, i: usize, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        while !self.follows(i).await {
            if Instant::now() >= deadline {
                return Err(anyhow!(
                    "replica {} knew no leader within {within:?} (logs in {})",
                    self.replicas[i].id(),
                    self.dir.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Every role event of every replica.
    pub fn role_events(&self) -> Vec<RoleEvent> {
        self.replicas.iter().flat_map(|r| r.role_events()).collect()
    }

    /// Waits for a role event that `pick` accepts.
    pub async fn wait_event(
        &self,
        within: Duration,
        what: &str,
        pick: impl Fn(&RoleEvent) -> bool,
    ) -> anyhow::Result<RoleEvent> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(e) = self.role_events().into_iter().find(|e| pick(e)) {
                return Ok(e);
            }
            if Instant::now() >= deadline {
                return Err(anyhow!(
                    "{what} did not happen within {within:?} (logs in {})",
                    self.dir.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for BenchCluster {
    fn drop(&mut self) {
        for p in self.workers.iter_mut().chain(self.replicas.iter_mut()) {
            p.sigkill();
        }
    }
}

async fn channel(addr: &str) -> anyhow::Result<AuthChannel> {
    crate::cli::channel(addr, &Default::default(), Duration::from_secs(2)).await
}

/// Nanoseconds between two boot-clock instants, as milliseconds.
pub fn ms_between(from: u64, to: u64) -> f64 {
    to.saturating_sub(from) as f64 / 1e6
}

/// Now on the clock the role logs use.
pub fn boot_now() -> u64 {
    BootInstant::now().as_nanos()
}
