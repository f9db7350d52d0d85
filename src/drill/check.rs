//! The drill's checks: the whole history, from etcd, the guards' execution ledger and the role
//! logs, against the guarantees Baton makes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use etcd_client::GetOptions;
use serde::Serialize;

use super::workload::{Kind, Submitted};
use super::Round;
use crate::clock::BootInstant;
use crate::exec::record::{KilledBy, LedgerEntry};
use crate::jobs::prefix_end;
use crate::jobs::records::{self, JobResult};
use crate::jobs::work::{AttemptRecord, AttemptState, ATTEMPT_VERSION};
use crate::rolelog;
use crate::store::codec;

/// One of the guarantees a drill checks.
#[derive(Clone, Debug, Serialize)]
pub struct Invariant {
    pub number: u8,
    pub name: &'static str,
}

#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub invariant: Invariant,
    pub passed: bool,
    /// False when the evidence is not visible from here (host-local ledgers and role logs of a
    /// remote cluster); such a verdict is reported as NOT CHECKED, never as a pass.
    pub checked: bool,
    /// For a failure: what shows it (at most a few lines).
    pub evidence: Vec<String>,
}

pub(super) fn verdict(number: u8, name: &'static str, evidence: Vec<String>) -> Verdict {
    Verdict {
        invariant: Invariant { number, name },
        checked: true,
        passed: evidence.is_empty(),
        evidence: evidence.into_iter().take(8).collect(),
    }
}

/// What the checks read: the cluster's etcd, and (for a local drill) the host-local evidence.
#[derive(Clone, Debug)]
pub struct Target {
    pub etcd: Vec<String>,
    pub cluster: String,
    /// The guards' execution ledger; `None` when drilling a remote cluster.
    pub ledger: Option<std::path::PathBuf>,
    pub role_logs: Vec<(String, std::path::PathBuf)>,
    /// When the drill's own processes were seen to exit (empty for a remote cluster).
    pub exits: Vec<crate::rolelog::Exit>,
}

async fn client(t: &Target) -> anyhow::Result<etcd_client::Client> {
    Ok(etcd_client::Client::connect(&t.etcd, None).await?)
}

fn prefix(t: &Target, suffix: &str) -> String {
    format!("/baton/{}/{suffix}", t.cluster)
}

pub async fn count_prefix(lab: &Target, suffix: &str) -> anyhow::Result<i64> {
    let p = prefix(lab, suffix);
    let mut c = client(lab).await?;
    let r = c
        .get(
            p.clone(),
            Some(
                GetOptions::new()
                    .with_range(prefix_end(&p))
                    .with_count_only(),
            ),
        )
        .await?;
    Ok(r.count())
}

/// Every value under a prefix, paged.
async fn all(lab: &Target, suffix: &str) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let p = prefix(lab, suffix);
    let mut c = client(lab).await?;
    let mut out = Vec::new();
    let mut start = p.clone();
    loop {
        let r = c
            .get(
                start.clone(),
                Some(GetOptions::new().with_range(prefix_end(&p)).with_limit(500)),
            )
            .await?;
        for kv in r.kvs() {
            let id = String::from_utf8_lossy(&kv.key()[p.len()..]).into_owned();
            out.push((id, kv.value().to_vec()));
        }
        match r.kvs().last() {
            Some(last) if r.more() => start = format!("{}\0", String::from_utf8_lossy(last.key())),
            _ => return Ok(out),
        }
    }
}

/// Waits (bounded) until some job runs (on worker `on`, if given): RUNNING in the registry and
/// its worker has recorded the start, so a fault has an execution to interrupt (an assignment
/// not yet started would only be handed elsewhere).
pub async fn wait_running(lab: &Target, within: Duration, on: Option<&str>) {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let (Ok(entries), Ok(attempts)) =
            (all(lab, "registry/").await, all(lab, "attempts/").await)
        {
            let running: HashSet<&str> = entries
                .iter()
                .filter(|(id, v)| {
                    codec::decode_any::<records::RegistryEntry>(
                        id.as_bytes(),
                        v,
                        records::REGISTRY_VERSIONS_READ,
                    )
                    .is_ok_and(|e| e.status == records::RegistryStatus::Running)
                })
                .map(|(id, _)| id.as_str())
                .collect();
            let started = attempts.iter().any(|(key, v)| {
                let job = key.split('/').next().unwrap_or_default();
                running.contains(job)
                    && codec::decode::<AttemptRecord>(key.as_bytes(), v, ATTEMPT_VERSION).is_ok_and(
                        |r| r.state == AttemptState::Started && on.is_none_or(|w| r.worker == w),
                    )
            });
            if started {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until nothing is pending, running or dirty.
pub async fn drain(lab: &Target, within: Duration) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        let busy = count_prefix(lab, "registry/").await.unwrap_or(1)
            + count_prefix(lab, "results/dirty/").await.unwrap_or(1);
        if busy == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

pub fn ledger(t: &Target) -> Vec<LedgerEntry> {
    let Some(path) = &t.ledger else {
        return Vec::new();
    };
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

pub fn first_start_after(lab: &Target, after: BootInstant, term: i64) -> Option<BootInstant> {
    ledger(lab)
        .iter()
        .filter(|e| {
            e.event == "start"
                && e.term > term
                && e.boottime_ns >= after.as_nanos()
                && e.name.starts_with("attempt-")
        })
        .map(|e| BootInstant::from_nanos(e.boottime_ns))
        .min()
}

/// Executions assigned in `term` or later (their token, the assignment's revision, is above the
/// term's) and started after `after`, whose job had an earlier execution cut off.
pub fn restarted_in(lab: &Target, after: BootInstant, term: i64) -> usize {
    let l = ledger(lab);
    let cut: HashSet<&str> = l
        .iter()
        .filter(|e| e.event == "end" && e.boottime_ns <= after.as_nanos() + 60_000_000_000)
        .filter(|e| {
            matches!(
                e.exit.as_ref().and_then(|x| x.killed_by),
                Some(KilledBy::LeaderGone | KilledBy::Deadline)
            )
        })
        .map(|e| e.job_id.as_str())
        .collect();
    l.iter()
        .filter(|e| e.event == "start" && e.term > term && e.boottime_ns >= after.as_nanos())
        .filter(|e| e.name.starts_with("attempt-") && cut.contains(e.job_id.as_str()))
        .count()
}

/// Jobs with an execution (an attempt) on `worker` that started and has not ended.
pub fn running_on(lab: &Target, worker: &str) -> HashSet<String> {
    running_in(&ledger(lab), worker)
}

fn running_in(l: &[LedgerEntry], worker: &str) -> HashSet<String> {
    executions(l)
        .into_iter()
        .filter(|(_, runs)| {
            runs.iter().any(|x| {
                x.end_ns.is_none()
                    && x.name.starts_with("attempt-")
                    && x.worker.as_deref() == Some(worker)
            })
        })
        .map(|(id, _)| id)
        .collect()
}

/// Whether some job of `jobs` still runs on `worker` with no execution assigned after `term`
/// (its token above it) yet: resuming that worker now would end the execution before the new
/// leader could start it again, and hide an overlap.
pub fn awaiting_restart(lab: &Target, worker: &str, jobs: &HashSet<String>, term: i64) -> bool {
    let l = ledger(lab);
    let again: HashSet<&str> = l
        .iter()
        .filter(|e| e.event == "start" && e.term > term && e.name.starts_with("attempt-"))
        .map(|e| e.job_id.as_str())
        .collect();
    running_in(&l, worker)
        .iter()
        .any(|id| jobs.contains(id) && !again.contains(id.as_str()))
}

/// One execution, from its ledger start and end.
#[derive(Debug)]
struct Execution {
    name: String,
    pid: i32,
    start_ns: u64,
    start_ms: u64,
    end_ns: Option<u64>,
    exit: Option<crate::exec::record::ExitRecord>,
    worker: Option<String>,
}

fn executions(l: &[LedgerEntry]) -> HashMap<String, Vec<Execution>> {
    let mut by_job: HashMap<String, Vec<Execution>> = HashMap::new();
    for e in l.iter().filter(|e| e.event == "start") {
        by_job.entry(e.job_id.clone()).or_default().push(Execution {
            name: e.name.clone(),
            pid: e.pid,
            start_ns: e.boottime_ns,
            start_ms: e.unix_ms,
            end_ns: None,
            exit: None,
            worker: e.worker.clone(),
        });
    }
    for e in l.iter().filter(|e| e.event == "end") {
        if let Some(x) = by_job
            .get_mut(&e.job_id)
            .and_then(|v| v.iter_mut().find(|x| x.pid == e.pid && x.name == e.name))
        {
            x.end_ns = Some(e.boottime_ns);
            x.exit = e.exit.clone();
        }
    }
    by_job
}

pub async fn verify(
    lab: &Target,
    submitted: &Submitted,
    rounds: &[Round],
    drained: bool,
) -> anyhow::Result<Vec<Verdict>> {
    let clean: BTreeMap<String, JobResult> = all(lab, "results/clean/")
        .await?
        .into_iter()
        .filter_map(|(id, v)| {
            codec::decode_any(id.as_bytes(), &v, records::RESULT_VERSIONS_READ)
                .ok()
                .map(|r| (id, r))
        })
        .collect();
    let dirty = all(lab, "results/dirty/").await?;
    let registry = all(lab, "registry/").await?;
    let ledger = ledger(lab);
    let execs = executions(&ledger);
    let mut out = Vec::new();

    // 1. Every acknowledged submission has exactly one terminal result.
    let dirty_ids: HashSet<&str> = dirty.iter().map(|(id, _)| id.as_str()).collect();
    let mut ev = Vec::new();
    for (id, _) in &submitted.acked {
        let n = usize::from(clean.contains_key(id)) + usize::from(dirty_ids.contains(id.as_str()));
        if n != 1 {
            ev.push(format!("{id}: {n} terminal results"));
        }
    }
    out.push(verdict(
        1,
        "every acknowledged submission has exactly one terminal result",
        ev,
    ));

    // 2. No execution after the result; no two executions of one job at once.
    let mut ev = Vec::new();
    for (id, xs) in &execs {
        let mut attempts: Vec<&Execution> = xs
            .iter()
            .filter(|x| x.name.starts_with("attempt-"))
            .collect();
        attempts.sort_by_key(|x| x.start_ns);
        for w in attempts.windows(2) {
            match w[0].end_ns {
                Some(end) if end <= w[1].start_ns => {}
                Some(end) => ev.push(format!(
                    "{id}: {} (pid {}) ran until {end} but {} (pid {}) started at {}",
                    w[0].name, w[0].pid, w[1].name, w[1].pid, w[1].start_ns
                )),
                None => ev.push(format!(
                    "{id}: {} (pid {}) has no recorded end",
                    w[0].name, w[0].pid
                )),
            }
        }
        if let Some(r) = clean.get(id) {
            for x in &attempts {
                if x.start_ms > r.finished_at_ms {
                    ev.push(format!(
                        "{id}: {} started at {} ms, after its result ({} ms)",
                        x.name, x.start_ms, r.finished_at_ms
                    ));
                }
            }
        }
    }
    out.push(verdict(
        2,
        "no execution after the terminal result; no two executions of a job overlapped",
        ev,
    ));

    // 3. Every dirty result became clean; every cleanup command completed at least once.
    let mut ev: Vec<String> = dirty
        .iter()
        .map(|(id, _)| format!("{id}: still dirty"))
        .collect();
    if !drained {
        ev.push("the workload did not drain within its deadline".into());
    }
    for (id, kind) in submitted.acked.iter().filter(|_| lab.ledger.is_some()) {
        if matches!(kind, Kind::Cleanup | Kind::FlakyCleanup) {
            let ok = execs.get(id).is_some_and(|xs| {
                xs.iter().any(|x| {
                    x.name.starts_with("cleanup-")
                        && x.exit
                            .as_ref()
                            .is_some_and(|e| e.exit_code == Some(0) && e.killed_by.is_none())
                })
            });
            if !ok {
                ev.push(format!("{id}: its cleanup command never completed"));
            }
        }
    }
    out.push(verdict(
        3,
        "every dirty result became clean and every cleanup command completed",
        ev,
    ));

    // 4. The registry holds only PENDING/RUNNING, and nothing at the end.
    let mut ev: Vec<String> = registry
        .iter()
        .map(|(id, v)| {
            match codec::decode_any::<records::RegistryEntry>(
                id.as_bytes(),
                v,
                records::REGISTRY_VERSIONS_READ,
            ) {
                Ok(e) => format!("{id}: left in the registry as {:?}", e.status),
                Err(e) => format!("{id}: an entry that is not PENDING/RUNNING: {e}"),
            }
        })
        .collect();
    ev.truncate(8);
    out.push(verdict(
        4,
        "the registry holds only PENDING/RUNNING, and is empty at the end",
        ev,
    ));

    // 5. No two terms overlapped; every result was written within its term.
    let mut ev = Vec::new();
    let mut events = Vec::new();
    for (id, path) in &lab.role_logs {
        match std::fs::read_to_string(path).map(|t| rolelog::parse(&t)) {
            Ok(Ok(e)) => events.extend(e),
            Ok(Err(e)) => ev.push(format!("{id}: {e}")),
            Err(_) => {}
        }
    }
    let terms = rolelog::terms_until_exits(&events, &lab.exits);
    if let Err(o) = rolelog::check_terms(&terms) {
        ev.push(o.to_string());
    }
    ev.extend(rolelog::unproven_revokes(&events, &lab.exits));
    let known: HashSet<i64> = terms.iter().map(|t| t.term).collect();
    for (id, r) in &clean {
        if !known.contains(&r.term) {
            ev.push(format!(
                "{id}: result written by term {}, which no role log shows",
                r.term
            ));
        }
    }
    out.push(verdict(
        5,
        "no two terms overlapped, and every result came from a known term",
        ev,
    ));

    // 6. Submissions kept succeeding during every fault.
    let ev = submitted
        .failures
        .iter()
        .map(|(id, e, at)| format!("{id} at {at} ms: {e}"))
        .collect();
    out.push(verdict(
        6,
        "submissions kept succeeding during every fault",
        ev,
    ));
    // 7. Every execution that was cut off ran in a process a fault hit: a leader change alone
    //    stops nothing.
    let mut ev = Vec::new();
    for (id, xs) in &execs {
        for x in xs.iter().filter(|x| x.name.starts_with("attempt-")) {
            let cut = x.exit.as_ref().is_some_and(|e| {
                matches!(e.killed_by, Some(KilledBy::LeaderGone | KilledBy::Deadline))
            });
            if !cut {
                continue;
            }
            let worker = x.worker.as_deref().unwrap_or("");
            let explained = rounds.iter().any(|r| {
                r.at_ns <= x.end_ns.unwrap_or(u64::MAX)
                    && r.faulted.iter().any(|f| f == "*" || f == worker)
            });
            if !explained {
                ev.push(format!(
                    "{id}: {} (pid {}) on {worker:?} was stopped, and no fault hit {worker:?}",
                    x.name, x.pid
                ));
            }
        }
    }
    ev.truncate(8);
    out.push(verdict(
        7,
        "no execution was stopped by a coordinator leader change (every cut is a worker's fault)",
        ev,
    ));
    if lab.ledger.is_none() {
        for v in out
            .iter_mut()
            .filter(|v| matches!(v.invariant.number, 2 | 5 | 7))
        {
            v.checked = false;
            v.passed = true;
            v.evidence.clear();
        }
    }
    Ok(out)
}
