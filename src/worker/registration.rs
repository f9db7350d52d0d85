//! Registration of a worker incarnation, and what is left of earlier ones.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use tokio_util::sync::CancellationToken;

use super::WorkerConfig;
use crate::election::Lease;
use crate::exec::record;
use crate::jobs::work::{WorkerRecord, WORKER_VERSION};
use crate::store::{codec, Keys, Store};

/// Puts `workers/<id>` on `lease` if absent, waiting (while the lease holds) for an earlier
/// incarnation's key to go. Returns the new key's create revision; `None` if stopped or the
/// lease was lost meanwhile.
pub(super) async fn register(
    store: &Store,
    keys: &Keys,
    config: &WorkerConfig,
    lease: &Lease,
    unable: Option<String>,
    stop: &CancellationToken,
) -> Option<i64> {
    // A worker an operator drained comes back drained: nothing is assigned to it in between.
    let mut c = store.client();
    let drained = store
        .timed(
            "read drain request",
            c.get(
                keys.drain(&config.worker_id),
                Some(GetOptions::new().with_count_only()),
            ),
        )
        .await
        .is_ok_and(|r| r.count() > 0);
    let record = WorkerRecord {
        version: WORKER_VERSION,
        worker_id: config.worker_id.clone(),
        advertise: config.advertise.clone(),
        capacity: config.capacity as u32,
        cleanup_capacity: config.max_cleanups as u32,
        labels: config.labels.clone(),
        draining: drained,
        started_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        // What etcd granted (it may raise a TTL below its minimum): how long the leader waits.
        lease_ttl_ms: lease.ttl().as_millis() as u64,
        margin_ms: config.guard.margin.as_millis() as u64,
        assign_timeout_ms: config.assign_timeout.as_millis() as u64,
        started_at_ms: crate::jobs::records::now_ms(),
        unable,
    };
    let mut told = false;
    loop {
        if stop.is_cancelled() || lease.lost().is_cancelled() {
            return None;
        }
        let txn = super::writes::register(keys, &record, lease.id()).into_txn();
        let mut c = store.client();
        match store.timed("register worker", c.txn(txn)).await {
            Ok(r) if r.succeeded() => return r.header().map(|h| h.revision()),
            Ok(_) => {
                if !told {
                    told = true;
                    tracing::info!(worker = %config.worker_id, "an earlier incarnation's key is still there; waiting for it to go");
                }
            }
            Err(e) => {
                tracing::warn!(worker = %config.worker_id, error = %e, "cannot register; retrying")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = stop.cancelled() => return None,
            _ = lease.lost().cancelled() => return None,
        }
    }
}

/// What a worker's record says about taking assignments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Marks {
    pub(super) draining: bool,
    /// Why it cannot start guards (see [`super::guards`]).
    pub(super) unable: Option<String>,
}

/// Sets incarnation `rev`'s `draining` and `unable` marks (bounded; false if it could not tell
/// that they landed). While either is set, the leader assigns it nothing: the assign
/// transaction compares the key's mod revision, so an assignment racing the change fails.
pub(super) async fn set_marks(
    store: &Store,
    keys: &Keys,
    config: &WorkerConfig,
    rev: i64,
    marks: &Marks,
) -> bool {
    let key = keys.worker(&config.worker_id);
    let mut c = store.client();
    let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), c.get(key.clone(), None)).await
    else {
        return false;
    };
    let Some(kv) = resp.kvs().first() else {
        return false;
    };
    let Ok(mut record) = codec::decode::<WorkerRecord>(kv.key(), kv.value(), WORKER_VERSION) else {
        return false;
    };
    if record.draining == marks.draining && record.unable == marks.unable {
        return kv.create_revision() == rev;
    }
    record.draining = marks.draining;
    record.unable = marks.unable.clone();
    let txn = Txn::new()
        .when([Compare::mod_revision(
            key.clone(),
            CompareOp::Equal,
            kv.mod_revision(),
        )])
        .and_then([TxnOp::put(
            key.clone(),
            codec::encode(&record),
            Some(PutOptions::new().with_ignore_lease()),
        )]);
    kv.create_revision() == rev
        && matches!(
            tokio::time::timeout(Duration::from_secs(2), c.txn(txn)).await,
            Ok(Ok(r)) if r.succeeded()
        )
}

/// Revokes a lost incarnation's lease once etcd answers (its key, if still there, goes with
/// it), so the next registration does not wait a TTL.
pub(super) async fn revoke_until_gone(store: &Store, lease: &Lease, stop: &CancellationToken) {
    lease.stop();
    let mut pause = crate::retry::policies::WORKER_REPORT.backoff();
    loop {
        let mut c = store.client();
        match store
            .timed("lease revoke", c.lease_revoke(lease.id()))
            .await
        {
            Ok(_) => return,
            Err(e) if e.is_lease_not_found() => return,
            Err(e) => {
                tracing::debug!(lease = lease.id(), error = %e, "cannot revoke the lost lease yet")
            }
        }
        tokio::select! {
            _ = pause.pause() => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// At start the worker runs nothing: folders of jobs that no longer exist go (their results
/// are clean), in the buckets and, left by an older release, at the root. Folders of live jobs
/// stay: on a shared scratch folder, another worker may run them.
pub(super) async fn sweep(store: &Store, keys: &Keys, config: &WorkerConfig) {
    let root = record::jobs_root(&config.storage_dir);
    let Ok(entries) = std::fs::read_dir(&root) else {
        return;
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_str().is_some_and(record::is_bucket) {
            if let Ok(inner) = std::fs::read_dir(entry.path()) {
                found.extend(inner.flatten());
            }
        } else {
            found.push(entry);
        }
    }
    let mut removed = 0;
    for entry in found {
        let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if id.contains("~removing-") {
            // A removal cut short.
            if std::fs::remove_dir_all(entry.path()).is_ok() {
                removed += 1;
            }
            continue;
        }
        if crate::jobs::spec::validate_id(&id).is_err() {
            continue;
        }
        let mut c = store.client();
        let get = c.get(
            keys.job(&id).spec,
            Some(GetOptions::new().with_count_only()),
        );
        match store.timed("sweep", get).await {
            Ok(r) if r.count() == 0 => {
                if std::fs::remove_dir_all(entry.path()).is_ok() {
                    removed += 1;
                }
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
    if removed > 0 {
        tracing::info!(worker = %config.worker_id, folders = removed, "removed folders of finished jobs");
    }
}
