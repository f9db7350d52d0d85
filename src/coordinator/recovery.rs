//! Recovery on becoming leader: the workers, cancel requests, the registry and the attempt
//! records, read in pages pinned to one revision R (never the whole keyspace at once), so that
//! the watches from R+1 miss nothing.
//!
//! Work starts while the pages come in: each registry page goes to the actor with what the
//! pages say of its jobs (entry, the current attempt's state, a cancel request), so adopting a
//! running job or queueing a pending one costs no round trip of its own; only jobs whose state
//! needs a write (an attempt that ended, a cancel) are read again by their transition. Dirty
//! results are the cleaner's to read.

use std::collections::{HashMap, HashSet};

use super::fleet::WorkerView;
use super::Ctx;
use crate::election::Term;
use crate::jobs;
use crate::jobs::records::{self, RegistryEntry};
use crate::jobs::work::{
    AttemptRecord, AttemptState, WorkerRecord, ATTEMPT_VERSION, WORKER_VERSION,
};
use crate::store::{codec, Keys};

/// One registry entry as the pinned pages show it.
pub(super) struct FoundJob {
    pub id: String,
    pub entry: RegistryEntry,
    /// The entry's mod revision: the current assignment's token.
    pub registry_rev: i64,
    /// The entry's create revision: the job's incarnation (the spec was created with it).
    pub incarnation: i64,
    /// The state of the current assignment's attempt record, if it has one.
    pub attempt: Option<AttemptState>,
    pub cancelled: bool,
    /// A result (dirty or clean) exists beside the entry: it must go, not run.
    pub has_result: bool,
}

/// What the pages yield, in order: the workers first, then registry pages.
pub(super) enum Found {
    Workers(Vec<WorkerView>),
    Jobs(Vec<FoundJob>),
}

/// Entries per page.
const PAGE: i64 = 500;

/// Reads everything a term starts from, handing it to `take` page by page, and returns the
/// revision the pages were pinned to, or `None` if the term ended first. A failed read starts
/// over (what was handed over is handed over again: the actor takes it idempotently).
pub(super) async fn recover(
    ctx: &Ctx,
    term: &Term,
    take: &mut (dyn FnMut(Found) + Send),
) -> Option<i64> {
    let mut pause = crate::retry::policies::RECOVERY.backoff();
    loop {
        match read_pages(ctx, take).await {
            Ok(rev) => return Some(rev),
            Err(e) => {
                if term.has_ended() {
                    return None;
                }
                tracing::warn!(error = %e, "recovery read failed; retrying");
                pause.pause().await;
            }
        }
    }
}

async fn read_pages(ctx: &Ctx, take: &mut (dyn FnMut(Found) + Send)) -> Result<i64, jobs::Error> {
    let keys = &ctx.keys;
    let mut rev = 0;
    let mut workers = Vec::new();
    for kv in all_pages(ctx, &keys.workers(), &mut rev, false).await? {
        if let Ok(record) = codec::decode::<WorkerRecord>(kv.key(), kv.value(), WORKER_VERSION) {
            workers.push(WorkerView {
                rev: kv.create_revision(),
                mod_rev: kv.mod_revision(),
                lease: kv.lease(),
                record,
            });
        }
    }
    take(Found::Workers(workers));
    let cancelled: HashSet<String> = all_pages(ctx, &keys.cancel(), &mut rev, true)
        .await?
        .iter()
        .filter_map(|kv| Keys::id_in(&keys.cancel(), kv.key()).map(str::to_string))
        .collect();
    let prefix = keys.registry();
    let mut after = String::new();
    loop {
        let (kvs, r) = jobs::page_ids(&ctx.store, &prefix, &after, PAGE, rev).await?;
        rev = r;
        let full = kvs.len() as i64 == PAGE;
        let ids: Vec<&str> = kvs
            .iter()
            .filter_map(|kv| Keys::id_in(&prefix, kv.key()))
            .collect();
        let Some(last) = ids.last() else {
            break;
        };
        let attempts = attempts_of(ctx, &ids, rev).await?;
        let results = results_of(ctx, &ids, rev).await?;
        let page = kvs
            .iter()
            .filter_map(|kv| {
                let id = Keys::id_in(&prefix, kv.key())?;
                let entry: RegistryEntry =
                    codec::decode_any(kv.key(), kv.value(), records::REGISTRY_VERSIONS_READ)
                        .ok()?;
                Some(FoundJob {
                    id: id.to_string(),
                    attempt: attempts.get(&(id.to_string(), kv.mod_revision())).copied(),
                    cancelled: cancelled.contains(id),
                    has_result: results.contains(id),
                    entry,
                    registry_rev: kv.mod_revision(),
                    incarnation: kv.create_revision(),
                })
            })
            .collect();
        after = last.to_string();
        take(Found::Jobs(page));
        if !full {
            break;
        }
    }
    Ok(rev)
}

/// Every key under `prefix`, in pages pinned to `rev` (0: the first page pins it).
async fn all_pages(
    ctx: &Ctx,
    prefix: &str,
    rev: &mut i64,
    keys_only: bool,
) -> Result<Vec<etcd_client::KeyValue>, jobs::Error> {
    let mut out = Vec::new();
    let mut after = String::new();
    loop {
        let (kvs, r) = jobs::page(
            &ctx.store,
            jobs::Range::after(prefix, &after),
            PAGE,
            *rev,
            keys_only,
        )
        .await?;
        *rev = r;
        let full = kvs.len() as i64 == PAGE;
        if let Some(last) = kvs.last().and_then(|kv| Keys::id_in(prefix, kv.key())) {
            after = last.to_string();
        }
        out.extend(kvs);
        if !full {
            return Ok(out);
        }
    }
}

/// The attempt records of the jobs `ids` (one registry page), by (job, token), read at `rev`.
/// `<id>/` keys do not sort like ids (`-` and `.` come before `/`): the range spans the
/// smallest and largest of them, and what else it holds is left out.
async fn attempts_of(
    ctx: &Ctx,
    ids: &[&str],
    rev: i64,
) -> Result<HashMap<(String, i64), AttemptState>, jobs::Error> {
    let keys = &ctx.keys;
    let mut found = HashMap::new();
    let wanted: HashSet<&str> = ids.iter().copied().collect();
    let Some(jobs::Range { mut start, end }) = attempts_range(keys, ids) else {
        return Ok(found);
    };
    loop {
        let range = jobs::Range {
            start: start.clone(),
            end: end.clone(),
        };
        let (kvs, _) = jobs::page(&ctx.store, range, PAGE * 2, rev, false).await?;
        for kv in &kvs {
            let Some((job, token)) = Keys::id_in(&keys.attempts(), kv.key())
                .and_then(|rest| rest.split_once('/'))
                .filter(|(job, _)| wanted.contains(job))
                .and_then(|(job, t)| Some((job.to_string(), t.parse::<i64>().ok()?)))
            else {
                continue;
            };
            if let Ok(r) = codec::decode::<AttemptRecord>(kv.key(), kv.value(), ATTEMPT_VERSION) {
                found.insert((job, token), r.state);
            }
        }
        match kvs.last() {
            Some(kv) if kvs.len() as i64 == PAGE * 2 => {
                start = kv.key().to_vec();
                start.push(0);
            }
            _ => return Ok(found),
        }
    }
}

/// Which of the jobs `ids` (one registry page, in key order) have a result, read at `rev`:
/// a keys-only read of each result range the page spans, or, where other results crowd that
/// range, a count per id.
async fn results_of(ctx: &Ctx, ids: &[&str], rev: i64) -> Result<HashSet<String>, jobs::Error> {
    let mut found = HashSet::new();
    let (Some(first), Some(last)) = (ids.first(), ids.last()) else {
        return Ok(found);
    };
    let wanted: HashSet<&str> = ids.iter().copied().collect();
    for prefix in [ctx.keys.dirty(), ctx.keys.clean()] {
        let range = jobs::Range {
            start: format!("{prefix}{first}").into_bytes(),
            end: format!("{prefix}{last}\0").into_bytes(),
        };
        let (kvs, _) = jobs::page(&ctx.store, range, PAGE * 4 + 1, rev, true).await?;
        if kvs.len() as i64 <= PAGE * 4 {
            found.extend(
                kvs.iter()
                    .filter_map(|kv| Keys::id_in(&prefix, kv.key()))
                    .filter(|id| wanted.contains(id))
                    .map(str::to_string),
            );
            continue;
        }
        for chunk in ids.chunks(100) {
            let mut c = ctx.store.client();
            let gets = chunk.iter().map(|id| {
                etcd_client::TxnOp::get(
                    format!("{prefix}{id}"),
                    Some(
                        etcd_client::GetOptions::new()
                            .with_revision(rev)
                            .with_count_only(),
                    ),
                )
            });
            let resp = ctx
                .store
                .timed(
                    "read results",
                    c.txn(etcd_client::Txn::new().and_then(gets.collect::<Vec<_>>())),
                )
                .await?;
            for (id, op) in chunk.iter().zip(resp.op_responses()) {
                if matches!(op, etcd_client::TxnOpResponse::Get(g) if g.count() > 0) {
                    found.insert(id.to_string());
                }
            }
        }
    }
    Ok(found)
}

/// The smallest range that holds the attempt records of every job in `ids`.
fn attempts_range(keys: &Keys, ids: &[&str]) -> Option<jobs::Range> {
    let prefixes = ids.iter().map(|id| keys.attempts_of(id));
    let (low, high) = (prefixes.clone().min()?, prefixes.max()?);
    Some(jobs::Range {
        start: low.into_bytes(),
        end: jobs::prefix_end(&high),
    })
}

#[cfg(test)]
mod tests {
    use crate::store::Keys;

    #[test]
    fn the_attempts_range_holds_every_job_of_the_page_whatever_its_characters() {
        let keys = Keys::new("t");
        // In id order, as a registry page comes; `-` and `.` sort before `/`.
        let ids = ["job", "job-1", "job.x", "jobs"];
        let r = super::attempts_range(&keys, &ids).unwrap();
        for id in ids {
            let key = keys.attempt(id, 12345).into_bytes();
            assert!(
                r.start <= key && key < r.end,
                "{id}'s records fall outside the range"
            );
        }
        assert!(super::attempts_range(&keys, &[]).is_none());
    }
}
