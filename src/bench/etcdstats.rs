//! What etcd itself counts: requests it answered and writes it applied, read from its
//! `/metrics` so that a job's cost in round trips is etcd's word, not Baton's.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::devcluster::etcd::http_get;
use crate::devcluster::EtcdCluster;

/// Counters summed over the members (requests) or read from the first (applied writes: every
/// member applies each one). Ranges are the first member's too: it evaluates the compares and
/// reads of every write it applies, but only the read-only requests it serves itself (all of
/// them with one member, the bench's default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Counts {
    /// KV requests answered (Range, Put, DeleteRange, Txn), on every member together.
    pub requests: f64,
    /// Of which transactions.
    pub txns: f64,
    /// Keys put or deleted.
    pub writes: f64,
    /// Ranges evaluated: each read of a key or prefix, and each compare of a transaction.
    pub ranges: f64,
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        Counts {
            requests: self.requests - o.requests,
            txns: self.txns - o.txns,
            writes: self.writes - o.writes,
            ranges: self.ranges - o.ranges,
        }
    }
}

/// Reads the counters now (0 for a member that does not answer).
pub async fn read(etcd: &EtcdCluster) -> Counts {
    let addrs = etcd.metrics_addrs();
    tokio::task::spawn_blocking(move || {
        let mut c = Counts::default();
        for (i, addr) in addrs.iter().enumerate() {
            let Some(text) = http_get(addr, "/metrics", Duration::from_secs(2)) else {
                continue;
            };
            for (name, labels, value) in text.lines().filter_map(sample) {
                match name {
                    "grpc_server_handled_total"
                        if labels.contains("grpc_service=\"etcdserverpb.KV\"")
                            && labels.contains("grpc_code=\"OK\"") =>
                    {
                        c.requests += value;
                        if labels.contains("grpc_method=\"Txn\"") {
                            c.txns += value;
                        }
                    }
                    "etcd_mvcc_put_total" | "etcd_mvcc_delete_total" if i == 0 => c.writes += value,
                    "etcd_mvcc_range_total" if i == 0 => c.ranges += value,
                    _ => {}
                }
            }
        }
        c
    })
    .await
    .unwrap_or_default()
}

/// The watchers etcd holds now, over every member (`etcd_debugging_mvcc_watcher_total`).
pub async fn watchers(etcd: &EtcdCluster) -> f64 {
    let addrs = etcd.metrics_addrs();
    tokio::task::spawn_blocking(move || {
        addrs
            .iter()
            .filter_map(|a| http_get(a, "/metrics", Duration::from_secs(2)))
            .flat_map(|text| {
                text.lines()
                    .filter_map(sample)
                    .filter(|(name, _, _)| *name == "etcd_debugging_mvcc_watcher_total")
                    .map(|(_, _, v)| v)
                    .collect::<Vec<_>>()
            })
            .sum()
    })
    .await
    .unwrap_or_default()
}

/// One sample line of the text format: name, the label text, value.
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    if line.starts_with('#') || line.is_empty() {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let value = value.parse().ok()?;
    match series.split_once('{') {
        Some((name, labels)) => Some((name, labels, value)),
        None => Some((series, "", value)),
    }
}

/// Waits until etcd answers fewer than a handful of requests in a quarter second (the cluster
/// has finished reacting to the last load), at most `within`.
pub async fn quiesce(etcd: &EtcdCluster, within: Duration) {
    let deadline = Instant::now() + within;
    let mut last = read(etcd).await;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = read(etcd).await;
        if (now - last).requests < 10.0 {
            return;
        }
        last = now;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sample_lines_split_into_name_labels_and_value() {
        let s = super::sample(r#"grpc_server_handled_total{grpc_code="OK",grpc_method="Txn"} 42"#);
        assert_eq!(
            s,
            Some((
                "grpc_server_handled_total",
                r#"grpc_code="OK",grpc_method="Txn"}"#,
                42.0
            ))
        );
        assert_eq!(
            super::sample("etcd_mvcc_put_total 7"),
            Some(("etcd_mvcc_put_total", "", 7.0))
        );
        assert_eq!(super::sample("# HELP x y"), None);
    }
}
