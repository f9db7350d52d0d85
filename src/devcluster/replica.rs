//! `baton serve` replicas and `baton worker` workers as child processes: started, SIGKILLed,
//! SIGTERMed, paused, resumed.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag};
use nix::unistd::Pid;

use crate::clock::BootInstant;
use crate::rolelog::{self, Exit, RoleEvent};

/// How to start one replica.
#[derive(Clone, Debug)]
pub struct ReplicaSpec {
    pub id: String,
    pub bin: PathBuf,
    pub etcd_endpoints: Vec<String>,
    pub cluster: String,
    pub listen: SocketAddr,
    pub lease_ttl: Duration,
    /// Logs and the role log go here, named after the id.
    pub dir: PathBuf,
    /// Anything else for `baton serve` (or `baton worker`).
    pub extra_args: Vec<String>,
    /// A `baton worker` (id as its worker id; `listen` for its WorkerService; no role log)
    /// instead of a replica.
    pub worker: bool,
}

pub struct ReplicaProcess {
    spec: ReplicaSpec,
    child: Child,
    exit: Option<ExitStatus>,
    /// When this process was seen to exit: what ends its terms for the overlap check.
    exited: Arc<OnceLock<BootInstant>>,
    /// When the earlier processes of this replica exited.
    earlier: Vec<BootInstant>,
}

impl ReplicaProcess {
    pub fn spawn(spec: ReplicaSpec) -> std::io::Result<ReplicaProcess> {
        std::fs::create_dir_all(&spec.dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(spec.dir.join(format!("{}.log", spec.id)))?;
        let mut cmd = Command::new(&spec.bin);
        cmd.arg("--log-format").arg("json");
        if spec.worker {
            cmd.arg("worker").args(["--worker-id", &spec.id]);
            if !spec.extra_args.iter().any(|a| a == "--listen") {
                cmd.args(["--listen", &spec.listen.to_string()]);
            }
        } else {
            cmd.arg("serve")
                .args(["--replica-id", &spec.id])
                .args(["--listen", &spec.listen.to_string()])
                .arg("--role-log")
                .arg(role_log_path(&spec.dir, &spec.id));
        }
        if !spec.extra_args.iter().any(|a| a == "--lease-ttl") {
            cmd.args(["--lease-ttl", &format!("{}s", spec.lease_ttl.as_secs())]);
        }
        cmd.args(["--etcd-endpoints", &spec.etcd_endpoints.join(",")])
            .args(["--cluster", &spec.cluster])
            .args(&spec.extra_args)
            // Its own group: a Ctrl-C at the terminal is for the drill or `baton dev`, which
            // then stop the replicas in order (a replica that got it too would hand over early).
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // Dies with whoever started it, so an aborted test or dev session leaves nothing behind.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
            });
        }
        let child = cmd.spawn()?;
        let exited = Arc::new(OnceLock::new());
        let seen = exited.clone();
        let pid = Pid::from_raw(child.id() as i32);
        std::thread::Builder::new()
            .name(format!("exit-{}", spec.id))
            .spawn(move || {
                // WNOWAIT: seen without being reaped, so `Child` still reaps it (after this).
                while let Err(Errno::EINTR) =
                    waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT)
                {
                }
                let _ = seen.set(BootInstant::now());
            })?;
        Ok(ReplicaProcess {
            spec,
            child,
            exit: None,
            exited,
            earlier: Vec::new(),
        })
    }

    /// Every exit of this replica's processes seen so far, on `CLOCK_BOOTTIME`.
    pub fn exits(&self) -> Vec<Exit> {
        self.earlier
            .iter()
            .chain(self.exited.get())
            .map(|at| Exit {
                replica: self.spec.id.clone(),
                at: *at,
            })
            .collect()
    }

    pub fn id(&self) -> &str {
        &self.spec.id
    }

    pub fn spec(&self) -> &ReplicaSpec {
        &self.spec
    }

    pub fn listen(&self) -> SocketAddr {
        self.spec.listen
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log_path(&self) -> PathBuf {
        self.spec.dir.join(format!("{}.log", self.spec.id))
    }

    pub fn role_log_path(&self) -> PathBuf {
        role_log_path(&self.spec.dir, &self.spec.id)
    }

    /// The role events this replica has written so far. Panics on an unreadable role line:
    /// an audit that skips lines could miss a term.
    pub fn role_events(&self) -> Vec<RoleEvent> {
        let text = std::fs::read_to_string(self.role_log_path()).unwrap_or_default();
        rolelog::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", self.role_log_path().display()))
    }

    /// Whether this replica has logged that it watches the leader of `term` (fast failover):
    /// only then would it act on that leader's death within milliseconds.
    pub fn watches_leader_of(&self, term: i64) -> bool {
        let needle = format!("\"term\":{term},");
        std::fs::read_to_string(self.log_path())
            .unwrap_or_default()
            .lines()
            .any(|l| l.contains("\"watching the leader\"") && l.contains(&needle))
    }

    fn signal(&self, s: Signal) {
        if self.exit.is_none() {
            let _ = kill(Pid::from_raw(self.pid()), s);
        }
    }

    pub fn sigkill(&mut self) {
        self.signal(Signal::SIGKILL);
        let _ = self.wait_exit(Duration::from_secs(10));
    }

    pub fn sigterm(&self) {
        self.signal(Signal::SIGTERM);
    }

    pub fn pause(&self) {
        self.signal(Signal::SIGSTOP);
    }

    pub fn resume(&self) {
        self.signal(Signal::SIGCONT);
    }

    /// The exit status, if it has exited.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() && self.exited.get().is_some() {
            self.exit = self.child.try_wait().ok().flatten();
        }
        self.exit
    }

    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(s) = self.try_exit() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) -> Option<ExitStatus> {
        self.resume();
        self.sigterm();
        if let Some(s) = self.wait_exit(grace) {
            return Some(s);
        }
        self.sigkill();
        self.exit
    }

    /// Starts the same replica again (same id, address and logs).
    pub fn restart(&mut self) -> std::io::Result<()> {
        if self.try_exit().is_none() {
            self.sigkill();
        }
        let mut earlier = std::mem::take(&mut self.earlier);
        earlier.extend(self.exited.get());
        *self = ReplicaProcess::spawn(self.spec.clone())?;
        self.earlier = earlier;
        Ok(())
    }
}

impl Drop for ReplicaProcess {
    fn drop(&mut self) {
        if self.try_exit().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn role_log_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.roles.jsonl"))
}
