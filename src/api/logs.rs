//! Job output through any replica: the replica finds which worker ran the attempt (its end
//! record, or the registry while it runs) and reads the log from that worker's
//! `baton.v1.WorkerService`; once the folder is gone, the last 4 KiB kept in etcd stand in.

use std::time::Duration;

use tokio::sync::mpsc;
use tonic::Status;

use crate::jobs::records::RegistryStatus;
use crate::jobs::work::{AttemptState, WorkerRecord, WORKER_VERSION};
use crate::jobs::{self, Snapshot};
use crate::proto::{self, worker_service_client::WorkerServiceClient};
use crate::security::{AuthChannel, ClientSecurity};
use crate::store::{codec, Keys, Store};

/// How often a follower looks for new output.
const FOLLOW_POLL: Duration = Duration::from_millis(250);
const CHUNK: u32 = 256 * 1024;

/// Where one attempt's output is.
#[derive(Debug)]
struct Located {
    attempt: u32,
    worker: Option<String>,
    ended: bool,
    /// What etcd kept of it, once it ended.
    tail: Option<String>,
}

/// The attempt `requested` (0: the latest) of a job; `None` if none has been assigned yet.
fn locate(snap: &Snapshot, requested: u32) -> Option<Located> {
    let registry = snap.registry.as_ref().map(|(e, _)| e);
    let result = snap.result();
    let latest = registry
        .map(|e| e.attempt)
        .or(result.map(|r| r.attempts))
        .unwrap_or(0);
    let attempt = if requested == 0 { latest } else { requested };
    if attempt == 0 || attempt > latest {
        return None;
    }
    let record = snap
        .attempts
        .values()
        .map(|(a, _)| a)
        .rfind(|a| a.attempt == attempt && a.state != AttemptState::Rejected);
    let running_now = registry.is_some_and(|e| {
        e.status == RegistryStatus::Running && e.attempt == attempt && result.is_none()
    });
    let is_final = result.is_some_and(|r| r.attempts == attempt);
    let worker = record
        .map(|a| a.worker.clone())
        .or_else(|| {
            registry
                .filter(|_| running_now)
                .and_then(|e| e.worker.clone())
        })
        .or_else(|| result.filter(|_| is_final).and_then(|r| r.worker.clone()));
    let ended = !running_now || record.is_some_and(|a| a.state != AttemptState::Started);
    let tail = record
        .filter(|a| a.state != AttemptState::Started)
        .map(|a| a.log_tail.clone())
        .or_else(|| result.filter(|_| is_final).map(|r| r.log_tail.clone()));
    Some(Located {
        attempt,
        worker,
        ended,
        tail,
    })
}

/// A connection to the worker `id` at the address its record advertises.
async fn connect(
    store: &Store,
    keys: &Keys,
    peer: &ClientSecurity,
    id: &str,
) -> Result<WorkerServiceClient<AuthChannel>, String> {
    let mut c = store.client();
    let resp = store
        .timed("read worker", c.get(keys.worker(id), None))
        .await
        .map_err(|e| e.to_string())?;
    let kv = resp
        .kvs()
        .first()
        .ok_or_else(|| format!("worker {id} is not live"))?;
    let record: WorkerRecord =
        codec::decode(kv.key(), kv.value(), WORKER_VERSION).map_err(|e| e.to_string())?;
    let channel = peer
        .connect(
            &record.advertise,
            Duration::from_secs(2),
            Duration::from_secs(5),
        )
        .await
        .map_err(|e| format!("worker {id}: {e}"))?;
    Ok(WorkerServiceClient::new(channel))
}

async fn read_at(
    client: &mut WorkerServiceClient<AuthChannel>,
    worker: &str,
    job: &str,
    attempt: u32,
    offset: i64,
    max: u32,
) -> Result<Option<proto::ReadLogResponse>, String> {
    let resp = client
        .read_log(proto::ReadLogRequest {
            job_id: job.to_string(),
            attempt,
            offset,
            max_bytes: max,
            worker_id: worker.to_string(),
        })
        .await
        .map_err(|s| s.message().to_string())?
        .into_inner();
    Ok(resp.exists.then_some(resp))
}

/// The last `tail` bytes of an attempt's output.
pub async fn tail(
    store: &Store,
    keys: &Keys,
    peer: &ClientSecurity,
    job: &str,
    requested: u32,
    tail: u32,
) -> Result<proto::GetJobLogsResponse, Status> {
    let snap = jobs::read(store, keys, job).await?;
    if !snap.exists() {
        return Err(jobs::Error::NotFound(job.to_string()).into());
    }
    let Some(at) = locate(&snap, requested) else {
        return Err(Status::failed_precondition(format!(
            "job {job} has no attempt {}",
            if requested == 0 {
                "yet".to_string()
            } else {
                requested.to_string()
            }
        )));
    };
    let mut unreachable = None;
    if let Some(w) = &at.worker {
        match connect(store, keys, peer, w).await {
            Ok(mut c) => match read_at(&mut c, w, job, at.attempt, -1, tail).await {
                Ok(Some(r)) => {
                    return Ok(proto::GetJobLogsResponse {
                        attempt: at.attempt,
                        content: r.content,
                    })
                }
                Ok(None) => {}
                Err(e) => unreachable = Some(e),
            },
            Err(e) => unreachable = Some(e),
        }
    }
    match (at.tail, unreachable) {
        (Some(t), _) => Ok(proto::GetJobLogsResponse {
            attempt: at.attempt,
            content: last_bytes(t.into_bytes(), tail as usize),
        }),
        (None, Some(e)) => Err(Status::unavailable(format!(
            "the log of attempt {} is on its worker: {e}",
            at.attempt
        ))),
        (None, None) => Err(Status::not_found(format!(
            "no log for attempt {} (its folder is removed and etcd keeps only the final attempt's tail)",
            at.attempt
        ))),
    }
}

fn last_bytes(mut v: Vec<u8>, n: usize) -> Vec<u8> {
    if v.len() > n {
        v.drain(..v.len() - n);
    }
    v
}

/// Sends an attempt's output from its start as it is written, until that attempt ends.
pub async fn follow(
    store: Store,
    keys: Keys,
    peer: ClientSecurity,
    job: String,
    requested: u32,
    tx: mpsc::Sender<Result<proto::LogChunk, Status>>,
) {
    let mut attempt = requested;
    let mut offset: i64 = 0;
    let mut client = None;
    loop {
        let snap = match jobs::read(&store, &keys, &job).await {
            Ok(s) if s.exists() => s,
            Ok(_) => {
                let _ = tx.send(Err(jobs::Error::NotFound(job).into())).await;
                return;
            }
            Err(e) => {
                let _ = tx.send(Err(e.into())).await;
                return;
            }
        };
        let Some(at) = locate(&snap, attempt) else {
            if snap.result().is_some() {
                let _ = tx
                    .send(Err(Status::failed_precondition(format!(
                        "job {job} ended without running"
                    ))))
                    .await;
                return;
            }
            if pause(&tx).await {
                return;
            }
            continue;
        };
        attempt = at.attempt;
        let mut read_any = false;
        let mut cut_off = at.worker.is_none();
        if let Some(w) = &at.worker {
            if client.is_none() {
                client = connect(&store, &keys, &peer, w).await.ok();
            }
            cut_off = client.is_none();
            while let Some(c) = client.as_mut() {
                match read_at(c, w, &job, attempt, offset, CHUNK).await {
                    Ok(Some(r)) if !r.content.is_empty() => {
                        offset = r.offset + r.content.len() as i64;
                        read_any = true;
                        let chunk = proto::LogChunk {
                            attempt,
                            content: r.content,
                        };
                        if tx.send(Ok(chunk)).await.is_err() {
                            return;
                        }
                    }
                    Ok(r) => {
                        // A folder gone before everything was sent is a cut, not an end.
                        cut_off = r.is_none() && offset > 0;
                        break;
                    }
                    Err(_) => {
                        client = None;
                        cut_off = true;
                        break;
                    }
                }
            }
        }
        if at.ended {
            // The worker had the whole log (its guard writes it all before the exit record),
            // unless its folder is gone: then what etcd kept, if nothing was sent.
            if offset == 0 && !read_any {
                if let Some(t) = at.tail.filter(|t| !t.is_empty()) {
                    let _ = tx
                        .send(Ok(proto::LogChunk {
                            attempt,
                            content: t.into_bytes(),
                        }))
                        .await;
                }
            } else if cut_off {
                let why = format!(
                    "attempt {attempt} ended, but its worker no longer serves the rest of its \
                     log after byte {offset}; `baton job logs` shows the tail etcd kept"
                );
                let _ = tx.send(Err(Status::unavailable(why))).await;
            }
            return;
        }
        if pause(&tx).await {
            return;
        }
    }
}

/// Waits a poll interval; true if the client went away meanwhile.
async fn pause(tx: &mpsc::Sender<Result<proto::LogChunk, Status>>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(FOLLOW_POLL) => false,
        _ = tx.closed() => true,
    }
}
