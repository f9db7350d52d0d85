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

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a loopback port")
}
