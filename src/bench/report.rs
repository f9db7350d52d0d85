//! What `baton bench` prints: a table per scenario and the targets met or missed, or all of it
//! as JSON.

use std::fmt::Write as _;

use serde::Serialize;

use super::console::ConsoleBench;
use super::e2e::EndToEnd;
use super::failover::Failover;
use super::footprint::Footprint;
use super::guards::Guards;
use super::recovery::Recovery;
use super::schedules::Schedules;
use super::submit::Point;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub cores: usize,
    pub etcd_members: usize,
    pub lease_ttl_ms: u64,
    pub submit_seconds: f64,
    pub submit: Option<Vec<Point>>,
    pub e2e: Option<EndToEnd>,
    pub guards: Option<Guards>,
    pub recovery: Option<Vec<Recovery>>,
    pub failover: Option<Failover>,
    pub footprint: Option<Footprint>,
    pub schedules: Option<Schedules>,
    pub console: Option<ConsoleBench>,
    pub targets: Vec<Target>,
}

/// One goal of the performance issue and how this run did.
#[derive(Clone, Debug, Serialize)]
pub struct Target {
    pub what: String,
    pub goal: String,
    pub measured: String,
    pub met: bool,
}

impl Report {
    /// Fills in [`Report::targets`] from the figures present.
    pub fn judge(&mut self) {
        let mut t = Vec::new();
        let mut add = |what: &str, goal: &str, measured: String, met: bool| {
            t.push(Target {
                what: what.into(),
                goal: goal.into(),
                measured,
                met,
            })
        };
        if let Some(p) = self
            .submit
            .as_ref()
            .and_then(|s| s.iter().max_by_key(|p| p.concurrency))
        {
            add(
                &format!("submit at C={}", p.concurrency),
                ">= 1.0x raw (aim 3x)",
                format!("{:.2}x", p.ratio),
                p.ratio >= 1.0,
            );
            add(
                &format!("submit p99 at C={}", p.concurrency),
                "<= 2x raw",
                format!("{:.2}x", p.p99_ratio),
                p.p99_ratio <= 2.0,
            );
        }
        if let Some(e) = &self.e2e {
            add(
                &format!("end-to-end, {} workers", e.workers),
                ">= 1,000 jobs/s to a result",
                format!("{:.0} jobs/s", e.results_per_sec),
                e.results_per_sec >= 1000.0,
            );
        }
        if let (Some(e), Some(g)) = (&self.e2e, &self.guards) {
            let bare = e.clean_per_sec / g.bare_spawns_per_sec.max(f64::MIN_POSITIVE);
            add(
                "end-to-end to clean / bare spawn rate",
                ">= 0.3x",
                format!("{bare:.2}x"),
                bare >= 0.3,
            );
            let legacy = e.clean_per_sec / g.legacy.clean_per_sec.max(f64::MIN_POSITIVE);
            add(
                "end-to-end to clean / legacy guard",
                ">= 1.5x",
                format!("{legacy:.2}x"),
                legacy >= 1.5,
            );
        }
        for m in self.guards.iter().flat_map(|g| &g.memory) {
            if m.guard != "small" {
                continue;
            }
            add(
                "guard private memory per running job",
                "< 256 KiB",
                format!("{:.0} KiB", m.private_kib_per_job),
                m.private_kib_per_job < 256.0,
            );
            if m.running >= 1000 {
                add(
                    &format!("worker + guards PSS, {} running", m.running),
                    "< 300 MiB",
                    format!("{:.0} MiB", m.worker_and_guards_pss_mib),
                    m.worker_and_guards_pss_mib < 300.0,
                );
            }
        }
        for r in self.recovery.iter().flatten() {
            let (goal, bound) = if r.jobs <= 10_000 {
                ("< 0.5 s per 10,000", 500.0 * r.jobs as f64 / 10_000.0)
            } else {
                ("< 5 s per 100,000", 5000.0 * r.jobs as f64 / 100_000.0)
            };
            add(
                &format!("recovery of {} jobs", r.jobs),
                goal,
                format!("{:.0} ms", r.recovery_ms),
                r.recovery_ms < bound.max(1.0),
            );
        }
        for f in self.failover.iter().flat_map(|f| &f.runs) {
            let ttl = f.lease_ttl_ms as f64;
            let with = if f.fast_failover { "fast" } else { "no fast" };
            let at = format!("TTL {:.0} s, {with} failover", ttl / 1e3);
            add(
                &format!("failover, SIGTERM p99 (until served), {at}"),
                "< 50 ms",
                format!("{:.0} ms", f.term_serving.p99_ms),
                f.term_serving.p99_ms < 50.0,
            );
            if f.fast_failover {
                add(
                    &format!("failover, SIGKILL p99 (until served), {at}"),
                    "< 100 ms",
                    format!("{:.0} ms", f.kill_serving.p99_ms),
                    f.kill_serving.p99_ms < 100.0,
                );
            } else {
                let bound = ttl + 600.0;
                add(
                    &format!("failover, SIGKILL p99 (until served), {at}"),
                    &format!("< TTL + 0.6 s = {bound:.0} ms"),
                    format!("{:.0} ms", f.kill_serving.p99_ms),
                    f.kill_serving.p99_ms < bound,
                );
            }
            // A paused leader is not dead: only its lease's expiry may replace it.
            add(
                &format!("failover, SIGSTOP min (until served), {at}"),
                &format!("> TTL / 2 = {:.0} ms", ttl / 2.0),
                format!("{:.0} ms", f.stop_serving.min_ms),
                f.stop_serving.n == 0 || f.stop_serving.min_ms > ttl / 2.0,
            );
            add(
                &format!("failover, overlapping terms and unproven revokes, {at}"),
                "0",
                format!("{}", f.overlapping_terms + f.unproven_revokes.len()),
                f.overlapping_terms + f.unproven_revokes.len() == 0,
            );
        }
        if let Some(f) = &self.footprint {
            for (who, u) in [
                ("idle follower", &f.idle_follower),
                ("idle worker", &f.idle_worker),
            ] {
                add(
                    who,
                    "< 30 MB and < 1% of a core",
                    format!("{:.1} MB, {:.2}%", u.rss_mb, u.cpu_percent),
                    u.rss_mb < 30.0 && u.cpu_percent < 1.0,
                );
            }
        }
        if let Some(c) = &self.console {
            let worst = c
                .views
                .iter()
                .filter(|v| v.query.contains("page_size=100&") || v.query == "page_size=100")
                .map(|v| v.max_ms)
                .fold(0.0, f64::max);
            add(
                &format!("a page of 100, any view, {} jobs (max)", c.jobs),
                "< 300 ms",
                format!("{worst:.0} ms"),
                worst < 300.0,
            );
            let added = c.busy.follower_cpu_percent - c.idle.follower_cpu_percent;
            add(
                &format!("{} consoles on a follower during e2e", c.busy.consoles),
                "< 15% of a core added",
                format!("{added:+.1}%"),
                added < 15.0,
            );
            add(
                "etcd watchers with them",
                "no more than without",
                format!("{:.0} vs {:.0}", c.busy.etcd_watchers, c.idle.etcd_watchers),
                c.busy.etcd_watchers <= c.idle.etcd_watchers,
            );
            let drop = 100.0 * (1.0 - c.with.clean_per_sec / c.without.clean_per_sec.max(1e-9));
            add(
                "e2e throughput with them",
                "< 10% lower",
                format!("{drop:+.1}%"),
                drop < 10.0,
            );
        }
        if let Some(s) = &self.schedules {
            add(
                "schedule tick lag, idle (p99)",
                "< 100 ms",
                format!("{:.0} ms", s.idle_lag.p99_ms),
                s.idle_lag.p99_ms < 100.0,
            );
            let all = s.burst_created == s.burst_schedules;
            add(
                &format!("{} schedules due at one instant", s.burst_schedules),
                "all jobs < 2 s, no step-down",
                format!(
                    "{} of {} in {:.0} ms, {} step-downs",
                    s.burst_created, s.burst_schedules, s.burst_last_ms, s.burst_step_downs
                ),
                all && s.burst_last_ms < 2000.0 && s.burst_step_downs == 0,
            );
            add(
                "leader RSS after the burst",
                "< 60 MB",
                format!("{:.1} MB", s.leader_rss_mb),
                s.leader_rss_mb < 60.0,
            );
            let bound = s.lease_ttl_ms as f64 + 1000.0;
            add(
                "leader SIGKILL at a tick: its job (max)",
                &format!("< TTL + 1 s = {bound:.0} ms"),
                format!("{:.0} ms", s.kill_to_job.max_ms),
                s.kill_to_job.max_ms < bound,
            );
        }
        self.targets = t;
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "baton bench: {} cores, etcd of {} member(s), lease TTL {} ms",
            self.cores, self.etcd_members, self.lease_ttl_ms
        );
        if let Some(points) = &self.submit {
            let _ = writeln!(
                o,
                "\nsubmit: SubmitJob to one replica vs raw etcd txn of the same shape, {:.1} s per run",
                self.submit_seconds
            );
            let _ = writeln!(
                o,
                "  {:>4} | {:>8} {:>7} {:>7} | {:>8} {:>7} {:>7} | {:>6} {:>9}",
                "C",
                "raw/s",
                "p50 ms",
                "p99 ms",
                "baton/s",
                "p50 ms",
                "p99 ms",
                "ratio",
                "p99 ratio"
            );
            for p in points {
                let _ = writeln!(
                    o,
                    "  {:>4} | {:>8.0} {:>7.2} {:>7.2} | {:>8.0} {:>7.2} {:>7.2} | {:>5.2}x {:>8.2}x",
                    p.concurrency,
                    p.raw.ops_per_sec,
                    p.raw.p50_ms,
                    p.raw.p99_ms,
                    p.baton.ops_per_sec,
                    p.baton.p50_ms,
                    p.baton.p99_ms,
                    p.ratio,
                    p.p99_ratio
                );
            }
        }
        if let Some(e) = &self.e2e {
            let _ = writeln!(
                o,
                "\nend-to-end: {} trivial jobs, {} workers ({})",
                e.jobs, e.workers, e.settings
            );
            let _ = writeln!(
                o,
                "  {:.0} jobs/s to a result, {:.0} jobs/s to clean ({:.1} s); per job etcd answered {:.1} requests ({:.1} transactions), applied {:.1} writes and evaluated {:.1} ranges (reads and compares)",
                e.results_per_sec,
                e.clean_per_sec,
                e.seconds,
                e.etcd_requests_per_job,
                e.etcd_txns_per_job,
                e.etcd_writes_per_job,
                e.etcd_ranges_per_job
            );
            // With the guards' runs, each run's line is printed with its rate below.
            if let (Some(cpu), None) = (&e.cpu, &self.guards) {
                let _ = writeln!(o, "  {}", cpu.line());
            }
        }
        if let (Some(e), Some(g)) = (&self.e2e, &self.guards) {
            let _ = writeln!(
                o,
                "\nguards: the same end-to-end run per guard, on this machine"
            );
            let _ = writeln!(
                o,
                "  bare spawn rate (/bin/true, two at a time, through the spawner): {:.0} processes/s \
                 (median of {} before, between and after the runs)",
                g.bare_spawns_per_sec,
                g.bare_spawn_samples
                    .iter()
                    .map(|r| format!("{r:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            for x in [&g.legacy, e] {
                let _ = writeln!(
                    o,
                    "  {:<7} {:>6.0} jobs/s to clean ({:.2}x bare)  [{}]",
                    x.guard,
                    x.clean_per_sec,
                    x.clean_per_sec / g.bare_spawns_per_sec.max(f64::MIN_POSITIVE),
                    x.settings
                );
                if let Some(cpu) = &x.cpu {
                    let _ = writeln!(o, "          {}", cpu.line());
                }
            }
            for m in &g.memory {
                let _ = writeln!(
                    o,
                    "  {:<7} {:>5} running: {:>6.0} KiB private per guard; worker + guards {:.0} MiB PSS",
                    m.guard, m.running, m.private_kib_per_job, m.worker_and_guards_pss_mib
                );
            }
        }
        if let Some(rs) = &self.recovery {
            let _ = writeln!(
                o,
                "\nrecovery: new leader after a SIGKILL, from its term's start"
            );
            let _ = writeln!(
                o,
                "  {:>7} {:>6} {:>6} {:>6} | {:>11} {:>11} {:>11} | {:>11} | {:>10}",
                "jobs",
                "live",
                "dead",
                "dirty",
                "registry ms",
                "cleanups ms",
                "recovery ms",
                "raw read ms",
                "leader MB"
            );
            for r in rs {
                let _ = writeln!(
                    o,
                    "  {:>7} {:>6} {:>6} {:>6} | {:>11.0} {:>11.0} {:>11.0} | {:>11.0} | {:>10.1}",
                    r.jobs,
                    r.running_live,
                    r.running_dead,
                    r.dirty,
                    r.registry_ms,
                    r.cleanups_ms,
                    r.recovery_ms,
                    r.raw_read_ms,
                    r.leader.rss_mb
                );
            }
        }
        for f in self.failover.iter().flat_map(|f| &f.runs) {
            let _ = writeln!(
                o,
                "\nfailover, TTL {} ms, fast failover {}: {} SIGKILLs, {} SIGTERMs, {} SIGSTOPs of the leader",
                f.lease_ttl_ms,
                if f.fast_failover { "on" } else { "off" },
                f.kill_serving.n,
                f.term_serving.n,
                f.stop_serving.n
            );
            let _ = writeln!(
                o,
                "  {:<46} {:>8} {:>8} {:>8} {:>8}",
                "", "min ms", "p50 ms", "p99 ms", "max ms"
            );
            for (what, s) in [
                ("SIGKILL: without a leader", &f.kill_leaderless),
                ("SIGKILL: until the new leader serves", &f.kill_serving),
                (
                    "SIGKILL: until its worker's job runs again",
                    &f.kill_job_rerun,
                ),
                ("SIGTERM: without a leader", &f.term_leaderless),
                ("SIGTERM: until the new leader serves", &f.term_serving),
                ("SIGSTOP: until the new leader serves", &f.stop_serving),
            ] {
                let _ = writeln!(
                    o,
                    "  {what:<46} {:>8.0} {:>8.0} {:>8.0} {:>8.0}",
                    s.min_ms, s.p50_ms, s.p99_ms, s.max_ms
                );
            }
            let _ = writeln!(
                o,
                "  revokes on evidence: {}; overlapping terms: {}; revokes before an exit: {}",
                f.revokes,
                f.overlapping_terms,
                f.unproven_revokes.len()
            );
        }
        if let Some(f) = &self.footprint {
            let _ = writeln!(o, "\nfootprint: over {:.1} s", f.window_seconds);
            let _ = writeln!(o, "  {:<30} {:>8} {:>8}", "", "RSS MB", "CPU %");
            let leader = format!("leader holding {} jobs", f.leader_jobs);
            for (who, u) in [
                ("idle follower", &f.idle_follower),
                ("idle worker", &f.idle_worker),
                (leader.as_str(), &f.leader),
            ] {
                let _ = writeln!(o, "  {who:<30} {:>8.1} {:>8.2}", u.rss_mb, u.cpu_percent);
            }
        }
        if let Some(s) = &self.schedules {
            let _ = writeln!(
                o,
                "\nschedules: jobs seen by the benchmark's own watch of jobs/, TTL {} ms",
                s.lease_ttl_ms
            );
            let _ = writeln!(
                o,
                "  {:<44} {:>8} {:>8} {:>8}",
                "", "p50 ms", "p99 ms", "max ms"
            );
            for (what, sp) in [
                ("every-second tick, idle: scheduled to job", &s.idle_lag),
                ("leader SIGKILL at a tick: kill to job", &s.kill_to_job),
                ("  new term's became_leader to job", &s.leader_to_job),
            ] {
                let _ = writeln!(
                    o,
                    "  {what:<44} {:>8.0} {:>8.0} {:>8.0}",
                    sp.p50_ms, sp.p99_ms, sp.max_ms
                );
            }
            let _ = writeln!(
                o,
                "  {} schedules due at one instant: {} jobs, median {:.0} ms, last {:.0} ms after it; {} step-downs; leader {:.1} MB; etcd db {:.1} MB",
                s.burst_schedules,
                s.burst_created,
                s.burst_p50_ms,
                s.burst_last_ms,
                s.burst_step_downs,
                s.leader_rss_mb,
                s.etcd_db_mb
            );
        }
        if let Some(c) = &self.console {
            let _ = writeln!(
                o,
                "\nconsole: pages of /api/v1/jobs on a follower over {} jobs",
                c.jobs
            );
            let _ = writeln!(
                o,
                "  {:<52} {:>6} {:>8} {:>8}",
                "view", "jobs", "p50 ms", "max ms"
            );
            for v in &c.views {
                let _ = writeln!(
                    o,
                    "  {:<52} {:>6} {:>8.1} {:>8.1}",
                    v.query, v.jobs_on_page, v.p50_ms, v.max_ms
                );
            }
            let _ = writeln!(
                o,
                "  e2e on 3 coordinators, {} jobs, submitted to a follower:",
                c.with.jobs
            );
            let _ = writeln!(
                o,
                "  {:<20} {:>10} {:>16} {:>14} {:>8}",
                "consoles", "clean/s", "follower CPU %", "etcd watchers", "events"
            );
            for (e, k) in [(&c.without, &c.idle), (&c.with, &c.busy)] {
                let _ = writeln!(
                    o,
                    "  {:<20} {:>10.0} {:>16.1} {:>14.0} {:>8}",
                    k.consoles, e.clean_per_sec, k.follower_cpu_percent, k.etcd_watchers, k.events
                );
            }
        }
        if !self.targets.is_empty() {
            let _ = writeln!(o, "\ntargets");
            for t in &self.targets {
                let _ = writeln!(
                    o,
                    "  {:<40} {:<30} {:>16}  {}",
                    t.what,
                    t.goal,
                    t.measured,
                    if t.met { "met" } else { "MISSED" }
                );
            }
        }
        o
    }
}
