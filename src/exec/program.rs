//! Which program runs the guards, opened once and checked once.
//!
//! Guarantees:
//! - **Opened at start, spawned through the descriptor.** The worker opens the guard binary
//!   when it starts and runs every guard as `/proc/self/fd/<n>`, so an upgrade that replaces or
//!   removes the file (a rename or an unlink, as package managers and image builds do) changes
//!   nothing until the worker restarts. (A write into the very file, which the kernel refuses
//!   while any guard runs it, is seen: that is how the tests break a guard binary.)
//! - **The same protocol or nothing.** At open, the program must answer `protocol` with this
//!   worker's [`PROTOCOL`]; a missing, unexecutable or different guard is an error at worker
//!   start, never a fallback to another way of running jobs.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::exec::guard::PROTOCOL;

/// Which guard program a worker runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GuardKind {
    /// `baton-guard`, the small program next to `baton` (or `--guard-bin`).
    #[default]
    Small,
    /// `baton __guard`: the same code in the whole `baton` binary (what `baton bench` compares
    /// against).
    Legacy,
}

impl GuardKind {
    /// Its `--guard` value.
    pub fn name(self) -> &'static str {
        match self {
            GuardKind::Small => "small",
            GuardKind::Legacy => "legacy",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error("cannot open the guard binary {path}: {source} (install baton-guard next to baton, as scripts/build-guard does, or give --guard-bin)")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot run the guard binary {path}: {source}")]
    Run {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the guard binary {path} does not answer its protocol version: {detail}")]
    NoAnswer { path: PathBuf, detail: String },
    #[error("the guard binary {path} speaks protocol {got}, this worker {PROTOCOL}: install the baton-guard of the same release")]
    Protocol { path: PathBuf, got: String },
}

/// The guard program, open.
#[derive(Debug)]
pub struct GuardProgram {
    fd: OwnedFd,
    path: PathBuf,
    kind: GuardKind,
}

/// How long the protocol check may take before the program counts as broken.
const CHECK_WITHIN: Duration = Duration::from_secs(10);

impl GuardProgram {
    /// The default program of `kind`: `baton-guard` next to the running executable, or the
    /// running executable itself for [`GuardKind::Legacy`].
    pub fn default_path(kind: GuardKind) -> std::io::Result<PathBuf> {
        let exe = std::env::current_exe()?;
        Ok(match kind {
            GuardKind::Small => exe.with_file_name("baton-guard"),
            GuardKind::Legacy => exe,
        })
    }

    /// Opens `path` and checks that it speaks this worker's protocol (blocking; at start).
    pub fn open(path: &Path, kind: GuardKind) -> Result<GuardProgram, ProgramError> {
        let file = std::fs::File::open(path).map_err(|source| ProgramError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let program = GuardProgram {
            fd: file.into(),
            path: path.to_path_buf(),
            kind,
        };
        program.check()?;
        Ok(program)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn kind(&self) -> GuardKind {
        self.kind
    }

    /// A command that runs the guard program with `args` (through the open descriptor).
    pub fn command<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut cmd = Command::new(format!("/proc/self/fd/{}", self.fd.as_raw_fd()));
        cmd.arg0(match self.kind {
            GuardKind::Small => "baton-guard",
            GuardKind::Legacy => "baton",
        });
        if self.kind == GuardKind::Legacy {
            cmd.arg("__guard");
        }
        cmd.args(args);
        cmd
    }

    /// Runs `protocol` and compares the answer with [`PROTOCOL`].
    fn check(&self) -> Result<(), ProgramError> {
        let path = self.path.clone();
        let mut child = self
            .command(["protocol"])
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| ProgramError::Run {
                path: path.clone(),
                source,
            })?;
        let until = Instant::now() + CHECK_WITHIN;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(ProgramError::NoAnswer {
                        path,
                        detail: format!("no answer within {CHECK_WITHIN:?}"),
                    });
                }
                Err(source) => return Err(ProgramError::Run { path, source }),
            }
        };
        let out = child
            .wait_with_output()
            .map_err(|source| ProgramError::Run {
                path: path.clone(),
                source,
            })?;
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !status.success() {
            let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
            return Err(ProgramError::NoAnswer {
                path,
                detail: format!("it exited with {status}: {err}"),
            });
        }
        if answer != PROTOCOL.to_string() {
            return Err(ProgramError::Protocol { path, got: answer });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("guard");
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[test]
    fn a_missing_or_foreign_guard_binary_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = GuardProgram::open(&dir.path().join("nope"), GuardKind::Small);
        assert!(
            matches!(missing, Err(ProgramError::Open { .. })),
            "{missing:?}"
        );
        let garbage = script(dir.path(), "not a program\n");
        let broken = GuardProgram::open(&garbage, GuardKind::Small).unwrap_err();
        assert!(matches!(broken, ProgramError::Run { .. }), "{broken:?}");
        assert!(broken.to_string().contains("cannot run the guard binary"));
    }
}
