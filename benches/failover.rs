//! Failover figures: time from SIGKILL / SIGTERM of the leader until every surviving replica's
//! `GetLeader` names a new leader. Median and max of `ROUNDS` (default 10) per TTL.
//!
//! `./scripts/build-guard --release && cargo bench --bench failover` (env: ROUNDS, TTLS="2,5"):
//! the replicas' workers run the guard next to the release `baton`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use support::*;

fn summary(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let median = v[v.len() / 2];
    println!(
        "{name}: median {} ms, min {} ms, max {} ms over {} rounds",
        ms(median),
        ms(v[0]),
        ms(*v.last().unwrap()),
        v.len()
    );
}

/// Client-observed failover times, and the role-log gaps between the old leader's step-down and
/// the new leader's start (graceful rounds only).
async fn rounds(ttl: Duration, n: usize, graceful: bool) -> (Vec<Duration>, Vec<Duration>) {
    let mut c = Cluster::start(Options {
        ttl,
        ..Options::default()
    });
    let mut out = Vec::new();
    let mut gaps = Vec::new();
    let mut term = 0;
    for _ in 0..n {
        let all = c.all_indices();
        let old = c
            .wait_leader(&all, Duration::from_secs(30), |t| t >= term)
            .await;
        let k = c.index_of(&old.replica_id);
        let rest: Vec<usize> = all.into_iter().filter(|&i| i != k).collect();
        let start = Instant::now();
        if graceful {
            c.replicas[k].sigterm();
        } else {
            c.replicas[k].sigkill();
        }
        let new = c
            .wait_leader(&rest, ttl * 4 + Duration::from_secs(5), |t| t > old.term)
            .await;
        out.push(start.elapsed());
        term = new.term;
        let events = c.role_events();
        let at = |ev: &str, t: i64| {
            events
                .iter()
                .find(|e| e.event == ev && e.term == Some(t))
                .map(|e| e.boottime_ns)
        };
        if let (Some(down), Some(up)) =
            (at("stepped_down", old.term), at("became_leader", new.term))
        {
            gaps.push(Duration::from_nanos(up.saturating_sub(down)));
        }
        c.replicas[k].wait_exit(Duration::from_secs(15));
        c.replicas[k].restart().unwrap();
    }
    c.checked_terms();
    (out, gaps)
}

fn main() {
    let n: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let ttls: Vec<u64> = std::env::var("TTLS")
        .unwrap_or_else(|_| "2,5".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for ttl in ttls {
            let ttl = Duration::from_secs(ttl);
            let secs = ttl.as_secs();
            let (killed, _) = rounds(ttl, n, false).await;
            summary(
                &format!("SIGKILL failover, TTL {secs}s (client view)"),
                killed,
            );
            let (handed, gaps) = rounds(ttl, n, true).await;
            summary(
                &format!("SIGTERM handover, TTL {secs}s (client view)"),
                handed,
            );
            summary(
                &format!("SIGTERM handover, TTL {secs}s (step-down to new term)"),
                gaps,
            );
        }
    });
}
