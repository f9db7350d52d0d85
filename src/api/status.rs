//! The one place where library errors become gRPC statuses.

use tonic::Status;

use crate::election;
use crate::jobs;
use crate::schedule;

impl From<jobs::Error> for Status {
    fn from(e: jobs::Error) -> Status {
        use jobs::Error::*;
        let msg = error_chain(&e);
        match e {
            Invalid(_) => Status::invalid_argument(msg),
            NotFound(_) | NoWorker(_) => Status::not_found(msg),
            AlreadyExists { .. } => Status::already_exists(msg),
            Terminal(_) | NotDirty(_) => Status::failed_precondition(msg),
            Store(_) => Status::unavailable(msg),
            Corrupt(_) => Status::data_loss(msg),
        }
    }
}

impl From<schedule::Error> for Status {
    fn from(e: schedule::Error) -> Status {
        use schedule::Error::*;
        let msg = error_chain(&e);
        match e {
            Invalid(_) => Status::invalid_argument(msg),
            NotFound(_) => Status::not_found(msg),
            AlreadyExists(_) => Status::already_exists(msg),
            Changed { .. } => Status::failed_precondition(msg),
            Busy(_) => Status::resource_exhausted(msg),
            Store(_) => Status::unavailable(msg),
            Corrupt(_) => Status::data_loss(msg),
            Jobs(e) => e.into(),
        }
    }
}

impl From<election::Error> for Status {
    fn from(e: election::Error) -> Status {
        use election::Error::*;
        let msg = error_chain(&e);
        match e {
            NoLeader => {
                Status::unavailable(format!("{msg}; an election is in progress, retry shortly"))
            }
            Store(_) | ShuttingDown => Status::unavailable(msg),
            CorruptRecord(_) => Status::internal(msg),
            NotLeader | WrongTerm { .. } => Status::failed_precondition(msg),
            PhantomWin => Status::aborted(msg),
        }
    }
}

/// "outer: cause: root cause", so a client sees why without the server's logs.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let part = c.to_string();
        if !s.contains(&part) {
            s.push_str(": ");
            s.push_str(&part);
        }
        cur = c.source();
    }
    s
}
