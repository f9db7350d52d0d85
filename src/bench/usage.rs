//! What a process uses, read from `/proc`: resident memory, and CPU over a window.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use serde::Serialize;

/// One process over a sampling window.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Usage {
    pub rss_mb: f64,
    /// Of one core, averaged over the window.
    pub cpu_percent: f64,
}

/// Resident memory at the end of `window`, and CPU over it.
pub async fn sample(pid: i32, window: Duration) -> anyhow::Result<Usage> {
    let t0 = Instant::now();
    let c0 = cpu_ticks(pid)?;
    tokio::time::sleep(window).await;
    let c1 = cpu_ticks(pid)?;
    let secs = t0.elapsed().as_secs_f64();
    Ok(Usage {
        rss_mb: rss_kib(pid)? as f64 / 1024.0,
        cpu_percent: cpu_percent(c1 - c0, secs),
    })
}

/// Of one core: `ticks` of CPU over `secs` of wall time.
pub fn cpu_percent(ticks: u64, secs: f64) -> f64 {
    100.0 * ticks as f64 / clock_hz() / secs
}

/// utime + stime of a process, in clock ticks.
pub fn cpu_ticks(pid: i32) -> anyhow::Result<u64> {
    Ok(cpu_ticks_split(pid)?.0)
}

/// utime + stime of a process, and cutime + cstime (what its children, and theirs, used once
/// reaped), in clock ticks.
pub fn cpu_ticks_split(pid: i32) -> anyhow::Result<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow!("unreadable /proc/{pid}/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 to 17 of the line (utime, stime, cutime, cstime): indexes 11 to 14 after the
    // name.
    let field = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .ok_or_else(|| anyhow!("unreadable /proc/{pid}/stat"))
    };
    Ok((field(11)? + field(12)?, field(13)? + field(14)?))
}

/// Every core's busy time since boot (`/proc/stat`: user, nice, system, irq and softirq; not
/// idle or iowait; guest time is inside user), and the hypervisor's steal, in clock ticks.
pub fn machine_ticks() -> anyhow::Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let line = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .ok_or_else(|| anyhow!("no cpu line in /proc/stat"))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    Ok((at(0) + at(1) + at(2) + at(5) + at(6), at(7)))
}

/// Milliseconds in `ticks` clock ticks.
pub fn ticks_ms(ticks: u64) -> f64 {
    1000.0 * ticks as f64 / clock_hz()
}

fn clock_hz() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64
}

fn rss_kib(pid: i32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow!("no VmRSS in /proc/{pid}/status"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_has_memory_and_cpu_ticks() {
        let pid = std::process::id() as i32;
        assert!(super::rss_kib(pid).unwrap() > 0);
        super::cpu_ticks(pid).unwrap();
        assert!(super::machine_ticks().unwrap().0 > 0);
    }
}
