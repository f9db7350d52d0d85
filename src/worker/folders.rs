//! The root of the jobs' folders (`<storage>/jobs`), spread over the filesystem.
//!
//! Every attempt creates a folder and a few files in it, and cleanup removes them, so a busy
//! worker frees inodes by the thousand. ext4 without a journal skips, for a minute or more, an
//! inode freed recently, and looks for a free one from the start of the group every time:
//! with every job's folder in one (flex) group, each new file walked past all the recently
//! freed ones, and that walk cost more CPU than the job and its guard together (`perf`, the
//! end-to-end benchmark on a journal-less ext4 root). Marking the root as a top of directory
//! hierarchies (`chattr +T`) makes ext4's Orlov allocator spread the folders made in it over
//! the flex groups, as it does for folders at the filesystem's root, but it weighs every flex
//! group to place each one: made for every attempt, that was a fifth of the worker's CPU in the
//! same benchmark. So the root holds [`BUCKETS`] buckets, made once at start and spread that
//! way, and each job's folder goes in its bucket ([`job_dir`]), placed in the bucket's group
//! at the cost of one look. With a journal there is no walk to avoid. The flag is set at every
//! start (a `chattr -T` by hand lasts until the next).

use std::path::Path;

use crate::exec::record::{jobs_root, BUCKETS};

/// `FS_TOPDIR_FL` of `linux/fs.h`, which the `libc` crate does not export.
const FS_TOPDIR_FL: nix::libc::c_int = 0x0002_0000;

/// Creates `<storage>/jobs`, marks it as a top directory where the filesystem has the notion
/// (ext2/3/4), then makes its buckets. Never fails a start: a folder that cannot be made is
/// each attempt's error (its assignment rejected with the reason; an attempt makes its bucket
/// if it is missing), and a flag that cannot be set (tmpfs, xfs, overlayfs, a foreign owner)
/// leaves the folders where the filesystem puts them.
pub fn prepare(storage: &Path) {
    let root = jobs_root(storage);
    if let Err(e) = std::fs::create_dir_all(&root) {
        tracing::warn!(dir = %root.display(), error = %e, "cannot create the jobs' folder root; jobs assigned here will be rejected until it can be");
        return;
    }
    if let Err(e) = mark_top(&root) {
        tracing::debug!(dir = %root.display(), error = %e, "jobs' folders stay where the filesystem puts them");
    }
    for b in 0..BUCKETS {
        let bucket = root.join(format!("@{b:02x}"));
        if let Err(e) = std::fs::create_dir(&bucket) {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                tracing::warn!(dir = %bucket.display(), error = %e, "cannot create a bucket of the jobs' folders");
                return;
            }
        }
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
    use crate::exec::record::{bucket, is_bucket, job_dir};

    #[test]
    fn the_root_and_its_buckets_are_made_and_a_second_prepare_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        prepare(dir.path());
        let root = jobs_root(dir.path());
        let buckets = || {
            let mut names: Vec<String> = std::fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            names
        };
        let made = buckets();
        assert_eq!(made.len(), BUCKETS as usize);
        assert!(made.iter().all(|b| is_bucket(b)), "{made:?}");
        let dir_of = job_dir(dir.path(), "e2e-17");
        assert!(made.contains(
            &dir_of
                .parent()
                .unwrap()
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .to_string()
        ));
        prepare(dir.path());
        assert_eq!(buckets(), made);
    }

    #[test]
    fn a_bucket_is_never_a_job_id_and_every_bucket_is_used() {
        assert!(crate::jobs::spec::validate_id(&bucket("x")).is_err());
        assert!(!is_bucket("a1") && !is_bucket("@40") && !is_bucket("@0") && is_bucket("@3f"));
        let used: std::collections::HashSet<String> =
            (0..2000).map(|i| bucket(&format!("job-{i}"))).collect();
        assert_eq!(used.len(), BUCKETS as usize);
        // Fixed forever: hosts and releases must agree on every job's folder.
        assert_eq!(bucket("e2e-17"), "@10");
        assert_eq!(
            job_dir(Path::new("/s"), "a"),
            Path::new("/s/jobs").join(bucket("a")).join("a")
        );
    }

    #[test]
    fn a_root_that_cannot_be_made_is_no_error_at_start() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("jobs"), "a file where the folder goes").unwrap();
        prepare(dir.path());
        assert!(jobs_root(dir.path()).is_file());
    }
}
