//! A job's cleanup as a list of steps, and how their progress is kept in the dirty entry.
//!
//! The steps, in order: `command` (the spec's `cleanup_command`, if any), the spec's ordered
//! steps one after another in the given order, then its concurrent steps together. The
//! built-in stages (`folder`, `finish`) come after every step.
//!
//! An entry whose job has no named steps, no abandonment and no stray attempts is written as
//! version 2, the `command` step's progress in the entry's own fields, exactly as releases
//! before steps wrote it (so an older leader in a rolling update goes on cleaning it). Anything
//! else is version 3, with each step's progress by name; a version 2 entry reads as its
//! `command` step.

use super::records::{
    CleanupProgress, JobResult, StepProgress, StepState, RESULT_VERSION, RESULT_VERSION_STEPS,
};
use super::spec::{JobSpec, StepMode};

/// The name of `cleanup_command`'s step.
pub const COMMAND_STEP: &str = "command";

/// One step of a job's cleanup plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedStep {
    pub name: String,
    pub command: Vec<String>,
    pub mode: StepMode,
}

/// The steps of `spec`'s cleanup, in the order they run.
pub fn plan(spec: &JobSpec) -> Vec<PlannedStep> {
    let command = (!spec.cleanup_command.is_empty()).then(|| PlannedStep {
        name: COMMAND_STEP.into(),
        command: spec.cleanup_command.clone(),
        mode: StepMode::Ordered,
    });
    let named = |mode: StepMode| {
        spec.cleanup_steps
            .iter()
            .filter(move |s| s.mode == mode)
            .map(|s| PlannedStep {
                name: s.name.clone(),
                command: s.command.clone(),
                mode: s.mode,
            })
    };
    command
        .into_iter()
        .chain(named(StepMode::Ordered))
        .chain(named(StepMode::Concurrent))
        .collect()
}

/// Whether an entry must be version 3 to say what `progress` holds for a job with `plan`.
pub fn needs_steps_version(plan: &[PlannedStep], progress: &CleanupProgress) -> bool {
    plan.iter().any(|s| s.name != COMMAND_STEP)
        || progress.abandoned.is_some()
        || !progress.strays.is_empty()
}

/// Each planned step's progress as `result` records it, whatever its version.
pub fn load(result: &JobResult, plan: &[PlannedStep]) -> Vec<StepProgress> {
    let c = &result.cleanup;
    plan.iter()
        .map(|p| {
            let mut s = if let Some(s) = c.steps.iter().find(|s| s.name == p.name) {
                s.clone()
            } else if p.name == COMMAND_STEP && c.steps.is_empty() {
                command_from_fields(c)
            } else {
                StepProgress {
                    name: p.name.clone(),
                    ..StepProgress::default()
                }
            };
            s.mode = p.mode;
            s
        })
        .collect()
}

/// A version 1 or 2 entry's `command` step, from the entry's own fields.
fn command_from_fields(c: &CleanupProgress) -> StepProgress {
    let assigned = c.assigned.clone().filter(|a| a.step != "folder");
    let state = if c.stage >= 1 {
        StepState::Done
    } else if assigned.is_some() {
        StepState::Running
    } else if c.needs_operator {
        StepState::NeedsOperator
    } else if c.next_retry_ms > 0 || c.last_error.is_some() {
        StepState::Retrying
    } else {
        StepState::Pending
    };
    StepProgress {
        name: COMMAND_STEP.into(),
        mode: StepMode::Ordered,
        state,
        attempts: c.attempts,
        retries: if c.stage >= 1 { 0 } else { c.retries },
        next_retry_ms: if c.stage >= 1 { 0 } else { c.next_retry_ms },
        last_error: if c.stage >= 1 {
            None
        } else {
            c.last_error.clone()
        },
        assigned,
    }
}

/// Writes `steps` into `result` during the steps phase (stage 0): as version 2 when nothing
/// needs version 3, else version 3 with the entry's own fields summing up the steps.
pub fn store(result: &mut JobResult, plan: &[PlannedStep], steps: Vec<StepProgress>) {
    let c = &mut result.cleanup;
    if result.version >= RESULT_VERSION_STEPS || needs_steps_version(plan, c) {
        result.version = RESULT_VERSION_STEPS;
        c.attempts = steps.iter().map(|s| s.attempts).sum();
        c.needs_operator = steps.iter().any(|s| s.state == StepState::NeedsOperator);
        c.next_retry_ms = steps
            .iter()
            .filter(|s| s.state == StepState::Retrying)
            .map(|s| s.next_retry_ms)
            .min()
            .unwrap_or(0);
        c.last_error = steps
            .iter()
            .filter(|s| s.state != StepState::Done)
            .find_map(|s| s.last_error.clone());
        c.retries = 0;
        c.assigned = None;
        c.steps = steps;
        return;
    }
    result.version = RESULT_VERSION;
    c.steps.clear();
    match steps.into_iter().next() {
        Some(s) => {
            c.attempts = s.attempts;
            c.retries = s.retries;
            c.next_retry_ms = s.next_retry_ms;
            c.last_error = s.last_error;
            c.needs_operator = s.state == StepState::NeedsOperator;
            c.assigned = s.assigned;
        }
        None => {
            c.retries = 0;
            c.next_retry_ms = 0;
            c.last_error = None;
            c.needs_operator = false;
            c.assigned = None;
        }
    }
}

/// The folder stage's progress (stage 1), kept in the entry's own fields in every version.
pub fn folder(c: &CleanupProgress) -> StepProgress {
    let assigned = c.assigned.clone().filter(|a| a.step == "folder");
    StepProgress {
        name: "folder".into(),
        mode: StepMode::Ordered,
        state: if assigned.is_some() {
            StepState::Running
        } else if c.needs_operator {
            StepState::NeedsOperator
        } else if c.next_retry_ms > 0 {
            StepState::Retrying
        } else {
            StepState::Pending
        },
        attempts: c.attempts,
        retries: c.retries,
        next_retry_ms: c.next_retry_ms,
        last_error: c.last_error.clone(),
        assigned,
    }
}

/// Writes the folder stage's progress back into the entry's own fields.
pub fn store_folder(c: &mut CleanupProgress, f: StepProgress) {
    c.attempts = f.attempts;
    c.retries = f.retries;
    c.next_retry_ms = f.next_retry_ms;
    c.last_error = f.last_error;
    c.needs_operator = f.state == StepState::NeedsOperator;
    c.assigned = f.assigned;
}

/// Which steps may run now: the first unfinished ordered step, or, once every ordered step
/// is done, every unfinished concurrent one. Indexes into `plan`.
pub fn runnable(plan: &[PlannedStep], steps: &[StepProgress]) -> Vec<usize> {
    let open = |i: &usize| steps.get(*i).is_none_or(|s| s.state != StepState::Done);
    if let Some(i) = (0..plan.len())
        .filter(|i| plan[*i].mode == StepMode::Ordered)
        .find(open)
    {
        return vec![i];
    }
    (0..plan.len())
        .filter(|i| plan[*i].mode == StepMode::Concurrent)
        .filter(open)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::records::{CleanupAssigned, TerminalStatus};
    use crate::jobs::spec::CleanupStep;
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn spec(cleanup: &[&str], steps: &[(&str, StepMode)]) -> JobSpec {
        JobSpec {
            command: vec!["true".into()],
            env: BTreeMap::new(),
            cleanup_command: cleanup.iter().map(|s| s.to_string()).collect(),
            max_attempts: 3,
            timeout: Duration::from_secs(60),
            worker_selector: BTreeMap::new(),
            cleanup_steps: steps
                .iter()
                .map(|(n, m)| CleanupStep {
                    name: n.to_string(),
                    command: vec!["true".into()],
                    mode: *m,
                })
                .collect(),
        }
    }

    fn result(version: u32, cleanup: CleanupProgress) -> JobResult {
        JobResult {
            version,
            job_id: "j".into(),
            status: TerminalStatus::Finished,
            exit_code: Some(0),
            signal: None,
            error: None,
            attempts: 1,
            failed_attempts: 0,
            recoveries: 0,
            preemptions: 0,
            submitted_at_ms: 1,
            submitted_by: None,
            started_at_ms: 2,
            finished_at_ms: 3,
            spec_hash: "h".into(),
            log_tail: String::new(),
            term: 4,
            cleanup,
            worker: None,
            worker_rev: 0,
        }
    }

    #[test]
    fn the_plan_runs_the_command_then_ordered_steps_then_concurrent_ones() {
        use StepMode::*;
        let s = spec(
            &["rm", "x"],
            &[
                ("a", Concurrent),
                ("b", Ordered),
                ("c", Concurrent),
                ("d", Ordered),
            ],
        );
        let names: Vec<String> = plan(&s).into_iter().map(|p| p.name).collect();
        assert_eq!(names, ["command", "b", "d", "a", "c"]);
        let p = plan(&s);
        let mut steps = load(&result(3, CleanupProgress::default()), &p);
        assert_eq!(runnable(&p, &steps), vec![0]);
        steps[0].state = StepState::Done;
        steps[1].state = StepState::Done;
        assert_eq!(runnable(&p, &steps), vec![2]);
        steps[2].state = StepState::Done;
        assert_eq!(runnable(&p, &steps), vec![3, 4]);
        steps[4].state = StepState::Done;
        assert_eq!(runnable(&p, &steps), vec![3]);
        steps[3].state = StepState::Done;
        assert!(runnable(&p, &steps).is_empty());
        assert!(plan(&spec(&[], &[])).is_empty());
    }

    #[test]
    fn a_version_2_entry_reads_as_its_command_step_and_is_written_back_the_same() {
        let p = plan(&spec(&["rm", "x"], &[]));
        let a = CleanupAssigned {
            worker: "w1".into(),
            worker_rev: 7,
            worker_lease: 0,
            worker_ttl_ms: 3000,
            assign_timeout_ms: 10000,
            step: "3".into(),
        };
        let v2 = CleanupProgress {
            attempts: 2,
            retries: 1,
            last_error: Some("exit 1".into()),
            assigned: Some(a.clone()),
            ..CleanupProgress::default()
        };
        let r = result(2, v2.clone());
        let steps = load(&r, &p);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].state, StepState::Running);
        assert_eq!((steps[0].attempts, steps[0].retries), (2, 1));
        assert_eq!(steps[0].assigned, Some(a));
        let mut back = r.clone();
        store(&mut back, &p, steps);
        assert_eq!(back, r, "a version 2 entry round-trips unchanged");
        let done = result(
            2,
            CleanupProgress {
                stage: 1,
                attempts: 4,
                ..CleanupProgress::default()
            },
        );
        assert_eq!(load(&done, &p)[0].state, StepState::Done);
        let exhausted = result(
            2,
            CleanupProgress {
                attempts: 5,
                needs_operator: true,
                ..CleanupProgress::default()
            },
        );
        assert_eq!(load(&exhausted, &p)[0].state, StepState::NeedsOperator);
    }

    #[test]
    fn named_steps_abandonment_or_strays_make_a_version_3_entry() {
        let p = plan(&spec(&["rm"], &[("a", StepMode::Ordered)]));
        let mut r = result(2, CleanupProgress::default());
        let mut steps = load(&r, &p);
        steps[0].state = StepState::Done;
        steps[0].attempts = 1;
        steps[1].state = StepState::Retrying;
        steps[1].attempts = 2;
        steps[1].next_retry_ms = 99;
        steps[1].last_error = Some("no".into());
        store(&mut r, &p, steps.clone());
        assert_eq!(r.version, RESULT_VERSION_STEPS);
        assert_eq!(r.cleanup.attempts, 3);
        assert_eq!(r.cleanup.next_retry_ms, 99);
        assert_eq!(r.cleanup.last_error.as_deref(), Some("no"));
        assert_eq!(load(&r, &p), steps, "read back by name");
        let json = String::from_utf8(crate::store::codec::encode(&r)).unwrap();
        assert!(json.contains("\"steps\":[{\"name\":\"command\""), "{json}");

        let only = plan(&spec(&["rm"], &[]));
        let mut r = result(2, CleanupProgress::default());
        r.cleanup.abandoned = Some(crate::jobs::records::Abandonment {
            reason: None,
            by: "op".into(),
            at_ms: 5,
        });
        let steps = load(&r, &only);
        store(&mut r, &only, steps);
        assert_eq!(r.version, RESULT_VERSION_STEPS);
        let plain = result(2, CleanupProgress::default());
        let json = String::from_utf8(crate::store::codec::encode(&plain)).unwrap();
        for absent in ["steps", "abandoned", "strays"] {
            assert!(!json.contains(absent), "{json}");
        }
    }

    #[test]
    fn the_folder_stage_keeps_its_progress_in_the_entry_fields() {
        let mut c = CleanupProgress {
            stage: 1,
            attempts: 3,
            ..CleanupProgress::default()
        };
        let mut f = folder(&c);
        assert_eq!(f.state, StepState::Pending);
        f.retries = 2;
        f.next_retry_ms = 10;
        f.state = StepState::Retrying;
        store_folder(&mut c, f.clone());
        assert_eq!(folder(&c), f);
    }
}
