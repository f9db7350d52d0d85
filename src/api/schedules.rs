//! `baton.v1.ScheduleService`: schedules created, read and changed by any replica, straight
//! from etcd, through [`crate::schedule::service`] (the leader decides the ticks).

use std::time::Duration;

use tonic::{Request, Response, Status};

use super::jobs::{resolve_spec, spec_proto, state_proto};
use crate::jobs::spec::Invalid;
use crate::proto::{self, schedule_service_server::ScheduleService};
use crate::schedule::expr;
use crate::schedule::record::{Catchup, Overlap};
use crate::schedule::service::{self, Changes, Definition, Retention, View};
use crate::security::caller_name;
use crate::store::{Keys, Store};

#[derive(Clone)]
pub struct ScheduleApi {
    store: Store,
    keys: Keys,
    replica_id: String,
    retention: Retention,
}

impl ScheduleApi {
    pub fn new(store: Store, keys: Keys, replica_id: String, retention: Retention) -> Self {
        Self {
            store,
            keys,
            replica_id,
            retention,
        }
    }
}

fn overlap_of(p: i32) -> Result<Overlap, Invalid> {
    match proto::OverlapPolicy::try_from(p) {
        Ok(proto::OverlapPolicy::OverlapAllow) => Ok(Overlap::Allow),
        Ok(proto::OverlapPolicy::OverlapReplace) => Ok(Overlap::Replace),
        Ok(_) => Ok(Overlap::Forbid),
        Err(_) => Err(Invalid {
            field: "overlap",
            reason: format!("unknown value {p}"),
        }),
    }
}

fn catchup_of(p: i32) -> Result<Catchup, Invalid> {
    match proto::CatchupPolicy::try_from(p) {
        Ok(proto::CatchupPolicy::CatchupAll) => Ok(Catchup::All),
        Ok(_) => Ok(Catchup::Latest),
        Err(_) => Err(Invalid {
            field: "catchup",
            reason: format!("unknown value {p}"),
        }),
    }
}

fn window_of(d: Option<pbjson_types::Duration>) -> Result<Duration, Invalid> {
    match d {
        None => Ok(Duration::ZERO),
        Some(d) => Duration::try_from(d).map_err(|_| Invalid {
            field: "catchup_window",
            reason: "must not be negative".into(),
        }),
    }
}

fn definition_of(d: Option<proto::ScheduleDefinition>) -> Result<Definition, Status> {
    let d = d.ok_or_else(|| Status::invalid_argument("definition: is required"))?;
    Ok(Definition {
        spec: resolve_spec(d.spec)?,
        cron: d.cron,
        tz: d.tz,
        overlap: overlap_of(d.overlap).map_err(crate::schedule::Error::from)?,
        catchup: catchup_of(d.catchup).map_err(crate::schedule::Error::from)?,
        catchup_window: window_of(d.catchup_window).map_err(crate::schedule::Error::from)?,
        keep_results: d.keep_results,
    })
}

fn changes_of(fields: &[String], d: Option<proto::ScheduleDefinition>) -> Result<Changes, Status> {
    let d = d.unwrap_or_default();
    let mut c = Changes::default();
    let bad = |reason: String| {
        crate::schedule::Error::from(Invalid {
            field: "fields",
            reason,
        })
    };
    if fields.is_empty() {
        return Err(bad("name at least one field to change".into()).into());
    }
    for f in fields {
        match f.as_str() {
            "cron" => c.cron = Some(d.cron.clone()),
            "tz" => c.tz = Some(d.tz.clone()),
            "overlap" => {
                c.overlap = Some(overlap_of(d.overlap).map_err(crate::schedule::Error::from)?)
            }
            "catchup" => {
                c.catchup = Some(catchup_of(d.catchup).map_err(crate::schedule::Error::from)?)
            }
            "catchup_window" => {
                c.catchup_window =
                    Some(window_of(d.catchup_window).map_err(crate::schedule::Error::from)?)
            }
            "keep_results" => c.keep_results = Some(d.keep_results),
            "spec" => c.spec = Some(resolve_spec(d.spec.clone())?),
            other => return Err(bad(format!("unknown field {other:?}")).into()),
        }
    }
    Ok(c)
}

/// The user's view of a schedule.
pub fn schedule_view(v: &View) -> proto::Schedule {
    let r = &v.record;
    let overlap = match r.overlap {
        Overlap::Forbid => proto::OverlapPolicy::OverlapForbid,
        Overlap::Allow => proto::OverlapPolicy::OverlapAllow,
        Overlap::Replace => proto::OverlapPolicy::OverlapReplace,
    };
    let catchup = match r.catchup {
        Catchup::Latest => proto::CatchupPolicy::CatchupLatest,
        Catchup::All => proto::CatchupPolicy::CatchupAll,
    };
    let s = &v.status;
    proto::Schedule {
        name: r.name.clone(),
        definition: Some(proto::ScheduleDefinition {
            cron: r.cron.clone(),
            tz: r.tz.clone(),
            overlap: overlap as i32,
            catchup: catchup as i32,
            catchup_window: Some(r.catchup_window.into()),
            keep_results: r.keep_results,
            spec: Some(spec_proto(&r.spec)),
        }),
        revision: v.revision,
        create_revision: v.create_revision,
        paused: r.paused,
        pause_reason: r.pause_reason.clone().unwrap_or_default(),
        next_fire_times: v.next.iter().map(|t| expr::rfc3339(*t)).collect(),
        watermark: if s.watermark_ms == 0 {
            String::new()
        } else {
            expr::rfc3339(s.watermark_ms)
        },
        live_jobs: s.live.clone(),
        counts: s.counts.clone().into_iter().collect(),
        recent: s
            .recent
            .iter()
            .map(|d| {
                let job_id = d.job_id(&r.name).unwrap_or_default();
                proto::TickOutcome {
                    scheduled_time: expr::rfc3339(d.t),
                    outcome: d.o.clone(),
                    job_state: v
                        .jobs
                        .get(&job_id)
                        .map(|s| state_proto(*s) as i32)
                        .unwrap_or_default(),
                    job_id,
                    ticks: d.n.max(1),
                    decided_unix_ms: d.d as i64,
                }
            })
            .collect(),
        created_by: r.created_by.clone(),
        created_unix_ms: r.created_at_ms as i64,
        updated_unix_ms: r.updated_at_ms as i64,
    }
}

impl ScheduleApi {
    fn audit(&self, action: &str, name: &str, caller: &str) {
        tracing::info!(target: "baton::audit", action, schedule = %name, caller = %caller, replica = %self.replica_id, "schedule changed");
    }
}

#[tonic::async_trait]
impl ScheduleService for ScheduleApi {
    async fn create_schedule(
        &self,
        req: Request<proto::CreateScheduleRequest>,
    ) -> Result<Response<proto::Schedule>, Status> {
        let caller = caller_name(&req);
        let req = req.into_inner();
        let def = definition_of(req.definition)?;
        let v = service::create(
            &self.store,
            &self.keys,
            &req.name,
            def,
            &caller,
            self.retention,
        )
        .await?;
        self.audit("schedule create", &req.name, &caller);
        Ok(Response::new(schedule_view(&v)))
    }

    async fn get_schedule(
        &self,
        req: Request<proto::GetScheduleRequest>,
    ) -> Result<Response<proto::Schedule>, Status> {
        let name = req.into_inner().name;
        let v = service::get(&self.store, &self.keys, &name).await?;
        Ok(Response::new(schedule_view(&v)))
    }

    async fn list_schedules(
        &self,
        _req: Request<proto::ListSchedulesRequest>,
    ) -> Result<Response<proto::ListSchedulesResponse>, Status> {
        let all = service::list(&self.store, &self.keys).await?;
        Ok(Response::new(proto::ListSchedulesResponse {
            schedules: all.iter().map(schedule_view).collect(),
        }))
    }

    async fn update_schedule(
        &self,
        req: Request<proto::UpdateScheduleRequest>,
    ) -> Result<Response<proto::Schedule>, Status> {
        let caller = caller_name(&req);
        let req = req.into_inner();
        let changes = changes_of(&req.fields, req.definition)?;
        let v = service::update(
            &self.store,
            &self.keys,
            &req.name,
            changes,
            req.if_revision,
            self.retention,
        )
        .await?;
        self.audit("schedule update", &req.name, &caller);
        Ok(Response::new(schedule_view(&v)))
    }

    async fn pause_schedule(
        &self,
        req: Request<proto::PauseScheduleRequest>,
    ) -> Result<Response<proto::Schedule>, Status> {
        let caller = caller_name(&req);
        let req = req.into_inner();
        let reason = (!req.reason.is_empty()).then_some(req.reason);
        let v = service::pause(&self.store, &self.keys, &req.name, reason, req.if_revision).await?;
        self.audit("schedule pause", &req.name, &caller);
        Ok(Response::new(schedule_view(&v)))
    }

    async fn resume_schedule(
        &self,
        req: Request<proto::ResumeScheduleRequest>,
    ) -> Result<Response<proto::Schedule>, Status> {
        let caller = caller_name(&req);
        let req = req.into_inner();
        let v = service::resume(
            &self.store,
            &self.keys,
            &req.name,
            req.if_revision,
            self.retention,
        )
        .await?;
        self.audit("schedule resume", &req.name, &caller);
        Ok(Response::new(schedule_view(&v)))
    }

    async fn delete_schedule(
        &self,
        req: Request<proto::DeleteScheduleRequest>,
    ) -> Result<Response<proto::DeleteScheduleResponse>, Status> {
        let caller = caller_name(&req);
        let req = req.into_inner();
        let via = format!("schedule delete by {caller}");
        let cancelled = service::delete(
            &self.store,
            &self.keys,
            &req.name,
            req.if_revision,
            req.cancel_running,
            &via,
        )
        .await?;
        self.audit("schedule delete", &req.name, &caller);
        Ok(Response::new(proto::DeleteScheduleResponse {
            cancelled_jobs: cancelled,
        }))
    }

    async fn trigger_schedule(
        &self,
        req: Request<proto::TriggerScheduleRequest>,
    ) -> Result<Response<proto::TriggerScheduleResponse>, Status> {
        let caller = caller_name(&req);
        let name = req.into_inner().name;
        let job_id = service::trigger(&self.store, &self.keys, &name, &caller).await?;
        self.audit("schedule trigger", &name, &caller);
        Ok(Response::new(proto::TriggerScheduleResponse { job_id }))
    }

    async fn backfill_schedule(
        &self,
        req: Request<proto::BackfillScheduleRequest>,
    ) -> Result<Response<proto::BackfillScheduleResponse>, Status> {
        let caller = caller_name(&req);
        let req = req.into_inner();
        let from = expr::parse_rfc3339("from", &req.from).map_err(crate::schedule::Error::from)?;
        let to = expr::parse_rfc3339("to", &req.to).map_err(crate::schedule::Error::from)?;
        let ticks = service::backfill(
            &self.store,
            &self.keys,
            &req.name,
            service::Range {
                from_ms: from,
                to_ms: to,
                force: req.force,
            },
            &caller,
            self.retention,
        )
        .await?;
        self.audit("schedule backfill", &req.name, &caller);
        Ok(Response::new(proto::BackfillScheduleResponse { ticks }))
    }
}
