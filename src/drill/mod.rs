//! `baton drill`: runs a workload, injects faults round after round, then checks the whole
//! history against Baton's guarantees, from etcd, the guards' execution ledger and the role logs.
//!
//! It is how on-call engineers get proof that a failover loses nothing, and how we find our own
//! bugs: the checks must be able to fail, so `--negative-control` runs the replicas with guards
//! that ignore lease deadlines, which a pause fault turns into overlapping executions.

mod check;
mod control;
pub mod history;
mod remote;
mod report;
mod schedules;
mod workload;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::clock::BootInstant;
use crate::config::{ClientArgs, Output};
pub use crate::config::{DrillArgs, ALL_FAULTS};
use crate::devcluster::{free_port, EtcdCluster, FaultProxy, Mode, ReplicaProcess, ReplicaSpec};
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::{GetLeaderRequest, LeaderInfo};
pub use check::{Invariant, Verdict};
use control::Control;
pub use report::{Report, Round};

/// How long a local drill waits for the cluster to finish its work after the faults.
pub const DRAIN_BOUND: Duration = Duration::from_secs(180);

/// A cheap deterministic generator (xorshift64*), so a seed reproduces a drill.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545F4914F6CDD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// The local cluster under drill.
pub(crate) struct Lab {
    pub etcd: EtcdCluster,
    pub replicas: Vec<ReplicaProcess>,
    /// Separate workers; their proxies follow the replicas' in `proxies`.
    pub workers: Vec<ReplicaProcess>,
    pub proxies: Vec<FaultProxy>,
    pub dir: PathBuf,
    pub ttl: Duration,
    pub cluster: String,
}

impl Lab {
    pub fn endpoints(&self) -> Vec<String> {
        self.replicas
            .iter()
            .map(|r| r.listen().to_string())
            .collect()
    }

    pub fn client(&self) -> ClientArgs {
        ClientArgs {
            endpoints: self.endpoints(),
            timeout: Duration::from_secs(2),
            output: Output::Text,
            security: Default::default(),
        }
    }

    pub fn target(&self) -> check::Target {
        check::Target {
            etcd: self.etcd.endpoints(),
            cluster: self.cluster.clone(),
            ledger: Some(self.dir.join("executions.jsonl")),
            role_logs: self
                .replicas
                .iter()
                .map(|r| (r.id().to_string(), r.role_log_path()))
                .collect(),
            exits: self.replicas.iter().flat_map(|r| r.exits()).collect(),
        }
    }

    /// The leader as some live replica answers, and whether it also says it is the leader.
    pub async fn leader(&self) -> Option<(LeaderInfo, bool)> {
        for r in &self.replicas {
            let Ok(ch) = crate::cli::channel(
                &r.listen().to_string(),
                &Default::default(),
                Duration::from_millis(500),
            )
            .await
            else {
                continue;
            };
            if let Ok(resp) = ClusterServiceClient::new(ch)
                .get_leader(GetLeaderRequest {})
                .await
            {
                let resp = resp.into_inner();
                if let Some(l) = resp.leader {
                    let serving = resp.answered_by_leader;
                    return Some((l, serving));
                }
            }
        }
        None
    }

    /// Whether the leader itself answers as leader, for a term above `above`.
    pub async fn serving_above(&self, above: i64) -> Option<LeaderInfo> {
        let (l, _) = self.leader().await?;
        if l.term <= above {
            return None;
        }
        let ch = crate::cli::channel(
            &l.advertise,
            &Default::default(),
            Duration::from_millis(500),
        )
        .await
        .ok()?;
        let resp = ClusterServiceClient::new(ch)
            .get_leader(GetLeaderRequest {})
            .await
            .ok()?
            .into_inner();
        (resp.answered_by_leader && resp.leader.as_ref().map(|x| x.term) == Some(l.term))
            .then_some(l)
    }

    pub fn index_of(&self, id: &str) -> Option<usize> {
        self.replicas.iter().position(|r| r.id() == id)
    }
}

fn start_lab(args: &DrillArgs, dir: &std::path::Path) -> anyhow::Result<Lab> {
    let bin = std::env::current_exe().context("locating the baton binary")?;
    let etcd = EtcdCluster::start(&args.etcd_bin, &dir.join("etcd"), args.etcd_members)?;
    let storage = dir.join("storage");
    let ledger = dir.join("executions.jsonl");
    let mut proxies = Vec::new();
    let mut replicas = Vec::new();
    let mut workers = Vec::new();
    let n_replicas = args.replicas.max(2);
    for i in 0..n_replicas + args.workers {
        let is_worker = i >= n_replicas;
        // Each replica reaches every etcd member through a proxy of its own per member? One
        // proxy to member 0 is enough to cut it off; the others stay direct only with 3 members.
        let target: SocketAddr = etcd.endpoints()[0].parse()?;
        let proxy = FaultProxy::start(target)?;
        let mut endpoints = vec![proxy.addr().to_string()];
        if args.etcd_members > 1 {
            // With several members a replica needs all of them (member 0 may be the one killed);
            // the partition fault then also cuts the direct ones through their own proxies.
            for ep in etcd.endpoints().iter().skip(1) {
                let p = FaultProxy::start(ep.parse()?)?;
                endpoints.push(p.addr().to_string());
                proxies.push((i, p));
            }
        }
        proxies.push((i, proxy));
        let mut extra = vec![
            "--storage-dir".to_string(),
            storage.display().to_string(),
            "--execution-ledger".into(),
            ledger.display().to_string(),
            "--retry-initial-delay".into(),
            "200ms".into(),
            "--cleanup-initial-delay".into(),
            "200ms".into(),
            "--cleanup-max-delay".into(),
            "2s".into(),
            "--kill-grace".into(),
            "2s".into(),
        ];
        if args.negative_control {
            extra.push("--unsafe-ignore-guard-deadlines".into());
        }
        if is_worker {
            // Only the worker's own flags: the coordinator's stay with the replicas.
            extra.drain(4..10);
        } else if args.workers > 0 {
            extra.extend(["--worker".into(), "false".into()]);
        }
        let spec = ReplicaSpec {
            id: if is_worker {
                format!("w{}", i - n_replicas + 1)
            } else {
                format!("r{}", i + 1)
            },
            bin: bin.clone(),
            etcd_endpoints: endpoints,
            cluster: "drill".into(),
            listen: ([127, 0, 0, 1], free_port()).into(),
            lease_ttl: args.lease_ttl,
            dir: dir.join("replicas"),
            extra_args: extra,
            worker: is_worker,
        };
        let p = ReplicaProcess::spawn(spec)?;
        if is_worker {
            workers.push(p);
        } else {
            replicas.push(p);
        }
    }
    let mut by_replica: Vec<Vec<FaultProxy>> = (0..replicas.len() + workers.len())
        .map(|_| Vec::new())
        .collect();
    for (i, p) in proxies {
        by_replica[i].push(p);
    }
    Ok(Lab {
        etcd,
        replicas,
        workers,
        proxies: by_replica.into_iter().flatten().collect(),
        dir: dir.to_path_buf(),
        ttl: args.lease_ttl,
        cluster: "drill".into(),
    })
}

impl Lab {
    /// The proxies of replica `i` (to every etcd member).
    fn set_net(&self, i: usize, mode: Mode, members: usize) {
        for p in &self.proxies[i * members..(i + 1) * members] {
            p.set_mode(mode);
        }
    }
}

/// Runs a drill; the exit code is 0 when every invariant holds.
pub async fn run(args: DrillArgs) -> anyhow::Result<i32> {
    let seed = args.seed.unwrap_or_else(|| BootInstant::now().as_nanos());
    if !args.endpoints.is_empty() {
        anyhow::ensure!(
            args.history.is_none(),
            "--history needs a local drill: the execution ledger of an existing cluster is on its hosts"
        );
        eprintln!(
            "drill: seed {seed}, existing cluster {:?} at {}",
            args.cluster,
            args.endpoints.join(",")
        );
        return remote::run(args, seed).await;
    }
    let mut faults: Vec<String> = if args.faults.is_empty() {
        ALL_FAULTS
            .iter()
            .filter(|f| args.etcd_members >= 3 || **f != "etcd-kill")
            .filter(|f| args.workers > 0 || !f.starts_with("worker-"))
            .map(|s| s.to_string())
            .collect()
    } else {
        args.faults.clone()
    };
    for f in &faults {
        anyhow::ensure!(
            ALL_FAULTS.contains(&f.as_str()),
            "unknown fault {f:?}; known: {}",
            ALL_FAULTS.join(", ")
        );
        anyhow::ensure!(
            f != "etcd-kill" || args.etcd_members >= 3,
            "the etcd-kill fault needs --etcd-members 3 (one member down must leave a quorum)"
        );
        anyhow::ensure!(
            !f.starts_with("worker-") || args.workers > 0,
            "the {f} fault needs separate workers (--workers 2, say)"
        );
    }
    let (tmp, dir) = crate::devcluster::workdir(args.dir.as_deref(), "baton-drill-")?;
    eprintln!("drill: seed {seed}, folder {}", dir.display());
    // From here on a signal ends the drill in order, and --duration counts.
    let control = Control::start(args.duration, args.rounds)?;
    let mut lab = start_lab(&args, &dir)?;
    let mut rng = Rng::new(seed);
    wait_leader(&lab, Duration::from_secs(30))
        .await
        .context("no leader at the start")?;
    let members = args.etcd_members.max(1);
    let sampler = match &args.history {
        Some(_) => Some(history::Sampler::start(&lab.etcd.endpoints()).await?),
        None => None,
    };

    schedules::start(&lab.client(), seed)
        .await
        .context("creating the drill's schedules")?;
    let workload = workload::start(lab.client(), &args, seed, control.stop_token());
    let progress = control.progress(lab.target(), &workload);
    let mut rounds = Vec::new();
    let mut round = 0;
    'faults: loop {
        round += 1;
        if !control.may_inject(round) {
            break;
        }
        if args.shuffle {
            for i in (1..faults.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                faults.swap(i, j);
            }
        }
        for fault in faults.clone() {
            if !control.may_inject(round) {
                break 'faults;
            }
            let r = inject(&mut lab, &fault, round, members, &mut rng).await?;
            control.say(&report::round_line(&r));
            control.fault_done();
            rounds.push(r);
        }
    }
    // A soak (or an interrupted drill) ends its workload with its faults; a drill of rounds
    // makes every planned submission.
    let submitted = if args.duration.is_some() || control.interrupted() {
        workload.stop().await
    } else {
        workload.finish().await
    };
    let target = lab.target();
    schedules::stop(&lab.client(), seed)
        .await
        .context("pausing the drill's schedules")?;
    let drained = control.drain(&target, DRAIN_BOUND).await;
    drop(progress);
    let mut verdicts = check::verify(&target, &submitted, &rounds, drained).await?;
    let ledger = check::ledger(&target);
    verdicts.push(schedules::check(&target, seed, &ledger, control.interrupted()).await?);
    if let (Some(path), Some(sampler), Some(ledger)) = (&args.history, sampler, &target.ledger) {
        let prefix = format!("/baton/{}/", target.cluster);
        let n = history::write(&target.etcd, &prefix, &sampler.stop(), ledger, path).await?;
        eprintln!("drill: history of {n} steps in {}", path.display());
    }
    let mut report = Report::new(
        seed,
        rounds,
        &submitted,
        verdicts,
        dir.display().to_string(),
    );
    report.interrupted = control.interrupted();
    let ok = report.print(args.json);
    for r in lab.replicas.iter_mut() {
        r.stop(Duration::from_secs(10));
    }
    lab.etcd.stop();
    if !ok || report.interrupted {
        if let Some(t) = tmp {
            let kept = t.keep();
            eprintln!(
                "drill: {}; everything kept in {}",
                if ok {
                    "interrupted"
                } else {
                    "invariants violated"
                },
                kept.display()
            );
        }
    }
    Ok(exit_code(ok, report.interrupted))
}

/// 1 when an invariant failed; 130 (as for SIGINT) when interrupted with every invariant
/// holding; 0 otherwise.
pub fn exit_code(passed: bool, interrupted: bool) -> i32 {
    match (passed, interrupted) {
        (false, _) => 1,
        (true, true) => 130,
        (true, false) => 0,
    }
}

async fn wait_leader(lab: &Lab, within: Duration) -> anyhow::Result<LeaderInfo> {
    let until = Instant::now() + within;
    loop {
        if let Some(l) = lab.serving_above(0).await {
            return Ok(l);
        }
        anyhow::ensure!(Instant::now() < until, "no leader within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Injects one fault, measures the failover, and waits until the cluster is whole again.
async fn inject(
    lab: &mut Lab,
    fault: &str,
    round: usize,
    members: usize,
    rng: &mut Rng,
) -> anyhow::Result<Round> {
    if let Some(kind) = fault.strip_prefix("worker-") {
        return worker_fault(lab, fault, kind, round, members, rng).await;
    }
    let leader_fault = !matches!(fault, "etcd-kill" | "follower-kill");
    let mut before = wait_leader(lab, Duration::from_secs(60)).await?;
    if leader_fault {
        // With embedded workers, the fault should cut something the leader's worker runs.
        let on = lab.workers.is_empty().then_some(before.replica_id.as_str());
        check::wait_running(&lab.target(), Duration::from_secs(10), on).await;
        before = wait_leader(lab, Duration::from_secs(60)).await?;
    }
    let k = lab
        .index_of(&before.replica_id)
        .context("the leader is not one of ours")?;
    let dirty_before = check::count_prefix(&lab.target(), "results/dirty/")
        .await
        .unwrap_or(0);
    // The executions a pause leaves running on the leader's embedded worker: the new leader
    // must have started them elsewhere before the pause ends.
    let paused_runs = match fault {
        "pause" => check::running_on(&lab.target(), &before.replica_id),
        _ => Default::default(),
    };
    let t0 = Instant::now();
    let b0 = BootInstant::now();
    // Whose executions this fault may cut: the leader's embedded worker, the follower's, or
    // (etcd down) anyone's.
    let mut faulted = vec![before.replica_id.clone()];
    match fault {
        "kill" => lab.replicas[k].sigkill(),
        "term" => lab.replicas[k].sigterm(),
        "pause" => lab.replicas[k].pause(),
        "partition" => lab.set_net(k, Mode::Blackhole, members),
        "etcd-kill" => {
            let m = rng.below(lab.etcd.size() as u64) as usize;
            faulted = vec!["*".into()];
            lab.etcd.kill_member(m);
            tokio::time::sleep(lab.ttl * 2).await;
            lab.etcd.restart_member(m)?;
        }
        "follower-kill" => {
            let f =
                (k + 1 + rng.below(lab.replicas.len() as u64 - 1) as usize) % lab.replicas.len();
            faulted = vec![lab.replicas[f].id().to_string()];
            lab.replicas[f].sigkill();
            tokio::time::sleep(Duration::from_millis(500)).await;
            lab.replicas[f].restart()?;
        }
        _ => unreachable!("checked"),
    }
    // Measure: until any replica names a new leader, and until that leader serves as leader.
    let deadline = Instant::now() + lab.ttl * 6 + Duration::from_secs(20);
    let mut no_leader = None;
    let mut serving = None;
    let mut new_term = before.term;
    if leader_fault {
        while Instant::now() < deadline && serving.is_none() {
            if let Some((l, _)) = lab.leader().await {
                if l.term > before.term && no_leader.is_none() {
                    no_leader = Some(t0.elapsed());
                }
            }
            if let Some(l) = lab.serving_above(before.term).await {
                serving = Some(t0.elapsed());
                no_leader.get_or_insert(t0.elapsed());
                new_term = l.term;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        anyhow::ensure!(
            serving.is_some(),
            "round {round} {fault}: no new leader within the deadline"
        );
    }
    // Undo the fault.
    match fault {
        "kill" => lab.replicas[k].restart()?,
        "term" => {
            lab.replicas[k].wait_exit(Duration::from_secs(20));
            lab.replicas[k].restart()?;
        }
        "pause" => {
            // Long enough for its embedded worker's key to expire and the new leader to restart
            // that worker's jobs elsewhere (key gone, then TTL + margin): the overlap the guards'
            // deadlines must prevent.
            let held = lab.ttl * 4;
            if t0.elapsed() < held {
                tokio::time::sleep(held - t0.elapsed()).await;
            }
            // On a loaded host the new leader may take longer than the TTLs say: while an
            // execution of the paused worker still runs (its guard did not kill it: the
            // negative control), hold until the new leader has started it elsewhere (bounded),
            // so a resume never ends it first and hides the overlap.
            let bound = Instant::now() + Duration::from_secs(30);
            let worker = &before.replica_id;
            while Instant::now() < bound
                && check::awaiting_restart(&lab.target(), worker, &paused_runs, new_term)
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            lab.replicas[k].resume();
        }
        "partition" => lab.set_net(k, Mode::Pass, members),
        _ => {}
    }
    if lab.etcd.size() > 0 {
        let _ = lab.etcd.wait_ready(Duration::from_secs(30));
    }
    let after = wait_leader(lab, Duration::from_secs(60)).await?;
    if !leader_fault {
        new_term = after.term;
    }
    let resumed = check::first_start_after(&lab.target(), b0, new_term);
    Ok(Round {
        round,
        fault: fault.to_string(),
        old_leader: before.replica_id,
        new_leader: after.replica_id,
        no_leader_ms: no_leader.map(|d| d.as_millis() as u64),
        serving_ms: serving.map(|d| d.as_millis() as u64),
        jobs_running_again_ms: resumed.map(|b| b0.until(b).as_millis() as u64),
        restarted: check::restarted_in(&lab.target(), b0, new_term),
        cleanups_resumed: if leader_fault { dirty_before } else { 0 },
        faulted,
        at_ns: b0.as_nanos(),
    })
}

/// Injects a fault on a separate worker (`kind`: kill, term, pause, partition), holds it long
/// enough for the leader to move the worker's jobs, and undoes it.
async fn worker_fault(
    lab: &mut Lab,
    fault: &str,
    kind: &str,
    round: usize,
    members: usize,
    rng: &mut Rng,
) -> anyhow::Result<Round> {
    let before = wait_leader(lab, Duration::from_secs(60)).await?;
    let w = rng.below(lab.workers.len() as u64) as usize;
    let id = lab.workers[w].id().to_string();
    check::wait_running(&lab.target(), Duration::from_secs(10), Some(&id)).await;
    let node = lab.replicas.len() + w;
    let b0 = BootInstant::now();
    match kind {
        "kill" => {
            lab.workers[w].sigkill();
            tokio::time::sleep(lab.ttl).await;
            lab.workers[w].restart()?;
        }
        "term" => {
            lab.workers[w].sigterm();
            lab.workers[w].wait_exit(Duration::from_secs(30));
            lab.workers[w].restart()?;
        }
        "pause" => {
            // Beyond its key's expiry plus the TTL and margin the leader waits after it.
            lab.workers[w].pause();
            tokio::time::sleep(lab.ttl * 4).await;
            lab.workers[w].resume();
        }
        "partition" => {
            lab.set_net(node, Mode::Blackhole, members);
            tokio::time::sleep(lab.ttl * 4).await;
            lab.set_net(node, Mode::Pass, members);
        }
        _ => unreachable!("checked"),
    }
    let after = wait_leader(lab, Duration::from_secs(60)).await?;
    let resumed = check::first_start_after(&lab.target(), b0, 0);
    Ok(Round {
        round,
        fault: fault.to_string(),
        old_leader: before.replica_id,
        new_leader: after.replica_id,
        no_leader_ms: None,
        serving_ms: None,
        jobs_running_again_ms: resumed.map(|b| b0.until(b).as_millis() as u64),
        restarted: check::restarted_in(&lab.target(), b0, 0),
        cleanups_resumed: 0,
        faulted: vec![id],
        at_ns: b0.as_nanos(),
    })
}
