//! The chaos suite's short drills: every fault kind once against a real local cluster, with all
//! six invariants checked, and the negative control that proves the checks can fail.

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
    assert_eq!(invariants.len(), 6);
    assert!(invariants.iter().all(|v| v["passed"] == true), "{out}");
    assert_eq!(report["submitted"], 50);
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
    let kill = format!(
        "pkill -KILL -f -- '--etcd-endpoint[s] {etcd} --cluster test --replica-id {{replica}} '"
    );
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
