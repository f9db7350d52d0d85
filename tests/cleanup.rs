//! Dirty-job cleanup on real replicas and workers: retries with growing delays, a cleanup command
//! that outlives a leader kill and reruns only after its worker dies, a leader killed between
//! stages, exhausted attempts and `cleanup --now`, a thousand dirty
//! jobs at failover under the concurrency limit, and result retention.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use baton::proto::{CleanupState, ListJobsRequest};
use support::*;
use tonic::Code;

const LONG: Duration = Duration::from_secs(60);

fn opts(extra: &[&str]) -> Options {
    Options {
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        ..Options::default()
    }
}

/// A job whose cleanup runs `script` with `$L` naming a folder outside the job's own.
fn with_cleanup(job: &str, script: &str, ledger: &Path) -> JobSpec {
    let mut spec = sh(job);
    spec.cleanup_command = vec!["sh".into(), "-c".into(), script.into()];
    spec.env.insert("L".into(), ledger.display().to_string());
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_failing_three_times_then_succeeding_ends_clean_after_growing_delays() {
    let c = Cluster::start(opts(&["--cleanup-initial-delay", "200ms"]));
    c.leader_index().await;
    let (_t, l) = ledger_dir();
    let script = "echo \"$BATON_CLEANUP_ATTEMPT $BATON_JOB_STATUS $(date +%s%N)\" >> $L/runs; \
                  [ \"$BATON_CLEANUP_ATTEMPT\" -ge 4 ] || { echo not yet >&2; exit 1; }";
    c.submit(
        0,
        "flaky",
        with_cleanup("echo work; echo work > $BATON_JOB_DIR/out", script, &l),
    )
    .await;
    let pending = c
        .wait_job(&[1], "flaky", LONG, "retrying its cleanup", |j| {
            j.cleanup
                .as_ref()
                .is_some_and(|c| c.attempts >= 1 && !c.last_error.is_empty())
        })
        .await;
    assert_eq!(cleanup_state(&pending), CleanupState::CleanupPending);
    assert!(pending.cleanup.unwrap().last_error.contains("not yet"));
    let j = c.wait_job(&[1], "flaky", LONG, "clean", clean).await;
    assert_eq!(state(&j), JobState::Finished);
    let cl = j.cleanup.unwrap();
    assert_eq!((cl.attempts, cl.stage), (4, 3), "{cl:?}");
    let runs = lines(&l.join("runs"));
    assert_eq!(runs.len(), 4, "{runs:?}");
    assert!(runs.iter().all(|r| r.contains("FINISHED")));
    let at: Vec<u64> = runs
        .iter()
        .map(|r| r.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    let gaps: Vec<u64> = at.windows(2).map(|w| (w[1] - w[0]) / 1_000_000).collect();
    println!("cleanup retry gaps (ms): {gaps:?}");
    assert!(
        gaps[0] >= 150 && gaps[1] > gaps[0] && gaps[2] > gaps[1],
        "{gaps:?}"
    );
    assert!(
        !c.job_dir("flaky").exists(),
        "stage 2 removes the job folder"
    );
    let logs = c
        .jobs(2)
        .await
        .get_job_logs(baton::proto::GetJobLogsRequest {
            job_id: "flaky".into(),
            attempt: 0,
            tail_bytes: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        logs.content, b"work\n",
        "after cleanup the result's log tail answers"
    );
    let mut etcd = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    assert!(etcd
        .get("/baton/test/jobs/flaky", None)
        .await
        .unwrap()
        .kvs()
        .is_empty());
    assert!(etcd
        .get("/baton/test/results/dirty/flaky", None)
        .await
        .unwrap()
        .kvs()
        .is_empty());
    assert_eq!(
        etcd.get("/baton/test/results/clean/flaky", None)
            .await
            .unwrap()
            .kvs()
            .len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_command_outlives_a_leader_kill_and_reruns_only_after_its_worker_dies() {
    let mut c = Cluster::start(Options {
        embedded: false,
        workers: 1,
        ..Options::default()
    });
    let (k, old) = c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let (_t, l) = ledger_dir();
    // The first run waits for `release`; a rerun does not.
    let script = "echo \"$BATON_WORKER\" >> $L/cleanups; \
                  if [ ! -e $L/started ]; then touch $L/started; \
                  while [ ! -e $L/release ]; do sleep 0.1; done; fi";
    c.submit(0, "held", with_cleanup("echo run >> $L/runs", script, &l))
        .await;
    wait_until("the cleanup command to start", LONG, || {
        l.join("started").exists()
    })
    .await;
    c.replicas[k].sigkill();
    let (_, new) = c.wait_new_leader(&c.others(k), old.term).await;
    c.replicas[k].restart().unwrap();
    c.wait_leader(&c.all_indices(), LONG, |t| t == new.term)
        .await;
    std::fs::write(l.join("release"), "").unwrap();
    let all = c.all_indices();
    let j = c.wait_job(&all, "held", LONG, "clean", clean).await;
    assert_eq!(state(&j), JobState::Finished);
    assert_eq!(
        lines(&l.join("cleanups")),
        vec!["w1"],
        "a leader change does not rerun a cleanup command"
    );

    // Its worker dies mid-command: it runs again on another worker, after the TTL.
    let (_t2, l2) = ledger_dir();
    c.submit(0, "orphan", with_cleanup("true", script, &l2))
        .await;
    wait_until("the second cleanup command to start", LONG, || {
        l2.join("started").exists()
    })
    .await;
    c.add_worker(&[]);
    c.wait_workers(&["w1", "w2"]).await;
    c.workers[0].sigkill();
    let j = c.wait_job(&all, "orphan", LONG, "clean", clean).await;
    assert_eq!(state(&j), JobState::Finished);
    assert_eq!(lines(&l2.join("cleanups")), vec!["w1", "w2"]);
    assert_eq!(lines(&l.join("runs")).len(), 1, "the job itself ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_between_stages_is_followed_by_one_that_starts_at_the_recorded_stage() {
    let mut c = Cluster::start(opts(&["--cleanup-pause-after-stage", "1"]));
    let (k, old) = c.leader_index().await;
    let (_t, l) = ledger_dir();
    c.submit(
        0,
        "staged",
        with_cleanup("true", "echo c >> $L/cleanups", &l),
    )
    .await;
    let j = c
        .wait_job(&[k], "staged", LONG, "past cleanup stage 1", |j| {
            j.cleanup.as_ref().is_some_and(|c| c.stage == 1)
        })
        .await;
    assert_eq!(cleanup_state(&j), CleanupState::CleanupPending);
    assert!(c.job_dir("staged").exists(), "held before stage 2");
    c.replicas[k].sigkill();
    let rest = c.others(k);
    c.wait_new_leader(&rest, old.term).await;
    let j = c.wait_job(&rest, "staged", LONG, "clean", clean).await;
    assert_eq!(j.cleanup.unwrap().stage, 3);
    assert_eq!(
        lines(&l.join("cleanups")).len(),
        1,
        "stage 1 is not repeated"
    );
    assert!(!c.job_dir("staged").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_cleanups_need_an_operator_and_cleanup_now_finishes_them() {
    let c = Cluster::start(opts(&[
        "--cleanup-max-attempts",
        "2",
        "--cleanup-initial-delay",
        "100ms",
    ]));
    c.leader_index().await;
    let (_t, l) = ledger_dir();
    c.submit(
        0,
        "stuck",
        with_cleanup("true", "echo c >> $L/cleanups; [ -e $L/fixed ]", &l),
    )
    .await;
    let j = c
        .wait_job(&[0], "stuck", LONG, "needing an operator", |j| {
            cleanup_state(j) == CleanupState::CleanupNeedsOperator
        })
        .await;
    assert_eq!(j.cleanup.unwrap().attempts, 2);
    assert_eq!(
        lines(&l.join("cleanups")).len(),
        2,
        "no attempts after exhaustion"
    );
    let eps: Vec<String> = c.replicas.iter().map(|r| r.listen().to_string()).collect();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(BIN)
            .args(["job", args[0], "--endpoints", &eps.join(",")])
            .args(&args[1..])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (_, out, _) = cli(&["list", "--cleanup", "needs-operator"]);
    assert!(
        out.contains("stuck") && out.contains("needs-operator"),
        "{out}"
    );
    std::fs::write(l.join("fixed"), "").unwrap();
    let (code, out, err) = cli(&["cleanup", "stuck", "--now"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let j = c.wait_job(&[1], "stuck", LONG, "clean", clean).await;
    assert_eq!(j.cleanup.unwrap().attempts, 3);
    let (code, _, err) = cli(&["cleanup", "stuck", "--now"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("already clean"), "{err}");
    let (_, out, _) = cli(&["list", "--cleanup", "done"]);
    assert!(out.contains("stuck"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_dirty_jobs_at_failover_all_become_clean_within_the_concurrency_limit() {
    let limit = 4;
    let mut c = Cluster::start(opts(&[
        "--cleanup-concurrency",
        &limit.to_string(),
        "--max-running",
        "200",
    ]));
    let (k, old) = c.leader_index().await;
    let (_t, l) = ledger_dir();
    let n = 1000;
    let script = "echo \"s $(date +%s%N)\" >> $L/$BATON_JOB_ID; sleep 0.05; echo \"e $(date +%s%N)\" >> $L/$BATON_JOB_ID";
    let client = c.jobs((k + 1) % 3).await;
    let spec = with_cleanup("true", script, &l);
    let started = Instant::now();
    futures_util::StreamExt::for_each_concurrent(futures_util::stream::iter(0..n), 16, |i| {
        let mut cl = client.clone();
        let spec = spec.clone();
        async move {
            cl.submit_job(SubmitJobRequest {
                job_id: format!("d-{i:04}"),
                spec: Some(spec),
            })
            .await
            .unwrap();
        }
    })
    .await;
    let count = |cleanup: CleanupState| {
        let mut cl = client.clone();
        async move {
            let mut total = 0;
            let mut token = String::new();
            loop {
                let page = cl
                    .list_jobs(ListJobsRequest {
                        cleanup: cleanup as i32,
                        page_size: 1000,
                        page_token: token,
                        ..Default::default()
                    })
                    .await
                    .ok()?
                    .into_inner();
                total += page.jobs.len();
                if page.next_page_token.is_empty() {
                    return Some(total);
                }
                token = page.next_page_token;
            }
        }
    };
    wait_for("some cleanups to finish", LONG, || async {
        count(CleanupState::CleanupDone).await.filter(|&n| n >= 50)
    })
    .await;
    c.replicas[k].sigkill();
    let dirty_at_kill = count(CleanupState::CleanupPending).await.unwrap_or(0);
    let rest = c.others(k);
    c.wait_new_leader(&rest, old.term).await;
    wait_for(
        "all results to become clean",
        Duration::from_secs(240),
        || async { count(CleanupState::CleanupDone).await.filter(|&d| d == n) },
    )
    .await;
    println!(
        "{n} jobs clean in {} s; {dirty_at_kill} were dirty at the leader kill",
        started.elapsed().as_secs()
    );
    assert!(
        dirty_at_kill > 0,
        "the kill came after every cleanup had finished"
    );
    // Completed cleanup executions never exceeded the limit at any instant.
    let mut edges = Vec::new();
    for i in 0..n {
        let runs = lines(&l.join(format!("d-{i:04}")));
        let mut start = None;
        for r in runs {
            let (kind, at) = r.split_once(' ').unwrap();
            let at: u64 = at.parse().unwrap();
            match kind {
                "s" => start = Some(at),
                _ => {
                    if let Some(s) = start.take() {
                        edges.push((s, 1i32));
                        edges.push((at, -1));
                    }
                }
            }
        }
    }
    edges.sort_by_key(|&(t, d)| (t, d));
    let (mut now, mut peak) = (0, 0);
    for (_, d) in edges {
        now += d;
        peak = peak.max(now);
    }
    println!("peak concurrent cleanup commands: {peak} (limit {limit})");
    assert!(peak <= limit, "peak {peak} over the limit {limit}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_results_decide_resubmissions_until_retention_expires_them() {
    let c = Cluster::start(opts(&["--result-retention", "3s"]));
    c.leader_index().await;
    let spec = sh("exit 0");
    c.submit(0, "kept", spec.clone()).await;
    c.wait_job(&[0], "kept", LONG, "clean", clean).await;
    let mut jobs = c.jobs(1).await;
    let same = jobs
        .submit_job(SubmitJobRequest {
            job_id: "kept".into(),
            spec: Some(spec.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!same.created);
    assert_eq!(state(same.job.as_ref().unwrap()), JobState::Finished);
    let other = jobs
        .submit_job(SubmitJobRequest {
            job_id: "kept".into(),
            spec: Some(sh("exit 1")),
        })
        .await
        .unwrap_err();
    assert_eq!(other.code(), Code::AlreadyExists);
    assert!(
        other.message().contains("globally terminated"),
        "{}",
        other.message()
    );
    wait_for("the clean result to expire", LONG, || async {
        let e = c
            .jobs(2)
            .await
            .get_job(GetJobRequest {
                job_id: "kept".into(),
            })
            .await
            .err()?;
        (e.code() == Code::NotFound).then_some(())
    })
    .await;
    let fresh = c.submit(0, "kept", sh("exit 1")).await;
    assert_eq!(
        state(&fresh),
        JobState::Pending,
        "after retention the id is free again"
    );
}
