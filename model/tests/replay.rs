//! A real drill's history replayed through the model: every step enabled, every invariant
//! held; and the same history, tampered with as a broken protocol would have written it, fails.

use std::path::PathBuf;
use std::process::Command;

use baton::drill::history::{Event, Step};
use baton_model::replay::{replay, Finding, Summary};

/// Runs a drill (2 replicas, 2 workers, a leader kill and a worker kill) with `--history`, once
/// per test process; its history's lines.
fn history() -> &'static [Step] {
    static HISTORY: std::sync::OnceLock<Vec<Step>> = std::sync::OnceLock::new();
    HISTORY.get_or_init(|| {
        let bin = std::env::var_os("BATON_TEST_RELEASE_BIN")
            .map(PathBuf::from)
            .expect(
                "BATON_TEST_RELEASE_BIN must name a built baton binary: run `make test`, or \
             `cargo build --release --bin baton` and set it to target/release/baton",
            );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("history.jsonl");
        let out = Command::new(&bin)
            .args(["drill", "--replicas", "2", "--workers", "2"])
            .args([
                "--faults",
                "kill,worker-kill",
                "--jobs",
                "30",
                "--rate",
                "20",
            ])
            .args(["--seed", "27", "--lease-ttl", "2s"])
            .arg("--dir")
            .arg(dir.path().join("drill"))
            .arg("--history")
            .arg(&file)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
        assert!(
            out.status.success(),
            "the drill failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    })
}

fn text(steps: &[Step]) -> String {
    steps
        .iter()
        .map(|s| serde_json::to_string(s).unwrap() + "\n")
        .collect()
}

fn check(steps: &[Step]) -> (Summary, Vec<Finding>) {
    replay(&text(steps)).unwrap()
}

fn findings(steps: &[Step]) -> String {
    let (_, f) = check(steps);
    f.iter().map(|f| f.what.clone() + "\n").collect()
}

#[test]
fn a_drill_history_replays_with_every_step_enabled_and_every_invariant_held() {
    let (summary, found) = check(history());
    println!("{summary:#?}");
    assert!(found.is_empty(), "{found:#?}");
    assert_eq!(summary.results, 30, "{summary:?}");
    // A worker killed mid-run: some job ran twice, one start per started record at least.
    assert!(summary.executions > 30, "{summary:?}");
    assert!(summary.started_records >= summary.executions, "{summary:?}");
    assert!(
        summary.assignments >= summary.started_records,
        "{summary:?}"
    );
    assert!(summary.fenced > summary.assignments, "{summary:?}");
}

/// The steps with one put changed by `edit` (the first for which it returns true).
fn tamper(mut edit: impl FnMut(&str, &mut serde_json::Value) -> bool) -> Vec<Step> {
    let mut steps = history().to_vec();
    for s in &mut steps {
        let Step::Etcd { events, .. } = s else {
            continue;
        };
        for e in events {
            let Event::Put { key, value, .. } = e else {
                continue;
            };
            let Ok(mut v) = serde_json::from_str::<serde_json::Value>(value) else {
                continue;
            };
            if edit(key, &mut v) {
                *value = v.to_string();
                return steps;
            }
        }
    }
    panic!("nothing to tamper with");
}

#[test]
fn an_assignment_in_a_stale_term_is_not_enabled() {
    let mut first_term: Option<i64> = None;
    let steps = tamper(|key, v| {
        if !key.contains("/assignments/") {
            return false;
        }
        let term = v["term"].as_i64().unwrap();
        match first_term {
            // An assignment of a later term, made as if by the first leader.
            Some(t) if term != t => {
                v["term"] = t.into();
                true
            }
            _ => {
                first_term = Some(term);
                false
            }
        }
    });
    let f = findings(&steps);
    assert!(f.contains("while the election key's term is"), "{f}");
}

#[test]
fn a_job_assigned_again_after_its_result_is_not_enabled() {
    let mut steps = history().to_vec();
    // The last revision again, as one more: an assignment of a job that has its result.
    let last = steps
        .iter()
        .rev()
        .find_map(|s| match s {
            Step::Etcd { rev, .. } => Some(*rev),
            _ => None,
        })
        .unwrap();
    let assignment = steps
        .iter()
        .find_map(|s| match s {
            Step::Etcd { events, .. } => events.iter().find_map(|e| match e {
                Event::Put { key, value, .. } if key.contains("/assignments/") => {
                    Some((key.clone(), value.clone()))
                }
                _ => None,
            }),
            _ => None,
        })
        .unwrap();
    // Under the term that leads at the end, so only the result store forbids it.
    let term = steps
        .iter()
        .rev()
        .find_map(|s| match s {
            Step::Etcd { events, .. } => events.iter().find_map(|e| match e {
                Event::Put { key, value, .. } if key.contains("/results/") => {
                    serde_json::from_str::<serde_json::Value>(value).ok()?["term"].as_i64()
                }
                _ => None,
            }),
            _ => None,
        })
        .unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&assignment.1).unwrap();
    v["term"] = term.into();
    steps.push(Step::Etcd {
        rev: last + 1,
        events: vec![Event::Put {
            key: assignment.0,
            value: v.to_string(),
            create: last + 1,
            modified: last + 1,
            version: 1,
            lease: 0,
        }],
    });
    let f = findings(&steps);
    assert!(f.contains("assigned beside its result"), "{f}");
}

#[test]
fn an_execution_without_a_started_record_is_not_enabled() {
    let steps = tamper(|key, v| {
        if !key.contains("/attempts/") || v["state"] != "started" {
            return false;
        }
        // Written by a worker incarnation that never was.
        v["worker_rev"] = 1.into();
        true
    });
    let f = findings(&steps);
    assert!(f.contains("started by"), "{f}");
    // And without any started record at all, its execution's start is not enabled either.
    let mut steps = history().to_vec();
    for s in &mut steps {
        if let Step::Etcd { events, .. } = s {
            events.retain(|e| {
                !matches!(e, Event::Put { key, value, .. }
                    if key.contains("/attempts/") && value.contains("\"started\""))
            });
        }
    }
    let f = findings(&steps);
    assert!(f.contains("started without a started record"), "{f}");
}

#[test]
fn overlapping_executions_of_one_job_are_found() {
    let mut steps = history().to_vec();
    // Move one execution's end after the next start of the same job (the drill's recovered or
    // retried job; cleanup steps are not executions of the job): the two overlap.
    let starts: Vec<(usize, String, u64)> = steps
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            Step::Local { entry, .. }
                if entry.event == "start" && entry.name.starts_with("attempt-") =>
            {
                Some((i, entry.job_id.clone(), entry.boottime_ns))
            }
            _ => None,
        })
        .collect();
    let (second, job, at) = starts
        .iter()
        .find(|(i, job, _)| starts.iter().any(|(j, other, _)| j < i && other == job))
        .cloned()
        .expect("a job that ran twice");
    let end = steps
        .iter()
        .position(|s| {
            matches!(s, Step::Local { entry, .. }
                if entry.event == "end" && entry.job_id == job && entry.name.starts_with("attempt-"))
        })
        .unwrap();
    assert!(end < second);
    let Step::Local {
        mut entry,
        after_rev,
        before_rev,
    } = steps.remove(end)
    else {
        unreachable!()
    };
    entry.boottime_ns = at + 1;
    steps.insert(
        second - 1,
        Step::Local {
            entry,
            after_rev,
            before_rev,
        },
    );
    let f = findings(&steps);
    assert!(f.contains("started while"), "{f}");
}
