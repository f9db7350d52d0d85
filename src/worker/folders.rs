//! The root of the jobs' folders (`<storage>/jobs`), spread over the filesystem.
//!
//! Every attempt creates a folder and a few files in it, and cleanup removes them, so a busy
//! worker frees inodes by the thousand. ext4 without a journal will not reuse an inode freed
//! in the last 30 seconds, and looks for a free one from the start of the block group every
//! time: with every job's folder in one group, each new file walked past all the recently
//! freed ones, and that walk cost more CPU than the job and its guard together (`perf`, the
//! end-to-end benchmark on a journal-less ext4 root). Marking the root as a top of directory
//! hierarchies (`chattr +T`) makes ext4 place each job's folder, and so its files, in a group
//! of its own choosing, as it does for folders at the filesystem's root.

use std::path::{Path, PathBuf};

/// `FS_TOPDIR_FL` of `linux/fs.h`, which the `libc` crate does not export.
const FS_TOPDIR_FL: nix::libc::c_int = 0x0002_0000;

/// Creates `<storage>/jobs` and marks it as a top directory where the filesystem has the
/// notion (ext2/3/4); elsewhere, and where the flag cannot be set, the folder is made all
/// the same.
pub fn prepare(storage: &Path) -> std::io::Result<PathBuf> {
    let root = storage.join("jobs");
    std::fs::create_dir_all(&root)?;
    if let Err(e) = mark_top(&root) {
        tracing::debug!(dir = %root.display(), error = %e, "jobs' folders stay where the filesystem puts them");
    }
    Ok(root)
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
        let root = prepare(dir.path()).unwrap();
        assert!(root.is_dir());
        prepare(dir.path()).unwrap();
        assert!(root.is_dir());
    }
}
