//! The chaos suite's short drills: every fault kind once against a real local cluster, with all
//! seven invariants checked, every worker fault with separate workers, and the negative control
//! that proves the checks can fail.

mod support;

use std::process::Command;

use support::BIN;

fn drill(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN).arg("drill").args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_short_drill_of_every_replica_fault_holds_every_invariant() {
    let (code, out, err) = drill(&[
        "--faults",
        "kill,term,pause,partition,follower-kill",
        "--jobs",
        "50",
        "--rate",
        "10",
        "--seed",
        "7",
        "--json",
    ]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rounds = report["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 5);
    for r in rounds.iter().filter(|r| r["fault"] != "follower-kill") {
        assert!(r["serving_ms"].as_u64().is_some(), "{r}");
        assert_ne!(r["old_leader"], r["new_leader"], "{r}");
    }
    assert!(
        rounds
            .iter()
            .any(|r| r["restarted"].as_u64().unwrap_or(0) > 0),
        "no fault cut a running job"
    );
    let invariants = report["invariants"].as_array().unwrap();
    assert_eq!(invariants.len(), 8);
    assert!(invariants.iter().all(|v| v["passed"] == true), "{out}");
    assert_eq!(report["submitted"], 50);
}

#[test]
fn a_drill_of_worker_faults_with_separate_workers_holds_every_invariant() {
    let (code, out, err) = drill(&[
        "--workers",
        "2",
        "--faults",
        "kill,worker-kill,worker-term,worker-pause,worker-partition",
        "--jobs",
        "40",
        "--rate",
        "5",
        "--seed",
        "4",
        "--json",
    ]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let invariants = report["invariants"].as_array().unwrap();
    assert_eq!(invariants.len(), 8);
    assert!(invariants.iter().all(|v| v["passed"] == true), "{out}");
    let rounds = report["rounds"].as_array().unwrap();
    assert!(
        rounds
            .iter()
            .filter(|r| r["fault"] == "kill")
            .all(|r| r["restarted"] == 0),
        "a leader kill restarts nothing when workers are separate: {out}"
    );
}

#[test]
fn a_drill_against_a_three_member_etcd_survives_losing_a_member() {
    let (code, out, err) = drill(&[
        "--etcd-members",
        "3",
        "--faults",
        "etcd-kill,kill",
        "--jobs",
        "30",
        "--rate",
        "10",
        "--seed",
        "11",
    ]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("etcd-kill") && out.contains("all invariants hold"),
        "{out}"
    );
    assert!(
        out.contains("[PASS] 6. submissions kept succeeding during every fault"),
        "{out}"
    );
}

#[test]
fn the_negative_control_without_lease_deadlines_in_guards_is_caught() {
    let (code, out, err) = drill(&[
        "--faults",
        "pause",
        "--jobs",
        "30",
        "--rate",
        "15",
        "--seed",
        "2",
        "--negative-control",
    ]);
    assert_eq!(code, Some(1), "the drill must exit non-zero: {out}\n{err}");
    assert!(out.contains("[FAIL] 2."), "{out}");
    assert!(
        out.contains("started at"),
        "evidence names the overlapping executions: {out}"
    );
    assert!(out.contains("INVARIANTS VIOLATED"));
}

#[test]
fn bad_drill_settings_are_refused() {
    let (code, _, err) = drill(&["--faults", "etcd-kill"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("needs --etcd-members 3"), "{err}");
    let (code, _, err) = drill(&["--faults", "worker-kill"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("needs separate workers"), "{err}");
    let (code, _, err) = drill(&["--faults", "meteor"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("unknown fault"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_cluster_is_drilled_through_fault_commands() {
    use support::{Cluster, Options};
    let c = Cluster::start(Options::default());
    c.wait_leader(&c.all_indices(), std::time::Duration::from_secs(30), |_| {
        true
    })
    .await;
    let eps: Vec<String> = c.replicas.iter().map(|r| r.listen().to_string()).collect();
    // Only this cluster's replica (its etcd port is unique to this test); `[s]` keeps pkill from
    // matching the shell that runs it.
    let etcd = c.etcd.endpoints().join(",");
    let kill = format!("pkill -KILL -f -- '--replica-i[d] {{replica}} .*--etcd-endpoints {etcd} '");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .args([
                "drill",
                "--endpoints",
                &eps.join(","),
                "--cluster",
                "test",
                "--faults",
                "kill",
            ])
            .args([
                "--etcd-endpoints",
                &c.etcd.endpoints().join(","),
                "--kill-cmd",
                &kill,
            ])
            .args([
                "--jobs",
                "20",
                "--rate",
                "10",
                "--recovery-wait",
                "1s",
                "--seed",
                "5",
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for n in [1, 3, 4, 6] {
        assert!(stdout.contains(&format!("[PASS] {n}.")), "{stdout}");
    }
    assert!(
        stdout.contains("[NOT CHECKED] 2.") && stdout.contains("[NOT CHECKED] 5."),
        "{stdout}"
    );
    assert!(stdout.contains(" kill "), "{stdout}");
}

/// Every process whose command line or working folder names `dir`.
fn processes_under(dir: &std::path::Path) -> Vec<String> {
    let d = dir.display().to_string();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if !support::alive(pid) {
            continue;
        }
        let cmd = std::fs::read(e.path().join("cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        let cwd = std::fs::read_link(e.path().join("cwd"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if cmd.contains(&d) || cwd.starts_with(&d) {
            found.push(format!("{pid}: {cmd}"));
        }
    }
    found
}

#[test]
fn a_soak_ends_with_its_duration_not_its_job_cap_and_gives_a_verdict() {
    let started = std::time::Instant::now();
    let (code, out, err) = drill(&[
        "--faults",
        "kill,term",
        "--shuffle",
        "--duration",
        "20s",
        "--jobs",
        "100000",
        "--rate",
        "5",
        "--seed",
        "13",
        "--json",
    ]);
    let took = started.elapsed();
    assert_eq!(code, Some(0), "{out}\n{err}");
    // The duration, then at most the drain bound (180 s), plus setup and teardown; never the
    // 5.5 hours 100,000 submissions at 5/s would take.
    assert!(
        took < std::time::Duration::from_secs(20 + 180 + 60),
        "the soak took {took:?}"
    );
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let submitted = report["submitted"].as_u64().unwrap();
    assert!(
        submitted > 0 && submitted < 1000,
        "--jobs is a cap: {submitted} submitted"
    );
    assert!(report["faults"].as_u64().unwrap() >= 1, "{out}");
    assert_eq!(report["interrupted"], false);
    let invariants = report["invariants"].as_array().unwrap();
    assert!(invariants.iter().all(|v| v["passed"] == true), "{out}");
    assert!(err.contains("drill: progress:"), "no progress line: {err}");
}

#[test]
fn an_interrupted_drill_prints_its_report_and_leaves_no_process() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("drill");
    let mut child = Command::new(BIN)
        .arg("drill")
        .arg("--dir")
        .arg(&folder)
        .args(["--faults", "kill", "--rounds", "1000", "--jobs", "100000"])
        .args(["--rate", "5", "--seed", "17"])
        // Its own group, signalled as a whole, as a terminal's Ctrl-C would.
        .process_group(0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut err = String::new();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    // Interrupt once the first fault's round line is out.
    loop {
        let line = rx
            .recv_timeout(until.saturating_duration_since(std::time::Instant::now()))
            .unwrap_or_else(|_| panic!("no round line within 120s:\n{err}"));
        err.push_str(&line);
        err.push('\n');
        if line.trim_start().starts_with("1  kill") {
            break;
        }
    }
    nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGINT).unwrap();
    let out = child.wait_with_output().unwrap();
    err.extend(rx.try_iter().map(|l| l + "\n"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(130), "{stdout}\n{err}");
    assert!(stdout.contains("INTERRUPTED"), "{stdout}");
    assert!(
        stdout.contains("[PASS] 1.") && stdout.contains("all invariants hold (interrupted)"),
        "{stdout}"
    );
    assert!(
        folder.join("executions.jsonl").exists(),
        "the folder is kept"
    );
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = processes_under(&folder);
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "processes left behind: {left:#?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
