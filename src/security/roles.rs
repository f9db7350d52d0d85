//! Roles, what each gRPC method needs (from [`super::operations`]), and the authenticated caller handlers read.

use std::fmt;
use std::str::FromStr;

/// Ordered: each role may do everything the ones below it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Get, list, watch jobs and their logs; leader and workers; reflection.
    Read,
    /// Also submit and cancel jobs.
    Submit,
    /// Also resign leadership, retry cleanups, drain workers and read a worker's logs (what
    /// coordinators do on workers).
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Submit => "submit",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "read" => Ok(Role::Read),
            "submit" => Ok(Role::Submit),
            "admin" => Ok(Role::Admin),
            other => Err(format!(
                "unknown role {other:?} (roles: read, submit, admin)"
            )),
        }
    }
}

/// The role a gRPC method (`/package.Service/Method`) needs; `None` for the ones open to
/// everybody. See [`super::operations`].
pub fn required(path: &str) -> Option<Role> {
    match super::operations::grpc(path) {
        super::operations::Access::Open => None,
        super::operations::Access::Needs(role) => Some(role),
    }
}

/// Who made a request, as authenticated by [`super::AuthLayer`]; in the request's extensions
/// when authentication is on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The token's name, or the client certificate's CN.
    pub name: String,
    pub role: Role,
}

/// The caller's name for records and audit lines: `anonymous` when authentication is off.
pub fn caller_name<T>(req: &tonic::Request<T>) -> String {
    req.extensions()
        .get::<Caller>()
        .map(|c| c.name.clone())
        .unwrap_or_else(|| "anonymous".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_need_the_documented_roles() {
        assert_eq!(required("/grpc.health.v1.Health/Check"), None);
        assert_eq!(required("/grpc.health.v1.Health/Watch"), None);
        assert_eq!(
            required("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
            Some(Role::Read)
        );
        assert_eq!(required("/baton.v1.JobService/GetJob"), Some(Role::Read));
        assert_eq!(
            required("/baton.v1.JobService/SubmitJob"),
            Some(Role::Submit)
        );
        assert_eq!(
            required("/baton.v1.JobService/CancelJob"),
            Some(Role::Submit)
        );
        assert_eq!(
            required("/baton.v1.JobService/RetryCleanup"),
            Some(Role::Admin)
        );
        assert_eq!(
            required("/baton.v1.ClusterService/ResignLeadership"),
            Some(Role::Admin)
        );
        assert_eq!(
            required("/baton.v1.FleetService/DrainWorker"),
            Some(Role::Admin)
        );
        assert_eq!(
            required("/baton.v1.WorkerService/ReadLog"),
            Some(Role::Admin)
        );
        assert_eq!(required("/baton.v1.JobService/Unknown"), Some(Role::Admin));
        assert_eq!(required("/baton.v1.ClusterService/Identify"), None);
        assert_eq!(
            required("/baton.v1.ClusterService/WatchLeader"),
            Some(Role::Admin)
        );
        assert_eq!(
            required("/baton.v1.ScheduleService/GetSchedule"),
            Some(Role::Read)
        );
        assert_eq!(
            required("/baton.v1.ScheduleService/PauseSchedule"),
            Some(Role::Submit)
        );
        assert_eq!(required("garbage"), Some(Role::Admin));
        assert!(Role::Read < Role::Submit && Role::Submit < Role::Admin);
    }
}
