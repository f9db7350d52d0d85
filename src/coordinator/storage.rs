//! The shared storage folder (`--storage-dir`): per-job folders kept across attempts.
//!
//! All replicas of a cluster must see the same folder (the same path on one host, a shared
//! volume on Kubernetes), or a new leader would not find the exit records and checkpoints of the
//! old one. The first replica writes a random token both into etcd and into a marker file; every
//! replica checks at start that its folder holds that token, and refuses to start otherwise.

use std::path::{Path, PathBuf};

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use crate::store::{self, Keys, Store};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "--storage-dir {dir} is not this cluster's shared storage folder (its marker file {marker} \
         {found}); every replica of cluster {cluster:?} must use the same folder"
    )]
    NotShared {
        dir: PathBuf,
        marker: PathBuf,
        found: String,
        cluster: String,
    },
    #[error("cannot use --storage-dir {0}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error(transparent)]
    Store(#[from] store::Error),
}

pub fn job_dir(storage: &Path, job_id: &str) -> PathBuf {
    storage.join("jobs").join(job_id)
}

/// Checks (or, for the first replica, establishes) that `dir` is the cluster's shared folder.
///
/// Each replica drops a marker file named after a fresh token, then tries to claim the etcd key
/// with it; whoever wins, the folder must then hold the file of the winning token. Losers remove
/// their own file. Two replicas starting at once on a shared folder both pass; a replica on a
/// private folder fails, whichever order they start in.
pub async fn check_marker(
    store: &Store,
    keys: &Keys,
    cluster: &str,
    dir: &Path,
) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Io(dir.into(), e))?;
    let marker = |token: &str| dir.join(format!(".baton-cluster-{cluster}-{token}"));
    let mine = format!("{:032x}", rand_token());
    std::fs::write(marker(&mine), cluster).map_err(|e| Error::Io(dir.into(), e))?;
    let key = keys.storage_marker();
    let txn = Txn::new()
        .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.clone(), mine.clone(), None)])
        .or_else([TxnOp::get(key.clone(), None)]);
    let mut c = store.client();
    let resp = store.timed("storage marker", c.txn(txn)).await?;
    let winner = if resp.succeeded() {
        mine.clone()
    } else {
        let _ = std::fs::remove_file(marker(&mine));
        match resp.op_responses().into_iter().next() {
            Some(TxnOpResponse::Get(g)) => g
                .kvs()
                .first()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
                .unwrap_or_default(),
            _ => String::new(),
        }
    };
    if marker(&winner).is_file() {
        return Ok(());
    }
    Err(Error::NotShared {
        dir: dir.into(),
        marker: marker(&winner),
        found: "is missing".into(),
        cluster: cluster.into(),
    })
}

fn rand_token() -> u128 {
    let mut buf = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    u128::from_le_bytes(buf) ^ crate::clock::BootInstant::now().as_nanos() as u128
}
