//! Workers apart from leadership, on real processes and a real etcd: a leader change restarts
//! nothing, a rolling restart of the coordinators restarts nothing, a lost worker's jobs move
//! only once they cannot be running any more, an exit during a short outage is recorded once,
//! an unanswered assignment is taken back, and jobs wait for a worker when there is none.

mod support;

use std::path::Path;
use std::time::Duration;

use baton::devcluster::etcd::http_get;
use baton::devcluster::{FaultProxy, Mode};
use baton::exec::record::KilledBy;
use support::*;

const LONG: Duration = Duration::from_secs(60);
/// A SIGTERMed coordinator's exit: past its own shutdown limits (10 s of grace, then 5 s for
/// the API), with room for a loaded machine.
const EXIT: Duration = Duration::from_secs(30);

/// A job that notes each of its executions in `out/<id>` and runs until `out/release` exists.
fn held(out: &Path) -> JobSpec {
    gated(out, "release")
}

/// Every job started once and each still runs its first attempt; then they are released and
/// finish with one attempt and no recovery each.
async fn all_ran_once(c: &Cluster, out: &Path, ids: &[String]) -> usize {
    let all = c.all_indices();
    std::fs::write(out.join("release"), "").unwrap();
    let mut restarts = 0;
    for id in ids {
        let j = c.wait_job(&all, id, LONG, "terminal", terminal).await;
        assert_eq!(state(&j), JobState::Finished, "{id}: {j:?}");
        restarts += runs(out, id) - 1;
        assert_eq!((j.attempts, j.recoveries), (1, 0), "{id}: {j:?}");
    }
    restarts
}

async fn submit_held(c: &Cluster, out: &Path, n: usize) -> Vec<String> {
    let ids: Vec<String> = (0..n).map(|i| format!("h{i}")).collect();
    for id in &ids {
        c.submit(0, id, held(out)).await;
    }
    for id in &ids {
        wait_until("every job to start", LONG, || runs(out, id) == 1).await;
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_sigkill_handover_and_resign_restart_none_of_twenty_jobs_on_workers() {
    let mut c = Cluster::start(Options {
        metrics: true,
        ..worker_opts(2, &[])
    });
    let (k, first) = c.leader_index().await;
    c.wait_workers(&["w1", "w2"]).await;
    // The leader learns of workers from its watch, a moment after etcd: jobs submitted before
    // it knows both would all go to one.
    let addr = c.replica_metrics[k].to_string();
    wait_until("the leader to count both workers live", LONG, || {
        http_get(&addr, "/metrics", Duration::from_secs(2))
            .is_some_and(|m| m.lines().any(|l| l == "baton_workers{state=\"live\"} 2"))
    })
    .await;
    let out = scratch(&c);
    let ids = submit_held(&c, &out, 20).await;
    let spread: std::collections::BTreeSet<String> = ids
        .iter()
        .map(|id| std::fs::read_to_string(out.join(id)).unwrap())
        .collect();
    assert!(spread.len() == 2, "jobs go to both workers: {spread:?}");

    // SIGKILL of the leader.
    let (k, _) = c.leader_index().await;
    c.replicas[k].sigkill();
    let (k2, second) = c.wait_new_leader(&c.others(k), first.term).await;
    c.replicas[k].restart().unwrap();
    // SIGTERM handover.
    c.replicas[k2].sigterm();
    assert!(c.replicas[k2].wait_exit(EXIT).is_some());
    let (_, third) = c.wait_new_leader(&c.others(k2), second.term).await;
    c.replicas[k2].restart().unwrap();
    // `leader resign`.
    let eps: Vec<String> = c.replicas.iter().map(|r| r.listen().to_string()).collect();
    let resign = std::process::Command::new(BIN)
        .args(["leader", "resign", "--endpoints", &eps.join(",")])
        .output()
        .unwrap();
    assert!(resign.status.success(), "{resign:?}");
    c.wait_new_leader(&c.all_indices(), third.term).await;

    for id in &ids {
        assert_eq!(runs(&out, id), 1, "{id} was restarted by a leader change");
        let e = c.registry_entry(id).await.expect("still running");
        assert_eq!(e["status"], "RUNNING", "{id}: {e}");
        assert_eq!(e["attempt"], 1, "{id}: {e}");
    }
    assert_eq!(all_ran_once(&c, &out, &ids).await, 0);
    c.checked_terms();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_three_coordinators_restarts_nothing() {
    let mut c = Cluster::start(worker_opts(2, &[]));
    c.leader_index().await;
    c.wait_workers(&["w1", "w2"]).await;
    let out = scratch(&c);
    let ids = submit_held(&c, &out, 6).await;
    for i in 0..3 {
        c.replicas[i].sigterm();
        assert!(c.replicas[i].wait_exit(EXIT).is_some());
        c.replicas[i].restart().unwrap();
        c.leader_index().await;
    }
    let (k, l) = c.leader_index().await;
    c.replicas[k].sigkill();
    c.wait_new_leader(&c.others(k), l.term).await;
    c.replicas[k].restart().unwrap();
    let restarts = all_ran_once(&c, &out, &ids).await;
    println!(
        "rolling restart of 3 coordinators and a leader SIGKILL: {restarts} restarts over {} jobs",
        ids.len()
    );
    assert_eq!(restarts, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_exits_during_a_short_worker_outage_is_recorded_once() {
    let c = Cluster::start(Options {
        ttl: Duration::from_secs(6),
        proxied: true,
        ..worker_opts(1, &[])
    });
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    let mut spec = sh("echo run >> \"$OUT/brief\"; sleep 1; exit 0");
    spec.env.insert("OUT".into(), out.display().to_string());
    c.submit(0, "brief", spec).await;
    wait_until("the job to start", LONG, || runs(&out, "brief") == 1).await;
    c.worker_proxies[0].set_mode(baton::devcluster::Mode::Blackhole);
    wait_until("the job to exit while its worker is cut off", LONG, || {
        c.exit_record("brief", 1).is_some()
    })
    .await;
    assert_eq!(c.exit_record("brief", 1).unwrap().killed_by, None);
    c.worker_proxies[0].set_mode(baton::devcluster::Mode::Pass);
    let j = c
        .wait_job(&c.all_indices(), "brief", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished, "{j:?}");
    assert_eq!((j.attempts, j.recoveries), (1, 0));
    assert_eq!(runs(&out, "brief"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_beyond_its_ttl_kills_its_job_before_it_runs_elsewhere() {
    let mut c = Cluster::start(Options {
        proxied: true,
        ..worker_opts(1, &[])
    });
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    let mut spec = sh("echo run >> \"$OUT/cut\"; [ \"$BATON_ATTEMPT\" = 1 ] && sleep 60; exit 0");
    spec.env.insert("OUT".into(), out.display().to_string());
    c.submit(0, "cut", spec).await;
    wait_until("the job to start", LONG, || runs(&out, "cut") == 1).await;
    c.add_worker(&[]);
    c.wait_workers(&["w1", "w2"]).await;
    c.worker_proxies[0].set_mode(baton::devcluster::Mode::Blackhole);
    let j = c
        .wait_job(&c.all_indices(), "cut", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished);
    let first = c.exit_record("cut", 1).unwrap();
    let second = c.exit_record("cut", 2).unwrap();
    assert_eq!(first.killed_by, Some(KilledBy::Deadline));
    assert!(
        first.ended_boottime_ns < second.started_boottime_ns,
        "overlap: {first:?} {second:?}"
    );
    c.worker_proxies[0].set_mode(baton::devcluster::Mode::Pass);
    c.wait_workers(&["w1", "w2"]).await;
    assert_eq!(runs(&out, "cut"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_key_revoked_early_stops_its_job_before_it_runs_elsewhere() {
    let mut c = Cluster::start(worker_opts(1, &[]));
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    let mut spec =
        sh("echo run >> \"$OUT/revoked\"; [ \"$BATON_ATTEMPT\" = 1 ] && sleep 60; exit 0");
    spec.env.insert("OUT".into(), out.display().to_string());
    c.submit(0, "revoked", spec).await;
    wait_until("the job to start", LONG, || runs(&out, "revoked") == 1).await;
    c.add_worker(&[]);
    c.wait_workers(&["w1", "w2"]).await;
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    let kv = client
        .get("/baton/test/workers/w1", None)
        .await
        .unwrap()
        .kvs()
        .first()
        .cloned()
        .unwrap();
    client.lease_revoke(kv.lease()).await.unwrap();
    let j = c
        .wait_job(&c.all_indices(), "revoked", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished);
    let first = c.exit_record("revoked", 1).unwrap();
    let second = c.exit_record("revoked", 2).unwrap();
    assert!(
        first.ended_boottime_ns < second.started_boottime_ns,
        "overlap: {first:?} {second:?}"
    );
    c.wait_workers(&["w1", "w2"]).await;
}

/// Job `id` (`sh -c script`, `$OUT` its scratch folder) running on w1, which reaches etcd
/// through a proxy while its lease keepalives go straight to etcd: cut off, it keeps proving
/// its lease and never learns that its key was deleted.
async fn running_on_a_worker_behind_a_proxy(id: &str, script: &str) -> (Cluster, FaultProxy) {
    let mut c = Cluster::start(worker_opts(0, &[]));
    c.leader_index().await;
    let direct = c.etcd.endpoints();
    let proxy = FaultProxy::start(direct[0].parse().unwrap()).unwrap();
    let keepalives = direct.join(",");
    c.add_worker_via(
        vec![proxy.addr().to_string()],
        &["--test-keepalive-endpoints", &keepalives],
    );
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    let mut spec = sh(script);
    spec.env.insert("OUT".into(), out.display().to_string());
    c.submit(0, id, spec).await;
    wait_until("the job to start", LONG, || runs(&out, id) == 1).await;
    (c, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_key_deleted_while_its_watch_is_cut_off_cannot_let_two_executions_overlap() {
    let script = "echo run >> \"$OUT/deleted\"; [ \"$BATON_ATTEMPT\" = 1 ] && sleep 600; exit 0";
    let (mut c, proxy) = running_on_a_worker_behind_a_proxy("deleted", script).await;
    c.add_worker(&[]);
    c.wait_workers(&["w1", "w2"]).await;
    proxy.set_mode(Mode::Blackhole);
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    client.delete("/baton/test/workers/w1", None).await.unwrap();
    let j = c
        .wait_job(&c.all_indices(), "deleted", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished);
    assert_eq!(j.recoveries, 1, "restarted once, as a recovery");
    let first = c
        .exit_record("deleted", 1)
        .expect("the first execution was stopped");
    let second = c.exit_record("deleted", 2).unwrap();
    assert!(
        first.ended_boottime_ns < second.started_boottime_ns,
        "overlap: {first:?} {second:?}"
    );
    let logs: String = c
        .replicas
        .iter()
        .map(|r| std::fs::read_to_string(r.log_path()).unwrap_or_default())
        .collect();
    assert!(
        logs.contains("revoked the worker's lease"),
        "the leader revoked it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_key_is_deleted_stops_its_job_by_itself_with_no_leader_acting() {
    // As above, but every coordinator is frozen: only the worker's own renewals, which read its
    // key back, can notice the deletion.
    let script = "echo run >> \"$OUT/alone\"; sleep 600";
    let (c, proxy) = running_on_a_worker_behind_a_proxy("alone", script).await;
    for r in &c.replicas {
        r.pause();
    }
    proxy.set_mode(Mode::Blackhole);
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    client.delete("/baton/test/workers/w1", None).await.unwrap();
    let ended = wait_for("the job to be killed by its guard", LONG, || async {
        c.exit_record("alone", 1)
    })
    .await;
    for r in &c.replicas {
        r.resume();
    }
    assert!(
        ended.killed_by.is_some(),
        "killed, not ended on its own: {ended:?}"
    );
    let log = std::fs::read_to_string(c.workers[0].log_path()).unwrap_or_default();
    assert!(
        log.contains("the key this lease holds is gone"),
        "noticed by a renewal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assignment_nobody_answers_is_taken_back_and_runs_elsewhere() {
    let mut c = Cluster::start(worker_opts(
        1,
        &["--lease-ttl", "30s", "--assign-timeout", "2s"],
    ));
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    c.workers[0].pause();
    let out = scratch(&c);
    let mut spec = sh("echo \"$BATON_WORKER\" >> \"$OUT/unanswered\"");
    spec.env.insert("OUT".into(), out.display().to_string());
    c.submit(0, "unanswered", spec).await;
    wait_for(
        "the job to be assigned to the frozen worker",
        LONG,
        || async {
            let e = c.registry_entry("unanswered").await?;
            (e["worker"] == "w1").then_some(())
        },
    )
    .await;
    wait_for("the assignment to be taken back", LONG, || async {
        let e = c.registry_entry("unanswered").await?;
        (e["status"] == "PENDING" && e["attempt"] == 0).then_some(())
    })
    .await;
    c.add_worker(&[]);
    let j = c
        .wait_job(&c.all_indices(), "unanswered", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished);
    assert_eq!(j.attempts, 1, "a reclaimed assignment is not an attempt");
    c.workers[0].resume();
    c.wait_workers(&["w1", "w2"]).await;
    let ran = std::fs::read_to_string(out.join("unanswered")).unwrap();
    assert_eq!(ran, "w2\n", "only the live worker ran it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_live_worker_jobs_wait_with_the_reason_and_start_when_one_registers() {
    let mut c = Cluster::start(worker_opts(0, &[]));
    c.leader_index().await;
    c.submit(0, "patient", sh("exit 0")).await;
    let j = c
        .wait_job(&[1], "patient", LONG, "pending", |j| {
            state(j) == JobState::Pending
        })
        .await;
    assert!(
        j.waiting_reason.contains("no live worker"),
        "{}",
        j.waiting_reason
    );
    let listen = format!("127.0.0.1:{}", baton::devcluster::free_port());
    c.add_worker(&["--listen", &listen]);
    let j = c
        .wait_job(&[2], "patient", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished);
    // The worker answers probes on its --listen address.
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{listen}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let status = tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_of_a_replica_preempts_its_embedded_workers_jobs_which_restart_at_once_uncounted() {
    let mut c = Cluster::start(Options {
        ttl: Duration::from_secs(10),
        extra_args: vec![
            "--cleanup-pause-after-stage".into(),
            "0".into(),
            "--drain-timeout".into(),
            "1s".into(),
        ],
        ..Options::default()
    });
    c.leader_index().await;
    c.wait_workers(&["r1", "r2", "r3"]).await;
    let out = scratch(&c);
    let ids = submit_held(&c, &out, 3).await;
    let on = |id: &str| {
        std::fs::read_to_string(out.join(id))
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_string()
    };
    let victim = on(&ids[0]);
    let hit: Vec<String> = ids.iter().filter(|id| on(id) == victim).cloned().collect();
    let k = c.index_of(&victim);
    let stopped = std::time::Instant::now();
    c.replicas[k].sigterm();
    assert!(c.replicas[k].wait_exit(Duration::from_secs(30)).is_some());
    for id in ids.iter().filter(|id| on(id) == victim) {
        wait_until("the preempted job to run again elsewhere", LONG, || {
            runs(&out, id) == 2
        })
        .await;
    }
    // Far sooner than the worker's TTL: the preempted record says the job is stopped.
    assert!(stopped.elapsed() < c.ttl, "{:?}", stopped.elapsed());
    std::fs::write(out.join("release"), "").unwrap();
    for id in &ids {
        let j = c
            .wait_job(&c.others(k), id, LONG, "terminal", terminal)
            .await;
        assert_eq!(state(&j), JobState::Finished, "{id}: {j:?}");
        assert_eq!(j.recoveries, 0, "a preemption is not a recovery: {j:?}");
        assert_eq!(j.failed_attempts, 0, "{j:?}");
        let moved = u32::from(hit.contains(id));
        assert_eq!(j.preemptions, moved, "counted apart from failures: {j:?}");
    }
}

/// What a previous release's leader left: a version 1 RUNNING entry of attempt 1 in term 1,
/// which it ran itself.
async fn plant_version_1_running(c: &Cluster, id: &str) {
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    client
        .put(
            format!("/baton/test/registry/{id}"),
            r#"{"version":1,"status":"RUNNING","attempt":1,"failed_attempts":0,"recoveries":0,"term":1}"#,
            None,
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_running_entry_of_an_older_leader_is_rescheduled() {
    let mut c = Cluster::start(worker_opts(0, &[]));
    c.leader_index().await;
    let out = scratch(&c);
    let mut spec = sh("env | grep ^BATON_RECOVERED >> \"$OUT/old\"; exit 0");
    spec.env.insert("OUT".into(), out.display().to_string());
    c.submit(0, "old", spec).await;
    plant_version_1_running(&c, "old").await;
    c.add_worker(&[]);
    let j = c
        .wait_job(&c.all_indices(), "old", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished, "{j:?}");
    assert_eq!((j.attempts, j.recoveries), (2, 1), "{j:?}");
    assert_eq!(
        std::fs::read_to_string(out.join("old")).unwrap(),
        "BATON_RECOVERED=1\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_running_entry_whose_exit_an_older_release_left_is_recorded_not_run_again() {
    let c = Cluster::start(worker_opts(0, &[]));
    c.leader_index().await;
    let out = scratch(&c);
    let mut spec = sh("echo ran >> \"$OUT/done\"");
    spec.env.insert("OUT".into(), out.display().to_string());
    c.submit(0, "done", spec).await;
    // Where a release before the buckets kept the job's folder, with the exit its guard wrote.
    let dir = baton::exec::record::legacy_job_dir(&c.storage(), "done");
    std::fs::create_dir_all(&dir).unwrap();
    let exit = serde_json::json!({
        "version": 1, "job_id": "done", "attempt": 1, "term": 1, "pid": 1,
        "started_boottime_ns": 1, "ended_boottime_ns": 2, "exit_code": 0,
        "signal": null, "killed_by": null
    });
    std::fs::write(dir.join("attempt-1.exit"), exit.to_string()).unwrap();
    plant_version_1_running(&c, "done").await;
    let j = c
        .wait_job(&c.all_indices(), "done", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished, "{j:?}");
    assert_eq!((j.attempts, j.recoveries, j.exit_code), (1, 0, 0), "{j:?}");
    assert!(!out.join("done").exists(), "it never ran again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_worker_removes_folders_of_gone_jobs_in_its_buckets_and_at_the_old_root() {
    let mut c = Cluster::start(Options {
        replicas: 1,
        extra_args: vec!["--cleanup-pause-after-stage".into(), "0".into()],
        ..Options::default()
    });
    c.leader_index().await;
    c.wait_workers(&["r1"]).await;
    c.submit(0, "kept", sh("echo kept > \"$BATON_JOB_DIR/out\""))
        .await;
    c.wait_job(&[0], "kept", LONG, "terminal", terminal).await;
    let kept = c.job_dir("kept");
    assert!(
        kept.join("out").is_file(),
        "held at stage 0, its folder stays"
    );
    assert_eq!(
        kept.parent().unwrap().parent().unwrap(),
        c.storage().join("jobs")
    );
    // Folders of jobs etcd does not know: one in its bucket, one where an older release kept
    // them, and a removal cut short.
    let gone = c.job_dir("gone");
    let old = c.storage().join("jobs").join("gone-old");
    let cut = c.job_dir("cut").with_file_name("cut~removing-7");
    for d in [&gone, &old, &cut] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("attempt-1.log"), "x").unwrap();
    }
    c.replicas[0].sigkill();
    c.replicas[0].restart().unwrap();
    wait_until("the gone jobs' folders to go", LONG, || {
        !gone.exists() && !old.exists() && !cut.exists()
    })
    .await;
    assert!(kept.join("out").is_file(), "a live job's folder stays");
    assert!(gone.parent().unwrap().is_dir(), "buckets stay");
}
