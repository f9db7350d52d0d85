//! Running commands under lease guards, apart from whoever decides to run them.
//!
//! This module knows nothing of leadership, jobs or etcd: it takes a [`spawner::Launch`] and a
//! stream of proven deadlines, and guarantees that the command runs niced under a guard that
//! kills its whole process group when the deadlines stop, the pipe closes or the parent dies;
//! it leaves an exit record and a log ([`record`]) for whoever decides what happened.

pub mod guard;
pub mod record;
pub mod spawner;

use std::os::fd::{FromRawFd, OwnedFd};

/// A descriptor that becomes readable when process `pid` exits (Linux 5.3+).
pub(crate) fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
