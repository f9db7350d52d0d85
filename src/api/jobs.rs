//! `baton.v1.JobService`: submission, reads, cancel, watch and logs, served by every replica
//! straight from etcd (and, for logs, from the workers that ran the job).

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::jobs::cleanup;
use crate::jobs::records::{self, JobResult, RegistryEntry, RegistryStatus, StepState};
use crate::jobs::spec::{self, CleanupStep, JobSpec, StepMode};
use crate::jobs::{self, Snapshot, State};
use crate::proto::{self, job_service_server::JobService};
use crate::security::{caller_name, ClientSecurity};
use crate::store::group::Limits;
use crate::store::{GroupCommit, Keys, Store};

/// Largest request the job API decodes; the stored spec limit is far below.
pub const MAX_REQUEST_BYTES: usize = 256 * 1024;

#[derive(Clone)]
pub struct JobApi {
    store: Store,
    keys: Keys,
    replica_id: String,
    /// How this replica calls workers for their logs.
    peer: ClientSecurity,
    /// Concurrent submissions to this replica share etcd transactions.
    submits: GroupCommit,
}

impl JobApi {
    /// Must be called on the runtime: it starts the replica's submission committer.
    pub fn new(store: Store, keys: Keys, replica_id: String, peer: ClientSecurity) -> Self {
        let (submits, run) = GroupCommit::new(store.clone(), None, "submit", Limits::default());
        tokio::spawn(run);
        Self {
            store,
            keys,
            replica_id,
            peer,
            submits,
        }
    }
}

pub(super) fn state_proto(s: State) -> proto::JobState {
    match s {
        State::Pending => proto::JobState::Pending,
        State::Running => proto::JobState::Running,
        State::Finished => proto::JobState::Finished,
        State::Failed => proto::JobState::Failed,
        State::Canceled => proto::JobState::Canceled,
    }
}

fn mode_proto(m: StepMode) -> proto::CleanupStepMode {
    match m {
        StepMode::Ordered => proto::CleanupStepMode::CleanupStepOrdered,
        StepMode::Concurrent => proto::CleanupStepMode::CleanupStepConcurrent,
    }
}

pub(super) fn spec_proto(s: &JobSpec) -> proto::JobSpec {
    proto::JobSpec {
        command: s.command.clone(),
        env: s.env.clone().into_iter().collect(),
        cleanup_command: s.cleanup_command.clone(),
        max_attempts: s.max_attempts,
        timeout: Some(s.timeout.into()),
        worker_selector: s.worker_selector.clone().into_iter().collect(),
        cleanup_steps: s
            .cleanup_steps
            .iter()
            .map(|c| proto::CleanupStep {
                name: c.name.clone(),
                command: c.command.clone(),
                mode: mode_proto(c.mode) as i32,
            })
            .collect(),
    }
}

/// The cleanup of `result`, each step as its entry records it (with the spec, while it is
/// there, naming the steps not started yet).
pub(super) fn cleanup_proto(
    result: Option<&JobResult>,
    clean: bool,
    spec: Option<&JobSpec>,
) -> proto::CleanupStatus {
    let Some(r) = result else {
        return proto::CleanupStatus {
            state: proto::CleanupState::CleanupNotStarted as i32,
            ..Default::default()
        };
    };
    let c = &r.cleanup;
    let state = if clean {
        proto::CleanupState::CleanupDone
    } else if c.needs_operator && c.abandoned.is_none() {
        proto::CleanupState::CleanupNeedsOperator
    } else {
        proto::CleanupState::CleanupPending
    };
    let mut plan = spec.map(cleanup::plan).unwrap_or_default();
    let ran_command = c.attempts > 0
        || c.assigned.as_ref().is_some_and(|a| a.step != "folder")
        || (c.stage == 0 && c.last_error.is_some());
    if spec.is_none() && c.steps.is_empty() && ran_command {
        // A version 2 entry read without its spec: it had a `command` step.
        plan = vec![cleanup::PlannedStep {
            name: cleanup::COMMAND_STEP.into(),
            command: Vec::new(),
            mode: StepMode::Ordered,
        }];
    }
    let steps = if plan.is_empty() {
        c.steps.clone()
    } else {
        cleanup::load(r, &plan)
    };
    let exhausted = state == proto::CleanupState::CleanupNeedsOperator;
    proto::CleanupStatus {
        state: state as i32,
        stage: c.stage,
        attempts: c.attempts,
        last_error: c.last_error.clone().unwrap_or_default(),
        next_retry_unix_ms: if exhausted || clean {
            0
        } else {
            c.next_retry_ms as i64
        },
        steps: steps
            .iter()
            .map(|s| proto::CleanupStepStatus {
                name: s.name.clone(),
                mode: mode_proto(s.mode) as i32,
                state: s.state.as_str().into(),
                attempts: s.attempts,
                next_retry_unix_ms: match s.state {
                    StepState::Retrying => s.next_retry_ms as i64,
                    _ => 0,
                },
                last_error: s.last_error.clone().unwrap_or_default(),
                worker: s
                    .assigned
                    .as_ref()
                    .map(|a| a.worker.clone())
                    .unwrap_or_default(),
            })
            .collect(),
        abandoned: c.abandoned.is_some(),
        abandon_reason: c
            .abandoned
            .as_ref()
            .and_then(|a| a.reason.clone())
            .unwrap_or_default(),
        abandoned_by: c
            .abandoned
            .as_ref()
            .map(|a| a.by.clone())
            .unwrap_or_default(),
    }
}

pub(super) fn from_result(job: &mut proto::Job, r: &JobResult) {
    job.state = state_proto(r.status.into()) as i32;
    job.spec_hash = r.spec_hash.clone();
    job.attempts = r.attempts;
    job.failed_attempts = r.failed_attempts;
    job.recoveries = r.recoveries;
    job.preemptions = r.preemptions;
    job.worker = r.worker.clone().unwrap_or_default();
    job.has_exit_code = r.exit_code.is_some();
    job.exit_code = r.exit_code.unwrap_or_default();
    job.signal = r.signal.unwrap_or_default();
    job.error = r.error.clone().unwrap_or_default();
    job.submitted_unix_ms = r.submitted_at_ms as i64;
    if let Some(by) = &r.submitted_by {
        job.submitted_by = by.clone();
    }
    job.started_unix_ms = r.started_at_ms as i64;
    job.finished_unix_ms = r.finished_at_ms as i64;
    job.log_tail = r.log_tail.clone();
}

pub(super) fn from_registry(job: &mut proto::Job, e: &RegistryEntry) {
    job.state = match e.status {
        RegistryStatus::Pending => proto::JobState::Pending,
        RegistryStatus::Running => proto::JobState::Running,
    } as i32;
    job.attempts = e.attempt;
    job.failed_attempts = e.failed_attempts;
    job.recoveries = e.recoveries;
    job.preemptions = e.preemptions;
    if let Some(w) = &e.worker {
        job.worker = w.clone();
    }
    job.error = e.last_error.clone().unwrap_or_default();
    job.started_unix_ms = e.first_started_ms as i64;
    if e.status == RegistryStatus::Pending {
        job.waiting_reason = waiting_reason(e, records::now_ms());
    }
}

/// Why a PENDING entry has not started, as far as the entry itself tells.
fn waiting_reason(e: &RegistryEntry, now_ms: u64) -> String {
    if e.not_before_ms > now_ms {
        let secs = (e.not_before_ms - now_ms).div_ceil(1000);
        return format!("retry backoff: next attempt in {secs}s");
    }
    "queued: jobs start in submission order, within the workers' free slots (--max-running \
     each) and --max-starts-per-second"
        .into()
}

fn attempt_proto(token: i64, a: &crate::jobs::work::AttemptRecord) -> proto::AttemptInfo {
    use crate::jobs::work::AttemptState as S;
    proto::AttemptInfo {
        attempt: a.attempt,
        token,
        worker: a.worker.clone(),
        state: match a.state {
            S::Started => "started",
            S::Exited => "exited",
            S::Lost => "lost",
            S::Preempted => "preempted",
            S::Rejected => "rejected",
        }
        .into(),
        has_exit_code: a.exit_code.is_some(),
        exit_code: a.exit_code.unwrap_or_default(),
        signal: a.signal.unwrap_or_default(),
        reason: a
            .reason
            .clone()
            .or_else(|| a.killed_by.as_ref().map(|k| format!("killed by {k}")))
            .unwrap_or_default(),
        at_unix_ms: a.at_ms as i64,
    }
}

/// The user's view of a job snapshot.
pub fn job_view(s: &Snapshot) -> proto::Job {
    let mut job = proto::Job {
        job_id: s.id.clone(),
        revision: s.revision,
        cancel_requested: s.cancel.is_some(),
        ..Default::default()
    };
    if let Some((e, _)) = &s.registry {
        from_registry(&mut job, e);
    }
    if let Some((rec, _)) = &s.spec {
        job.spec = Some(spec_proto(&rec.spec));
        job.spec_hash = rec.spec_hash.clone();
        job.submitted_unix_ms = rec.submitted_at_ms as i64;
        job.submitted_by = rec.submitted_by.clone().unwrap_or_default();
    }
    if let Some(r) = s.result() {
        from_result(&mut job, r);
    }
    let spec = s.spec.as_ref().map(|(r, _)| &r.spec);
    job.cleanup = Some(cleanup_proto(s.result(), s.is_clean(), spec));
    job.history = s
        .attempts
        .iter()
        .map(|(token, (a, _))| attempt_proto(*token, a))
        .collect();
    if job.worker.is_empty() {
        if let Some(last) = job.history.iter().rev().find(|a| a.state != "rejected") {
            job.worker = last.worker.clone();
        }
    }
    if let Some(st) = s.state() {
        job.state = state_proto(st) as i32;
    }
    job
}

pub(super) fn resolve_spec(p: Option<proto::JobSpec>) -> Result<JobSpec, jobs::Error> {
    let p = p.ok_or(spec::Invalid {
        field: "spec",
        reason: "is required".into(),
    })?;
    let timeout = match p.timeout {
        None => None,
        Some(d) => Some(Duration::try_from(d).map_err(|_| spec::Invalid {
            field: "spec.timeout",
            reason: "must not be negative".into(),
        })?),
    };
    let steps = p
        .cleanup_steps
        .into_iter()
        .map(|c| {
            let mode = match proto::CleanupStepMode::try_from(c.mode) {
                Ok(proto::CleanupStepMode::CleanupStepConcurrent) => StepMode::Concurrent,
                Ok(_) => StepMode::Ordered,
                Err(_) => {
                    return Err(spec::Invalid {
                        field: "spec.cleanup_steps",
                        reason: format!("step {:?}: unknown mode {}", c.name, c.mode),
                    })
                }
            };
            Ok(CleanupStep {
                name: c.name,
                command: c.command,
                mode,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(JobSpec::resolve(
        p.command,
        p.env.into_iter().collect::<BTreeMap<_, _>>(),
        p.cleanup_command,
        p.max_attempts,
        timeout,
    )?
    .with_selector(p.worker_selector.into_iter().collect())?
    .with_cleanup_steps(steps)?)
}

fn generated_id() -> String {
    let mut buf = [0u8; 6];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    let r: String = buf.iter().map(|b| format!("{b:02x}")).collect();
    format!("job-{:x}-{r}", crate::jobs::records::now_ms())
}

type LogStream = Pin<Box<dyn Stream<Item = Result<proto::LogChunk, Status>> + Send>>;
type JobStream = Pin<Box<dyn Stream<Item = Result<proto::Job, Status>> + Send>>;

#[tonic::async_trait]
impl JobService for JobApi {
    async fn submit_job(
        &self,
        req: Request<proto::SubmitJobRequest>,
    ) -> Result<Response<proto::SubmitJobResponse>, Status> {
        let _timer = crate::metrics::get().submit_seconds.start_timer();
        let caller = caller_name(&req);
        let req = req.into_inner();
        let spec = resolve_spec(req.spec)?;
        let id = if req.job_id.is_empty() {
            generated_id()
        } else {
            crate::schedule::check_submitted_id(&req.job_id).map_err(jobs::Error::from)?;
            req.job_id
        };
        let done = jobs::submit(&self.submits, &self.keys, &id, spec, &caller).await?;
        tracing::info!(target: "baton::audit", action = "submit", job_id = %id, caller = %caller, created = done.created, replica = %self.replica_id, "job submitted");
        Ok(Response::new(proto::SubmitJobResponse {
            job: Some(job_view(&done.snapshot)),
            created: done.created,
        }))
    }

    async fn get_job(
        &self,
        req: Request<proto::GetJobRequest>,
    ) -> Result<Response<proto::Job>, Status> {
        let id = req.into_inner().job_id;
        let snap = jobs::read(&self.store, &self.keys, &id).await?;
        if !snap.exists() {
            return Err(jobs::Error::NotFound(id).into());
        }
        let mut job = job_view(&snap);
        if job.state == proto::JobState::Pending as i32 && job.waiting_reason.starts_with("queued")
        {
            if let Ok(fleet) = jobs::fleet::read(&self.store, &self.keys).await {
                let spec = snap.spec.as_ref().map(|(r, _)| &r.spec);
                job.waiting_reason = fleet.waiting_reason(spec);
            }
        }
        Ok(Response::new(job))
    }

    async fn list_jobs(
        &self,
        req: Request<proto::ListJobsRequest>,
    ) -> Result<Response<proto::ListJobsResponse>, Status> {
        let page = super::job_list::list(&self.store, &self.keys, req.into_inner()).await?;
        Ok(Response::new(page))
    }

    async fn cancel_job(
        &self,
        req: Request<proto::CancelJobRequest>,
    ) -> Result<Response<proto::Job>, Status> {
        let caller = caller_name(&req);
        let id = req.into_inner().job_id;
        let snap = jobs::cancel(&self.store, &self.keys, &id, &self.replica_id).await?;
        tracing::info!(target: "baton::audit", action = "cancel", job_id = %id, caller = %caller, replica = %self.replica_id, "cancel requested");
        Ok(Response::new(job_view(&snap)))
    }

    type WatchJobStream = JobStream;

    async fn watch_job(
        &self,
        req: Request<proto::WatchJobRequest>,
    ) -> Result<Response<JobStream>, Status> {
        let id = req.into_inner().job_id;
        let first = jobs::read(&self.store, &self.keys, &id).await?;
        if !first.exists() {
            return Err(jobs::Error::NotFound(id).into());
        }
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let store = self.store.clone();
        let keys = self.keys.clone();
        tokio::spawn(async move {
            if let Err(s) = watch_loop(&store, &keys, first, &tx).await {
                let _ = tx.send(Err(s)).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn retry_cleanup(
        &self,
        req: Request<proto::RetryCleanupRequest>,
    ) -> Result<Response<proto::Job>, Status> {
        let caller = caller_name(&req);
        let id = req.into_inner().job_id;
        let snap = jobs::request_cleanup(&self.store, &self.keys, &id).await?;
        tracing::info!(target: "baton::audit", action = "retry-cleanup", job_id = %id, caller = %caller, replica = %self.replica_id, "cleanup retry requested");
        Ok(Response::new(job_view(&snap)))
    }

    async fn abandon_cleanup(
        &self,
        req: Request<proto::AbandonCleanupRequest>,
    ) -> Result<Response<proto::Job>, Status> {
        let caller = caller_name(&req);
        let req = req.into_inner();
        let reason = (!req.reason.is_empty()).then_some(req.reason);
        let snap = jobs::request_abandon(
            &self.store,
            &self.keys,
            &req.job_id,
            reason.clone(),
            &caller,
        )
        .await?;
        tracing::info!(target: "baton::audit", action = "abandon-cleanup", job_id = %req.job_id, caller = %caller, reason = reason.as_deref().unwrap_or(""), replica = %self.replica_id, "cleanup abandonment requested");
        Ok(Response::new(job_view(&snap)))
    }

    async fn get_job_logs(
        &self,
        req: Request<proto::GetJobLogsRequest>,
    ) -> Result<Response<proto::GetJobLogsResponse>, Status> {
        let req = req.into_inner();
        let tail = match req.tail_bytes {
            0 => 64 * 1024,
            n => n.min(crate::worker::READ_MAX),
        };
        let logs = super::logs::tail(
            &self.store,
            &self.keys,
            &self.peer,
            &req.job_id,
            req.attempt,
            tail,
        );
        Ok(Response::new(logs.await?))
    }

    type FollowJobLogsStream = LogStream;

    async fn follow_job_logs(
        &self,
        req: Request<proto::FollowJobLogsRequest>,
    ) -> Result<Response<LogStream>, Status> {
        let req = req.into_inner();
        crate::jobs::spec::validate_id(&req.job_id).map_err(jobs::Error::from)?;
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(super::logs::follow(
            self.store.clone(),
            self.keys.clone(),
            self.peer.clone(),
            req.job_id,
            req.attempt,
            tx,
        ));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Sends the job each time it changes, until its cleanup is done. Each update is the first
/// snapshot brought forward by the watch's events: no read per change. Each key has a watcher
/// of its own, so the events of one transaction may come apart: a snapshot caught between them
/// (no state, or an entry without its spec) is read whole once instead, and events the read
/// already covers are skipped.
async fn watch_loop(
    store: &Store,
    keys: &Keys,
    first: Snapshot,
    tx: &tokio::sync::mpsc::Sender<Result<proto::Job, Status>>,
) -> Result<(), Status> {
    let id = first.id.clone();
    let mut last = job_view(&first);
    let mut read_at = first.revision;
    let mut snap = first;
    if tx.send(Ok(last.clone())).await.is_err() || snap.is_clean() {
        return Ok(());
    }
    let k = keys.job(&id);
    let mut client = store.client();
    let from = snap.revision + 1;
    let opts = || Some(WatchOptions::new().with_start_revision(from));
    let cannot = |e: etcd_client::Error| Status::unavailable(format!("cannot watch job {id}: {e}"));
    let mut stream = client.watch(k.spec.clone(), opts()).await.map_err(cannot)?;
    for key in [
        &k.registry,
        &k.dirty,
        &k.clean,
        &k.cancel,
        &k.cleanup_now,
        &k.abandon,
    ] {
        stream.watch(key.clone(), opts()).await.map_err(cannot)?;
    }
    stream
        .watch(
            keys.attempts_of(&id),
            Some(WatchOptions::new().with_prefix().with_start_revision(from)),
        )
        .await
        .map_err(cannot)?;
    loop {
        let msg = tokio::select! {
            m = stream.message() => m,
            _ = tx.closed() => return Ok(()),
        };
        match msg {
            Ok(Some(resp)) => {
                if resp.compact_revision() > 0 || resp.canceled() {
                    return Err(Status::aborted(
                        "the watch fell behind etcd's compaction; watch again",
                    ));
                }
                if resp.events().is_empty() {
                    continue;
                }
                for ev in resp.events() {
                    match ev.kv() {
                        Some(kv) if kv.mod_revision() > read_at => {
                            snap.apply(keys, ev.event_type() == EventType::Delete, kv)
                        }
                        _ => {}
                    }
                }
                let torn =
                    snap.state().is_none() || (snap.registry.is_some() && snap.spec.is_none());
                if torn {
                    snap = jobs::read(store, keys, &id).await?;
                    read_at = snap.revision;
                    if !snap.exists() {
                        return Ok(());
                    }
                }
                let view = job_view(&snap);
                let changed = proto::Job {
                    revision: 0,
                    ..view.clone()
                } != proto::Job {
                    revision: 0,
                    ..last.clone()
                };
                if changed {
                    if tx.send(Ok(view.clone())).await.is_err() {
                        return Ok(());
                    }
                    last = view;
                }
                if snap.is_clean() {
                    return Ok(());
                }
            }
            Ok(None) => return Err(Status::unavailable("the watch ended; watch again")),
            Err(e) => return Err(Status::unavailable(format!("watch failed: {e}"))),
        }
    }
}
