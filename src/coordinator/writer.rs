//! The one writer of a term: every fenced write of the leader goes through here, and
//! concurrent ones (assignments, results, cleanup progress) are group-committed: batched into
//! one transaction under the term's fence, each keeping its own compares and outcome (see
//! [`crate::store::group`]).

use crate::election::{Commit, FenceError, Term};
use crate::store::group::{self, Fence, GroupCommit, Limits};
use crate::store::{self, Write};

#[derive(Clone)]
pub struct Writer {
    group: GroupCommit,
    term: Term,
}

impl Writer {
    /// Starts the term's committer; it stops when the term ends.
    pub fn start(term: &Term) -> Writer {
        let t = term.clone();
        let fence = Fence {
            compare: term.fence(),
            valid: Box::new(move || t.check().is_ok()),
        };
        let (group, run) = GroupCommit::new(
            term.store().clone(),
            Some(fence),
            "fenced txn",
            Limits::default(),
        );
        let t = term.clone();
        term.tracker().spawn(async move {
            tokio::select! {
                _ = run => {}
                _ = t.ended() => {}
            }
        });
        Writer {
            group,
            term: term.clone(),
        }
    }

    pub fn term(&self) -> &Term {
        &self.term
    }

    /// Commits `write` under the term's fence. `Err(Deposed)`: the term is over.
    pub async fn commit(&self, write: Write) -> Result<Commit, FenceError> {
        self.term.check()?;
        let term = self.term.revision();
        match self.group.commit(write).await {
            Ok(group::Outcome::Applied { revision, response }) => {
                Ok(Commit::Applied { revision, response })
            }
            Ok(group::Outcome::Conflict { response, .. }) => Ok(Commit::Conflict(response)),
            Ok(group::Outcome::Fenced) => Err(self.term.fenced_out()),
            Err(store::Error::Stopped) => Err(FenceError::Deposed { term }),
            Err(source) => Err(FenceError::Store { term, source }),
        }
    }
}
