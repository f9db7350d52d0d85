//! Starting the job: `clone(CLONE_VM | CLONE_VFORK)`, then `execvp` in the child.
//!
//! A `fork` copies the guard's page tables and marks its memory copy-on-write, the `exec` then
//! tears the copy down, and the guard pays page faults on its own memory afterwards: on this
//! project's test VM that was about a tenth of the guard's CPU per job (docs/performance.md).
//! Here the child borrows the guard's memory, on a stack of its own, until it execs; the guard
//! is suspended meanwhile. So the child calls only thin system call wrappers, on data prepared
//! before the clone, with every signal blocked until just before the exec.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

use nix::libc;

use crate::NOT_STARTED;

/// Everything the child needs, built before the clone (the child must not allocate).
pub struct Launch {
    argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    dir: CString,
    stdin: OwnedFd,
    log: OwnedFd,
    guard_pid: libc::pid_t,
    nice: Option<i32>,
    /// The child's `errno` when it could not exec, written through the shared memory.
    err: AtomicI32,
}

/// The child's stack beyond what glibc's `execvp` puts there per argument (its fallback for a
/// script without `#!` copies the argument vector onto the stack, as `posix_spawn` sizes for):
/// a `PATH_MAX` buffer and the frames of a few calls. Only the pages the child touches are ever
/// backed, and a page below it is left unmapped, so an overflow faults in the child instead of
/// writing over the guard's memory.
const STACK_BASE: usize = 64 * 1024;

/// An anonymous mapping for the child's stack, with an inaccessible page at its low end.
struct Stack {
    base: *mut libc::c_void,
    len: usize,
}

impl Stack {
    fn new(args: usize) -> io::Result<Stack> {
        // SAFETY: sysconf has no preconditions.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => 4096,
        };
        let len =
            (STACK_BASE + (args + 2) * std::mem::size_of::<usize>()).div_ceil(page) * page + page;
        // SAFETY: a fresh private anonymous mapping; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Stack { base, len };
        // SAFETY: the lowest page of the mapping just made.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// The initial stack pointer: the stack grows down from the end, 16-byte aligned.
    fn top(&self) -> *mut libc::c_void {
        ((self.base as usize + self.len) & !15) as *mut libc::c_void
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made, once the child no longer uses it.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

impl Launch {
    /// `stdin` and `log` become the job's standard input and its output (stdout and stderr).
    pub fn new(
        command: &[String],
        dir: &Path,
        stdin: OwnedFd,
        log: OwnedFd,
        nice: Option<i32>,
    ) -> io::Result<Launch> {
        let cstr =
            |b: &[u8]| CString::new(b).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL));
        let argv = command
            .iter()
            .map(|a| cstr(a.as_bytes()))
            .collect::<io::Result<Vec<_>>>()?;
        if argv.is_empty() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut argv_ptrs: Vec<_> = argv.iter().map(|a| a.as_ptr()).collect();
        argv_ptrs.push(std::ptr::null());
        Ok(Launch {
            argv,
            argv_ptrs,
            dir: cstr(OsStr::as_bytes(dir.as_os_str()))?,
            stdin: above_stdio(stdin)?,
            log: above_stdio(log)?,
            guard_pid: std::process::id() as libc::pid_t,
            nice,
            err: AtomicI32::new(0),
        })
    }

    /// Starts the job in a process group of its own; returns its pid once it has exec'd. An
    /// error is either the clone's (the host is short of something) or the child's, before or
    /// at its exec (the command or its folder), in which case the child is already reaped.
    pub fn spawn(self) -> io::Result<libc::pid_t> {
        let stack = Stack::new(self.argv.len())?;
        let all = full_set();
        let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid sigset pointers; blocking every signal here means no handler of the
        // guard's can run in the child while it shares the guard's memory.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) };
        // SAFETY: `child` runs on its own stack, `stack`, which outlives it (CLONE_VFORK
        // returns only after the child's exec or exit), and only reads `self`.
        let pid = unsafe {
            libc::clone(
                child,
                stack.top(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                &self as *const Launch as *mut libc::c_void,
            )
        };
        let clone_err = io::Error::last_os_error();
        // SAFETY: restores the mask saved above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
        drop(stack);
        if pid < 0 {
            return Err(clone_err);
        }
        match self.err.load(Ordering::SeqCst) {
            0 => Ok(pid),
            errno => {
                // SAFETY: reaps exactly the child that failed before its exec.
                unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
                Err(io::Error::from_raw_os_error(errno))
            }
        }
    }
}

/// The child, until its exec: system calls only, on what `Launch::new` prepared.
extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Launch` the suspended parent passed, alive until we exec or exit.
    let l = unsafe { &*(arg as *const Launch) };
    let fail = |l: &Launch| -> libc::c_int {
        let errno = io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        l.err.store(errno.max(1), Ordering::SeqCst);
        // SAFETY: ends the child without running any of the guard's exit handlers.
        unsafe { libc::_exit(127) }
    };
    // SAFETY: plain system calls on valid descriptors and pointers.
    unsafe {
        if libc::setpgid(0, 0) != 0
            || libc::dup2(l.stdin.as_raw_fd(), 0) < 0
            || libc::dup2(l.log.as_raw_fd(), 1) < 0
            || libc::dup2(l.log.as_raw_fd(), 2) < 0
            || libc::chdir(l.dir.as_ptr()) != 0
        {
            return fail(l);
        }
        // The job dies with its guard; and if the guard died before this line, it never runs.
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
        {
            return fail(l);
        }
        if libc::getppid() != l.guard_pid {
            libc::_exit(NOT_STARTED);
        }
        if let Some(nice) = l.nice {
            libc::setpriority(libc::PRIO_PROCESS, 0, nice);
        }
        // Rust's runtime ignores SIGPIPE; the job gets the default, as `std::process` gives.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        // The signals the guard blocks (and the ones blocked for the clone) must not stay
        // blocked in the job.
        let empty = empty_set();
        libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::execvp(l.argv[0].as_ptr(), l.argv_ptrs.as_ptr());
    }
    fail(l)
}

/// A descriptor numbered 3 or above, close-on-exec, so the child's `dup2` onto 0-2 never
/// meets itself (which would leave it close-on-exec, and the job without it).
fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: duplicates a valid descriptor; the new one is owned below.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` was just returned by fcntl and belongs to nobody else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(new) })
}

fn full_set() -> libc::sigset_t {
    let mut s: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: initializes a local sigset.
    unsafe { libc::sigfillset(&mut s) };
    s
}

fn empty_set() -> libc::sigset_t {
    let mut s: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: initializes a local sigset.
    unsafe { libc::sigemptyset(&mut s) };
    s
}
