//! Starting jobs cannot starve the lease: hundreds of jobs started at once on a 2-core machine
//! at TTL 2 s cost no step-down and start each job once; starts are bounded per second, in
//! submission order, with the reason shown while jobs wait; a killed Baton leaves no job and no
//! guard running; jobs run niced while their guards keep the replica's priority.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use baton::exec::record::LedgerEntry;
use futures_util::StreamExt;
use support::*;

const LONG: Duration = Duration::from_secs(60);

fn opts(extra: &[&str]) -> Options {
    Options {
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        ..Options::default()
    }
}

/// A cluster whose guards append every execution to a ledger of the test's own.
fn with_ledger(extra: &[&str]) -> (tempfile::TempDir, std::path::PathBuf, Cluster) {
    let scratch = tempfile::tempdir().unwrap();
    let path = scratch.path().join("ledger.jsonl");
    let arg = path.display().to_string();
    let mut args = extra.to_vec();
    args.extend(["--execution-ledger", &arg]);
    let c = Cluster::start(opts(&args));
    (scratch, path, c)
}

/// The ledger's complete lines: a guard may be in the middle of appending the last one.
fn ledger(path: &std::path::Path) -> Vec<LedgerEntry> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..=end]);
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("ledger line {l:?}: {e}")))
        .collect()
}

/// The `stepped_down` events of every replica, with their keepalive figures.
fn step_downs(c: &Cluster) -> Vec<String> {
    c.role_events()
        .into_iter()
        .filter(|e| e.event == "stepped_down")
        .map(|e| {
            format!(
                "{} term {:?}: {:?} (longest keepalive gap {:?} ms)",
                e.replica, e.term, e.reason, e.longest_keepalive_gap_ms
            )
        })
        .collect()
}

fn threads_of(pid: i32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_jobs_started_at_once_cost_no_lease_and_start_once_each() {
    const N: usize = 300;
    let (_scratch, ledger_path, c) = with_ledger(&["--max-running", "300"]);
    let (k, _) = c.leader_index().await;
    let client = c.jobs((k + 1) % 3).await;
    futures_util::stream::iter(0..N)
        .for_each_concurrent(32, |i| {
            let mut cl = client.clone();
            async move {
                cl.submit_job(SubmitJobRequest {
                    job_id: format!("j{i}"),
                    spec: Some(sh("sleep 3")),
                })
                .await
                .unwrap_or_else(|s| panic!("submit j{i}: {s}"));
            }
        })
        .await;
    // No OS thread per running job: the leader's threads stay few while they all run.
    wait_until("all the jobs to have started", LONG, || {
        ledger(&ledger_path)
            .iter()
            .filter(|e| e.event == "start")
            .count()
            == N
    })
    .await;
    let threads = threads_of(c.replicas[k].pid());
    assert!(
        threads < 64,
        "the leader has {threads} threads with {N} jobs running"
    );
    for i in 0..N {
        let j = c
            .wait_job(&[k], &format!("j{i}"), LONG * 2, "terminal", terminal)
            .await;
        assert_eq!(state(&j), JobState::Finished, "{j:?}");
        assert_eq!(
            (j.attempts, j.recoveries),
            (1, 0),
            "j{i} ran more than once"
        );
    }
    let downs = step_downs(&c);
    assert!(downs.is_empty(), "a replica stepped down: {downs:?}");
    let (leader_now, _) = c.leader_index().await;
    assert_eq!(leader_now, k, "leadership moved while the jobs started");
    let mut starts: HashMap<String, usize> = HashMap::new();
    for e in ledger(&ledger_path).iter().filter(|e| e.event == "start") {
        *starts.entry(e.job_id.clone()).or_default() += 1;
    }
    assert_eq!(starts.len(), N, "every job started");
    assert!(
        starts.values().all(|&n| n == 1),
        "a job started twice: {:?}",
        starts.iter().filter(|(_, &n)| n > 1).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_are_bounded_per_second_in_submission_order_and_waiting_jobs_say_why() {
    let (_scratch, ledger_path, c) = with_ledger(&["--max-starts-per-second", "2"]);
    let (k, _) = c.leader_index().await;
    let t0 = baton::clock::BootInstant::now();
    for i in 0..8 {
        c.submit(k, &format!("q{i}"), sh("sleep 30")).await;
    }
    let last = c
        .wait_job(&[k], "q7", LONG, "pending with a reason", |j| {
            state(j) == JobState::Pending && !j.waiting_reason.is_empty()
        })
        .await;
    assert!(
        last.waiting_reason.contains("--max-starts-per-second"),
        "{}",
        last.waiting_reason
    );
    wait_until("all 8 jobs to start", LONG, || {
        ledger(&ledger_path)
            .iter()
            .filter(|e| e.event == "start")
            .count()
            == 8
    })
    .await;
    // The order of the fenced PENDING -> RUNNING writes, as etcd committed them.
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    let registry = client
        .get(
            "/baton/test/registry/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let mut by_rev: Vec<(i64, String)> = registry
        .kvs()
        .iter()
        .map(|kv| {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            (
                kv.mod_revision(),
                key.rsplit('/').next().unwrap().to_string(),
            )
        })
        .collect();
    by_rev.sort();
    let order: Vec<&str> = by_rev.iter().map(|(_, id)| id.as_str()).collect();
    // The first two take the burst together; from then on one at a time, oldest first.
    let mut first_two = order[..2].to_vec();
    first_two.sort();
    assert_eq!(
        first_two,
        ["q0", "q1"],
        "starts out of submission order: {order:?}"
    );
    assert_eq!(
        order[2..],
        ["q2", "q3", "q4", "q5", "q6", "q7"],
        "starts out of submission order: {order:?}"
    );
    // A burst of 2 (one second's worth), then one start every 500 ms: the 8th cannot start
    // earlier than 3 s after q0 was submitted. Load only delays it further.
    let q7 = ledger(&ledger_path)
        .into_iter()
        .find(|e| e.event == "start" && e.job_id == "q7")
        .unwrap();
    let after = Duration::from_nanos(q7.boottime_ns - t0.as_nanos());
    assert!(
        after >= Duration::from_millis(2900),
        "8 starts at 2/s: the last came {after:?} after the first submission"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_baton_leaves_no_job_and_no_guard_running() {
    // Guards that ignore lease deadlines: only the parent's death can stop these jobs.
    let mut c = Cluster::start(Options {
        replicas: 1,
        extra_args: vec!["--unsafe-ignore-guard-deadlines".into()],
        ..Options::default()
    });
    c.leader_index().await;
    let script = "sleep 600 & echo $! >> $BATON_JOB_DIR/pids; echo $$ >> $BATON_JOB_DIR/pids; wait";
    for i in 0..5 {
        c.submit(0, &format!("k{i}"), sh(script)).await;
    }
    let mut jobs = Vec::new();
    let mut guards = Vec::new();
    for i in 0..5 {
        let dir = c.job_dir(&format!("k{i}"));
        wait_until("the job to start its processes", LONG, || {
            read_pids(&dir.join("pids")).len() == 2
        })
        .await;
        let pids = read_pids(&dir.join("pids"));
        let guard: i32 = stat_field(pids[1], 4).unwrap().parse().unwrap();
        assert_eq!(
            stat_field(guard, 4).unwrap().parse::<i32>().unwrap(),
            c.replicas[0].pid(),
            "the guard's parent is the replica"
        );
        jobs.extend(pids);
        guards.push(guard);
    }
    c.replicas[0].sigkill();
    wait_until(
        "every job process and guard of the killed replica to die",
        Duration::from_secs(10),
        || jobs.iter().chain(&guards).all(|&p| !alive(p)),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_and_cleanup_commands_run_niced_and_their_guards_do_not() {
    let c = Cluster::start(opts(&["--job-nice", "7"]));
    let (k, _) = c.leader_index().await;
    let out = c.dir.path().join("nice");
    std::fs::create_dir_all(&out).unwrap();
    let record = |name: &str| {
        format!(
            "cut -d' ' -f19 /proc/self/stat > {o}/{name}-self; \
             cut -d' ' -f19 /proc/$PPID/stat > {o}/{name}-guard",
            o = out.display()
        )
    };
    let mut spec = sh(&record("job"));
    spec.cleanup_command = vec!["sh".into(), "-c".into(), record("cleanup")];
    c.submit(k, "niced", spec).await;
    let read = |f: &str| std::fs::read_to_string(out.join(f)).map(|s| s.trim().to_string());
    wait_until("the cleanup command to record its niceness", LONG, || {
        read("cleanup-guard").is_ok_and(|s| !s.is_empty())
    })
    .await;
    assert_eq!(read("job-self").unwrap(), "7", "the job runs at --job-nice");
    assert_eq!(
        read("job-guard").unwrap(),
        "0",
        "its guard keeps normal priority"
    );
    assert_eq!(read("cleanup-self").unwrap(), "7");
    assert_eq!(read("cleanup-guard").unwrap(), "0");
    assert_eq!(
        stat_field(c.replicas[k].pid(), 19).unwrap(),
        "0",
        "the replica keeps normal priority"
    );
}
