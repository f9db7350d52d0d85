//! Test harness: a real etcd (own temp dir, free loopback ports), real `baton serve` processes,
//! and fault proxies between replicas and etcd. Every wait is a condition with a deadline.
#![allow(dead_code, unused_imports)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use baton::devcluster::{free_port, EtcdCluster, FaultProxy, Mode, ReplicaProcess, ReplicaSpec};
use baton::proto::cluster_service_client::ClusterServiceClient;
use baton::proto::{GetLeaderRequest, GetLeaderResponse, LeaderInfo};
use baton::rolelog::{self, RoleEvent, TermInterval};

pub mod browser;
pub mod pki;

pub const BIN: &str = env!("CARGO_BIN_EXE_baton");

/// `baton-guard` next to [`BIN`], where the worker finds it by default: `make build` and
/// `make test` put the shipped (static) build there through `scripts/build-guard`, which a
/// bare `cargo test` does not run; so the program must answer `source` with the fingerprint of
/// the guard's sources these tests were built from.
pub fn guard_bin() -> &'static str {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let path = std::path::Path::new(BIN).with_file_name("baton-guard");
        let built = std::process::Command::new(&path).arg("source").output();
        let answer = match &built {
            Ok(out) => String::from_utf8_lossy(&out.stdout).trim().to_string(),
            Err(e) => format!("none ({e})"),
        };
        assert_eq!(
            answer,
            baton_guard::SOURCE,
            "the guard program at {} was not built from these sources: run \
             `./scripts/build-guard` (make build and make test do)",
            path.display()
        );
        path.to_string_lossy().into_owned()
    })
}

/// Starts etcd (`BATON_ETCD_BIN`, else `etcd` on the PATH), or fails the test with the install
/// hint when the binary is missing. Every test that starts etcd may start workers, whose guard
/// program is checked first ([`guard_bin`]).
pub fn start_etcd(dir: &std::path::Path, members: usize) -> EtcdCluster {
    guard_bin();
    let bin = std::env::var_os("BATON_ETCD_BIN").unwrap_or_else(|| "etcd".into());
    match EtcdCluster::start(std::path::Path::new(&bin), dir, members) {
        Ok(c) => c,
        Err(e) => panic!("cannot start etcd for the tests: {e}"),
    }
}

pub struct Options {
    pub replicas: usize,
    pub etcd_members: usize,
    pub ttl: Duration,
    /// Put a fault proxy between each replica (and each worker) and etcd member 0.
    pub proxied: bool,
    /// For the replicas.
    pub extra_args: Vec<String>,
    /// Separate `baton worker` processes (`w1`, `w2`, ...).
    pub workers: usize,
    /// Only for the separate workers.
    pub worker_args: Vec<String>,
    /// Whether replicas run an embedded worker (`--worker`).
    pub embedded: bool,
    /// Give every replica and separate worker `--metrics-listen` on a free port.
    pub metrics: bool,
    /// Give every replica `--http-listen` on a free port.
    pub http: bool,
    /// What each replica advertises.
    pub advertise: Advertise,
}

/// What each replica advertises to the others.
#[derive(Clone, Debug, Default)]
pub enum Advertise {
    /// Its listen address (`127.0.0.1:port`).
    #[default]
    Listen,
    /// `0.0.0.0:port`: unspecified.
    Unspecified,
    /// `localhost:port`.
    Localhost,
    /// Replica `i` advertises a fault proxy (`Cluster::advertised[i]`) that forwards to replica
    /// `v[i]`'s listen address.
    Proxy(Vec<usize>),
}

impl Default for Options {
    fn default() -> Self {
        Options {
            replicas: 3,
            etcd_members: 1,
            ttl: Duration::from_secs(2),
            proxied: false,
            extra_args: Vec::new(),
            workers: 0,
            worker_args: Vec::new(),
            embedded: true,
            metrics: false,
            http: false,
            advertise: Advertise::Listen,
        }
    }
}

pub struct Cluster {
    pub replicas: Vec<ReplicaProcess>,
    pub proxies: Vec<FaultProxy>,
    pub workers: Vec<ReplicaProcess>,
    pub worker_proxies: Vec<FaultProxy>,
    pub etcd: EtcdCluster,
    pub ttl: Duration,
    pub cluster: String,
    pub dir: tempfile::TempDir,
    /// `/metrics` of each replica and of each separate worker, with [`Options::metrics`].
    pub replica_metrics: Vec<SocketAddr>,
    pub worker_metrics: Vec<SocketAddr>,
    /// The HTTP API of each replica, with [`Options::http`].
    pub replica_http: Vec<SocketAddr>,
    /// With [`Advertise::Proxy`]: the proxy each replica advertises.
    pub advertised: Vec<FaultProxy>,
}

impl Cluster {
    pub fn start(opts: Options) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("baton-test-")
            .tempdir()
            .unwrap();
        let etcd = start_etcd(&dir.path().join("etcd"), opts.etcd_members);
        let storage = dir.path().join("storage");
        let mut proxies = Vec::new();
        let mut replicas = Vec::new();
        let mut worker_proxies = Vec::new();
        let mut workers = Vec::new();
        let endpoints = |proxies: &mut Vec<FaultProxy>| {
            if opts.proxied {
                let target: SocketAddr = etcd.endpoints()[0].parse().unwrap();
                let p = FaultProxy::start(target).unwrap();
                let ep = vec![p.addr().to_string()];
                proxies.push(p);
                ep
            } else {
                etcd.endpoints()
            }
        };
        let (mut replica_metrics, mut worker_metrics) = (Vec::new(), Vec::new());
        let common = |extra: &[String], metrics: &mut Vec<SocketAddr>| -> Vec<String> {
            let mut args = vec!["--storage-dir".to_string(), storage.display().to_string()];
            if opts.metrics {
                let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
                args.extend(["--metrics-listen".to_string(), addr.to_string()]);
                metrics.push(addr);
            }
            [args, extra.to_vec()].concat()
        };
        let mut replica_http = Vec::new();
        let listens: Vec<SocketAddr> = (0..opts.replicas)
            .map(|_| ([127, 0, 0, 1], free_port()).into())
            .collect();
        let mut advertised = Vec::new();
        for i in 0..opts.replicas {
            let advertise = match &opts.advertise {
                Advertise::Listen => None,
                Advertise::Unspecified => Some(format!("0.0.0.0:{}", listens[i].port())),
                Advertise::Localhost => Some(format!("localhost:{}", listens[i].port())),
                Advertise::Proxy(to) => {
                    let p = FaultProxy::start(listens[to[i]]).unwrap();
                    let a = p.addr().to_string();
                    advertised.push(p);
                    Some(a)
                }
            };
            let mut embedded = [
                vec!["--worker".to_string(), opts.embedded.to_string()],
                opts.extra_args.clone(),
            ]
            .concat();
            if opts.http {
                let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
                embedded.extend(["--http-listen".to_string(), addr.to_string()]);
                replica_http.push(addr);
            }
            if let Some(a) = advertise {
                embedded.extend(["--advertise".to_string(), a]);
            }
            let spec = ReplicaSpec {
                id: format!("r{}", i + 1),
                bin: BIN.into(),
                etcd_endpoints: endpoints(&mut proxies),
                cluster: "test".into(),
                listen: listens[i],
                lease_ttl: opts.ttl,
                dir: dir.path().join("replicas"),
                extra_args: common(&embedded, &mut replica_metrics),
                worker: false,
            };
            replicas.push(ReplicaProcess::spawn(spec).unwrap());
        }
        for i in 0..opts.workers {
            let spec = ReplicaSpec {
                id: format!("w{}", i + 1),
                bin: BIN.into(),
                etcd_endpoints: endpoints(&mut worker_proxies),
                cluster: "test".into(),
                listen: ([127, 0, 0, 1], free_port()).into(),
                lease_ttl: opts.ttl,
                dir: dir.path().join("replicas"),
                extra_args: common(&opts.worker_args, &mut worker_metrics),
                worker: true,
            };
            workers.push(ReplicaProcess::spawn(spec).unwrap());
        }
        Cluster {
            replicas,
            proxies,
            workers,
            worker_proxies,
            etcd,
            ttl: opts.ttl,
            cluster: "test".into(),
            dir,
            replica_metrics,
            worker_metrics,
            replica_http,
            advertised,
        }
    }

    pub fn index_of(&self, replica_id: &str) -> usize {
        self.replicas
            .iter()
            .position(|r| r.id() == replica_id)
            .unwrap_or_else(|| panic!("no replica {replica_id}"))
    }

    /// `GetLeader` answered by replica `i`.
    pub async fn get_leader(&self, i: usize) -> Result<GetLeaderResponse, String> {
        get_leader_at(self.replicas[i].listen()).await
    }

    /// Waits until every replica in `among` names the same confirmed leader, one of `among`,
    /// whose term satisfies `term_ok`. Returns that leader.
    pub async fn wait_leader(
        &self,
        among: &[usize],
        within: Duration,
        term_ok: impl Fn(i64) -> bool,
    ) -> LeaderInfo {
        let ids: Vec<String> = among
            .iter()
            .map(|&i| self.replicas[i].id().to_string())
            .collect();
        wait_for("all replicas to agree on one leader", within, || async {
            let mut agreed: Option<LeaderInfo> = None;
            for &i in among {
                let l = self.get_leader(i).await.ok()?.leader?;
                if agreed.as_ref().is_some_and(|a| a != &l) {
                    return None;
                }
                agreed = Some(l);
            }
            // Confirmed (its elected_at written): what replicas name until the term ends.
            agreed.filter(|l| {
                l.elected_at.is_some() && ids.contains(&l.replica_id) && term_ok(l.term)
            })
        })
        .await
    }

    pub fn all_indices(&self) -> Vec<usize> {
        (0..self.replicas.len()).collect()
    }

    /// Every replica but `k`.
    pub fn others(&self, k: usize) -> Vec<usize> {
        self.all_indices().into_iter().filter(|&i| i != k).collect()
    }

    /// The replica all agree leads, with its index.
    pub async fn leader_index(&self) -> (usize, LeaderInfo) {
        let l = self
            .wait_leader(&self.all_indices(), Duration::from_secs(60), |_| true)
            .await;
        (self.index_of(&l.replica_id), l)
    }

    /// Starts another separate worker (`w<n>`) with these extra arguments.
    pub fn add_worker(&mut self, extra: &[&str]) -> usize {
        let direct = self.etcd.endpoints();
        self.add_worker_via(direct, extra)
    }

    /// [`Cluster::add_worker`], reaching etcd through `endpoints` (a fault proxy, say).
    pub fn add_worker_via(&mut self, endpoints: Vec<String>, extra: &[&str]) -> usize {
        let n = self.workers.len() + 1;
        let base = self.replicas.first().map(|r| r.spec().clone()).unwrap();
        let mut args = vec![
            "--storage-dir".to_string(),
            self.storage().display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let spec = ReplicaSpec {
            id: format!("w{n}"),
            listen: ([127, 0, 0, 1], free_port()).into(),
            etcd_endpoints: endpoints,
            extra_args: args,
            worker: true,
            ..base
        };
        self.workers.push(ReplicaProcess::spawn(spec).unwrap());
        self.workers.len() - 1
    }

    /// Waits until etcd lists exactly these worker ids as live.
    pub async fn wait_workers(&self, ids: &[&str]) {
        let mut want: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        want.sort();
        let prefix = format!("/baton/{}/workers/", self.cluster);
        wait_for(
            &format!("workers {want:?} to be registered"),
            Duration::from_secs(30),
            || async {
                let mut client = etcd_client::Client::connect(self.etcd.endpoints(), None)
                    .await
                    .ok()?;
                let resp = client
                    .get(
                        prefix.clone(),
                        Some(etcd_client::GetOptions::new().with_prefix()),
                    )
                    .await
                    .ok()?;
                let mut have: Vec<String> = resp
                    .kvs()
                    .iter()
                    .map(|kv| String::from_utf8_lossy(&kv.key()[prefix.len()..]).into_owned())
                    .collect();
                have.sort();
                (have == want).then_some(())
            },
        )
        .await;
    }

    /// The registry entry of a job as JSON, if any.
    pub async fn registry_entry(&self, id: &str) -> Option<serde_json::Value> {
        let mut client = etcd_client::Client::connect(self.etcd.endpoints(), None)
            .await
            .ok()?;
        let key = format!("/baton/{}/registry/{id}", self.cluster);
        let resp = client.get(key, None).await.ok()?;
        let kv = resp.kvs().first()?;
        serde_json::from_slice(kv.value()).ok()
    }

    pub fn role_events(&self) -> Vec<RoleEvent> {
        self.replicas.iter().flat_map(|r| r.role_events()).collect()
    }

    /// When each replica process was seen to exit.
    pub fn exits(&self) -> Vec<rolelog::Exit> {
        self.replicas.iter().flat_map(|r| r.exits()).collect()
    }

    /// Every term in the role logs; fails the test if any two overlap (a term ends at its
    /// process's exit at the latest) or if a revoke on evidence preceded its leader's exit.
    pub fn checked_terms(&self) -> Vec<TermInterval> {
        let events = self.role_events();
        let exits = self.exits();
        let terms = rolelog::terms_until_exits(&events, &exits);
        if let Err(o) = rolelog::check_terms(&terms) {
            panic!("leadership intervals overlap: {o}\nall terms: {terms:#?}");
        }
        let unproven = rolelog::unproven_revokes(&events, &exits);
        assert!(unproven.is_empty(), "{unproven:#?}");
        terms
    }

    /// Every election key (candidates and the leader) with its create revision.
    pub async fn candidate_keys(&self) -> Vec<(String, i64)> {
        let mut client = etcd_client::Client::connect(self.etcd.endpoints(), None)
            .await
            .unwrap();
        let prefix = format!("/baton/{}/election/", self.cluster);
        let resp = client
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .unwrap();
        let mut keys: Vec<(String, i64)> = resp
            .kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.create_revision(),
                )
            })
            .collect();
        keys.sort();
        keys
    }

    /// Waits until `replica` campaigns (or leads) with a lease other than `old_lease`.
    pub async fn wait_candidate_on_new_lease(&self, replica: &str, old_lease: i64) {
        let client = etcd_client::Client::connect(self.etcd.endpoints(), None)
            .await
            .unwrap();
        let prefix = format!("/baton/{}/election/", self.cluster);
        wait_for(
            "the replica to campaign again on a new lease",
            Duration::from_secs(20),
            || {
                let mut client = client.clone();
                let prefix = prefix.clone();
                async move {
                    let resp = client
                        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
                        .await
                        .ok()?;
                    resp.kvs()
                        .iter()
                        .any(|kv| {
                            let v: serde_json::Value = serde_json::from_slice(kv.value()).unwrap();
                            v["replica_id"] == replica && kv.lease() != old_lease
                        })
                        .then_some(())
                }
            },
        )
        .await;
    }

    pub fn proxy(&self, i: usize) -> &FaultProxy {
        &self.proxies[i]
    }

    pub fn cut_off(&self, i: usize) {
        self.proxies[i].set_mode(Mode::Blackhole);
    }

    pub fn reconnect(&self, i: usize) {
        self.proxies[i].set_mode(Mode::Pass);
    }

    pub fn log_of(&self, i: usize) -> String {
        std::fs::read_to_string(self.replicas[i].log_path()).unwrap_or_default()
    }

    pub fn logs_dir(&self) -> PathBuf {
        self.dir.path().join("replicas")
    }

    /// The shared storage folder (`--storage-dir`) of every replica.
    pub fn storage(&self) -> PathBuf {
        self.dir.path().join("storage")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Keep the logs of a failed test for a human to read.
            let kept = self.dir.path().to_path_buf();
            eprintln!("test failed; logs kept in {}", kept.display());
            // CI keeps only what the test printed: each process's state and its last warnings.
            for p in self.replicas.iter_mut().chain(self.workers.iter_mut()) {
                let log = std::fs::read_to_string(p.log_path()).unwrap_or_default();
                let notable: Vec<&str> = log
                    .lines()
                    .filter(|l| {
                        l.contains("\"WARN\"") || l.contains("\"ERROR\"") || !l.starts_with('{')
                    })
                    .collect();
                let exit = p
                    .try_exit()
                    .map_or("running".to_string(), |s| s.to_string());
                eprintln!("{} ({}, pid {}): {exit}", p.id(), p.listen(), p.pid());
                for l in &notable[notable.len().saturating_sub(8)..] {
                    eprintln!("  {}", l.chars().take(400).collect::<String>());
                }
            }
            let _ = std::mem::replace(
                &mut self.dir,
                tempfile::Builder::new()
                    .prefix("baton-empty-")
                    .tempdir()
                    .unwrap(),
            )
            .keep();
        }
    }
}

pub async fn get_leader_at(addr: SocketAddr) -> Result<GetLeaderResponse, String> {
    let ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(2));
    let ch = ep.connect().await.map_err(|e| e.to_string())?;
    ClusterServiceClient::new(ch)
        .get_leader(GetLeaderRequest {})
        .await
        .map(|r| r.into_inner())
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

/// Polls `check` until it yields a value; panics with `what` after `within`.
pub async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    wait_seeing(what, within, || {
        let f = check();
        async move { f.await.ok_or(None::<String>) }
    })
    .await
}

/// Polls `check` until it yields `Ok`; an `Err(Some(seen))` says what it saw instead, and the
/// panic after `within` names the last such sight as well as `what`.
pub async fn wait_seeing<T, S, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    S: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Option<S>>>,
{
    let deadline = Instant::now() + within;
    let mut seen = None;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(now) => seen = now.or(seen),
        }
        if Instant::now() >= deadline {
            match seen {
                Some(s) => {
                    panic!("timed out after {within:?} waiting for {what}; last seen: {s:?}")
                }
                None => panic!("timed out after {within:?} waiting for {what}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Synchronous variant for conditions on files and processes.
pub async fn wait_until(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    wait_for(what, within, || {
        let ok = check();
        async move { ok.then_some(()) }
    })
    .await
}

/// The events of `replica` in its role log.
pub fn events_of<'a>(events: &'a [RoleEvent], replica: &str) -> Vec<&'a RoleEvent> {
    events.iter().filter(|e| e.replica == replica).collect()
}

pub fn ms(d: Duration) -> u128 {
    d.as_millis()
}

pub use baton::proto::job_service_client::JobServiceClient;
pub use baton::proto::{
    CancelJobRequest, GetJobRequest, Job, JobSpec, JobState, SubmitJobRequest, WatchJobRequest,
};

pub type Jobs = JobServiceClient<tonic::transport::Channel>;

/// A client of the replica at `addr`, waiting for it to listen: a replica just started may
/// still be reaching etcd (a loaded machine makes that take seconds).
pub async fn jobs_at(addr: SocketAddr) -> Jobs {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10));
    let ch = wait_for(
        &format!("the replica at {addr} to accept connections"),
        Duration::from_secs(60),
        || async { endpoint.connect().await.ok() },
    )
    .await;
    JobServiceClient::new(ch)
}

/// The jobs' folders under a storage folder, in every bucket.
pub fn job_folders(storage: &Path) -> usize {
    let Ok(root) = std::fs::read_dir(baton::exec::record::jobs_root(storage)) else {
        return 0;
    };
    root.flatten()
        .filter_map(|b| std::fs::read_dir(b.path()).ok())
        .map(|d| d.count())
        .sum()
}

/// A spec running `sh -c script`.
pub fn sh(script: &str) -> JobSpec {
    JobSpec {
        command: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

impl Cluster {
    pub async fn jobs(&self, i: usize) -> Jobs {
        jobs_at(self.replicas[i].listen()).await
    }

    pub async fn submit(&self, i: usize, id: &str, spec: JobSpec) -> Job {
        let mut c = self.jobs(i).await;
        c.submit_job(SubmitJobRequest {
            job_id: id.into(),
            spec: Some(spec),
        })
        .await
        .unwrap_or_else(|s| panic!("submit {id}: {s}"))
        .into_inner()
        .job
        .unwrap()
    }

    /// `None` also while replica `i` does not answer (killed, or restarting).
    pub async fn get_job(&self, i: usize, id: &str) -> Option<Job> {
        let ch = tonic::transport::Endpoint::from_shared(format!(
            "http://{}",
            self.replicas[i].listen()
        ))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .ok()?;
        let mut c = JobServiceClient::new(ch);
        c.get_job(GetJobRequest { job_id: id.into() })
            .await
            .ok()
            .map(|r| r.into_inner())
    }

    /// Waits until job `id`, read through any live replica in `via`, satisfies `ok`.
    pub async fn wait_job(
        &self,
        via: &[usize],
        id: &str,
        within: Duration,
        what: &str,
        ok: impl Fn(&Job) -> bool,
    ) -> Job {
        wait_for(&format!("job {id} to be {what}"), within, || async {
            for &i in via {
                if let Some(j) = self.get_job(i, id).await {
                    return ok(&j).then_some(j);
                }
            }
            None
        })
        .await
    }

    pub fn job_dir(&self, id: &str) -> PathBuf {
        baton::exec::record::job_dir(&self.storage(), id)
    }

    pub fn exit_record(&self, id: &str, attempt: u32) -> Option<baton::exec::record::ExitRecord> {
        baton::exec::record::read_exit(&self.job_dir(id), &format!("attempt-{attempt}"))
    }

    /// Waits for any replica in `among` to lead with a term above `above`; returns its index.
    pub async fn wait_new_leader(&self, among: &[usize], above: i64) -> (usize, LeaderInfo) {
        let l = self
            .wait_leader(among, self.ttl * 3 + Duration::from_secs(10), |t| t > above)
            .await;
        (self.index_of(&l.replica_id), l)
    }
}

pub fn cleanup_state(j: &Job) -> baton::proto::CleanupState {
    j.cleanup
        .as_ref()
        .and_then(|c| baton::proto::CleanupState::try_from(c.state).ok())
        .unwrap_or(baton::proto::CleanupState::Unspecified)
}

/// The job's cleanup is done: its result is clean.
pub fn clean(j: &Job) -> bool {
    cleanup_state(j) == baton::proto::CleanupState::CleanupDone
}

/// The lines of a file a test's jobs append to (none while it is missing).
pub fn lines(p: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

/// A folder of the test's own, outside any job's.
pub fn ledger_dir() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().to_path_buf();
    (t, p)
}

pub fn state(j: &Job) -> JobState {
    JobState::try_from(j.state).unwrap_or(JobState::Unspecified)
}

pub fn terminal(j: &Job) -> bool {
    matches!(
        state(j),
        JobState::Finished | JobState::Failed | JobState::Canceled
    )
}

/// Field `n` (1-based, as in proc(5)) of `/proc/<pid>/stat`.
pub fn stat_field(pid: i32, n: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(n - 3).map(str::to_string)
}

/// Whether a process is alive (a zombie counts as dead).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// Complete lines in a file a job appends to (0 while it is missing). A file that exists may
/// still be empty: the shell creates it before it writes.
pub fn line_count(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.matches('\n').count())
        .unwrap_or(0)
}

pub fn read_pids(path: &std::path::Path) -> Vec<i32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Runs the `baton` CLI; panics if it has not exited within `within`. Returns its exit code,
/// stdout and stderr.
pub fn run_cli(args: &[&str], within: Duration) -> (Option<i32>, String, String) {
    use std::io::Read;
    let mut child = std::process::Command::new(BIN)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = std::time::Instant::now() + within;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("baton {args:?} did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.code(), out.join().unwrap(), err.join().unwrap())
}

/// Coordinators only (their cleanup held, so job folders stay), and `workers` separate
/// workers with `worker_args`.
pub fn worker_opts(workers: usize, worker_args: &[&str]) -> Options {
    Options {
        embedded: false,
        workers,
        worker_args: worker_args.iter().map(|s| s.to_string()).collect(),
        extra_args: vec!["--cleanup-pause-after-stage".into(), "0".into()],
        ..Options::default()
    }
}

/// `Identify` on the replica at `addr`, if it answers.
pub async fn identify_at(addr: SocketAddr) -> Option<baton::proto::Identity> {
    use baton::proto::cluster_service_client::ClusterServiceClient;
    let mut c = ClusterServiceClient::connect(format!("http://{addr}"))
        .await
        .ok()?;
    Some(
        c.identify(baton::proto::IdentifyRequest {})
            .await
            .ok()?
            .into_inner(),
    )
}

/// Every `leader_process_gone` (a revoke on evidence) in the role logs.
pub fn revokes(c: &Cluster) -> Vec<RoleEvent> {
    c.role_events()
        .into_iter()
        .filter(|e| e.event == "leader_process_gone")
        .collect()
}

/// Whether replica `i` has logged that it watches the leader of `term` (fast failover).
pub fn watching(c: &Cluster, i: usize, term: i64) -> bool {
    c.replicas[i].watches_leader_of(term)
}

/// Notes each execution (`<attempt> <worker>`) in `out/<id>`, runs until `out/<gate>` exists.
pub fn gated(out: &std::path::Path, gate: &str) -> JobSpec {
    let mut spec = sh(&format!(
        "echo \"$BATON_ATTEMPT $BATON_WORKER\" >> \"$OUT/$BATON_JOB_ID\"; \
         while [ ! -e \"$OUT/{gate}\" ]; do sleep 0.1; done"
    ));
    spec.env.insert("OUT".into(), out.display().to_string());
    spec
}

/// Notes each execution in `out/<id>` and ends after `secs`.
pub fn brief(out: &std::path::Path, secs: f32) -> JobSpec {
    let mut spec = sh(&format!(
        "echo \"$BATON_ATTEMPT $BATON_WORKER\" >> \"$OUT/$BATON_JOB_ID\"; sleep {secs}"
    ));
    spec.env.insert("OUT".into(), out.display().to_string());
    spec
}

/// How many executions of `id` the jobs of [`gated`] and [`brief`] noted.
pub fn runs(out: &std::path::Path, id: &str) -> usize {
    line_count(&out.join(id))
}

/// A folder for what test jobs write.
pub fn scratch(c: &Cluster) -> PathBuf {
    let d = c.dir.path().join("out");
    std::fs::create_dir_all(&d).unwrap();
    d
}
