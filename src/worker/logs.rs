//! `baton.v1.WorkerService`: what a worker serves the replicas about its own job folders, so a
//! job's output can be read (and followed) through any replica while the worker has it.
//!
//! It reads only `<storage>/jobs/<id>/attempt-<n>.log` for a valid job id: nothing a request
//! names can reach another path.

use std::io::SeekFrom;
use std::path::PathBuf;

use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tonic::{Request, Response, Status};

use crate::exec::record;
use crate::jobs::spec;
use crate::proto::{self, worker_service_server::WorkerService};

/// Most bytes one read returns.
pub const READ_MAX: u32 = 4 * 1024 * 1024;
const READ_DEFAULT: u32 = 64 * 1024;

#[derive(Clone)]
pub struct WorkerLogs {
    storage_dir: PathBuf,
}

impl WorkerLogs {
    pub fn new(storage_dir: PathBuf) -> Self {
        Self { storage_dir }
    }
}

#[tonic::async_trait]
impl WorkerService for WorkerLogs {
    async fn read_log(
        &self,
        req: Request<proto::ReadLogRequest>,
    ) -> Result<Response<proto::ReadLogResponse>, Status> {
        let req = req.into_inner();
        spec::validate_id(&req.job_id).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if req.attempt == 0 {
            return Err(Status::invalid_argument("attempt must be at least 1"));
        }
        let max = match req.max_bytes {
            0 => READ_DEFAULT,
            n => n.min(READ_MAX),
        } as u64;
        let dir = record::job_dir(&self.storage_dir, &req.job_id);
        let path = record::log_path(&dir, &format!("attempt-{}", req.attempt));
        let mut f = match tokio::fs::File::open(&path).await {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Response::new(proto::ReadLogResponse::default()))
            }
            Err(e) => return Err(Status::internal(format!("cannot read the log: {e}"))),
        };
        let read = async {
            let size = f.metadata().await?.len();
            let start = if req.offset < 0 {
                size.saturating_sub(max)
            } else {
                (req.offset as u64).min(size)
            };
            f.seek(SeekFrom::Start(start)).await?;
            let mut content = Vec::new();
            (&mut f).take(max).read_to_end(&mut content).await?;
            Ok::<_, std::io::Error>((start, size, content))
        };
        let (start, size, content) = read
            .await
            .map_err(|e| Status::internal(format!("cannot read the log: {e}")))?;
        Ok(Response::new(proto::ReadLogResponse {
            exists: true,
            offset: start as i64,
            size: size.max(start + content.len() as u64) as i64,
            content,
        }))
    }
}
