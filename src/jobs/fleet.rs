//! The fleet as any replica reads it from etcd: live worker incarnations, what each holds, and
//! operators' drain requests; and the requests themselves. Needs no leader.
//!
//! A drain request (`drains/<id>`) is only a wish: the worker acts on it and marks its own
//! record `draining` (its writes stay fenced by its own key), so the leader assigns it nothing
//! more. The request outlives the worker's restarts until `undrain`, as `kubectl cordon` does.

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};

use super::spec::{self, JobSpec};
use super::work::{DrainRequest, WorkerRecord, DRAIN_VERSION, WORKER_VERSION};
use super::{records, Error};
use crate::store::{codec, Keys, Store};

/// One live worker incarnation.
#[derive(Clone, Debug)]
pub struct LiveWorker {
    pub record: WorkerRecord,
    /// The create revision of its key.
    pub incarnation: i64,
    /// Job and cleanup assignments it holds.
    pub running: u32,
    pub cleanups: u32,
    pub drain_requested: bool,
}

impl LiveWorker {
    pub fn free(&self) -> u32 {
        self.record.capacity.saturating_sub(self.running)
    }
}

/// Every live worker, read at one revision.
#[derive(Clone, Debug, Default)]
pub struct FleetView {
    pub revision: i64,
    pub workers: Vec<LiveWorker>,
}

/// Reads the fleet: the worker keys, then at that revision what each incarnation holds.
pub async fn read(store: &Store, keys: &Keys) -> Result<FleetView, Error> {
    let mut c = store.client();
    let resp = store
        .timed(
            "list workers",
            c.get(keys.workers(), Some(GetOptions::new().with_prefix())),
        )
        .await?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let pinned = || GetOptions::new().with_revision(revision);
    let drains = store
        .timed(
            "list drains",
            c.get(keys.drains(), Some(pinned().with_prefix().with_keys_only())),
        )
        .await?;
    let drained: Vec<String> = drains
        .kvs()
        .iter()
        .filter_map(|kv| Keys::id_in(&keys.drains(), kv.key()).map(str::to_owned))
        .collect();
    let mut workers = Vec::new();
    for kv in resp.kvs() {
        let record: WorkerRecord = match codec::decode(kv.key(), kv.value(), WORKER_VERSION) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "skipping an unreadable worker record");
                continue;
            }
        };
        let incarnation = kv.create_revision();
        let prefix = keys.assignments_of(&record.worker_id, incarnation);
        let count = |p: String| {
            let mut c = store.client();
            async move {
                store
                    .timed(
                        "count assignments",
                        c.get(p, Some(pinned().with_prefix().with_count_only())),
                    )
                    .await
                    .map(|r| r.count() as u32)
            }
        };
        let all = count(prefix.clone()).await?;
        let cleanups = count(format!("{prefix}cleanup/")).await?;
        workers.push(LiveWorker {
            drain_requested: drained.contains(&record.worker_id),
            record,
            incarnation,
            running: all.saturating_sub(cleanups),
            cleanups,
        });
    }
    Ok(FleetView { revision, workers })
}

impl FleetView {
    pub fn get(&self, id: &str) -> Option<&LiveWorker> {
        self.workers.iter().find(|w| w.record.worker_id == id)
    }

    /// Why a due PENDING job with this spec does not start, as far as the fleet tells.
    pub fn waiting_reason(&self, spec: Option<&JobSpec>) -> String {
        if self.workers.is_empty() {
            return "no live worker: the job starts when a worker registers".into();
        }
        let matching: Vec<&LiveWorker> = self
            .workers
            .iter()
            .filter(|w| spec.is_none_or(|s| s.selects(&w.record.labels)))
            .collect();
        if matching.is_empty() {
            let sel = spec.map(|s| spec::show_labels(&s.worker_selector));
            return format!(
                "no live worker matches {}: the job starts when one registers",
                sel.unwrap_or_default()
            );
        }
        let open: Vec<&&LiveWorker> = matching.iter().filter(|w| w.record.takes_work()).collect();
        if open.is_empty() {
            if let Some(why) = matching.iter().find_map(|w| w.record.unable.as_ref()) {
                return format!(
                    "unable: no live worker that can run the job takes work (one says: {why})"
                );
            }
            return "draining: every live worker that can run the job is draining".into();
        }
        let free: u32 = open.iter().map(|w| w.free()).sum();
        let total: u32 = open.iter().map(|w| w.record.capacity).sum();
        if free == 0 {
            return format!(
                "no worker with free capacity: 0 of {total} free on {} worker(s)",
                open.len()
            );
        }
        format!(
            "start rate limit: {free} of {total} slots free; jobs start in submission order \
             within --max-starts-per-second"
        )
    }
}

/// Asks worker `id` to drain. NotFound-like [`Error::NoWorker`] if it is not live.
pub async fn drain(store: &Store, keys: &Keys, id: &str, via: &str) -> Result<(), Error> {
    valid_worker_id(id)?;
    let request = DrainRequest {
        version: DRAIN_VERSION,
        requested_at_ms: records::now_ms(),
        via: via.to_string(),
    };
    let txn = Txn::new()
        .when([Compare::version(keys.worker(id), CompareOp::Greater, 0)])
        .and_then([TxnOp::put(keys.drain(id), codec::encode(&request), None)]);
    let mut c = store.client();
    let resp = store.timed("drain worker", c.txn(txn)).await?;
    if !resp.succeeded() {
        return Err(Error::NoWorker(id.to_string()));
    }
    Ok(())
}

/// Withdraws a drain request for `id` (live or not). Idempotent.
pub async fn undrain(store: &Store, keys: &Keys, id: &str) -> Result<(), Error> {
    valid_worker_id(id)?;
    let mut c = store.client();
    store
        .timed("undrain worker", c.delete(keys.drain(id), None))
        .await?;
    Ok(())
}

fn valid_worker_id(id: &str) -> Result<(), Error> {
    if spec::is_label(id) {
        Ok(())
    } else {
        Err(spec::Invalid {
            field: "worker_id",
            reason: "must be 1 to 128 characters of [A-Za-z0-9._-]".into(),
        }
        .into())
    }
}
