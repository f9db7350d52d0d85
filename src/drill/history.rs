//! A drill's history (`baton drill --history FILE`), for a checker to replay through the
//! protocol model (`modelcheck replay FILE`).
//!
//! Two clocks, each exact on its own: etcd's steps are its revisions (read back after the drill
//! by a watch of every key from the first revision); local steps (an execution's start and end
//! in the guards' ledger) carry `CLOCK_BOOTTIME`. They meet through samples taken during the
//! drill: before a read of etcd's revision `r` the clock said `t0`, after it `t1`. A local step
//! at `t` happened after every revision `<=` the last `r` read with `t1 <= t` (`after_rev`), and
//! before every revision `>` the first `r` read with `t0 >= t` (`before_rev`); revisions in
//! between are concurrent with it. The file is JSON lines, one [`Step`] each, etcd steps in
//! revision order and each local step right after its `after_rev`.

use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use etcd_client::{EventType, GetOptions, WatchOptions};
use serde::{Deserialize, Serialize};

use crate::clock::BootInstant;
use crate::exec::record::LedgerEntry;

/// The layout of the file.
pub const HISTORY_VERSION: u32 = 1;

/// One line of the history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Step {
    /// The first line.
    Header {
        version: u32,
        /// The key prefix of the drilled cluster (`/baton/<cluster>/`).
        prefix: String,
    },
    /// Every change etcd made at one revision.
    Etcd { rev: i64, events: Vec<Event> },
    /// A line of the guards' execution ledger, placed among the revisions.
    Local {
        #[serde(flatten)]
        entry: Box<LedgerEntry>,
        after_rev: i64,
        before_rev: i64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Event {
    Put {
        key: String,
        /// The value as text (every stored value is JSON or plain text).
        value: String,
        create: i64,
        modified: i64,
        version: i64,
        lease: i64,
    },
    Delete {
        key: String,
    },
}

/// `(t0, revision, t1)`: the revision read between two clock readings.
type Sample = (u64, i64, u64);

/// Samples etcd's revision against the boot clock while the drill runs.
pub struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    pub async fn start(endpoints: &[String]) -> anyhow::Result<Sampler> {
        let mut client = etcd_client::Client::connect(endpoints, None).await?;
        let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
        let kept = samples.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let t0 = BootInstant::now().as_nanos();
                let got = client
                    .get("\0", Some(GetOptions::new().with_count_only()))
                    .await;
                let t1 = BootInstant::now().as_nanos();
                if let Some(rev) = got.ok().and_then(|r| r.header().map(|h| h.revision())) {
                    kept.lock().expect("samples").push((t0, rev, t1));
                }
            }
        });
        let sampler = Sampler { samples, task };
        Ok(sampler)
    }

    /// Stops sampling; the samples taken.
    pub fn stop(self) -> Vec<Sample> {
        self.task.abort();
        std::mem::take(&mut *self.samples.lock().expect("samples"))
    }
}

impl Drop for Sampler {
    /// A drill that fails early stops sampling too.
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where a local step at `t` sits among the revisions: `(after_rev, before_rev)`.
pub fn place(samples: &[Sample], t: u64) -> (i64, i64) {
    let after = samples
        .iter()
        .filter(|(_, _, t1)| *t1 <= t)
        .map(|(_, r, _)| *r)
        .max()
        .unwrap_or(0);
    let before = samples
        .iter()
        .filter(|(t0, _, _)| *t0 >= t)
        .map(|(_, r, _)| *r)
        .min()
        .unwrap_or(i64::MAX);
    (after, before.max(after))
}

/// Reads every revision from 1 to now back from etcd and writes the history to `path`, with
/// the ledger's lines placed by `samples`.
pub async fn write(
    endpoints: &[String],
    prefix: &str,
    samples: &[Sample],
    ledger: &Path,
    path: &Path,
) -> anyhow::Result<usize> {
    let mut client = etcd_client::Client::connect(endpoints, None).await?;
    let end = client
        .get("\0", Some(GetOptions::new().with_count_only()))
        .await?
        .header()
        .map(|h| h.revision())
        .context("etcd answered without a header")?;
    let mut revisions: Vec<Step> = Vec::new();
    let mut stream = client
        .watch(
            "\0",
            Some(WatchOptions::new().with_all_keys().with_start_revision(1)),
        )
        .await?;
    // Every revision changed at least one key, so the watch reaches `end`.
    let mut last = 1;
    while last < end {
        let msg = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .context("etcd's history stalled")??
            .context("etcd closed the watch")?;
        anyhow::ensure!(
            msg.compact_revision() == 0,
            "etcd compacted its history up to revision {} during or after the drill; \
             a history needs every revision",
            msg.compact_revision()
        );
        for ev in msg.events() {
            let Some(kv) = ev.kv() else { continue };
            let rev = kv.mod_revision();
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let event = match ev.event_type() {
                EventType::Put => Event::Put {
                    key,
                    value: String::from_utf8_lossy(kv.value()).into_owned(),
                    create: kv.create_revision(),
                    modified: rev,
                    version: kv.version(),
                    lease: kv.lease(),
                },
                EventType::Delete => Event::Delete { key },
            };
            match revisions.last_mut() {
                Some(Step::Etcd { rev: r, events }) if *r == rev => events.push(event),
                _ => revisions.push(Step::Etcd {
                    rev,
                    events: vec![event],
                }),
            }
            last = last.max(rev);
        }
    }
    let mut local: Vec<(i64, u64, Step)> = std::fs::read_to_string(ledger)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<LedgerEntry>(l).ok())
        .map(|entry| {
            let (after_rev, before_rev) = place(samples, entry.boottime_ns);
            (
                after_rev,
                entry.boottime_ns,
                Step::Local {
                    entry: Box::new(entry),
                    after_rev,
                    before_rev,
                },
            )
        })
        .collect();
    local.sort_by_key(|(after, t, _)| (*after, *t));
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    let mut line = |s: &Step| -> anyhow::Result<()> {
        serde_json::to_writer(&mut out, s)?;
        out.write_all(b"\n")?;
        Ok(())
    };
    line(&Step::Header {
        version: HISTORY_VERSION,
        prefix: prefix.to_string(),
    })?;
    let mut local = local.into_iter().peekable();
    let mut n = 0;
    for step in &revisions {
        let Step::Etcd { rev, .. } = step else {
            continue;
        };
        while let Some((_, _, l)) = local.next_if(|(after, _, _)| after < rev) {
            line(&l)?;
            n += 1;
        }
        line(step)?;
        n += 1;
    }
    for (_, _, l) in local {
        line(&l)?;
        n += 1;
    }
    out.flush()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_step_sits_after_revisions_read_before_it_and_before_those_read_after() {
        // Revision 5 read between 100 and 110, 7 between 200 and 205, 9 between 300 and 310.
        let samples = [(100, 5, 110), (200, 7, 205), (300, 9, 310)];
        assert_eq!(place(&samples, 150), (5, 7));
        // A reading that straddles the step places nothing on its side.
        assert_eq!(place(&samples, 202), (5, 9));
        assert_eq!(place(&samples, 50), (0, 5));
        assert_eq!(place(&samples, 400), (9, i64::MAX));
    }

    #[test]
    fn steps_read_back_as_written() {
        let s = Step::Etcd {
            rev: 3,
            events: vec![
                Event::Put {
                    key: "/baton/c/election".into(),
                    value: "r1".into(),
                    create: 3,
                    modified: 3,
                    version: 1,
                    lease: 7,
                },
                Event::Delete { key: "/x".into() },
            ],
        };
        let text = serde_json::to_string(&s).unwrap();
        assert!(text.starts_with(r#"{"step":"etcd","rev":3,"#), "{text}");
        assert_eq!(serde_json::from_str::<Step>(&text).unwrap(), s);
    }
}
