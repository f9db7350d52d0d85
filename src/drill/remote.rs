//! Drilling an existing cluster (Kubernetes, say): faults through command templates, checks
//! from etcd and the API. The guards' ledgers and the role logs live on other hosts and their
//! clocks are not shared, so invariants 2 and 5 are reported as not checked.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use etcd_client::GetOptions;

use super::check::{self, Target};
use super::control::Control;
use super::{workload, DrillArgs, Report, Rng, Round};
use crate::config::{ClientArgs, Output};
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::{GetLeaderRequest, LeaderInfo};

async fn leader(client: &ClientArgs) -> Option<(LeaderInfo, bool)> {
    crate::cli::call_any(client, |ch| async move {
        let r = ClusterServiceClient::new(ch)
            .get_leader(GetLeaderRequest {})
            .await?
            .into_inner();
        let l = r
            .leader
            .ok_or_else(|| tonic::Status::unavailable("no leader"))?;
        Ok((l, r.answered_by_leader))
    })
    .await
    .ok()
}

/// Replica ids campaigning right now (the election keys' records).
async fn candidates(t: &Target) -> anyhow::Result<BTreeSet<String>> {
    let mut c = etcd_client::Client::connect(&t.etcd, None).await?;
    let p = format!("/baton/{}/election/", t.cluster);
    let r = c.get(p, Some(GetOptions::new().with_prefix())).await?;
    Ok(r.kvs()
        .iter()
        .filter_map(|kv| serde_json::from_slice::<serde_json::Value>(kv.value()).ok())
        .filter_map(|v| v["replica_id"].as_str().map(String::from))
        .collect())
}

fn run_cmd(template: &str, replica: &str) -> anyhow::Result<()> {
    let cmd = template.replace("{replica}", replica);
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(&cmd)
        .status()?;
    if !status.success() {
        bail!("fault command {cmd:?} failed: {status}");
    }
    Ok(())
}

pub async fn run(args: DrillArgs, seed: u64) -> anyhow::Result<i32> {
    anyhow::ensure!(
        !args.etcd_endpoints.is_empty(),
        "--endpoints needs --etcd-endpoints for the checks"
    );
    let faults: Vec<String> = if args.faults.is_empty() {
        vec!["kill".into()]
    } else {
        args.faults.clone()
    };
    for f in &faults {
        let template = match f.as_str() {
            "kill" | "follower-kill" => &args.kill_cmd,
            "term" => &args.term_cmd,
            _ => bail!("fault {f:?} cannot be injected into an existing cluster; use kill, term or follower-kill"),
        };
        anyhow::ensure!(
            template.is_some(),
            "the {f} fault needs --{}-cmd",
            if f == "term" { "term" } else { "kill" }
        );
    }
    let target = Target {
        etcd: args.etcd_endpoints.clone(),
        cluster: args.cluster.clone(),
        ledger: None,
        role_logs: Vec::new(),
        exits: Vec::new(),
    };
    let client = ClientArgs {
        endpoints: args.endpoints.clone(),
        timeout: Duration::from_secs(3),
        output: Output::Text,
        security: args.security.clone(),
    };
    let mut rng = Rng::new(seed);
    let replicas = candidates(&target)
        .await
        .context("reading the candidates from etcd")?;
    anyhow::ensure!(
        !replicas.is_empty(),
        "no replica campaigns in cluster {:?}",
        args.cluster
    );
    let control = Control::start(args.duration, args.rounds)?;
    let workload = workload::start(client.clone(), &args, seed, control.stop_token());
    let progress = control.progress(target.clone(), &workload);
    let mut rounds = Vec::new();
    let mut round = 0;
    'faults: loop {
        round += 1;
        for fault in &faults {
            if !control.may_inject(round) {
                break 'faults;
            }
            check::wait_running(&target, Duration::from_secs(10), None).await;
            let (before, _) = leader(&client)
                .await
                .context("no leader before the fault")?;
            let victim = if fault == "follower-kill" {
                let others: Vec<&String> = replicas
                    .iter()
                    .filter(|r| **r != before.replica_id)
                    .collect();
                anyhow::ensure!(!others.is_empty(), "no follower to kill");
                others[rng.below(others.len() as u64) as usize].clone()
            } else {
                before.replica_id.clone()
            };
            let dirty = check::count_prefix(&target, "results/dirty/")
                .await
                .unwrap_or(0);
            let t0 = Instant::now();
            let b0 = crate::clock::BootInstant::now();
            let template = if fault == "term" {
                &args.term_cmd
            } else {
                &args.kill_cmd
            };
            run_cmd(template.as_deref().unwrap_or_default(), &victim)?;
            let (mut no_leader, mut serving, mut after) = (None, None, before.clone());
            let deadline = Instant::now() + Duration::from_secs(120);
            if fault != "follower-kill" {
                while serving.is_none() && Instant::now() < deadline {
                    if let Some((l, leads)) = leader(&client).await {
                        if l.term > before.term {
                            no_leader.get_or_insert(t0.elapsed());
                            if leads || l.replica_id != victim {
                                serving = Some(t0.elapsed());
                                after = l;
                            }
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                anyhow::ensure!(
                    serving.is_some(),
                    "round {round} {fault}: no new leader within 120s"
                );
            }
            // Wait for the cluster to be whole again (the orchestrator restarts the victim).
            let whole = Instant::now() + args.recovery_wait;
            while candidates(&target).await.map(|c| c.len()).unwrap_or(0) < replicas.len()
                && Instant::now() < whole
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let r = Round {
                round,
                fault: fault.clone(),
                old_leader: before.replica_id.clone(),
                new_leader: after.replica_id.clone(),
                no_leader_ms: no_leader.map(|d| d.as_millis() as u64),
                serving_ms: serving.map(|d| d.as_millis() as u64),
                jobs_running_again_ms: None,
                restarted: 0,
                cleanups_resumed: if fault == "follower-kill" { 0 } else { dirty },
                faulted: vec![victim.clone()],
                at_ns: b0.as_nanos(),
            };
            control.say(&super::report::round_line(&r));
            control.fault_done();
            rounds.push(r);
        }
    }
    let submitted = if args.duration.is_some() || control.interrupted() {
        workload.stop().await
    } else {
        workload.finish().await
    };
    let drained = control.drain(&target, Duration::from_secs(300)).await;
    drop(progress);
    let invariants = check::verify(&target, &submitted, &rounds, drained).await?;
    let mut report = Report::new(seed, rounds, &submitted, invariants, String::new());
    report.interrupted = control.interrupted();
    let ok = report.print(args.json);
    Ok(super::exit_code(ok, report.interrupted))
}
