//! What a follower concludes when its stream to the leader ends. Only two findings are
//! evidence that the leader's process is gone: the exact socket the stream was connected to
//! refuses a connection (the host is up and nothing listens there), or an authenticated answer
//! from that socket names the same cluster and replica with another incarnation (the process
//! was restarted in place). Everything else is inconclusive and leaves the lease to expire.

use std::io::ErrorKind;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::Watched;
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::IdentifyRequest;
use crate::retry::policies;
use crate::security::ClientSecurity;

/// Evidence that the watched process is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Evidence {
    /// Its exact socket address refused a connection.
    Refused,
    /// Another incarnation of the same replica answered there.
    Restarted { incarnation: String, pid: u32 },
}

impl Evidence {
    pub fn name(&self) -> &'static str {
        match self {
            Evidence::Refused => "refused",
            Evidence::Restarted { .. } => "restarted",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finding {
    Gone(Evidence),
    /// The same process answered: the stream ended for another reason (its term ended).
    Alive,
    /// No evidence either way; the reason is a metric label.
    Inconclusive(&'static str),
}

/// Looks for evidence within `bound` of the stream's end. A refused connection is taken to mean
/// that nothing listens there; a host firewall's REJECT rule, kube-proxy in front of a NotReady
/// pod or an overflowing accept queue with `tcp_abort_on_overflow` can also refuse for a live
/// process, which is why a revoked live leader records a false alarm. A connection that was taken and then
/// dropped unanswered is what a dying process does while it closes its sockets one by one (the
/// listener may go after the stream), so that finding is probed again until the bound.
pub async fn probe(peer: &ClientSecurity, watched: &Watched, bound: Duration) -> Finding {
    let deadline = Instant::now() + bound;
    let mut again = policies::PROBE_AGAIN.backoff();
    loop {
        match once(peer, watched, deadline).await {
            Finding::Inconclusive("transport") if Instant::now() < deadline => {
                tokio::time::sleep(again.next_delay()).await;
            }
            f => return f,
        }
    }
}

async fn once(peer: &ClientSecurity, watched: &Watched, deadline: Instant) -> Finding {
    let addr = watched.target.addr;
    match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
        Err(_) => return Finding::Inconclusive("timeout"),
        Ok(Err(e)) if e.kind() == ErrorKind::ConnectionRefused => {
            return Finding::Gone(Evidence::Refused)
        }
        Ok(Err(e)) => {
            return Finding::Inconclusive(match e.kind() {
                ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => "unreachable",
                ErrorKind::TimedOut => "timeout",
                _ => "connect_error",
            })
        }
        Ok(Ok(_)) => {}
    }
    let left = deadline.saturating_duration_since(Instant::now());
    // Identify is open: no credential goes to a socket whose owner may be another process now.
    let anonymous = ClientSecurity {
        tls: peer.tls.clone(),
        bearer: Default::default(),
    };
    let asked = async {
        let ch = anonymous
            .connect_exact(&watched.target.host, addr, left)
            .await
            .map_err(|_| "transport")?;
        ClusterServiceClient::new(ch)
            .identify(IdentifyRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|s| code_reason(s.code()))
    };
    let id = match tokio::time::timeout_at(deadline, asked).await {
        Err(_) => return Finding::Inconclusive("timeout"),
        Ok(Err(reason)) => return Finding::Inconclusive(reason),
        Ok(Ok(id)) => id,
    };
    if id.cluster != watched.cluster || id.replica_id != watched.replica_id {
        Finding::Inconclusive("another_replica_or_cluster")
    } else if id.incarnation == watched.incarnation {
        Finding::Alive
    } else {
        Finding::Gone(Evidence::Restarted {
            incarnation: id.incarnation,
            pid: id.pid,
        })
    }
}

fn code_reason(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Unimplemented => "unimplemented",
        Unauthenticated => "unauthenticated",
        PermissionDenied => "permission_denied",
        DeadlineExceeded | Cancelled => "timeout",
        Unavailable | Unknown | Internal => "transport",
        _ => "error_answer",
    }
}
