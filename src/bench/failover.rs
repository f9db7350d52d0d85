//! Scenario `failover`: SIGKILLs and SIGTERMs of the leader of three coordinator-only
//! replicas: how long the cluster had no leader, and how long until the new leader answered
//! as leader. The killed replica is started again before the next round.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::cluster::{boot_now, ms_between, BenchCluster, Shape};
use super::stats::Spread;
use crate::config::BenchArgs;
use crate::rolelog;

#[derive(Clone, Debug, Serialize)]
pub struct Failover {
    pub lease_ttl_ms: u64,
    /// SIGKILL: from the kill to the new term's start (role log).
    pub kill_leaderless: Spread,
    /// SIGKILL: from the kill until the new leader answers as leader.
    pub kill_serving: Spread,
    /// SIGTERM: from the old leader's step-down to the new term's start (role logs).
    pub term_leaderless: Spread,
    /// SIGTERM: from the signal until the new leader answers as leader.
    pub term_serving: Spread,
    /// Terms that overlapped in the role logs (must be 0).
    pub overlapping_terms: usize,
}

pub async fn run(args: &BenchArgs, dir: &Path) -> anyhow::Result<Failover> {
    let mut c = BenchCluster::start(args, dir, Shape::coordinators(3))?;
    let bound = args.lease_ttl * 4 + Duration::from_secs(20);
    let (mut leader, mut term) = c.wait_leader(0, Duration::from_secs(60)).await?;
    let mut kill = (Vec::new(), Vec::new());
    let mut stop = (Vec::new(), Vec::new());
    for round in 0..args.failovers * 2 {
        let graceful = round % 2 == 1;
        // Every replica follows the election again before the next fault.
        for i in 0..c.replicas.len() {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !c.follows(i).await && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let (at, t0) = (boot_now(), Instant::now());
        if graceful {
            c.replicas[leader].sigterm();
        } else {
            c.replicas[leader].sigkill();
        }
        let (next, next_term) = c.wait_leader(term, bound).await?;
        let serving = t0.elapsed().as_secs_f64() * 1e3;
        let events = c.role_events();
        let when = |ev: &str, t: i64| {
            events
                .iter()
                .find(|e| e.event == ev && e.term == Some(t))
                .map(|e| e.boottime_ns)
        };
        let began = when("became_leader", next_term).unwrap_or(at);
        if graceful {
            let down = when("stepped_down", term).unwrap_or(at);
            stop.0.push(ms_between(down, began));
            stop.1.push(serving);
        } else {
            kill.0.push(ms_between(at, began));
            kill.1.push(serving);
        }
        c.replicas[leader].wait_exit(Duration::from_secs(30));
        c.replicas[leader].restart()?;
        (leader, term) = (next, next_term);
    }
    let terms = rolelog::terms(&c.role_events());
    let overlapping_terms = terms
        .windows(2)
        .filter(|w| rolelog::check_terms(w).is_err())
        .count();
    Ok(Failover {
        lease_ttl_ms: args.lease_ttl.as_millis() as u64,
        kill_leaderless: Spread::of(kill.0),
        kill_serving: Spread::of(kill.1),
        term_leaderless: Spread::of(stop.0),
        term_serving: Spread::of(stop.1),
        overlapping_terms,
    })
}
