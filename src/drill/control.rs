//! When a drill stops, and what it says while it runs.
//!
//! A drill ends its faults (and, in soak mode, its workload) when `--rounds` are done or
//! `--duration` has passed, or at the first SIGINT/SIGTERM: the fault in progress is undone, the
//! workload stops, the cluster drains, and the report is printed marked as interrupted. A second
//! signal skips the drain. Every process the drill started is stopped either way.
//!
//! Progress goes to stderr: one line that updates in place on a terminal, or a line every
//! [`PROGRESS_EVERY`] otherwise, so a 30-minute soak is never silent.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::check::{self, Target};
use super::workload::Workload;

/// How often progress is printed when stderr is not a terminal.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(15);

#[derive(Clone)]
pub struct Control {
    started: Instant,
    duration: Option<Duration>,
    rounds: usize,
    faults_done: Arc<AtomicUsize>,
    interrupted: CancellationToken,
    hurry: CancellationToken,
    tty: bool,
}

impl Control {
    /// Starts the clock and listens for SIGINT/SIGTERM.
    pub fn start(duration: Option<Duration>, rounds: usize) -> anyhow::Result<Control> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        let c = Control {
            started: Instant::now(),
            duration,
            rounds,
            faults_done: Arc::new(AtomicUsize::new(0)),
            interrupted: CancellationToken::new(),
            hurry: CancellationToken::new(),
            tty: std::io::stderr().is_terminal(),
        };
        let (interrupted, hurry, tty) = (c.interrupted.clone(), c.hurry.clone(), c.tty);
        tokio::spawn(async move {
            let next = async {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            };
            next.await;
            say(
                tty,
                "drill: interrupted: undoing the current fault, then draining and checking \
                 (signal again to skip the drain)",
            );
            interrupted.cancel();
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            say(tty, "drill: skipping the drain");
            hurry.cancel();
        });
        Ok(c)
    }

    /// Whether another fault may start (round `round`, counting from 1).
    pub fn may_inject(&self, round: usize) -> bool {
        if self.interrupted.is_cancelled() {
            return false;
        }
        match self.duration {
            Some(d) => self.started.elapsed() < d,
            None => round <= self.rounds,
        }
    }

    pub fn fault_done(&self) {
        self.faults_done.fetch_add(1, Ordering::Relaxed);
    }

    /// A token the workload stops on: cancelled by the first signal.
    pub fn stop_token(&self) -> CancellationToken {
        self.interrupted.child_token()
    }

    pub fn interrupted(&self) -> bool {
        self.interrupted.is_cancelled()
    }

    /// Prints a line of the drill's own (a round), keeping the progress line intact.
    pub fn say(&self, line: &str) {
        say(self.tty, line);
    }

    /// Waits until the cluster has no registry entry and no dirty result, within `bound` (at
    /// once on a second signal). Returns whether it drained.
    pub async fn drain(&self, target: &Target, bound: Duration) -> bool {
        tokio::select! {
            drained = check::drain(target, bound) => drained,
            _ = self.hurry.cancelled() => false,
        }
    }

    /// Prints progress until the returned guard is dropped.
    pub fn progress(&self, target: Target, workload: &Workload) -> tokio_util::sync::DropGuard {
        let stop = CancellationToken::new();
        let (c, w, s) = (self.clone(), workload.counts(), stop.clone());
        tokio::spawn(async move {
            let every = if c.tty {
                Duration::from_secs(1)
            } else {
                PROGRESS_EVERY
            };
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            let mut last = false;
            while !last {
                tokio::select! {
                    _ = tick.tick() => {}
                    // One last line at the end, so even a short drill reports its progress.
                    _ = s.cancelled() => last = true,
                }
                let finished = check::count_prefix(&target, "results/dirty/")
                    .await
                    .unwrap_or(0)
                    + check::count_prefix(&target, "results/clean/")
                        .await
                        .unwrap_or(0);
                let (acked, failed) = w();
                let left = match c.duration {
                    Some(d) => format!("{}s left", d.saturating_sub(c.started.elapsed()).as_secs()),
                    None => format!("{} rounds", c.rounds),
                };
                let line = format!(
                    "drill: progress: {} faults, {acked} jobs acknowledged ({failed} failed), \
                     {finished} finished, {left}",
                    c.faults_done.load(Ordering::Relaxed)
                );
                if c.tty {
                    let mut e = std::io::stderr().lock();
                    let _ = write!(e, "\r\x1b[2K{line}");
                    let _ = e.flush();
                } else {
                    eprintln!("{line}");
                }
            }
            if c.tty {
                eprint!("\r\x1b[2K");
            }
        });
        stop.drop_guard()
    }
}

fn say(tty: bool, line: &str) {
    if tty {
        eprintln!("\r\x1b[2K{line}");
    } else {
        eprintln!("{line}");
    }
}
