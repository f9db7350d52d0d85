//! The coordinator: what the leader does while its term lasts.
//!
//! [`run`] follows the role channel and, for every term this replica wins, starts the job actor
//! ([`actor`]) and the cleaner ([`cleanup`]), both tracked by the term so that a handover waits
//! for them. Jobs run on workers, which the coordinator reaches only through etcd keys: when a
//! term ends, nothing is stopped, and the next term adopts what runs. The pieces:
//! - [`actor`]: the one decision maker of a term (worker slots, start budget, timers);
//! - [`fleet`]: the term's view of the workers (alive, gone since when);
//! - [`transition`]: one job's step, read from etcd and written fenced;
//! - [`recovery`]: the pinned, paged read a new term starts from;
//! - [`cleanup`]: dirty results made clean, stage by stage;
//! - [`schedules`]: schedules' ticks, fired at most once each;
//! - [`writer`]: the one fenced writer of a term.
//!
//! The leader starts no process: jobs and cleanup steps run on workers.

mod actor;
pub mod cleanup;
mod ctx;
mod fleet;
pub mod protocol;
mod recovery;
mod schedules;
mod starts;
mod transition;
mod writer;

pub use ctx::{CleanupConfig, CoordinatorConfig, Ctx};
pub use schedules::EVENT_TARGET as SCHEDULE_EVENTS;
pub use writer::Writer;

use std::sync::Arc;

use tokio::sync::watch;
use tracing::Instrument;

use crate::election::Role;
use crate::store::{Keys, Store};

/// Follows the role channel and leads every term this replica wins.
pub async fn run(
    store: Store,
    keys: Keys,
    config: CoordinatorConfig,
    mut role: watch::Receiver<Role>,
) {
    let ctx = Arc::new(Ctx::new(store, keys, config));
    loop {
        let term = role.borrow_and_update().term().cloned();
        if let Some(term) = term.filter(|t| !t.has_ended()) {
            let span = tracing::info_span!("term", term = term.revision(), replica = %ctx.config.replica_id);
            let ctx = ctx.clone();
            let t = term.clone();
            // Tracked by the term, so the handover waits for the guards to be gone.
            term.tracker()
                .spawn(async move { actor::lead(ctx, t).await }.instrument(span));
        }
        if role.changed().await.is_err() {
            return;
        }
    }
}
