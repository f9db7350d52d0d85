//! Client commands (`baton leader ...`). This is the binary's edge: errors are `anyhow`.
//!
//! Every command takes several replica endpoints and tries them in turn, with backoff between
//! rounds, until the overall `--timeout`.

pub mod jobs;
pub mod schedules;
pub mod workers;

use std::future::Future;
use std::time::Duration;

use anyhow::anyhow;
use serde_json::json;
use tonic::{Code, Status};

use crate::config::{ClientArgs, ClientSecurityArgs, HistoryArgs, Output, ResignArgs};
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::{
    GetLeaderHistoryRequest, GetLeaderRequest, LeaderInfo, ResignLeadershipRequest,
};
use crate::security::{AuthChannel, Bearer, ClientSecurity, ClientTlsFiles};

/// The CLI's TLS and token, read from their files.
pub fn client_security(args: &ClientSecurityArgs) -> anyhow::Result<ClientSecurity> {
    let files = ClientTlsFiles {
        ca: args.ca.clone(),
        cert: args.cert.clone(),
        key: args.key.clone(),
    };
    Ok(ClientSecurity {
        tls: files.config().map_err(|e| anyhow!(e))?,
        bearer: match &args.token_file {
            Some(p) => Bearer::from_file(p).map_err(|e| anyhow!(e))?,
            None => Bearer::default(),
        },
    })
}

/// Opens a channel to one replica.
pub async fn channel(
    addr: &str,
    security: &ClientSecurity,
    timeout: Duration,
) -> anyhow::Result<AuthChannel> {
    security
        .connect(addr, timeout.min(Duration::from_secs(3)), timeout)
        .await
        .map_err(|e| anyhow!(e))
}

/// Calls `f` on each endpoint in turn until one answers with something other than
/// UNAVAILABLE, retrying rounds with backoff until `timeout` has passed.
pub async fn call_any<T, F, Fut>(args: &ClientArgs, mut f: F) -> anyhow::Result<T>
where
    F: FnMut(AuthChannel) -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut pause = crate::retry::policies::CLIENT_ROUNDS.backoff();
    let security = client_security(&args.security)?;
    let mut last = anyhow!("no endpoints given");
    loop {
        for ep in &args.endpoints {
            match channel(ep, &security, args.timeout).await {
                Ok(ch) => match f(ch).await {
                    Ok(v) => return Ok(v),
                    Err(s) if retryable(&s) => last = anyhow!("{ep}: {}", s.message()),
                    Err(s) => return Err(anyhow!("{ep}: {} ({:?})", s.message(), s.code())),
                },
                Err(e) => last = e,
            }
        }
        let wait = pause.next_delay();
        if tokio::time::Instant::now() + wait >= deadline {
            return Err(last.context(format!(
                "no replica answered within {}",
                humantime::format_duration(args.timeout)
            )));
        }
        tokio::time::sleep(wait).await;
    }
}

/// Worth trying on the next replica. Every call here is idempotent (submissions carry their id),
/// so a call cut off mid-flight is retried: tonic reports it as `Unknown: transport error`, or,
/// when the dying server's HTTP/2 stream or connection was reset (a replica killed or stopping),
/// as `Internal: h2 protocol error: ...`, which Baton's services never answer themselves.
fn retryable(s: &Status) -> bool {
    match s.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => true,
        Code::Unknown => {
            s.message().contains("transport error") || s.message().contains("connection")
        }
        Code::Internal => s.message().starts_with("h2 protocol error"),
        _ => false,
    }
}

async fn get_leader(args: &ClientArgs) -> anyhow::Result<LeaderInfo> {
    call_any(args, |ch| async move {
        let resp = ClusterServiceClient::new(ch)
            .get_leader(GetLeaderRequest {})
            .await?
            .into_inner();
        resp.leader
            .ok_or_else(|| Status::unavailable("the answer named no leader"))
    })
    .await
}

/// A protobuf time as RFC 3339, as its JSON mapping writes it.
fn rfc3339(t: &pbjson_types::Timestamp) -> Option<String> {
    let at = chrono::DateTime::<chrono::Utc>::try_from(*t).ok()?;
    Some(at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
}

fn leader_json(l: &LeaderInfo) -> serde_json::Value {
    json!({
        "replica_id": l.replica_id,
        "advertise": l.advertise,
        "term": l.term,
        "lease_id": format!("{:x}", l.lease_id),
        "elected_at": l.elected_at.as_ref().and_then(rfc3339),
    })
}

fn print_leader(prefix: &str, l: &LeaderInfo, output: Output) {
    match output {
        Output::Json => println!("{}", leader_json(l)),
        Output::Text => {
            let at = l
                .elected_at
                .as_ref()
                .and_then(rfc3339)
                .map(|t| format!(", elected {t}"))
                .unwrap_or_default();
            println!(
                "{prefix}{} at {} (term {}{at}, lease {:x})",
                l.replica_id, l.advertise, l.term, l.lease_id
            );
        }
    }
}

pub async fn leader_get(args: &ClientArgs) -> anyhow::Result<()> {
    let l = get_leader(args).await?;
    print_leader("leader: ", &l, args.output);
    Ok(())
}

/// Asks the leader (found through any endpoint) to resign, then waits for the next term.
pub async fn leader_resign(args: &ResignArgs) -> anyhow::Result<()> {
    let c = &args.client;
    let old = get_leader(c).await?;
    let term = if args.term == 0 { old.term } else { args.term };
    let ch = channel(&old.advertise, &client_security(&c.security)?, c.timeout).await?;
    let resp = ClusterServiceClient::new(ch)
        .resign_leadership(ResignLeadershipRequest { term })
        .await
        .map_err(|s| {
            anyhow!(
                "{} refused: {} ({:?})",
                old.advertise,
                s.message(),
                s.code()
            )
        })?
        .into_inner();
    if c.output == Output::Text {
        println!("{} resigned term {}", resp.replica_id, resp.resigned_term);
    }
    let deadline = tokio::time::Instant::now() + c.timeout;
    loop {
        if let Ok(l) = get_leader(c).await {
            if l.term != resp.resigned_term {
                print_leader("new leader: ", &l, c.output);
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "no new leader within {}",
                humantime::format_duration(c.timeout)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `baton leader history`: the terms, newest first.
pub async fn leader_history(args: &HistoryArgs) -> anyhow::Result<()> {
    let limit = args.limit;
    let terms = call_any(&args.client, |ch| async move {
        Ok(ClusterServiceClient::new(ch)
            .get_leader_history(GetLeaderHistoryRequest { limit })
            .await?
            .into_inner()
            .terms)
    })
    .await?;
    match args.client.output {
        Output::Json => {
            let all: Vec<serde_json::Value> = terms
                .iter()
                .map(|t| {
                    json!({
                        "term": t.term,
                        "replica_id": t.replica_id,
                        "advertise": t.advertise,
                        "elected_at": t.elected_at,
                        "followed": t.followed,
                        "ended_reason": t.ended_reason,
                        "ended_at": t.ended_at,
                    })
                })
                .collect();
            println!("{}", serde_json::Value::Array(all));
        }
        Output::Text => {
            println!(
                "{:>10}  {:<12} {:<26} {:>10}  ENDED",
                "TERM", "REPLICA", "ELECTED", "FOLLOWED"
            );
            for t in &terms {
                let ended = if t.ended_reason.is_empty() {
                    "-".to_string()
                } else {
                    format!("{} ({})", t.ended_at, t.ended_reason)
                };
                println!(
                    "{:>10}  {:<12} {:<26} {:>10}  {ended}",
                    t.term, t.replica_id, t.elected_at, t.followed
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod retry_tests {
    use super::*;

    #[test]
    fn calls_cut_off_mid_flight_are_retried_and_answers_are_not() {
        // What a soak drill saw when a replica was stopped under a submission.
        let reset = Status::internal("h2 protocol error: http2 error (Internal)");
        assert!(retryable(&reset));
        assert!(retryable(&Status::unknown("transport error")));
        assert!(retryable(&Status::unavailable("not the leader")));
        assert!(!retryable(&Status::internal("a stored value is corrupt")));
        assert!(!retryable(&Status::invalid_argument("bad spec")));
        assert!(!retryable(&Status::already_exists("another spec")));
    }
}
