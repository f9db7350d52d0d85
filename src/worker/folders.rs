//! The root of the jobs' folders (`<storage>/jobs`), spread over the filesystem.
//!
//! Every attempt creates a folder and a few files in it, and cleanup removes them, so a busy
//! worker frees inodes by the thousand. ext4 without a journal skips, for a minute or more, an
//! inode freed recently, and looks for a free one from the start of the group every time:
//! with every job's folder in one (flex) group, each new file walked past all the recently
//! freed ones, and that walk cost more CPU than the job and its guard together (`perf`, the
//! end-to-end benchmark on a journal-less ext4 root). Marking the root as a top of directory
//! hierarchies (`chattr +T`) makes ext4's Orlov allocator place each job's folder, and so its
//! files, in a flex group of its own choosing, as it does for folders at the filesystem's
//! root. With a journal there is no walk to avoid, and the flag costs a look at every flex
//! group's counters per folder made. The flag is set at every start (a `chattr -T` by hand
//! lasts until the next).

use std::path::Path;

use crate::exec::record::jobs_root;

/// `FS_TOPDIR_FL` of `linux/fs.h`, which the `libc` crate does not export.
const FS_TOPDIR_FL: nix::libc::c_int = 0x0002_0000;

/// Creates `<storage>/jobs` and marks it as a top directory where the filesystem has the
/// notion (ext2/3/4). Never fails a start: a folder that cannot be made is each attempt's
/// error (its assignment rejected with the reason), as before, and a flag that cannot be set
/// (tmpfs, xfs, overlayfs, a foreign owner) leaves the folders where the filesystem puts them.
pub fn prepare(storage: &Path) {
    let root = jobs_root(storage);
    if let Err(e) = std::fs::create_dir_all(&root) {
        tracing::warn!(dir = %root.display(), error = %e, "cannot create the jobs' folder root; jobs assigned here will be rejected until it can be");
        return;
    }
    if let Err(e) = mark_top(&root) {
        tracing::debug!(dir = %root.display(), error = %e, "jobs' folders stay where the filesystem puts them");
    }
}

fn mark_top(dir: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(dir)?;
    let mut flags: nix::libc::c_int = 0;
    // SAFETY: both ioctls read or write one `int` through the pointer, which outlives them.
    if unsafe { nix::libc::ioctl(f.as_raw_fd(), nix::libc::FS_IOC_GETFLAGS, &mut flags) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if flags & FS_TOPDIR_FL != 0 {
        return Ok(());
    }
    flags |= FS_TOPDIR_FL;
    if unsafe { nix::libc::ioctl(f.as_raw_fd(), nix::libc::FS_IOC_SETFLAGS, &flags) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_is_made_and_a_second_prepare_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        prepare(dir.path());
        let root = jobs_root(dir.path());
        assert!(root.is_dir());
        prepare(dir.path());
        assert!(root.is_dir());
    }

    #[test]
    fn a_root_that_cannot_be_made_is_no_error_at_start() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("jobs"), "a file where the folder goes").unwrap();
        prepare(dir.path());
        assert!(jobs_root(dir.path()).is_file());
    }
}
