//! `baton bench` at tiny sizes, so it cannot rot: every scenario runs against its own etcd and
//! cluster, the JSON report holds figures that could only come from real runs, and the
//! pictures are drawn.

mod support;

use std::time::Duration;

use serde_json::Value;

use support::run_cli;

fn num(v: &Value, path: &[&str]) -> f64 {
    let mut at = v;
    for p in path {
        at = match p.parse::<usize>() {
            Ok(i) => &at[i],
            Err(_) => &at[*p],
        };
    }
    at.as_f64()
        .unwrap_or_else(|| panic!("{} is not a number in {v:#}", path.join(".")))
}

#[test]
fn every_scenario_runs_at_tiny_sizes_and_reports_real_figures() {
    let dir = tempfile::tempdir().unwrap();
    let plots = dir.path().join("plots");
    let work = dir.path().join("work");
    let (code, stdout, stderr) = run_cli(
        &[
            "bench",
            "--json",
            "--duration",
            "300ms",
            "--concurrency",
            "1,4",
            "--e2e-jobs",
            "20",
            "--guard-memory-jobs",
            "3",
            "--workers",
            "1",
            "--recovery-jobs",
            "300",
            "--failovers",
            "1",
            "--failover-ttls",
            "2s",
            "--schedules",
            "50",
            "--schedule-ticks",
            "3",
            "--console-jobs",
            "300",
            "--dir",
            work.to_str().unwrap(),
            "--plot",
            plots.to_str().unwrap(),
        ],
        Duration::from_secs(600),
    );
    assert_eq!(code, Some(0), "baton bench failed: {stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("--json prints JSON");

    // submit: both loads ran at each concurrency, and the ratio is theirs.
    let points = report["submit"].as_array().expect("submit points");
    assert_eq!(points.len(), 2);
    for (i, c) in [1.0, 4.0].into_iter().enumerate() {
        let i = &i.to_string();
        assert_eq!(num(&report, &["submit", i, "concurrency"]), c);
        let raw = num(&report, &["submit", i, "raw", "ops_per_sec"]);
        let baton = num(&report, &["submit", i, "baton", "ops_per_sec"]);
        assert!(raw > 0.0 && baton > 0.0, "{report:#}");
        let ratio = num(&report, &["submit", i, "ratio"]);
        assert!((ratio - baton / raw).abs() < 1e-6);
        assert!(num(&report, &["submit", i, "baton", "p99_ms"]) > 0.0);
    }
    // e2e: every job reached a clean result, and etcd counted what they cost.
    assert_eq!(num(&report, &["e2e", "jobs"]), 20.0);
    assert!(num(&report, &["e2e", "clean_per_sec"]) > 0.0);
    assert!(num(&report, &["e2e", "etcd_requests_per_job"]) > 0.0);
    assert!(num(&report, &["e2e", "etcd_writes_per_job"]) >= 4.0);
    // The leader's read of a job alone is eight ranges (seven keys and the attempts prefix).
    assert!(num(&report, &["e2e", "etcd_ranges_per_job"]) >= 8.0);
    // The guards: the bare spawn rate, the legacy guard's run of the same jobs, and each
    // kind's memory with its jobs running.
    assert_eq!(report["e2e"]["guard"], "small");
    // Sampled before, between and after the two runs; the ratios use the median.
    let samples: Vec<f64> = report["guards"]["bare_spawn_samples"]
        .as_array()
        .expect("bare spawn samples")
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(samples.len(), 3, "{samples:?}");
    assert!(samples.iter().all(|r| *r > 0.0), "{samples:?}");
    let mut sorted = samples.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(num(&report, &["guards", "bare_spawns_per_sec"]), sorted[1]);
    assert_eq!(report["guards"]["legacy"]["guard"], "legacy");
    assert_eq!(num(&report, &["guards", "legacy", "jobs"]), 20.0);
    assert!(num(&report, &["guards", "legacy", "clean_per_sec"]) > 0.0);
    // Each run's CPU per job, by kind of process: the guards and their jobs (the workers'
    // reaped children) used some, the whole binary as the legacy guard more than the small
    // guard (about 2.5x in this project's runs), and the kinds together stay within what the
    // machine's cores spent (give or take a tick per process of the 7, over 20 jobs).
    let cpu = |run: &Value, k: &str| num(&run["cpu"], &[k]);
    for run in [&report["e2e"], &report["guards"]["legacy"]] {
        let kinds = [
            "etcd_ms",
            "leader_ms",
            "followers_ms",
            "workers_ms",
            "guards_and_jobs_ms",
            "bench_ms",
        ];
        assert!(cpu(run, "guards_and_jobs_ms") > 0.0, "{run:#}");
        let sum: f64 = kinds.iter().map(|k| cpu(run, k)).sum();
        assert!(sum <= cpu(run, "machine_ms") + 7.0 * 10.0 / 20.0, "{run:#}");
    }
    assert!(
        cpu(&report["guards"]["legacy"], "guards_and_jobs_ms")
            > cpu(&report["e2e"], "guards_and_jobs_ms"),
        "{report:#}"
    );
    for (n, kind) in ["legacy", "small"].iter().enumerate() {
        assert_eq!(report["guards"]["memory"][n]["guard"], *kind);
        let i = &n.to_string();
        assert_eq!(num(&report, &["guards", "memory", i, "running"]), 3.0);
        assert!(num(&report, &["guards", "memory", i, "private_kib_per_job"]) > 0.0);
        assert!(
            num(
                &report,
                &["guards", "memory", i, "worker_and_guards_pss_mib"]
            ) > 1.0
        );
    }
    // recovery: the new leader logged both parts; the raw read is beside it.
    assert_eq!(num(&report, &["recovery", "0", "jobs"]), 300.0);
    assert!(num(&report, &["recovery", "0", "registry_ms"]) > 0.0);
    assert!(num(&report, &["recovery", "0", "raw_read_ms"]) > 0.0);
    assert!(num(&report, &["recovery", "0", "leader", "rss_mb"]) > 1.0);
    // failover at TTL 2 s, with fast failover then without: one of each fault. A SIGKILL is
    // revoked on evidence or waits out the lease; a SIGSTOP always waits; the killed leader's
    // worker's job waits for that worker's lease either way.
    for (i, fast) in [(0, true), (1, false)] {
        let run = &i.to_string();
        let f = |k: &[&str]| num(&report, &[&["failover", "runs", run.as_str()], k].concat());
        assert_eq!(report["failover"]["runs"][i]["fast_failover"], fast);
        for what in [
            "kill_serving",
            "term_serving",
            "stop_serving",
            "kill_job_rerun",
        ] {
            assert_eq!(f(&[what, "n"]), 1.0, "{what}: {report:#}");
        }
        assert_eq!(f(&["overlapping_terms"]), 0.0);
        assert_eq!(
            report["failover"]["runs"][i]["unproven_revokes"],
            serde_json::json!([])
        );
        assert!(f(&["stop_serving", "p50_ms"]) >= 1000.0, "{report:#}");
        assert!(f(&["kill_job_rerun", "p50_ms"]) >= 1500.0, "{report:#}");
        if fast {
            assert_eq!(f(&["revokes"]), 1.0, "{report:#}");
            assert!(f(&["kill_leaderless", "p50_ms"]) < 1000.0, "{report:#}");
        } else {
            assert_eq!(f(&["revokes"]), 0.0, "{report:#}");
            assert!(f(&["kill_leaderless", "p50_ms"]) >= 1000.0, "{report:#}");
        }
    }
    // footprint: real processes.
    assert!(num(&report, &["footprint", "idle_follower", "rss_mb"]) > 1.0);
    assert!(num(&report, &["footprint", "idle_worker", "rss_mb"]) > 1.0);
    // schedules: ticks seen by the watch; a killed leader's tick is fired by the next term.
    assert_eq!(num(&report, &["schedules", "idle_lag", "n"]), 3.0);
    assert_eq!(num(&report, &["schedules", "kill_to_job", "n"]), 1.0);
    assert!(num(&report, &["schedules", "kill_to_job", "p50_ms"]) > 0.0);
    assert_eq!(num(&report, &["schedules", "burst_created"]), 50.0);
    assert!(num(&report, &["schedules", "leader_rss_mb"]) > 1.0);
    assert!(num(&report, &["schedules", "etcd_db_mb"]) > 0.0);
    // console: every view answered a page; the consoles got events; etcd counted watchers.
    assert_eq!(num(&report, &["console", "jobs"]), 300.0);
    let views = report["console"]["views"]
        .as_array()
        .expect("console views");
    assert!(views.len() >= 8);
    assert_eq!(
        num(&report, &["console", "views", "0", "jobs_on_page"]),
        100.0
    );
    assert!(num(&report, &["console", "views", "0", "max_ms"]) > 0.0);
    assert_eq!(num(&report, &["console", "busy", "consoles"]), 50.0);
    assert!(num(&report, &["console", "busy", "events"]) >= 50.0);
    assert!(num(&report, &["console", "idle", "etcd_watchers"]) > 0.0);
    assert!(num(&report, &["console", "with", "clean_per_sec"]) > 0.0);
    assert!(!report["targets"].as_array().unwrap().is_empty());
    for name in ["submit-throughput.svg", "submit-latency-cdf.svg"] {
        let svg = std::fs::read_to_string(plots.join(name)).unwrap();
        assert!(
            svg.contains("<svg") && svg.contains("baton SubmitJob"),
            "{name}"
        );
    }
}

#[test]
fn an_unknown_scenario_is_refused_with_the_known_ones() {
    let (code, _, err) = run_cli(
        &["bench", "--scenarios", "submit,warp"],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1));
    assert!(err.contains("warp") && err.contains("failover"), "{err}");
}
