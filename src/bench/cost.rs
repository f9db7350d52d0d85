//! Part of scenario `e2e`: what one job cost each kind of process in CPU, over the run, from
//! `/proc`. The run is CPU-bound on a small machine, so this says where a faster end-to-end
//! rate has to come from (docs/performance.md, "The lease guard").

use serde::Serialize;

use super::cluster::BenchCluster;
use super::usage::{cpu_ticks_split, machine_ticks, ticks_ms};

/// Milliseconds of CPU per job, from the first submission to the last clean result.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct CpuPerJob {
    /// Every core's busy time, whoever used it (kernel threads and other processes included;
    /// not the hypervisor's steal).
    pub machine_ms: f64,
    /// Time the hypervisor ran something else while a core had work (this VM's drift).
    pub steal_ms: f64,
    /// Every etcd member.
    pub etcd_ms: f64,
    /// The coordinator that led when the run began.
    pub leader_ms: f64,
    /// Leadership moved during the run: the leader's and the others' figures are mixed.
    pub leader_moved: bool,
    /// The other coordinators (the submissions go to one of them).
    pub followers_ms: f64,
    /// The worker processes themselves.
    pub workers_ms: f64,
    /// What the workers' reaped children used: the guards and, under them, the jobs.
    pub guards_and_jobs_ms: f64,
    /// This benchmark: its submitting clients and its watch.
    pub bench_ms: f64,
}

/// The processes of a run and their CPU when the run began.
pub struct Meter {
    etcd: Vec<Mark>,
    leader: Vec<Mark>,
    followers: Vec<Mark>,
    workers: Vec<Mark>,
    bench: Vec<Mark>,
    machine: (u64, u64),
}

/// One process and its (own, children's) ticks at the start.
#[derive(Clone, Copy)]
struct Mark {
    pid: i32,
    own: u64,
    children: u64,
}

impl Mark {
    fn of(pid: i32) -> anyhow::Result<Mark> {
        let (own, children) = cpu_ticks_split(pid)?;
        Ok(Mark { pid, own, children })
    }
}

fn marks(pids: impl IntoIterator<Item = i32>) -> anyhow::Result<Vec<Mark>> {
    pids.into_iter().map(Mark::of).collect()
}

/// The ticks each of `marks` used since it was taken: its own, its children's.
fn spent(marks: &[Mark]) -> anyhow::Result<(u64, u64)> {
    let mut sum = (0, 0);
    for m in marks {
        let (own, children) = cpu_ticks_split(m.pid)?;
        sum.0 += own.saturating_sub(m.own);
        sum.1 += children.saturating_sub(m.children);
    }
    Ok(sum)
}

impl Meter {
    /// Marks every process of `c`, `leader` being the index of the leading replica; `None`
    /// (with a warning) when one cannot be read: the figures are left out, the run goes on.
    pub fn start(c: &BenchCluster, leader: usize) -> Option<Meter> {
        let replicas = |lead: bool| {
            c.replicas
                .iter()
                .enumerate()
                .filter(move |(i, _)| (*i == leader) == lead)
                .map(|(_, r)| r.pid())
        };
        let meter = || -> anyhow::Result<Meter> {
            Ok(Meter {
                etcd: marks(c.etcd.pids())?,
                leader: marks(replicas(true))?,
                followers: marks(replicas(false))?,
                workers: marks(c.workers.iter().map(|w| w.pid()))?,
                bench: marks([std::process::id() as i32])?,
                machine: machine_ticks()?,
            })
        };
        meter()
            .inspect_err(|e| tracing::warn!(error = %e, "CPU per job left out"))
            .ok()
    }

    /// What `jobs` jobs cost per job since [`Meter::start`]; `None` (with a warning) when a
    /// process cannot be read any more. Whether leadership moved is the caller's to say.
    pub fn per_job(&self, jobs: usize) -> Option<CpuPerJob> {
        let per = |ticks: u64| ticks_ms(ticks) / jobs.max(1) as f64;
        let own = |m: &[Mark]| spent(m).map(|(own, _)| per(own));
        let figures = || -> anyhow::Result<CpuPerJob> {
            let (workers, children) = spent(&self.workers)?;
            let (busy, steal) = machine_ticks()?;
            Ok(CpuPerJob {
                machine_ms: per(busy.saturating_sub(self.machine.0)),
                steal_ms: per(steal.saturating_sub(self.machine.1)),
                etcd_ms: own(&self.etcd)?,
                leader_ms: own(&self.leader)?,
                leader_moved: false,
                followers_ms: own(&self.followers)?,
                workers_ms: per(workers),
                guards_and_jobs_ms: per(children),
                bench_ms: own(&self.bench)?,
            })
        };
        figures()
            .inspect_err(|e| tracing::warn!(error = %e, "CPU per job left out"))
            .ok()
    }
}

impl CpuPerJob {
    /// One line of the report: the machine's figure, then each kind's.
    pub fn line(&self) -> String {
        format!(
            "CPU per job {:.2} ms on the machine (steal {:.2}): etcd {:.2}, leader {:.2}{}, other \
             coordinators {:.2}, workers {:.2}, guards and their jobs {:.2}, this benchmark {:.2}",
            self.machine_ms,
            self.steal_ms,
            self.etcd_ms,
            self.leader_ms,
            if self.leader_moved {
                " (leadership moved during the run)"
            } else {
                ""
            },
            self.followers_ms,
            self.workers_ms,
            self.guards_and_jobs_ms,
            self.bench_ms
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_reaped_counts_as_the_parents_children_not_its_own() {
        use nix::sys::wait::{waitid, Id, WaitPidFlag};
        let me = std::process::id() as i32;
        let m = [Mark::of(me).unwrap()];
        // A child that burns CPU in user space, then exits.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"])
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // Exited, not yet reaped: its own figures are still readable.
        waitid(
            Id::Pid(nix::unistd::Pid::from_raw(pid)),
            WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT,
        )
        .unwrap();
        let (used, _) = cpu_ticks_split(pid).unwrap();
        assert!(used > 0, "the loop used no CPU tick");
        child.wait().unwrap();
        let (_, children) = spent(&m).unwrap();
        assert!(
            children >= used,
            "the reaped child's {used} ticks show as the parent's children's ({children})"
        );
        let line = CpuPerJob {
            machine_ms: 3.5,
            etcd_ms: 0.8,
            ..Default::default()
        }
        .line();
        assert!(
            line.starts_with("CPU per job 3.50 ms on the machine (steal 0.00): etcd 0.80,"),
            "{line}"
        );
    }
}
