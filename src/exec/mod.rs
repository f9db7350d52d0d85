//! Running commands under lease guards, apart from whoever decides to run them.
//!
//! This module knows nothing of leadership, jobs or etcd: it takes a [`spawner::Launch`] and a
//! stream of proven deadlines, and guarantees that the command runs niced under a guard that
//! kills its whole process group when the deadlines stop, the pipe closes or the parent dies;
//! it leaves an exit record and a log ([`record`]) for whoever decides what happened.

pub mod guard;
pub mod program;
pub mod record;
pub mod spawner;

pub(crate) use baton_guard::pidfd_open;
