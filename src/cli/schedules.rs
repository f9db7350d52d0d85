//! `baton schedule ...`: create, get, list, update, pause, resume, delete, trigger, backfill.

use anyhow::anyhow;
use serde_json::json;

use super::call_any;
use super::jobs::{spec_of, wait_for};
use crate::config::{
    ClientArgs, Output, ScheduleBackfillArgs, ScheduleCreateArgs, ScheduleDeleteArgs,
    ScheduleNameArgs, SchedulePauseArgs, SchedulePolicyArgs, ScheduleRevisionArgs,
    ScheduleTriggerArgs, ScheduleUpdateArgs,
};
use crate::proto::schedule_service_client::ScheduleServiceClient;
use crate::proto::{
    BackfillScheduleRequest, CatchupPolicy, CreateScheduleRequest, DeleteScheduleRequest,
    GetScheduleRequest, JobState, ListSchedulesRequest, OverlapPolicy, PauseScheduleRequest,
    ResumeScheduleRequest, Schedule, ScheduleDefinition, TriggerScheduleRequest,
    UpdateScheduleRequest,
};

fn overlap_name(p: i32) -> &'static str {
    match OverlapPolicy::try_from(p) {
        Ok(OverlapPolicy::OverlapAllow) => "allow",
        Ok(OverlapPolicy::OverlapReplace) => "replace",
        _ => "forbid",
    }
}

fn catchup_name(p: i32) -> &'static str {
    match CatchupPolicy::try_from(p) {
        Ok(CatchupPolicy::CatchupAll) => "all",
        _ => "latest",
    }
}

fn state_name(s: i32) -> &'static str {
    match JobState::try_from(s) {
        Ok(JobState::Pending) => "PENDING",
        Ok(JobState::Running) => "RUNNING",
        Ok(JobState::Finished) => "FINISHED",
        Ok(JobState::Failed) => "FAILED",
        Ok(JobState::Canceled) => "CANCELED",
        _ => "",
    }
}

fn overlap_of(s: &str) -> anyhow::Result<OverlapPolicy> {
    match s {
        "forbid" => Ok(OverlapPolicy::OverlapForbid),
        "allow" => Ok(OverlapPolicy::OverlapAllow),
        "replace" => Ok(OverlapPolicy::OverlapReplace),
        _ => Err(anyhow!(
            "--overlap {s:?}: expected forbid, allow or replace"
        )),
    }
}

fn catchup_of(s: &str) -> anyhow::Result<CatchupPolicy> {
    match s {
        "latest" => Ok(CatchupPolicy::CatchupLatest),
        "all" => Ok(CatchupPolicy::CatchupAll),
        _ => Err(anyhow!("--catchup {s:?}: expected latest or all")),
    }
}

/// The definition fields the policy flags set, and their names for an update.
fn policy(p: &SchedulePolicyArgs, d: &mut ScheduleDefinition) -> anyhow::Result<Vec<String>> {
    let mut fields = Vec::new();
    if let Some(tz) = &p.tz {
        d.tz = tz.clone();
        fields.push("tz".to_string());
    }
    if let Some(o) = &p.overlap {
        d.overlap = overlap_of(o)? as i32;
        fields.push("overlap".into());
    }
    if let Some(c) = &p.catchup {
        d.catchup = catchup_of(c)? as i32;
        fields.push("catchup".into());
    }
    if let Some(w) = p.catchup_window {
        d.catchup_window = Some(w.into());
        fields.push("catchup_window".into());
    }
    if let Some(n) = p.keep_results {
        d.keep_results = n;
        fields.push("keep_results".into());
    }
    Ok(fields)
}

pub fn schedule_json(s: &Schedule) -> serde_json::Value {
    let d = s.definition.clone().unwrap_or_default();
    json!({
        "name": s.name,
        "cron": d.cron,
        "tz": d.tz,
        "overlap": overlap_name(d.overlap),
        "catchup": catchup_name(d.catchup),
        "catchup_window": d.catchup_window.map(|w| format!("{}s", w.seconds)),
        "keep_results": d.keep_results,
        "command": d.spec.as_ref().map(|s| s.command.clone()).unwrap_or_default(),
        "revision": s.revision,
        "create_revision": s.create_revision,
        "paused": s.paused,
        "pause_reason": s.pause_reason,
        "next_fire_times": s.next_fire_times,
        "watermark": s.watermark,
        "live_jobs": s.live_jobs,
        "counts": s.counts,
        "recent": s.recent.iter().map(|r| json!({
            "scheduled_time": r.scheduled_time,
            "outcome": r.outcome,
            "job_id": r.job_id,
            "job_state": state_name(r.job_state),
            "ticks": r.ticks,
        })).collect::<Vec<_>>(),
        "created_by": s.created_by,
    })
}

fn print(s: &Schedule, output: Output) {
    if output == Output::Json {
        println!("{}", schedule_json(s));
        return;
    }
    let d = s.definition.clone().unwrap_or_default();
    let window = d
        .catchup_window
        .map(|w| {
            humantime::format_duration(std::time::Duration::from_secs(w.seconds as u64)).to_string()
        })
        .unwrap_or_default();
    println!("name:      {}", s.name);
    println!("cron:      {} ({})", d.cron, d.tz);
    println!(
        "policies:  overlap {}, catch-up {} within {window}, keep {} results",
        overlap_name(d.overlap),
        catchup_name(d.catchup),
        d.keep_results
    );
    let cmd = d.spec.map(|s| s.command.join(" ")).unwrap_or_default();
    println!("command:   {cmd}");
    match (s.paused, s.pause_reason.as_str()) {
        (true, "") => println!("state:     paused"),
        (true, why) => println!("state:     paused ({why})"),
        _ => println!("state:     active"),
    }
    println!("revision:  {}", s.revision);
    if !s.watermark.is_empty() {
        println!("watermark: {}", s.watermark);
    }
    println!("next:");
    for t in &s.next_fire_times {
        println!("  {t}");
    }
    if !s.recent.is_empty() {
        println!("recent:");
        for r in &s.recent {
            let n = if r.ticks > 1 {
                format!(" ({} ticks)", r.ticks)
            } else {
                String::new()
            };
            println!(
                "  {}  {:<10} {} {}{n}",
                r.scheduled_time,
                r.outcome,
                r.job_id,
                state_name(r.job_state)
            );
        }
    }
}

async fn client_call<T, F, Fut>(c: &ClientArgs, f: F) -> anyhow::Result<T>
where
    F: Fn(ScheduleServiceClient<crate::security::AuthChannel>) -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    call_any(c, |ch| f(ScheduleServiceClient::new(ch))).await
}

pub async fn create(args: &ScheduleCreateArgs) -> anyhow::Result<()> {
    let mut d = ScheduleDefinition {
        cron: args.cron.clone(),
        spec: Some(spec_of(&args.job)?),
        ..Default::default()
    };
    policy(&args.policy, &mut d)?;
    let req = CreateScheduleRequest {
        name: args.name.clone(),
        definition: Some(d),
    };
    let s = client_call(&args.client, |mut c| {
        let req = req.clone();
        async move { Ok(c.create_schedule(req).await?.into_inner()) }
    })
    .await?;
    match args.client.output {
        Output::Json => print(&s, Output::Json),
        Output::Text => println!(
            "created schedule {} (next: {})",
            s.name,
            s.next_fire_times
                .first()
                .map(String::as_str)
                .unwrap_or("never")
        ),
    }
    Ok(())
}

async fn fetch(c: &ClientArgs, name: &str) -> anyhow::Result<Schedule> {
    let req = GetScheduleRequest {
        name: name.to_string(),
    };
    client_call(c, |mut cl| {
        let req = req.clone();
        async move { Ok(cl.get_schedule(req).await?.into_inner()) }
    })
    .await
}

pub async fn get(args: &ScheduleNameArgs) -> anyhow::Result<()> {
    let s = fetch(&args.client, &args.name).await?;
    print(&s, args.client.output);
    Ok(())
}

pub async fn list(c: &ClientArgs) -> anyhow::Result<()> {
    let all = client_call(c, |mut cl| async move {
        Ok(cl
            .list_schedules(ListSchedulesRequest {})
            .await?
            .into_inner()
            .schedules)
    })
    .await?;
    match c.output {
        Output::Json => println!(
            "{}",
            serde_json::Value::Array(all.iter().map(schedule_json).collect())
        ),
        Output::Text => {
            println!("{:<32} {:<20} {:<8} NEXT", "NAME", "CRON", "STATE");
            for s in &all {
                let d = s.definition.clone().unwrap_or_default();
                println!(
                    "{:<32} {:<20} {:<8} {}",
                    s.name,
                    d.cron,
                    if s.paused { "paused" } else { "active" },
                    s.next_fire_times.first().map(String::as_str).unwrap_or("-")
                );
            }
        }
    }
    Ok(())
}

pub async fn update(args: &ScheduleUpdateArgs) -> anyhow::Result<()> {
    let mut d = ScheduleDefinition::default();
    let mut fields = policy(&args.policy, &mut d)?;
    if let Some(c) = &args.cron {
        d.cron = c.clone();
        fields.push("cron".into());
    }
    let mut if_revision = args.if_revision;
    if !args.command.is_empty() {
        // A new command keeps the rest of the job spec as it is.
        let current = fetch(&args.client, &args.name).await?;
        let mut spec = current.definition.and_then(|d| d.spec).unwrap_or_default();
        spec.command = args.command.clone();
        spec.env.retain(|k, _| !k.starts_with("BATON_"));
        d.spec = Some(spec);
        fields.push("spec".into());
        if if_revision == 0 {
            if_revision = current.revision;
        }
    }
    if fields.is_empty() {
        return Err(anyhow!(
            "nothing to change: give --cron, --tz, --overlap, --catchup, --catchup-window, --keep-results or -- COMMAND"
        ));
    }
    let req = UpdateScheduleRequest {
        name: args.name.clone(),
        fields,
        definition: Some(d),
        if_revision,
    };
    let s = client_call(&args.client, |mut c| {
        let req = req.clone();
        async move { Ok(c.update_schedule(req).await?.into_inner()) }
    })
    .await?;
    done(&s, &args.client, "updated")
}

fn done(s: &Schedule, c: &ClientArgs, what: &str) -> anyhow::Result<()> {
    match c.output {
        Output::Json => print(s, Output::Json),
        Output::Text => println!("{what} schedule {} (revision {})", s.name, s.revision),
    }
    Ok(())
}

pub async fn pause(args: &SchedulePauseArgs) -> anyhow::Result<()> {
    let req = PauseScheduleRequest {
        name: args.name.clone(),
        reason: args.reason.clone().unwrap_or_default(),
        if_revision: args.if_revision,
    };
    let s = client_call(&args.client, |mut c| {
        let req = req.clone();
        async move { Ok(c.pause_schedule(req).await?.into_inner()) }
    })
    .await?;
    done(&s, &args.client, "paused")
}

pub async fn resume(args: &ScheduleRevisionArgs) -> anyhow::Result<()> {
    let req = ResumeScheduleRequest {
        name: args.name.clone(),
        if_revision: args.if_revision,
    };
    let s = client_call(&args.client, |mut c| {
        let req = req.clone();
        async move { Ok(c.resume_schedule(req).await?.into_inner()) }
    })
    .await?;
    done(&s, &args.client, "resumed")
}

pub async fn delete(args: &ScheduleDeleteArgs) -> anyhow::Result<()> {
    let req = DeleteScheduleRequest {
        name: args.name.clone(),
        if_revision: args.if_revision,
        cancel_running: args.cancel_running,
    };
    let r = client_call(&args.client, |mut c| {
        let req = req.clone();
        async move { Ok(c.delete_schedule(req).await?.into_inner()) }
    })
    .await?;
    match args.client.output {
        Output::Json => println!(
            "{}",
            json!({"name": args.name, "cancelled_jobs": r.cancelled_jobs})
        ),
        Output::Text => {
            println!("deleted schedule {}", args.name);
            for j in &r.cancelled_jobs {
                println!("cancel requested: {j}");
            }
        }
    }
    Ok(())
}

pub async fn trigger(args: &ScheduleTriggerArgs) -> anyhow::Result<()> {
    let req = TriggerScheduleRequest {
        name: args.name.clone(),
    };
    let r = client_call(&args.client, |mut c| {
        let req = req.clone();
        async move { Ok(c.trigger_schedule(req).await?.into_inner()) }
    })
    .await?;
    if args.wait {
        return wait_for(&args.client, &r.job_id).await;
    }
    match args.client.output {
        Output::Json => println!("{}", json!({"name": args.name, "job_id": r.job_id})),
        Output::Text => println!("triggered {} as job {}", args.name, r.job_id),
    }
    Ok(())
}

pub async fn backfill(args: &ScheduleBackfillArgs) -> anyhow::Result<()> {
    let req = BackfillScheduleRequest {
        name: args.name.clone(),
        from: args.from.clone(),
        to: args.to.clone(),
        force: args.force,
    };
    let r = client_call(&args.client, |mut c| {
        let req = req.clone();
        async move { Ok(c.backfill_schedule(req).await?.into_inner()) }
    })
    .await?;
    match args.client.output {
        Output::Json => println!("{}", json!({"name": args.name, "ticks": r.ticks})),
        Output::Text => println!(
            "backfill of {} requested: {} ticks; those not run yet get jobs",
            args.name, r.ticks
        ),
    }
    Ok(())
}
