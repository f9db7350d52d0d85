//! Baton's lease guard: the direct parent of every job process, a program of its own.
//!
//! Every running job holds one guard for its whole life, so the guard is kept small: no async
//! runtime, no argument parser, no logging framework; it links `nix`, `serde` and
//! `serde_json`, and its memory per running job is what `baton bench` prints. The worker talks
//! to it through its command line (one JSON [`Spec`]) and a pipe on stdin ([`run`]'s protocol).
//!
//! The worker opens the guard binary once at start, checks [`PROTOCOL`] (`baton-guard
//! protocol`), and spawns every guard through that open descriptor; the `baton` binary still
//! runs the same code as `baton __guard` (the legacy guard `baton bench` compares against).

pub mod clock;
pub mod record;
mod run;
mod spawn;

use std::ffi::OsString;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use run::run;

/// The version of the worker-guard protocol: the [`Spec`], the stdin lines, the files it writes.
/// A worker spawns only a guard that answers the same number.
pub const PROTOCOL: u32 = 3;

/// Exit code of a guard that did not start its job (the deadline had passed, no deadline came,
/// its parent was gone).
pub const NOT_STARTED: i32 = 75;

/// Exit code of a guard that failed (bad arguments, an unwritable folder): no record is left.
pub const GUARD_FAILED: i32 = 70;

/// Everything about one execution the guard needs, given as its one argument (JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// Must equal [`PROTOCOL`].
    pub protocol: u32,
    pub job_id: String,
    pub attempt: u32,
    pub term: i64,
    /// The job's folder (its working directory); the log and exit record go here.
    pub dir: PathBuf,
    /// Name of the log and exit files (`attempt-<n>` for jobs, `cleanup-<n>` for cleanups).
    pub name: String,
    /// The job is killed at `deadline - margin`.
    pub margin_ms: u64,
    /// The attempt's timeout.
    pub timeout_ms: u64,
    /// After a cancel's SIGTERM, the time before SIGKILL.
    pub kill_grace_ms: u64,
    /// How long to wait for the first deadline (the go) before giving up without starting.
    pub go_within_ms: u64,
    /// Append a JSON line per execution start and end to this file (drills audit them).
    #[serde(default)]
    pub ledger: Option<PathBuf>,
    /// The job's niceness, at least (0 to 19; a guard already nicer passes its own on); the
    /// guard itself keeps its own.
    #[serde(default)]
    pub nice: i32,
    /// The spawning process: a guard that finds another parent at start starts nothing.
    #[serde(default)]
    pub parent_pid: Option<i32>,
    /// Negative control for drills: ignore lease deadlines (only a closed pipe kills the job).
    #[serde(default)]
    pub unsafe_ignore_deadlines: bool,
    /// The soft `RLIMIT_NOFILE` the job gets: the worker's before it raised its own, so a
    /// job sees the host's usual limit (programs that `select()` or close every descriptor
    /// up to the limit break on a huge one).
    #[serde(default)]
    pub nofile: Option<u64>,
    /// The command and its arguments.
    pub command: Vec<String>,
}

impl Spec {
    /// Why this spec cannot be run, if it cannot.
    pub fn invalid(&self) -> Option<String> {
        if self.protocol != PROTOCOL {
            return Some(format!(
                "protocol {} asked, this guard speaks {PROTOCOL}",
                self.protocol
            ));
        }
        if self.command.is_empty() {
            return Some("no command".into());
        }
        if !(0..=19).contains(&self.nice) {
            return Some(format!("nice {} is not in 0..=19", self.nice));
        }
        None
    }
}

/// A fingerprint of the sources this guard was built from (guard/build.rs): the program is
/// built apart from `baton` (scripts/build-guard), so the tests check that the one they run
/// was built from the code beside them.
pub const SOURCE: &str = env!("BATON_GUARD_SOURCE");

const USAGE: &str =
    "usage: baton-guard run <spec as JSON> | baton-guard protocol | baton-guard source\n\
    (started by a Baton worker, not by hand)";

/// The program: `run <spec>` runs one execution, `protocol` prints [`PROTOCOL`], `source`
/// prints [`SOURCE`]. Returns the
/// process exit code.
pub fn main(args: impl IntoIterator<Item = OsString>) -> i32 {
    let args: Vec<OsString> = args.into_iter().collect();
    match args.first().and_then(|a| a.to_str()) {
        Some("protocol") if args.len() == 1 => {
            println!("{PROTOCOL}");
            0
        }
        Some("source") if args.len() == 1 => {
            println!("{SOURCE}");
            0
        }
        Some("run") if args.len() == 2 => {
            // The protocol first: a spec of another release gets that answer, not a field's.
            let value = match args[1]
                .to_str()
                .map(serde_json::from_str::<serde_json::Value>)
            {
                Some(Ok(v)) => v,
                Some(Err(e)) => return fail(&format!("bad spec: {e}")),
                None => return fail("bad spec: not UTF-8"),
            };
            let asked = value.get("protocol").and_then(|p| p.as_u64());
            if asked != Some(PROTOCOL as u64) {
                return fail(&format!(
                    "protocol {} asked, this guard speaks {PROTOCOL}",
                    asked.map_or("none".into(), |p| p.to_string())
                ));
            }
            let spec = match serde_json::from_value::<Spec>(value) {
                Ok(spec) => spec,
                Err(e) => return fail(&format!("bad spec: {e}")),
            };
            match spec.invalid() {
                Some(why) => fail(&why),
                None => run(spec),
            }
        }
        _ => fail(USAGE),
    }
}

/// A descriptor that becomes readable when process `pid` exits (Linux 5.3+).
pub fn pidfd_open(pid: u32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: a plain system call; a descriptor it returns is new and ours.
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

fn fail(why: &str) -> i32 {
    eprintln!("baton-guard: {why}");
    GUARD_FAILED
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Spec {
        Spec {
            protocol: PROTOCOL,
            job_id: "j".into(),
            attempt: 1,
            term: 3,
            dir: "/tmp/x".into(),
            name: "attempt-1".into(),
            margin_ms: 200,
            timeout_ms: 1000,
            kill_grace_ms: 100,
            go_within_ms: 5000,
            ledger: None,
            nice: 0,
            parent_pid: None,
            unsafe_ignore_deadlines: false,
            nofile: None,
            command: vec!["true".into()],
        }
    }

    #[test]
    fn a_spec_round_trips_and_a_wrong_one_is_named() {
        let s = spec();
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Spec>(&text).unwrap(), s);
        assert_eq!(s.invalid(), None);
        let old = Spec {
            protocol: 1,
            ..spec()
        };
        assert!(old.invalid().unwrap().contains("protocol 1"));
        let empty = Spec {
            command: vec![],
            ..spec()
        };
        assert_eq!(empty.invalid().as_deref(), Some("no command"));
        let nice = Spec { nice: 20, ..spec() };
        assert!(nice.invalid().is_some());
        let unknown = text.replace("\"nice\"", "\"nicety\"");
        assert!(serde_json::from_str::<Spec>(&unknown).is_err());
    }

    #[test]
    fn bad_command_lines_fail_without_running_anything() {
        assert_eq!(main(Vec::<OsString>::new()), GUARD_FAILED);
        assert_eq!(main(["run".into(), "{".into()]), GUARD_FAILED);
        let old = serde_json::to_string(&Spec {
            protocol: 1,
            ..spec()
        })
        .unwrap();
        assert_eq!(main(["run".into(), old.into()]), GUARD_FAILED);
        assert_eq!(main(["protocol".into()]), 0);
        assert_eq!(main(["source".into()]), 0);
        assert_eq!(SOURCE.len(), 16, "{SOURCE}");
    }
}
