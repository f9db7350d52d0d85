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

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a loopback port")
}
