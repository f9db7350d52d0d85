//! The Prometheus metrics of this process (a replica, a worker, or a replica with its embedded
//! worker): one registry, encoded by the `prometheus` crate in the text exposition format and
//! served at `/metrics` on `--metrics-listen`.
//!
//! Counters and histograms are updated where things happen. Gauges that describe a moment are
//! set by their owners (the leader's actor and cleaner, the role channel) or, when they change
//! continuously (seconds since a keepalive was answered), computed at scrape time by probes
//! their owners registered. This module imports nothing else of Baton, so any module may report
//! to it.

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Why a job's execution started again.
#[derive(Clone, Copy, Debug)]
pub enum Restart {
    /// Its worker died or could not prove its lease (`BATON_RECOVERED=1`).
    WorkerLost,
    /// The attempt failed and the job has attempts left.
    FailedAttempt,
    /// A worker's drain stopped it (`preempted`).
    Preempted,
}

impl Restart {
    fn label(self) -> &'static str {
        match self {
            Restart::WorkerLost => "worker_lost",
            Restart::FailedAttempt => "failed_attempt",
            Restart::Preempted => "preempted",
        }
    }
}

/// The `state` labels of `baton_jobs` and `baton_workers`.
pub const JOB_STATES: [&str; 2] = ["pending", "running"];
pub const WORKER_STATES: [&str; 2] = ["live", "draining"];

/// What a lease probe reads at scrape time.
#[derive(Clone, Copy, Debug)]
pub struct LeaseReading {
    /// Since the last answered keepalive was sent.
    pub since_answer: Duration,
    /// Seconds before its owner stops acting without another answer (negative: overdue).
    pub margin_left: f64,
}

type Probe = Box<dyn Fn(&Metrics) + Send + Sync>;

pub struct Metrics {
    registry: Registry,
    pub is_leader: IntGauge,
    pub term: IntGauge,
    pub leader_changes: IntCounter,
    keepalive_age: GaugeVec,
    lease_margin: GaugeVec,
    /// Registry entries by state, as the leader's actor knows them (0 on followers).
    pub jobs: IntGaugeVec,
    pub worker_running: IntGaugeVec,
    pub worker_capacity: IntGaugeVec,
    /// Live workers, and how many of them drain, as the leader sees them (0 on followers).
    pub workers: IntGaugeVec,
    pub cleanups_pending: IntGauge,
    pub cleanups_needing_operator: IntGauge,
    pub cleanup_failures: IntCounter,
    /// Registry entries found beside a result and removed.
    pub stray_registry_entries: IntCounter,
    pub corrupt_values: IntCounter,
    pub submit_seconds: Histogram,
    etcd_seconds: HistogramVec,
    batch_writes: HistogramVec,
    restarts: IntCounterVec,
    /// Schedule ticks decided by this replica as leader, by outcome.
    pub schedule_ticks: IntCounterVec,
    /// From a tick's scheduled time to its job's creation.
    pub schedule_lag_seconds: Histogram,
    pub schedule_clock_skews: IntCounter,
    /// Fast failover, as a follower: leases revoked on evidence, and suspicions that ended
    /// without evidence, by reason.
    pub fast_failover_revokes: IntCounter,
    pub fast_failover_inconclusive: IntCounterVec,
    /// Fast failover: false alarms this replica, as a revoked live leader, recorded; and
    /// revokes this replica, as a follower, held back because one was recorded.
    pub fast_failover_false_alarms: IntCounter,
    pub fast_failover_held_back: IntCounter,
    probes: Mutex<BTreeMap<String, Probe>>,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// This process's metrics.
pub fn get() -> &'static Metrics {
    &METRICS
}

impl Metrics {
    fn new() -> Metrics {
        let registry = Registry::new();
        let reg = |c: Box<dyn prometheus::core::Collector>| {
            registry
                .register(c)
                .expect("metric names are unique and valid")
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            reg(Box::new(g.clone()));
            g
        };
        let gauges = |name: &str, help: &str, label: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &[label]).expect("valid metric");
            reg(Box::new(g.clone()));
            g
        };
        let fgauges = |name: &str, help: &str| {
            let g = GaugeVec::new(Opts::new(name, help), &["lease"]).expect("valid metric");
            reg(Box::new(g.clone()));
            g
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            reg(Box::new(c.clone()));
            c
        };
        let submit_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "baton_submit_duration_seconds",
                "Time to answer SubmitJob on this replica, etcd included.",
            )
            .buckets(latency_buckets()),
        )
        .expect("valid metric");
        reg(Box::new(submit_seconds.clone()));
        let etcd_seconds = HistogramVec::new(
            HistogramOpts::new(
                "baton_etcd_request_duration_seconds",
                "Time of single etcd requests, by operation; timeouts included.",
            )
            .buckets(latency_buckets()),
            &["op"],
        )
        .expect("valid metric");
        reg(Box::new(etcd_seconds.clone()));
        let batch_writes = HistogramVec::new(
            HistogramOpts::new(
                "baton_etcd_batch_writes",
                "Writes committed together in one etcd transaction (group commit), by committer.",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
            &["op"],
        )
        .expect("valid metric");
        reg(Box::new(batch_writes.clone()));
        let restarts = IntCounterVec::new(
            Opts::new(
                "baton_job_restarts_total",
                "Executions started again by this replica as leader, by cause.",
            ),
            &["cause"],
        )
        .expect("valid metric");
        reg(Box::new(restarts.clone()));
        for cause in [
            Restart::WorkerLost,
            Restart::FailedAttempt,
            Restart::Preempted,
        ] {
            restarts.with_label_values(&[cause.label()]);
        }
        let schedule_ticks = IntCounterVec::new(
            Opts::new(
                "baton_schedule_ticks_total",
                "Schedule ticks decided by this replica as leader, by outcome (fired, skipped, missed, superseded, paused, conflict, clock-skew).",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        reg(Box::new(schedule_ticks.clone()));
        let fast_failover_inconclusive = IntCounterVec::new(
            Opts::new(
                "baton_fast_failover_inconclusive_total",
                "Ends of this follower's stream to the leader that gave no evidence the leader's process is gone, by reason (the lease then expires as usual).",
            ),
            &["reason"],
        )
        .expect("valid metric");
        reg(Box::new(fast_failover_inconclusive.clone()));
        let schedule_lag_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "baton_schedule_tick_lag_seconds",
                "From a tick's scheduled time to the creation of its job.",
            )
            .buckets(latency_buckets()),
        )
        .expect("valid metric");
        reg(Box::new(schedule_lag_seconds.clone()));
        let m = Metrics {
            is_leader: gauge("baton_is_leader", "1 while this replica leads, else 0."),
            term: gauge(
                "baton_term",
                "The current leader's term (its election key's create revision) as this replica last saw it.",
            ),
            schedule_ticks,
            schedule_lag_seconds,
            schedule_clock_skews: counter(
                "baton_schedule_clock_skews_total",
                "Schedules whose watermark this replica, as a new leader, found over a minute ahead of its clock.",
            ),
            fast_failover_revokes: counter(
                "baton_fast_failover_revokes_total",
                "Leader leases this follower revoked on evidence that the leader's process is gone.",
            ),
            fast_failover_inconclusive,
            fast_failover_false_alarms: counter(
                "baton_fast_failover_false_alarms_total",
                "Times this replica, leading and alive, saw its election key revoked and recorded a false alarm (fast failover then waits 10 minutes).",
            ),
            fast_failover_held_back: counter(
                "baton_fast_failover_held_back_total",
                "Revokes on evidence this follower did not make because a false alarm is recorded.",
            ),
            leader_changes: counter(
                "baton_leader_changes_total",
                "Changes of the leader this replica has seen since it started.",
            ),
            keepalive_age: fgauges(
                "baton_lease_keepalive_age_seconds",
                "Seconds since the last answered keepalive of this process's lease was sent.",
            ),
            lease_margin: fgauges(
                "baton_lease_margin_left_seconds",
                "Seconds before the lease's owner stops acting unless a keepalive is answered.",
            ),
            jobs: gauges(
                "baton_jobs",
                "Jobs in the RunningJobRegistry by state, as the leader knows them (0 elsewhere).",
                "state",
            ),
            worker_running: gauges(
                "baton_worker_running_executions",
                "Jobs this worker runs now.",
                "worker",
            ),
            worker_capacity: gauges(
                "baton_worker_capacity",
                "Jobs this worker runs at most (--max-running).",
                "worker",
            ),
            workers: gauges(
                "baton_workers",
                "Live workers as the leader sees them (0 elsewhere); state=draining counts those that drain.",
                "state",
            ),
            cleanups_pending: gauge(
                "baton_cleanups_pending",
                "Dirty results not clean yet, as the leader knows them: being cleaned, waiting for a retry, or needing an operator (0 elsewhere).",
            ),
            cleanups_needing_operator: gauge(
                "baton_cleanups_needing_operator",
                "Dirty results whose cleanup exhausted its attempts (baton job cleanup ID --now).",
            ),
            cleanup_failures: counter(
                "baton_cleanup_failures_total",
                "Cleanup steps and stages that failed on this replica as leader.",
            ),
            stray_registry_entries: counter(
                "baton_stray_registry_entries_total",
                "Registry entries found beside a recorded result and removed with their assignment (the result is the last word).",
            ),
            corrupt_values: counter(
                "baton_corrupt_values_total",
                "Stored values this process found corrupt or of an unknown version (kept, never used).",
            ),
            submit_seconds,
            etcd_seconds,
            batch_writes,
            restarts,
            probes: Mutex::new(BTreeMap::new()),
            registry,
        };
        m.clear_registry_gauges();
        m.clear_cleanup_gauges();
        m
    }

    /// Counts one etcd request of `op` that took `took`.
    pub fn etcd_request(&self, op: &str, took: Duration) {
        self.etcd_seconds
            .with_label_values(&[op])
            .observe(took.as_secs_f64());
    }

    /// One group-commit transaction of `op` carried `writes` writes.
    pub fn group_commit(&self, op: &str, writes: usize) {
        self.batch_writes
            .with_label_values(&[op])
            .observe(writes as f64);
    }

    pub fn restarted(&self, cause: Restart) {
        self.restarts.with_label_values(&[cause.label()]).inc();
    }

    /// Sets the job actor's gauges back to 0 (its term ended).
    pub fn clear_registry_gauges(&self) {
        for state in JOB_STATES {
            self.jobs.with_label_values(&[state]).set(0);
        }
        for state in WORKER_STATES {
            self.workers.with_label_values(&[state]).set(0);
        }
    }

    /// Sets the cleaner's gauges back to 0 (its term ended).
    pub fn clear_cleanup_gauges(&self) {
        self.cleanups_pending.set(0);
        self.cleanups_needing_operator.set(0);
    }

    /// Runs `probe` before every scrape, in place of any earlier probe under `key`.
    pub fn on_scrape(
        &self,
        key: impl Into<String>,
        probe: impl Fn(&Metrics) + Send + Sync + 'static,
    ) {
        self.probes
            .lock()
            .expect("probes lock")
            .insert(key.into(), Box::new(probe));
    }

    /// Reports a lease (`election` or `worker`) from a reading taken at scrape time.
    pub fn track_lease(
        &self,
        kind: &'static str,
        read: impl Fn() -> LeaseReading + Send + Sync + 'static,
    ) {
        self.on_scrape(format!("lease/{kind}"), move |m| {
            let r = read();
            m.keepalive_age
                .with_label_values(&[kind])
                .set(r.since_answer.as_secs_f64());
            m.lease_margin.with_label_values(&[kind]).set(r.margin_left);
        });
    }

    /// The text exposition of every metric, probes run first.
    pub fn render(&self) -> String {
        for probe in self.probes.lock().expect("probes lock").values() {
            probe(self);
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("encoding into memory does not fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn latency_buckets() -> Vec<f64> {
    vec![
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_with_help() {
        let m = get();
        m.restarted(Restart::WorkerLost);
        m.track_lease("election", || LeaseReading {
            since_answer: Duration::from_millis(1500),
            margin_left: 2.25,
        });
        let text = m.render();
        assert!(text.contains("# TYPE baton_is_leader gauge"), "{text}");
        assert!(
            text.contains("baton_job_restarts_total{cause=\"worker_lost\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("baton_job_restarts_total{cause=\"failed_attempt\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("baton_lease_keepalive_age_seconds{lease=\"election\"} 1.5"),
            "{text}"
        );
        assert!(
            text.contains("baton_lease_margin_left_seconds{lease=\"election\"} 2.25"),
            "{text}"
        );
    }
}
