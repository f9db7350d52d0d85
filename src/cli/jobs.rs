//! `baton job ...`: submit, get, list, cancel, wait, logs.

use std::time::Duration;

use anyhow::anyhow;
use serde_json::json;
use tonic::Status;

use super::call_any;
use crate::config::{CleanupArgs, JobIdArgs, JobSpecArgs, ListArgs, LogsArgs, Output, SubmitArgs};
use crate::proto::job_service_client::JobServiceClient;
use crate::proto::{
    AbandonCleanupRequest, CancelJobRequest, CleanupState, CleanupStep, CleanupStepMode,
    FollowJobLogsRequest, GetJobLogsRequest, GetJobRequest, Job, JobSpec, JobState,
    ListJobsRequest, RetryCleanupRequest, SubmitJobRequest, WatchJobRequest,
};

/// `baton job wait` exits with the job's exit code.
#[derive(Debug, thiserror::Error)]
#[error("job ended with exit code {0}")]
pub struct JobExit(pub u8);

fn state_name(s: i32) -> &'static str {
    match JobState::try_from(s).unwrap_or(JobState::Unspecified) {
        JobState::Pending => "PENDING",
        JobState::Running => "RUNNING",
        JobState::Finished => "FINISHED",
        JobState::Failed => "FAILED",
        JobState::Canceled => "CANCELED",
        JobState::Unspecified => "UNKNOWN",
    }
}

fn cleanup_name(s: i32) -> &'static str {
    match CleanupState::try_from(s).unwrap_or(CleanupState::Unspecified) {
        CleanupState::CleanupNotStarted => "not-started",
        CleanupState::CleanupPending => "pending",
        CleanupState::CleanupNeedsOperator => "needs-operator",
        CleanupState::CleanupDone => "done",
        CleanupState::Unspecified => "unknown",
    }
}

pub fn is_terminal(job: &Job) -> bool {
    matches!(
        JobState::try_from(job.state),
        Ok(JobState::Finished | JobState::Failed | JobState::Canceled)
    )
}

pub fn job_json(j: &Job) -> serde_json::Value {
    let c = j.cleanup.clone().unwrap_or_default();
    json!({
        "job_id": j.job_id,
        "state": state_name(j.state),
        "command": j.spec.as_ref().map(|s| s.command.clone()),
        "spec_hash": j.spec_hash,
        "attempts": j.attempts,
        "failed_attempts": j.failed_attempts,
        "recoveries": j.recoveries,
        "preemptions": j.preemptions,
        "worker": (!j.worker.is_empty()).then_some(&j.worker),
        "worker_selector": j.spec.as_ref().map(|s| s.worker_selector.clone()),
        "history": j.history.iter().map(|a| json!({
            "attempt": a.attempt,
            "token": a.token,
            "worker": a.worker,
            "state": a.state,
            "exit_code": a.has_exit_code.then_some(a.exit_code),
            "signal": (a.signal != 0).then_some(a.signal),
            "reason": (!a.reason.is_empty()).then_some(&a.reason),
            "at_unix_ms": a.at_unix_ms,
        })).collect::<Vec<_>>(),
        "exit_code": j.has_exit_code.then_some(j.exit_code),
        "signal": (j.signal != 0).then_some(j.signal),
        "error": (!j.error.is_empty()).then_some(&j.error),
        "waiting_reason": (!j.waiting_reason.is_empty()).then_some(&j.waiting_reason),
        "cancel_requested": j.cancel_requested,
        "submitted_unix_ms": j.submitted_unix_ms,
        "submitted_by": (!j.submitted_by.is_empty()).then_some(&j.submitted_by),
        "started_unix_ms": j.started_unix_ms,
        "finished_unix_ms": j.finished_unix_ms,
        "log_tail": j.log_tail,
        "cleanup": {
            "state": cleanup_name(c.state),
            "stage": c.stage,
            "attempts": c.attempts,
            "last_error": (!c.last_error.is_empty()).then_some(&c.last_error),
            "next_retry_unix_ms": (c.next_retry_unix_ms > 0).then_some(c.next_retry_unix_ms),
            "steps": c.steps.iter().map(|s| json!({
                "name": s.name,
                "mode": mode_name(s.mode),
                "state": s.state,
                "attempts": s.attempts,
                "next_retry_unix_ms": (s.next_retry_unix_ms > 0).then_some(s.next_retry_unix_ms),
                "last_error": (!s.last_error.is_empty()).then_some(&s.last_error),
                "worker": (!s.worker.is_empty()).then_some(&s.worker),
            })).collect::<Vec<_>>(),
            "abandoned": c.abandoned.then(|| json!({
                "reason": (!c.abandon_reason.is_empty()).then_some(&c.abandon_reason),
                "by": c.abandoned_by,
            })),
        },
    })
}

fn mode_name(m: i32) -> &'static str {
    match CleanupStepMode::try_from(m).unwrap_or(CleanupStepMode::Unspecified) {
        CleanupStepMode::CleanupStepConcurrent => "concurrent",
        CleanupStepMode::CleanupStepOrdered => "ordered",
        CleanupStepMode::Unspecified => "unknown",
    }
}

/// `in 8s`, or nothing for a time not in the future (or none).
fn due_in(at_ms: i64) -> Option<String> {
    let now = crate::jobs::records::now_ms() as i64;
    (at_ms > now).then(|| format!("in {}s", (at_ms - now + 999) / 1000))
}

fn print_job(j: &Job, output: Output) {
    match output {
        Output::Json => println!("{}", job_json(j)),
        Output::Text => {
            let mut line = format!("{}  {}", j.job_id, state_name(j.state));
            if j.has_exit_code {
                line.push_str(&format!("  exit {}", j.exit_code));
            } else if j.signal != 0 {
                line.push_str(&format!("  signal {}", j.signal));
            }
            line.push_str(&format!("  attempts {}", j.attempts));
            if j.recoveries > 0 {
                line.push_str(&format!(" (recovered {})", j.recoveries));
            }
            if j.preemptions > 0 {
                line.push_str(&format!(" (preempted {})", j.preemptions));
            }
            if !j.worker.is_empty() {
                line.push_str(&format!("  on {}", j.worker));
            }
            if j.cancel_requested && !is_terminal(j) {
                line.push_str("  cancel requested");
            }
            if !j.waiting_reason.is_empty() {
                line.push_str(&format!("  ({})", j.waiting_reason));
            }
            if let Some(c) = &j.cleanup {
                if c.state != CleanupState::CleanupNotStarted as i32 {
                    line.push_str(&format!("  cleanup {}", cleanup_name(c.state)));
                    let mut detail = Vec::new();
                    if c.state != CleanupState::CleanupDone as i32 {
                        detail.push(format!("{} stages done", c.stage));
                    }
                    if c.attempts > 0 {
                        detail.push(format!("{} attempts", c.attempts));
                    }
                    if let Some(d) = due_in(c.next_retry_unix_ms) {
                        detail.push(format!("next retry {d}"));
                    }
                    if !c.last_error.is_empty() {
                        detail.push(format!("last error: {}", c.last_error));
                    }
                    if c.abandoned {
                        let why = match c.abandon_reason.as_str() {
                            "" => String::new(),
                            r => format!(": {r}"),
                        };
                        detail.push(format!("abandoned by {}{why}", c.abandoned_by));
                    }
                    if !detail.is_empty() {
                        line.push_str(&format!(" ({})", detail.join(", ")));
                    }
                    for s in &c.steps {
                        let mut step = format!(
                            "\n    step {} ({}): {}, {} attempts",
                            s.name,
                            mode_name(s.mode),
                            s.state,
                            s.attempts
                        );
                        if !s.worker.is_empty() {
                            step.push_str(&format!(", on {}", s.worker));
                        }
                        if let Some(d) = due_in(s.next_retry_unix_ms) {
                            step.push_str(&format!(", next retry {d}"));
                        }
                        if !s.last_error.is_empty() {
                            step.push_str(&format!(", last error: {}", s.last_error));
                        }
                        line.push_str(&step);
                    }
                }
            }
            if !j.error.is_empty() {
                line.push_str(&format!("  error: {}", j.error));
            }
            println!("{line}");
        }
    }
}

fn new_id() -> String {
    let mut buf = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    let r: String = buf.iter().map(|b| format!("{b:02x}")).collect();
    format!("job-{r}")
}

/// The job spec the job flags describe (checked by the replica).
pub fn spec_of(args: &JobSpecArgs) -> anyhow::Result<JobSpec> {
    let mut env = std::collections::HashMap::new();
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("--env {kv:?}: expected K=V"))?;
        env.insert(k.to_string(), v.to_string());
    }
    let mut worker_selector = std::collections::HashMap::new();
    for kv in &args.selector {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("--selector {kv:?}: expected K=V"))?;
        worker_selector.insert(k.trim().to_string(), v.trim().to_string());
    }
    let mut cleanup_steps = Vec::new();
    for (flag, list, mode) in [
        (
            "--cleanup",
            &args.cleanup,
            CleanupStepMode::CleanupStepOrdered,
        ),
        (
            "--cleanup-concurrent",
            &args.cleanup_concurrent,
            CleanupStepMode::CleanupStepConcurrent,
        ),
    ] {
        for s in list {
            let (name, command) = s
                .split_once('=')
                .filter(|(n, _)| crate::jobs::spec::is_step_name(n))
                .ok_or_else(|| {
                    anyhow!(
                        "{flag} {s:?}: expected NAME=COMMAND, NAME 1-32 characters of [a-z0-9-] \
                         (a single unnamed command is --cleanup-command)"
                    )
                })?;
            cleanup_steps.push(CleanupStep {
                name: name.to_string(),
                command: command.split_whitespace().map(String::from).collect(),
                mode: mode as i32,
            });
        }
    }
    Ok(JobSpec {
        command: args.command.clone(),
        env,
        cleanup_command: args
            .cleanup_command
            .as_deref()
            .map(|c| c.split_whitespace().map(String::from).collect())
            .unwrap_or_default(),
        cleanup_steps,
        max_attempts: args.max_attempts,
        timeout: args.attempt_timeout.map(pbjson_types::Duration::from),
        worker_selector,
    })
}

pub async fn submit(args: &SubmitArgs) -> anyhow::Result<()> {
    // Chosen before the first try: retries across replicas can never create two jobs.
    let id = args.id.clone().unwrap_or_else(new_id);
    let spec = spec_of(&args.job)?;
    let resp = submit_spec(&args.client, &id, spec).await?;
    let job = resp.job.unwrap_or_default();
    if args.wait {
        return wait_for(&args.client, &job.job_id).await;
    }
    match args.client.output {
        Output::Json => print_job(&job, Output::Json),
        Output::Text => println!(
            "{} {}",
            if resp.created {
                "submitted"
            } else {
                "already submitted"
            },
            job.job_id
        ),
    }
    Ok(())
}

/// Submits `spec` as job `id` through the first replica that answers (a retry is safe: the id
/// is chosen by the caller).
pub async fn submit_spec(
    c: &crate::config::ClientArgs,
    id: &str,
    spec: JobSpec,
) -> anyhow::Result<crate::proto::SubmitJobResponse> {
    call_any(c, |ch| {
        let req = SubmitJobRequest {
            job_id: id.to_string(),
            spec: Some(spec.clone()),
        };
        async move {
            Ok(JobServiceClient::new(ch)
                .submit_job(req)
                .await?
                .into_inner())
        }
    })
    .await
}

pub async fn get_job(c: &crate::config::ClientArgs, id: &str) -> anyhow::Result<Job> {
    call_any(c, |ch| {
        let req = GetJobRequest {
            job_id: id.to_string(),
        };
        async move { Ok(JobServiceClient::new(ch).get_job(req).await?.into_inner()) }
    })
    .await
}

pub async fn get(args: &JobIdArgs) -> anyhow::Result<()> {
    let job = get_job(&args.client, &args.id).await?;
    print_job(&job, args.client.output);
    Ok(())
}

fn parse_state(s: &str) -> anyhow::Result<JobState> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "pending" => JobState::Pending,
        "running" => JobState::Running,
        "finished" => JobState::Finished,
        "failed" => JobState::Failed,
        "canceled" | "cancelled" => JobState::Canceled,
        _ => {
            anyhow::bail!("--state {s:?}: expected pending, running, finished, failed or canceled")
        }
    })
}

fn parse_cleanup(s: &str) -> anyhow::Result<CleanupState> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "pending" => CleanupState::CleanupPending,
        "needs-operator" => CleanupState::CleanupNeedsOperator,
        "done" => CleanupState::CleanupDone,
        _ => anyhow::bail!("--cleanup {s:?}: expected pending, needs-operator or done"),
    })
}

pub async fn list(args: &ListArgs) -> anyhow::Result<()> {
    let state = args.state.as_deref().map(parse_state).transpose()?;
    let cleanup = args.cleanup.as_deref().map(parse_cleanup).transpose()?;
    let mut token = String::new();
    let mut shown = 0;
    loop {
        let req = ListJobsRequest {
            state: state.unwrap_or(JobState::Unspecified) as i32,
            cleanup: cleanup.unwrap_or(CleanupState::Unspecified) as i32,
            page_size: 500,
            page_token: token.clone(),
            id_prefix: args.prefix.clone().unwrap_or_default(),
        };
        let page = call_any(&args.client, |ch| {
            let req = req.clone();
            async move { Ok(JobServiceClient::new(ch).list_jobs(req).await?.into_inner()) }
        })
        .await?;
        if !page.notice.is_empty() {
            eprintln!("note: {}", page.notice);
        }
        for j in &page.jobs {
            if shown >= args.limit {
                return Ok(());
            }
            print_job(j, args.client.output);
            shown += 1;
        }
        if page.next_page_token.is_empty() {
            return Ok(());
        }
        token = page.next_page_token;
    }
}

pub async fn cancel(args: &JobIdArgs) -> anyhow::Result<()> {
    let job = call_any(&args.client, |ch| {
        let req = CancelJobRequest {
            job_id: args.id.clone(),
        };
        async move {
            Ok(JobServiceClient::new(ch)
                .cancel_job(req)
                .await?
                .into_inner())
        }
    })
    .await?;
    match args.client.output {
        Output::Json => print_job(&job, Output::Json),
        Output::Text => println!("cancel requested for {}", job.job_id),
    }
    Ok(())
}

pub async fn wait(args: &JobIdArgs) -> anyhow::Result<()> {
    wait_for(&args.client, &args.id).await
}

/// Follows the job (WatchJob, re-opened on any replica after errors) until its result is
/// recorded, prints it, and returns its exit code as [`JobExit`] when it is not 0.
pub async fn wait_for(c: &crate::config::ClientArgs, id: &str) -> anyhow::Result<()> {
    let job = loop {
        let mut long = c.clone();
        long.timeout = Duration::from_secs(10);
        let found = call_any(&long, |ch| {
            let req = WatchJobRequest {
                job_id: id.to_string(),
            };
            async move {
                let mut stream = JobServiceClient::new(ch).watch_job(req).await?.into_inner();
                while let Some(job) = stream.message().await? {
                    if is_terminal(&job) {
                        return Ok(Some(job));
                    }
                }
                Ok::<_, Status>(None)
            }
        })
        .await;
        match found {
            Ok(Some(job)) => break job,
            Ok(None) | Err(_) => {
                let job = get_job(c, id).await?;
                if is_terminal(&job) {
                    break job;
                }
            }
        }
    };
    print_job(&job, c.output);
    let code = match JobState::try_from(job.state) {
        Ok(JobState::Finished) => 0,
        _ if job.has_exit_code && job.exit_code != 0 => job.exit_code.clamp(1, 255) as u8,
        Ok(JobState::Canceled) => 130,
        _ => 1,
    };
    if code == 0 {
        Ok(())
    } else {
        Err(JobExit(code).into())
    }
}

pub async fn logs(args: &LogsArgs) -> anyhow::Result<()> {
    if args.follow {
        return follow(args).await;
    }
    let resp = call_any(&args.client, |ch| {
        let req = GetJobLogsRequest {
            job_id: args.id.clone(),
            attempt: args.attempt,
            tail_bytes: 0,
        };
        async move {
            Ok(JobServiceClient::new(ch)
                .get_job_logs(req)
                .await?
                .into_inner())
        }
    })
    .await?;
    use std::io::Write;
    std::io::stdout().write_all(&resp.content)?;
    Ok(())
}

pub async fn cleanup(args: &CleanupArgs) -> anyhow::Result<()> {
    if args.abandon {
        return abandon(args).await;
    }
    let job = call_any(&args.client, |ch| {
        let req = RetryCleanupRequest {
            job_id: args.id.clone(),
        };
        async move {
            Ok(JobServiceClient::new(ch)
                .retry_cleanup(req)
                .await?
                .into_inner())
        }
    })
    .await?;
    match args.client.output {
        Output::Json => print_job(&job, Output::Json),
        Output::Text => println!("cleanup retry requested for {}", job.job_id),
    }
    Ok(())
}

async fn abandon(args: &CleanupArgs) -> anyhow::Result<()> {
    let job = call_any(&args.client, |ch| {
        let req = AbandonCleanupRequest {
            job_id: args.id.clone(),
            reason: args.reason.clone().unwrap_or_default(),
        };
        async move {
            Ok(JobServiceClient::new(ch)
                .abandon_cleanup(req)
                .await?
                .into_inner())
        }
    })
    .await?;
    match args.client.output {
        Output::Json => print_job(&job, Output::Json),
        Output::Text => println!("cleanup abandonment requested for {}", job.job_id),
    }
    Ok(())
}

/// Prints an attempt's output as it comes, through the first replica that answers; ends when
/// the attempt ends.
async fn follow(args: &LogsArgs) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stream = call_any(&args.client, |ch| {
        let req = FollowJobLogsRequest {
            job_id: args.id.clone(),
            attempt: args.attempt,
        };
        async move {
            Ok(JobServiceClient::new(ch)
                .follow_job_logs(req)
                .await?
                .into_inner())
        }
    })
    .await?;
    let mut out = std::io::stdout();
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|s| anyhow!("{} ({:?})", s.message(), s.code()))?
    {
        match out.write_all(&chunk.content).and_then(|()| out.flush()) {
            // `| head` has what it wanted.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            other => other?,
        }
    }
    Ok(())
}
