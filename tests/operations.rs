//! Operating workers, on real processes and a real etcd: a drain lets short jobs finish and
//! moves long ones at once, a rolling restart of the workers loses and repeats nothing, labels
//! route jobs without blocking the others, logs follow a job through any replica, and the
//! fleet is listed with its load and drains.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use baton::proto::fleet_service_client::FleetServiceClient;
use baton::proto::{ListWorkersRequest, WorkerInfo};
use support::*;

const LONG: Duration = Duration::from_secs(60);

/// The worker of the latest execution noted in `out/<id>`.
fn ran_on(out: &Path, id: &str) -> String {
    std::fs::read_to_string(out.join(id))
        .unwrap_or_default()
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_default()
        .to_string()
}

async fn workers_at(c: &Cluster, i: usize) -> Vec<WorkerInfo> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", c.replicas[i].listen()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    FleetServiceClient::new(ch)
        .list_workers(ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner()
        .workers
}

fn endpoints(c: &Cluster, among: &[usize]) -> String {
    among
        .iter()
        .map(|i| c.replicas[*i].listen().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_sigterm_lets_a_short_job_finish_and_moves_a_long_one_at_its_drain_timeout() {
    // A long worker TTL: a move "at once" is then far sooner than a lost worker's would be.
    let mut c = Cluster::start(worker_opts(
        1,
        &["--drain-timeout", "6s", "--lease-ttl", "20s"],
    ));
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    c.submit(0, "short", gated(&out, "short-go")).await;
    c.submit(0, "long", gated(&out, "release")).await;
    for id in ["short", "long"] {
        wait_until("both jobs to run on w1", LONG, || runs(&out, id) == 1).await;
    }
    // w2 has fewer free slots: only the drain keeps new jobs off w1.
    c.add_worker(&["--max-running", "8"]);
    c.wait_workers(&["w1", "w2"]).await;

    let signalled = baton::jobs::records::now_ms();
    c.workers[0].sigterm();
    // The short job ends on its own within the drain timeout: it finishes where it ran.
    std::fs::write(out.join("short-go"), "").unwrap();
    wait_for("w1 to show as draining", LONG, || async {
        workers_at(&c, 1)
            .await
            .iter()
            .any(|w| w.worker_id == "w1" && w.draining)
            .then_some(())
    })
    .await;
    // Submissions go on meanwhile, and run on the worker that is not draining.
    for i in 0..3 {
        c.submit(1, &format!("during-{i}"), brief(&out, 0.1)).await;
    }
    let short = c.wait_job(&[2], "short", LONG, "terminal", terminal).await;
    assert_eq!(state(&short), JobState::Finished, "{short:?}");
    assert_eq!((short.attempts, short.preemptions), (1, 0), "{short:?}");
    assert_eq!(short.worker, "w1", "{short:?}");
    for i in 0..3 {
        let j = c
            .wait_job(&[0], &format!("during-{i}"), LONG, "terminal", terminal)
            .await;
        assert_eq!(state(&j), JobState::Finished, "{j:?}");
        assert_eq!(
            j.worker, "w2",
            "nothing new lands on a draining worker: {j:?}"
        );
    }
    // The long one is stopped at the drain timeout and runs again on w2 at once.
    wait_until("the long job to run again", LONG, || {
        runs(&out, "long") == 2
    })
    .await;
    assert_eq!(ran_on(&out, "long"), "w2");
    let status = c.workers[0].wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "w1 exits 0: {status:?}"
    );
    c.wait_workers(&["w2"]).await;
    let long = c.get_job(0, "long").await.unwrap();
    let history: Vec<(u32, &str, &str)> = long
        .history
        .iter()
        .map(|a| (a.attempt, a.worker.as_str(), a.state.as_str()))
        .collect();
    assert!(
        history.contains(&(1, "w1", "preempted")) && history.contains(&(2, "w2", "started")),
        "{history:?}"
    );
    let at = |n: u32| {
        long.history
            .iter()
            .find(|a| a.attempt == n)
            .unwrap()
            .at_unix_ms as u64
    };
    assert!(
        at(1) >= signalled + 6000,
        "preempted at the drain timeout, not before: {} ms",
        at(1) - signalled
    );
    assert!(
        at(2) - at(1) < 20_000,
        "restarted at once, not after the worker's TTL: {} ms",
        at(2) - at(1)
    );
    println!(
        "drain: preempted {} ms after SIGTERM, running again {} ms later",
        at(1) - signalled,
        at(2) - at(1)
    );
    std::fs::write(out.join("release"), "").unwrap();
    let long = c.wait_job(&[1], "long", LONG, "terminal", terminal).await;
    assert_eq!(state(&long), JobState::Finished, "{long:?}");
    assert_eq!(
        (long.preemptions, long.recoveries, long.failed_attempts),
        (1, 0, 0),
        "a preemption is counted apart: {long:?}"
    );
}

/// Submits 2 s jobs, four at a time, until one runs on worker `name`. The leader places a job on
/// the worker with the most free slots among those it has seen, and a worker that registered a
/// moment ago (or came back from a roll) may not be among them yet: etcd delivers the workers'
/// events on their own watch, up to its sync interval behind the registry's.
async fn feed_until_one_runs_on(
    c: &Cluster,
    out: &std::path::Path,
    name: &str,
    ids: &mut Vec<String>,
    next: &mut usize,
) {
    let fed = Instant::now();
    loop {
        for _ in 0..4 {
            let id = format!("r{next}");
            c.submit(*next % 3, &id, brief(out, 2.0)).await;
            ids.push(id);
            *next += 1;
        }
        let look_until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < look_until {
            let workers = workers_at(c, 0).await;
            if workers.iter().any(|x| x.worker_id == name && x.running > 0) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(fed.elapsed() < LONG, "no job ran on {name} within {LONG:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_two_workers_loses_nothing_and_runs_nothing_twice() {
    let mut c = Cluster::start(worker_opts(2, &["--drain-timeout", "30s"]));
    c.leader_index().await;
    c.wait_workers(&["w1", "w2"]).await;
    let out = scratch(&c);
    let mut ids: Vec<String> = Vec::new();
    for i in 0..20 {
        let id = format!("r{i}");
        c.submit(i % 3, &id, brief(&out, 1.0)).await;
        ids.push(id);
    }
    let mut next = 20;
    for w in 0..2 {
        let name = format!("w{}", w + 1);
        feed_until_one_runs_on(&c, &out, &name, &mut ids, &mut next).await;
        c.workers[w].sigterm();
        let rolled = Instant::now();
        // Submissions continue while the worker drains and comes back.
        while c.workers[w].try_exit().is_none() {
            assert!(rolled.elapsed() < LONG, "{name} did not finish draining");
            let id = format!("r{next}");
            c.submit(next % 3, &id, brief(&out, 0.5)).await;
            ids.push(id);
            next += 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let status = c.workers[w].try_exit();
        assert!(status.is_some_and(|s| s.success()), "{status:?}");
        c.workers[w].restart().unwrap();
        c.wait_workers(&["w1", "w2"]).await;
    }
    for id in &ids {
        let j = c
            .wait_job(&c.all_indices(), id, LONG, "terminal", terminal)
            .await;
        assert_eq!(state(&j), JobState::Finished, "{id}: {j:?}");
        assert_eq!(
            (j.attempts, j.preemptions, j.recoveries),
            (1, 0, 0),
            "{id}: {j:?}"
        );
        assert_eq!(runs(&out, id), 1, "{id} ran once");
    }
    println!(
        "rolling restart of 2 workers: {} jobs, 0 restarts",
        ids.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_route_jobs_and_an_unmatched_job_waits_without_blocking_the_others() {
    let mut c = Cluster::start(worker_opts(1, &[]));
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    let mut gpu = brief(&out, 0.1);
    gpu.worker_selector
        .insert("gpu".to_string(), "true".to_string());
    c.submit(0, "gpu", gpu).await;
    for i in 0..3 {
        c.submit(0, &format!("plain-{i}"), brief(&out, 0.1)).await;
    }
    for i in 0..3 {
        let j = c
            .wait_job(&[1], &format!("plain-{i}"), LONG, "terminal", terminal)
            .await;
        assert_eq!(state(&j), JobState::Finished, "the jobs behind run: {j:?}");
    }
    let waiting = c.get_job(2, "gpu").await.unwrap();
    assert_eq!(state(&waiting), JobState::Pending, "{waiting:?}");
    assert!(
        waiting
            .waiting_reason
            .contains("no live worker matches gpu=true"),
        "{}",
        waiting.waiting_reason
    );
    assert_eq!(runs(&out, "gpu"), 0);
    c.add_worker(&["--labels", "gpu=true,zone=a"]);
    let j = c.wait_job(&[0], "gpu", LONG, "terminal", terminal).await;
    assert_eq!(state(&j), JobState::Finished, "{j:?}");
    assert_eq!(ran_on(&out, "gpu"), "w2");
    // A selector no worker has is refused with the field named only when malformed.
    let mut bad = brief(&out, 0.1);
    bad.worker_selector.insert("a b".into(), "c".into());
    let err = c
        .jobs(0)
        .await
        .submit_job(baton::proto::SubmitJobRequest {
            job_id: "bad".into(),
            spec: Some(bad),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("worker_selector"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_a_job_on_a_separate_worker_through_a_follower() {
    let c = Cluster::start(worker_opts(1, &[]));
    let (leader, _) = c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let follower = c.others(leader)[0];
    c.submit(
        0,
        "talker",
        sh("i=1; while [ $i -le 20 ]; do echo \"line $i\"; i=$((i+1)); sleep 0.15; done"),
    )
    .await;
    let eps = endpoints(&c, &[follower]);
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        run_cli(
            &["job", "logs", "talker", "-f", "--endpoints", &eps],
            Duration::from_secs(90),
        )
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{stderr}");
    let want: String = (1..=20).map(|i| format!("line {i}\n")).collect();
    assert_eq!(stdout, want, "every line once, in order");
    let j = c
        .wait_job(&[follower], "talker", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished, "{j:?}");
    // And afterwards, read from the worker through another replica.
    let eps = endpoints(&c, &[leader]);
    let (code, stdout, stderr) = run_cli(
        &["job", "logs", "talker", "--endpoints", &eps],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout, want);
    // Hostile ids are refused, by the replicas and by the worker itself; a worker answers only
    // for itself.
    let (code, _, stderr) = run_cli(
        &["job", "logs", "../../etc", "-f", "--endpoints", &eps],
        Duration::from_secs(30),
    );
    assert_ne!(code, Some(0));
    assert!(stderr.contains("InvalidArgument"), "{stderr}");
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", c.workers[0].listen()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut w = baton::proto::worker_service_client::WorkerServiceClient::new(ch);
    let read = |job: &str, worker: &str| baton::proto::ReadLogRequest {
        job_id: job.into(),
        attempt: 1,
        offset: 0,
        max_bytes: 0,
        worker_id: worker.into(),
    };
    let e = w.read_log(read("../../etc", "w1")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = w.read_log(read("talker", "w9")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    let r = w.read_log(read("talker", "w1")).await.unwrap().into_inner();
    assert_eq!(String::from_utf8(r.content).unwrap(), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_list_shows_the_fleet_its_load_and_drains() {
    let c = Cluster::start(worker_opts(2, &["--labels", "pool=blue"]));
    c.leader_index().await;
    c.wait_workers(&["w1", "w2"]).await;
    let out = scratch(&c);
    c.submit(0, "busy", gated(&out, "release")).await;
    wait_until("the job to start", LONG, || runs(&out, "busy") == 1).await;
    let busy_on = ran_on(&out, "busy");
    let eps = endpoints(&c, &c.all_indices());
    let list = || {
        let (code, stdout, stderr) = run_cli(
            &["worker", "list", "-o", "json", "--endpoints", &eps],
            Duration::from_secs(30),
        );
        assert_eq!(code, Some(0), "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        v["workers"].as_array().unwrap().clone()
    };
    let ws = list();
    let ids: Vec<&str> = ws
        .iter()
        .map(|w| w["worker_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["w1", "w2"], "{ws:?}");
    for w in &ws {
        let mine = w["worker_id"] == busy_on.as_str();
        assert_eq!(w["running"], u64::from(mine), "{w}");
        assert_eq!(w["capacity"], 64, "{w}");
        assert_eq!(w["labels"]["pool"], "blue", "{w}");
        assert_eq!(w["draining"], false, "{w}");
        assert!(!w["address"].as_str().unwrap().is_empty(), "{w}");
    }
    // Drain the idle one: it shows as draining, and new jobs go to the other.
    let idle = if busy_on == "w1" { "w2" } else { "w1" };
    let (code, _, stderr) = run_cli(
        &["worker", "drain", idle, "--endpoints", &eps],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{stderr}");
    wait_for("the drained worker to show as draining", LONG, || async {
        let ws = list();
        ws.iter()
            .any(|w| {
                w["worker_id"] == idle && w["draining"] == true && w["drain_requested"] == true
            })
            .then_some(())
    })
    .await;
    for i in 0..4 {
        c.submit(0, &format!("after-{i}"), brief(&out, 0.1)).await;
    }
    for i in 0..4 {
        let j = c
            .wait_job(&[1], &format!("after-{i}"), LONG, "terminal", terminal)
            .await;
        assert_eq!(
            j.worker, busy_on,
            "nothing lands on a drained worker: {j:?}"
        );
    }
    let (code, stdout, _) = run_cli(
        &["worker", "list", "--endpoints", &eps],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0));
    assert!(stdout.contains("drained"), "{stdout}");
    // Undrain takes it back; an unknown worker is an error on stderr.
    let (code, _, stderr) = run_cli(
        &["worker", "undrain", idle, "--endpoints", &eps],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{stderr}");
    wait_for("the worker to take jobs again", LONG, || async {
        list()
            .iter()
            .any(|w| w["worker_id"] == idle && w["draining"] == false)
            .then_some(())
    })
    .await;
    let (code, _, stderr) = run_cli(
        &["worker", "drain", "nobody", "--endpoints", &eps],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1));
    assert!(stderr.contains("no live worker nobody"), "{stderr}");
    std::fs::write(out.join("release"), "").unwrap();
}
