//! Stored values are versioned JSON. Decoding checks the version; a value that fails is
//! *corrupt*: logged and counted, never a crash, and it never blocks other jobs.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::de::DeserializeOwned;
use serde::Serialize;

static CORRUPT_VALUES: AtomicU64 = AtomicU64::new(0);

/// Counts a corrupt value found by other means than [`decode`].
pub fn note_corrupt() {
    CORRUPT_VALUES.fetch_add(1, Ordering::Relaxed);
    crate::metrics::get().corrupt_values.inc();
}

/// How many corrupt or unknown-version values this process has met.
pub fn corrupt_values() -> u64 {
    CORRUPT_VALUES.load(Ordering::Relaxed)
}

#[derive(Debug, thiserror::Error)]
#[error("corrupt value at {key}: {reason}")]
pub struct Corrupt {
    pub key: String,
    pub reason: String,
}

#[derive(serde::Deserialize)]
struct VersionOnly {
    version: u32,
}

/// Decodes a value whose `version` must be `expected`.
pub fn decode<T: DeserializeOwned>(key: &[u8], value: &[u8], expected: u32) -> Result<T, Corrupt> {
    decode_any(key, value, &[expected])
}

/// Decodes a value whose `version` is one of `accepted` (older layouts read through serde
/// defaults).
pub fn decode_any<T: DeserializeOwned>(
    key: &[u8],
    value: &[u8],
    accepted: &[u32],
) -> Result<T, Corrupt> {
    let fail = |reason: String| {
        note_corrupt();
        let key = String::from_utf8_lossy(key).into_owned();
        tracing::error!(key = %key, reason = %reason, "corrupt value in etcd; leaving it alone");
        Corrupt { key, reason }
    };
    let v: VersionOnly = serde_json::from_slice(value).map_err(|e| fail(e.to_string()))?;
    if !accepted.contains(&v.version) {
        return Err(fail(format!(
            "unknown version {} (this replica reads {accepted:?})",
            v.version
        )));
    }
    serde_json::from_slice(value).map_err(|e| fail(e.to_string()))
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("stored values serialize")
}
