//! Replays a drill's history (`baton drill --history FILE`) through the model's etcd and its
//! invariants: every step must be one the protocol could take from the state before it, and
//! every invariant must hold after it.
//!
//! A step is **enabled** when:
//! - a write that carries a leader's term (an assignment, a dirty result created, a registry
//!   entry whose term changed) names the term of the election key as it stood just before;
//! - a job assignment finds no result of its job (the result store is the last word) and no
//!   execution of it running for certain (started before the revision, ended after it);
//! - a `started` attempt record finds its worker's key of that incarnation and its assignment at
//!   the token it names;
//! - an execution's start follows a `started` record of its job on its worker, and no result of
//!   its job recorded for certain before it.
//!
//! After each step: registry and assignments agree ([`invariants`]); a job has at most one
//! result; executions of a job never overlap (their starts and ends are on one boot clock).
//!
//! What local steps are concurrent with is known only to a window of revisions (see
//! `baton::drill::history`): a check fails only on what certainly happened in that order.

use std::collections::BTreeMap;

use baton::drill::history::{Event, Step, HISTORY_VERSION};
use baton::exec::record::LedgerEntry;
use baton::jobs::records::RegistryEntry;
use baton::jobs::work::{Assignment, AttemptRecord, AttemptState};
use baton::store::mem::{Kv, MemEtcd};
use baton::store::Keys;

use crate::invariants;

/// What a replay went through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub revisions: usize,
    pub events: usize,
    /// Leader writes whose term was checked against the election key.
    pub fenced: usize,
    pub assignments: usize,
    pub started_records: usize,
    pub executions: usize,
    pub results: usize,
}

/// A step that was not enabled, or an invariant broken after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The history's line (1-based).
    pub line: usize,
    pub what: String,
}

#[derive(Clone, Debug)]
struct Execution {
    job: String,
    start_t: u64,
    start_before_rev: i64,
    end_t: Option<u64>,
}

struct Replay {
    keys: Keys,
    etcd: MemEtcd,
    summary: Summary,
    findings: Vec<Finding>,
    line: usize,
    /// Revision at which each job's first result was recorded.
    result_rev: BTreeMap<String, i64>,
    /// `started` records by job and token: (revision, worker).
    started: BTreeMap<(String, i64), (i64, String)>,
    /// Executions of jobs (not cleanup steps), by (job, name, worker, pid).
    executions: BTreeMap<(String, String, String, i32), Execution>,
    /// Starts, to check against the `started` records once every revision is known.
    starts: Vec<(usize, LedgerEntry, i64)>,
}

/// Replays the history in `text` (JSON lines). `Err` for a file that is not a history.
pub fn replay(text: &str) -> Result<(Summary, Vec<Finding>), String> {
    let mut steps = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let header = steps.next().ok_or("an empty history")?;
    let prefix = match serde_json::from_str::<Step>(header.1) {
        Ok(Step::Header { version, prefix }) if version == HISTORY_VERSION => prefix,
        Ok(Step::Header { version, .. }) => {
            return Err(format!(
                "history version {version}; this checker reads {HISTORY_VERSION}"
            ))
        }
        _ => return Err("the first line is not a history header".into()),
    };
    let cluster = prefix
        .strip_prefix("/baton/")
        .and_then(|p| p.strip_suffix('/'))
        .ok_or_else(|| format!("a prefix that is not /baton/<cluster>/: {prefix}"))?;
    let mut r = Replay {
        keys: Keys::new(cluster),
        etcd: MemEtcd::new(),
        summary: Summary::default(),
        findings: Vec::new(),
        line: 1,
        result_rev: BTreeMap::new(),
        started: BTreeMap::new(),
        executions: BTreeMap::new(),
        starts: Vec::new(),
    };
    for (i, l) in steps {
        r.line = i + 1;
        let step: Step = serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1))?;
        match step {
            Step::Header { .. } => return Err(format!("line {}: a second header", i + 1)),
            Step::Etcd { rev, events } => r.etcd_step(rev, &events),
            Step::Local {
                entry,
                after_rev,
                before_rev,
            } => r.local_step(&entry, after_rev, before_rev),
        }
    }
    for (line, e, before_rev) in std::mem::take(&mut r.starts) {
        let worker = e.worker.clone().unwrap_or_default();
        // The guard's term is its attempt's token: `attempts/<job>/<token>`.
        let recorded = r
            .started
            .get(&(e.job_id.clone(), e.term))
            .is_some_and(|(rev, w)| *rev <= before_rev && (worker.is_empty() || *w == worker));
        if !recorded {
            r.line = line;
            r.find(format!(
                "{} of {} on {worker} started without a started record at or before revision {before_rev}",
                e.name, e.job_id
            ));
        }
    }
    Ok((r.summary, r.findings))
}

impl Replay {
    fn find(&mut self, what: String) {
        self.findings.push(Finding {
            line: self.line,
            what,
        });
    }

    /// The current term: the create revision of the election key that leads (etcd's election
    /// API: the oldest key under the election prefix; the model's single key otherwise).
    fn term(&self) -> Option<i64> {
        let election = self.keys.election();
        let candidates = format!("{election}/");
        self.etcd
            .prefix(candidates.as_bytes())
            .map(|(_, kv)| kv.create)
            .min()
            .or_else(|| self.etcd.get(election.as_bytes()).map(|kv| kv.create))
    }

    fn etcd_step(&mut self, rev: i64, events: &[Event]) {
        self.summary.revisions += 1;
        self.summary.events += events.len();
        if rev <= self.etcd.revision {
            self.find(format!("revision {rev} after {}", self.etcd.revision));
        }
        let election = self.term();
        for ev in events {
            if let Event::Put { key, value, .. } = ev {
                self.enabled(rev, key, value, election);
            }
        }
        for ev in events {
            match ev {
                Event::Put {
                    key,
                    value,
                    create,
                    modified,
                    version,
                    lease,
                } => {
                    self.etcd.kvs.insert(
                        key.as_bytes().to_vec(),
                        Kv {
                            value: value.as_bytes().to_vec(),
                            create: *create,
                            modified: *modified,
                            version: *version,
                            lease: *lease,
                        },
                    );
                }
                Event::Delete { key } => {
                    self.etcd.kvs.remove(key.as_bytes());
                }
            }
        }
        self.etcd.revision = rev;
        if let Some(why) = invariants::registry_disagreement(&self.keys, &self.etcd) {
            self.find(format!("after revision {rev}: {why}"));
        }
    }

    /// Whether the put of `value` at `key` could be made at `rev` from the state before it.
    fn enabled(&mut self, rev: i64, key: &str, value: &str, election: Option<i64>) {
        let keys = self.keys.clone();
        let fenced = |r: &mut Replay, term: i64, what: &str| {
            r.summary.fenced += 1;
            if election != Some(term) {
                r.find(format!(
                    "revision {rev}: {what} in term {term} while the election key's term is {election:?}"
                ));
            }
        };
        if let Some(rest) = Keys::id_in(&keys.assignments(), key.as_bytes()).map(str::to_string) {
            let Ok(a) = serde_json::from_str::<Assignment>(value) else {
                return self.find(format!(
                    "revision {rev}: an assignment that does not decode: {key}"
                ));
            };
            fenced(self, a.term, &format!("the assignment {rest}"));
            if rest
                .splitn(3, '/')
                .nth(2)
                .is_some_and(|j| j.starts_with("cleanup/"))
            {
                return;
            }
            self.summary.assignments += 1;
            let job = a.job_id.clone();
            let k = keys.job(&job);
            if self.etcd.get(k.dirty.as_bytes()).is_some()
                || self.etcd.get(k.clean.as_bytes()).is_some()
            {
                self.find(format!("revision {rev}: {job} assigned beside its result"));
            }
            let running: Vec<String> = self
                .executions
                .iter()
                .filter(|(_, e)| e.job == job && e.end_t.is_none() && e.start_before_rev < rev)
                .map(|((_, name, w, pid), _)| format!("{name} on {w} (pid {pid})"))
                .collect();
            if !running.is_empty() {
                self.find(format!(
                    "revision {rev}: {job} assigned while {} runs",
                    running.join(", ")
                ));
            }
        } else if let Some(job) = Keys::id_in(&keys.jobs(), key.as_bytes()).map(str::to_string) {
            // A job id used again after its clean result expired is a new job. (A first
            // submission clears nothing: a local step placed before it by a sparse sample
            // window may already have been replayed.)
            if self.etcd.get(key.as_bytes()).is_none() && self.result_rev.remove(&job).is_some() {
                self.started.retain(|(j, _), _| *j != job);
                self.executions
                    .retain(|(j, ..), x| *j != job || x.end_t.is_none());
            }
        } else if let Some(job) = Keys::id_in(&keys.dirty(), key.as_bytes()).map(str::to_string) {
            if self.etcd.get(key.as_bytes()).is_some() {
                return;
            }
            self.summary.results += 1;
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(value) {
                if let Some(term) = v.get("term").and_then(|t| t.as_i64()) {
                    fenced(self, term, &format!("the result of {job}"));
                }
            }
            if let Some(first) = self.result_rev.get(&job) {
                self.find(format!(
                    "revision {rev}: a second result of {job} (the first at {first})"
                ));
            }
            self.result_rev.entry(job).or_insert(rev);
        } else if let Some(job) = Keys::id_in(&keys.clean(), key.as_bytes()).map(str::to_string) {
            // Moved from dirty in one transaction: a clean result without a dirty one is new.
            let dirty = keys.job(&job).dirty;
            if self.etcd.get(dirty.as_bytes()).is_none() && self.etcd.get(key.as_bytes()).is_none()
            {
                self.summary.results += 1;
                if let Some(first) = self.result_rev.get(&job) {
                    self.find(format!(
                        "revision {rev}: a second result of {job} (the first at {first})"
                    ));
                }
                self.result_rev.entry(job).or_insert(rev);
            }
        } else if let Some(job) = Keys::id_in(&keys.registry(), key.as_bytes()).map(str::to_string)
        {
            let Ok(entry) = serde_json::from_str::<RegistryEntry>(value) else {
                return self.find(format!(
                    "revision {rev}: a registry entry that does not decode: {key}"
                ));
            };
            // Every leader write of an entry stamps its own term (a submission writes 0).
            if entry.term != 0 {
                fenced(self, entry.term, &format!("the registry entry of {job}"));
            }
        } else if let Some(rest) = Keys::id_in(&keys.attempts(), key.as_bytes()).map(str::to_string)
        {
            let Some((job, token)) = rest.rsplit_once('/') else {
                return;
            };
            let Ok(rec) = serde_json::from_str::<AttemptRecord>(value) else {
                return self.find(format!(
                    "revision {rev}: an attempt record that does not decode: {key}"
                ));
            };
            if rec.state != AttemptState::Started {
                return;
            }
            self.summary.started_records += 1;
            let token: i64 = token.parse().unwrap_or(-1);
            let worker = self
                .etcd
                .get(keys.worker(&rec.worker).as_bytes())
                .map(|kv| kv.create);
            if worker != Some(rec.worker_rev) {
                self.find(format!(
                    "revision {rev}: {job} started by {} incarnation {} while its key's is {worker:?}",
                    rec.worker, rec.worker_rev
                ));
            }
            let akey = keys.assignment(&rec.worker, rec.worker_rev, job);
            let assigned = self.etcd.get(akey.as_bytes()).map(|kv| kv.modified);
            if assigned != Some(token) {
                self.find(format!(
                    "revision {rev}: {job} started at token {token} while its assignment stands at {assigned:?}"
                ));
            }
            self.started
                .entry((job.to_string(), token))
                .or_insert((rev, rec.worker.clone()));
        }
    }

    fn local_step(&mut self, e: &LedgerEntry, after_rev: i64, before_rev: i64) {
        if !e.name.starts_with("attempt-") {
            return;
        }
        let worker = e.worker.clone().unwrap_or_default();
        let id = (e.job_id.clone(), e.name.clone(), worker.clone(), e.pid);
        match e.event.as_str() {
            "start" => {
                self.summary.executions += 1;
                if let Some(first) = self.result_rev.get(&e.job_id).filter(|r| **r <= after_rev) {
                    self.find(format!(
                        "{} of {} started after its result (revision {first})",
                        e.name, e.job_id
                    ));
                }
                // Revisions up to `before_rev` may come later in the file: checked at the end.
                self.starts.push((self.line, e.clone(), before_rev));
                let overlapping: Vec<String> = self
                    .executions
                    .iter()
                    .filter(|(_, x)| {
                        x.job == e.job_id && x.end_t.is_none_or(|end| end > e.boottime_ns)
                    })
                    .map(|((_, name, w, pid), _)| format!("{name} on {w} (pid {pid})"))
                    .collect();
                if !overlapping.is_empty() {
                    self.find(format!(
                        "{} of {} started while {} ran",
                        e.name,
                        e.job_id,
                        overlapping.join(", ")
                    ));
                }
                self.executions.insert(
                    id,
                    Execution {
                        job: e.job_id.clone(),
                        start_t: e.boottime_ns,
                        start_before_rev: before_rev,
                        end_t: None,
                    },
                );
            }
            "end" => match self.executions.get_mut(&id) {
                Some(x) if x.end_t.is_none() && x.start_t <= e.boottime_ns => {
                    x.end_t = Some(e.boottime_ns);
                }
                _ => self.find(format!(
                    "{} of {} on {worker} ended without its start",
                    e.name, e.job_id
                )),
            },
            other => self.find(format!("an unknown local step {other:?}")),
        }
    }
}
