//! The worker: runs the jobs the leader assigns to it, under a lease of its own, so that a
//! leader change stops no job.
//!
//! Guarantees:
//! - **One incarnation at a time.** The worker registers `workers/<id>` put-if-absent on a fresh
//!   lease; its create revision names the incarnation. A worker restarted under the same id
//!   waits until the old key is gone.
//! - **Fenced writes.** Accepting an assignment (`started`, written before the job may exec)
//!   compares this incarnation's key and the assignment; reporting how it ended (`exited`,
//!   `lost`, `preempted`) compares only the assignment, so an exit that happened during a short
//!   etcd outage still lands once etcd is back, unless the leader has moved on.
//! - **Stop before the lease can expire.** Every job runs under a guard fed the lease's proven
//!   deadline; when the lease can no longer be proven, the key vanishes, or the main loop hangs
//!   (the lease's watchdog), every job is killed, recorded `lost`, the old lease revoked once
//!   etcd answers, and the worker registers afresh with no jobs.
//! - **Shutdown preempts.** On stop, jobs are killed and recorded `preempted` (rescheduled at
//!   once, not counted against the job) before the lease is revoked.
//!
//! The worker reaches the coordinator only through etcd keys (see [`crate::jobs::work`]).

mod attempt;
pub mod descriptors;
pub mod folders;
pub mod guards;
mod incarnation;
mod logs;
mod registration;
pub mod writes;

pub use logs::{WorkerLogs, READ_MAX};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::election::Lease;
use crate::exec::spawner::GuardSettings;
use crate::store::{Keys, Store};

#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub worker_id: String,
    pub advertise: String,
    /// Jobs running at once.
    pub capacity: usize,
    /// Cleanup commands running at once, besides the jobs.
    pub max_cleanups: usize,
    pub labels: BTreeMap<String, String>,
    /// Local scratch: `<storage>/jobs/<job>` per job.
    pub storage_dir: PathBuf,
    /// How guards run; its margin is this worker's lease margin.
    pub guard: GuardSettings,
    pub lease_ttl: Duration,
    pub assign_timeout: Duration,
    /// How long a drain lets running jobs go on before it preempts them.
    pub drain_timeout: Duration,
}

/// Runs the worker until `stop`; then preempts its jobs and revokes its lease.
pub async fn run(store: Store, keys: Keys, config: WorkerConfig, stop: CancellationToken) {
    let mut pause = crate::retry::policies::WORKER_RECONNECT.backoff();
    let guards = guards::GuardHealth::new(config.guard.program.clone());
    while !stop.is_cancelled() {
        let margin = config.guard.margin;
        let lease = tokio::select! {
            l = Lease::grant(&store, config.lease_ttl, margin, &config.worker_id) => l,
            _ = stop.cancelled() => return,
        };
        let lease = match lease {
            Ok(l) => {
                l.report_metrics("worker");
                l
            }
            Err(e) => {
                tracing::warn!(worker = %config.worker_id, error = %e, "cannot grant the worker lease; retrying");
                pause.pause().await;
                continue;
            }
        };
        pause.reset();
        let rev =
            match registration::register(&store, &keys, &config, &lease, guards.unable(), &stop)
                .await
            {
                Some(rev) => rev,
                None => {
                    lease.revoke(&store).await;
                    continue;
                }
            };
        // Its guards are fed only while its own key is there (see the lease's module doc).
        lease.hold_key(keys.worker(&config.worker_id), rev);
        // A new incarnation runs nothing: folders of jobs that are gone, go.
        registration::sweep(&store, &keys, &config).await;
        let span = tracing::info_span!("worker", worker = %config.worker_id, incarnation = rev);
        let end = {
            let _e = span.enter();
            tracing::info!(lease = lease.id(), "worker registered");
            drop(_e);
            tracing::Instrument::instrument(
                incarnation::serve(&store, &keys, &config, &lease, rev, &guards, &stop),
                span.clone(),
            )
            .await
        };
        match end {
            incarnation::End::Stopped => {
                lease.revoke(&store).await;
                tracing::info!(worker = %config.worker_id, "worker stopped");
                return;
            }
            incarnation::End::Lost(reason) => {
                tracing::warn!(worker = %config.worker_id, incarnation = rev, reason, "worker incarnation lost; registering afresh");
                registration::revoke_until_gone(&store, &lease, &stop).await;
            }
        }
    }
}
