//! What an execution leaves behind on disk: its exit record, its log, and a line per start and
//! end in the execution ledger. Written by the guard, read by whoever decides what happened.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// How much of an execution's output a result keeps.
pub const LOG_TAIL_BYTES: u64 = 4096;

/// One line of the execution ledger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerEntry {
    /// `start` or `end`.
    pub event: String,
    pub job_id: String,
    /// `attempt-<n>` or `cleanup-<n>`.
    pub name: String,
    pub term: i64,
    pub pid: i32,
    pub boottime_ns: u64,
    pub unix_ms: u64,
    #[serde(default)]
    pub exit: Option<ExitRecord>,
    /// The worker that ran it (`BATON_WORKER`), if any.
    #[serde(default)]
    pub worker: Option<String>,
}

/// Why the guard ended the job, if it did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KilledBy {
    /// The lease deadline passed without a renewal.
    Deadline,
    /// The leader went away (pipe closed, or parent-death signal).
    LeaderGone,
    Timeout,
    Cancel,
}

/// `attempt-<n>.exit`: what happened to one execution.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub version: u32,
    pub job_id: String,
    pub attempt: u32,
    pub term: i64,
    pub pid: i32,
    pub started_boottime_ns: u64,
    pub ended_boottime_ns: u64,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub killed_by: Option<KilledBy>,
    /// The command could not be started (nothing ran; not an exit code, not even 127).
    #[serde(default)]
    pub start_error: Option<StartError>,
}

/// Why the guard could not start a job's command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartError {
    /// The `errno` of the failed exec (or of what failed before it).
    pub errno: Option<i32>,
    /// What a person reads: the program and the system's message.
    pub message: String,
}

impl StartError {
    pub fn new(program: &str, e: &std::io::Error) -> StartError {
        let errno = e.raw_os_error();
        let text = match errno {
            Some(n) => format!("{} (errno {n})", nix::errno::Errno::from_raw(n).desc()),
            None => e.to_string(),
        };
        StartError {
            errno,
            message: format!("cannot execute {program:?}: {text}"),
        }
    }
}

pub const EXIT_RECORD_VERSION: u32 = 1;

/// `<storage>/jobs`: where the jobs' folders are.
pub fn jobs_root(storage: &Path) -> PathBuf {
    storage.join("jobs")
}

/// How many buckets the jobs' folders are spread over.
pub const BUCKETS: u64 = 64;

/// The bucket of a job's folder: `@` and two hex digits of the FNV-1a hash of its id, the same
/// on every host and release. `@` is in no job id, so a bucket is never taken for the folder of
/// a job (an older release kept them at `<storage>/jobs/<job>`).
pub fn bucket(job_id: &str) -> String {
    let hash = job_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("@{:02x}", hash % BUCKETS)
}

/// Whether a name in [`jobs_root`] is one of the buckets.
pub fn is_bucket(name: &str) -> bool {
    name.len() == 3
        && name.starts_with('@')
        && name[1..].bytes().all(|b| b.is_ascii_hexdigit())
        && u64::from_str_radix(&name[1..], 16).is_ok_and(|n| n < BUCKETS)
}

/// `<storage>/jobs/<bucket>/<job>`: the folder of a job on the host that runs it (scratch for
/// one attempt at a time; another worker's attempt gets another host's folder). Buckets keep
/// the folder made for every attempt out of the root, which is marked as a top of directory
/// hierarchies (see the worker's `folders`): ext4 then spreads the buckets once, and places
/// each job's folder in its bucket's group without weighing every group of the filesystem.
pub fn job_dir(storage: &Path, job_id: &str) -> PathBuf {
    jobs_root(storage).join(bucket(job_id)).join(job_id)
}

/// `<storage>/jobs/<job>`: where releases before the buckets kept a job's folder (read for
/// their leftovers: exit records, logs, folders to remove).
pub fn legacy_job_dir(storage: &Path, job_id: &str) -> PathBuf {
    jobs_root(storage).join(job_id)
}

pub fn exit_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.exit"))
}

/// The job's pid (its process group), written by the guard once the job started, in the file
/// its exit record is later written over and renamed from: one file per attempt fewer, and
/// creating files is most of what an attempt costs the filesystem. A guard that died while
/// writing its record (after the group was empty) leaves it unreadable; one that died before
/// writing the pid, or could not write it (a full disk), leaves none, and then only the job's
/// own parent-death signal ends it, not its descendants.
pub fn pid_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.exit.tmp"))
}

/// The job's pid from [`pid_path`], if the guard wrote it.
pub fn read_pid(dir: &Path, name: &str) -> Option<i32> {
    std::fs::read_to_string(pid_path(dir, name))
        .ok()?
        .trim()
        .parse()
        .ok()
}

pub fn log_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.log"))
}

/// Reads an exit record; `None` if absent or unreadable (a torn write cannot happen: it is
/// renamed into place).
pub fn read_exit(dir: &Path, name: &str) -> Option<ExitRecord> {
    let bytes = std::fs::read(exit_path(dir, name)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The last [`LOG_TAIL_BYTES`] of a log file, lossily as UTF-8.
pub fn log_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut buf = Vec::new();
    let _ = f.take(LOG_TAIL_BYTES).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}
