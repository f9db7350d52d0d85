//! Baton: a high-availability job coordinator on etcd.
//!
//! The folder layout follows the architecture: `store` (etcd access and key layout),
//! `election` (lease, campaign, fenced terms, the role channel), `api` (gRPC), `cli` (client
//! commands), `server` (one replica wired together), `devcluster` (local clusters for `baton
//! dev`, drills and tests), `rolelog` (the audit trail of leadership).

pub mod api;
pub mod cleanup;
pub mod cli;
pub mod clock;
pub mod config;
pub mod devcluster;
pub mod drill;
pub mod election;
pub mod jobs;
pub mod logging;
pub mod rolelog;
pub mod runner;
pub mod server;
pub mod store;

pub mod proto {
    tonic::include_proto!("baton.v1");
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("baton_descriptor");
}
