//! Recovery on becoming leader: the registry, cancel requests and dirty results, read in pages
//! pinned to one revision R (never the whole keyspace at once), so that the watch from R+1
//! misses nothing.

use std::collections::HashSet;
use std::time::Duration;

use super::Ctx;
use crate::election::Term;
use crate::jobs;
use crate::store::Keys;

/// Reads the registry, cancel requests and dirty results in pages pinned to one revision.
/// Returns that revision, the ids to reconcile, and how many dirty results there are.
pub(super) async fn recover(ctx: &Ctx, term: &Term) -> (i64, Vec<String>, usize) {
    let mut pause = Duration::from_millis(100);
    loop {
        match read_pages(ctx).await {
            Ok(r) => return r,
            Err(e) => {
                if term.has_ended() {
                    return (0, Vec::new(), 0);
                }
                tracing::warn!(error = %e, "recovery read failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

const PAGE: i64 = 500;

async fn read_pages(ctx: &Ctx) -> Result<(i64, Vec<String>, usize), jobs::Error> {
    let mut rev = 0;
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
    Ok((rev, ids, dirty))
}
