//! The election pieces in-process against a real etcd: the fence, phantom wins, the role
//! channel, and a keepalive loop that a saturated runtime cannot starve.

mod support;

use std::time::Duration;

use baton::clock::BootInstant;
use baton::election::{self, Commit, ElectionConfig, FenceError, Lease, Role};
use baton::store::{EtcdConfig, Keys, Store, Write};
use etcd_client::LeaderKey;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use support::*;

fn config(id: &str) -> ElectionConfig {
    ElectionConfig {
        replica_id: id.into(),
        advertise: "127.0.0.1:1".into(),
        ttl: Duration::from_secs(2),
        margin: Duration::from_millis(500),
        work_grace: Duration::from_secs(1),
    }
}

async fn store(etcd: &baton::devcluster::EtcdCluster) -> Store {
    Store::connect(EtcdConfig::new(etcd.endpoints()))
        .await
        .unwrap()
}

async fn wait_term(role: &mut watch::Receiver<Role>, not: Option<i64>) -> election::Term {
    tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            if let Role::Leader(t) = &*role.borrow_and_update() {
                if Some(t.lease_id()) != not {
                    return t.clone();
                }
            }
            role.changed().await.unwrap();
        }
    })
    .await
    .expect("no term within 15s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_tells_a_lost_term_from_a_conflict_and_ends_the_term() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = start_etcd(dir.path(), 1);
    let store = store(&etcd).await;
    let keys = Keys::new("fence");
    let (role_tx, mut role) = watch::channel(Role::Follower);
    let (_cmd_tx, cmd_rx) = mpsc::channel(1);
    let shutdown = CancellationToken::new();
    let election = tokio::spawn(election::run(
        store.clone(),
        keys.clone(),
        config("solo"),
        role_tx,
        cmd_rx,
        shutdown.clone(),
    ));
    let term = wait_term(&mut role, None).await;
    assert!(term.is_valid());

    let key = "/baton/fence/probe";
    let put = || Write::new().when_absent(key).put(key, "1");
    let first = term.commit(put()).await.unwrap();
    assert!(matches!(first, Commit::Applied { .. }));
    let second = term.commit(put()).await.unwrap();
    assert!(
        matches!(second, Commit::Conflict(_)),
        "a failed per-key compare is a conflict"
    );
    assert!(term.is_valid(), "a conflict does not end the term");

    // Depose it behind its back: the election key disappears.
    let mut client = store.client();
    client.delete(term.key(), None).await.unwrap();
    let lost = term.commit(Write::new().put(key, "2")).await;
    assert!(matches!(lost, Err(FenceError::Deposed { .. })), "{lost:?}");
    assert!(term.has_ended() && !term.is_valid());
    assert!(matches!(term.check(), Err(FenceError::Deposed { .. })));
    assert!(matches!(
        term.commit(Write::new().put(key, "2")).await,
        Err(FenceError::Deposed { .. })
    ));

    // The role channel follows, and the next term runs on a new lease with a higher revision.
    let next = wait_term(&mut role, Some(term.lease_id())).await;
    assert!(next.revision() > term.revision());
    assert_ne!(next.lease_id(), term.lease_id());
    shutdown.cancel();
    election.await.unwrap();
    assert!(matches!(*role.borrow(), Role::Follower));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_campaign_win_for_a_deleted_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = start_etcd(dir.path(), 1);
    let store = store(&etcd).await;
    let keys = Keys::new("phantom");
    let cfg = config("ghost");
    let lease = Lease::grant(&store, cfg.ttl, cfg.margin, "ghost")
        .await
        .unwrap();
    let mut client = store.client();
    let mut won = client
        .campaign(keys.election(), "{}", lease.id())
        .await
        .unwrap();
    let key: LeaderKey = won.take_leader().unwrap();
    // The key vanishes (as lease expiry would delete it) before the win is confirmed.
    client.delete(key.key(), None).await.unwrap();
    let refused = election::confirm(&store, &keys, &cfg, &lease, key, 0).await;
    assert!(
        matches!(refused, Err(election::Error::PhantomWin)),
        "{:?}",
        refused.err()
    );

    // A revoked lease is refused too, even for a key that still looks right.
    let lease2 = Lease::grant(&store, cfg.ttl, cfg.margin, "ghost")
        .await
        .unwrap();
    let key2 = client
        .campaign(keys.election(), "{}", lease2.id())
        .await
        .unwrap()
        .take_leader()
        .unwrap();
    client.lease_revoke(lease2.id()).await.unwrap();
    let refused = election::confirm(&store, &keys, &cfg, &lease2, key2, 0).await;
    assert!(
        matches!(refused, Err(election::Error::PhantomWin)),
        "a win on a revoked lease: {:?}",
        refused.err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalives_continue_while_every_runtime_worker_is_blocked() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = start_etcd(dir.path(), 1);
    let store = store(&etcd).await;
    let lease = Lease::grant(
        &store,
        Duration::from_secs(2),
        Duration::from_millis(500),
        "busy",
    )
    .await
    .unwrap();
    let before = lease.valid_until();
    // Block both workers for twice the TTL, as a burst of CPU-bound work would.
    let hogs: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async { std::thread::sleep(Duration::from_secs(4)) }))
        .collect();
    for h in hogs {
        h.await.unwrap();
    }
    assert!(
        !lease.lost().is_cancelled(),
        "the lease was lost while the runtime was busy"
    );
    let now = BootInstant::now();
    assert!(
        // Renewed on schedule during the block: the latest proof is at most one period
        // (TTL/3) and a little slack old.
        lease.valid_until() > now + Duration::from_millis(2000 - 667 - 300),
        "valid_until {} not renewed past now {} (was {})",
        lease.valid_until(),
        now,
        before
    );
}

/// Recovery chains page reads at one revision and watches from the next: a page pinned to R
/// must say R, even though etcd's answer header carries the store's current revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_page_read_reports_the_revision_it_was_pinned_to() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = start_etcd(dir.path(), 1);
    let store = store(&etcd).await;
    let mut client = store.client();
    client.put("/p/a", "1", None).await.unwrap();
    let (first, r) = baton::jobs::page_ids(&store, "/p/", "", 10, 0)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    client.put("/p/b", "2", None).await.unwrap();
    let (pinned, r2) = baton::jobs::page_ids(&store, "/p/", "", 10, r)
        .await
        .unwrap();
    assert_eq!(r2, r, "a pinned read must report its pinned revision");
    assert_eq!(pinned.len(), 1, "a pinned read sees nothing newer");
    let (now, r3) = baton::jobs::page_ids(&store, "/p/", "", 10, 0)
        .await
        .unwrap();
    assert!(r3 > r && now.len() == 2);
}
