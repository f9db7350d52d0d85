//! Jobs as any replica sees them: submission, reads, cancel requests. None of this needs the
//! leader, so submissions and reads keep working during a failover as long as etcd has quorum.
//!
//! Submission is one transaction that writes `jobs/<id>` and a PENDING `registry/<id>` only if
//! no spec, registry, dirty or clean entry exists for the id. A retry with an identical spec
//! (same hash) is answered with the existing job in whatever state; a different spec is refused.

pub mod cleanup;
pub mod fleet;
pub mod records;
pub mod spec;
pub mod work;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};

use crate::store::codec::{self, Corrupt};
use crate::store::{self, GroupCommit, Keys, Store, Write};
use records::{
    AbandonRequest, CancelRequest, JobResult, RegistryEntry, RegistryStatus, TerminalStatus,
};
use spec::{Invalid, JobRecord, JobSpec};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid request: {0}")]
    Invalid(#[from] Invalid),
    #[error("no job {0}")]
    NotFound(String),
    #[error("no live worker {0}")]
    NoWorker(String),
    #[error("job {id} already exists with a different spec and is {}", if *.terminated { "globally terminated" } else { "still running" })]
    AlreadyExists { id: String, terminated: bool },
    #[error("job {0} has already reached a terminal state")]
    Terminal(String),
    #[error("{0}")]
    NotDirty(String),
    #[error(transparent)]
    Store(#[from] store::Error),
    #[error(transparent)]
    Corrupt(#[from] Corrupt),
}

/// The user-facing state of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Pending,
    Running,
    Finished,
    Failed,
    Canceled,
}

impl From<TerminalStatus> for State {
    fn from(s: TerminalStatus) -> State {
        match s {
            TerminalStatus::Finished => State::Finished,
            TerminalStatus::Failed => State::Failed,
            TerminalStatus::Canceled => State::Canceled,
        }
    }
}

/// Everything etcd holds about one job, read at one revision.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub id: String,
    /// The spec and its incarnation (the create revision of `jobs/<id>`).
    pub spec: Option<(JobRecord, i64)>,
    /// The registry entry and its mod revision.
    pub registry: Option<(RegistryEntry, i64)>,
    pub dirty: Option<JobResult>,
    pub clean: Option<JobResult>,
    pub cancel: Option<CancelRequest>,
    /// The mod revision of the dirty result (0 if none): cleanup writes compare it.
    pub dirty_rev: i64,
    /// An operator asked for an immediate cleanup retry.
    pub cleanup_now: bool,
    /// An operator asked to end the cleanup by hand.
    pub abandon: Option<AbandonRequest>,
    /// Workers' attempt records by token (the assignment's revision), with their mod revision.
    /// A corrupt one is left out (and counted).
    pub attempts: std::collections::BTreeMap<i64, (work::AttemptRecord, i64)>,
    pub revision: i64,
}

impl Snapshot {
    /// Brings the snapshot up to a watch event on one of the job's keys (its attempt records
    /// included). A value that does not decode is left out, as a fresh read would leave it.
    pub fn apply(&mut self, keys: &Keys, deleted: bool, kv: &etcd_client::KeyValue) {
        let k = keys.job(&self.id);
        let key = kv.key();
        let value = (!deleted).then(|| kv.value());
        self.revision = self.revision.max(kv.mod_revision());
        if key == k.spec.as_bytes() {
            self.spec = value.and_then(|v| {
                let r = codec::decode_any(key, v, spec::JOB_RECORD_VERSIONS_READ).ok()?;
                Some((r, kv.create_revision()))
            });
        } else if key == k.registry.as_bytes() {
            self.registry = value.and_then(|v| {
                let e = codec::decode_any(key, v, records::REGISTRY_VERSIONS_READ).ok()?;
                Some((e, kv.mod_revision()))
            });
        } else if key == k.dirty.as_bytes() {
            self.dirty =
                value.and_then(|v| codec::decode_any(key, v, records::RESULT_VERSIONS_READ).ok());
            self.dirty_rev = if deleted { 0 } else { kv.mod_revision() };
        } else if key == k.clean.as_bytes() {
            self.clean =
                value.and_then(|v| codec::decode_any(key, v, records::RESULT_VERSIONS_READ).ok());
        } else if key == k.cancel.as_bytes() {
            self.cancel = value.and_then(|v| codec::decode(key, v, records::CANCEL_VERSION).ok());
        } else if key == k.cleanup_now.as_bytes() {
            self.cleanup_now = !deleted;
        } else if key == k.abandon.as_bytes() {
            self.abandon = value.and_then(|v| codec::decode(key, v, records::ABANDON_VERSION).ok());
        } else if let Some(token) =
            Keys::id_in(&keys.attempts_of(&self.id), key).and_then(|t| t.parse::<i64>().ok())
        {
            match value.and_then(|v| codec::decode(key, v, work::ATTEMPT_VERSION).ok()) {
                Some(rec) => {
                    self.attempts.insert(token, (rec, kv.mod_revision()));
                }
                None => {
                    self.attempts.remove(&token);
                }
            }
        }
    }

    /// This snapshot after a write of its reader's own that put `dirty` at `revision` (and
    /// took any cleanup-now or abandon request with it).
    pub fn after(&self, dirty: JobResult, revision: i64) -> Snapshot {
        Snapshot {
            dirty: Some(dirty),
            dirty_rev: revision,
            cleanup_now: false,
            abandon: None,
            revision,
            ..self.clone()
        }
    }

    pub fn exists(&self) -> bool {
        self.spec.is_some()
            || self.registry.is_some()
            || self.dirty.is_some()
            || self.clean.is_some()
    }

    pub fn result(&self) -> Option<&JobResult> {
        self.dirty.as_ref().or(self.clean.as_ref())
    }

    pub fn state(&self) -> Option<State> {
        if let Some(r) = self.result() {
            return Some(r.status.into());
        }
        match &self.registry {
            Some((e, _)) if e.status == RegistryStatus::Running => Some(State::Running),
            Some(_) => Some(State::Pending),
            None => None,
        }
    }

    pub fn is_clean(&self) -> bool {
        self.clean.is_some() && self.dirty.is_none()
    }

    pub fn spec_hash(&self) -> Option<&str> {
        self.spec
            .as_ref()
            .map(|(r, _)| r.spec_hash.as_str())
            .or_else(|| self.result().map(|r| r.spec_hash.as_str()))
    }
}

/// One read of a job's snapshot.
enum Get {
    Key(String),
    Prefix(String),
}

/// What a snapshot of job `id` reads, in the order [`snapshot_from`] takes the answers.
fn gets(keys: &Keys, id: &str) -> Vec<Get> {
    let k = keys.job(id);
    [
        k.spec,
        k.registry,
        k.dirty,
        k.clean,
        k.cancel,
        k.cleanup_now,
        k.abandon,
    ]
    .into_iter()
    .map(Get::Key)
    .chain([Get::Prefix(keys.attempts_of(id))])
    .collect()
}

fn get_ops(keys: &Keys, id: &str) -> Vec<TxnOp> {
    gets(keys, id)
        .into_iter()
        .map(|g| match g {
            Get::Key(key) => TxnOp::get(key, None),
            Get::Prefix(p) => TxnOp::get(p, Some(GetOptions::new().with_prefix())),
        })
        .collect()
}

/// Job `id` as an in-memory etcd holds it (the protocol model's reads), decoded as a read of
/// etcd would be.
pub fn snapshot_in(keys: &Keys, mem: &store::mem::MemEtcd, id: &str) -> Result<Snapshot, Corrupt> {
    let k = keys.job(id);
    let get = |key: &str| mem.get(key.as_bytes());
    fn decode_one<T: serde::de::DeserializeOwned>(
        mem: &store::mem::MemEtcd,
        key: &str,
        versions: &[u32],
    ) -> Result<Option<T>, Corrupt> {
        mem.get(key.as_bytes())
            .map(|kv| codec::decode_any(key.as_bytes(), &kv.value, versions))
            .transpose()
    }
    let spec = match get(&k.spec) {
        Some(kv) => Some((
            codec::decode_any(k.spec.as_bytes(), &kv.value, spec::JOB_RECORD_VERSIONS_READ)?,
            kv.create,
        )),
        None => None,
    };
    let registry = match get(&k.registry) {
        Some(kv) => Some((
            codec::decode_any(
                k.registry.as_bytes(),
                &kv.value,
                records::REGISTRY_VERSIONS_READ,
            )?,
            kv.modified,
        )),
        None => None,
    };
    let prefix = keys.attempts_of(id);
    let attempts = mem
        .prefix(prefix.as_bytes())
        .filter_map(|(key, kv)| {
            let token = Keys::id_in(&prefix, key)?.parse::<i64>().ok()?;
            let rec = codec::decode(key, &kv.value, work::ATTEMPT_VERSION).ok()?;
            Some((token, (rec, kv.modified)))
        })
        .collect();
    Ok(Snapshot {
        id: id.to_string(),
        spec,
        registry,
        dirty: decode_one(mem, &k.dirty, records::RESULT_VERSIONS_READ)?,
        clean: decode_one(mem, &k.clean, records::RESULT_VERSIONS_READ)?,
        cancel: decode_one(mem, &k.cancel, &[records::CANCEL_VERSION])?,
        dirty_rev: get(&k.dirty).map_or(0, |kv| kv.modified),
        cleanup_now: get(&k.cleanup_now).is_some(),
        abandon: get(&k.abandon)
            .and_then(|kv| codec::decode(k.abandon.as_bytes(), &kv.value, 1).ok()),
        attempts,
        revision: mem.revision,
    })
}

/// Builds a snapshot from the answers to [`gets`], in order.
fn snapshot_from(
    id: &str,
    revision: i64,
    answers: Vec<TxnOpResponse>,
) -> Result<Snapshot, Corrupt> {
    let mut answers: Vec<Vec<etcd_client::KeyValue>> = answers
        .into_iter()
        .map(|a| match a {
            TxnOpResponse::Get(g) => g.kvs().to_vec(),
            _ => Vec::new(),
        })
        .collect();
    let attempt_kvs = if answers.len() > 7 {
        answers.pop().unwrap_or_default()
    } else {
        Vec::new()
    };
    let mut kvs = answers.into_iter().map(|v| v.into_iter().next());
    let mut next = || kvs.next().flatten();
    let spec = next();
    let registry = next();
    let dirty = next();
    let clean = next();
    let cancel = next();
    let cleanup_now = next().is_some();
    let abandon = next();
    let dirty_rev = dirty.as_ref().map_or(0, |kv| kv.mod_revision());
    Ok(Snapshot {
        id: id.to_string(),
        spec: spec
            .map(|kv| {
                Ok::<_, Corrupt>((
                    codec::decode_any(kv.key(), kv.value(), spec::JOB_RECORD_VERSIONS_READ)?,
                    kv.create_revision(),
                ))
            })
            .transpose()?,
        registry: registry
            .map(|kv| {
                Ok::<_, Corrupt>((
                    codec::decode_any(kv.key(), kv.value(), records::REGISTRY_VERSIONS_READ)?,
                    kv.mod_revision(),
                ))
            })
            .transpose()?,
        dirty: dirty
            .map(|kv| codec::decode_any(kv.key(), kv.value(), records::RESULT_VERSIONS_READ))
            .transpose()?,
        clean: clean
            .map(|kv| codec::decode_any(kv.key(), kv.value(), records::RESULT_VERSIONS_READ))
            .transpose()?,
        cancel: cancel
            .map(|kv| codec::decode(kv.key(), kv.value(), records::CANCEL_VERSION))
            .transpose()?,
        dirty_rev,
        cleanup_now,
        // A request that does not decode is counted and left alone: it must not wedge the
        // job's reads.
        abandon: abandon
            .and_then(|kv| codec::decode(kv.key(), kv.value(), records::ABANDON_VERSION).ok()),
        attempts: attempt_kvs
            .iter()
            .filter_map(|kv| {
                let token = std::str::from_utf8(kv.key())
                    .ok()?
                    .rsplit('/')
                    .next()?
                    .parse::<i64>()
                    .ok()?;
                let rec = codec::decode(kv.key(), kv.value(), work::ATTEMPT_VERSION).ok()?;
                Some((token, (rec, kv.mod_revision())))
            })
            .collect(),
        revision,
    })
}

/// Reads every key of one job in one transaction (one consistent revision).
pub async fn read(store: &Store, keys: &Keys, id: &str) -> Result<Snapshot, Error> {
    spec::validate_id(id)?;
    let mut c = store.client();
    let resp = store
        .timed("read job", c.txn(Txn::new().and_then(get_ops(keys, id))))
        .await?;
    let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
    Ok(snapshot_from(id, rev, resp.op_responses())?)
}

/// [`read`] through `group`: concurrent reads share one transaction (one consistent
/// revision each, as a read of its own would have).
pub async fn read_batched(group: &GroupCommit, keys: &Keys, id: &str) -> Result<Snapshot, Error> {
    spec::validate_id(id)?;
    let write = gets(keys, id)
        .into_iter()
        .fold(Write::new(), |w, g| match g {
            Get::Key(key) => w.get(key),
            Get::Prefix(p) => w.get_prefix(p),
        });
    match group.commit(write).await? {
        store::group::Outcome::Applied { revision, response } => {
            Ok(snapshot_from(id, revision, response.op_responses())?)
        }
        _ => Err(Error::Store(store::Error::Shared {
            op: "read job",
            reason: "a read without compares did not apply".into(),
        })),
    }
}

/// Outcome of a submission.
#[derive(Debug)]
pub struct Submitted {
    pub snapshot: Snapshot,
    /// False when an identical earlier submission was found.
    pub created: bool,
}

/// Submits `spec` as job `id` through `group` (concurrent submissions share transactions).
/// See the module doc for the idempotence rules. One round trip: a failed put-if-absent
/// answers with the existing job's keys.
pub async fn submit(
    group: &GroupCommit,
    keys: &Keys,
    id: &str,
    spec: JobSpec,
    submitted_by: &str,
) -> Result<Submitted, Error> {
    spec::validate_id(id)?;
    let k = keys.job(id);
    let hash = spec.hash();
    let record = JobRecord {
        version: spec.record_version(),
        job_id: id.to_string(),
        spec,
        spec_hash: hash.clone(),
        submitted_at_ms: records::now_ms(),
        submitted_by: Some(submitted_by.to_string()),
        schedule: None,
    };
    let write = Write::new()
        .when_absent(k.spec.clone())
        .when_absent(k.registry.clone())
        .when_absent(k.dirty.clone())
        .when_absent(k.clean.clone())
        .put(k.spec.clone(), codec::encode(&record))
        .put(k.registry.clone(), codec::encode(&RegistryEntry::pending()));
    let write = gets(keys, id).into_iter().fold(write, |w, g| match g {
        Get::Key(key) => w.or_get(key),
        Get::Prefix(p) => w.or_get_prefix(p),
    });
    let (rev, resp) = match group.commit(write).await? {
        store::group::Outcome::Applied { revision, .. } => (revision, None),
        store::group::Outcome::Conflict { revision, response } => (revision, Some(response)),
        store::group::Outcome::Fenced => {
            return Err(Error::Store(store::Error::Shared {
                op: "submit",
                reason: "a fence failed on an unfenced submission".into(),
            }))
        }
    };
    let Some(resp) = resp else {
        let snapshot = Snapshot {
            id: id.to_string(),
            spec: Some((record, rev)),
            registry: Some((RegistryEntry::pending(), rev)),
            revision: rev,
            ..Snapshot::default()
        };
        return Ok(Submitted {
            snapshot,
            created: true,
        });
    };
    let existing = snapshot_from(id, rev, resp.op_responses())?;
    if existing.spec_hash() == Some(hash.as_str()) {
        return Ok(Submitted {
            snapshot: existing,
            created: false,
        });
    }
    Err(Error::AlreadyExists {
        id: id.to_string(),
        terminated: existing.result().is_some(),
    })
}

/// Requests cancellation. Only a job with a registry entry (PENDING or RUNNING) can be
/// cancelled; the leader acts on the request.
pub async fn cancel(store: &Store, keys: &Keys, id: &str, via: &str) -> Result<Snapshot, Error> {
    spec::validate_id(id)?;
    let k = keys.job(id);
    let req = CancelRequest {
        version: records::CANCEL_VERSION,
        requested_at_ms: records::now_ms(),
        requested_via: via.to_string(),
    };
    let txn = Txn::new()
        .when([Compare::version(k.registry.clone(), CompareOp::Greater, 0)])
        .and_then([TxnOp::put(k.cancel.clone(), codec::encode(&req), None)]);
    let mut c = store.client();
    let resp = store.timed("cancel", c.txn(txn)).await?;
    let snap = read(store, keys, id).await?;
    if resp.succeeded() {
        return Ok(snap);
    }
    if snap.result().is_some() {
        Err(Error::Terminal(id.to_string()))
    } else {
        Err(Error::NotFound(id.to_string()))
    }
}

/// Asks the leader to retry a pending or exhausted cleanup at once, through a request key of
/// its own (the dirty entry belongs to the leader).
pub async fn request_cleanup(store: &Store, keys: &Keys, id: &str) -> Result<Snapshot, Error> {
    spec::validate_id(id)?;
    let key = keys.job(id).cleanup_now;
    let value = format!(
        "{{\"version\":1,\"requested_at_ms\":{}}}",
        records::now_ms()
    );
    cleanup_request(
        store,
        keys,
        id,
        key,
        value,
        "there is nothing to clean up yet",
    )
    .await
}

/// Asks the leader to end a job's cleanup by hand (`baton job cleanup ID --abandon`), through
/// a request key of its own. Refused unless the result is dirty.
pub async fn request_abandon(
    store: &Store,
    keys: &Keys,
    id: &str,
    reason: Option<String>,
    by: &str,
) -> Result<Snapshot, Error> {
    spec::validate_id(id)?;
    if let Some(r) = &reason {
        if r.len() > 1024 || r.contains('\0') {
            return Err(Error::Invalid(spec::Invalid {
                field: "reason",
                reason: "at most 1024 bytes, without NUL".into(),
            }));
        }
    }
    let req = AbandonRequest {
        version: records::ABANDON_VERSION,
        reason,
        requested_by: by.to_string(),
        requested_at_ms: records::now_ms(),
    };
    let key = keys.job(id).abandon;
    let not_yet = "there is no cleanup to abandon";
    cleanup_request(store, keys, id, key, codec::encode(&req), not_yet).await
}

/// Puts an operator's request about a dirty result's cleanup, only while the result is dirty;
/// otherwise says why (`not_yet`: for a job not terminal yet).
async fn cleanup_request(
    store: &Store,
    keys: &Keys,
    id: &str,
    key: String,
    value: impl Into<Vec<u8>>,
    not_yet: &str,
) -> Result<Snapshot, Error> {
    let txn = Txn::new()
        .when([Compare::version(keys.job(id).dirty, CompareOp::Greater, 0)])
        .and_then([TxnOp::put(key, value, None)]);
    let mut c = store.client();
    let resp = store.timed("cleanup request", c.txn(txn)).await?;
    let snap = read(store, keys, id).await?;
    if resp.succeeded() {
        Ok(snap)
    } else if snap.clean.is_some() {
        Err(Error::NotDirty(format!("job {id} is already clean")))
    } else if snap.exists() {
        Err(Error::NotDirty(format!(
            "job {id} has not reached a terminal state; {not_yet}"
        )))
    } else {
        Err(Error::NotFound(id.to_string()))
    }
}

/// One page of job ids under `prefix`, after `after` (exclusive), at most `limit`, read at
/// `revision` (0: now). Returns the page and the revision it was read at, to pin the next page.
pub async fn page_ids(
    store: &Store,
    prefix: &str,
    after: &str,
    limit: i64,
    revision: i64,
) -> Result<(Vec<etcd_client::KeyValue>, i64), Error> {
    page(store, Range::after(prefix, after), limit, revision, false).await
}

/// A key range `[start, end)`.
#[derive(Clone, Debug)]
pub struct Range {
    pub start: Vec<u8>,
    pub end: Vec<u8>,
}

impl Range {
    /// The keys under `prefix` that sort after `prefix + after` (all of them for `""`).
    pub fn after(prefix: &str, after: &str) -> Range {
        let start = if after.is_empty() {
            prefix.to_string()
        } else {
            format!("{prefix}{after}\0")
        };
        Range {
            start: start.into_bytes(),
            end: prefix_end(prefix),
        }
    }
}

/// At most `limit` keys of `range` in key order (values too unless `keys_only`), read at
/// `revision` (0: now). Returns them and the revision they were read at, to pin the next page.
pub async fn page(
    store: &Store,
    range: Range,
    limit: i64,
    revision: i64,
    keys_only: bool,
) -> Result<(Vec<etcd_client::KeyValue>, i64), Error> {
    // Keys come in ascending order without asking. Asking (any sort order) makes etcd read the
    // whole rest of the range for every page before it truncates: quadratic over the pages.
    let mut opts = GetOptions::new().with_range(range.end).with_limit(limit);
    if revision > 0 {
        opts = opts.with_revision(revision);
    }
    if keys_only {
        opts = opts.with_keys_only();
    }
    let mut c = store.client();
    let resp = store.timed("list", c.get(range.start, Some(opts))).await?;
    // A pinned read answers with the store's current revision in its header, not the pinned
    // one: a caller that chained that into its next page (or its watch) would skip every change
    // in between.
    let rev = if revision > 0 {
        revision
    } else {
        resp.header().map_or(0, |h| h.revision())
    };
    Ok((resp.kvs().to_vec(), rev))
}

/// The first key after every key with this prefix.
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}
