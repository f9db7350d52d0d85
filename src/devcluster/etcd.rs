//! A private etcd cluster (1 or more members) on loopback, for `baton dev`, drills and tests.
//!
//! Auto-compaction is always on: Debian's etcd 3.4 keeps every revision by default and would
//! eventually fill its quota and refuse all writes.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::free_port;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "the etcd binary {bin:?} was not found. Install it with `sudo apt-get install etcd-server etcd-client` \
         (Debian/Ubuntu), or pass its path with --etcd-bin / BATON_ETCD_BIN"
    )]
    Missing { bin: PathBuf },
    #[error("cannot start etcd member {name}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("etcd did not become ready within {within:?} (logs under {}):\n{detail}", dir.display())]
    NotReady {
        within: Duration,
        dir: PathBuf,
        /// Which members were not ready, whether they had exited, and their logs' last lines.
        detail: String,
    },
    #[error("io error in {0}")]
    Io(PathBuf, #[source] std::io::Error),
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    /// Plain HTTP `/health` (and metrics), whether or not clients use TLS.
    metrics_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Member {
    fn fresh(dir: &Path, i: usize) -> Member {
        Member {
            name: format!("etcd-{i}"),
            client_port: free_port(),
            peer_port: free_port(),
            metrics_port: free_port(),
            data_dir: dir.join(format!("etcd-{i}.data")),
            log: dir.join(format!("etcd-{i}.log")),
            child: None,
        }
    }

    /// What a failed start shows: whether it runs, and its log's last lines.
    fn report(&mut self) -> String {
        let state = match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(status))) => format!("exited ({status})"),
            Some(_) => "running, not healthy".to_string(),
            None => "not started".to_string(),
        };
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(5)..].join("\n  ");
        format!("{}: {state}\n  {tail}", self.name)
    }
}

/// A running etcd cluster. Dropping it kills every member.
pub struct EtcdCluster {
    bin: PathBuf,
    dir: PathBuf,
    token: String,
    members: Vec<Member>,
    tls: Option<EtcdTls>,
}

/// TLS on the client port: the server's certificate and key, and the CA that signs it and the
/// client certificates etcd then requires (it asks for one once `--trusted-ca-file` is set).
#[derive(Clone, Debug)]
pub struct EtcdTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl EtcdCluster {
    /// Starts `size` members with data and logs under `dir`, and waits until they serve.
    pub fn start(bin: &Path, dir: &Path, size: usize) -> Result<EtcdCluster, Error> {
        Self::start_with(bin, dir, size, None)
    }

    /// Like [`EtcdCluster::start`], with TLS on the client port when `tls` is given.
    pub fn start_with(
        bin: &Path,
        dir: &Path,
        size: usize,
        tls: Option<EtcdTls>,
    ) -> Result<EtcdCluster, Error> {
        which(bin)?;
        std::fs::create_dir_all(dir).map_err(|e| Error::Io(dir.into(), e))?;
        let mut c = EtcdCluster {
            bin: bin.into(),
            dir: dir.into(),
            token: format!("baton-{}", std::process::id()),
            members: Vec::new(),
            tls,
        };
        // free_port() releases the port it found: another process may bind it before etcd
        // does. A member that lost that race exits at once; a fresh cluster then starts over on
        // new ports (nothing is lost: it holds no data yet).
        let mut attempt = 0;
        loop {
            attempt += 1;
            c.members = (0..size.max(1)).map(|i| Member::fresh(dir, i)).collect();
            for m in &c.members {
                let _ = std::fs::remove_dir_all(&m.data_dir);
                let _ = std::fs::remove_file(&m.log);
            }
            for i in 0..c.members.len() {
                c.spawn(i)?;
            }
            match c.wait_ready(Duration::from_secs(30)) {
                Err(e) if attempt < 3 && c.lost_a_port() => {
                    tracing::warn!(error = %e, "an etcd port was taken before etcd bound it; starting over on new ports");
                    for i in 0..c.members.len() {
                        c.kill_member(i);
                    }
                }
                r => return r.map(|()| c),
            }
        }
    }

    /// Whether a member exited because one of its ports was taken.
    fn lost_a_port(&mut self) -> bool {
        self.members.iter_mut().any(|m| {
            let exited = m
                .child
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
            exited
                && std::fs::read_to_string(&m.log)
                    .is_ok_and(|l| l.contains("address already in use"))
        })
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, i: usize) -> Result<(), Error> {
        let initial = self.initial_cluster();
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .map_err(|e| Error::Io(m.log.clone(), e))?;
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let metrics = format!("http://127.0.0.1:{}", m.metrics_port);
        let mut cmd = Command::new(&self.bin);
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key)
                .arg("--trusted-ca-file")
                .arg(&t.ca);
        }
        let child = cmd
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--listen-metrics-urls", &metrics])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token])
            .args(["--auto-compaction-mode", "periodic"])
            .args(["--auto-compaction-retention", "1h"])
            .args(["--logger", "zap", "--log-level", "warn"])
            // Its own group: a Ctrl-C at the terminal is for the drill or `baton dev`, which
            // stop etcd last, after the replicas.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| Error::Io(m.log.clone(), e))?)
            .stderr(log)
            .spawn()
            .map_err(|source| Error::Spawn {
                name: m.name.clone(),
                source,
            })?;
        m.child = Some(child);
        Ok(())
    }

    /// `127.0.0.1:port` of every member's client listener.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// The process ids of the members started and not stopped or killed since.
    pub fn pids(&self) -> Vec<i32> {
        self.members
            .iter()
            .filter_map(|m| m.child.as_ref().map(|c| c.id() as i32))
            .collect()
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// `127.0.0.1:port` of every member's plain HTTP `/metrics` and `/health` listener.
    pub fn metrics_addrs(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.metrics_port))
            .collect()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Waits until every running member's `/health` says true (it does once raft has a leader).
    pub fn wait_ready(&mut self, within: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + within;
        for i in 0..self.members.len() {
            if self.members[i].child.is_none() {
                continue;
            }
            let addr = format!("127.0.0.1:{}", self.members[i].metrics_port);
            while !health_ok(&addr) {
                let exited = self.members[i]
                    .child
                    .as_mut()
                    .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
                if exited || Instant::now() >= deadline {
                    let detail = self.members[i..]
                        .iter_mut()
                        .map(Member::report)
                        .collect::<Vec<_>>()
                        .join("\n");
                    return Err(Error::NotReady {
                        within,
                        dir: self.dir.clone(),
                        detail,
                    });
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// SIGKILLs member `i`.
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERMs member `i` and waits for it to exit.
    pub fn stop_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its old data and ports.
    pub fn restart_member(&mut self, i: usize) -> Result<(), Error> {
        if self.members[i].child.is_none() {
            self.spawn(i)?;
        }
        Ok(())
    }

    pub fn stop(&mut self) {
        for i in 0..self.members.len() {
            self.stop_member(i);
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
    }
}

/// Fails with the install hint when `bin` cannot be found.
fn which(bin: &Path) -> Result<(), Error> {
    let found = if bin.components().count() > 1 {
        bin.is_file()
    } else {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
            .unwrap_or(false)
    };
    if found {
        Ok(())
    } else {
        Err(Error::Missing { bin: bin.into() })
    }
}

/// `GET /health` on the member's metrics port answers `{"health":"true"}` once it has a leader.
fn health_ok(addr: &str) -> bool {
    http_get(addr, "/health", Duration::from_millis(1000))
        .is_some_and(|body| body.contains("\"health\":\"true\""))
}

/// The whole answer (status line and headers included) to a plain HTTP/1.0 `GET` on loopback.
pub fn http_get(addr: &str, path: &str, timeout: Duration) -> Option<String> {
    use std::io::{Read, Write};
    let sock = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    let req = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    Some(body)
}
