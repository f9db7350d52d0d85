//! The protocol model in the test suite: no faults and one fault of each kind, every property
//! and the backward-reachability liveness check; and the mutation controls, each of which must
//! yield a counterexample. State counts are exact, so a change that shrinks the explored space
//! is noticed.

use baton::schedule::record::Overlap;
use baton_model::{stuck_states, BatonModel, FaultKind, Mutations, ALL_FAULTS};
use stateright::{Checker, HasDiscoveries, Model};

/// 2 replicas, 2 workers, 1 job.
fn model() -> BatonModel {
    BatonModel::new(2, 2, 1)
}

fn check(m: BatonModel) -> usize {
    let started = std::time::Instant::now();
    let checker = m.checker().spawn_bfs().join();
    let n = checker.unique_state_count();
    println!(
        "{n} unique states in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    checker.assert_properties();
    n
}

/// The first property the model breaks, by name. A broken protocol's space may be infinite
/// (stale records pile up), so the search stops at the first failure, and after a bound that
/// no correct run here comes near (none found by then fails the control).
fn broken(m: BatonModel) -> String {
    let checker = m
        .checker()
        .finish_when(HasDiscoveries::AnyFailures)
        .target_state_count(2_000_000)
        .spawn_bfs()
        .join();
    const SAFETY: [&str; 7] = [
        "no invariant broken at a step",
        "one acting leader",
        "proofs never exceed etcd's own countdown",
        "at most one execution of a job runs",
        "a forbid or replace schedule runs one tick at a time",
        "at most one result per job",
        "registry and assignment agree",
    ];
    let found: Vec<String> = SAFETY
        .into_iter()
        .filter_map(|p| {
            let path = checker.discovery(p)?;
            // A step invariant names what broke.
            let why = path.last_state().broken.unwrap_or_default();
            println!("counterexample for {p:?} ({why}):");
            for a in path.into_actions() {
                println!("  {a:?}");
            }
            Some(format!("{p}: {why}"))
        })
        .collect();
    found.join(", ")
}

/// Unique states of the model without faults, and with one fault of each kind: a change that
/// shrinks (or grows) the explored space shows here.
const NO_FAULT_STATES: usize = 1_314;
const ONE_FAULT_STATES: [(FaultKind, usize); 8] = [
    (FaultKind::ReplicaCrash, 35_307),
    (FaultKind::ReplicaPause, 79_320),
    (FaultKind::ReplicaCut, 38_811),
    (FaultKind::WorkerCrash, 16_179),
    (FaultKind::WorkerPause, 176_505),
    (FaultKind::WorkerCut, 159_852),
    (FaultKind::KeyDeleted, 141_924),
    (FaultKind::LeaseRevoked, 141_879),
];

#[test]
fn without_faults_every_property_holds_and_every_job_can_finish() {
    let n = check(model());
    assert_eq!(n, NO_FAULT_STATES);
    let (all, stuck) = stuck_states(&model(), 5_000_000).unwrap();
    assert_eq!(all, n);
    assert!(
        stuck.is_empty(),
        "states that cannot reach a result: {stuck:#?}"
    );
}

/// Two jobs contend for the workers (no faults): every property holds, both can finish.
const TWO_JOB_STATES: usize = 208_383;

#[test]
fn two_jobs_without_faults_keep_every_property_and_both_can_finish() {
    let m = BatonModel::new(2, 2, 2);
    let n = check(m.clone());
    assert_eq!(n, TWO_JOB_STATES);
    let (all, stuck) = stuck_states(&m, 5_000_000).unwrap();
    assert_eq!(all, n);
    assert!(stuck.is_empty(), "{stuck:#?}");
}

#[test]
fn one_fault_of_each_kind_breaks_no_property() {
    assert_eq!(ONE_FAULT_STATES.map(|(k, _)| k), ALL_FAULTS);
    // Properties first, for every kind; then the counts.
    let counts = ONE_FAULT_STATES.map(|(kind, _)| {
        println!("{kind:?}:");
        (kind, check(model().with_faults(&[kind], 1)))
    });
    assert_eq!(counts, ONE_FAULT_STATES);
}

#[test]
fn every_job_can_still_finish_after_any_one_fault() {
    for (kind, states) in ONE_FAULT_STATES {
        let (all, stuck) = stuck_states(&model().with_faults(&[kind], 1), 5_000_000).unwrap();
        println!("{kind:?}: {all} states, {} stuck", stuck.len());
        assert_eq!(all, states, "{kind:?}");
        assert!(stuck.is_empty(), "{kind:?}: {stuck:#?}");
    }
}

/// A crashed leader's lease revoked on evidence (fast failover): its late writes still fail on
/// the fence, and no two leaders act.
const FAST_FAILOVER_STATES: usize = 35_331;

#[test]
fn fast_failover_after_a_leader_crash_keeps_every_property_and_every_job_can_finish() {
    let m = model()
        .with_faults(&[FaultKind::ReplicaCrash], 1)
        .with_fast_failover();
    let n = check(m.clone());
    assert!(
        n > ONE_FAULT_STATES[0].1,
        "the revoke adds states to the crash's {}",
        ONE_FAULT_STATES[0].1
    );
    assert_eq!(n, FAST_FAILOVER_STATES);
    let (all, stuck) = stuck_states(&m, 5_000_000).unwrap();
    assert_eq!(all, n);
    assert!(stuck.is_empty(), "{stuck:#?}");
}

#[test]
fn revoking_a_live_leader_lets_two_leaders_act() {
    let m = model().with_fast_failover().with_mutations(Mutations {
        revoke_live: true,
        ..Mutations::default()
    });
    let found = broken(m);
    assert!(found.contains("one acting leader"), "{found}");
}

#[test]
fn without_the_fence_a_late_write_of_a_paused_leader_is_found() {
    let m = model()
        .with_faults(&[FaultKind::ReplicaPause], 1)
        .with_mutations(Mutations {
            no_fence: true,
            ..Mutations::default()
        });
    assert!(!broken(m).is_empty());
}

#[test]
fn without_the_attempt_compare_a_take_back_racing_a_start_is_found() {
    let m = model().with_mutations(Mutations {
        no_attempt_compare: true,
        ..Mutations::default()
    });
    assert!(!broken(m).is_empty());
}

#[test]
fn without_the_guards_go_check_a_late_go_is_found() {
    let m = model()
        .with_faults(&[FaultKind::WorkerPause], 1)
        .with_mutations(Mutations {
            no_go_check: true,
            ..Mutations::default()
        });
    assert!(!broken(m).is_empty());
}

#[test]
fn without_the_wait_a_restart_beside_a_live_guard_is_found() {
    let m = model()
        .with_faults(&[FaultKind::KeyDeleted], 1)
        .with_mutations(Mutations {
            short_wait: true,
            ..Mutations::default()
        });
    let found = broken(m);
    assert!(found.contains("execution"), "{found}");
}

#[test]
fn without_the_revoke_a_deleted_worker_key_lets_two_executions_overlap() {
    // Issue 27's gap: the key is deleted, the worker's watch lags, it goes on renewing.
    let m = model()
        .with_faults(&[FaultKind::KeyDeleted], 1)
        .with_mutations(Mutations {
            no_revoke: true,
            ..Mutations::default()
        });
    let found = broken(m);
    assert!(found.contains("execution"), "{found}");
}

/// `cargo test --release -p baton-model -- --ignored --nocapture counts`: the counts to put in
/// the constants above after a deliberate change of the model or the protocol.
#[test]
#[ignore]
fn counts() {
    println!(
        "no faults: {}",
        model().checker().spawn_bfs().join().unique_state_count()
    );
    println!(
        "two jobs: {}",
        BatonModel::new(2, 2, 2)
            .checker()
            .spawn_bfs()
            .join()
            .unique_state_count()
    );
    for kind in ALL_FAULTS {
        let n = model().with_faults(&[kind], 1).checker().spawn_bfs().join();
        println!("{kind:?}: {}", n.unique_state_count());
    }
}

#[test]
fn a_proof_counted_from_the_answer_outlives_etcds_countdown() {
    // A pause holds the keepalive's answer until a tick after etcd restarted the countdown.
    let m = model()
        .with_faults(&[FaultKind::ReplicaPause], 1)
        .with_mutations(Mutations {
            proof_from_answer: true,
            ..Mutations::default()
        });
    let found = broken(m);
    assert!(found.contains("countdown"), "{found}");
}

/// A schedule of two ticks beside no other job, 2 replicas and 1 worker: its ticks' jobs are
/// created at most once, never at or before the watermark, and under `forbid` and `replace`
/// never run at once; with a replica paused (its fires landing late).
fn scheduled(overlap: Overlap) -> BatonModel {
    BatonModel::new(2, 1, 0).with_schedule(overlap, 2)
}

/// Unique states without faults, and with a replica paused (none for `allow`, whose two runs
/// at once make that space too large for `make test`).
const SCHEDULE_STATES: [(Overlap, usize, Option<usize>); 3] = [
    (Overlap::Forbid, 1_614, Some(138_638)),
    (Overlap::Allow, 30_516, None),
    (Overlap::Replace, 2_079, Some(200_158)),
];

#[test]
fn schedule_ticks_fire_once_and_forbid_and_replace_never_overlap() {
    let counts = SCHEDULE_STATES.map(|(overlap, _, paused)| {
        println!("{overlap:?}:");
        let n = check(scheduled(overlap));
        let p =
            paused.map(|_| check(scheduled(overlap).with_faults(&[FaultKind::ReplicaPause], 1)));
        (overlap, n, p)
    });
    assert_eq!(counts, SCHEDULE_STATES);
}

#[test]
fn without_the_tick_guards_a_lost_answer_makes_a_tick_fire_twice() {
    // Guarded, the same run holds: the refire's compare on the status fails.
    check(scheduled(Overlap::Allow).with_lost_answers());
    let m = scheduled(Overlap::Allow)
        .with_lost_answers()
        .with_mutations(Mutations {
            no_tick_guards: true,
            ..Mutations::default()
        });
    let found = broken(m);
    assert!(found.contains("created twice"), "{found}");
}

#[test]
fn without_the_after_compare_a_replace_overlaps() {
    let m = scheduled(Overlap::Replace).with_mutations(Mutations {
        no_after: true,
        ..Mutations::default()
    });
    let found = broken(m);
    assert!(found.contains("one tick at a time"), "{found}");
}
