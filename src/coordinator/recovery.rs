//! Recovery on becoming leader: the workers, the registry, cancel requests and dirty results,
//! read in pages pinned to one revision R (never the whole keyspace at once), so that the
//! watches from R+1 miss nothing. Attempt records are read per job by its transition.

use std::collections::HashSet;
use std::time::Duration;

use super::fleet::WorkerView;
use super::Ctx;
use crate::election::Term;
use crate::jobs;
use crate::jobs::work::{WorkerRecord, WORKER_VERSION};
use crate::store::{codec, Keys};

type Recovered = (i64, Vec<String>, usize, Vec<WorkerView>);

/// Reads the workers, the registry, cancel requests and dirty results in pages pinned to one
/// revision. Returns that revision, the ids to reconcile, how many dirty results there are, and
/// the live workers.
pub(super) async fn recover(ctx: &Ctx, term: &Term) -> Recovered {
    let mut pause = Duration::from_millis(100);
    loop {
        match read_pages(ctx).await {
            Ok(r) => return r,
            Err(e) => {
                if term.has_ended() {
                    return (0, Vec::new(), 0, Vec::new());
                }
                tracing::warn!(error = %e, "recovery read failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

const PAGE: i64 = 500;

async fn read_pages(ctx: &Ctx) -> Result<Recovered, jobs::Error> {
    let mut rev = 0;
    let mut workers = Vec::new();
    let prefix = ctx.keys.workers();
    let mut after = String::new();
    loop {
        let (kvs, r) = jobs::page_ids(&ctx.store, &prefix, &after, PAGE, rev).await?;
        rev = r;
        for kv in &kvs {
            if let Some(id) = Keys::id_in(&prefix, kv.key()) {
                after = id.to_string();
            }
            if let Ok(record) = codec::decode::<WorkerRecord>(kv.key(), kv.value(), WORKER_VERSION)
            {
                workers.push(WorkerView {
                    rev: kv.create_revision(),
                    mod_rev: kv.mod_revision(),
                    record,
                });
            }
        }
        if (kvs.len() as i64) < PAGE {
            break;
        }
    }
    // Registry entries are created with their job in the submit transaction: ordering by their
    // create revision restarts jobs in submission order.
    let mut ids: Vec<(i64, String)> = Vec::new();
    let mut dirty = 0;
    for (prefix, is_dirty) in [
        (ctx.keys.registry(), false),
        (ctx.keys.cancel(), false),
        (ctx.keys.dirty(), true),
    ] {
        let mut after = String::new();
        loop {
            let (kvs, r) = jobs::page_ids(&ctx.store, &prefix, &after, PAGE, rev).await?;
            rev = r;
            for kv in &kvs {
                if let Some(id) = Keys::id_in(&prefix, kv.key()) {
                    if is_dirty {
                        dirty += 1;
                    } else {
                        ids.push((kv.create_revision(), id.to_string()));
                    }
                    after = id.to_string();
                }
            }
            if (kvs.len() as i64) < PAGE {
                break;
            }
        }
    }
    ids.sort();
    let mut seen = HashSet::new();
    let ids = ids
        .into_iter()
        .filter(|(_, id)| seen.insert(id.clone()))
        .map(|(_, id)| id)
        .collect();
    Ok((rev, ids, dirty, workers))
}
