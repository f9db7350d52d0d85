//! `ListJobs`: pages of jobs in id order, merged from the registry (active jobs) and the
//! result store (dirty, clean), every page read at one pinned revision.
//!
//! Honest at 100,000 jobs: a request reads at most [`MAX_SCAN`] entries, so a filter that
//! matches little answers a short page that says so (and continues), never a scan of the
//! whole store; a search by id prefix reads only that prefix's keys; a token whose revision
//! etcd has compacted goes on at the newest revision, with a notice.

use std::collections::BTreeMap;

use tonic::Status;

use super::jobs::{cleanup_proto, from_registry, from_result};
use crate::jobs::records::{JobResult, RegistryEntry};
use crate::jobs::{self, spec, Range};
use crate::proto;
use crate::store::{codec, Keys, Store};

/// Entries one request reads at most, over all prefixes and rounds (a first round of at most
/// 3 x 1,001 included).
pub const MAX_SCAN: usize = 5_000;

/// Entries read per prefix in a round after the first: bounded, so a round's memory is.
const ROUND: usize = 1_000;

fn parse_token(t: &str) -> Result<(i64, String), Status> {
    if t.is_empty() {
        return Ok((0, String::new()));
    }
    let bad = || Status::invalid_argument("page_token: not a token this API returned");
    let (rev, id) = t.split_once('/').ok_or_else(bad)?;
    let rev: i64 = rev.parse().map_err(|_| bad())?;
    spec::validate_id(id).map_err(|_| bad())?;
    Ok((rev, id.to_string()))
}

/// The keys of `prefix` whose ids start with `id_prefix` and sort after `after`.
fn range(prefix: &str, id_prefix: &str, after: &str) -> Range {
    let start = if after.is_empty() || after < id_prefix {
        format!("{prefix}{id_prefix}")
    } else {
        format!("{prefix}{after}\0")
    };
    Range {
        start: start.into_bytes(),
        end: jobs::prefix_end(&format!("{prefix}{id_prefix}")),
    }
}

fn compacted(e: &jobs::Error) -> bool {
    super::status::error_chain(e).contains("compacted")
}

pub async fn list(
    store: &Store,
    keys: &Keys,
    req: proto::ListJobsRequest,
) -> Result<proto::ListJobsResponse, Status> {
    let size = match req.page_size {
        0 => 100,
        n if n > 1000 => return Err(Status::invalid_argument("page_size: at most 1000")),
        n => n as usize,
    };
    let state = proto::JobState::try_from(req.state)
        .map_err(|_| Status::invalid_argument("state: unknown value"))?;
    let cleanup = proto::CleanupState::try_from(req.cleanup)
        .map_err(|_| Status::invalid_argument("cleanup: unknown value"))?;
    if !req.id_prefix.is_empty() {
        spec::validate_id(&req.id_prefix)
            .map_err(|e| Status::invalid_argument(format!("id_prefix: {e}")))?;
    }
    let (mut rev, mut after) = parse_token(&req.page_token)?;
    use proto::CleanupState as C;
    use proto::JobState as S;
    let active = matches!(state, S::Unspecified | S::Pending | S::Running)
        && matches!(cleanup, C::Unspecified | C::CleanupNotStarted);
    let terminal = matches!(
        state,
        S::Unspecified | S::Finished | S::Failed | S::Canceled
    );
    let mut prefixes = Vec::new();
    if active {
        prefixes.push(keys.registry());
    }
    if terminal && !matches!(cleanup, C::CleanupDone | C::CleanupNotStarted) {
        prefixes.push(keys.dirty());
    }
    if terminal && matches!(cleanup, C::Unspecified | C::CleanupDone) {
        prefixes.push(keys.clean());
    }
    let mut notice = String::new();
    let mut found: BTreeMap<String, proto::Job> = BTreeMap::new();
    let mut scanned = 0;
    let mut more = !prefixes.is_empty();
    // One more than the page: a last page that is exactly full says it is the last.
    let mut chunk = size + 1;
    'rounds: while more && found.len() < size && scanned < MAX_SCAN {
        let mut batches = Vec::new();
        // The merge of the prefixes is complete up to the smallest last id read among those
        // that may have more: the round keeps what sorts up to it.
        let mut bound: Option<String> = None;
        for prefix in &prefixes {
            let r = range(prefix, &req.id_prefix, &after);
            let (kvs, r) = match jobs::page(store, r, chunk as i64, rev, false).await {
                Ok(x) => x,
                Err(e) if rev > 0 && compacted(&e) => {
                    rev = 0;
                    notice = "the page token's revision was compacted; the listing went on at the newest revision (see revision) from the same id: jobs changed in between may be missed or listed twice".into();
                    continue 'rounds;
                }
                Err(e) => return Err(e.into()),
            };
            rev = r;
            // Every entry read counts, kept or not: the cap bounds what etcd sends.
            scanned += kvs.len();
            note_bound(&mut bound, prefix, &kvs, chunk);
            batches.push((prefix.clone(), kvs));
        }
        for (prefix, kvs) in &batches {
            for kv in kvs {
                let Some(id) = Keys::id_in(prefix, kv.key()) else {
                    continue;
                };
                if bound.as_deref().is_some_and(|b| id > b) {
                    continue;
                }
                if found.contains_key(id) {
                    continue;
                }
                if let Some(job) = decode(keys, prefix, id, rev, kv) {
                    let keep = match state {
                        S::Unspecified => true,
                        s => job.state == s as i32,
                    } && match cleanup {
                        C::Unspecified => true,
                        c => job.cleanup.as_ref().is_some_and(|x| x.state == c as i32),
                    };
                    if keep {
                        found.insert(id.to_string(), job);
                    }
                }
            }
        }
        match bound {
            Some(b) => after = b,
            None => more = false,
        }
        // What is left of the cap, shared by the prefixes.
        chunk = ROUND
            .min(MAX_SCAN.saturating_sub(scanned) / prefixes.len().max(1))
            .max(1);
    }
    let mut jobs: Vec<proto::Job> = found.into_values().collect();
    let next_page_token = if jobs.len() > size {
        jobs.truncate(size);
        format!("{rev}/{}", jobs[size - 1].job_id)
    } else if more {
        format!("{rev}/{after}")
    } else {
        String::new()
    };
    Ok(proto::ListJobsResponse {
        scan_limit_reached: more && jobs.len() < size,
        jobs,
        next_page_token,
        notice,
        revision: rev,
    })
}

/// Lowers `bound` to the last id of a full batch: that prefix may have more after it.
fn note_bound(
    bound: &mut Option<String>,
    prefix: &str,
    kvs: &[etcd_client::KeyValue],
    chunk: usize,
) {
    if kvs.len() < chunk {
        return;
    }
    if let Some(last) = kvs.last().and_then(|kv| Keys::id_in(prefix, kv.key())) {
        if bound.as_deref().is_none_or(|b| last < b) {
            *bound = Some(last.to_string());
        }
    }
}

/// The job of one entry; `None` for a value that does not decode (it is skipped, as it
/// would be for any reader: a corrupt entry never breaks a listing).
fn decode(
    keys: &Keys,
    prefix: &str,
    id: &str,
    rev: i64,
    kv: &etcd_client::KeyValue,
) -> Option<proto::Job> {
    let mut job = proto::Job {
        job_id: id.to_string(),
        revision: rev,
        ..Default::default()
    };
    if prefix == keys.registry() {
        let e = codec::decode_any::<RegistryEntry>(
            kv.key(),
            kv.value(),
            crate::jobs::records::REGISTRY_VERSIONS_READ,
        )
        .ok()?;
        from_registry(&mut job, &e);
        job.cleanup = Some(cleanup_proto(None, false, None));
    } else {
        let r = codec::decode_any::<JobResult>(
            kv.key(),
            kv.value(),
            crate::jobs::records::RESULT_VERSIONS_READ,
        )
        .ok()?;
        from_result(&mut job, &r);
        let clean = prefix == keys.clean();
        job.cleanup = Some(cleanup_proto(Some(&r), clean, None));
    }
    Some(job)
}
