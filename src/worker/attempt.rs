//! One assignment on this worker, from acceptance to the record of how it ended.
//!
//! Order of events, each a crash point that leaves a state the leader can read:
//! 1. the guard is spawned held (it waits for its go, the first deadline);
//! 2. `started` is written, comparing this incarnation's key and the assignment (no record
//!    yet): a worker that is no longer this incarnation, or an assignment taken back, starts
//!    nothing;
//! 3. the go: the job execs under the guard, which is fed the lease's proven deadlines;
//! 4. once the guard has reaped the job and found its group empty, `exited`, `lost` or
//!    `preempted` is written comparing only the assignment, retried until it lands or the
//!    leader has ended the assignment.
//!
//! Anything that fails after the guard exists ends with the guard gone and `rejected` written
//! the same way, so a `started` that may have committed never stays without an end.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::TxnOpResponse;
use tokio::sync::watch;

use super::WorkerConfig;
use crate::clock::BootInstant;
use crate::exec::guard::{GUARD_FAILED, NOT_STARTED};
use crate::exec::record::{self, KilledBy};
use crate::exec::spawner::{self, Guard, Launch};
use crate::jobs::records::now_ms;
use crate::jobs::work::{Assignment, AssignmentKind, AttemptRecord, AttemptState, ATTEMPT_VERSION};
use crate::store::group::{GroupCommit, Outcome};
use crate::store::{codec, Keys, Write};

/// What the incarnation's loop wants from a running attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Control {
    Run,
    /// The job's cancel key appeared: SIGTERM, then SIGKILL after the grace.
    Cancel,
    /// The leader ended the assignment: kill, write nothing.
    Revoked,
    /// The incarnation is over (lease not provable, key gone): kill, record `lost`.
    Lost,
    /// The worker is shutting down: kill, record `preempted`.
    Preempt,
}

/// What every attempt of one incarnation shares.
pub(super) struct Incarnation {
    /// The attempts' reports (`started`, how they ended), committed together when many come
    /// at once; each keeps its own compares.
    pub(super) reports: GroupCommit,
    pub(super) keys: Keys,
    pub(super) config: WorkerConfig,
    /// The create revision of this incarnation's key.
    pub(super) rev: i64,
    pub(super) deadlines: watch::Receiver<BootInstant>,
    /// Job guards alive (the worker's own view of its capacity).
    pub(super) processes: Arc<AtomicUsize>,
    /// Cleanup guards alive.
    pub(super) cleanups: Arc<AtomicUsize>,
    /// A drain is on: job assignments that raced the draining mark are refused, not started.
    pub(super) draining: Arc<std::sync::atomic::AtomicBool>,
    /// Whether guards can be started (shared by the worker's incarnations).
    pub(super) guards: Arc<super::guards::GuardHealth>,
}

/// The keys one assignment is about: its own, and the record the worker writes.
struct Keyed {
    assignment: String,
    record: String,
}

fn keyed(inc: &Incarnation, a: &Assignment, token: i64) -> Keyed {
    let (k, w, id) = (&inc.keys, &inc.config.worker_id, &a.job_id);
    match a.kind {
        AssignmentKind::Job => Keyed {
            assignment: k.assignment(w, inc.rev, id),
            record: k.attempt(id, token),
        },
        AssignmentKind::Cleanup => match &a.step {
            Some(step) => Keyed {
                assignment: k.cleanup_step_assignment(w, inc.rev, id, step),
                record: k.cleanup_record(id, &format!("{step}.{}", a.attempt)),
            },
            None => Keyed {
                assignment: k.cleanup_assignment(w, inc.rev, id),
                record: k.cleanup_record(id, &a.attempt.to_string()),
            },
        },
        AssignmentKind::Folder => Keyed {
            assignment: k.cleanup_assignment(w, inc.rev, id),
            record: k.cleanup_record(id, "folder"),
        },
    }
}

struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs assignment `a` (revision `token`) to its end, and reports `lost` if that panicked (its
/// guard, whose pipe closed with the task, has killed the job).
pub(super) async fn run_reported(
    inc: Arc<Incarnation>,
    a: Assignment,
    token: i64,
    ctl: watch::Receiver<Control>,
) {
    let keys = keyed(&inc, &a, token);
    let (id, attempt) = (a.job_id.clone(), a.attempt);
    if tokio::spawn(run(inc.clone(), a, token, ctl)).await.is_err() {
        tracing::error!(job_id = %id, token, "the attempt's task failed; reporting it lost");
        // Its guard's pipe closed with the task: the guard kills the group at once. Give it
        // time to find the group empty before saying the execution is over.
        tokio::time::sleep(inc.config.guard.kill_grace + Duration::from_secs(5)).await;
        let rec = AttemptRecord {
            version: ATTEMPT_VERSION,
            state: AttemptState::Lost,
            worker: inc.config.worker_id.clone(),
            worker_rev: inc.rev,
            attempt,
            pid: 0,
            exit_code: None,
            signal: None,
            killed_by: None,
            log_tail: String::new(),
            reason: Some("the worker's attempt task failed".into()),
            start_error: None,
            at_ms: now_ms(),
        };
        report(&inc, &keys, &id, token, rec).await;
    }
}

/// Runs assignment `a` (revision `token`) to its end. See the module doc.
async fn run(inc: Arc<Incarnation>, a: Assignment, token: i64, mut ctl: watch::Receiver<Control>) {
    let id = a.job_id.clone();
    let cfg = &inc.config;
    let keys = keyed(&inc, &a, token);
    let base = AttemptRecord {
        version: ATTEMPT_VERSION,
        state: AttemptState::Rejected,
        worker: cfg.worker_id.clone(),
        worker_rev: inc.rev,
        attempt: a.attempt,
        pid: 0,
        exit_code: None,
        signal: None,
        killed_by: None,
        log_tail: String::new(),
        reason: None,
        start_error: None,
        at_ms: now_ms(),
    };
    let reject = |reason: String| AttemptRecord {
        reason: Some(reason),
        at_ms: now_ms(),
        ..base.clone()
    };
    if a.kind == AssignmentKind::Job && inc.draining.load(Ordering::SeqCst) {
        let why = reject("the worker is draining".into());
        report(&inc, &keys, &id, token, why).await;
        return;
    }
    let first = *ctl.borrow();
    match first {
        Control::Run => {}
        Control::Cancel => {
            report(
                &inc,
                &keys,
                &id,
                token,
                reject("cancelled before it started".into()),
            )
            .await;
            return;
        }
        _ => return,
    }
    let dir = record::job_dir(&cfg.storage_dir, &id);
    if a.kind == AssignmentKind::Folder {
        let started = AttemptRecord {
            state: AttemptState::Started,
            at_ms: now_ms(),
            ..base.clone()
        };
        // Fenced like a start, so a removal taken back never runs beside its retry.
        if !matches!(accept(&inc, &keys, token, &started).await, Accept::Yes(_)) {
            return;
        }
        let target = dir.clone();
        let removed = tokio::task::spawn_blocking(move || {
            // Out of the way first (one rename), then deleted off the runtime's threads.
            // `~` is in no job id: the trash never meets a job's folder.
            let mut name = target.file_name().unwrap_or_default().to_os_string();
            name.push(format!("~removing-{token}"));
            let trash = target.with_file_name(name);
            match std::fs::rename(&target, &trash) {
                Ok(()) => std::fs::remove_dir_all(&trash),
                Err(e) => Err(e),
            }
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        let end = match removed {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => AttemptRecord {
                state: AttemptState::Exited,
                exit_code: Some(1),
                reason: Some(format!("cannot remove {}: {e}", dir.display())),
                ..base.clone()
            },
            _ => AttemptRecord {
                state: AttemptState::Exited,
                exit_code: Some(0),
                ..base.clone()
            },
        };
        report(&inc, &keys, &id, token, end).await;
        return;
    }
    let (counter, limit) = match a.kind {
        AssignmentKind::Cleanup => (&inc.cleanups, cfg.max_cleanups),
        _ => (&inc.processes, cfg.capacity),
    };
    if counter.fetch_add(1, Ordering::SeqCst) >= limit {
        counter.fetch_sub(1, Ordering::SeqCst);
        tracing::info!(job_id = %id, token, "full: rejecting the assignment");
        report(&inc, &keys, &id, token, reject("the worker is full".into())).await;
        return;
    }
    let _slot = Slot(counter.clone());
    let name = match (a.kind, &a.step) {
        (AssignmentKind::Cleanup, Some(step)) => format!("cleanup-{step}-{}", a.attempt),
        (AssignmentKind::Cleanup, None) => format!("cleanup-{}", a.attempt),
        _ => format!("attempt-{}", a.attempt),
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        let why = format!("cannot create {}: {e}", dir.display());
        report(&inc, &keys, &id, token, reject(why)).await;
        return;
    }
    // An earlier job of this id (or a requeued attempt) may have left a record of the same
    // name here, or the pid of a guard that died: neither is this attempt's.
    let _ = std::fs::remove_file(record::exit_path(&dir, &name));
    let _ = std::fs::remove_file(record::pid_path(&dir, &name));
    let mut env = a.spec.env.clone();
    env.insert("BATON_JOB_ID".into(), id.clone());
    env.insert("BATON_JOB_DIR".into(), dir.display().to_string());
    env.insert("BATON_TERM".into(), token.to_string());
    env.insert("BATON_WORKER".into(), cfg.worker_id.clone());
    match a.kind {
        AssignmentKind::Cleanup => {
            env.insert("BATON_CLEANUP_ATTEMPT".into(), a.attempt.to_string());
            let step = a
                .step
                .as_deref()
                .unwrap_or(crate::jobs::cleanup::COMMAND_STEP);
            env.insert("BATON_CLEANUP_STEP".into(), step.into());
        }
        _ => {
            env.insert("BATON_ATTEMPT".into(), a.attempt.to_string());
        }
    }
    if a.recovered {
        env.insert("BATON_RECOVERED".into(), "1".into());
    }
    let launch = Launch {
        guard: cfg.guard.clone(),
        job_id: id.clone(),
        attempt: a.attempt,
        term: token,
        dir: dir.clone(),
        name: name.clone(),
        go_within: cfg.assign_timeout,
        command: a.spec.command.clone(),
        env,
        timeout: a.spec.timeout,
    };
    if let Some(why) = inc.guards.unable() {
        report(&inc, &keys, &id, token, reject(why)).await;
        return;
    }
    let mut guard = match spawner::spawn_held(launch).await {
        Ok(g) => {
            inc.guards.spawned();
            g
        }
        Err(e) => {
            inc.guards.failed(&e);
            tracing::error!(job_id = %id, error = %e, "cannot start the guard");
            report(
                &inc,
                &keys,
                &id,
                token,
                reject(format!("cannot start the guard: {e}")),
            )
            .await;
            return;
        }
    };
    let started = AttemptRecord {
        state: AttemptState::Started,
        pid: guard.pid,
        at_ms: now_ms(),
        ..base.clone()
    };
    let started_rev = match accept(&inc, &keys, token, &started).await {
        Accept::Yes(rev) => rev,
        Accept::TakenAway => {
            guard.feed.abandon();
            let _ = (&mut guard.exited).await;
            return;
        }
        Accept::Unknown(why) => {
            guard.feed.abandon();
            let _ = (&mut guard.exited).await;
            report(&inc, &keys, &id, token, reject(why)).await;
            return;
        }
    };
    let now_wanted = *ctl.borrow();
    if now_wanted == Control::Cancel {
        guard.feed.abandon();
        let _ = (&mut guard.exited).await;
        let end = AttemptRecord {
            state: AttemptState::Exited,
            killed_by: Some("cancel".into()),
            reason: Some("cancelled before it started".into()),
            at_ms: now_ms(),
            ..base.clone()
        };
        report(&inc, &keys, &id, token, end).await;
        return;
    }
    // The go.
    let mut deadlines = inc.deadlines.clone();
    guard.feed.deadline(*deadlines.borrow_and_update());
    tracing::info!(job_id = %id, attempt = a.attempt, token, guard = guard.pid, "job started");
    let (why, status) = supervise(&mut guard, &mut deadlines, &mut ctl).await;
    if why == Control::Revoked {
        tracing::info!(job_id = %id, token, "the leader ended the assignment; the job was stopped");
        // Whoever waits for this execution's end (an abandoned cleanup, a result found beside
        // a stray registry entry) learns it here: over our own `started`, nothing else.
        let end = AttemptRecord {
            state: AttemptState::Exited,
            killed_by: Some("revoked".into()),
            reason: Some("the leader ended the assignment".into()),
            pid: guard.pid,
            at_ms: now_ms(),
            ..base.clone()
        };
        report_over(&inc, &keys, &id, token, started_rev, end).await;
        return;
    }
    let rec = record::read_exit(&dir, &name).filter(|r| r.term == token && r.attempt == a.attempt);
    let mut end = AttemptRecord {
        pid: guard.pid,
        log_tail: record::log_tail(&record::log_path(&dir, &name)),
        at_ms: now_ms(),
        ..base.clone()
    };
    match rec {
        Some(r) if r.start_error.is_some() => {
            end.state = AttemptState::Exited;
            end.start_error = r.start_error.map(|e| e.message);
        }
        Some(r)
            if matches!(
                r.killed_by,
                None | Some(KilledBy::Timeout | KilledBy::Cancel)
            ) =>
        {
            end.state = AttemptState::Exited;
            end.exit_code = r.exit_code;
            end.signal = r.signal;
            end.killed_by = r.killed_by.map(|k| match k {
                KilledBy::Timeout => "timeout".to_string(),
                _ => "cancel".to_string(),
            });
        }
        None if why != Control::Preempt && status.and_then(|s| s.code()) == Some(NOT_STARTED) => {
            // The guard started nothing (its go came too late, the host was short of
            // processes or memory): nothing ran.
            end.state = AttemptState::Rejected;
            end.reason = Some("the guard started nothing".into());
        }
        None if why != Control::Preempt => {
            // The guard died without a record (killed, or it failed): the job may have run,
            // and part of its group may live on. Its group goes first; then the attempt
            // counts as lost, so the job runs again only as a counted recovery.
            let shown = status.map_or("an unknown status".into(), |s| s.to_string());
            if status.and_then(|s| s.code()) == Some(GUARD_FAILED) {
                inc.guards.failed(&std::io::Error::other(format!(
                    "the guard exited with {shown}"
                )));
            }
            stop_group(&dir, &name).await;
            tracing::error!(job_id = %id, token, status = %shown, "the guard ended without an exit record");
            end.state = AttemptState::Lost;
            end.reason = Some(format!(
                "the guard exited with {shown} and left no exit record"
            ));
        }
        other => {
            end.state = if why == Control::Preempt {
                AttemptState::Preempted
            } else {
                AttemptState::Lost
            };
            end.signal = other.as_ref().and_then(|r| r.signal);
            end.reason = Some(match other {
                Some(_) if why == Control::Preempt => "the worker drained or shut down".into(),
                Some(_) => "the worker could not prove its lease".into(),
                None => "the guard started nothing".into(),
            });
        }
    }
    tracing::info!(job_id = %id, token, state = ?end.state, exit_code = end.exit_code, "attempt ended");
    if !report(&inc, &keys, &id, token, end.clone()).await {
        // The leader ended the assignment meanwhile (an abandoned cleanup, a result found
        // beside the job's entry): whoever waits for this execution learns its end over our
        // own `started`.
        report_over(&inc, &keys, &id, token, started_rev, end).await;
    }
}

/// Kills what is left of a job whose guard died without a record (its group, by the pid the
/// guard wrote), until the group is empty or a bound passes.
async fn stop_group(dir: &std::path::Path, name: &str) {
    use nix::sys::signal::{killpg, Signal};
    let Some(pgid) = record::read_pid(dir, name).filter(|p| *p > 1) else {
        return;
    };
    let group = nix::unistd::Pid::from_raw(pgid);
    for _ in 0..200 {
        if killpg(group, Signal::SIGKILL) == Err(nix::errno::Errno::ESRCH) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::warn!(pgid, "the job's group survives SIGKILL");
}

/// Feeds deadlines and follows the loop's wishes until the guard is gone; returns the last wish
/// and the guard's exit status.
async fn supervise(
    guard: &mut Guard,
    deadlines: &mut watch::Receiver<BootInstant>,
    ctl: &mut watch::Receiver<Control>,
) -> (Control, Option<std::process::ExitStatus>) {
    let mut cancelled = false;
    let mut act = |c: Control, guard: &Guard| match c {
        Control::Run => {}
        Control::Cancel if !cancelled => {
            cancelled = true;
            guard.feed.terminate();
        }
        Control::Cancel => {}
        Control::Revoked | Control::Lost | Control::Preempt => guard.feed.abandon(),
    };
    act(*ctl.borrow_and_update(), guard);
    let mut ctl_open = true;
    let mut deadlines_open = true;
    let status = loop {
        tokio::select! {
            s = &mut guard.exited => break s.ok(),
            changed = deadlines.changed(), if deadlines_open => match changed {
                Ok(()) => guard.feed.deadline(*deadlines.borrow_and_update()),
                Err(_) => deadlines_open = false,
            },
            changed = ctl.changed(), if ctl_open => match changed {
                Ok(()) => act(*ctl.borrow_and_update(), guard),
                Err(_) => ctl_open = false,
            },
        }
    };
    let last = *ctl.borrow();
    (last, status)
}

enum Accept {
    /// `started` is recorded, at this revision.
    Yes(i64),
    /// The assignment is gone or this is no longer the incarnation: nothing to report.
    TakenAway,
    /// etcd did not answer in time: whether `started` committed is unknown.
    Unknown(String),
}

/// Writes `started`, fenced by this incarnation's key and the assignment. A retry after a
/// timeout recognises its own earlier commit by the record's pid.
async fn accept(inc: &Incarnation, keys: &Keyed, token: i64, started: &AttemptRecord) -> Accept {
    let assignment = keys.assignment.clone();
    let attempt = keys.record.clone();
    let until = tokio::time::Instant::now() + inc.config.assign_timeout / 2;
    let mut last = String::new();
    while tokio::time::Instant::now() < until {
        let worker = &inc.config.worker_id;
        let write = super::writes::started(
            &inc.keys,
            worker,
            inc.rev,
            &assignment,
            token,
            &attempt,
            started,
        );
        match inc.reports.commit(write).await {
            Ok(Outcome::Applied { revision, .. }) => return Accept::Yes(revision),
            Ok(Outcome::Conflict { response, .. }) => {
                let mine = response.op_responses().into_iter().find_map(|op| match op {
                    TxnOpResponse::Get(g) => g.kvs().first().and_then(|kv| {
                        codec::decode::<AttemptRecord>(kv.key(), kv.value(), ATTEMPT_VERSION)
                            .ok()
                            .filter(|rec| {
                                rec.state == AttemptState::Started && rec.pid == started.pid
                            })
                            .map(|_| kv.mod_revision())
                    }),
                    _ => None,
                });
                return match mine {
                    Some(rev) => Accept::Yes(rev),
                    None => Accept::TakenAway,
                };
            }
            Ok(Outcome::Fenced) => return Accept::TakenAway,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Accept::Unknown(format!("could not record the start: {last}"))
}

/// Writes how the attempt ended, comparing only the assignment: retried until it lands or the
/// leader has ended the assignment (then there is nobody left to tell).
/// Whether it landed.
async fn report(inc: &Incarnation, keys: &Keyed, id: &str, token: i64, rec: AttemptRecord) -> bool {
    let write = super::writes::report(&keys.assignment, token, &keys.record, &rec);
    put_report(inc, id, token, write).await
}

/// Writes how an execution whose assignment the leader deleted ended, over its own `started`
/// record (mod revision `started_rev`) and nothing else.
async fn report_over(
    inc: &Incarnation,
    keys: &Keyed,
    id: &str,
    token: i64,
    started_rev: i64,
    rec: AttemptRecord,
) {
    let write = super::writes::report_over(&keys.record, started_rev, &rec);
    put_report(inc, id, token, write).await;
}

/// Commits a report, retried until it lands (`true`) or its compares have failed.
async fn put_report(inc: &Incarnation, id: &str, token: i64, write: Write) -> bool {
    let mut pause = crate::retry::policies::WORKER_REPORT.backoff();
    loop {
        match inc.reports.commit(write.clone()).await {
            Ok(Outcome::Applied { .. }) => return true,
            Ok(_) => {
                tracing::info!(
                    job_id = id,
                    token,
                    "the assignment was already ended; nothing reported"
                );
                return false;
            }
            Err(e) => {
                tracing::warn!(job_id = id, token, error = %e, "cannot report the attempt yet; retrying");
            }
        }
        pause.pause().await;
    }
}
