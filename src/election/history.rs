//! The history of terms in etcd: `terms/<term, 20 digits>`, one key per term.
//!
//! The write that confirms a term adds only a put of its own record, with no compare on any
//! other history key, so the history can never stop an election. How a term ended is added by
//! whoever knows: a leader stepping down in order records it before it resigns. A separate
//! fenced trim keeps the newest [`KEEP`]; its failure never ends a term.

use std::time::Duration;

use etcd_client::{GetOptions, SortOrder, SortTarget};
use serde::{Deserialize, Serialize};

use super::Term;
use crate::store::{self, codec, Keys, Store, Write};

pub const TERM_RECORD_VERSION: u32 = 1;
/// Terms the history keeps.
pub const KEEP: usize = 1000;

/// `terms/<term>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TermRecord {
    pub version: u32,
    pub term: i64,
    pub replica_id: String,
    pub advertise: String,
    /// RFC 3339.
    pub elected_at: String,
    /// The newest term in the history when this one began (0: none known).
    #[serde(default)]
    pub followed: i64,
    /// How it ended, when its leader could say (a step-down in order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<TermEnd>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TermEnd {
    pub reason: String,
    /// RFC 3339.
    pub at: String,
}

/// The newest term the history holds (0 if none, or if etcd does not answer within `wait`):
/// read before a term is confirmed, never a reason to fail it.
pub async fn newest(store: &Store, keys: &Keys, wait: Duration) -> i64 {
    let mut c = store.client();
    let opts = GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_sort(SortTarget::Key, SortOrder::Descend)
        .with_limit(1);
    let read = c.get(keys.terms(), Some(opts));
    match tokio::time::timeout(wait, read).await {
        Ok(Ok(r)) => r
            .kvs()
            .first()
            .and_then(|kv| Keys::id_in(&keys.terms(), kv.key())?.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}

/// The put the confirming write adds.
pub fn record_put(keys: &Keys, record: &TermRecord) -> Write {
    Write::new().put(keys.term_record(record.term), codec::encode(record))
}

/// Records how `term` ended, fenced by the term itself (so only while it still holds).
pub async fn record_end(term: &Term, keys: &Keys, record: &TermRecord, reason: &str) {
    let mut done = record.clone();
    done.ended = Some(TermEnd {
        reason: reason.to_string(),
        at: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
    });
    let write = Write::new().put(keys.term_record(record.term), codec::encode(&done));
    let wait = Duration::from_millis(500);
    if let Ok(Err(e)) = tokio::time::timeout(wait, term.commit(write)).await {
        tracing::debug!(error = %e, "cannot record how the term ended");
    }
}

/// Deletes the history's oldest terms beyond [`KEEP`] (up to 100 a term: one more term adds
/// one), fenced by `term`.
pub async fn trim(term: &Term, store: &Store, keys: &Keys) {
    let mut c = store.client();
    let opts = GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_sort(SortTarget::Key, SortOrder::Descend)
        .with_limit(KEEP as i64 + 100);
    let Ok(resp) = store
        .timed("term history", c.get(keys.terms(), Some(opts)))
        .await
    else {
        return;
    };
    let old: Vec<Vec<u8>> = resp
        .kvs()
        .iter()
        .skip(KEEP)
        .map(|kv| kv.key().to_vec())
        .collect();
    if old.is_empty() {
        return;
    }
    let write = old.into_iter().fold(Write::new(), |w, k| w.delete(k));
    if let Err(e) = term.commit(write).await {
        tracing::debug!(error = %e, "cannot trim the term history");
    }
}

/// The newest `limit` terms of the history, newest first. A record that does not decode is
/// left out (and counted).
pub async fn read(
    store: &Store,
    keys: &Keys,
    limit: usize,
) -> Result<Vec<TermRecord>, store::Error> {
    let mut c = store.client();
    let opts = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Key, SortOrder::Descend)
        .with_limit(limit as i64);
    let resp = store
        .timed("term history", c.get(keys.terms(), Some(opts)))
        .await?;
    Ok(resp
        .kvs()
        .iter()
        .filter_map(|kv| codec::decode(kv.key(), kv.value(), TERM_RECORD_VERSION).ok())
        .collect())
}
