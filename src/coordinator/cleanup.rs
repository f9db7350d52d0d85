//! Dirty-job cleanup: the leader turns every dirty result clean, whatever fails and however
//! often leadership moves (Flink's FLINK-11813, standalone).
//!
//! Stages, in order, each idempotent (safe to repeat, safe to interrupt anywhere):
//! 1. the job's `cleanup_command`, if any, under a lease guard like jobs, with a timeout;
//! 2. removal of the job's folder under `--storage-dir`;
//! 3. one fenced transaction: delete `jobs/<id>`, `cancel/<id>`, `cleanup-now/<id>` and
//!    `results/dirty/<id>`, put `results/clean/<id>`.
//!
//! Progress is recorded in the dirty entry after each stage (a fenced write comparing the
//! entry's revision), so a new leader resumes at the first unfinished stage. A failed stage is
//! retried with exponential backoff and jitter; when attempts run out the entry stays dirty and
//! is marked as needing an operator, never dropped. At most `--cleanup-concurrency` cleanups
//! run at once. Clean results are deleted after `--result-retention`, in small fenced batches.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use backoff::backoff::Backoff;
use etcd_client::{Compare, CompareOp, TxnOp, WatchOptions};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{proven, CleanupConfig, Ctx, Writer};
use crate::exec::record::{self, KilledBy};
use crate::exec::spawner::{self, Launch};
use crate::jobs::records::{self, JobResult, TerminalStatus};
use crate::jobs::{self, Snapshot};
use crate::store::codec;
use crate::store::Keys;

/// What one cleanup run ended with.
enum Next {
    Done,
    /// Retry at this Unix ms.
    At(u64),
    /// Stopped: needs an operator, paused by the hook, term over, or nothing to do.
    Stop,
}

/// Cleans every dirty result for as long as the writer's term lasts.
pub async fn run(ctx: Arc<Ctx>, writer: Writer) {
    let term = writer.term().clone();
    let limit = Arc::new(Semaphore::new(ctx.config.cleanup.concurrency.max(1)));
    let mut tasks: JoinSet<(String, Next)> = JoinSet::new();
    let mut inflight: HashSet<String> = HashSet::new();
    let mut recheck: HashSet<String> = HashSet::new();
    let mut timers: BTreeMap<u64, HashSet<String>> = BTreeMap::new();
    let mut retention = tokio::time::interval(
        (ctx.config.cleanup.retention / 4)
            .clamp(Duration::from_millis(500), Duration::from_secs(60)),
    );
    let schedule = |id: String,
                    tasks: &mut JoinSet<(String, Next)>,
                    inflight: &mut HashSet<String>,
                    recheck: &mut HashSet<String>| {
        if !inflight.insert(id.clone()) {
            recheck.insert(id);
            return;
        }
        let (ctx, writer, limit) = (ctx.clone(), writer.clone(), limit.clone());
        tasks.spawn(async move {
            let Ok(_permit) = limit.acquire_owned().await else {
                return (id, Next::Stop);
            };
            let next = clean(&ctx, &writer, &id).await;
            (id, next)
        });
    };
    'resync: loop {
        let (rev, ids) = tokio::select! {
            r = read_pages(&ctx) => match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read dirty results; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            },
            _ = term.ended() => break 'resync,
        };
        if !ids.is_empty() {
            tracing::info!(dirty = ids.len(), "resuming dirty cleanups");
        }
        for id in ids {
            schedule(id, &mut tasks, &mut inflight, &mut recheck);
        }
        let mut client = ctx.store.client();
        let opts = || {
            WatchOptions::new()
                .with_prefix()
                .with_start_revision(rev + 1)
        };
        let Ok(mut stream) = client.watch(ctx.keys.dirty(), Some(opts())).await else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        if stream
            .watch(ctx.keys.cleanup_now(), Some(opts()))
            .await
            .is_err()
        {
            continue;
        }
        loop {
            let next_timer = timers.keys().next().copied();
            let sleep = records::sleep_until_ms(next_timer);
            tokio::select! {
                biased;
                _ = term.ended() => break 'resync,
                msg = stream.message() => match msg {
                    Ok(Some(resp)) if !resp.canceled() && resp.compact_revision() == 0 => {
                        for ev in resp.events() {
                            if ev.event_type() != etcd_client::EventType::Put {
                                continue;
                            }
                            let Some(kv) = ev.kv() else { continue };
                            let id = Keys::id_in(&ctx.keys.dirty(), kv.key())
                                .or_else(|| Keys::id_in(&ctx.keys.cleanup_now(), kv.key()));
                            if let Some(id) = id {
                                schedule(id.to_string(), &mut tasks, &mut inflight, &mut recheck);
                            }
                        }
                    }
                    _ => {
                        tracing::warn!("cleanup watch ended; resyncing");
                        continue 'resync;
                    }
                },
                Some(done) = tasks.join_next() => {
                    let Ok((id, next)) = done else { continue };
                    inflight.remove(&id);
                    if let Next::At(at) = next {
                        timers.entry(at).or_default().insert(id.clone());
                    }
                    if recheck.remove(&id) {
                        schedule(id, &mut tasks, &mut inflight, &mut recheck);
                    }
                }
                _ = sleep => {
                    let now = records::now_ms();
                    let due: Vec<u64> = timers.range(..=now).map(|(k, _)| *k).collect();
                    for at in due {
                        for id in timers.remove(&at).unwrap_or_default() {
                            schedule(id, &mut tasks, &mut inflight, &mut recheck);
                        }
                    }
                }
                _ = retention.tick() => expire_clean(&ctx, &writer).await,
            }
        }
    }
    // Dropping the tasks drops their guards' pipes: the guards kill the cleanup commands.
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
}

async fn read_pages(ctx: &Ctx) -> Result<(i64, Vec<String>), jobs::Error> {
    let mut rev = 0;
    let mut ids = Vec::new();
    for prefix in [ctx.keys.dirty(), ctx.keys.cleanup_now()] {
        let mut after = String::new();
        loop {
            let (kvs, r) = jobs::page_ids(&ctx.store, &prefix, &after, 500, rev).await?;
            rev = r;
            for kv in &kvs {
                if let Some(id) = Keys::id_in(&prefix, kv.key()) {
                    ids.push(id.to_string());
                    after = id.to_string();
                }
            }
            if kvs.len() < 500 {
                break;
            }
        }
    }
    ids.dedup();
    Ok((rev, ids))
}

/// The delay before cleanup attempt `attempts + 1`: exponential with jitter, capped.
fn delay(cfg: &CleanupConfig, attempts: u32) -> Duration {
    let mut b = backoff::ExponentialBackoff {
        initial_interval: cfg.initial_delay,
        max_interval: cfg.max_delay,
        randomization_factor: 0.1,
        multiplier: 2.0,
        max_elapsed_time: None,
        ..Default::default()
    };
    let mut d = cfg.initial_delay;
    for _ in 0..attempts.max(1) {
        d = b.next_backoff().unwrap_or(cfg.max_delay);
    }
    d.min(cfg.max_delay)
}

/// Runs the remaining stages of one job's cleanup.
async fn clean(ctx: &Ctx, writer: &Writer, id: &str) -> Next {
    let term = writer.term();
    loop {
        if term.check().is_err() {
            return Next::Stop;
        }
        let snap = match jobs::read(&ctx.store, &ctx.keys, id).await {
            Ok(s) => s,
            Err(jobs::Error::Corrupt(_)) => return Next::Stop,
            Err(e) => {
                tracing::warn!(job_id = id, error = %e, "cannot read a dirty job");
                return Next::At(records::now_ms() + 1000);
            }
        };
        let Some(mut result) = snap.dirty.clone() else {
            return Next::Done;
        };
        let progress = &mut result.cleanup;
        if snap.cleanup_now && (progress.needs_operator || progress.next_retry_ms > 0) {
            tracing::info!(job_id = id, "operator asked for an immediate cleanup retry");
            progress.needs_operator = false;
            progress.next_retry_ms = 0;
        } else if progress.needs_operator {
            return Next::Stop;
        } else if progress.next_retry_ms > records::now_ms() {
            return Next::At(progress.next_retry_ms);
        }
        if let Some(p) = ctx.config.cleanup.pause_after_stage {
            // Only the term that reached the stage pauses: a new leader resumes.
            let here = progress.stage_term == term.revision() || (p == 0 && progress.stage == 0);
            if progress.stage == p && p < 3 && here {
                return Next::Stop;
            }
        }
        // Ok(true): a stage that ran the cleanup command, which counts as an attempt.
        let outcome = match progress.stage {
            0 => stage_command(ctx, writer, &snap, &result).await,
            1 => stage_folder(ctx, id).map(|()| false),
            _ => return finish(ctx, writer, &snap, result).await,
        };
        let mut next = result.clone();
        let p = &mut next.cleanup;
        match outcome {
            Ok(ran) => {
                p.attempts += u32::from(ran);
                p.stage += 1;
                p.stage_term = term.revision();
                p.last_error = None;
                p.next_retry_ms = 0;
            }
            Err(StageError::TermOver) => return Next::Stop,
            Err(StageError::Failed(e)) => {
                p.attempts += 1;
                p.last_error = Some(e.clone());
                let cfg = &ctx.config.cleanup;
                if cfg.max_attempts > 0 && p.attempts >= cfg.max_attempts {
                    p.needs_operator = true;
                    tracing::error!(job_id = id, attempts = p.attempts, error = %e, "cleanup attempts exhausted; needs an operator (baton job cleanup ID --now)");
                } else {
                    let d = delay(cfg, p.attempts);
                    p.next_retry_ms = records::now_ms() + d.as_millis() as u64;
                    tracing::warn!(job_id = id, stage = p.stage + 1, attempts = p.attempts, retry_in = ?d, error = %e, "cleanup stage failed");
                }
            }
        }
        if record(ctx, writer, &snap, &next).await.is_err() {
            return Next::At(records::now_ms() + 500);
        }
    }
}

enum StageError {
    TermOver,
    Failed(String),
}

/// Stage 1: the job's own cleanup command, under a lease guard.
async fn stage_command(
    ctx: &Ctx,
    writer: &Writer,
    snap: &Snapshot,
    result: &JobResult,
) -> Result<bool, StageError> {
    let term = writer.term();
    let Some((record, _)) = &snap.spec else {
        return Ok(false);
    };
    let cmd = &record.spec.cleanup_command;
    if cmd.is_empty() {
        return Ok(false);
    }
    let cfg = &ctx.config;
    let attempt = result.cleanup.attempts + 1;
    let dir = record::job_dir(&cfg.storage_dir, &snap.id);
    std::fs::create_dir_all(&dir)
        .map_err(|e| StageError::Failed(format!("cannot create {}: {e}", dir.display())))?;
    let mut env = record.spec.env.clone();
    env.insert("BATON_JOB_ID".into(), snap.id.clone());
    env.insert("BATON_JOB_STATUS".into(), status_name(result.status).into());
    env.insert("BATON_JOB_DIR".into(), dir.display().to_string());
    env.insert("BATON_CLEANUP_ATTEMPT".into(), attempt.to_string());
    env.insert("BATON_TERM".into(), term.revision().to_string());
    let name = format!("cleanup-{attempt}");
    let launch = Launch {
        guard: cfg.guard.clone(),
        job_id: snap.id.clone(),
        attempt,
        term: term.revision(),
        dir: dir.clone(),
        name: name.clone(),
        go_within: std::time::Duration::from_secs(5),
        command: cmd.clone(),
        env,
        timeout: cfg.cleanup.timeout,
    };
    ctx.take_start().await;
    if term.check().is_err() {
        return Err(StageError::TermOver);
    }
    let mut g = spawner::spawn(launch, proven(term))
        .await
        .map_err(|e| StageError::Failed(format!("cannot start the cleanup command: {e}")))?;
    let mut deadlines = term.deadlines();
    loop {
        tokio::select! {
            _ = &mut g.exited => break,
            _ = term.ended() => {
                g.feed.abandon();
                return Err(StageError::TermOver);
            }
            changed = deadlines.changed() => {
                if changed.is_ok() {
                    g.feed.deadline(*deadlines.borrow_and_update());
                }
            }
        }
    }
    match record::read_exit(&dir, &name) {
        Some(r) if r.exit_code == Some(0) && r.killed_by.is_none() => Ok(true),
        Some(r) if matches!(r.killed_by, Some(KilledBy::Deadline | KilledBy::LeaderGone)) => {
            Err(StageError::TermOver)
        }
        Some(r) if r.killed_by == Some(KilledBy::Timeout) => Err(StageError::Failed(format!(
            "cleanup command timed out after {}",
            humantime::format_duration(cfg.cleanup.timeout)
        ))),
        Some(r) => {
            let tail = record::log_tail(&record::log_path(&dir, &name));
            let tail = tail.lines().last().unwrap_or("").to_string();
            Err(StageError::Failed(match r.exit_code {
                Some(c) => format!("cleanup command exited with code {c}: {tail}"),
                None => format!("cleanup command killed by signal {}", r.signal.unwrap_or(0)),
            }))
        }
        None if term.check().is_err() => Err(StageError::TermOver),
        None => Err(StageError::Failed(
            "the cleanup command's guard left no exit record".into(),
        )),
    }
}

/// Stage 2: the job's folder. Idempotent: a missing folder is success.
fn stage_folder(ctx: &Ctx, id: &str) -> Result<(), StageError> {
    let dir = record::job_dir(&ctx.config.storage_dir, id);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StageError::Failed(format!(
            "cannot remove {}: {e}",
            dir.display()
        ))),
    }
}

/// Records progress in the dirty entry (fenced, and only if nobody changed it meanwhile).
async fn record(ctx: &Ctx, writer: &Writer, snap: &Snapshot, next: &JobResult) -> Result<(), ()> {
    let k = ctx.keys.job(&snap.id);
    let compares = vec![Compare::mod_revision(
        k.dirty.clone(),
        CompareOp::Equal,
        snap.dirty_rev,
    )];
    let mut ops = vec![TxnOp::put(k.dirty, codec::encode(next), None)];
    if snap.cleanup_now {
        ops.push(TxnOp::delete(k.cleanup_now, None));
    }
    match writer.commit(compares, ops).await {
        Ok(c) if c.applied() => Ok(()),
        _ => Err(()),
    }
}

/// Stage 3: dirty becomes clean, and the job's other keys go, in one fenced transaction.
async fn finish(ctx: &Ctx, writer: &Writer, snap: &Snapshot, mut result: JobResult) -> Next {
    let k = ctx.keys.job(&snap.id);
    result.cleanup.stage = 3;
    result.cleanup.done_ms = records::now_ms();
    result.cleanup.next_retry_ms = 0;
    result.cleanup.last_error = None;
    let mut compares = vec![Compare::mod_revision(
        k.dirty.clone(),
        CompareOp::Equal,
        snap.dirty_rev,
    )];
    if let Some((_, incarnation)) = &snap.spec {
        compares.push(Compare::create_revision(
            k.spec.clone(),
            CompareOp::Equal,
            *incarnation,
        ));
    }
    let ops = vec![
        TxnOp::delete(k.spec, None),
        TxnOp::delete(k.cancel, None),
        TxnOp::delete(k.cleanup_now, None),
        TxnOp::delete(k.dirty, None),
        TxnOp::put(k.clean, codec::encode(&result), None),
    ];
    match writer.commit(compares, ops).await {
        Ok(c) if c.applied() => {
            tracing::info!(job_id = %snap.id, attempts = result.cleanup.attempts, "cleanup done; result is clean");
            Next::Done
        }
        Ok(_) => Next::At(records::now_ms()),
        Err(_) => Next::Stop,
    }
}

/// Deletes clean results older than the retention, in small fenced batches.
async fn expire_clean(ctx: &Ctx, writer: &Writer) {
    let retention = ctx.config.cleanup.retention.as_millis() as u64;
    let cutoff = records::now_ms().saturating_sub(retention);
    let prefix = ctx.keys.clean();
    let mut after = String::new();
    let mut expired: Vec<(Vec<u8>, i64)> = Vec::new();
    loop {
        let Ok((kvs, _)) = jobs::page_ids(&ctx.store, &prefix, &after, 500, 0).await else {
            return;
        };
        for kv in &kvs {
            if let Some(id) = Keys::id_in(&prefix, kv.key()) {
                after = id.to_string();
            }
            let Ok(r) = codec::decode::<JobResult>(kv.key(), kv.value(), records::RESULT_VERSION)
            else {
                continue;
            };
            if r.cleanup.done_ms <= cutoff {
                expired.push((kv.key().to_vec(), kv.mod_revision()));
            }
        }
        if kvs.len() < 500 {
            break;
        }
    }
    for batch in expired.chunks(50) {
        let compares = batch
            .iter()
            .map(|(k, rev)| Compare::mod_revision(k.clone(), CompareOp::Equal, *rev))
            .collect();
        let ops = batch
            .iter()
            .map(|(k, _)| TxnOp::delete(k.clone(), None))
            .collect();
        match writer.commit(compares, ops).await {
            Ok(c) if c.applied() => tracing::info!(
                results = batch.len(),
                "expired clean results past retention"
            ),
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

fn status_name(s: TerminalStatus) -> &'static str {
    match s {
        TerminalStatus::Finished => "FINISHED",
        TerminalStatus::Failed => "FAILED",
        TerminalStatus::Canceled => "CANCELED",
    }
}
