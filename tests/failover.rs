//! Fast failover on a real etcd with real `baton serve` processes: a follower that has evidence
//! the leader's process is gone (its exact socket refuses, or another incarnation answers
//! there) revokes that term's lease at once; nothing else ever triggers a revoke, a live leader
//! revoked by mistake steps down at once and holds further revokes back, and jobs on workers
//! never restart.

mod support;

use std::time::{Duration, Instant};

use baton::devcluster::Mode;
use baton::rolelog;
use support::*;

/// Waits until every follower in `among` watches the leader of `term`.
async fn all_watching(c: &Cluster, among: &[usize], term: i64) {
    wait_until(
        &format!("followers {among:?} to watch the leader of term {term}"),
        Duration::from_secs(30),
        || among.iter().all(|&i| watching(c, i, term)),
    )
    .await;
}

/// Replica `k`, leading `term`, resigns.
async fn resign(c: &Cluster, k: usize, term: i64) {
    baton::proto::cluster_service_client::ClusterServiceClient::connect(format!(
        "http://{}",
        c.replicas[k].listen()
    ))
    .await
    .unwrap()
    .resign_leadership(baton::proto::ResignLeadershipRequest { term })
    .await
    .unwrap();
}

/// A separate worker runs one gated job through the whole test.
async fn steady_job(c: &Cluster) -> std::path::PathBuf {
    let out = scratch(c);
    c.wait_workers(&["w1"]).await;
    c.submit(0, "steady", gated(&out, "gate")).await;
    wait_until("the steady job to start", Duration::from_secs(30), || {
        runs(&out, "steady") == 1
    })
    .await;
    out
}

/// It ran once, is still running, and finishes once let go.
async fn ran_once(c: &Cluster, out: &std::path::Path) {
    assert_eq!(runs(out, "steady"), 1, "the job restarted");
    std::fs::write(out.join("gate"), "").unwrap();
    let j = c
        .wait_job(
            &c.all_indices(),
            "steady",
            Duration::from_secs(60),
            "finished",
            terminal,
        )
        .await;
    assert_eq!(state(&j), baton::proto::JobState::Finished);
    assert_eq!(runs(out, "steady"), 1, "the job restarted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_in_well_under_its_ttl_and_jobs_run_on() {
    let mut c = Cluster::start(Options {
        ttl: Duration::from_secs(10),
        ..worker_opts(1, &[])
    });
    let out = steady_job(&c).await;
    let (k, old) = c.leader_index().await;
    all_watching(&c, &c.others(k), old.term).await;
    let killed = Instant::now();
    c.replicas[k].sigkill();
    let (_, new) = c.wait_new_leader(&c.others(k), old.term).await;
    let took = killed.elapsed();
    println!(
        "SIGKILL to a new leader serving at TTL 10 s: {} ms",
        ms(took)
    );
    // Expiry would take the TTL (10 s) at least: only a revoke explains a new leader this soon.
    assert!(took < c.ttl / 2, "a new leader only after {took:?}");
    let revoked = revokes(&c);
    assert_eq!(revoked.len(), 1, "{revoked:#?}");
    let r = &revoked[0];
    assert_eq!(
        (r.leader.as_deref(), r.term, r.evidence.as_deref()),
        (
            Some(old.replica_id.as_str()),
            Some(old.term),
            Some("refused")
        )
    );
    assert_eq!(r.lease, old.lease_id);
    assert_eq!(r.pid, Some(c.replicas[k].pid() as u32));
    assert!(new.term > old.term);
    c.checked_terms();
    ran_once(&c, &out).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_restarted_in_place_is_another_incarnation_and_is_revoked_as_such() {
    let mut c = Cluster::start(Options {
        ttl: Duration::from_secs(15),
        ..worker_opts(1, &[])
    });
    let (k, old) = c.leader_index().await;
    let followers = c.others(k);
    all_watching(&c, &followers, old.term).await;
    let before = identify_at(c.replicas[k].listen()).await.unwrap();
    // The followers sleep through the death, so the first they learn of it is the new process
    // answering on the same address.
    for &i in &followers {
        c.replicas[i].pause();
    }
    c.replicas[k].restart().unwrap();
    let again = wait_for(
        "the restarted leader to answer",
        Duration::from_secs(30),
        || identify_at(c.replicas[k].listen()),
    )
    .await;
    assert_eq!(again.replica_id, before.replica_id);
    assert_ne!(again.incarnation, before.incarnation);
    let resumed = Instant::now();
    for &i in &followers {
        c.replicas[i].resume();
    }
    let (_, new) = c.wait_new_leader(&c.all_indices(), old.term).await;
    assert!(
        resumed.elapsed() < c.ttl / 2,
        "no revoke: the old lease expired"
    );
    let revoked = revokes(&c);
    assert_eq!(revoked.len(), 1, "{revoked:#?}");
    assert_eq!(
        (revoked[0].term, revoked[0].evidence.as_deref()),
        (Some(old.term), Some("restarted"))
    );
    assert!(new.term > old.term);
    c.checked_terms();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_already_won_again_after_a_restart_keeps_its_term() {
    let mut c = Cluster::start(Options {
        replicas: 2,
        ttl: Duration::from_secs(3),
        ..worker_opts(1, &[])
    });
    let (k, old) = c.leader_index().await;
    let f = 1 - k;
    all_watching(&c, &[f], old.term).await;
    // The follower sleeps while the leader dies, comes back in place and wins again once its
    // old lease expired: when the follower wakes, its evidence is about a term already gone.
    c.replicas[f].pause();
    c.replicas[k].restart().unwrap();
    let again = wait_for(
        "the restarted replica to lead again",
        Duration::from_secs(60),
        || async {
            let r = get_leader_at(c.replicas[k].listen()).await.ok()?;
            let l = r.leader?;
            (r.answered_by_leader && l.term > old.term).then_some(l)
        },
    )
    .await;
    c.replicas[f].resume();
    all_watching(&c, &[f], again.term).await;
    let now = c.get_leader(k).await.unwrap().leader.unwrap();
    assert_eq!(now.term, again.term, "the term won again was revoked");
    assert!(revokes(&c).is_empty(), "{:#?}", revokes(&c));
    c.checked_terms();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_leader_is_never_revoked_by_resign_sigterm_sigstop_or_an_etcd_cut() {
    let mut c = Cluster::start(Options {
        ttl: Duration::from_secs(3),
        proxied: true,
        ..worker_opts(1, &[])
    });
    let out = steady_job(&c).await;

    // Resign: the stream ends, the same incarnation answers.
    let (k, old) = c.leader_index().await;
    all_watching(&c, &c.others(k), old.term).await;
    resign(&c, k, old.term).await;
    let (k, old) = c.wait_new_leader(&c.all_indices(), old.term).await;

    // SIGTERM: it resigns, then exits; the refused connection is about a term already gone.
    all_watching(&c, &c.others(k), old.term).await;
    c.replicas[k].sigterm();
    assert!(c.replicas[k].wait_exit(Duration::from_secs(30)).is_some());
    let rest = c.others(k);
    let (l, old) = c.wait_new_leader(&rest, old.term).await;
    c.replicas[k].restart().unwrap();

    // SIGSTOP: the stream stays open; the lease expires as before.
    all_watching(&c, &c.others(l), old.term).await;
    c.replicas[l].pause();
    let (_, next) = c.wait_new_leader(&c.others(l), old.term).await;
    c.replicas[l].resume();

    // Cut from etcd: it steps down at its margin; then the same incarnation answers.
    let (l, old) = c.leader_index().await;
    assert_eq!(old.term, next.term);
    all_watching(&c, &c.others(l), old.term).await;
    c.cut_off(l);
    c.wait_new_leader(&c.others(l), old.term).await;
    c.reconnect(l);

    assert!(revokes(&c).is_empty(), "{:#?}", revokes(&c));
    c.checked_terms();
    ran_once(&c, &out).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advertise_addresses_that_name_no_single_leader_socket_never_revoke() {
    // Unspecified: fast failover is off; a SIGKILL waits out the lease.
    let mut c = Cluster::start(Options {
        advertise: Advertise::Unspecified,
        ..Options::default()
    });
    let (k, old) = c.leader_index().await;
    wait_until("the warning", Duration::from_secs(10), || {
        c.log_of(k).contains("fast failover is off")
    })
    .await;
    c.replicas[k].sigkill();
    c.wait_new_leader(&c.others(k), old.term).await;
    assert!(revokes(&c).is_empty(), "{:#?}", revokes(&c));
    c.checked_terms();
    drop(c);

    // Each replica advertises a proxy to another: a follower reaches a replica that is not the
    // leader, the handshake fails, and no stream is ever held.
    let mut c = Cluster::start(Options {
        advertise: Advertise::Proxy(vec![1, 2, 0]),
        ..Options::default()
    });
    let (k, old) = c.leader_index().await;
    wait_until(
        "followers to give up holding a stream to the leader's advertised address",
        Duration::from_secs(30),
        || {
            c.others(k)
                .iter()
                .all(|&i| c.log_of(i).contains("no stream to the leader can be held"))
        },
    )
    .await;
    c.replicas[k].sigkill();
    c.wait_new_leader(&c.others(k), old.term).await;
    assert!(revokes(&c).is_empty(), "{:#?}", revokes(&c));
    assert!(c.others(k).iter().all(|&i| !watching(&c, i, old.term)));
    c.checked_terms();
    drop(c);

    // `localhost`, the leader listening on 127.0.0.1 only: a follower dials the one address the
    // name resolves to, or none when it names several (with `::1 localhost`); a live leader's
    // stream that ends (here: it resigns) is never evidence.
    let c = Cluster::start(Options {
        advertise: Advertise::Localhost,
        ..Options::default()
    });
    let (k, old) = c.leader_index().await;
    resign(&c, k, old.term).await;
    let (_, new) = c.wait_new_leader(&c.all_indices(), old.term).await;
    let now = c.get_leader(k).await.unwrap().leader.unwrap();
    assert_eq!(now.term, new.term);
    assert!(revokes(&c).is_empty(), "{:#?}", revokes(&c));
    c.checked_terms();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_refuses_a_live_leader_costs_one_term_then_none_for_ten_minutes() {
    let c = Cluster::start(Options {
        ttl: Duration::from_secs(3),
        advertise: Advertise::Proxy(vec![0, 1, 2]),
        ..worker_opts(1, &[])
    });
    let out = steady_job(&c).await;
    let (k, old) = c.leader_index().await;
    all_watching(&c, &c.others(k), old.term).await;
    // The leader lives; only the way to it refuses connections.
    c.advertised[k].set_mode(Mode::Closed);
    let (l, next) = c.wait_new_leader(&c.all_indices(), old.term).await;
    let revoked = revokes(&c);
    assert_eq!(revoked.len(), 1, "{revoked:#?}");
    assert_eq!(revoked[0].term, Some(old.term));
    wait_until(
        "the live leader to record the false alarm",
        Duration::from_secs(10),
        || {
            c.replicas[k].role_events().iter().any(|e| {
                e.event == "stepped_down"
                    && e.term == Some(old.term)
                    && e.reason.as_deref() == Some("lease revoked")
            }) && c.log_of(k).contains("\"event\":\"false_alarm\"")
        },
    )
    .await;
    assert_ne!(
        l, k,
        "the revoked leader campaigned again behind the others"
    );

    // The next leader's way refuses too: the evidence looks the same, and is held back.
    all_watching(&c, &c.others(l), next.term).await;
    c.advertised[l].set_mode(Mode::Closed);
    wait_until(
        "a follower to hold its revoke back",
        Duration::from_secs(30),
        || {
            c.others(l).iter().any(|&i| {
                c.log_of(i)
                    .contains("a false alarm is recorded: not revoking")
            })
        },
    )
    .await;
    c.advertised[k].set_mode(Mode::Pass);
    c.advertised[l].set_mode(Mode::Pass);
    let now = c.get_leader(l).await.unwrap().leader.unwrap();
    assert_eq!(now.term, next.term, "the second leader was revoked");
    assert_eq!(revokes(&c).len(), 1, "{:#?}", revokes(&c));
    // The one revoke hit a live process, which the exit check must catch; the other terms never
    // overlapped.
    let (events, exits) = (c.role_events(), c.exits());
    assert_eq!(rolelog::unproven_revokes(&events, &exits).len(), 1);
    let others: Vec<_> = rolelog::terms_until_exits(&events, &exits)
        .into_iter()
        .filter(|t| t.term != old.term)
        .collect();
    rolelog::check_terms(&others).unwrap();
    ran_once(&c, &out).await;
}

/// The newest `became_leader` in the role logs: (replica index, term, lease).
fn newest_term(c: &Cluster) -> Option<(usize, i64, i64)> {
    c.role_events()
        .iter()
        .filter(|e| e.event == "became_leader")
        .max_by_key(|e| e.term)
        .map(|e| (c.index_of(&e.replica), e.term.unwrap_or_default(), e.lease))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mtls_a_killed_leader_is_replaced_in_well_under_its_ttl() {
    // Replicas serve TLS with client certificates, and call each other with their own
    // certificate (CN `replica`, role admin), verifying the leader's against the CA for the
    // advertised 127.0.0.1.
    let d = tempfile::tempdir().unwrap();
    let ca = pki::Ca::new("ca");
    let ca_pem = ca.save(d.path(), "ca.pem");
    let (cert, key) = ca.issue(d.path(), "replica", "replica");
    let s = |p: &std::path::Path| p.display().to_string();
    let mut c = Cluster::start(Options {
        ttl: Duration::from_secs(10),
        extra_args: vec![
            "--tls-cert".into(),
            s(&cert),
            "--tls-key".into(),
            s(&key),
            "--tls-client-ca".into(),
            s(&ca_pem),
            "--tls-client-roles".into(),
            "replica=admin".into(),
            "--peer-ca".into(),
            s(&ca_pem),
        ],
        ..Options::default()
    });
    let (k, term, lease) = wait_for("a leader", Duration::from_secs(30), || async {
        newest_term(&c)
    })
    .await;
    all_watching(&c, &c.others(k), term).await;
    let killed = Instant::now();
    c.replicas[k].sigkill();
    let (next, _, _) = wait_for("a new leader", c.ttl * 3, || async {
        newest_term(&c).filter(|t| t.1 > term)
    })
    .await;
    let took = killed.elapsed();
    println!(
        "over mTLS, SIGKILL to a new term at TTL 10 s: {} ms",
        ms(took)
    );
    assert!(took < c.ttl / 2, "a new leader only after {took:?}");
    assert_ne!(next, k);
    let revoked = revokes(&c);
    assert_eq!(revoked.len(), 1, "{revoked:#?}");
    assert_eq!(
        (
            revoked[0].term,
            revoked[0].lease,
            revoked[0].evidence.as_deref()
        ),
        (Some(term), lease, Some("refused"))
    );
    c.checked_terms();
}
