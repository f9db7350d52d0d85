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
             `cargo build --release --bin baton && ./scripts/build-guard --release` and set it to \
             target/release/baton",
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

/// The first put (from the end with `rev`) whose key `matches`: its key and value.
fn find_put(steps: &[Step], rev: bool, matches: impl Fn(&str) -> bool) -> (String, String) {
    let found = |s: &Step| match s {
        Step::Etcd { events, .. } => events.iter().find_map(|e| match e {
            Event::Put { key, value, .. } if matches(key) => Some((key.clone(), value.clone())),
            _ => None,
        }),
        _ => None,
    };
    if rev {
        steps.iter().rev().find_map(found)
    } else {
        steps.iter().find_map(found)
    }
    .expect("a put to tamper with")
}

/// Appends a revision after the last that puts `value` at `key` (created there).
fn append_put(steps: &mut Vec<Step>, key: String, value: String) -> i64 {
    let last = steps
        .iter()
        .rev()
        .find_map(|s| match s {
            Step::Etcd { rev, .. } => Some(*rev),
            _ => None,
        })
        .unwrap();
    steps.push(Step::Etcd {
        rev: last + 1,
        events: vec![Event::Put {
            key,
            value,
            create: last + 1,
            modified: last + 1,
            version: 1,
            lease: 0,
        }],
    });
    last + 1
}

#[test]
fn a_drill_history_replays_with_every_step_enabled_and_every_invariant_held() {
    let (summary, found) = check(history());
    println!("{summary:#?}");
    assert!(found.is_empty(), "{found:#?}");
    // The drill's 30 jobs, and the jobs of its schedules' ticks.
    assert!(summary.results > 30, "{summary:?}");
    // Every job ran (a worker killed mid-run restarts one, if the kill found it running).
    assert!(summary.executions >= 30, "{summary:?}");
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
    // An assignment of a job that has its result, under the term that leads at the end, so
    // only the result store forbids it.
    let (key, value) = find_put(&steps, false, |k| k.contains("/assignments/"));
    let (_, result) = find_put(&steps, true, |k| k.contains("/results/"));
    let term = serde_json::from_str::<serde_json::Value>(&result).unwrap()["term"].clone();
    let mut v: serde_json::Value = serde_json::from_str(&value).unwrap();
    v["term"] = term;
    append_put(&mut steps, key, v.to_string());
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

/// The first job execution's start line (its index) and job.
fn first_start(steps: &[Step]) -> (usize, String) {
    steps
        .iter()
        .enumerate()
        .find_map(|(i, s)| match s {
            Step::Local { entry, .. }
                if entry.event == "start" && entry.name.starts_with("attempt-") =>
            {
                Some((i, entry.job_id.clone()))
            }
            _ => None,
        })
        .expect("an execution")
}

#[test]
fn overlapping_executions_of_one_job_are_found() {
    let mut steps = history().to_vec();
    // A second execution of the first job, started a moment after it on another pid.
    let (i, _) = first_start(&steps);
    let Step::Local {
        mut entry,
        after_rev,
        before_rev,
    } = steps[i].clone()
    else {
        unreachable!()
    };
    entry.pid += 100_000;
    entry.boottime_ns += 1;
    steps.insert(
        i + 1,
        Step::Local {
            entry,
            after_rev,
            before_rev,
        },
    );
    let f = findings(&steps);
    assert!(f.contains("started while"), "{f}");
}

#[test]
fn an_assignment_while_an_execution_of_its_job_still_runs_is_not_enabled() {
    let mut steps = history().to_vec();
    // The first job's execution ends only after everything else, and the job is assigned again
    // at the end (also beside its result, which is found too).
    let (start, job) = first_start(&steps);
    let end = (start..steps.len())
        .find(|&i| {
            matches!(&steps[i], Step::Local { entry, .. }
                if entry.event == "end" && entry.job_id == job && entry.name.starts_with("attempt-"))
        })
        .unwrap();
    let Step::Local { mut entry, .. } = steps.remove(end) else {
        unreachable!()
    };
    let tail = format!("/{job}");
    let (key, value) = find_put(&steps, false, |k| {
        k.contains("/assignments/") && k.ends_with(&tail)
    });
    let last = append_put(&mut steps, key, value);
    entry.boottime_ns = u64::MAX;
    steps.push(Step::Local {
        entry,
        after_rev: last,
        before_rev: last,
    });
    let f = findings(&steps);
    assert!(f.contains(&format!("{job} assigned while")), "{f}");
}

#[test]
fn a_second_result_of_a_job_is_found() {
    let mut steps = history().to_vec();
    // The same job's result again, once its first has moved to clean and gone from dirty.
    let (key, value) = find_put(&steps, true, |k| k.contains("/results/dirty/"));
    append_put(&mut steps, key, value);
    let f = findings(&steps);
    assert!(f.contains("a second result of"), "{f}");
}
