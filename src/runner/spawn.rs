//! Starting guards from the leader.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits. Each guard is forked
//! by a thread of its own that then blocks in `wait()` until the guard exits, so the signal fires
//! exactly when the replica dies, never earlier. The fork also races a dying parent: the child
//! compares `getppid()` with the pid recorded before the fork and exits if it changed.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::{getppid, Pid};
use tokio::sync::oneshot;

use crate::clock::BootInstant;

/// Environment variables a job inherits from the replica; everything else is dropped so that
/// `BATON_*` settings and secrets of the replica do not leak into jobs.
const INHERITED: &[&str] = &[
    "PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "TMPDIR",
];

/// One execution to start under a guard.
#[derive(Clone, Debug)]
pub struct Launch {
    pub guard_bin: PathBuf,
    pub job_id: String,
    pub attempt: u32,
    pub term: i64,
    pub dir: PathBuf,
    /// `attempt-<n>` or `cleanup-<n>`.
    pub name: String,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub margin: Duration,
    pub timeout: Duration,
    pub kill_grace: Duration,
    pub ledger: Option<PathBuf>,
    pub unsafe_ignore_deadlines: bool,
}

/// A running guard.
pub struct Guard {
    pub pid: i32,
    pub feed: GuardFeed,
    pub exited: oneshot::Receiver<ExitStatus>,
}

/// The leader's side of a guard's pipe. Cloneable; closing it (or SIGHUP) makes the guard kill
/// its job at once.
#[derive(Clone)]
pub struct GuardFeed {
    stdin: Arc<Mutex<Option<std::process::ChildStdin>>>,
    pid: i32,
}

impl GuardFeed {
    /// Sends a line; a full pipe drops it (the next deadline supersedes it).
    fn send(&self, line: &str) {
        let mut feed = self.stdin.lock().expect("guard feed lock");
        if let Some(stdin) = feed.as_mut() {
            if let Err(e) = stdin.write_all(line.as_bytes()) {
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    *feed = None;
                }
            }
        }
    }

    pub fn deadline(&self, valid_until: BootInstant) {
        self.send(&format!("D {}\n", valid_until.as_nanos()));
    }

    /// Cancel: SIGTERM to the job's group, SIGKILL after the grace period.
    pub fn terminate(&self) {
        self.send("TERM\n");
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The term is over: the guard kills the job's group at once.
    pub fn abandon(&self) {
        self.stdin.lock().expect("guard feed lock").take();
        let _ = kill(Pid::from_raw(self.pid), Signal::SIGHUP);
    }
}

/// Starts a guard for `launch`, fed `first_deadline` before anything else.
pub fn spawn(launch: Launch, first_deadline: BootInstant) -> std::io::Result<Guard> {
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (exit_tx, exit_rx) = oneshot::channel();
    let name = format!("guard-{}", launch.job_id);
    std::thread::Builder::new()
        .name(name.chars().take(15).collect())
        .stack_size(256 * 1024)
        .spawn(move || {
            let mut cmd = guard_command(&launch);
            let parent = std::process::id() as i32;
            unsafe {
                cmd.pre_exec(move || {
                    nix::sys::prctl::set_pdeathsig(Signal::SIGHUP).map_err(std::io::Error::from)?;
                    if getppid().as_raw() != parent {
                        nix::libc::_exit(crate::runner::guard::NOT_STARTED);
                    }
                    Ok(())
                });
            }
            match cmd.spawn() {
                Err(e) => {
                    let _ = started_tx.send(Err(e));
                }
                Ok(mut child) => {
                    let stdin = child.stdin.take().expect("guard stdin is piped");
                    let _ = nix::fcntl::fcntl(
                        stdin.as_fd(),
                        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
                    );
                    let _ = started_tx.send(Ok((child.id() as i32, stdin)));
                    let status = child
                        .wait()
                        .unwrap_or_else(|_| ExitStatus::from_raw(70 << 8));
                    let _ = exit_tx.send(status);
                }
            }
        })?;
    let (pid, stdin) = started_rx
        .recv()
        .map_err(|_| std::io::Error::other("guard spawner thread died"))??;
    let guard = Guard {
        pid,
        feed: GuardFeed {
            stdin: Arc::new(Mutex::new(Some(stdin))),
            pid,
        },
        exited: exit_rx,
    };
    guard.feed.deadline(first_deadline);
    Ok(guard)
}

fn guard_command(l: &Launch) -> Command {
    let mut cmd = Command::new(&l.guard_bin);
    cmd.arg("__guard")
        .args(["--job-id", &l.job_id])
        .args(["--attempt", &l.attempt.to_string()])
        .args(["--term", &l.term.to_string()])
        .arg("--dir")
        .arg(&l.dir)
        .args(["--name", &l.name])
        .args(["--margin", &format!("{}ms", l.margin.as_millis())])
        .args(["--timeout", &format!("{}ms", l.timeout.as_millis())])
        .args(["--kill-grace", &format!("{}ms", l.kill_grace.as_millis())]);
    if let Some(ledger) = &l.ledger {
        cmd.arg("--ledger").arg(ledger);
    }
    if l.unsafe_ignore_deadlines {
        cmd.arg("--unsafe-ignore-deadlines");
    }
    cmd.arg("--")
        .args(&l.command)
        .env_clear()
        // Its own group: a stop or interrupt aimed at the replica's group must not freeze
        // the guards while their jobs run on.
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    for k in INHERITED {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    cmd.envs(&l.env);
    cmd
}
