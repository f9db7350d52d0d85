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
/// Below gRPC's default 4 MiB message limit, framing included.
pub const READ_MAX: u32 = 3 * 1024 * 1024;
const READ_DEFAULT: u32 = 64 * 1024;

#[derive(Clone)]
pub struct WorkerLogs {
    worker_id: String,
    storage_dir: PathBuf,
}

impl WorkerLogs {
    pub fn new(worker_id: String, storage_dir: PathBuf) -> Self {
        Self {
            worker_id,
            storage_dir,
        }
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
        if !req.worker_id.is_empty() && req.worker_id != self.worker_id {
            return Err(Status::failed_precondition(format!(
                "this is worker {}, not {}",
                self.worker_id, req.worker_id
            )));
        }
        if req.attempt == 0 {
            return Err(Status::invalid_argument("attempt must be at least 1"));
        }
        let max = match req.max_bytes {
            0 => READ_DEFAULT,
            n => n.min(READ_MAX),
        } as u64;
        let mut dir = record::job_dir(&self.storage_dir, &req.job_id);
        if !dir.exists() {
            // An attempt run here by a release before the buckets.
            dir = record::legacy_job_dir(&self.storage_dir, &req.job_id);
        }
        let path = record::log_path(&dir, &format!("attempt-{}", req.attempt));
        // A job could plant a symlink in its own folder: only a regular file is served.
        let opened = tokio::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&path)
            .await;
        let mut f = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Response::new(proto::ReadLogResponse::default()))
            }
            Err(e) => return Err(Status::internal(format!("cannot read the log: {e}"))),
        };
        let read = async {
            let meta = f.metadata().await?;
            if !meta.is_file() {
                return Err(std::io::Error::other("not a regular file"));
            }
            let size = meta.len();
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
