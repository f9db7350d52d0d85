//! Every operation of the API, once: its gRPC method, its HTTP route and the role it needs.
//! Both transports look roles up here, so a method or route cannot be served with a role
//! declared for the other.

use super::Role;

/// Who may call an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Anybody, without credentials: probes, the console's files and the API's description.
    Open,
    /// A caller with at least this role.
    Needs(Role),
}

/// One operation of the API.
#[derive(Clone, Copy, Debug)]
pub struct Operation {
    /// `/package.Service/Method`, when gRPC serves it.
    pub grpc: Option<&'static str>,
    /// Method and route (axum's syntax, `{param}`) when HTTP serves it.
    pub http: Option<(&'static str, &'static str)>,
    pub access: Access,
}

const fn op(
    grpc: Option<&'static str>,
    http: Option<(&'static str, &'static str)>,
    access: Access,
) -> Operation {
    Operation { grpc, http, access }
}

const READ: Access = Access::Needs(Role::Read);
const SUBMIT: Access = Access::Needs(Role::Submit);
const ADMIN: Access = Access::Needs(Role::Admin);

/// The table. gRPC methods not in it need `admin` (see [`grpc`]); HTTP routes not in it are
/// refused (see [`http`]).
pub const OPERATIONS: &[Operation] = &[
    // Jobs.
    op(
        Some("/baton.v1.JobService/SubmitJob"),
        Some(("POST", "/api/v1/jobs")),
        SUBMIT,
    ),
    op(
        Some("/baton.v1.JobService/ListJobs"),
        Some(("GET", "/api/v1/jobs")),
        READ,
    ),
    op(
        Some("/baton.v1.JobService/GetJob"),
        Some(("GET", "/api/v1/jobs/{job_id}")),
        READ,
    ),
    op(
        Some("/baton.v1.JobService/CancelJob"),
        Some(("POST", "/api/v1/jobs/{job_id}/cancel")),
        SUBMIT,
    ),
    op(
        Some("/baton.v1.JobService/WatchJob"),
        Some(("GET", "/api/v1/jobs/{job_id}/watch")),
        READ,
    ),
    op(
        Some("/baton.v1.JobService/GetJobLogs"),
        Some(("GET", "/api/v1/jobs/{job_id}/logs")),
        READ,
    ),
    op(
        Some("/baton.v1.JobService/FollowJobLogs"),
        Some(("GET", "/api/v1/jobs/{job_id}/logs/follow")),
        READ,
    ),
    op(
        Some("/baton.v1.JobService/RetryCleanup"),
        Some(("POST", "/api/v1/jobs/{job_id}/cleanup/retry")),
        ADMIN,
    ),
    op(
        Some("/baton.v1.JobService/AbandonCleanup"),
        Some(("POST", "/api/v1/jobs/{job_id}/cleanup/abandon")),
        ADMIN,
    ),
    // Schedules.
    op(
        Some("/baton.v1.ScheduleService/CreateSchedule"),
        Some(("POST", "/api/v1/schedules")),
        SUBMIT,
    ),
    op(
        Some("/baton.v1.ScheduleService/ListSchedules"),
        Some(("GET", "/api/v1/schedules")),
        READ,
    ),
    op(
        Some("/baton.v1.ScheduleService/GetSchedule"),
        Some(("GET", "/api/v1/schedules/{name}")),
        READ,
    ),
    op(
        Some("/baton.v1.ScheduleService/UpdateSchedule"),
        Some(("PUT", "/api/v1/schedules/{name}")),
        SUBMIT,
    ),
    op(
        Some("/baton.v1.ScheduleService/DeleteSchedule"),
        Some(("DELETE", "/api/v1/schedules/{name}")),
        SUBMIT,
    ),
    op(
        Some("/baton.v1.ScheduleService/PauseSchedule"),
        Some(("POST", "/api/v1/schedules/{name}/pause")),
        SUBMIT,
    ),
    op(
        Some("/baton.v1.ScheduleService/ResumeSchedule"),
        Some(("POST", "/api/v1/schedules/{name}/resume")),
        SUBMIT,
    ),
    op(
        Some("/baton.v1.ScheduleService/TriggerSchedule"),
        Some(("POST", "/api/v1/schedules/{name}/trigger")),
        SUBMIT,
    ),
    op(
        Some("/baton.v1.ScheduleService/BackfillSchedule"),
        Some(("POST", "/api/v1/schedules/{name}/backfill")),
        SUBMIT,
    ),
    // The cluster.
    op(
        Some("/baton.v1.ClusterService/GetLeader"),
        Some(("GET", "/api/v1/leader")),
        READ,
    ),
    op(
        Some("/baton.v1.ClusterService/GetLeaderHistory"),
        Some(("GET", "/api/v1/leader/history")),
        READ,
    ),
    op(
        Some("/baton.v1.ClusterService/ResignLeadership"),
        Some(("POST", "/api/v1/leader/resign")),
        ADMIN,
    ),
    op(None, Some(("GET", "/api/v1/whoami")), READ),
    op(None, Some(("GET", "/api/v1/events")), READ),
    // Workers.
    op(
        Some("/baton.v1.FleetService/ListWorkers"),
        Some(("GET", "/api/v1/workers")),
        READ,
    ),
    op(
        Some("/baton.v1.FleetService/DrainWorker"),
        Some(("POST", "/api/v1/workers/{worker_id}/drain")),
        ADMIN,
    ),
    op(
        Some("/baton.v1.FleetService/UndrainWorker"),
        Some(("POST", "/api/v1/workers/{worker_id}/undrain")),
        ADMIN,
    ),
    // What coordinators call on workers.
    op(Some("/baton.v1.WorkerService/ReadLog"), None, ADMIN),
    // Fast failover. Identify is open: a follower probing a socket whose process may be gone
    // sends no credential to whoever holds it now (the answer carries nothing secret). The
    // stream to the leader is a peer call.
    op(
        Some("/baton.v1.ClusterService/Identify"),
        None,
        Access::Open,
    ),
    op(Some("/baton.v1.ClusterService/WatchLeader"), None, ADMIN),
    // Open: the API's description and the console's files (the page asks for a token).
    op(None, Some(("GET", "/api/v1/openapi.json")), Access::Open),
    op(None, Some(("GET", "/")), Access::Open),
    op(None, Some(("GET", "/assets/{file}")), Access::Open),
];

/// What a gRPC method (`/package.Service/Method`) needs. Health is open (probes and load
/// balancers carry no credentials) and reflection needs `read`; a method not in the table
/// needs `admin`, so one added later is closed until someone declares it.
pub fn grpc(path: &str) -> Access {
    let service = path
        .trim_start_matches('/')
        .split_once('/')
        .map(|(s, _)| s)
        .unwrap_or_default();
    if service == "grpc.health.v1.Health" {
        return Access::Open;
    }
    if service.starts_with("grpc.reflection.") {
        return READ;
    }
    OPERATIONS
        .iter()
        .find(|o| o.grpc == Some(path))
        .map_or(ADMIN, |o| o.access)
}

/// What an HTTP route (as matched, `{param}` unexpanded) needs; `None`: no role is declared
/// for it, and it is refused.
pub fn http(method: &str, route: &str) -> Option<Access> {
    OPERATIONS
        .iter()
        .find(|o| o.http == Some((method, route)))
        .map(|o| o.access)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_route_and_method_is_declared_once() {
        let mut routes = std::collections::HashSet::new();
        let mut methods = std::collections::HashSet::new();
        for o in OPERATIONS {
            assert!(o.grpc.is_some() || o.http.is_some());
            if let Some(r) = o.http {
                assert!(routes.insert(r), "{r:?} twice");
            }
            if let Some(m) = o.grpc {
                assert!(methods.insert(m), "{m} twice");
            }
        }
    }

    #[test]
    fn http_routes_without_a_declared_role_are_refused() {
        assert_eq!(http("GET", "/api/v1/jobs/{job_id}"), Some(READ));
        assert_eq!(http("POST", "/api/v1/jobs/{job_id}"), None);
        assert_eq!(http("GET", "/api/v1/secret"), None);
        assert_eq!(http("GET", "/"), Some(Access::Open));
    }
}
