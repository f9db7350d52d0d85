//! Where cleanup step commands run, and how many at once: at most `--cleanup-concurrency`
//! over every dirty result, and no more on one worker than its `--max-cleanups`, counted by
//! the term as it assigns them (steps it finds running, from an earlier term, count too).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// A live worker as the cleaner sees it.
pub(super) type LiveWorker = crate::coordinator::fleet::WorkerView;

/// The step commands this term counts as running.
#[derive(Default)]
pub(super) struct Slots {
    limit: usize,
    state: Mutex<Counts>,
    released: Notify,
}

#[derive(Default)]
struct Counts {
    running: usize,
    per_worker: HashMap<(String, i64), usize>,
}

/// One running step command, counted until dropped.
pub(super) struct StepLease {
    slots: Arc<Slots>,
    worker: (String, i64),
}

impl Drop for StepLease {
    fn drop(&mut self) {
        {
            let mut s = self.slots.state.lock().expect("slots lock");
            s.running = s.running.saturating_sub(1);
            if let Some(n) = s.per_worker.get_mut(&self.worker) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    s.per_worker.remove(&self.worker);
                }
            }
        }
        self.slots.released.notify_waiters();
    }
}

impl Slots {
    pub(super) fn new(limit: usize) -> Arc<Slots> {
        Arc::new(Slots {
            limit: limit.max(1),
            ..Slots::default()
        })
    }

    /// A place for one more command on `worker` (at most `capacity` there), if the limits
    /// allow.
    pub(super) fn try_take(
        self: &Arc<Self>,
        worker: &str,
        rev: i64,
        capacity: u32,
    ) -> Option<StepLease> {
        let key = (worker.to_string(), rev);
        let mut s = self.state.lock().expect("slots lock");
        let here = s.per_worker.get(&key).copied().unwrap_or(0);
        if s.running >= self.limit || here >= capacity as usize {
            return None;
        }
        s.running += 1;
        *s.per_worker.entry(key.clone()).or_default() += 1;
        Some(StepLease {
            slots: self.clone(),
            worker: key,
        })
    }

    /// Counts a command already running (found in an entry), whatever the limits say.
    pub(super) fn adopt(self: &Arc<Self>, worker: &str, rev: i64) -> StepLease {
        let key = (worker.to_string(), rev);
        let mut s = self.state.lock().expect("slots lock");
        s.running += 1;
        *s.per_worker.entry(key.clone()).or_default() += 1;
        StepLease {
            slots: self.clone(),
            worker: key,
        }
    }

    /// Whether the overall limit leaves room.
    pub(super) fn has_room(&self) -> bool {
        self.state.lock().expect("slots lock").running < self.limit
    }

    /// Commands counted on a worker incarnation.
    pub(super) fn on(&self, worker: &str, rev: i64) -> usize {
        let s = self.state.lock().expect("slots lock");
        s.per_worker
            .get(&(worker.to_string(), rev))
            .copied()
            .unwrap_or(0)
    }

    /// Resolves when a command's place is given back.
    pub(super) async fn released(&self) {
        self.released.notified().await
    }

    #[cfg(test)]
    fn running(&self) -> usize {
        self.state.lock().expect("slots lock").running
    }
}

/// The workers a step of a job with `selector` may run on, in the order to try them: the one
/// that ran the job first (its folder is there), then the others from a place that moves with
/// each uncounted retry and with the step's position, so concurrent steps spread out.
pub(super) fn candidates<'a>(
    workers: &'a [LiveWorker],
    slots: &Slots,
    selector: &BTreeMap<String, String>,
    own: Option<(&str, i64)>,
    job_id: &str,
    turn: usize,
) -> Vec<&'a LiveWorker> {
    let open: Vec<&LiveWorker> = workers
        .iter()
        .filter(|w| {
            w.record.takes_work()
                && w.record.cleanup_capacity > 0
                && selector
                    .iter()
                    .all(|(k, v)| w.record.labels.get(k) == Some(v))
        })
        .collect();
    if open.is_empty() {
        return open;
    }
    let spread = job_id
        .bytes()
        .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
    let first = open
        .iter()
        .position(|w| own.is_some_and(|(id, rev)| w.record.worker_id == id && w.rev == rev))
        .unwrap_or(spread % open.len());
    let n = open.len();
    let mut out: Vec<&LiveWorker> = (0..n).map(|i| open[(first + turn + i) % n]).collect();
    // A worker with room first, in that order.
    out.sort_by_key(|w| slots.on(&w.record.worker_id, w.rev) >= w.record.cleanup_capacity as usize);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::work::WorkerRecord;

    fn worker(id: &str, cap: u32) -> LiveWorker {
        LiveWorker {
            rev: 1,
            mod_rev: 1,
            lease: 7,
            record: WorkerRecord {
                version: 1,
                worker_id: id.into(),
                advertise: String::new(),
                capacity: 4,
                cleanup_capacity: cap,
                labels: BTreeMap::new(),
                draining: false,
                started_at: String::new(),
                lease_ttl_ms: 2000,
                margin_ms: 500,
                assign_timeout_ms: 10_000,
                started_at_ms: 0,
                unable: None,
            },
        }
    }

    #[test]
    fn leases_count_overall_and_per_worker_until_dropped() {
        let s = Slots::new(3);
        let a = s.try_take("w1", 1, 2).unwrap();
        let b = s.try_take("w1", 1, 2).unwrap();
        assert!(s.try_take("w1", 1, 2).is_none(), "w1 is full");
        let c = s.try_take("w2", 1, 2).unwrap();
        assert!(s.try_take("w2", 1, 2).is_none(), "the overall limit");
        assert_eq!(s.running(), 3);
        drop(a);
        assert!(s.has_room());
        let d = s.adopt("w3", 1);
        assert_eq!(s.running(), 3);
        drop((b, c, d));
        assert_eq!(s.running(), 0);
        assert_eq!(s.on("w1", 1), 0);
    }

    #[test]
    fn the_jobs_own_worker_comes_first_and_full_ones_last() {
        let ws = vec![worker("a", 1), worker("b", 1), worker("c", 0)];
        let s = Slots::new(8);
        let none = BTreeMap::new();
        let order = |own, turn| -> Vec<String> {
            candidates(&ws, &s, &none, own, "job", turn)
                .into_iter()
                .map(|w| w.record.worker_id.clone())
                .collect()
        };
        assert_eq!(order(Some(("b", 1)), 0), ["b", "a"], "c runs no cleanups");
        assert_eq!(order(Some(("b", 1)), 1), ["a", "b"], "a retry moves on");
        let _held = s.try_take("b", 1, 1).unwrap();
        assert_eq!(
            order(Some(("b", 1)), 0),
            ["a", "b"],
            "a full worker goes last"
        );
    }
}
