//! `grpc.health.v1` for probes, with two meanings:
//! - service [`LIVENESS`]: SERVING for as long as the process answers at all, a drain included,
//!   so an orchestrator never kills a process that is handing over;
//! - service `""` and each `baton.v1` service (readiness): SERVING while the process reaches etcd
//!   (a linearizable read, probed every second, answered within the last 3 s) and is not
//!   shutting down. A follower is ready: it serves reads and submissions. A process cut off
//!   from etcd turns NOT_SERVING about 5 s later (3 s without an answer, plus a probe's 2 s
//!   bound) and SERVING again at the first answer; after SIGTERM it stays NOT_SERVING.
//!
//! The same two answers are served over plain HTTP as `/livez` and `/readyz` on
//! `--metrics-listen` (see [`Ready`]), for probes that cannot speak gRPC over TLS (kubelet's).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::store::Store;

/// The health service name a liveness probe asks for.
pub const LIVENESS: &str = "liveness";

const PROBE_EVERY: Duration = Duration::from_secs(1);
/// Bound on one probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Not ready once no probe has been answered for this long.
const UNREADY_AFTER: Duration = Duration::from_secs(3);

/// Readiness as the gRPC health service reports it, readable by the HTTP `/readyz`: false until
/// the API serves, then it follows every change of the `""` service's status.
#[derive(Clone, Debug, Default)]
pub struct Ready(Arc<AtomicBool>);

impl Ready {
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
    }
}

/// Starts reporting: liveness at once, readiness (`""` and `services`, and `ready`) from etcd
/// probes until `draining` fires, then NOT_SERVING for good.
pub async fn report(
    health: HealthReporter,
    store: Store,
    probe_key: String,
    services: Vec<&'static str>,
    ready: Ready,
    draining: CancellationToken,
) {
    health
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    let readiness = Readiness {
        health,
        services,
        ready,
    };
    // The caller reached etcd just before serving.
    readiness.set(ServingStatus::Serving).await;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ready = true;
        let mut last_answer = Instant::now();
        loop {
            let reached = tokio::select! {
                _ = draining.cancelled() => break,
                _ = tick.tick() => tokio::select! {
                    _ = draining.cancelled() => break,
                    r = reachable(&store, &probe_key) => r,
                },
            };
            if reached {
                last_answer = Instant::now();
            }
            // One answer proves reach; only a run of failures lasting UNREADY_AFTER disproves
            // it, so a member without a leader answering some probes does not flap readiness.
            let now_ready = reached || last_answer.elapsed() < UNREADY_AFTER;
            if now_ready != ready {
                if now_ready {
                    tracing::info!("etcd answers again: ready");
                    readiness.set(ServingStatus::Serving).await;
                } else {
                    tracing::warn!(since = ?last_answer.elapsed(), "etcd has not answered: not ready");
                    readiness.set(ServingStatus::NotServing).await;
                }
                ready = now_ready;
            }
        }
        readiness.set(ServingStatus::NotServing).await;
    });
}

struct Readiness {
    health: HealthReporter,
    services: Vec<&'static str>,
    ready: Ready,
}

impl Readiness {
    async fn set(&self, status: ServingStatus) {
        self.ready.set(status == ServingStatus::Serving);
        self.health.set_service_status("", status).await;
        for s in &self.services {
            self.health.set_service_status(*s, status).await;
        }
    }
}

async fn reachable(store: &Store, key: &str) -> bool {
    let mut c = store.client();
    let probe = c.get(key, Some(etcd_client::GetOptions::new().with_count_only()));
    let answered = tokio::time::timeout(PROBE_TIMEOUT, store.timed("health probe", probe)).await;
    matches!(answered, Ok(Ok(_)))
}
