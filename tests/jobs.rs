//! Jobs on real replicas, workers and a real etcd: submission, retries, duplicates, cancel,
//! WatchJob, submission without a leader, recovery after SIGKILL and SIGSTOP of a worker, exits
//! recorded across a leader's death instead of re-running, a thousand jobs across two leader
//! kills, and bad input.

mod support;

use std::time::{Duration, Instant};

use baton::exec::record::KilledBy;
use support::*;
use tonic::Code;

const LONG: Duration = Duration::from_secs(30);

/// Cleanup is held at stage 0 here, so the job folders (exit records, logs) stay for the
/// assertions; tests/cleanup.rs covers cleanup.
fn opts(extra: &[&str]) -> Options {
    Options {
        extra_args: ["--cleanup-pause-after-stage", "0"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect(),
        ..Options::default()
    }
}

/// Coordinators only (`--worker=false`) and `workers` separate workers with `worker_args`.
fn on_workers(workers: usize, worker_args: &[&str], extra: &[&str]) -> Options {
    Options {
        embedded: false,
        workers,
        worker_args: worker_args.iter().map(|s| s.to_string()).collect(),
        ..opts(extra)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_finishes_and_a_failing_one_is_retried_with_backoff_then_failed() {
    let c = Cluster::start(opts(&["--retry-initial-delay", "300ms"]));
    c.leader_index().await;
    c.submit(0, "ok", sh("echo out; echo err >&2; exit 0"))
        .await;
    let mut failing = sh("echo try $BATON_ATTEMPT; exit 7");
    failing.max_attempts = 3;
    c.submit(1, "bad", failing).await;

    let ok = c.wait_job(&[2], "ok", LONG, "terminal", terminal).await;
    assert_eq!(state(&ok), JobState::Finished);
    assert!(ok.has_exit_code && ok.exit_code == 0);
    assert_eq!(ok.attempts, 1);
    assert!(
        ok.log_tail.contains("out") && ok.log_tail.contains("err"),
        "{:?}",
        ok.log_tail
    );

    let bad = c.wait_job(&[0], "bad", LONG, "terminal", terminal).await;
    assert_eq!(state(&bad), JobState::Failed);
    assert_eq!(
        (bad.exit_code, bad.attempts, bad.failed_attempts),
        (7, 3, 3)
    );
    assert!(bad.error.contains("exited with code 7"), "{}", bad.error);
    assert!(bad.log_tail.contains("try 3"));
    // Delays grow: 300 ms, then 600 ms between attempts.
    let r: Vec<_> = (1..=3).map(|a| c.exit_record("bad", a).unwrap()).collect();
    let gap1 = r[1].started_boottime_ns - r[0].ended_boottime_ns;
    let gap2 = r[2].started_boottime_ns - r[1].ended_boottime_ns;
    println!(
        "retry gaps: {} ms, {} ms",
        gap1 / 1_000_000,
        gap2 / 1_000_000
    );
    assert!(gap1 >= 300_000_000 && gap2 >= 600_000_000 && gap2 > gap1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_ids_return_the_same_job_or_are_refused() {
    let c = Cluster::start(opts(&[]));
    c.leader_index().await;
    let spec = sh("sleep 2");
    let first = c.submit(0, "dup", spec.clone()).await;
    assert_eq!(state(&first), JobState::Pending);
    c.wait_job(&[0], "dup", LONG, "running", |j| {
        state(j) == JobState::Running
    })
    .await;

    let mut jobs = c.jobs(1).await;
    let again = jobs
        .submit_job(SubmitJobRequest {
            job_id: "dup".into(),
            spec: Some(spec.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.created);
    assert_eq!(state(again.job.as_ref().unwrap()), JobState::Running);

    let other = jobs
        .submit_job(SubmitJobRequest {
            job_id: "dup".into(),
            spec: Some(sh("true")),
        })
        .await
        .unwrap_err();
    assert_eq!(other.code(), Code::AlreadyExists);
    assert!(
        other.message().contains("still running"),
        "{}",
        other.message()
    );

    c.wait_job(&[2], "dup", LONG, "finished", terminal).await;
    let after = jobs
        .submit_job(SubmitJobRequest {
            job_id: "dup".into(),
            spec: Some(spec),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!after.created);
    assert_eq!(state(after.job.as_ref().unwrap()), JobState::Finished);
    let other = jobs
        .submit_job(SubmitJobRequest {
            job_id: "dup".into(),
            spec: Some(sh("true")),
        })
        .await
        .unwrap_err();
    assert!(
        other.message().contains("globally terminated"),
        "{}",
        other.message()
    );
    assert!(
        c.exit_record("dup", 2).is_none(),
        "an identical re-submission must not run again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_in_every_state_and_watch_sees_every_transition() {
    let c = Cluster::start(on_workers(
        1,
        &["--max-running", "1", "--kill-grace", "1s"],
        &[],
    ));
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    c.submit(0, "blocker", sh("sleep 60")).await;
    c.wait_job(&[0], "blocker", LONG, "running", |j| {
        state(j) == JobState::Running
    })
    .await;

    // PENDING (no slot): cancelled without running.
    c.submit(0, "queued", sh("true")).await;
    let mut jobs = c.jobs(1).await;
    jobs.cancel_job(CancelJobRequest {
        job_id: "queued".into(),
    })
    .await
    .unwrap();
    let q = c.wait_job(&[1], "queued", LONG, "terminal", terminal).await;
    assert_eq!(state(&q), JobState::Canceled);
    assert_eq!(q.attempts, 0, "a pending job is cancelled without running");

    // Watch a job from PENDING to FINISHED.
    c.submit(0, "watched", sh("sleep 0.3")).await;
    let mut stream = jobs
        .watch_job(WatchJobRequest {
            job_id: "watched".into(),
        })
        .await
        .unwrap()
        .into_inner();
    // RUNNING, ignoring SIGTERM: killed after the grace period.
    let mut stubborn = c.jobs(2).await;
    jobs.cancel_job(CancelJobRequest {
        job_id: "blocker".into(),
    })
    .await
    .unwrap();
    // Every change comes (an attempt record's too): each state in order, none skipped.
    let mut seen = Vec::new();
    while let Some(j) = tokio::time::timeout(LONG, stream.message())
        .await
        .unwrap()
        .unwrap()
    {
        if seen.last() != Some(&state(&j)) {
            seen.push(state(&j));
        }
        if terminal(&j) {
            break;
        }
    }
    assert_eq!(
        seen,
        vec![JobState::Pending, JobState::Running, JobState::Finished],
        "{seen:?}"
    );
    let b = c
        .wait_job(&[0], "blocker", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&b), JobState::Canceled);

    c.submit(
        0,
        "stubborn",
        sh("trap '' TERM; echo trapped > $BATON_JOB_DIR/trapped; sleep 60"),
    )
    .await;
    // RUNNING in etcd comes before the spawn: wait until the shell ignores SIGTERM.
    wait_until("the job to ignore SIGTERM", LONG, || {
        line_count(&c.job_dir("stubborn").join("trapped")) == 1
    })
    .await;
    let asked = Instant::now();
    stubborn
        .cancel_job(CancelJobRequest {
            job_id: "stubborn".into(),
        })
        .await
        .unwrap();
    let s = c
        .wait_job(&[0], "stubborn", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&s), JobState::Canceled);
    assert_eq!(s.signal, 9, "SIGKILL after the grace period");
    assert!(asked.elapsed() >= Duration::from_secs(1));

    // Terminal and unknown jobs.
    let e = jobs
        .cancel_job(CancelJobRequest {
            job_id: "stubborn".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    let e = jobs
        .cancel_job(CancelJobRequest {
            job_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_followed_by_a_leader_kill_is_never_restarted() {
    // The job ignores SIGTERM, so the cancel ends it only with the SIGKILL after this grace:
    // it is still being cancelled while the leadership moves.
    const GRACE: Duration = Duration::from_secs(30);
    let grace = format!("{}s", GRACE.as_secs());
    let mut c = Cluster::start(opts(&["--kill-grace", &grace]));
    let (k, old) = c.leader_index().await;
    let f = (k + 1) % 3;
    c.submit(
        f,
        "doomed",
        sh("trap '' TERM; echo run >> $BATON_JOB_DIR/runs; sleep 60"),
    )
    .await;
    wait_until("the job to start", LONG, || {
        line_count(&c.job_dir("doomed").join("runs")) >= 1
    })
    .await;
    let mut jobs = c.jobs(f).await;
    jobs.cancel_job(CancelJobRequest {
        job_id: "doomed".into(),
    })
    .await
    .unwrap();
    c.replicas[k].sigkill();
    let rest = c.others(k);
    c.wait_new_leader(&rest, old.term).await;
    // Not before the grace is over: wait that long and then as long as any other job.
    let j = c
        .wait_job(&rest, "doomed", GRACE + LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Canceled);
    let runs = std::fs::read_to_string(c.job_dir("doomed").join("runs")).unwrap();
    assert_eq!(
        runs.lines().count(),
        1,
        "a cancelled job must not be restarted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_succeed_while_there_is_no_leader_and_run_later() {
    // Without fast failover, so the dead leader's lease holds the election for its TTL.
    let mut c = Cluster::start(Options {
        ttl: Duration::from_secs(5),
        ..opts(&["--fast-failover", "false"])
    });
    let (k, old) = c.leader_index().await;
    c.replicas[k].sigkill();
    let f = (k + 1) % 3;
    // Right after the kill the old lease is still alive in etcd: nobody leads.
    let resp = c.get_leader(f).await.unwrap();
    assert_eq!(
        resp.leader.unwrap().term,
        old.term,
        "the dead leader's key still holds"
    );
    assert!(!resp.answered_by_leader);
    let j = c.submit(f, "leaderless", sh("exit 0")).await;
    assert_eq!(state(&j), JobState::Pending);
    let rest = c.others(k);
    c.wait_new_leader(&rest, old.term).await;
    let done = c
        .wait_job(&rest, "leaderless", LONG, "finished", terminal)
        .await;
    assert_eq!(state(&done), JobState::Finished);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_a_worker_restarts_its_jobs_elsewhere_only_after_its_key_is_gone_plus_a_ttl() {
    let mut c = Cluster::start(on_workers(1, &[], &[]));
    c.leader_index().await;
    let script = "env | grep ^BATON_ > $BATON_JOB_DIR/env-$BATON_ATTEMPT; \
                  if [ \"$BATON_ATTEMPT\" = 1 ]; then \
                    sleep 60 & echo $! >> $BATON_JOB_DIR/pids-1; echo $$ >> $BATON_JOB_DIR/pids-1; \
                    wait; fi";
    c.submit(0, "grandchild", sh(script)).await;
    c.submit(0, "stubborn", sh(&format!("trap '' TERM; {script}")))
        .await;
    for id in ["grandchild", "stubborn"] {
        wait_until("the first attempt to start its processes", LONG, || {
            read_pids(&c.job_dir(id).join("pids-1")).len() == 2
        })
        .await;
    }
    c.add_worker(&[]);
    c.wait_workers(&["w1", "w2"]).await;
    c.workers[0].sigkill();
    for id in ["grandchild", "stubborn"] {
        let pids = read_pids(&c.job_dir(id).join("pids-1"));
        wait_until(
            "every process of the killed worker's job to die",
            Duration::from_secs(10),
            || pids.iter().all(|&p| !alive(p)),
        )
        .await;
    }
    let all = c.all_indices();
    for id in ["grandchild", "stubborn"] {
        let j = c.wait_job(&all, id, LONG, "terminal", terminal).await;
        assert_eq!(state(&j), JobState::Finished, "{id}: {j:?}");
        assert_eq!(
            (j.attempts, j.recoveries, j.failed_attempts),
            (2, 1, 0),
            "{id}"
        );
        let env = std::fs::read_to_string(c.job_dir(id).join("env-2")).unwrap();
        assert!(
            env.contains("BATON_RECOVERED=1")
                && env.contains("BATON_ATTEMPT=2")
                && env.contains("BATON_WORKER=w2"),
            "{env}"
        );
        let env1 = std::fs::read_to_string(c.job_dir(id).join("env-1")).unwrap();
        assert!(!env1.contains("BATON_RECOVERED"), "{env1}");
        let token = |env: &str| -> i64 {
            env.lines()
                .find_map(|l| l.strip_prefix("BATON_TERM="))
                .unwrap()
                .parse()
                .unwrap()
        };
        assert!(token(&env) > token(&env1), "the fencing token rises");
        let first = c.exit_record(id, 1).unwrap();
        assert_eq!(first.killed_by, Some(KilledBy::LeaderGone));
        // The key goes at most a TTL after the kill, and the restart waits a further TTL plus
        // margin after the leader saw it go: at least TTL + margin after the first execution.
        let second = c.exit_record(id, 2).unwrap();
        let gap = Duration::from_nanos(second.started_boottime_ns - first.ended_boottime_ns);
        assert!(
            gap >= c.ttl + Duration::from_millis(500),
            "{id} restarted {gap:?} after the first execution ended"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_workers_guard_kills_the_job_before_it_runs_elsewhere_and_the_worker_returns_anew()
{
    let mut c = Cluster::start(on_workers(1, &[], &[]));
    c.leader_index().await;
    c.submit(
        0,
        "long",
        sh("echo run >> $BATON_JOB_DIR/runs; [ \"$BATON_ATTEMPT\" = 1 ] && sleep 60; exit 0"),
    )
    .await;
    wait_until("the job to start", LONG, || {
        line_count(&c.job_dir("long").join("runs")) >= 1
    })
    .await;
    c.add_worker(&[]);
    c.wait_workers(&["w1", "w2"]).await;
    let before = worker_rev(&c, "w1").await.unwrap();
    c.workers[0].pause();
    let all = c.all_indices();
    let j = c.wait_job(&all, "long", LONG, "finished", terminal).await;
    assert_eq!(state(&j), JobState::Finished);
    let first = c
        .exit_record("long", 1)
        .expect("the guard recorded the first execution");
    let second = c.exit_record("long", 2).expect("the second execution");
    assert_eq!(first.killed_by, Some(KilledBy::Deadline));
    assert!(
        first.ended_boottime_ns < second.started_boottime_ns,
        "executions overlapped: first ended {} second started {}",
        first.ended_boottime_ns,
        second.started_boottime_ns
    );
    c.workers[0].resume();
    wait_for(
        "the paused worker to register as a new incarnation",
        LONG,
        || async { worker_rev(&c, "w1").await.filter(|r| *r > before) },
    )
    .await;
    let runs = std::fs::read_to_string(c.job_dir("long").join("runs")).unwrap();
    assert_eq!(runs.lines().count(), 2, "nothing ran again after SIGCONT");
}

/// The create revision of a worker's key (its incarnation).
async fn worker_rev(c: &Cluster, id: &str) -> Option<i64> {
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .ok()?;
    let resp = client
        .get(format!("/baton/test/workers/{id}"), None)
        .await
        .ok()?;
    resp.kvs().first().map(|kv| kv.create_revision())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_exited_while_the_leader_was_frozen_is_recorded_once_by_the_next() {
    let mut c = Cluster::start(Options {
        ttl: Duration::from_secs(5),
        ..on_workers(1, &[], &[])
    });
    let (k, old) = c.leader_index().await;
    c.submit(
        0,
        "quick",
        sh("echo run >> $BATON_JOB_DIR/runs; sleep 0.5; exit 4"),
    )
    .await;
    wait_until("the job to start", LONG, || {
        line_count(&c.job_dir("quick").join("runs")) >= 1
    })
    .await;
    // The leader freezes: the job ends on its worker, which reports it, but nobody records
    // the result.
    c.replicas[k].pause();
    wait_until("the guard to write the exit record", LONG, || {
        c.exit_record("quick", 1).is_some()
    })
    .await;
    c.replicas[k].sigkill();
    let rest = c.others(k);
    c.wait_new_leader(&rest, old.term).await;
    let j = c.wait_job(&rest, "quick", LONG, "terminal", terminal).await;
    // max_attempts defaults to 3, so exit 4 counts as a failed attempt and is retried; but the
    // first attempt's outcome is taken from its worker's report, not re-run as a recovery.
    assert_eq!(j.recoveries, 0, "{j:?}");
    assert_eq!(c.exit_record("quick", 1).unwrap().exit_code, Some(4));
    assert!(c.exit_record("quick", 1).unwrap().killed_by.is_none());
    let runs = std::fs::read_to_string(c.job_dir("quick").join("runs")).unwrap();
    assert_eq!(runs.lines().count() as u32, j.attempts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_jobs_survive_two_leader_kills() {
    let mut c = Cluster::start(opts(&["--max-running", "300"]));
    let (mut k, mut leader) = c.leader_index().await;
    let n = 1000;
    let started = Instant::now();
    let mut clients = Vec::new();
    for i in 0..3 {
        clients.push(c.jobs(i).await);
    }
    for i in 0..n {
        let mut cl = clients[i % 3].clone();
        cl.submit_job(SubmitJobRequest {
            job_id: format!("bulk-{i:04}"),
            spec: Some(sh("sleep 1")),
        })
        .await
        .unwrap();
    }
    println!("submitted {n} jobs in {} ms", started.elapsed().as_millis());
    for _ in 0..2 {
        wait_until("some jobs to run", LONG, || job_folders(&c.storage()) > 50).await;
        c.replicas[k].sigkill();
        let rest = c.others(k);
        let killed_at = Instant::now();
        let (nk, nl) = c.wait_new_leader(&rest, leader.term).await;
        println!("new leader after {} ms", killed_at.elapsed().as_millis());
        c.replicas[k].restart().unwrap();
        (k, leader) = (nk, nl);
    }
    let mut restarted = 0;
    let mut cl = c.jobs(k).await;
    wait_for(
        "all jobs to reach a terminal result",
        Duration::from_secs(180),
        || {
            let mut cl = cl.clone();
            async move {
                let mut done = 0;
                let mut token = String::new();
                loop {
                    let page = cl
                        .list_jobs(baton::proto::ListJobsRequest {
                            page_size: 1000,
                            page_token: token,
                            ..Default::default()
                        })
                        .await
                        .ok()?
                        .into_inner();
                    done += page.jobs.iter().filter(|j| terminal(j)).count();
                    if page.next_page_token.is_empty() {
                        break;
                    }
                    token = page.next_page_token;
                }
                (done == n).then_some(())
            }
        },
    )
    .await;
    for i in 0..n {
        let j = cl
            .get_job(GetJobRequest {
                job_id: format!("bulk-{i:04}"),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(state(&j), JobState::Finished, "{j:?}");
        if j.recoveries > 0 {
            restarted += 1;
        }
    }
    println!(
        "{n} jobs finished in {} s; {restarted} were restarted after a leader kill",
        started.elapsed().as_secs()
    );
    assert!(restarted > 0, "the kills hit no running job");
    c.checked_terms();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_the_field_named_and_corrupt_values_block_nothing() {
    let c = Cluster::start(opts(&[]));
    c.leader_index().await;
    let mut jobs = c.jobs(0).await;
    let bad = |id: &str, spec: Option<JobSpec>| {
        let req = SubmitJobRequest {
            job_id: id.into(),
            spec,
        };
        let mut j = jobs.clone();
        async move { j.submit_job(req).await.unwrap_err() }
    };
    let e = bad("a/b", Some(sh("true"))).await;
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("job_id"), "{}", e.message());
    let e = bad("x", Some(JobSpec::default())).await;
    assert!(
        e.code() == Code::InvalidArgument && e.message().contains("spec.command"),
        "{}",
        e.message()
    );
    let e = bad("x", None).await;
    assert!(e.message().contains("spec"), "{}", e.message());
    let mut big = sh("true");
    big.command = (0..40).map(|_| "y".repeat(4000)).collect();
    let e = bad("x", Some(big)).await;
    assert!(
        e.code() == Code::InvalidArgument && e.message().contains("spec"),
        "{}",
        e.message()
    );
    let mut huge = sh("true");
    huge.command = vec!["z".repeat(1024 * 1024)];
    assert_eq!(
        bad("x", Some(huge)).await.code(),
        Code::OutOfRange,
        "oversized requests are refused before decoding"
    );
    let mut absurd = sh("true");
    absurd.max_attempts = 1_000_000;
    assert!(bad("x", Some(absurd))
        .await
        .message()
        .contains("spec.max_attempts"));
    let mut forever = sh("true");
    forever.timeout = Some(pbjson_types::Duration {
        seconds: 365 * 86400,
        nanos: 0,
    });
    assert!(bad("x", Some(forever))
        .await
        .message()
        .contains("spec.timeout"));
    assert!(
        c.get_job(0, "x").await.is_none(),
        "refused submissions change nothing"
    );

    // Corrupt values under the cluster prefix: logged, counted, and nobody else is blocked.
    let mut etcd = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    etcd.put("/baton/test/registry/garbage", "{not json", None)
        .await
        .unwrap();
    etcd.put("/baton/test/jobs/future", r#"{"version":99}"#, None)
        .await
        .unwrap();
    etcd.put("/baton/test/registry/future", r#"{"version":99}"#, None)
        .await
        .unwrap();
    c.submit(1, "fine", sh("true")).await;
    let j = c.wait_job(&[2], "fine", LONG, "finished", terminal).await;
    assert_eq!(state(&j), JobState::Finished);
    let e = jobs
        .get_job(GetJobRequest {
            job_id: "future".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::DataLoss, "{e:?}");
    for r in c
        .replicas
        .iter()
        .map(|r| r.id().to_string())
        .collect::<Vec<_>>()
    {
        let i = c.index_of(&r);
        assert!(c.get_leader(i).await.is_ok(), "{r} is still serving");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_fail_attempts_and_queued_jobs_start_in_submission_order() {
    let c = Cluster::start(on_workers(1, &["--max-running", "1"], &[]));
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let mut slow = sh("sleep 30");
    slow.max_attempts = 1;
    slow.timeout = Some(pbjson_types::Duration {
        seconds: 0,
        nanos: 300_000_000,
    });
    c.submit(0, "slow", slow).await;
    for id in ["q1", "q2", "q3"] {
        c.submit(1, id, sh("true")).await;
    }
    let s = c.wait_job(&[2], "slow", LONG, "terminal", terminal).await;
    assert_eq!(state(&s), JobState::Failed);
    assert!(s.error.contains("timed out after 300ms"), "{}", s.error);
    for id in ["q1", "q2", "q3"] {
        c.wait_job(&[2], id, LONG, "finished", terminal).await;
    }
    let starts: Vec<u64> = ["q1", "q2", "q3"]
        .iter()
        .map(|id| c.exit_record(id, 1).unwrap().started_boottime_ns)
        .collect();
    assert!(starts[0] < starts[1] && starts[1] < starts[2], "{starts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_recoveries_stops_a_job_from_crash_looping_the_cluster() {
    let mut c = Cluster::start(on_workers(1, &[], &["--max-recoveries", "0"]));
    c.leader_index().await;
    c.submit(
        0,
        "fragile",
        sh("echo run >> $BATON_JOB_DIR/runs; sleep 60"),
    )
    .await;
    wait_until("the job to start", LONG, || {
        line_count(&c.job_dir("fragile").join("runs")) >= 1
    })
    .await;
    c.add_worker(&[]);
    c.wait_workers(&["w1", "w2"]).await;
    c.workers[0].sigkill();
    let all = c.all_indices();
    let j = c
        .wait_job(&all, "fragile", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Failed);
    assert!(j.error.contains("--max-recoveries 0"), "{}", j.error);
    let runs = std::fs::read_to_string(c.job_dir("fragile").join("runs")).unwrap();
    assert_eq!(runs.lines().count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_submits_waits_lists_cancels_and_shows_logs() {
    let c = Cluster::start(opts(&[]));
    c.leader_index().await;
    let eps: Vec<String> = c.replicas.iter().map(|r| r.listen().to_string()).collect();
    // A dead endpoint first: the CLI moves on to the next one.
    let dead = format!("127.0.0.1:{}", baton::devcluster::free_port());
    let endpoints = format!("{dead},{}", eps.join(","));
    let run = |args: &[&str]| {
        let out = std::process::Command::new(BIN)
            .args(["job", args[0], "--endpoints", &endpoints])
            .args(&args[1..])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&[
        "submit",
        "--id",
        "cli-1",
        "--env",
        "GREETING=hi",
        "--",
        "sh",
        "-c",
        "echo $GREETING; exit 3",
    ]);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(out.contains("submitted cli-1"), "{out}");
    let (code, out, _) = run(&["wait", "cli-1"]);
    assert_eq!(code, Some(3), "wait exits with the job's exit code: {out}");
    let (_, out, _) = run(&["logs", "cli-1"]);
    assert_eq!(out, "hi\n");
    let (_, out, _) = run(&["get", "cli-1", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["exit_code"], 3);
    let (_, out, _) = run(&["submit", "--id", "cli-2", "--", "sleep", "60"]);
    assert!(out.contains("submitted"));
    c.wait_job(&[0], "cli-2", LONG, "running", |j| {
        state(j) == JobState::Running
    })
    .await;
    let (_, out, _) = run(&["list", "--state", "running"]);
    assert!(out.contains("cli-2") && !out.contains("cli-1"), "{out}");
    let (code, _, _) = run(&["cancel", "cli-2"]);
    assert_eq!(code, Some(0));
    let (code, out, _) = run(&["wait", "cli-2"]);
    assert_eq!(code, Some(130), "{out}");
    let (code, _, err) = run(&["cancel", "cli-2"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("terminal"), "{err}");
}
