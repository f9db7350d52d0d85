//! One execution under the guard: the direct parent of every job process.
//!
//! A paused leader cannot kill anything, yet its lease expires and another replica starts the
//! same jobs. So each job runs under this small synchronous process, which its parent feeds the
//! proven lease deadline through a pipe (stdin) at every keepalive. The guard:
//! - never starts the job if the first deadline it receives has already passed (minus margin);
//! - kills the job's whole process group by itself at `deadline - margin` without a renewal;
//! - kills it at once when the pipe reaches EOF (only its parent holds the write end, so EOF is
//!   the parent's death) or the spawning thread dies (parent-death signal, set by the guard
//!   itself: nothing runs between fork and exec in the parent);
//! - gives the job a parent-death SIGKILL of its own and checks its parent before its exec
//!   ([`crate::spawn`]), so a guard killed by anything (the OOM killer) takes its job with it;
//! - runs the job at `nice`, and keeps its own priority, so a busy host starves jobs first;
//! - enforces the attempt's timeout and a cancel (SIGTERM, then SIGKILL after a grace period);
//! - after reaping the job, kills what is left of its group, waits until the group is empty
//!   (it is the subreaper of the job's orphans), and only then writes the exit record
//!   `attempt-<n>.exit` (atomically, fsynced), so a new leader records that result instead of
//!   running a finished job again; a command that cannot be started is recorded as a start
//!   error with its errno, not as an exit code.
//!
//! Protocol on stdin, one line each: `D <boottime ns>` (a new deadline), `TERM` (cancel), `KILL`.

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use crate::clock::BootInstant;
use crate::record::{
    exit_path, log_path, pid_path, ExitRecord, KilledBy, LedgerEntry, StartError,
    EXIT_RECORD_VERSION,
};
use crate::spawn::Launch;
use crate::{Spec, GUARD_FAILED, NOT_STARTED};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{killpg, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::{getppid, Pid};

/// The spec's durations.
struct Times {
    margin: Duration,
    timeout: Duration,
    kill_grace: Duration,
    go_within: Duration,
}

fn ledger(args: &Spec, event: &str, pid: i32, exit: Option<&ExitRecord>) {
    use std::io::Write;
    let Some(path) = &args.ledger else { return };
    let entry = LedgerEntry {
        event: event.into(),
        job_id: args.job_id.clone(),
        name: args.name.clone(),
        term: args.term,
        pid,
        boottime_ns: BootInstant::now().as_nanos(),
        unix_ms: crate::clock::unix_ms(),
        exit: exit.cloned(),
        worker: std::env::var("BATON_WORKER").ok(),
    };
    let mut line = serde_json::to_vec(&entry).expect("ledger entries serialize");
    line.push(b'\n');
    // One write on an O_APPEND file: lines of concurrent guards never interleave.
    if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(&line);
    }
}

/// Runs one execution of a valid spec; returns the process exit code.
pub fn run(args: Spec) -> i32 {
    match guard(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("baton-guard: {e}");
            GUARD_FAILED
        }
    }
}

fn guard(args: Spec) -> std::io::Result<i32> {
    let t = Times {
        margin: Duration::from_millis(args.margin_ms),
        timeout: Duration::from_millis(args.timeout_ms),
        kill_grace: Duration::from_millis(args.kill_grace_ms),
        go_within: Duration::from_millis(args.go_within_ms),
    };
    // Spawned through a descriptor (`/proc/self/fd/<n>`), the kernel names the process after
    // the number: name it for `ps` and `top`.
    let _ = nix::sys::prctl::set_name(c"baton-guard");
    // Armed here rather than between fork and exec in the parent, which runs no code there.
    // The signal follows the thread that spawned us: the parent's long-lived spawner thread.
    nix::sys::prctl::set_pdeathsig(Signal::SIGHUP).map_err(std::io::Error::from)?;
    // The job's orphaned descendants become the guard's children, so the guard can reap them
    // and tell when the job's group is really empty (a container's init may never reap them).
    nix::sys::prctl::set_child_subreaper(true).map_err(std::io::Error::from)?;
    if args.parent_pid.is_some_and(|p| getppid().as_raw() != p) {
        return Ok(NOT_STARTED);
    }
    if let Some(soft) = args.nofile {
        // Lowered here, for the guard and so for the job (the guard needs a handful).
        use nix::sys::resource::{getrlimit, setrlimit, Resource};
        if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, soft.min(hard), hard);
        }
    }
    // Signals that mean "the leader is gone or wants us to stop" arrive on a descriptor, so the
    // loop below never misses one between checks.
    let mut mask = SigSet::empty();
    for s in [
        Signal::SIGHUP,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGPIPE,
    ] {
        mask.add(s);
    }
    mask.thread_block().map_err(std::io::Error::from)?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(std::io::Error::from)?;

    let stdin = std::io::stdin();
    let mut feed = Feed::new(stdin.as_fd().try_clone_to_owned()?);
    let first = BootInstant::now() + t.go_within;
    let mut deadline = loop {
        if let Some(d) = feed.deadline {
            break d;
        }
        if feed.closed || BootInstant::now() >= first || let_go(&signals) {
            return Ok(NOT_STARTED);
        }
        feed.wait(Duration::from_millis(100))?;
    };
    if BootInstant::now() + t.margin >= deadline {
        return Ok(NOT_STARTED);
    }

    std::fs::create_dir_all(&args.dir)?;
    // A same-named record of an earlier job of this id (or a rejected run) is not ours.
    let _ = std::fs::remove_file(exit_path(&args.dir, &args.name));
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path(&args.dir, &args.name))?;
    // Only ever raised: a guard already running niced (a niced replica) keeps that, and raising
    // needs no privilege, so it cannot fail the job.
    let current = unsafe { nix::libc::getpriority(nix::libc::PRIO_PROCESS, 0) };
    let nice = (args.nice > current).then_some(args.nice);
    let devnull = OpenOptions::new().read(true).open("/dev/null")?;
    // The parent may have let go in the same breath as it sent the first deadline (a guard
    // abandoned right after its spawn): the last look before the job starts.
    feed.read_available()?;
    if feed.closed || let_go(&signals) {
        return Ok(NOT_STARTED);
    }
    let started = BootInstant::now();
    let launched = Launch::new(&args.command, &args.dir, devnull.into(), log.into(), nice)
        .and_then(Launch::spawn);
    let pid = match launched {
        Ok(pid) => pid,
        // The host, not the command: out of processes, memory or descriptors. Nothing ran,
        // and the job is not to blame (the worker takes the assignment back uncounted).
        Err(e) if e.raw_os_error().is_some_and(host_failure) => {
            eprintln!("baton-guard: cannot start {:?} now: {e}", args.command[0]);
            return Ok(NOT_STARTED);
        }
        Err(e) => {
            let rec = ExitRecord {
                version: EXIT_RECORD_VERSION,
                job_id: args.job_id.clone(),
                attempt: args.attempt,
                term: args.term,
                pid: 0,
                started_boottime_ns: started.as_nanos(),
                ended_boottime_ns: BootInstant::now().as_nanos(),
                exit_code: None,
                signal: None,
                killed_by: None,
                start_error: Some(StartError::new(&args.command[0], &e)),
            };
            eprintln!("baton-guard: cannot start {:?}: {e}", args.command[0]);
            write_exit(&args, &rec)?;
            return Ok(0);
        }
    };
    // Whoever finds this guard gone without an exit record kills the job's group by it.
    let _ = std::fs::write(pid_path(&args.dir, &args.name), pid.to_string());
    ledger(&args, "start", pid, None);
    let group = Pid::from_raw(pid);
    // Without a pidfd (an old kernel, no descriptor left) the loop below still notices the
    // exit at its next bounded wake-up; the job is running, so this must not fail the guard.
    let pidfd = crate::pidfd_open(pid as u32).ok();
    let timeout_at = started + t.timeout;
    let mut killed_by: Option<KilledBy> = None;
    let mut kill_at: Option<BootInstant> = None;

    loop {
        let now = BootInstant::now();
        // Reap first: a job that ended on its own at the moment its leader went away must be
        // recorded as ended, not as killed (a new leader would run it again).
        let reaped = try_wait(group)?;
        if reaped.is_none() && killed_by.is_none() {
            let reason = if feed.closed {
                Some(KilledBy::LeaderGone)
            } else if now + t.margin >= deadline && !args.unsafe_ignore_deadlines {
                Some(KilledBy::Deadline)
            } else if now >= timeout_at {
                Some(KilledBy::Timeout)
            } else if feed.kill {
                Some(KilledBy::Cancel)
            } else {
                None
            };
            if let Some(r) = reason {
                let _ = killpg(group, Signal::SIGKILL);
                killed_by = Some(r);
            } else if feed.term && kill_at.is_none() {
                let _ = killpg(group, Signal::SIGTERM);
                kill_at = Some(now + t.kill_grace);
            }
        }
        if let Some(at) = kill_at {
            if reaped.is_none() && now >= at && killed_by.is_none() {
                let _ = killpg(group, Signal::SIGKILL);
                killed_by = Some(KilledBy::Cancel);
            }
        }
        let status = match reaped {
            Some(s) => Some(s),
            None if killed_by.is_some() => try_wait(group)?,
            None => None,
        };
        if let Some(status) = status {
            // Nothing of the job may outlive its attempt: kill what is left of its group, and
            // wait until it is empty, so an immediate reschedule cannot overlap it. A process
            // that SIGKILL cannot end (stuck in the kernel) holds the attempt open, and its
            // slot taken, for as long as it lives.
            // Polled with a growing pause, and /proc scanned at most once a second: hundreds
            // of guards ending at once (a worker's lease lost) must not load the host.
            let mut told = BootInstant::now() + Duration::from_secs(10);
            let mut scan_at = BootInstant::now() + Duration::from_millis(200);
            let mut pause = Duration::from_millis(1);
            loop {
                let _ = killpg(group, Signal::SIGKILL);
                reap_orphans(group);
                match killpg(group, None) {
                    Err(nix::errno::Errno::ESRCH) => break,
                    // Only zombies left (their parent left the group and never reaps them):
                    // nothing of the job runs any more.
                    _ if BootInstant::now() >= scan_at => {
                        if only_zombies(pid) {
                            break;
                        }
                        scan_at = BootInstant::now() + Duration::from_secs(1);
                    }
                    _ => {}
                }
                if BootInstant::now() >= told {
                    eprintln!(
                        "baton-guard: job {}: its process group survives SIGKILL; waiting",
                        args.job_id
                    );
                    told = BootInstant::now() + Duration::from_secs(60);
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            // A kill that lost the race against a normal exit did not end the job.
            let killed_by = match killed_by {
                Some(k) if k != KilledBy::Cancel && status.code().is_some() => None,
                Some(k) => Some(k),
                None if feed.term => Some(KilledBy::Cancel),
                None => None,
            };
            let rec = ExitRecord {
                version: EXIT_RECORD_VERSION,
                job_id: args.job_id.clone(),
                attempt: args.attempt,
                term: args.term,
                pid,
                started_boottime_ns: started.as_nanos(),
                ended_boottime_ns: BootInstant::now().as_nanos(),
                exit_code: status.code(),
                signal: status.signal(),
                killed_by,
                start_error: None,
            };
            write_exit(&args, &rec)?;
            ledger(&args, "end", pid, Some(&rec));
            return Ok(0);
        }
        reap_orphans(group);
        // Sleep until the job exits, the leader speaks, a signal comes, or the next deadline;
        // at most half the margin, as poll's clock stops while the host is suspended.
        let mut next = deadline - t.margin;
        next = next.min(timeout_at);
        if let Some(at) = kill_at {
            next = next.min(at);
        }
        let cap = (t.margin / 2).clamp(Duration::from_millis(20), Duration::from_secs(1));
        let wait = now.until(next).min(cap);
        let exited = pidfd.as_ref().map_or(signals.as_fd(), |p| p.as_fd());
        let mut fds = [
            PollFd::new(feed.fd.as_fd(), PollFlags::POLLIN),
            PollFd::new(exited, PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        if feed.closed {
            fds[0] = PollFd::new(exited, PollFlags::POLLIN);
        }
        let _ = poll(
            &mut fds,
            PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX),
        );
        let sig_ready = fds[2].revents().is_some_and(|r| !r.is_empty());
        if sig_ready {
            while let Ok(Some(_)) = signals.read_signal() {}
            feed.closed = true;
        }
        if !feed.closed {
            feed.read_available()?;
            if let Some(d) = feed.deadline {
                deadline = deadline.max(d);
            }
        }
    }
}

/// Whether every process left in group `pgid` is a zombie (from /proc).
fn only_zombies(pgid: i32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp ...`: comm may hold spaces, so split after the last ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let (state, _ppid, pgrp) = (f.next(), f.next(), f.next());
        if pgrp.and_then(|g| g.parse::<i32>().ok()) == Some(pgid) && state != Some("Z") {
            return false;
        }
    }
    true
}

/// Reaps the exited descendants handed to the guard as their subreaper, all but the job: while
/// it runs, so a job that leaves short-lived processes behind (a daemonizing script, a shell's
/// `&`) does not fill the host's process table with zombies for as long as it runs, and after
/// it, until its group is empty. The job's status is the attempt's (`try_wait`); a job that
/// exited and is not reaped yet ends the round.
fn reap_orphans(job: Pid) {
    use nix::libc;
    loop {
        // `libc` rather than nix's `waitid`, which fails to decode a child killed by a
        // realtime signal: that zombie would come first at every peek and stop the reaping.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let peek = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
        // SAFETY: `info` is a valid, writable siginfo_t for the call's duration.
        if unsafe { libc::waitid(libc::P_ALL, 0, &mut info, peek) } != 0 {
            return;
        }
        // SAFETY: filled by waitid (zero when no child has exited).
        let pid = unsafe { info.si_pid() };
        if pid == 0 || pid == job.as_raw() {
            return;
        }
        // SAFETY: reaps exactly the exited child just peeked at; no status is needed.
        unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
    }
}

/// The job's status once it has exited (the job is reaped then), without blocking.
fn try_wait(job: Pid) -> std::io::Result<Option<ExitStatus>> {
    let mut status = 0;
    // SAFETY: waits for exactly the job, the guard's own child; `status` is writable.
    match unsafe { nix::libc::waitpid(job.as_raw(), &mut status, nix::libc::WNOHANG) } {
        0 => Ok(None),
        p if p > 0 => Ok(Some(ExitStatus::from_raw(status))),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Whether a stop signal (the parent's death, SIGHUP from an abandon, SIGTERM) is pending.
fn let_go(signals: &SignalFd) -> bool {
    matches!(signals.read_signal(), Ok(Some(_)))
}

/// Writes the record over the pid file, fsyncs it, renames it into place and fsyncs the
/// folder: only then is the attempt's end on disk. Opened by its name, not kept open since the
/// pid was written: the job may have removed or replaced that file in its folder.
fn write_exit(args: &Spec, rec: &ExitRecord) -> std::io::Result<()> {
    let path = exit_path(&args.dir, &args.name);
    let tmp = pid_path(&args.dir, &args.name);
    let body = serde_json::to_vec(rec).expect("exit record serializes");
    if write_synced(&tmp, &body, false).is_err() {
        // Something of the job's where the pid file was (a symlink, a FIFO, a folder), or no
        // folder at all: a new file instead. Only then, as ext4 without a journal pays for
        // every new inode.
        let _ = std::fs::remove_file(&tmp).or_else(|_| std::fs::remove_dir_all(&tmp));
        let _ = std::fs::create_dir_all(&args.dir);
        write_synced(&tmp, &body, true)?;
    }
    std::fs::rename(&tmp, &path)?;
    // The rename itself must survive a power loss: a lost record means a job run again.
    std::fs::File::open(&args.dir)?.sync_all()
}

/// Writes `body` as the whole of the regular file `path` and fsyncs it: an existing file
/// (never through a symlink, never blocking on a FIFO), or only a new one if `new`.
fn write_synced(path: &std::path::Path, body: &[u8], new: bool) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut opts = OpenOptions::new();
    opts.write(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK);
    if new {
        opts.create_new(true);
    } else {
        opts.create(true);
    }
    let mut file = opts.open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::from_raw_os_error(nix::libc::EINVAL));
    }
    file.set_len(0)?;
    file.write_all(body)?;
    file.sync_all()
}

/// `errno`s of a failed spawn that say the host is short of something, not that the command
/// cannot run.
fn host_failure(errno: i32) -> bool {
    use nix::errno::Errno;
    [Errno::EAGAIN, Errno::ENOMEM, Errno::EMFILE, Errno::ENFILE]
        .iter()
        .any(|e| *e as i32 == errno)
}

/// The leader's messages on stdin, read without blocking.
struct Feed {
    fd: OwnedFd,
    buf: Vec<u8>,
    deadline: Option<BootInstant>,
    term: bool,
    kill: bool,
    closed: bool,
}

impl Feed {
    fn new(fd: OwnedFd) -> Feed {
        let _ = nix::fcntl::fcntl(
            fd.as_fd(),
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        );
        Feed {
            fd,
            buf: Vec::new(),
            deadline: None,
            term: false,
            kill: false,
            closed: false,
        }
    }

    fn wait(&mut self, at_most: Duration) -> std::io::Result<()> {
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        let _ = poll(
            &mut fds,
            PollTimeout::try_from(at_most).unwrap_or(PollTimeout::MAX),
        );
        self.read_available()
    }

    fn read_available(&mut self) -> std::io::Result<()> {
        let mut file = unsafe { std::fs::File::from_raw_fd(self.fd.as_raw_fd()) };
        let mut chunk = [0u8; 4096];
        let result = loop {
            match file.read(&mut chunk) {
                Ok(0) => {
                    self.closed = true;
                    break Ok(());
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => break Err(e),
            }
        };
        // The descriptor belongs to `self.fd`; do not close it here.
        std::mem::forget(file);
        let lines: Vec<String> = BufReader::new(&self.buf[..])
            .lines()
            .map_while(Result::ok)
            .collect();
        let complete = self.buf.ends_with(b"\n");
        let keep = if complete {
            0
        } else {
            lines.last().map_or(0, |l| l.len())
        };
        let n = if complete {
            lines.len()
        } else {
            lines.len().saturating_sub(1)
        };
        for line in &lines[..n] {
            let line = line.trim();
            if let Some(ns) = line.strip_prefix("D ") {
                if let Ok(ns) = ns.parse::<u64>() {
                    let d = BootInstant::from_nanos(ns);
                    self.deadline = Some(self.deadline.map_or(d, |old| old.max(d)));
                }
            } else if line == "TERM" {
                self.term = true;
            } else if line == "KILL" {
                self.kill = true;
            }
        }
        let tail = self.buf.len() - keep;
        self.buf.drain(..tail);
        result
    }
}
