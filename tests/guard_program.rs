//! The guard program as a worker holds it: opened and checked at start (a missing, unexecutable
//! or foreign one is a clear error then), spawned through the open descriptor (replacing or
//! removing the file changes nothing until a restart), and a guard that cannot be spawned
//! rejects its assignments without running the job, until a spawn succeeds again.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use baton::proto::fleet_service_client::FleetServiceClient;
use baton::proto::{ListWorkersRequest, WorkerInfo};
use support::*;

const LONG: Duration = Duration::from_secs(60);

/// A copy of the guard program in a folder of the test's own.
fn own_guard(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let path = bin.join("baton-guard");
    std::fs::copy(guard_bin(), &path).unwrap();
    path
}

async fn workers_at(c: &Cluster, i: usize) -> Vec<WorkerInfo> {
    let Ok(ch) =
        tonic::transport::Endpoint::from_shared(format!("http://{}", c.replicas[i].listen()))
            .unwrap()
            .connect()
            .await
    else {
        return Vec::new();
    };
    FleetServiceClient::new(ch)
        .list_workers(ListWorkersRequest {})
        .await
        .map(|r| r.into_inner().workers)
        .unwrap_or_default()
}

#[test]
fn a_missing_unexecutable_or_foreign_guard_binary_stops_the_worker_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    std::fs::write(&plain, "#!/bin/sh\necho 1\n").unwrap();
    std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
    let foreign = dir.path().join("foreign");
    std::fs::write(&foreign, b"\x7fELF garbage").unwrap();
    std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o755)).unwrap();
    let missing = dir.path().join("missing").display().to_string();
    let cases = [
        (missing.as_str(), "cannot open the guard binary"),
        (plain.to_str().unwrap(), "Permission denied"),
        (foreign.to_str().unwrap(), "cannot run the guard binary"),
    ];
    for (bin, says) in cases {
        // etcd is never reached: the guard is checked first.
        let (code, _, err) = run_cli(
            &[
                "worker",
                "--etcd-endpoints",
                "http://127.0.0.1:9",
                "--storage-dir",
                dir.path().join("storage").to_str().unwrap(),
                "--guard-bin",
                bin,
            ],
            Duration::from_secs(30),
        );
        assert_ne!(code, Some(0), "{bin}: {err}");
        assert!(err.contains(says) && err.contains(bin), "{bin}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_binary_replaced_or_removed_under_a_running_worker_changes_nothing() {
    let tools = tempfile::tempdir().unwrap();
    let path = own_guard(tools.path());
    let arg = path.display().to_string();
    let c = Cluster::start(worker_opts(1, &["--guard-bin", &arg]));
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    let all = c.all_indices();
    let ran = |id: &'static str| {
        let out = out.clone();
        let c = &c;
        let all = all.clone();
        async move {
            c.submit(0, id, brief(&out, 0.0)).await;
            let j = c.wait_job(&all, id, LONG, "terminal", terminal).await;
            assert_eq!(state(&j), JobState::Finished, "{id}: {j:?}");
            assert_eq!(runs(&out, id), 1);
        }
    };
    ran("before").await;
    // An upgrade's rename over the file: a program that would fail every spawn.
    let next = path.with_extension("new");
    std::fs::write(&next, b"not a program").unwrap();
    std::fs::set_permissions(&next, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&next, &path).unwrap();
    ran("replaced").await;
    std::fs::remove_file(&path).unwrap();
    ran("removed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_guard_binary_makes_assignments_come_back_rejected_never_run() {
    let tools = tempfile::tempdir().unwrap();
    let path = own_guard(tools.path());
    let good = std::fs::read(&path).unwrap();
    let arg = path.display().to_string();
    // A short assign timeout: the leader gives a worker that could not start a job nothing for
    // three of them, and the jobs come back sooner.
    let c = Cluster::start(worker_opts(
        1,
        &["--guard-bin", &arg, "--assign-timeout", "2s"],
    ));
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    // Written into the very file the worker holds open (no guard runs it now, so the kernel
    // allows the write): every spawn fails from here on.
    std::fs::write(&path, b"not a program").unwrap();
    let ids = ["j1", "j2", "j3"];
    for id in ids {
        c.submit(0, id, brief(&out, 0.0)).await;
    }
    let unable = wait_for("the worker to say it cannot start guards", LONG, || async {
        workers_at(&c, 0)
            .await
            .into_iter()
            .find(|w| w.worker_id == "w1" && !w.unable.is_empty())
    })
    .await;
    assert!(
        unable.unable.contains("cannot start the guard")
            && unable.unable.contains("Exec format error"),
        "{unable:?}"
    );
    let (code, text, _) = run_cli(
        &[
            "worker",
            "list",
            "--endpoints",
            &c.replicas[0].listen().to_string(),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0));
    assert!(
        text.contains("unable") && text.contains("w1 takes no assignments: cannot start the guard"),
        "{text}"
    );
    for id in ids {
        let j = c.get_job(0, id).await.unwrap();
        assert!(!terminal(&j), "{j:?}");
        assert_eq!(runs(&out, id), 0, "a job ran without its guard");
    }
    // The program is good again: the worker's own probe finds it and takes work again.
    std::fs::write(&path, &good).unwrap();
    for id in ids {
        let j = c
            .wait_job(&c.all_indices(), id, LONG, "terminal", terminal)
            .await;
        assert_eq!(state(&j), JobState::Finished, "{j:?}");
        assert_eq!(runs(&out, id), 1);
        assert_eq!(j.attempts, 1, "rejections are not attempts: {j:?}");
    }
    wait_for("the mark to go", LONG, || async {
        workers_at(&c, 0)
            .await
            .into_iter()
            .find(|w| w.worker_id == "w1" && w.unable.is_empty())
    })
    .await;
}

/// A guard killed under its running job (the OOM killer, an operator) leaves no exit record:
/// the job's group is killed, the attempt counts as lost, and the job runs again as a counted
/// recovery, never beside what is left of the first run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_killed_under_its_job_ends_the_attempt_as_lost_and_its_group_with_it() {
    let c = Cluster::start(worker_opts(1, &[]));
    c.wait_workers(&["w1"]).await;
    let out = scratch(&c);
    c.submit(0, "k", gated(&out, "gate")).await;
    wait_until("the job to start", LONG, || runs(&out, "k") == 1).await;
    let dir = c.job_dir("k");
    let job = wait_for("the guard to note the job's pid", LONG, || async {
        baton::exec::record::read_pid(&dir, "attempt-1")
    })
    .await;
    let stat = std::fs::read_to_string(format!("/proc/{job}/stat")).unwrap();
    let guard: i32 = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(guard),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_until("the job to run again", LONG, || runs(&out, "k") == 2).await;
    assert!(!alive(job), "the first run's group outlived its guard");
    std::fs::write(out.join("gate"), "").unwrap();
    let j = c
        .wait_job(&c.all_indices(), "k", LONG, "terminal", terminal)
        .await;
    assert_eq!(state(&j), JobState::Finished, "{j:?}");
    assert_eq!(j.recoveries, 1, "{j:?}");
}
