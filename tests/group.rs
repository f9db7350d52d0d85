//! Group commit against a real etcd: concurrent writes share transactions (etcd's own counters
//! say so), each keeps its own outcome, writes on the same key never share one, an oversized
//! write fails alone, and a failed fence applies nothing.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton::devcluster::etcd::http_get;
use baton::devcluster::EtcdCluster;
use baton::store::group::{Fence, GroupCommit, Limits, Outcome};
use baton::store::{EtcdConfig, Store, Write};
use etcd_client::{Compare, CompareOp, TxnOpResponse};

use support::*;

/// Transactions etcd has answered OK, from its metrics.
fn txns(etcd: &EtcdCluster) -> f64 {
    let text = http_get(&etcd.metrics_addrs()[0], "/metrics", Duration::from_secs(2))
        .expect("etcd serves /metrics");
    text.lines()
        .filter(|l| {
            l.starts_with("grpc_server_handled_total{")
                && l.contains("grpc_code=\"OK\"")
                && l.contains("grpc_method=\"Txn\"")
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

fn value_of(o: &Outcome) -> Option<Vec<u8>> {
    let Outcome::Conflict { response, .. } = o else {
        return None;
    };
    match response.op_responses().into_iter().next()? {
        TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_share_transactions_and_keep_their_own_outcomes() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = start_etcd(dir.path(), 1);
    let store = Store::connect(EtcdConfig::new(etcd.endpoints()))
        .await
        .unwrap();
    let mut kv = store.client();
    for i in (1..100).step_by(2) {
        kv.put(format!("/g/k{i}"), "old", None).await.unwrap();
    }
    let (group, run) = GroupCommit::new(store.clone(), None, "test", Limits::default());
    tokio::spawn(run);
    // 300 put-if-absent writes at once; the odd ones below 100 find the key there.
    let before = txns(&etcd);
    let writes = (0..300).map(|i| {
        let group = group.clone();
        async move {
            let key = format!("/g/k{i}");
            let w = Write::new()
                .when_absent(key.clone())
                .put(key.clone(), "new")
                .or_get(key);
            (i, group.commit(w).await.unwrap())
        }
    });
    let outcomes = futures_util::future::join_all(writes).await;
    let spent = txns(&etcd) - before;
    for (i, o) in &outcomes {
        if i % 2 == 1 && *i < 100 {
            assert_eq!(value_of(o), Some(b"old".to_vec()), "write {i}: {o:?}");
        } else {
            assert!(matches!(o, Outcome::Applied { .. }), "write {i}: {o:?}");
        }
    }
    // At least 3 batches (a write has one operation per branch: 127 fit one transaction under
    // etcd's 128), and far fewer than one each.
    assert!(
        (3.0..30.0).contains(&spent),
        "300 concurrent writes took {spent} etcd transactions"
    );
    let got = kv
        .get("/g/k", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert_eq!(got.kvs().len(), 300);

    // Twenty writes on one key at once: never in one transaction (etcd would refuse it), one
    // applies, the others see it.
    let same = (0..20).map(|i| {
        let group = group.clone();
        async move {
            let w = Write::new()
                .when_absent("/g/one")
                .put("/g/one", format!("{i}"))
                .or_get("/g/one");
            group.commit(w).await.unwrap()
        }
    });
    let outcomes = futures_util::future::join_all(same).await;
    let applied = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Applied { .. }))
        .count();
    assert_eq!(applied, 1, "{outcomes:?}");
    assert!(outcomes
        .iter()
        .all(|o| matches!(o, Outcome::Applied { .. }) || value_of(o).is_some()));

    // A write over etcd's request limit fails; the writes beside it do not.
    let big = {
        let group = group.clone();
        async move {
            let w = Write::new().put("/g/big", vec![b'x'; 3 * 1024 * 1024]);
            group.commit(w).await
        }
    };
    let small = (0..10).map(|i| {
        let group = group.clone();
        async move {
            group
                .commit(Write::new().put(format!("/g/s{i}"), "1"))
                .await
        }
    });
    let (big, small) = tokio::join!(big, futures_util::future::join_all(small));
    assert!(big.is_err(), "{big:?}");
    assert!(
        small
            .iter()
            .all(|r| matches!(r, Ok(Outcome::Applied { .. }))),
        "{small:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fence_applies_nothing_of_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = start_etcd(dir.path(), 1);
    let store = Store::connect(EtcdConfig::new(etcd.endpoints()))
        .await
        .unwrap();
    // The fence requires a key that does not exist: every write answers Fenced.
    let fence = Fence {
        compare: Compare::version("/f/term", CompareOp::Greater, 0),
        valid: Box::new(|| true),
    };
    let (group, run) = GroupCommit::new(store.clone(), Some(fence), "test", Limits::default());
    tokio::spawn(run);
    let writes = (0..50).map(|i| {
        let group = group.clone();
        async move {
            group
                .commit(Write::new().put(format!("/f/k{i}"), "1"))
                .await
                .unwrap()
        }
    });
    let outcomes = futures_util::future::join_all(writes).await;
    assert!(outcomes.iter().all(|o| matches!(o, Outcome::Fenced)));
    let mut kv = store.client();
    let got = kv
        .get("/f/k", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert_eq!(got.kvs().len(), 0);

    // A fence that is no longer valid sends nothing at all.
    let valid = Arc::new(AtomicBool::new(true));
    let v = valid.clone();
    let fence = Fence {
        compare: Compare::version("/f/k0", CompareOp::Equal, 0),
        valid: Box::new(move || v.load(Ordering::SeqCst)),
    };
    let (group, run) = GroupCommit::new(store.clone(), Some(fence), "test", Limits::default());
    tokio::spawn(run);
    let ok = group.commit(Write::new().put("/f/x", "1")).await.unwrap();
    assert!(matches!(ok, Outcome::Applied { .. }));
    valid.store(false, Ordering::SeqCst);
    let before = txns(&etcd);
    let fenced = group.commit(Write::new().put("/f/y", "1")).await.unwrap();
    assert!(matches!(fenced, Outcome::Fenced));
    assert_eq!(txns(&etcd), before, "nothing was sent");
}
