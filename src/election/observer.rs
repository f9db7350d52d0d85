//! Every replica, leader or not, follows who leads, so `baton_term` and
//! `baton_leader_changes_total` mean the same on each of them (as etcd's own
//! `leader_changes_seen` does): a watch on the election prefix, and a read of the leader after
//! each change. Nothing acts on what it sees; it only counts.

use std::time::Duration;

use etcd_client::{GetOptions, WatchOptions};
use tokio_util::sync::CancellationToken;

use super::{current_leader, Error};
use crate::metrics;
use crate::store::{Keys, Store};

/// Counts the leader changes this replica sees until `stop`.
pub async fn observe(store: Store, keys: Keys, stop: CancellationToken) {
    let mut seen: Option<i64> = None;
    let mut look = |leader: Result<i64, Error>| {
        let Ok(term) = leader else { return };
        let m = metrics::get();
        if seen.is_some_and(|s| s != term) {
            m.leader_changes.inc();
        }
        if seen != Some(term) {
            m.term.set(term);
        }
        seen = Some(term);
    };
    while !stop.is_cancelled() {
        let mut c = store.client();
        let at = store
            .timed(
                "election revision",
                c.get(keys.election(), Some(GetOptions::new().with_count_only())),
            )
            .await;
        let rev = match at {
            Ok(r) => r.header().map_or(0, |h| h.revision()),
            Err(_) => {
                pause(&stop).await;
                continue;
            }
        };
        look(current_leader(&store, &keys).await.map(|l| l.term));
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(rev + 1);
        let watch = tokio::time::timeout(
            store.config().request_timeout,
            c.watch(keys.election(), Some(opts)),
        );
        let Ok(Ok(mut stream)) = watch.await else {
            pause(&stop).await;
            continue;
        };
        loop {
            tokio::select! {
                msg = stream.message() => match msg {
                    Ok(Some(resp)) if !resp.canceled() => {
                        look(current_leader(&store, &keys).await.map(|l| l.term));
                    }
                    _ => break,
                },
                _ = stop.cancelled() => return,
            }
        }
        pause(&stop).await;
    }
}

async fn pause(stop: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        _ = stop.cancelled() => {}
    }
}
