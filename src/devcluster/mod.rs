//! A whole Baton cluster on one host: private etcd, fault proxies and replica processes.
//! Used by `baton dev`, by drills, and by the test harness.

mod dev;
pub mod etcd;
pub mod proxy;
pub mod replica;

pub use dev::run as run_dev;
pub use etcd::{EtcdCluster, EtcdTls};
pub use proxy::{FaultProxy, Mode};
pub use replica::{ReplicaProcess, ReplicaSpec};

/// The folder a local cluster works in: `dir` if given (kept), else a new temporary one
/// named `<prefix>…`, removed when the returned guard drops.
pub fn workdir(
    dir: Option<&std::path::Path>,
    prefix: &str,
) -> std::io::Result<(Option<tempfile::TempDir>, std::path::PathBuf)> {
    match dir {
        Some(d) => Ok((None, d.to_path_buf())),
        None => {
            let t = tempfile::Builder::new().prefix(prefix).tempdir()?;
            let p = t.path().to_path_buf();
            Ok((Some(t), p))
        }
    }
}

/// A loopback port that was free a moment ago, and that this process has not handed out
/// before: the kernel may give a port it just released to the next bind, which once gave two
/// replicas of one cluster the same port.
pub fn free_port() -> u16 {
    bind_loopback()
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a loopback port")
}

/// A listener on a loopback port this process has never handed out (by [`free_port`] or
/// here), so a proxy cannot take a port a child process was told to bind and has not bound yet.
pub fn bind_loopback() -> std::io::Result<std::net::TcpListener> {
    static HANDED: std::sync::Mutex<Option<std::collections::HashSet<u16>>> =
        std::sync::Mutex::new(None);
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
        if handed.get_or_insert_with(Default::default).insert(port) {
            return Ok(l);
        }
    }
}
