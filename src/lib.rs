//! Baton: a high-availability job coordinator on etcd.
//!
//! The folder layout follows the architecture: `store` (etcd access and key layout),
//! `election` (lease, campaign, fenced terms, the role channel), `coordinator` (what the leader
//! does: the job actor, recovery, cleanup), `exec` (the spawner and the lease guard, which know
//! nothing of leadership), `jobs` (specs and stored records), `api` (gRPC), `cli` (client
//! commands), `server` (one replica wired together), `devcluster` (local clusters for `baton
//! dev`, drills, benchmarks and tests), `bench` (`baton bench`), `rolelog` (the audit trail of leadership), `metrics` (what Prometheus scrapes), `retry` (every
//! retry and backoff policy).

pub mod api;
pub mod bench;
pub mod cli;
pub mod clock;
pub mod config;
pub mod coordinator;
pub mod devcluster;
pub mod drill;
pub mod election;
pub mod exec;
pub mod failover;
pub mod http;
pub mod jobs;
pub mod logging;
pub mod metrics;
pub mod retry;
pub mod rolelog;
pub mod schedule;
pub mod security;
pub mod server;
pub mod store;
pub mod worker;

/// This process's incarnation: drawn at random once, at its start, so a replica restarted in
/// place on the same address and id is told from the one before it.
pub fn incarnation() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| format!("{:016x}", fastrand::u64(..)))
}

pub mod proto {
    tonic::include_proto!("baton.v1");
    include!(concat!(env!("OUT_DIR"), "/baton.v1.serde.rs"));
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("baton_descriptor");
}
