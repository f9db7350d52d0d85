//! Values loaded from files and re-read when the files change (certificates rotated by
//! cert-manager, a token file edited by hand), without a restart.
//!
//! Polling, not inotify: Kubernetes swaps a mounted Secret by renaming a symlinked folder,
//! which a watch on the old file never sees; the file's (inode, length, mtime) does change.
//! A new version that does not parse is refused with a warning and the previous one stays.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

/// How often the files are looked at.
const POLL: Duration = Duration::from_millis(250);

type Fingerprint = Vec<Option<(u64, u64, SystemTime)>>;

fn fingerprint(paths: &[PathBuf]) -> Fingerprint {
    use std::os::unix::fs::MetadataExt;
    paths
        .iter()
        .map(|p| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.ino(), m.len(), m.modified().ok()?))
        })
        .collect()
}

/// The current value parsed from a set of files.
pub struct Watched<T> {
    current: Arc<RwLock<Arc<T>>>,
}

impl<T> Clone for Watched<T> {
    fn clone(&self) -> Self {
        Self {
            current: self.current.clone(),
        }
    }
}

impl<T: Send + Sync + 'static> Watched<T> {
    /// Parses once (an error here is the caller's to report: the process should not start),
    /// then re-parses in the background whenever one of `paths` changes.
    pub fn load<F>(what: &'static str, paths: Vec<PathBuf>, parse: F) -> Result<Self, String>
    where
        F: Fn() -> Result<T, String> + Send + Sync + 'static,
    {
        let mut seen = fingerprint(&paths);
        let current = Arc::new(RwLock::new(Arc::new(parse()?)));
        let weak = Arc::downgrade(&current);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(POLL).await;
                let Some(current) = weak.upgrade() else {
                    return;
                };
                let now = fingerprint(&paths);
                if now == seen {
                    continue;
                }
                seen = now;
                match parse() {
                    Ok(v) => {
                        *current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(v);
                        tracing::info!(what, "re-read after a change");
                    }
                    Err(e) => {
                        tracing::warn!(what, error = %e, "changed but cannot be used; keeping the previous version")
                    }
                }
            }
        });
        Ok(Self { current })
    }

    pub fn get(&self) -> Arc<T> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
