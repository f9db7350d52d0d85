//! A bounded model of Baton's protocol, checked exhaustively with `stateright`'s plain
//! [`Model`] (not its actor layer).
//!
//! What is modelled, and how it is tied to the code:
//! - **etcd** is [`MemEtcd`]: keys with create and mod revisions and leases, each applied write
//!   one revision, compares evaluated as etcd does; leases count down in ticks and expire.
//! - **The leader's decisions and writes are the code's own**: each step reads the job from the
//!   in-memory etcd ([`jobs::snapshot_in`]), decides with [`protocol::decide`] and builds its
//!   write with [`protocol::Job`]; a **worker's** registration, `started` and reports are
//!   [`writes`]' builders. A compare taken out of the code fails the model.
//! - **Leaders** win a single election key on a lease, act only while their proof (the last
//!   keepalive's send time plus the TTL) exceeds the margin, and must step down before time
//!   passes otherwise. Their writes are fenced by the election key's create revision and may
//!   land late: a write in flight lands even after its writer paused, crashed or lost its term.
//! - **Workers** register on leases of their own; their guards run a job only after its
//!   `started` record and a go within the proven deadline, are fed each renewed deadline, and
//!   must kill at `deadline - margin` before time passes. A worker learns that its key is gone
//!   only when its watch delivers (an action that may come late, or never).
//! - **Time** passes in ticks; timers are kept as ticks left, so the space is finite. Healthy
//!   processes renew on time; leases are lost only through faults.
//! - **Fast failover** (optional, [`BatonModel::with_fast_failover`]): a follower with evidence
//!   that the leader's process is gone (its host crashed) revokes the election key's lease in one
//!   step that also checks the key still holds it. Checked: the crashed leader's late writes
//!   fail on the fence and no two leaders act; the `revoke_live` mutation (evidence against a
//!   live leader) must break "one acting leader".
//! - **Faults** come from a budget: replica and worker crash, pause and cut from etcd; a worker's
//!   key deleted with its lease alive; a worker's lease revoked early.
//!
//! - **Revisions** are renamed to ranks after each step ([`ranks`]), so runs that differ only
//!   in how many revisions etcd counted meet in one state.
//! - **A schedule** (optional, [`BatonModel::with_schedule`]): its ticks come due in any order
//!   with every other step; a leader fires the latest due tick with the code's own decision and
//!   write ([`fire::plan`]), which may land late like any leader write, and its tick's job then
//!   runs like any other. Checked: each tick's job is created at most once, never at or before
//!   the watermark, and under `forbid` and `replace` two runs never overlap.

use std::collections::BTreeMap;

use baton::coordinator::protocol::{self, Decision, Ending, Job, Outcome, Seen, Target};
use baton::jobs::spec::{JobRecord, JobSpec, JOB_RECORD_VERSION};
use baton::jobs::work::{
    AttemptRecord, AttemptState, WorkerRecord, ATTEMPT_VERSION, WORKER_VERSION,
};
use baton::jobs::{self, records::RegistryEntry, records::TerminalStatus};
use baton::schedule::fire::{self, Fire, Known, Plan};
use baton::schedule::record::{
    Overlap, ScheduleRecord, ScheduleStatus, SCHEDULE_VERSION, STATUS_VERSION,
};
use baton::store::mem::MemEtcd;
use baton::store::{codec, Cond, Effect, Keys, Write};
use baton::worker::writes;
use stateright::{Model, Property};
use std::time::Duration;

use baton::clock::BootInstant;
use baton::election as lease;

pub mod invariants;
mod ranks;
pub mod replay;

/// Lease TTL and margin, in ticks.
pub const TTL: u8 = 3;
pub const MARGIN: u8 = 1;
/// Restarts after a lost worker a job may have.
pub const MAX_RECOVERIES: u32 = 1;

/// A fault the budget may spend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    ReplicaCrash,
    ReplicaPause,
    ReplicaCut,
    WorkerCrash,
    WorkerPause,
    WorkerCut,
    /// `etcdctl del workers/<id>`: the key goes, its lease lives on.
    KeyDeleted,
    /// The worker's lease revoked early.
    LeaseRevoked,
}

pub const ALL_FAULTS: [FaultKind; 8] = [
    FaultKind::ReplicaCrash,
    FaultKind::ReplicaPause,
    FaultKind::ReplicaCut,
    FaultKind::WorkerCrash,
    FaultKind::WorkerPause,
    FaultKind::WorkerCut,
    FaultKind::KeyDeleted,
    FaultKind::LeaseRevoked,
];

/// Test-only switches that break the protocol on purpose: each must yield a counterexample,
/// so a model that explores nothing cannot pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Mutations {
    /// Leader writes land without the term's fence.
    pub no_fence: bool,
    /// Writes that end an attempt lose their compare on its record.
    pub no_attempt_compare: bool,
    /// A guard gives the go even when its deadline is too near.
    pub no_go_check: bool,
    /// A gone worker's jobs are rescheduled without waiting its TTL and margin.
    pub short_wait: bool,
    /// A gone worker's lease is not revoked before the wait, and a worker's renewals do not
    /// check its own key (both close the gap of issue 27).
    pub no_revoke: bool,
    /// A keepalive's proof counts from its answer's arrival, not from when it was sent.
    pub proof_from_answer: bool,
    /// A schedule's fire write loses its compares on the status and its tick's id (a leader
    /// that lost a fire's answer then fires the tick again from what it remembered).
    pub no_tick_guards: bool,
    /// Assignments lose their compares on the runs they wait `after` (a `replace` then
    /// overlaps).
    pub no_after: bool,
    /// Fast failover revokes a leader whose process is alive (evidence that is not).
    pub revoke_live: bool,
}

/// The model's bounds.
#[derive(Clone, Debug)]
pub struct BatonModel {
    pub replicas: u8,
    pub workers: u8,
    pub jobs: u8,
    /// Fault kinds that may happen.
    pub faults: Vec<FaultKind>,
    /// How many faults may happen.
    pub budget: u8,
    pub mutations: Mutations,
    /// Faults may hit every replica and worker, not only replica 0 and worker 0 (larger).
    pub everywhere: bool,
    /// A schedule `s` (`@every 1s`) with this overlap policy and this many ticks, besides the
    /// submitted jobs.
    pub schedule: Option<(Overlap, u8)>,
    /// A leader write about the schedule may land with its answer lost (an etcd timeout): the
    /// leader then decides again from what it remembered.
    pub lost_answers: bool,
    /// Fast failover: a follower with evidence that the leader's process is gone (in the
    /// model: its host crashed) revokes the election key's lease at once, if the key still
    /// holds it.
    pub fast_failover: bool,
    keys: Keys,
}

impl BatonModel {
    pub fn new(replicas: u8, workers: u8, jobs: u8) -> BatonModel {
        BatonModel {
            replicas,
            workers,
            jobs,
            faults: Vec::new(),
            budget: 0,
            mutations: Mutations::default(),
            everywhere: false,
            schedule: None,
            lost_answers: false,
            fast_failover: false,
            keys: Keys::new("m"),
        }
    }

    /// A schedule whose `ticks` ticks its leaders fire (under `overlap`).
    pub fn with_schedule(mut self, overlap: Overlap, ticks: u8) -> BatonModel {
        self.schedule = Some((overlap, ticks));
        self
    }

    /// Followers revoke a crashed leader's lease on evidence.
    pub fn with_fast_failover(mut self) -> BatonModel {
        self.fast_failover = true;
        self
    }

    /// Fire answers may be lost.
    pub fn with_lost_answers(mut self) -> BatonModel {
        self.lost_answers = true;
        self
    }

    /// Submitted jobs, then the schedule's tick jobs.
    pub fn all_jobs(&self) -> u8 {
        self.jobs + self.schedule.map_or(0, |(_, t)| t)
    }

    /// The tick a job index stands for (1-based), if it is a tick job.
    fn tick_of(&self, j: u8) -> Option<u8> {
        (j >= self.jobs).then(|| j - self.jobs + 1)
    }

    pub fn with_faults(mut self, faults: &[FaultKind], budget: u8) -> BatonModel {
        self.faults = faults.to_vec();
        self.budget = budget;
        self
    }

    /// Faults may hit any replica or worker.
    pub fn everywhere(mut self) -> BatonModel {
        self.everywhere = true;
        self
    }

    pub fn with_mutations(mut self, m: Mutations) -> BatonModel {
        self.mutations = m;
        self
    }

    pub fn job_id(&self, j: u8) -> String {
        match self.tick_of(j) {
            Some(k) => baton::schedule::tick_id("s", tick_ms(k)),
            None => format!("j{j}"),
        }
    }

    fn worker_id(w: u8) -> String {
        format!("w{w}")
    }

    fn election(&self) -> String {
        self.keys.election()
    }

    /// The election key's lease, if fast failover has evidence against its holder: its
    /// process is gone (or, mutated, always).
    fn evidence(&self, s: &State) -> Option<i64> {
        if !self.fast_failover {
            return None;
        }
        let kv = s.etcd.get(self.election().as_bytes())?;
        let holder: usize = std::str::from_utf8(&kv.value)
            .ok()?
            .strip_prefix('r')?
            .parse()
            .ok()?;
        let gone = s.replicas.get(holder)?.host.crashed;
        (gone || self.mutations.revoke_live).then_some(kv.lease)
    }
}

/// A process's host: crashed, paused (SIGSTOP: its guards, separate processes, go on), or cut
/// off from etcd.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Host {
    pub crashed: bool,
    pub paused: bool,
    pub cut: bool,
}

impl Host {
    fn runs(&self) -> bool {
        !self.crashed && !self.paused
    }
}

/// A term this replica holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Lead {
    /// The election key's create revision: the fence.
    pub fence: i64,
    pub lease: i64,
    /// Ticks its lease is proven for.
    pub proof: u8,
    /// A keepalive sent and not answered yet: ticks since it was sent.
    pub renewal: Option<u8>,
}

/// A leader write sent and not yet applied: its compares, effects and fence.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InFlight {
    pub conds: Vec<Cond>,
    pub effects: Vec<Effect>,
    /// The writer's term (its election key's create revision).
    pub term: i64,
    /// The fence it carries (none under the mutation control).
    pub fence: Option<i64>,
    /// The jobs whose result it writes.
    pub results: Vec<u8>,
    /// The schedule's tick whose job it creates (0: none).
    pub fires: u8,
    /// A write about the schedule's status: its answer updates what the leader remembers.
    pub about_status: bool,
}

/// A gone worker incarnation, as a leader follows it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gone {
    /// Ticks before its jobs may be restarted.
    pub wait: u8,
    /// This term revoked its lease (the wait counts from then).
    pub revoked: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Replica {
    pub host: Host,
    pub lead: Option<Lead>,
    pub outbox: Option<InFlight>,
    /// Gone worker incarnations (by create revision) this term follows.
    pub gone: BTreeMap<i64, Gone>,
    /// What this term remembers of the schedule's status: its value and mod revision (read at
    /// the term's start, then what its own writes' answers say).
    pub sched: Option<(Vec<u8>, i64)>,
}

/// A worker incarnation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Inc {
    pub rev: i64,
    pub lease: i64,
    pub proof: u8,
    /// A keepalive sent and not answered yet: ticks since it was sent.
    pub renewal: Option<u8>,
}

/// A lease guard and the job under it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Guard {
    pub job: u8,
    /// The worker incarnation it was assigned to.
    pub inc: i64,
    /// The assignment's revision.
    pub token: i64,
    /// The revision of its `started` record.
    pub started: i64,
    pub go: bool,
    /// Ticks before its deadline.
    pub deadline: u8,
    /// The job's process group is alive.
    pub running: bool,
    /// The group is gone (on its own, `exited`, or killed).
    pub ended: bool,
    pub exited: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Worker {
    pub host: Host,
    pub inc: Option<Inc>,
    pub guards: Vec<Guard>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub etcd: MemEtcd,
    /// etcd's countdown of each live lease, in ticks.
    pub countdown: BTreeMap<i64, u8>,
    pub next_lease: i64,
    pub replicas: Vec<Replica>,
    pub workers: Vec<Worker>,
    pub faults_left: u8,
    /// Results written per job.
    pub results: Vec<u8>,
    /// The schedule's ticks that have come due (the wall clock has passed them).
    pub due: u8,
    /// Creations of each tick's job.
    pub fired: Vec<u8>,
    /// An invariant broken at a step (kept: every later state shows it).
    pub broken: Option<&'static str>,
}

/// What a leader's step is told to do with a PENDING or unstarted job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pick {
    /// Nothing to choose.
    Any,
    /// Assign it to this worker.
    To(u8),
    /// An assignment without a start: take it back (its assign timeout has passed).
    TakeBack,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Tick,
    Campaign(u8),
    /// A keepalive sent (etcd restarts the lease's countdown on receipt).
    KeepAlive(u8),
    /// Its answer arrives: the proof is renewed.
    Answer(u8),
    StepDown(u8),
    Act(u8, u8, Pick),
    /// The schedule's next tick comes due.
    Due,
    /// Leader `.0` fires the schedule's latest due tick.
    Fire(u8),
    Land(u8),
    /// A write about the schedule lands, and its answer is lost.
    LandLost(u8),
    Register(u8),
    WorkerKeepAlive(u8),
    /// Its answer arrives, with the worker's own key read back after it was sent.
    WorkerAnswer(u8),
    /// The worker's watch delivers its own key's state.
    WatchSelf(u8),
    /// The worker's lease can no longer be proven beyond the margin: the incarnation is over.
    WorkerLost(u8),
    /// The worker sees its assignment of job `.1` and writes `started`.
    Take(u8, u8),
    Go(u8, u8),
    /// The guard kills the job at its deadline.
    Kill(u8, u8),
    /// The job exits on its own.
    Exit(u8, u8),
    /// The worker sees its assignment deleted and stops the job.
    Revoked(u8, u8),
    Report(u8, u8),
    Fault(FaultKind, u8),
    Recover(u8, bool),
    /// Follower `.0` revokes the lease of the election key, on evidence that the process
    /// holding it is gone.
    Evidence(u8),
}

/// A keepalive must be sent before time passes: renewals go out on a fixed schedule, the tick
/// before the margin, one at a time.
fn due(proof: u8, renewal: Option<u8>, host: &Host) -> bool {
    proof == MARGIN + 1 && renewal.is_none() && !host.cut
}

/// A keepalive is due, or its answer is on its way to a host that can hear it: both happen
/// before time passes, unless a fault (a pause, a cut) holds them up. (A late answer on a
/// healthy host would be a free fault: its leader steps down and a new lease is granted, without
/// bound.)
fn pending(proof: u8, renewal: Option<u8>, host: &Host) -> bool {
    due(proof, renewal, host) || (renewal.is_some() && !host.cut)
}

/// Ticks a keepalive answered now proves, sent `elapsed` ticks ago: the code's own rule
/// ([`lease::proof`]), on a boot clock whose seconds are ticks.
fn proven(elapsed: u8, from_answer: bool) -> u8 {
    let now = BootInstant::from_nanos(1_000 * 1_000_000_000);
    let sent = if from_answer {
        now
    } else {
        now - Duration::from_secs(u64::from(elapsed))
    };
    lease::proof(sent, i64::from(TTL)).map_or(0, |p| now.until(p.valid_until).as_secs() as u8)
}

fn ms(ticks: u8) -> u64 {
    u64::from(ticks) * 1000
}

/// The time of the schedule's tick `k` (`@every 1s` from 0), Unix ms.
fn tick_ms(k: u8) -> u64 {
    u64::from(k) * 1000
}

impl State {
    fn lease_alive(&self, lease: i64) -> bool {
        self.countdown.contains_key(&lease)
    }

    fn grant(&mut self) -> i64 {
        let id = self.next_lease;
        self.next_lease += 1;
        self.etcd.grant(id);
        self.countdown.insert(id, TTL);
        id
    }

    fn revoke(&mut self, lease: i64) {
        self.etcd.revoke(lease);
        self.countdown.remove(&lease);
    }

    fn break_with(&mut self, why: &'static str) {
        if self.broken.is_none() {
            self.broken = Some(why);
        }
    }

    /// Executions of job `j` running now.
    fn running(&self, j: u8) -> usize {
        self.workers
            .iter()
            .flat_map(|w| &w.guards)
            .filter(|g| g.job == j && g.running)
            .count()
    }

    fn has_result(&self, m: &BatonModel, j: u8) -> bool {
        let k = m.keys.job(&m.job_id(j));
        self.etcd.get(k.dirty.as_bytes()).is_some() || self.etcd.get(k.clean.as_bytes()).is_some()
    }

    /// Whether a process must act before time may pass.
    fn urgent(&self) -> bool {
        let leader = self.replicas.iter().any(|r| {
            r.host.runs()
                && r.lead
                    .as_ref()
                    .is_some_and(|l| l.proof <= MARGIN || pending(l.proof, l.renewal, &r.host))
        });
        let worker = self.workers.iter().any(|w| {
            w.host.runs()
                && w.inc
                    .as_ref()
                    .is_some_and(|i| i.proof <= MARGIN || pending(i.proof, i.renewal, &w.host))
        });
        let guard = self
            .workers
            .iter()
            .flat_map(|w| &w.guards)
            .any(|g| g.running && g.deadline <= MARGIN);
        leader || worker || guard
    }

    /// The incarnation of worker `w` is over: its guards kill their jobs; its old lease is
    /// revoked when etcd can be reached.
    fn lose(&mut self, w: usize) {
        let Some(inc) = self.workers[w].inc.take() else {
            return;
        };
        for g in &mut self.workers[w].guards {
            if g.running {
                g.running = false;
                g.ended = true;
            }
            if !g.go {
                g.ended = true;
            }
        }
        if !self.workers[w].host.cut {
            self.revoke(inc.lease);
        }
    }
}

impl BatonModel {
    fn initial(&self) -> State {
        let mut etcd = MemEtcd::new();
        for j in 0..self.jobs {
            let id = self.job_id(j);
            let spec =
                JobSpec::resolve(vec!["true".into()], Default::default(), Vec::new(), 0, None)
                    .expect("a valid spec");
            let record = JobRecord {
                version: JOB_RECORD_VERSION,
                job_id: id.clone(),
                spec_hash: spec.hash(),
                spec,
                submitted_at_ms: 1,
                submitted_by: None,
                schedule: None,
            };
            let k = self.keys.job(&id);
            let submit = Write::new()
                .when_absent(k.spec.clone())
                .put(k.spec, codec::encode(&record))
                .put(k.registry, codec::encode(&RegistryEntry::pending()));
            assert!(etcd.apply(&submit, None));
        }
        let mut s = State {
            etcd,
            countdown: BTreeMap::new(),
            next_lease: 1,
            replicas: vec![Replica::default(); self.replicas as usize],
            workers: vec![Worker::default(); self.workers as usize],
            faults_left: self.budget,
            results: vec![0; self.all_jobs() as usize],
            due: 0,
            fired: vec![0; self.schedule.map_or(0, |(_, t)| t) as usize],
            broken: None,
        };
        if let Some((overlap, _)) = self.schedule {
            let spec =
                JobSpec::resolve(vec!["true".into()], Default::default(), Vec::new(), 0, None)
                    .expect("a valid spec");
            let rec = ScheduleRecord::new("s", spec, "@every 1s", overlap, "model", 0);
            let key = self.keys.schedule("s");
            let create = Write::new()
                .when_absent(key.clone())
                .put(key, codec::encode(&rec));
            assert!(s.etcd.apply(&create, None));
        }
        // The cluster as it starts: replica 0 leads, every worker is registered. (Which one
        // wins first is a renaming; starting from one order keeps the space small.)
        for a in std::iter::once(Action::Campaign(0)).chain((0..self.workers).map(Action::Register))
        {
            s = self.next_state(&s, a).expect("the cluster starts");
        }
        s
    }

    fn worker_record(&self, w: u8) -> WorkerRecord {
        WorkerRecord {
            version: WORKER_VERSION,
            worker_id: Self::worker_id(w),
            advertise: String::new(),
            capacity: 4,
            cleanup_capacity: 0,
            labels: Default::default(),
            draining: false,
            started_at: String::new(),
            lease_ttl_ms: ms(TTL),
            margin_ms: ms(MARGIN),
            assign_timeout_ms: ms(TTL),
            started_at_ms: 0,
            unable: None,
        }
    }

    /// Leader `r`'s step for job `j`: the code's decision and write.
    fn act(&self, s: &mut State, r: usize, j: u8, pick: Pick) -> bool {
        let Some(lead) = s.replicas[r].lead.clone() else {
            return false;
        };
        let id = self.job_id(j);
        let Ok(snap) = jobs::snapshot_in(&self.keys, &s.etcd, &id) else {
            return false;
        };
        let gone = s.replicas[r].gone.clone();
        let mut newly_gone: Option<(i64, Gone)> = None;
        // What the leader's fleet knows, handed to the code's own rule.
        let decision = protocol::decide(&snap, 0, |entry, started| {
            let wid = entry.worker.clone().unwrap_or_default();
            let alive = s
                .etcd
                .get(self.keys.worker(&wid).as_bytes())
                .is_some_and(|kv| kv.create == entry.worker_rev);
            let seen = if alive {
                let taking = pick == Pick::TakeBack;
                Seen::Alive { timed_out: taking }
            } else {
                // Seen gone now, unless this term already follows it.
                let g = gone.get(&entry.worker_rev).cloned().unwrap_or_else(|| {
                    let g = Gone {
                        wait: TTL + MARGIN,
                        revoked: false,
                    };
                    newly_gone = Some((entry.worker_rev, g.clone()));
                    g
                });
                Seen::Gone {
                    lease_known: entry.worker_lease != 0 && !self.mutations.no_revoke,
                    revoked: g.revoked,
                    waited: g.wait == 0 || self.mutations.short_wait,
                }
            };
            protocol::verdict(seen, started)
        });
        let noted = newly_gone.is_some();
        if let Some((rev, g)) = newly_gone {
            s.replicas[r].gone.insert(rev, g);
        }
        let term = lead.fence;
        let send = |s: &mut State, write: Write, results: Vec<u8>| {
            let write = if self.mutations.no_attempt_compare {
                let attempts = self.keys.attempts();
                write.without(|c| c.key().starts_with(attempts.as_bytes()))
            } else {
                write
            };
            let write = if self.mutations.no_after {
                // Every compare on another job's registry entry: the runs it waits `after`.
                let own = self.keys.job(&id).registry;
                let registry = self.keys.registry();
                write.without(|c| {
                    matches!(c, Cond::Absent(k)
                        if k.starts_with(registry.as_bytes()) && k != own.as_bytes())
                })
            } else {
                write
            };
            s.replicas[r].outbox = Some(InFlight {
                conds: write.conds().to_vec(),
                effects: write.effects().to_vec(),
                term,
                fence: (!self.mutations.no_fence).then_some(term),
                results,
                fires: 0,
                about_status: false,
            });
            true
        };
        if decision == Decision::Stray {
            return match protocol::remove_stray(&self.keys, &snap) {
                Some(w) => send(s, w, Vec::new()),
                None => false,
            };
        }
        let Some(job) = Job::of(&self.keys, &snap) else {
            return false;
        };
        match decision {
            Decision::Assign => {
                let Pick::To(w) = pick else {
                    return false;
                };
                let key = self.keys.worker(&Self::worker_id(w));
                let Some(kv) = s.etcd.get(key.as_bytes()) else {
                    return false;
                };
                let to = Target {
                    id: Self::worker_id(w),
                    rev: kv.create,
                    mod_rev: kv.modified,
                    lease: kv.lease,
                    ttl_ms: ms(TTL + MARGIN),
                };
                let (write, _, _) = job.assign(&to, term, 0);
                send(s, write, Vec::new())
            }
            Decision::Ended(rec) => match job.ending(&rec, term, 0, 0) {
                Ending::Result(outcome, entry) => {
                    let write = job.terminal(&entry, &outcome, term, 0);
                    send(s, write, vec![j])
                }
                Ending::Retry(entry, _) => {
                    let write = job.retry(&entry);
                    send(s, write, Vec::new())
                }
            },
            Decision::Requeue(why, _) => match job.requeue(why, term, MAX_RECOVERIES) {
                Ok(write) => send(s, write, Vec::new()),
                Err(gave_up) => {
                    let (entry, msg) = *gave_up;
                    let failed = Outcome {
                        status: TerminalStatus::Failed,
                        exit_code: None,
                        signal: None,
                        error: Some(msg),
                    };
                    let write = job.terminal(&entry, &failed, term, 0);
                    send(s, write, vec![j])
                }
            },
            Decision::Cancel(why) => {
                let write = job.terminal(&job.entry.clone(), &Outcome::canceled(why), term, 0);
                send(s, write, vec![j])
            }
            Decision::Revoke => {
                // Not a transaction: a revoke goes straight to etcd, and the wait starts.
                s.revoke(job.entry.worker_lease);
                let g = Gone {
                    wait: TTL + MARGIN,
                    revoked: true,
                };
                s.replicas[r].gone.insert(job.entry.worker_rev, g);
                true
            }
            Decision::Idle
            | Decision::Stray
            | Decision::Later(_)
            | Decision::Legacy
            | Decision::Wait => noted,
        }
    }

    /// Worker `w` sees its assignment of job `j` and writes `started` (the guard waits for
    /// its go).
    fn take(&self, s: &mut State, w: usize, j: u8) -> bool {
        let Some(inc) = s.workers[w].inc.clone() else {
            return false;
        };
        let wid = Self::worker_id(w as u8);
        let id = self.job_id(j);
        let akey = self.keys.assignment(&wid, inc.rev, &id);
        let Some(token) = s.etcd.get(akey.as_bytes()).map(|kv| kv.modified) else {
            return false;
        };
        if s.workers[w].guards.iter().any(|g| g.token == token) {
            return false;
        }
        let record = self.keys.attempt(&id, token);
        let rec = self.record(w as u8, inc.rev, AttemptState::Started);
        let write = writes::started(&self.keys, &wid, inc.rev, &akey, token, &record, &rec);
        if !s.etcd.apply(&write, None) {
            return false;
        }
        let started = s.etcd.revision;
        s.workers[w].guards.push(Guard {
            job: j,
            inc: inc.rev,
            token,
            started,
            go: false,
            deadline: inc.proof,
            running: false,
            ended: false,
            exited: false,
        });
        true
    }

    fn record(&self, w: u8, rev: i64, state: AttemptState) -> AttemptRecord {
        AttemptRecord {
            version: ATTEMPT_VERSION,
            state,
            worker: Self::worker_id(w),
            worker_rev: rev,
            attempt: 1,
            pid: 0,
            exit_code: (state == AttemptState::Exited).then_some(0),
            signal: None,
            killed_by: None,
            log_tail: String::new(),
            reason: None,
            start_error: None,
            at_ms: 0,
        }
    }

    /// The worker reports how guard `g`'s execution ended (over its `started` if the
    /// assignment is gone).
    fn report(&self, s: &mut State, w: usize, g: usize) -> bool {
        let guard = s.workers[w].guards[g].clone();
        let wid = Self::worker_id(w as u8);
        let id = self.job_id(guard.job);
        let rev = guard.inc;
        let akey = self.keys.assignment(&wid, rev, &id);
        let record = self.keys.attempt(&id, guard.token);
        let state = match (guard.go, guard.exited) {
            (_, true) => AttemptState::Exited,
            (true, false) => AttemptState::Lost,
            (false, false) => AttemptState::Rejected,
        };
        let rec = self.record(w as u8, rev, state);
        let write = writes::report(&akey, guard.token, &record, &rec);
        if !s.etcd.apply(&write, None) {
            let over = writes::report_over(&record, guard.started, &rec);
            s.etcd.apply(&over, None);
        }
        s.workers[w].guards.remove(g);
        true
    }

    fn fault(&self, s: &mut State, kind: FaultKind, who: u8) -> bool {
        let (r, w) = (who as usize, who as usize);
        match kind {
            FaultKind::ReplicaCrash => {
                let rep = &mut s.replicas[r];
                if rep.host.crashed {
                    return false;
                }
                rep.host.crashed = true;
                rep.lead = None;
                rep.gone.clear();
            }
            FaultKind::ReplicaPause => s.replicas[r].host.paused = true,
            FaultKind::ReplicaCut => s.replicas[r].host.cut = true,
            FaultKind::WorkerCrash => {
                let wk = &mut s.workers[w];
                if wk.host.crashed {
                    return false;
                }
                wk.host.crashed = true;
                wk.inc = None;
                // The guards' pipes close: they kill at once; a crashed worker reports nothing.
                wk.guards.clear();
            }
            FaultKind::WorkerPause => s.workers[w].host.paused = true,
            FaultKind::WorkerCut => s.workers[w].host.cut = true,
            FaultKind::KeyDeleted => {
                let key = self.keys.worker(&Self::worker_id(who));
                if s.etcd.get(key.as_bytes()).is_none() {
                    return false;
                }
                s.etcd.apply(&Write::new().delete(key), None);
            }
            FaultKind::LeaseRevoked => {
                let Some(lease) = s.workers[w].inc.as_ref().map(|i| i.lease) else {
                    return false;
                };
                if !s.lease_alive(lease) {
                    return false;
                }
                s.revoke(lease);
            }
        }
        s.faults_left -= 1;
        true
    }
}

impl Model for BatonModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        if s.broken.is_some() {
            return;
        }
        if !s.urgent() {
            out.push(Action::Tick);
        }
        if self.schedule.is_some_and(|(_, t)| s.due < t) {
            out.push(Action::Due);
        }
        let election = s.etcd.get(self.election().as_bytes()).is_some();
        for (i, r) in s.replicas.iter().enumerate() {
            let i = i as u8;
            if r.outbox.is_some() {
                out.push(Action::Land(i));
                if self.lost_answers && r.outbox.as_ref().is_some_and(|o| o.about_status) {
                    out.push(Action::LandLost(i));
                }
            }
            if !r.host.runs() {
                continue;
            }
            if r.lead.is_none() && !r.host.cut && self.evidence(s).is_some() {
                out.push(Action::Evidence(i));
            }
            match &r.lead {
                None if !election && !r.host.cut => out.push(Action::Campaign(i)),
                None => {}
                // An answer may still arrive before the step-down (which one the keeper sees
                // first is a race): late, it proves less.
                Some(l) if l.renewal.is_some() && !r.host.cut && l.proof <= MARGIN => {
                    out.push(Action::Answer(i));
                    out.push(Action::StepDown(i));
                }
                Some(l) if l.proof <= MARGIN => out.push(Action::StepDown(i)),
                Some(l) => {
                    if due(l.proof, l.renewal, &r.host) {
                        out.push(Action::KeepAlive(i));
                    }
                    if l.renewal.is_some() && !r.host.cut {
                        out.push(Action::Answer(i));
                    }
                    if !r.host.cut && r.outbox.is_none() {
                        if self.schedule.is_some() {
                            out.push(Action::Fire(i));
                        }
                        for j in 0..self.all_jobs() {
                            out.push(Action::Act(i, j, Pick::Any));
                            out.push(Action::Act(i, j, Pick::TakeBack));
                            for w in 0..self.workers {
                                out.push(Action::Act(i, j, Pick::To(w)));
                            }
                        }
                    }
                }
            }
        }
        for (i, w) in s.workers.iter().enumerate() {
            let i = i as u8;
            for (g, guard) in w.guards.iter().enumerate() {
                let g = g as u8;
                if guard.running && guard.deadline <= MARGIN {
                    out.push(Action::Kill(i, g));
                }
            }
            if !w.host.runs() {
                continue;
            }
            for (g, guard) in w.guards.iter().enumerate() {
                let g = g as u8;
                if guard.running {
                    out.push(Action::Exit(i, g));
                }
                if !guard.ended && !w.host.cut {
                    out.push(Action::Revoked(i, g));
                    if !guard.go && w.inc.is_some() {
                        out.push(Action::Go(i, g));
                    }
                }
                if guard.ended && !w.host.cut {
                    out.push(Action::Report(i, g));
                }
            }
            if w.inc.as_ref().is_some_and(|inc| inc.proof <= MARGIN) {
                // As for a leader: a late answer races the give-up.
                if w.inc.as_ref().is_some_and(|inc| inc.renewal.is_some()) && !w.host.cut {
                    out.push(Action::WorkerAnswer(i));
                }
                out.push(Action::WorkerLost(i));
                continue;
            }
            if w.host.cut {
                continue;
            }
            match &w.inc {
                None => out.push(Action::Register(i)),
                Some(inc) => {
                    if due(inc.proof, inc.renewal, &w.host) {
                        out.push(Action::WorkerKeepAlive(i));
                    }
                    if inc.renewal.is_some() {
                        out.push(Action::WorkerAnswer(i));
                    }
                    out.push(Action::WatchSelf(i));
                    for j in 0..self.all_jobs() {
                        out.push(Action::Take(i, j));
                    }
                }
            }
        }
        if s.faults_left > 0 {
            // Replicas and workers start alike, and every run explores each of them leading
            // or running the job: faults of replica 0 and worker 0 cover the others.
            for &kind in &self.faults {
                let n = match (self.everywhere, kind) {
                    (false, _) => 1,
                    (
                        true,
                        FaultKind::ReplicaCrash | FaultKind::ReplicaPause | FaultKind::ReplicaCut,
                    ) => self.replicas,
                    (true, _) => self.workers,
                };
                for who in 0..n {
                    out.push(Action::Fault(kind, who));
                }
            }
        }
        for (i, r) in s.replicas.iter().enumerate() {
            if r.host != Host::default() {
                out.push(Action::Recover(i as u8, true));
            }
        }
        for (i, w) in s.workers.iter().enumerate() {
            if w.host != Host::default() {
                out.push(Action::Recover(i as u8, false));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = self.step(last, action)?;
        ranks::rename(&self.keys, &mut s);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties()
    }
}

impl BatonModel {
    /// The state after `action`, with revisions as etcd would count them.
    fn step(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        let changed = match action {
            Action::Tick => {
                for left in s.countdown.values_mut() {
                    *left = left.saturating_sub(1);
                }
                let expired: Vec<i64> = s
                    .countdown
                    .iter()
                    .filter(|(_, l)| **l == 0)
                    .map(|(id, _)| *id)
                    .collect();
                for id in expired {
                    s.revoke(id);
                }
                for r in &mut s.replicas {
                    if let Some(l) = &mut r.lead {
                        l.proof = l.proof.saturating_sub(1);
                        l.renewal = l.renewal.map(|e| e.saturating_add(1).min(TTL));
                    }
                    for g in r.gone.values_mut() {
                        g.wait = g.wait.saturating_sub(1);
                    }
                }
                for w in &mut s.workers {
                    if let Some(inc) = &mut w.inc {
                        inc.proof = inc.proof.saturating_sub(1);
                        inc.renewal = inc.renewal.map(|e| e.saturating_add(1).min(TTL));
                    }
                    for g in &mut w.guards {
                        g.deadline = g.deadline.saturating_sub(1);
                    }
                }
                true
            }
            Action::Campaign(r) => {
                let lease = s.grant();
                let key = self.election();
                let w = Write::new().when_absent(key.clone()).put_leased(
                    key.clone(),
                    format!("r{r}"),
                    lease,
                );
                if !s.etcd.apply(&w, None) {
                    return None;
                }
                let fence = s.etcd.get(key.as_bytes()).map(|kv| kv.create).unwrap_or(0);
                let rep = &mut s.replicas[r as usize];
                rep.lead = Some(Lead {
                    fence,
                    lease,
                    proof: TTL,
                    renewal: None,
                });
                rep.gone.clear();
                let status_key = self.keys.schedule_status("s");
                let mem = s
                    .etcd
                    .get(status_key.as_bytes())
                    .map(|kv| (kv.value.clone(), kv.modified));
                s.replicas[r as usize].sched = self.schedule.map(|_| mem.unwrap_or_default());
                true
            }
            Action::KeepAlive(r) => {
                let lease = s.replicas[r as usize].lead.as_ref()?.lease;
                if !s.lease_alive(lease) {
                    // etcd says the lease is gone: the term is over.
                    let rep = &mut s.replicas[r as usize];
                    rep.lead = None;
                    rep.gone.clear();
                    return Some(s);
                }
                s.countdown.insert(lease, TTL);
                s.replicas[r as usize].lead.as_mut()?.renewal = Some(0);
                true
            }
            Action::Answer(r) => {
                let l = s.replicas[r as usize].lead.as_mut()?;
                let elapsed = l.renewal.take()?;
                l.proof = l
                    .proof
                    .max(proven(elapsed, self.mutations.proof_from_answer));
                true
            }
            Action::StepDown(r) => {
                let rep = &mut s.replicas[r as usize];
                rep.lead = None;
                rep.gone.clear();
                true
            }
            Action::Act(r, j, pick) => self.act(&mut s, r as usize, j, pick),
            Action::Due => {
                s.due += 1;
                true
            }
            Action::Fire(r) => self.fire(&mut s, r as usize),
            Action::Land(r) | Action::LandLost(r) => {
                let f = s.replicas[r as usize].outbox.take()?;
                let heard = matches!(action, Action::Land(_));
                let before_wm = self.status(&s.etcd).1.watermark_ms;
                let fence = f
                    .fence
                    .map(|rev| Cond::Created(self.election().into_bytes(), rev));
                let applied = s.etcd.apply_parts(&f.conds, &f.effects, fence.as_ref());
                if f.about_status && heard && s.replicas[r as usize].sched.is_some() {
                    // The answer: its own status as written, or etcd's as it read it.
                    let key = self.keys.schedule_status("s");
                    let mem = s
                        .etcd
                        .get(key.as_bytes())
                        .map(|kv| (kv.value.clone(), kv.modified))
                        .unwrap_or_default();
                    s.replicas[r as usize].sched = Some(mem);
                }
                if applied {
                    if f.fires > 0 {
                        let k = f.fires as usize - 1;
                        s.fired[k] += 1;
                        if s.fired[k] > 1 {
                            s.break_with("a tick's job was created twice");
                        }
                        if before_wm >= tick_ms(f.fires) {
                            s.break_with("a tick fired at or before the watermark");
                        }
                    }
                    let current = s.etcd.get(self.election().as_bytes()).map(|kv| kv.create);
                    if current != Some(f.term) {
                        s.break_with("a leader write applied outside the current term");
                    }
                    let assigns = self.keys.assignments();
                    for j in 0..self.all_jobs() {
                        let tail = format!("/{}", self.job_id(j));
                        let assigned = f.effects.iter().any(|e| {
                            matches!(e, Effect::Put(k, _, _)
                                if k.starts_with(assigns.as_bytes()) && k.ends_with(tail.as_bytes()))
                        });
                        if assigned && s.running(j) > 0 {
                            s.break_with("an assignment while an execution of the job runs");
                        }
                    }
                    for j in f.results {
                        s.results[j as usize] += 1;
                        if s.results[j as usize] > 1 {
                            s.break_with("two results for one job");
                        }
                        if s.running(j) > 0 {
                            s.break_with("a result while an execution runs");
                        }
                    }
                }
                true
            }
            Action::Register(w) => {
                let lease = s.grant();
                let write = writes::register(&self.keys, &self.worker_record(w), lease);
                if !s.etcd.apply(&write, None) {
                    return None;
                }
                let key = self.keys.worker(&Self::worker_id(w));
                let rev = s.etcd.get(key.as_bytes())?.create;
                s.workers[w as usize].inc = Some(Inc {
                    rev,
                    lease,
                    proof: TTL,
                    renewal: None,
                });
                true
            }
            Action::WorkerKeepAlive(w) => {
                let inc = s.workers[w as usize].inc.clone()?;
                if !s.lease_alive(inc.lease) {
                    s.lose(w as usize);
                    return Some(s);
                }
                s.countdown.insert(inc.lease, TTL);
                s.workers[w as usize].inc.as_mut()?.renewal = Some(0);
                true
            }
            Action::WorkerAnswer(w) => {
                let inc = s.workers[w as usize].inc.clone()?;
                let elapsed = inc.renewal?;
                let key = self.keys.worker(&Self::worker_id(w));
                let held = s
                    .etcd
                    .get(key.as_bytes())
                    .is_some_and(|kv| kv.create == inc.rev);
                // The renewal proves nothing without the worker's own key (see the lease).
                if !s.lease_alive(inc.lease) || (!held && !self.mutations.no_revoke) {
                    s.lose(w as usize);
                    return Some(s);
                }
                let proof = inc
                    .proof
                    .max(proven(elapsed, self.mutations.proof_from_answer));
                let wk = &mut s.workers[w as usize];
                let i = wk.inc.as_mut()?;
                i.proof = proof;
                i.renewal = None;
                for g in &mut wk.guards {
                    if g.go && g.running {
                        g.deadline = proof;
                    }
                }
                true
            }
            Action::WatchSelf(w) => {
                let inc = s.workers[w as usize].inc.clone()?;
                let key = self.keys.worker(&Self::worker_id(w));
                let mine = s
                    .etcd
                    .get(key.as_bytes())
                    .is_some_and(|kv| kv.create == inc.rev);
                if mine {
                    return None;
                }
                s.lose(w as usize);
                true
            }
            Action::WorkerLost(w) => {
                s.lose(w as usize);
                true
            }
            Action::Take(w, j) => self.take(&mut s, w as usize, j),
            Action::Go(w, g) => {
                let proof = s.workers[w as usize].inc.as_ref()?.proof;
                let job = s.workers[w as usize].guards[g as usize].job;
                let ok = proof > MARGIN || self.mutations.no_go_check;
                let guard = &mut s.workers[w as usize].guards[g as usize];
                if !ok {
                    // The go came too late: the guard starts nothing.
                    guard.ended = true;
                    return Some(s);
                }
                guard.go = true;
                guard.running = true;
                guard.deadline = proof;
                if s.has_result(self, job) {
                    s.break_with("a go after the job's result");
                }
                true
            }
            Action::Kill(w, g) | Action::Revoked(w, g) => {
                if let Action::Revoked(..) = action {
                    let guard = &s.workers[w as usize].guards[g as usize];
                    let id = self.job_id(guard.job);
                    let akey = self.keys.assignment(&Self::worker_id(w), guard.inc, &id);
                    let stands = s
                        .etcd
                        .get(akey.as_bytes())
                        .is_some_and(|kv| kv.modified == guard.token);
                    if stands {
                        return None;
                    }
                }
                let guard = &mut s.workers[w as usize].guards[g as usize];
                guard.running = false;
                guard.ended = true;
                true
            }
            Action::Exit(w, g) => {
                let guard = &mut s.workers[w as usize].guards[g as usize];
                guard.running = false;
                guard.ended = true;
                guard.exited = true;
                true
            }
            Action::Report(w, g) => self.report(&mut s, w as usize, g as usize),
            Action::Fault(kind, who) => self.fault(&mut s, kind, who),
            Action::Evidence(_) => {
                // One etcd step: the key still holds the lease the follower recorded, then the
                // revoke (the code's compare-then-revoke; nothing can land in between that the
                // compare would not have caught, as the holder's writes are fenced by the key).
                let lease = self.evidence(&s)?;
                s.revoke(lease);
                true
            }
            Action::Recover(i, replica) => {
                if replica {
                    s.replicas[i as usize].host = Host::default();
                } else {
                    s.workers[i as usize].host = Host::default();
                }
                true
            }
        };
        changed.then_some(s)
    }
}

fn properties() -> Vec<Property<BatonModel>> {
    vec![
        Property::always("no invariant broken at a step", |_, s: &State| {
            s.broken.is_none()
        }),
        Property::always("one acting leader", |m: &BatonModel, s: &State| {
            let key = s.etcd.get(m.election().as_bytes());
            let acting: Vec<&Lead> = s
                .replicas
                .iter()
                .filter(|r| r.host.runs())
                .filter_map(|r| r.lead.as_ref())
                .filter(|l| l.proof > MARGIN)
                .collect();
            acting.len() <= 1
                && acting
                    .iter()
                    .all(|l| key.is_some_and(|kv| kv.create == l.fence))
        }),
        Property::always(
            "proofs never exceed etcd's own countdown",
            |_, s: &State| {
                let leaders = s
                    .replicas
                    .iter()
                    .filter_map(|r| r.lead.as_ref())
                    .all(|l| l.proof <= s.countdown.get(&l.lease).copied().unwrap_or(0));
                // A worker's lease may be revoked under it (a fault, or a leader that saw its
                // key go): that is what its guards' margin and key check are for.
                let workers = s.workers.iter().filter_map(|w| w.inc.as_ref()).all(|i| {
                    s.countdown
                        .get(&i.lease)
                        .is_none_or(|left| i.proof <= *left)
                });
                leaders && workers
            },
        ),
        Property::always(
            "at most one execution of a job runs",
            |m: &BatonModel, s: &State| (0..m.all_jobs()).all(|j| s.running(j) <= 1),
        ),
        Property::always(
            "a forbid or replace schedule runs one tick at a time",
            |m: &BatonModel, s: &State| match m.schedule {
                Some((Overlap::Forbid | Overlap::Replace, _)) => {
                    (m.jobs..m.all_jobs()).filter(|j| s.running(*j) > 0).count() <= 1
                }
                _ => true,
            },
        ),
        Property::always("at most one result per job", |_, s: &State| {
            s.results.iter().all(|n| *n <= 1)
        }),
        Property::always(
            "registry and assignment agree",
            |m: &BatonModel, s: &State| {
                invariants::registry_disagreement(&m.keys, &s.etcd).is_none()
            },
        ),
        Property::sometimes("every job gets a result", |m: &BatonModel, s: &State| {
            (0..m.jobs).all(|j| s.has_result(m, j))
        }),
        Property::sometimes(
            "the schedule's last tick is decided and its job finished",
            |m: &BatonModel, s: &State| match m.schedule {
                Some((_, t)) => {
                    m.status(&s.etcd).1.watermark_ms == tick_ms(t)
                        && s.has_result(m, m.all_jobs() - 1)
                }
                None => true,
            },
        ),
    ]
}

impl BatonModel {
    /// The schedule's definition (with its revisions) and its status as etcd holds them.
    fn status(&self, etcd: &MemEtcd) -> (Option<(ScheduleRecord, i64, i64)>, ScheduleStatus, i64) {
        let def = etcd.get(self.keys.schedule("s").as_bytes()).and_then(|kv| {
            let rec = codec::decode(b"s", &kv.value, SCHEDULE_VERSION).ok()?;
            Some((rec, kv.modified, kv.create))
        });
        let create = def.as_ref().map_or(0, |d| d.2);
        let kv = etcd.get(self.keys.schedule_status("s").as_bytes());
        let status = kv
            .and_then(|kv| codec::decode::<ScheduleStatus>(b"s", &kv.value, STATUS_VERSION).ok())
            .filter(|st| st.schedule_rev == create)
            .unwrap_or_else(|| ScheduleStatus::new(create));
        (def, status, kv.map_or(0, |kv| kv.modified))
    }

    /// Leader `r` fires the latest due tick after the watermark (catch-up `latest`): the
    /// code's decision and write, sent like any leader write.
    fn fire(&self, s: &mut State, r: usize) -> bool {
        let Some((overlap, _)) = self.schedule else {
            return false;
        };
        let Some(lead) = s.replicas[r].lead.clone() else {
            return false;
        };
        let (Some((rec, rev, create)), ..) = self.status(&s.etcd) else {
            return false;
        };
        // What this term remembers of the status, as the code's leader decides from.
        let Some((mem, status_rev)) = s.replicas[r].sched.clone() else {
            return false;
        };
        let status = codec::decode::<ScheduleStatus>(b"s", &mem, STATUS_VERSION)
            .ok()
            .filter(|st| st.schedule_rev == create)
            .unwrap_or_else(|| ScheduleStatus::new(create));
        let done = (status.watermark_ms / 1000) as u8;
        if s.due <= done {
            return false;
        }
        let k = s.due;
        let mut pre = Vec::new();
        if k - done > 1 {
            pre.push((tick_ms(k - 1), "superseded", u64::from(k - done - 1)));
        }
        let alive: Vec<String> = status
            .live
            .iter()
            .filter(|id| s.etcd.get(self.keys.job(id).registry.as_bytes()).is_some())
            .cloned()
            .collect();
        let f = Fire {
            t: tick_ms(k),
            id: baton::schedule::tick_id("s", tick_ms(k)),
            kind: "tick",
            overlap,
            pre,
            watermark: Some(tick_ms(k)),
            request: None,
        };
        let known = Known {
            rec: &rec,
            rev,
            create,
            status: &status,
            status_rev,
        };
        let (write, fires) = match fire::plan(&self.keys, &known, &f, &alive, 0) {
            Plan::Skip { write, .. } => (write, 0),
            Plan::Create { write, .. } => (write, k),
        };
        let write = if self.mutations.no_tick_guards {
            let status_key = self.keys.schedule_status("s");
            let j = self.keys.job(&f.id);
            let guarded = [status_key, j.spec, j.registry, j.dirty, j.clean];
            write.without(|c| guarded.iter().any(|g| c.key() == g.as_bytes()))
        } else {
            write
        };
        s.replicas[r].outbox = Some(InFlight {
            conds: write.conds().to_vec(),
            effects: write.effects().to_vec(),
            term: lead.fence,
            fence: (!self.mutations.no_fence).then_some(lead.fence),
            results: Vec::new(),
            fires,
            about_status: true,
        });
        true
    }
}

/// Every state reachable from the initial one, and whether each can still reach "every job
/// has a result" (a backward pass over the whole graph: no `eventually`, which is unsound on
/// cycles, and no fairness). States are told apart by a 64-bit fingerprint, as `stateright`
/// does, so only the graph is kept. Returns the number of states and up to three from which no
/// result can be reached.
pub fn stuck_states(model: &BatonModel, limit: usize) -> Result<(usize, Vec<State>), String> {
    use std::collections::{HashMap, VecDeque};
    use std::hash::{Hash, Hasher};
    let fingerprint = |s: &State| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        s.hash(&mut h);
        h.finish()
    };
    let done = |s: &State| (0..model.jobs).all(|j| s.has_result(model, j));
    let mut index: HashMap<u64, u32> = HashMap::new();
    let mut preds: Vec<Vec<u32>> = Vec::new();
    let mut good: Vec<bool> = Vec::new();
    let mut queue: VecDeque<(State, u32)> = VecDeque::new();
    for s in model.init_states() {
        let n = preds.len() as u32;
        index.insert(fingerprint(&s), n);
        preds.push(Vec::new());
        good.push(done(&s));
        queue.push_back((s, n));
    }
    let mut actions = Vec::new();
    while let Some((state, i)) = queue.pop_front() {
        actions.clear();
        model.actions(&state, &mut actions);
        for a in actions.drain(..) {
            let Some(next) = model.next_state(&state, a) else {
                continue;
            };
            let f = fingerprint(&next);
            let n = match index.get(&f) {
                Some(n) => *n,
                None => {
                    let n = preds.len();
                    if n >= limit {
                        return Err(format!("more than {limit} states"));
                    }
                    let n = n as u32;
                    index.insert(f, n);
                    preds.push(Vec::new());
                    good.push(done(&next));
                    queue.push_back((next, n));
                    n
                }
            };
            preds[n as usize].push(i);
        }
    }
    let mut back: VecDeque<u32> = (0..good.len() as u32)
        .filter(|i| good[*i as usize])
        .collect();
    while let Some(i) = back.pop_front() {
        for &p in &preds[i as usize] {
            if !good[p as usize] {
                good[p as usize] = true;
                back.push_back(p);
            }
        }
    }
    let stuck: Vec<u32> = (0..good.len() as u32)
        .filter(|i| !good[*i as usize])
        .collect();
    if stuck.is_empty() {
        return Ok((good.len(), Vec::new()));
    }
    // Find the first few stuck states again, to show them.
    let wanted: std::collections::HashSet<u32> = stuck.iter().take(3).copied().collect();
    let mut shown = Vec::new();
    let mut seen: std::collections::HashSet<u64> = Default::default();
    let mut queue: VecDeque<State> = model.init_states().into();
    while let Some(state) = queue.pop_front() {
        let f = fingerprint(&state);
        if !seen.insert(f) {
            continue;
        }
        if index.get(&f).is_some_and(|n| wanted.contains(n)) {
            shown.push(state.clone());
            if shown.len() == wanted.len() {
                break;
            }
        }
        actions.clear();
        model.actions(&state, &mut actions);
        for a in actions.drain(..) {
            if let Some(next) = model.next_state(&state, a) {
                queue.push_back(next);
            }
        }
    }
    let _ = stuck.len();
    Ok((good.len(), shown))
}
