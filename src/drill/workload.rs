//! The drill's workload: a steady stream of submissions of short and long tasks, a share with
//! cleanup commands and a share whose cleanup fails twice first. Every submission is retried
//! across replicas with the same id, so "acknowledged" means the cluster has it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::{DrillArgs, Rng};
use crate::config::ClientArgs;
use crate::proto::job_service_client::JobServiceClient;
use crate::proto::{JobSpec, SubmitJobRequest};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    Short,
    Long,
    Longer,
    Cleanup,
    FlakyCleanup,
}

#[derive(Clone, Debug, Default)]
pub struct Submitted {
    pub acked: Vec<(String, Kind)>,
    /// Submissions that failed even after retrying every replica: (id, error, unix ms).
    pub failures: Vec<(String, String, u64)>,
}

pub struct Workload {
    done: tokio::task::JoinHandle<()>,
    stop: CancellationToken,
    out: Arc<Mutex<Submitted>>,
}

impl Workload {
    /// Waits until every planned submission was made (or failed), and returns them.
    pub async fn finish(self) -> Submitted {
        let _stop_on_drop = self.stop.drop_guard();
        let _ = self.done.await;
        self.out.lock().expect("workload lock").clone()
    }

    /// Stops submitting now, waits for the submissions in flight, and returns them all.
    pub async fn stop(self) -> Submitted {
        self.stop.cancel();
        self.finish().await
    }

    /// Reads (acknowledged, failed) so far.
    pub fn counts(&self) -> impl Fn() -> (usize, usize) + Send + 'static {
        let out = self.out.clone();
        move || {
            let o = out.lock().expect("workload lock");
            (o.acked.len(), o.failures.len())
        }
    }
}

fn spec(kind: Kind) -> JobSpec {
    let sh = |s: &str| vec!["sh".to_string(), "-c".to_string(), s.to_string()];
    let mut spec = JobSpec {
        command: match kind {
            Kind::Long => sh("sleep 4"),
            // Outlives a paused worker's key plus the TTL and margin the leader waits after it.
            Kind::Longer => sh("sleep 12"),
            _ => sh("sleep 0.2"),
        },
        max_attempts: 3,
        ..Default::default()
    };
    match kind {
        Kind::Cleanup => spec.cleanup_command = sh("sleep 0.1"),
        Kind::FlakyCleanup => {
            spec.cleanup_command = sh(
                // The job folder outlives failed stage-1 attempts (stage 2 removes it).
                "f=$BATON_JOB_DIR/cleanups; n=$(cat $f 2>/dev/null || echo 0); \
                 n=$((n+1)); echo $n > $f; [ $n -ge 3 ]",
            )
        }
        _ => {}
    }
    spec
}

/// Starts submitting; `stop` (a signal, say) ends the submissions early.
pub fn start(client: ClientArgs, args: &DrillArgs, seed: u64, stop: CancellationToken) -> Workload {
    let out = Arc::new(Mutex::new(Submitted::default()));
    let client = ClientArgs {
        timeout: Duration::from_secs(30),
        ..client
    };
    let (n, rate) = (args.jobs, args.rate.max(0.1));
    let all_long = args.negative_control;
    let (stop2, out2) = (stop.clone(), out.clone());
    let done = tokio::spawn(async move {
        let mut rng = Rng::new(seed ^ 0x9e37_79b9_7f4a_7c15);
        let inflight = Arc::new(Semaphore::new(32));
        let mut tasks = tokio::task::JoinSet::new();
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        for i in 0..n {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop2.cancelled() => break,
            }
            let kind = match rng.below(10) {
                // The negative control needs executions long enough for a pause to cut.
                _ if all_long => Kind::Longer,
                0..=3 => Kind::Short,
                4..=5 => Kind::Long,
                6..=7 => Kind::Cleanup,
                _ => Kind::FlakyCleanup,
            };
            let id = format!("drill-{:04}-{i:05}", seed % 10_000);
            let spec = spec(kind);
            let (client, out, permit) = (
                client.clone(),
                out2.clone(),
                inflight.clone().acquire_owned().await,
            );
            tasks.spawn(async move {
                let _permit = permit;
                let r = crate::cli::call_any(&client, |ch| {
                    let req = SubmitJobRequest {
                        job_id: id.clone(),
                        spec: Some(spec.clone()),
                    };
                    async move { JobServiceClient::new(ch).submit_job(req).await.map(|_| ()) }
                })
                .await;
                let mut o = out.lock().expect("workload lock");
                match r {
                    Ok(()) => o.acked.push((id, kind)),
                    Err(e) => {
                        o.failures
                            .push((id, format!("{e:#}"), crate::jobs::records::now_ms()))
                    }
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    });
    Workload { done, stop, out }
}
