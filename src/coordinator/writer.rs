//! The one writer of a term: every fenced write of the leader goes through here, so that a
//! later change can batch concurrent transitions into one transaction (group commit) without
//! touching the job logic.

use etcd_client::{Compare, TxnOp};
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;

use crate::election::{Commit, FenceError, Term};

/// How many fenced transactions may be in flight at once.
const IN_FLIGHT: usize = 32;

struct Write {
    compares: Vec<Compare>,
    ops: Vec<TxnOp>,
    reply: oneshot::Sender<Result<Commit, FenceError>>,
}

#[derive(Clone)]
pub struct Writer {
    tx: mpsc::Sender<Write>,
    term: Term,
}

impl Writer {
    /// Starts the writer task; it stops when the term ends.
    pub fn start(term: &Term) -> Writer {
        let (tx, rx) = mpsc::channel::<Write>(1024);
        let t = term.clone();
        term.tracker().spawn(async move {
            let work = ReceiverStream::new(rx).for_each_concurrent(IN_FLIGHT, |w| {
                let t = t.clone();
                async move {
                    let _ = w.reply.send(t.commit(w.compares, w.ops).await);
                }
            });
            tokio::select! {
                _ = work => {}
                _ = t.ended() => {}
            }
        });
        Writer {
            tx,
            term: term.clone(),
        }
    }

    pub fn term(&self) -> &Term {
        &self.term
    }

    pub async fn commit(
        &self,
        compares: Vec<Compare>,
        ops: Vec<TxnOp>,
    ) -> Result<Commit, FenceError> {
        let deposed = || FenceError::Deposed {
            term: self.term.revision(),
        };
        self.term.check()?;
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Write {
                compares,
                ops,
                reply,
            })
            .await
            .map_err(|_| deposed())?;
        answer.await.map_err(|_| deposed())?
    }
}
