//! Starting guards from a big multi-threaded process without starving it.
//!
//! Guarantees:
//! - **One long-lived spawner thread** starts every guard. A guard arms its parent-death signal
//!   itself, and that signal follows the thread that spawned it; this thread lives as long as
//!   the process, so the signal fires exactly when the process dies (never when some pool
//!   thread retires).
//! - **No code of ours between fork and exec.** The guard command has no `pre_exec` closure,
//!   an absolute program path and no uid/gid change, so the standard library starts it with
//!   `posix_spawn` (glibc's `clone(CLONE_VM | CLONE_VFORK)`): no copy of the page tables of a
//!   large process, no allocator or lock touched in a half-copied child.
//! - **No OS thread per guard.** Each guard is reaped through a pidfd awaited on the runtime.
//! - **The parent's death is seen.** The guard's stdin is a pipe whose write end only this
//!   process holds (close-on-exec, so no other child inherits it): EOF means the parent is gone.
//! - A guard whose requester went away before it was handed over (an aborted task) gets its
//!   pipe closed at once (it then starts nothing, or kills what it started) and is reaped here.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

use super::guard::{Spec, PROTOCOL};
use super::pidfd_open;
use super::program::GuardProgram;
use crate::clock::BootInstant;

/// Environment variables a job inherits from its parent; everything else is dropped so that
/// `BATON_*` settings and secrets of the replica do not leak into jobs.
const INHERITED: &[&str] = &[
    "PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "TMPDIR",
];

/// How guards are run: the same for every execution of one process.
#[derive(Clone, Debug)]
pub struct GuardSettings {
    /// The guard program, opened and checked at start.
    pub program: Arc<GuardProgram>,
    /// The guard kills its job at `deadline - margin`.
    pub margin: Duration,
    /// After a cancel's SIGTERM, the time before SIGKILL.
    pub kill_grace: Duration,
    /// The job's niceness; the guard keeps the parent's.
    pub nice: i32,
    /// Every guard appends its executions here (drills audit them).
    pub ledger: Option<PathBuf>,
    /// Negative control for drills: guards ignore lease deadlines.
    pub unsafe_ignore_deadlines: bool,
    /// The jobs' soft `RLIMIT_NOFILE` (the process's before the worker raised it).
    pub job_nofile: Option<u64>,
}

/// One execution to start under a guard.
#[derive(Clone, Debug)]
pub struct Launch {
    pub guard: GuardSettings,
    pub job_id: String,
    pub attempt: u32,
    pub term: i64,
    pub dir: PathBuf,
    /// `attempt-<n>` or `cleanup-<n>`.
    pub name: String,
    /// How long the guard waits for its first deadline (its go) before giving up.
    pub go_within: Duration,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
}

/// A running guard.
pub struct Guard {
    pub pid: i32,
    pub feed: GuardFeed,
    /// Resolves when the guard has exited and been reaped.
    pub exited: oneshot::Receiver<ExitStatus>,
}

/// The parent's side of a guard's pipe. Cloneable; closing it (or SIGHUP) makes the guard kill
/// its job at once.
#[derive(Clone)]
pub struct GuardFeed {
    stdin: Arc<Mutex<Option<std::process::ChildStdin>>>,
    pid: i32,
    /// Signals go through a pidfd, so one sent after the guard was reaped reaches nobody
    /// rather than a process that reused its pid.
    pidfd: Option<Arc<OwnedFd>>,
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

    /// The execution may not go on: the guard kills the job's group at once.
    pub fn abandon(&self) {
        self.stdin.lock().expect("guard feed lock").take();
        self.signal(Signal::SIGHUP as i32);
    }

    /// Whether the guard has not been reaped yet.
    pub fn is_running(&self) -> bool {
        self.signal(0)
    }

    fn signal(&self, sig: i32) -> bool {
        let Some(fd) = &self.pidfd else {
            return false;
        };
        let r = unsafe {
            nix::libc::syscall(
                nix::libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                sig,
                std::ptr::null::<nix::libc::siginfo_t>(),
                0,
            )
        };
        r == 0
    }
}

/// Exit status reported when a guard could not be waited for.
const UNKNOWN_EXIT: i32 = 70 << 8;

struct Request {
    cmd: Command,
    reply: oneshot::Sender<std::io::Result<(Child, OwnedFd)>>,
}

/// The spawner thread's queue, started on first use and never stopped.
fn spawner() -> &'static mpsc::Sender<Request> {
    static SPAWNER: OnceLock<mpsc::Sender<Request>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("baton-spawner".into())
            .stack_size(256 * 1024)
            .spawn(move || spawn_loop(rx))
            .expect("starting the spawner thread");
        tx
    })
}

fn spawn_loop(rx: mpsc::Receiver<Request>) {
    // Without this thread no guard can start, and every running guard has lost its parent-death
    // anchor: a replica in that state must not go on.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(rx))).is_err() {
        eprintln!("baton: the spawner thread panicked; aborting");
        std::process::abort();
    }
}

fn serve(rx: mpsc::Receiver<Request>) {
    // Guards nobody took over: their pipes are closed, they exit on their own; reap them.
    let mut orphans: Vec<Child> = Vec::new();
    loop {
        let wait = if orphans.is_empty() {
            Duration::from_secs(3600)
        } else {
            Duration::from_millis(100)
        };
        match rx.recv_timeout(wait) {
            Ok(mut req) => {
                let started = req
                    .cmd
                    .spawn()
                    .and_then(|mut child| match pidfd_open(child.id()) {
                        Ok(fd) => Ok((child, fd)),
                        Err(e) => {
                            let _ = child.kill();
                            orphans.push(child);
                            Err(e)
                        }
                    });
                if let Err(Ok((mut child, _))) = req.reply.send(started) {
                    drop(child.stdin.take());
                    orphans.push(child);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        orphans.retain_mut(|c| matches!(c.try_wait(), Ok(None)));
    }
}

/// Spawns the guard program (`protocol`) the way guards are spawned, and waits for its answer:
/// whether guards can be started now.
pub async fn probe(program: &GuardProgram) -> std::io::Result<()> {
    let mut cmd = program.command(["protocol"]);
    // The shape of a guard's spawn: its own group, a pipe on stdin, nothing inherited.
    cmd.env_clear().process_group(0).stdin(Stdio::piped());
    let status = run_to_end(cmd).await?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "the guard program exited with {status}"
        )))
    }
}

/// Runs `cmd` (stdout and stderr to /dev/null; stdin as the caller set it) through the
/// spawner thread, as guards are spawned, and waits for its exit: [`probe`], and the bench's
/// bare spawn rate.
pub async fn run_to_end(mut cmd: Command) -> std::io::Result<ExitStatus> {
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    let (reply, answer) = oneshot::channel();
    spawner()
        .send(Request { cmd, reply })
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    let (child, pidfd) = answer
        .await
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))??;
    // SAFETY: as in `adopt`.
    let pidfd = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
        .map_err(std::io::Error::from);
    Ok(reap(child, pidfd).await)
}

/// Starts a guard for `launch`, fed `first_deadline()` (read once the guard exists, so a slow
/// spawn does not feed a stale deadline) before anything else. Must be called on a tokio
/// runtime, which reaps the guard. Cancel-safe: if the caller goes away, the guard is still
/// taken over, its pipe closed (it starts nothing, or kills what it started) and reaped.
pub async fn spawn(
    launch: Launch,
    first_deadline: impl FnOnce() -> BootInstant + Send + 'static,
) -> std::io::Result<Guard> {
    start(launch, Some(Box::new(first_deadline))).await
}

/// Starts a guard that waits for its first deadline, which is its go: the caller records the
/// start (with the guard's pid) before the job may exec. A guard not fed within its
/// `--go-within` starts nothing. Cancel-safe like [`spawn`].
pub async fn spawn_held(launch: Launch) -> std::io::Result<Guard> {
    start(launch, None).await
}

type FirstDeadline = Box<dyn FnOnce() -> BootInstant + Send + 'static>;

async fn start(launch: Launch, first_deadline: Option<FirstDeadline>) -> std::io::Result<Guard> {
    let (reply, answer) = oneshot::channel();
    spawner()
        .send(Request {
            cmd: guard_command(&launch),
            reply,
        })
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    tokio::spawn(async move {
        let (child, pidfd) = answer
            .await
            .map_err(|_| std::io::Error::other("the spawner thread is gone"))??;
        adopt(child, pidfd, first_deadline.map(|f| f()))
    })
    .await
    .map_err(|e| std::io::Error::other(format!("starting a guard failed: {e}")))?
}

/// Takes a freshly spawned guard over: its pipe, its first deadline and its reaping.
fn adopt(
    mut child: Child,
    pidfd: OwnedFd,
    first_deadline: Option<BootInstant>,
) -> std::io::Result<Guard> {
    let stdin = child.stdin.take().expect("guard stdin is piped");
    let nonblocking = nix::fcntl::fcntl(
        stdin.as_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    );
    let pid = child.id() as i32;
    let signals = pidfd.try_clone().ok().map(Arc::new);
    let (exit_tx, exited) = oneshot::channel();
    // SAFETY: the OwnedFd is moved into the AsyncFd and stays open, unchanged, until it drops.
    let pidfd = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
        .map_err(std::io::Error::from);
    tokio::spawn(async move {
        let _ = exit_tx.send(reap(child, pidfd).await);
    });
    // Closing the pipe on an error makes the guard exit without starting anything.
    nonblocking?;
    let feed = GuardFeed {
        stdin: Arc::new(Mutex::new(Some(stdin))),
        pid,
        pidfd: signals,
    };
    if let Some(d) = first_deadline {
        feed.deadline(d);
    }
    Ok(Guard { pid, feed, exited })
}

/// Waits for `child` to exit without a thread of its own: the pidfd becomes readable on exit.
async fn reap(mut child: Child, pidfd: std::io::Result<AsyncFd<OwnedFd>>) -> ExitStatus {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status,
            Ok(None) => {}
            Err(_) => return ExitStatus::from_raw(UNKNOWN_EXIT),
        }
        match &pidfd {
            Ok(fd) => match fd.readable().await {
                Ok(mut ready) => ready.clear_ready(),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            },
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// What the guard of `l` is told: one JSON argument.
fn spec(l: &Launch) -> Spec {
    let g = &l.guard;
    let ms = |d: Duration| d.as_millis().min(u64::MAX as u128) as u64;
    Spec {
        protocol: PROTOCOL,
        job_id: l.job_id.clone(),
        attempt: l.attempt,
        term: l.term,
        dir: l.dir.clone(),
        name: l.name.clone(),
        margin_ms: ms(g.margin),
        timeout_ms: ms(l.timeout),
        kill_grace_ms: ms(g.kill_grace),
        go_within_ms: ms(l.go_within),
        ledger: g.ledger.clone(),
        nice: g.nice,
        parent_pid: Some(std::process::id() as i32),
        unsafe_ignore_deadlines: g.unsafe_ignore_deadlines,
        nofile: g.job_nofile,
        command: l.command.clone(),
    }
}

fn guard_command(l: &Launch) -> Command {
    let spec = serde_json::to_string(&spec(l)).expect("a guard spec serializes");
    let mut cmd = l.guard.program.command(["run", spec.as_str()]);
    cmd.env_clear()
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
