//! Leadership on a real etcd with real `baton serve` processes: election, failover by SIGKILL,
//! handover by SIGTERM and `baton leader resign`, isolation from etcd, a paused leader, a full
//! etcd cluster restart, and clear errors for bad flags.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use baton::clock::BootInstant;
use baton::rolelog::RoleEvent;
use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use support::*;

fn became<'a>(events: &'a [RoleEvent], replica: &str) -> Vec<&'a RoleEvent> {
    events_of(events, replica)
        .into_iter()
        .filter(|e| e.event == "became_leader")
        .collect()
}

/// Every role event, once `replica` has logged that it leads `term`: the others' observers name
/// a new leader as soon as etcd does, a moment before it has proven its lease and logged it.
async fn events_once_leading(c: &Cluster, replica: &str, term: i64) -> Vec<RoleEvent> {
    wait_for(
        &format!("{replica} to log that it leads term {term}"),
        Duration::from_secs(10),
        || {
            let events = c.role_events();
            let logged = events.iter().any(|e| {
                e.replica == replica && e.event == "became_leader" && e.term == Some(term)
            });
            async move { logged.then_some(events) }
        },
    )
    .await
}

fn stepped_down<'a>(events: &'a [RoleEvent], replica: &str, term: i64) -> Option<&'a RoleEvent> {
    events
        .iter()
        .find(|e| e.replica == replica && e.event == "stepped_down" && e.term == Some(term))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_elect_exactly_one_leader_that_all_name() {
    let c = Cluster::start(Options::default());
    let leader = c
        .wait_leader(&c.all_indices(), Duration::from_secs(15), |_| true)
        .await;
    let mut claimed = 0;
    for i in c.all_indices() {
        let resp = c.get_leader(i).await.unwrap();
        assert_eq!(resp.leader.as_ref().unwrap(), &leader);
        assert_eq!(resp.answered_by, c.replicas[i].id());
        if resp.answered_by_leader {
            claimed += 1;
            assert_eq!(c.replicas[i].id(), leader.replica_id);
        }
    }
    assert_eq!(claimed, 1, "exactly one replica must say it is the leader");
    assert!(
        leader.elected_at.is_some(),
        "the win is confirmed with an elected_at"
    );
    let terms = c.checked_terms();
    assert_eq!(terms.len(), 1, "one term only: {terms:?}");
    assert_eq!(terms[0].term, leader.term);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_leader_elects_a_new_one_with_a_higher_term() {
    let mut c = Cluster::start(Options::default());
    let old = c
        .wait_leader(&c.all_indices(), Duration::from_secs(15), |_| true)
        .await;
    // Followers keep campaigning longer than etcd's request timeout (3 s): a campaign must not be
    // cut by a per-request timeout.
    let before = c.candidate_keys().await;
    let since = Instant::now();
    wait_until(
        "followers to wait in campaign past the request timeout",
        Duration::from_secs(10),
        || since.elapsed() > Duration::from_secs(4),
    )
    .await;
    assert_eq!(
        c.candidate_keys().await,
        before,
        "the followers' campaigns were restarted while waiting"
    );
    let k = c.index_of(&old.replica_id);
    let killed_at = Instant::now();
    c.replicas[k].sigkill();
    let rest = c.others(k);
    let new = c
        .wait_leader(&rest, c.ttl * 3 + Duration::from_secs(5), |t| t > old.term)
        .await;
    println!(
        "SIGKILL failover at TTL {:?}: {} ms",
        c.ttl,
        ms(killed_at.elapsed())
    );
    assert_ne!(new.replica_id, old.replica_id);
    assert!(new.term > old.term);
    c.checked_terms();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_over_well_before_the_lease_could_expire() {
    let mut c = Cluster::start(Options {
        ttl: Duration::from_secs(5),
        ..Options::default()
    });
    let old = c
        .wait_leader(&c.all_indices(), Duration::from_secs(15), |_| true)
        .await;
    let k = c.index_of(&old.replica_id);
    let asked = Instant::now();
    c.replicas[k].sigterm();
    let rest = c.others(k);
    let new = c
        .wait_leader(&rest, Duration::from_secs(15), |t| t > old.term)
        .await;
    let took = asked.elapsed();
    println!("SIGTERM handover at TTL 5s: {} ms", ms(took));
    // Past its own shutdown limits (10 s of grace, then 5 s for the API), with room for load.
    let status = c.replicas[k].wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "a SIGTERMed replica exits 0: {status:?}"
    );
    // The old lease was proven for up to 5 s at the time of the signal: a handover that waited
    // for expiry would take longer than the step-down margin allows.
    assert!(
        took < c.ttl - Duration::from_millis(1250),
        "handover took {took:?}: the next leader waited for the lease to expire"
    );
    let events = events_once_leading(&c, &new.replica_id, new.term).await;
    let down = stepped_down(&events, &old.replica_id, old.term)
        .expect("the old leader logged its step-down");
    assert_eq!(down.reason.as_deref(), Some("shutdown"));
    let up = became(&events, &new.replica_id);
    assert!(down.boottime_ns < up.last().unwrap().boottime_ns);
    c.checked_terms();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_resign_command_moves_leadership_to_another_replica() {
    let c = Cluster::start(Options::default());
    let old = c
        .wait_leader(&c.all_indices(), Duration::from_secs(15), |_| true)
        .await;
    let endpoints: Vec<String> = c.replicas.iter().map(|r| r.listen().to_string()).collect();
    let started = Instant::now();
    let out = Command::new(BIN)
        .args(["leader", "resign", "--endpoints", &endpoints.join(",")])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "resign failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("leader resign round trip: {} ms", ms(started.elapsed()));
    assert!(
        stdout.contains(&format!("resigned term {}", old.term)),
        "{stdout}"
    );
    let new = c
        .wait_leader(&c.all_indices(), Duration::from_secs(10), |t| t > old.term)
        .await;
    assert_ne!(
        new.replica_id, old.replica_id,
        "the resigned leader queues behind the others"
    );
    assert!(
        stdout.contains(&format!("new leader: {}", new.replica_id)),
        "{stdout}"
    );
    let events = c.role_events();
    let down = stepped_down(&events, &old.replica_id, old.term).unwrap();
    assert_eq!(down.reason.as_deref(), Some("resign requested"));
    c.wait_candidate_on_new_lease(&old.replica_id, old.lease_id)
        .await;
    c.checked_terms();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_off_from_etcd_steps_down_before_anyone_else_leads() {
    let c = Cluster::start(Options {
        proxied: true,
        ..Options::default()
    });
    let old = c
        .wait_leader(&c.all_indices(), Duration::from_secs(15), |_| true)
        .await;
    let k = c.index_of(&old.replica_id);
    c.cut_off(k);
    let rest = c.others(k);
    let new = c
        .wait_leader(&rest, c.ttl * 3 + Duration::from_secs(5), |t| t > old.term)
        .await;
    let events = events_once_leading(&c, &new.replica_id, new.term).await;
    let down = stepped_down(&events, &old.replica_id, old.term)
        .expect("the isolated leader must log its step-down");
    assert!(
        down.reason.as_deref().unwrap_or("").contains("not proven"),
        "step-down reason: {:?}",
        down.reason
    );
    // It says what its keepalives looked like: the last answered one was sent at least
    // TTL - margin (1.5 s) before the step-down, and that is the longest gap.
    let last = down.last_keepalive_ns.expect("the last answered keepalive");
    let gap = down
        .longest_keepalive_gap_ms
        .expect("the longest keepalive gap");
    assert!(
        down.boottime_ns - last >= 1_400_000_000 && gap >= 1_400,
        "last keepalive {} ms before the step-down, longest gap {gap} ms",
        (down.boottime_ns - last) / 1_000_000
    );
    let up = became(&events, &new.replica_id);
    assert!(
        down.boottime_ns < up.last().unwrap().boottime_ns,
        "the isolated leader stepped down at {} but {} led from {}",
        down.boottime_ns,
        new.replica_id,
        up.last().unwrap().boottime_ns
    );
    c.checked_terms();

    // Back on the network it campaigns again, with a new lease.
    c.reconnect(k);
    c.wait_candidate_on_new_lease(&old.replica_id, old.lease_id)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_etcd_blip_is_ridden_out_on_a_fresh_connection() {
    let c = Cluster::start(Options {
        ttl: Duration::from_secs(5),
        proxied: true,
        ..Options::default()
    });
    let leader = c
        .wait_leader(&c.all_indices(), Duration::from_secs(15), |_| true)
        .await;
    let k = c.index_of(&leader.replica_id);
    c.cut_off(k);
    let cut = Instant::now();
    wait_until("a one-second blip", Duration::from_secs(5), || {
        cut.elapsed() >= Duration::from_secs(1)
    })
    .await;
    c.reconnect(k);
    let back = BootInstant::now();
    wait_until(
        "a keepalive answered after the blip",
        Duration::from_secs(10),
        || {
            c.replicas[k].role_events().iter().any(|e| {
                e.event == "lease_proven"
                    && e.lease == leader.lease_id
                    && e.boottime_ns > back.as_nanos()
            })
        },
    )
    .await;
    let still = c
        .wait_leader(&c.all_indices(), Duration::from_secs(10), |_| true)
        .await;
    assert_eq!(still, leader, "the blip must not cost the term");
    let events = c.role_events();
    assert!(
        stepped_down(&events, &leader.replica_id, leader.term).is_none(),
        "no step-down for a blip shorter than the margin allows"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_steps_down_on_waking_and_its_fence_fails() {
    let c = Cluster::start(Options::default());
    let old = c
        .wait_leader(&c.all_indices(), Duration::from_secs(15), |_| true)
        .await;
    let k = c.index_of(&old.replica_id);
    let key = became(&c.role_events(), &old.replica_id)[0]
        .key
        .clone()
        .unwrap();
    c.replicas[k].pause();
    let paused = Instant::now();
    let rest = c.others(k);
    let new = c
        .wait_leader(&rest, c.ttl * 3 + Duration::from_secs(5), |t| t > old.term)
        .await;
    wait_until(
        "a pause longer than the TTL",
        Duration::from_secs(10),
        || paused.elapsed() > c.ttl + Duration::from_millis(500),
    )
    .await;
    let woke = BootInstant::now();
    c.replicas[k].resume();
    wait_until(
        "the woken replica to log its step-down",
        Duration::from_secs(10),
        || stepped_down(&c.replicas[k].role_events(), &old.replica_id, old.term).is_some(),
    )
    .await;
    let events = c.role_events();
    let down = stepped_down(&events, &old.replica_id, old.term).unwrap();
    assert!(
        down.boottime_ns >= woke.as_nanos(),
        "it could only notice after waking"
    );
    assert!(
        down.reason.as_deref().unwrap().contains("not proven"),
        "{:?}",
        down.reason
    );
    assert!(
        !events.iter().any(|e| e.lease == old.lease_id
            && e.event == "lease_proven"
            && e.boottime_ns >= woke.as_nanos()),
        "the woken leader must not renew its expired lease"
    );
    // Its term's interval ended before the new leader's started.
    let terms = c.checked_terms();
    let old_term = terms.iter().find(|t| t.term == old.term).unwrap();
    let new_term = terms.iter().find(|t| t.term == new.term).unwrap();
    assert!(old_term.end <= new_term.start);

    // A write through the old term's fence fails.
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    let txn = Txn::new()
        .when([Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            old.term,
        )])
        .and_then([TxnOp::put(
            format!("/baton/{}/fenced-probe", c.cluster),
            "stale",
            None,
        )]);
    let resp = client.txn(txn).await.unwrap();
    assert!(!resp.succeeded(), "the old term's fence still held");
    assert!(client.get(key, None).await.unwrap().kvs().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_survive_a_restart_of_the_whole_etcd_cluster() {
    let mut c = Cluster::start(Options {
        etcd_members: 3,
        ..Options::default()
    });
    let old = c
        .wait_leader(&c.all_indices(), Duration::from_secs(20), |_| true)
        .await;
    c.etcd.stop();
    wait_until(
        "the leader to step down while etcd is gone",
        Duration::from_secs(15),
        || stepped_down(&c.role_events(), &old.replica_id, old.term).is_some(),
    )
    .await;
    for i in 0..c.etcd.size() {
        c.etcd.restart_member(i).unwrap();
    }
    c.etcd.wait_ready(Duration::from_secs(30)).unwrap();
    let new = c
        .wait_leader(&c.all_indices(), Duration::from_secs(40), |t| t > old.term)
        .await;
    for r in c.replicas.iter_mut() {
        assert!(
            r.try_exit().is_none(),
            "{} exited during the etcd restart",
            r.id()
        );
    }
    assert!(new.term > old.term);
    c.checked_terms();
}

#[test]
fn lease_ttl_below_etcds_minimum_is_a_clear_error() {
    let out = Command::new(BIN)
        .args(["serve", "--lease-ttl", "1s", "--replica-id", "x"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--lease-ttl 1s is below etcd's 2s minimum"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn unreachable_etcd_is_a_clear_error() {
    let port = baton::devcluster::free_port();
    let started = Instant::now();
    let out = Command::new(BIN)
        .args(["serve", "--replica-id", "x", "--startup-timeout", "1s"])
        .args(["--etcd-endpoints", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("cannot reach etcd at 127.0.0.1:{port} within 1s")),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_term_history_records_each_term_after_the_one_it_followed() {
    let mut c = Cluster::start(Options::default());
    let first = c
        .wait_leader(&c.all_indices(), Duration::from_secs(15), |_| true)
        .await;
    let endpoints: Vec<String> = c.replicas.iter().map(|r| r.listen().to_string()).collect();
    let eps = endpoints.join(",");
    // A step-down in order records its reason; a SIGKILL records nothing.
    let out = Command::new(BIN)
        .args(["leader", "resign", "--endpoints", &eps])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let second = c
        .wait_leader(&c.all_indices(), Duration::from_secs(10), |t| {
            t > first.term
        })
        .await;
    let k = c.index_of(&second.replica_id);
    c.replicas[k].sigkill();
    let third = c
        .wait_leader(&c.others(k), Duration::from_secs(20), |t| t > second.term)
        .await;
    let history = wait_for(
        "the third term in the history",
        Duration::from_secs(10),
        || async {
            let out = Command::new(BIN)
                .args(["leader", "history", "-o", "json", "--endpoints", &eps])
                .output()
                .ok()?;
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let terms = v.as_array()?.clone();
            (terms.first()?["term"] == third.term).then_some(terms)
        },
    )
    .await;
    let at = |t: i64| {
        history
            .iter()
            .find(|h| h["term"] == t)
            .unwrap_or_else(|| panic!("term {t} in {history:?}"))
    };
    assert_eq!(at(third.term)["replica_id"], third.replica_id.as_str());
    assert_eq!(at(third.term)["followed"], second.term);
    assert_eq!(at(second.term)["followed"], first.term);
    assert_eq!(at(first.term)["ended_reason"], "resign requested");
    assert_eq!(
        at(second.term)["ended_reason"],
        "",
        "a SIGKILL says nothing"
    );
    let terms: Vec<i64> = history
        .iter()
        .map(|h| h["term"].as_i64().unwrap())
        .collect();
    assert!(
        terms.windows(2).all(|w| w[0] > w[1]),
        "newest first: {terms:?}"
    );
}

async fn identify(addr: std::net::SocketAddr) -> baton::proto::Identity {
    identify_at(addr).await.expect("Identify answered")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_process_identifies_itself_and_a_restart_in_place_is_another_incarnation() {
    let mut c = Cluster::start(Options {
        replicas: 2,
        ..Options::default()
    });
    let leader = c
        .wait_leader(&[0, 1], Duration::from_secs(30), |_| true)
        .await;
    let li = c.index_of(&leader.replica_id);
    let fi = 1 - li;
    let (l, f) = (
        identify(c.replicas[li].listen()).await,
        identify(c.replicas[fi].listen()).await,
    );
    assert_eq!(
        (l.cluster.as_str(), l.replica_id.as_str()),
        ("test", leader.replica_id.as_str())
    );
    assert_eq!((l.term, l.lease_id), (leader.term, leader.lease_id));
    assert_eq!(l.pid, c.replicas[li].pid() as u32);
    assert_eq!((f.term, f.lease_id), (0, 0), "a follower leads no term");
    assert_ne!(l.incarnation, f.incarnation);
    // The follower, restarted on the same address: same id, another incarnation.
    c.replicas[fi].restart().unwrap();
    let again = wait_for("the restarted follower", Duration::from_secs(30), || {
        identify_at(c.replicas[fi].listen())
    })
    .await;
    assert_eq!(again.replica_id, f.replica_id);
    assert_ne!(again.incarnation, f.incarnation);
}
