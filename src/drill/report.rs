//! The drill report: a row per round, failover figures per fault kind, and a verdict per
//! invariant. Human-readable, or JSON with `--json`.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use super::Verdict;

#[derive(Clone, Debug, Serialize)]
pub struct Round {
    pub round: usize,
    pub fault: String,
    pub old_leader: String,
    pub new_leader: String,
    /// From the fault until a replica names a new leader (leader faults only).
    pub no_leader_ms: Option<u64>,
    /// From the fault until the new leader answers as leader.
    pub serving_ms: Option<u64>,
    /// From the fault until the new term started its first job execution.
    pub jobs_running_again_ms: Option<u64>,
    /// Executions the new term restarted after the fault cut them off.
    pub restarted: usize,
    /// Dirty results at the moment of the fault, which the next leader resumed.
    pub cleanups_resumed: i64,
    /// The processes (replica or worker ids; `*`: all) whose executions this fault may cut.
    pub faulted: Vec<String>,
    /// When the fault was injected (CLOCK_BOOTTIME ns).
    pub at_ns: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub seed: u64,
    pub faults: usize,
    pub rounds: Vec<Round>,
    pub submitted: usize,
    pub submit_failures: usize,
    pub invariants: Vec<Verdict>,
    pub dir: String,
    /// Stopped by SIGINT/SIGTERM: the report covers what ran until then.
    pub interrupted: bool,
}

fn ms(v: Option<u64>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

pub fn round_line(r: &Round) -> String {
    format!(
        "{:>5}  {:<16} {:<4} -> {:<4} {:>10} {:>10} {:>12} {:>9} {:>9}",
        r.round,
        r.fault,
        r.old_leader,
        r.new_leader,
        ms(r.no_leader_ms),
        ms(r.serving_ms),
        ms(r.jobs_running_again_ms),
        r.restarted,
        r.cleanups_resumed
    )
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

impl Report {
    pub fn new(
        seed: u64,
        rounds: Vec<Round>,
        submitted: &super::workload::Submitted,
        invariants: Vec<Verdict>,
        dir: String,
    ) -> Report {
        Report {
            seed,
            faults: rounds.len(),
            rounds,
            submitted: submitted.acked.len(),
            submit_failures: submitted.failures.len(),
            invariants,
            dir,
            interrupted: false,
        }
    }

    /// Prints the report (JSON or text); returns whether every checked invariant holds.
    pub fn print(&self, json: bool) -> bool {
        if json {
            println!(
                "{}",
                serde_json::to_string_pretty(self).expect("a report serializes")
            );
        } else {
            print!("{}", self.human());
        }
        self.passed()
    }

    pub fn passed(&self) -> bool {
        self.invariants.iter().all(|v| v.passed)
    }

    pub fn human(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "Baton failover drill (seed {}, {} faults, {} jobs submitted){}\n",
            self.seed,
            self.faults,
            self.submitted,
            if self.interrupted {
                ", INTERRUPTED: the checks cover what ran until the signal"
            } else {
                ""
            }
        );
        let _ = writeln!(
            s,
            "round  fault            leader        no-leader    serving  jobs-again  restarted  cleanups\n{}",
            "-".repeat(95)
        );
        for r in &self.rounds {
            let _ = writeln!(s, "{}", round_line(r));
        }
        let _ = writeln!(s, "(times in ms from the fault)\n");
        let mut by: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for r in &self.rounds {
            if let Some(v) = r.serving_ms {
                by.entry(&r.fault).or_default().push(v);
            }
        }
        if !by.is_empty() {
            let _ = writeln!(s, "time until the new leader serves, per fault kind:");
            for (k, mut v) in by {
                v.sort();
                let _ = writeln!(
                    s,
                    "  {k:<13} n={:<3} p50 {:>6} ms  p99 {:>6} ms  max {:>6} ms",
                    v.len(),
                    percentile(&v, 0.5),
                    percentile(&v, 0.99),
                    v.last().copied().unwrap_or(0)
                );
            }
            let _ = writeln!(s);
        }
        for v in &self.invariants {
            let _ = writeln!(
                s,
                "[{}] {}. {}",
                if !v.checked {
                    "NOT CHECKED"
                } else if v.passed {
                    "PASS"
                } else {
                    "FAIL"
                },
                v.invariant.number,
                v.invariant.name
            );
            for e in &v.evidence {
                let _ = writeln!(s, "       {e}");
            }
        }
        let _ = writeln!(
            s,
            "\n{}",
            match (self.passed(), self.interrupted) {
                (true, false) => "all invariants hold",
                (true, true) => "all invariants hold (interrupted)",
                (false, _) => "INVARIANTS VIOLATED",
            }
        );
        s
    }
}
