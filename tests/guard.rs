//! The lease guard on its own (`baton __guard`): it never starts a job whose first deadline has
//! passed, kills the job's whole process group at the deadline without a renewal or as soon as
//! its pipe closes, enforces the attempt timeout, and records every execution.

mod support;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton::clock::BootInstant;
use baton::exec::guard::NOT_STARTED;
use baton::exec::record::{read_exit, KilledBy};
use support::{alive, read_pids, wait_until, BIN};

fn guard(dir: &Path, timeout: &str, script: &str) -> Child {
    Command::new(BIN)
        .args(["__guard", "--job-id", "g", "--attempt", "1", "--term", "7"])
        .arg("--dir")
        .arg(dir)
        .args([
            "--name",
            "attempt-1",
            "--margin",
            "200ms",
            "--timeout",
            timeout,
            "--kill-grace",
            "1s",
        ])
        .args(["--", "sh", "-c", script])
        .env("BATON_JOB_DIR", dir)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap()
}

fn feed(child: &mut Child, deadline: BootInstant) {
    let line = format!("D {}\n", deadline.as_nanos());
    child
        .stdin
        .as_mut()
        .unwrap()
        .write_all(line.as_bytes())
        .unwrap();
}

fn wait_exit(child: &mut Child) -> i32 {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the guard did not exit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until every process the job listed in `pids` is gone.
async fn all_die(pids: &Path) {
    for p in read_pids(pids) {
        wait_until(
            "every process of the job to die",
            Duration::from_secs(5),
            || !alive(p),
        )
        .await;
    }
}

const FAMILY: &str =
    "sleep 60 & echo $! >> $BATON_JOB_DIR/pids; echo $$ >> $BATON_JOB_DIR/pids; wait";

#[test]
fn a_job_whose_first_deadline_has_passed_never_starts() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "10s", "touch $BATON_JOB_DIR/ran");
    feed(&mut g, BootInstant::now() + Duration::from_millis(100));
    assert_eq!(wait_exit(&mut g), NOT_STARTED);
    assert!(!dir.path().join("ran").exists());
    assert!(read_exit(dir.path(), "attempt-1").is_none());
}

#[tokio::test]
async fn without_renewal_the_whole_group_dies_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "60s", FAMILY);
    let deadline = BootInstant::now() + Duration::from_millis(1500);
    feed(&mut g, deadline);
    let pids_file = dir.path().join("pids");
    wait_until(
        "the job and its child to start",
        Duration::from_secs(10),
        || read_pids(&pids_file).len() == 2,
    )
    .await;
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    assert_eq!(rec.killed_by, Some(KilledBy::Deadline));
    assert_eq!(rec.signal, Some(9));
    // Killed at deadline - margin, not later.
    assert!(
        rec.ended_boottime_ns <= (deadline + Duration::from_millis(300)).as_nanos(),
        "{rec:?}"
    );
    for p in read_pids(&pids_file) {
        wait_until("the grandchild to die too", Duration::from_secs(5), || {
            !alive(p)
        })
        .await;
    }
}

#[tokio::test]
async fn renewals_keep_the_job_alive_and_a_closed_pipe_kills_it_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "60s", FAMILY);
    let pids_file = dir.path().join("pids");
    feed(&mut g, BootInstant::now() + Duration::from_millis(800));
    wait_until("the job to start", Duration::from_secs(10), || {
        read_pids(&pids_file).len() == 2
    })
    .await;
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        feed(&mut g, BootInstant::now() + Duration::from_millis(800));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        g.try_wait().unwrap().is_none(),
        "renewed, yet the guard ended the job"
    );
    drop(g.stdin.take());
    let closed = Instant::now();
    assert_eq!(wait_exit(&mut g), 0);
    assert!(closed.elapsed() < Duration::from_secs(2));
    assert_eq!(
        read_exit(dir.path(), "attempt-1").unwrap().killed_by,
        Some(KilledBy::LeaderGone)
    );
    all_die(&pids_file).await;
}

#[test]
fn the_attempt_timeout_is_enforced_and_a_normal_exit_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "300ms", "sleep 30");
    feed(&mut g, BootInstant::now() + Duration::from_secs(30));
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    assert_eq!(rec.killed_by, Some(KilledBy::Timeout));

    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "30s", "echo hi; exit 5");
    feed(&mut g, BootInstant::now() + Duration::from_secs(30));
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    assert_eq!((rec.exit_code, rec.killed_by, rec.term), (Some(5), None, 7));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("attempt-1.log")).unwrap(),
        "hi\n"
    );
}

/// The parent-death signal follows the thread that spawned the guard (which is why Baton spawns
/// from one thread that lives as long as the process): when that thread ends, the guard kills
/// its job at once, even though its pipe is still open and its deadline far away.
#[tokio::test]
async fn a_guard_whose_spawning_thread_dies_kills_its_job() {
    let dir = tempfile::tempdir().unwrap();
    let pids_file = dir.path().join("pids");
    let (path, pids) = (dir.path().to_path_buf(), pids_file.clone());
    let mut g = std::thread::spawn(move || {
        let mut g = guard(&path, "60s", FAMILY);
        feed(&mut g, BootInstant::now() + Duration::from_secs(60));
        // The guard arms its parent-death signal before it starts the job.
        let until = Instant::now() + Duration::from_secs(10);
        while read_pids(&pids).len() < 2 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        g
    })
    .join()
    .unwrap();
    assert_eq!(read_pids(&pids_file).len(), 2, "the job did not start");
    assert_eq!(wait_exit(&mut g), 0);
    assert_eq!(
        read_exit(dir.path(), "attempt-1").unwrap().killed_by,
        Some(KilledBy::LeaderGone)
    );
    all_die(&pids_file).await;
}
