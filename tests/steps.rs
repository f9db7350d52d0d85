//! Cleanup as a pipeline of steps, on real replicas, workers and etcd: the retry strategies'
//! delays measured from the execution ledger, ordered and concurrent steps across a leader
//! kill, abandoning a cleanup (with its worker running, and frozen), registry entries found
//! beside a result (the result store is the last word), compatibility of specs without steps,
//! and bad input.

mod support;

use std::path::Path;
use std::time::Duration;

use baton::exec::record::LedgerEntry;
use baton::proto::{
    AbandonCleanupRequest, CleanupState, CleanupStep, CleanupStepMode, RetryCleanupRequest,
};
use support::*;
use tonic::Code;

const LONG: Duration = Duration::from_secs(60);

fn opts(replicas: usize, extra: &[&str]) -> Options {
    Options {
        replicas,
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
        ..Options::default()
    }
}

fn step(name: &str, mode: CleanupStepMode, script: &str) -> CleanupStep {
    CleanupStep {
        name: name.into(),
        command: vec!["sh".into(), "-c".into(), script.into()],
        mode: mode as i32,
    }
}

use CleanupStepMode::{CleanupStepConcurrent as Concurrent, CleanupStepOrdered as Ordered};

/// A spec whose job and steps see `$L`, a folder of the test's.
fn with_steps(job: &str, steps: Vec<CleanupStep>, l: &Path) -> JobSpec {
    let mut spec = sh(job);
    spec.cleanup_steps = steps;
    spec.env.insert("L".into(), l.display().to_string());
    spec
}

/// The execution ledger's complete lines.
fn ledger(path: &Path) -> Vec<LedgerEntry> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .filter_map(|l| serde_json::from_str(l.trim_end()).ok())
        .collect()
}

/// Unix ms of each start of `job`'s executions named `name-<n>`, in order.
fn starts(path: &Path, job: &str, name: &str) -> Vec<u64> {
    let mut at: Vec<u64> = ledger(path)
        .into_iter()
        .filter(|e| e.event == "start" && e.job_id == job && e.name.starts_with(name))
        .map(|e| e.unix_ms)
        .collect();
    at.sort();
    at
}

async fn etcd(c: &Cluster) -> etcd_client::Client {
    etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap()
}

async fn present(c: &Cluster, key: &str) -> bool {
    !etcd(c)
        .await
        .get(format!("/baton/test/{key}"), None)
        .await
        .unwrap()
        .kvs()
        .is_empty()
}

/// A cluster of one replica with an execution ledger and `flags`, running a job whose
/// cleanup command fails until its attempt `succeed_at`; returns the gaps between the
/// command's starts.
async fn gaps(flags: &[&str], succeed_at: u32) -> Vec<Duration> {
    let (_t, l) = ledger_dir();
    let led = l.join("ledger.jsonl");
    let led_s = led.display().to_string();
    let mut args = vec!["--execution-ledger", led_s.as_str()];
    args.extend_from_slice(flags);
    let c = Cluster::start(opts(1, &args));
    c.leader_index().await;
    let mut spec = sh("true");
    spec.cleanup_command = vec![
        "sh".into(),
        "-c".into(),
        format!("[ \"$BATON_CLEANUP_ATTEMPT\" -ge {succeed_at} ]"),
    ];
    c.submit(0, "timed", spec).await;
    c.wait_job(&[0], "timed", LONG, "clean", clean).await;
    let at = starts(&led, "timed", "cleanup-");
    assert_eq!(at.len(), succeed_at as usize, "{at:?}");
    at.windows(2)
        .map(|w| Duration::from_millis(w[1] - w[0]))
        .collect()
}

/// Each gap within 0.9 d .. 1.1 d + 0.3 s of its expected delay.
fn assert_delays(got: &[Duration], want: &[f64]) {
    println!("gaps between cleanup starts: {got:?} (expected {want:?} s)");
    assert_eq!(got.len(), want.len(), "{got:?}");
    for (g, w) in got.iter().zip(want) {
        let (lo, hi) = (0.9 * w, 1.1 * w + 0.3);
        let g = g.as_secs_f64();
        assert!(
            g >= lo && g <= hi,
            "a gap of {g:.3} s where {w} s was due (allowed {lo:.2} .. {hi:.2}): {got:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exponential_delay_starts_at_its_initial_delay_doubles_and_stops_at_its_cap() {
    let got = gaps(
        &["--cleanup-initial-delay", "1s", "--cleanup-max-delay", "4s"],
        5,
    )
    .await;
    assert_delays(&got, &[1.0, 2.0, 4.0, 4.0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initial_delay_of_three_seconds_is_honoured_from_the_first_retry() {
    let got = gaps(&["--cleanup-initial-delay", "3s"], 3).await;
    assert_delays(&got, &[3.0, 6.0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_delay_waits_the_same_after_every_failure() {
    let got = gaps(
        &[
            "--cleanup-strategy",
            "fixed-delay",
            "--cleanup-fixed-delay",
            "1500ms",
        ],
        4,
    )
    .await;
    assert_delays(&got, &[1.5, 1.5, 1.5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strategy_none_needs_an_operator_at_the_first_failure_with_no_retry_time() {
    let (_t, l) = ledger_dir();
    let led = l.join("ledger.jsonl");
    let led_s = led.display().to_string();
    let c = Cluster::start(opts(
        1,
        &["--execution-ledger", &led_s, "--cleanup-strategy", "none"],
    ));
    c.leader_index().await;
    let mut spec = sh("true");
    spec.cleanup_command = vec!["sh".into(), "-c".into(), "[ -e \"$L/fixed\" ]".into()];
    spec.env.insert("L".into(), l.display().to_string());
    c.submit(0, "once", spec).await;
    let j = c
        .wait_job(&[0], "once", LONG, "needing an operator", |j| {
            cleanup_state(j) == CleanupState::CleanupNeedsOperator
        })
        .await;
    let cl = j.cleanup.unwrap();
    assert_eq!(cl.attempts, 1);
    assert_eq!(cl.next_retry_unix_ms, 0, "no retry is scheduled: {cl:?}");
    assert_eq!(cl.steps.len(), 1);
    assert_eq!(cl.steps[0].name, "command");
    assert_eq!(cl.steps[0].state, "needs-operator");
    assert_eq!(cl.steps[0].next_retry_unix_ms, 0);
    let (_, out, _) = run_cli(
        &[
            "job",
            "get",
            "once",
            "-o",
            "json",
            "--endpoints",
            &c.replicas[0].listen().to_string(),
        ],
        LONG,
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["cleanup"]["next_retry_unix_ms"].is_null(), "{v}");
    assert_eq!(v["cleanup"]["steps"][0]["state"], "needs-operator", "{v}");
    assert_eq!(starts(&led, "once", "cleanup-").len(), 1, "no retry ran");
    std::fs::write(l.join("fixed"), "").unwrap();
    c.jobs(0)
        .await
        .retry_cleanup(RetryCleanupRequest {
            job_id: "once".into(),
        })
        .await
        .unwrap();
    let j = c.wait_job(&[0], "once", LONG, "clean", clean).await;
    assert_eq!(j.cleanup.unwrap().attempts, 2);
    assert_eq!(starts(&led, "once", "cleanup-").len(), 2);
}

/// Every change under the cluster's prefix from now on, in revision order: key, revision,
/// put (or delete), value.
struct History(std::sync::Arc<std::sync::Mutex<Vec<Change>>>);

/// Key, revision, put (or delete), value.
type Change = (String, i64, bool, Vec<u8>);

impl History {
    async fn record(c: &Cluster) -> History {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut client = etcd(c).await;
        let mut stream = client
            .watch(
                "/baton/test/",
                Some(etcd_client::WatchOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        let into = seen.clone();
        tokio::spawn(async move {
            while let Ok(Some(resp)) = stream.message().await {
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    into.lock().unwrap().push((
                        String::from_utf8_lossy(kv.key()).into_owned(),
                        kv.mod_revision(),
                        ev.event_type() == etcd_client::EventType::Put,
                        kv.value().to_vec(),
                    ));
                }
            }
        });
        History(seen)
    }

    /// The first revision at which a key ending with `suffix` was put with a value
    /// containing `part`.
    fn first_put(&self, suffix: &str, part: &str) -> Option<i64> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .find(|(k, _, put, v)| {
                *put && k.ends_with(suffix) && String::from_utf8_lossy(v).contains(part)
            })
            .map(|(_, rev, _, _)| *rev)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_steps_run_in_turn_concurrent_ones_together_and_only_a_failed_step_again() {
    let mut c = Cluster::start(Options {
        embedded: false,
        workers: 2,
        extra_args: ["--cleanup-initial-delay", "200ms"]
            .into_iter()
            .chain(["--test-cleanup-pause-after-step", "a"])
            .map(String::from)
            .collect(),
        ..Options::default()
    });
    let (k, old) = c.leader_index().await;
    c.wait_workers(&["w1", "w2"]).await;
    let (_t, l) = ledger_dir();
    let note = |name: &str| {
        format!(
            "echo \"{name} $BATON_CLEANUP_STEP $BATON_CLEANUP_ATTEMPT s $(date +%s%N)\" >> $L/log"
        )
    };
    let end = |name: &str| format!("echo \"{name} e $(date +%s%N)\" >> $L/log");
    // `b` fails twice.
    let b = format!(
        "{}; [ \"$BATON_CLEANUP_ATTEMPT\" -ge 3 ] || exit 1; {}",
        note("b"),
        end("b")
    );
    // Each concurrent step waits (bounded) for the other to start.
    let conc = |me: &str, other: &str| {
        format!(
            "{}; touch $L/{me}-up; i=0; while [ ! -e $L/{other}-up ] && [ $i -lt 300 ]; do \
             sleep 0.05; i=$((i+1)); done; sleep 0.2; {}",
            note(me),
            end(me)
        )
    };
    let steps = vec![
        step("a", Ordered, &format!("{}; {}", note("a"), end("a"))),
        step("c1", Concurrent, &conc("c1", "c2")),
        step("b", Ordered, &b),
        step("c2", Concurrent, &conc("c2", "c1")),
        step("c", Ordered, &format!("{}; {}", note("c"), end("c"))),
    ];
    c.submit(
        (k + 1) % 3,
        "piped",
        with_steps("echo job >> $L/job", steps, &l),
    )
    .await;
    // The leader recorded `a` done and (held by the hook) gave out nothing after it.
    let j = c
        .wait_job(&c.others(k), "piped", LONG, "past step a", |j| {
            j.cleanup
                .as_ref()
                .is_some_and(|c| c.steps.first().is_some_and(|s| s.state == "done"))
        })
        .await;
    assert_eq!(j.cleanup.unwrap().steps[1].state, "pending");
    c.replicas[k].sigkill();
    let rest = c.others(k);
    c.wait_new_leader(&rest, old.term).await;
    let j = c.wait_job(&rest, "piped", LONG, "clean", clean).await;
    c.replicas[k].restart().unwrap();
    let log = lines(&l.join("log"));
    println!("{}", log.join("\n"));
    let runs = |name: &str| {
        log.iter()
            .filter(|x| x.starts_with(&format!("{name} {name} ")))
            .count()
    };
    assert_eq!(lines(&l.join("job")).len(), 1, "the job ran once");
    for (name, n) in [("a", 1), ("b", 3), ("c", 1), ("c1", 1), ("c2", 1)] {
        assert_eq!(
            runs(name),
            n,
            "step {name} ran {} times: {log:?}",
            runs(name)
        );
    }
    let at = |name: &str, kind: &str| -> u64 {
        log.iter()
            .filter(|x| x.starts_with(&format!("{name} ")))
            .filter_map(|x| {
                let parts: Vec<&str> = x.split(' ').collect();
                let k = parts.iter().position(|p| *p == kind)?;
                parts.get(k + 1)?.parse().ok()
            })
            .next_back()
            .unwrap_or_else(|| panic!("no {kind} of {name}: {log:?}"))
    };
    assert!(at("a", "e") < at("b", "s"), "a before b");
    assert!(at("b", "e") < at("c", "s"), "b before c");
    assert!(
        at("c", "e") < at("c1", "s") && at("c", "e") < at("c2", "s"),
        "ordered steps first"
    );
    assert!(
        at("c1", "s") < at("c2", "e") && at("c2", "s") < at("c1", "e"),
        "the concurrent steps overlap in time"
    );
    let cl = j.cleanup.unwrap();
    let names: Vec<&str> = cl.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["a", "b", "c", "c1", "c2"],
        "ordered first, then concurrent"
    );
    assert!(cl.steps.iter().all(|s| s.state == "done"), "{cl:?}");
    let modes: Vec<i32> = cl.steps.iter().map(|s| s.mode).collect();
    assert_eq!(
        modes,
        [Ordered, Ordered, Ordered, Concurrent, Concurrent].map(|m| m as i32)
    );
    let b = cl.steps.iter().find(|s| s.name == "b").unwrap();
    assert_eq!(b.attempts, 3);
    assert_eq!(cl.attempts, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoning_kills_a_running_step_before_the_folder_goes_then_the_result_is_clean() {
    let c = Cluster::start(opts(3, &[]));
    c.leader_index().await;
    let (_t, l) = ledger_dir();
    // It writes into the job's folder until killed: outliving the folder would bring it back.
    let forever = "echo $$ > $L/pid; echo $PPID > $L/guard; while true; do \
                   mkdir -p \"$BATON_JOB_DIR\" && date +%s%N >> \"$BATON_JOB_DIR/ticks\"; \
                   sleep 0.05; done";
    let steps = vec![
        step("hang", Ordered, forever),
        step("after", Ordered, "echo after >> $L/after"),
        step("side", Concurrent, "echo side >> $L/after"),
    ];
    c.submit(0, "stuck", with_steps("true", steps, &l)).await;
    wait_until("the step to run", LONG, || {
        !read_pids(&l.join("pid")).is_empty()
    })
    .await;
    let pid = read_pids(&l.join("pid"))[0];
    let j = c
        .wait_job(&[1], "stuck", LONG, "running its step", |j| {
            j.cleanup
                .as_ref()
                .is_some_and(|c| c.steps.first().is_some_and(|s| s.state == "running"))
        })
        .await;
    assert!(!j.cleanup.unwrap().steps[0].worker.is_empty());
    let history = History::record(&c).await;
    // Its guard frozen, the command cannot die yet: the folder must wait for its end.
    let guard = read_pids(&l.join("guard"))[0];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(guard),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let eps: Vec<String> = c.replicas.iter().map(|r| r.listen().to_string()).collect();
    let (code, out, err) = run_cli(
        &[
            "job",
            "cleanup",
            "stuck",
            "--abandon",
            "--reason",
            "disk gone",
            "--endpoints",
            &eps.join(","),
        ],
        LONG,
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let j = c
        .wait_job(&[2], "stuck", LONG, "abandoned", |j| {
            j.cleanup
                .as_ref()
                .is_some_and(|c| c.steps.first().is_some_and(|s| s.state == "abandoned"))
        })
        .await;
    let cl = j.cleanup.unwrap();
    assert_eq!(cl.stage, 0, "still waiting for the step's end: {cl:?}");
    assert!(alive(pid));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(guard),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    let j = c.wait_job(&[2], "stuck", LONG, "clean", clean).await;
    assert!(!alive(pid), "the abandoned step's command is dead");
    // In etcd's order: the step's end recorded by its worker, then the folder given out.
    let ended = history
        .first_put("/cleanups/stuck/hang.1", "\"exited\"")
        .expect("the killed step's end is recorded");
    let folder = history
        .first_put("/cleanup/stuck", "\"folder\"")
        .expect("the folder stage ran");
    assert!(
        ended < folder,
        "the folder went at revision {folder}, before the step's end at {ended}"
    );
    assert!(
        !c.job_dir("stuck").exists(),
        "the folder went after the command died (a live command would have made it again)"
    );
    assert!(!l.join("after").exists(), "abandoned steps never ran");
    let cl = j.cleanup.unwrap();
    assert!(cl.abandoned, "{cl:?}");
    assert_eq!(cl.abandon_reason, "disk gone");
    let states: Vec<&str> = cl.steps.iter().map(|s| s.state.as_str()).collect();
    assert_eq!(states, ["abandoned", "abandoned", "abandoned"]);
    // Only a dirty result can be abandoned.
    let e = c
        .jobs(0)
        .await
        .abandon_cleanup(AbandonCleanupRequest {
            job_id: "stuck".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = c
        .jobs(0)
        .await
        .abandon_cleanup(AbandonCleanupRequest {
            job_id: "nobody".into(),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoning_while_the_steps_worker_is_frozen_waits_out_its_lease() {
    let c = Cluster::start(Options {
        embedded: false,
        workers: 2,
        ..Options::default()
    });
    c.leader_index().await;
    c.wait_workers(&["w1", "w2"]).await;
    let (_t, l) = ledger_dir();
    let forever = "echo $$ > $L/pid; while true; do date +%s%N >> $L/ticks; sleep 0.05; done";
    // The folder's worker is the job's; the step runs on the other one.
    let mut spec = with_steps("echo $BATON_WORKER > $L/job-worker", vec![], &l);
    spec.cleanup_steps = vec![
        step("other", Ordered, "true"),
        step("hang", Ordered, forever),
    ];
    c.submit(0, "frozen", spec).await;
    wait_until("the step to run", LONG, || {
        !read_pids(&l.join("pid")).is_empty()
    })
    .await;
    let pid = read_pids(&l.join("pid"))[0];
    let j = c
        .wait_job(&[1], "frozen", LONG, "running its step", |j| {
            j.cleanup.as_ref().is_some_and(|c| {
                c.steps
                    .iter()
                    .any(|s| s.name == "hang" && s.state == "running")
            })
        })
        .await;
    let on = j.cleanup.unwrap().steps[1].worker.clone();
    let job_worker = lines(&l.join("job-worker"))[0].clone();
    let frozen = if on == "w1" { 0 } else { 1 };
    c.workers[frozen].pause();
    c.jobs(1)
        .await
        .abandon_cleanup(AbandonCleanupRequest {
            job_id: "frozen".into(),
            reason: "host frozen".into(),
        })
        .await
        .unwrap();
    let gone_ms = wait_for("the frozen worker's key to expire", LONG, || async {
        (!present(&c, &format!("workers/{on}")).await).then(baton::jobs::records::now_ms)
    })
    .await;
    let j = c.wait_job(&[1], "frozen", LONG, "clean", clean).await;
    let dead_at_clean = !alive(pid);
    c.workers[frozen].resume();
    let stored: serde_json::Value = serde_json::from_slice(
        etcd(&c)
            .await
            .get("/baton/test/results/clean/frozen", None)
            .await
            .unwrap()
            .kvs()[0]
            .value(),
    )
    .unwrap();
    let done_ms = stored["cleanup"]["done_ms"].as_u64().unwrap();
    let last_tick = lines(&l.join("ticks"))
        .last()
        .unwrap()
        .parse::<u64>()
        .unwrap()
        / 1_000_000;
    println!(
        "step on {on} (the job on {job_worker}): last tick {} ms before the key went; clean {} ms after",
        gone_ms as i64 - last_tick as i64,
        done_ms as i64 - gone_ms as i64
    );
    assert!(
        dead_at_clean,
        "the command is dead when the result is clean"
    );
    assert!(
        last_tick <= gone_ms,
        "the guard killed the command before its worker's lease expired"
    );
    // TTL 2 s + margin 0.5 s after the key went, less what polling it cost.
    assert!(
        done_ms + 200 >= gone_ms + 2500,
        "the result became clean {} ms after the worker's key went: the TTL and margin were not waited out",
        done_ms as i64 - gone_ms as i64
    );
    let cl = j.cleanup.unwrap();
    assert!(cl.abandoned && cl.abandon_reason == "host frozen", "{cl:?}");
    assert_eq!(cl.steps[0].state, "done");
    assert_eq!(cl.steps[1].state, "abandoned");
}

/// Asserts that `ok` stays true for `window` (checked every 20 ms).
async fn holds_for(what: &str, window: Duration, ok: impl Fn() -> bool) {
    let until = std::time::Instant::now() + window;
    while std::time::Instant::now() < until {
        assert!(ok(), "expected {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A PENDING (or RUNNING) registry entry for `id`, as a stale writer would put it.
async fn put_stray(c: &Cluster, id: &str, running_on: Option<(&str, i64)>) {
    let mut entry = baton::jobs::records::RegistryEntry::pending();
    if let Some((w, rev)) = running_on {
        entry.status = baton::jobs::records::RegistryStatus::Running;
        entry.attempt = 2;
        entry.worker = Some(w.into());
        entry.worker_rev = rev;
        entry.worker_ttl_ms = 2500;
    }
    etcd(c)
        .await
        .put(
            format!("/baton/test/registry/{id}"),
            serde_json::to_vec(&entry).unwrap(),
            None,
        )
        .await
        .unwrap();
}

async fn worker_rev(c: &Cluster, id: &str) -> i64 {
    etcd(c)
        .await
        .get(format!("/baton/test/workers/{id}"), None)
        .await
        .unwrap()
        .kvs()[0]
        .create_revision()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_entry_beside_a_result_is_removed_and_never_runs_the_job_again() {
    let mut c = Cluster::start(opts(3, &[]));
    let (k, old) = c.leader_index().await;
    let (_t, l) = ledger_dir();
    let out = l.display().to_string();
    let job = |id: &str| {
        let mut s = sh(&format!("echo run >> {out}/{id}"));
        s.cleanup_command = vec![
            "sh".into(),
            "-c".into(),
            format!("while [ ! -e {out}/release-$BATON_JOB_ID ]; do sleep 0.05; done"),
        ];
        s
    };
    // Beside a dirty result, with and without a leader change in between.
    for id in ["dirty-1", "dirty-2", "dirty-3"] {
        c.submit(0, id, job(id)).await;
        c.wait_job(&[0], id, LONG, "finished", terminal).await;
    }
    // Beside a clean one.
    c.submit(0, "clean-1", sh(&format!("echo run >> {out}/clean-1")))
        .await;
    c.wait_job(&[0], "clean-1", LONG, "clean", clean).await;

    put_stray(&c, "dirty-1", None).await;
    put_stray(&c, "clean-1", None).await;
    wait_for("the stray entries to go", LONG, || async {
        (!present(&c, "registry/dirty-1").await && !present(&c, "registry/clean-1").await)
            .then_some(())
    })
    .await;

    c.replicas[k].sigkill();
    let r2 = worker_rev(&c, "r2").await;
    put_stray(&c, "dirty-2", None).await;
    put_stray(&c, "dirty-3", Some(("r2", r2))).await;
    put_stray(&c, "clean-1", None).await;
    let rest = c.others(k);
    c.wait_new_leader(&rest, old.term).await;
    wait_for(
        "the stray entries to go after the failover",
        LONG,
        || async {
            let mut any = false;
            for id in ["dirty-2", "dirty-3", "clean-1"] {
                any |= present(&c, &format!("registry/{id}")).await;
            }
            (!any).then_some(())
        },
    )
    .await;
    c.replicas[k].restart().unwrap();
    for id in ["dirty-1", "dirty-2", "dirty-3"] {
        std::fs::write(l.join(format!("release-{id}")), "").unwrap();
    }
    for id in ["dirty-1", "dirty-2", "dirty-3", "clean-1"] {
        let j = c.wait_job(&rest, id, LONG, "clean", clean).await;
        assert_eq!(state(&j), JobState::Finished);
        assert_eq!(lines(&l.join(id)).len(), 1, "{id} ran once");
    }
    let m: String = c
        .replicas
        .iter()
        .map(|r| std::fs::read_to_string(r.log_path()).unwrap_or_default())
        .collect();
    assert!(
        m.contains("a registry entry stood beside the job's result"),
        "the removal is logged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_written_between_the_leaders_read_and_its_assignment_stops_the_run() {
    let (_t, l) = ledger_dir();
    let gate = l.join("gate");
    let gate_s = gate.display().to_string();
    // Cleanups held, so that only the leader's assignment can see the result.
    let c = Cluster::start(opts(
        3,
        &[
            "--test-pause-before-assign",
            &gate_s,
            "--cleanup-pause-after-stage",
            "0",
        ],
    ));
    c.leader_index().await;
    std::fs::write(&gate, "").unwrap();
    let out = l.display().to_string();
    c.submit(0, "raced", sh(&format!("echo run >> {out}/raced")))
        .await;
    let reached = l.join("gate.raced.reached");
    wait_until("the leader to pause before assigning", LONG, || {
        reached.exists()
    })
    .await;
    let planted = serde_json::json!({
        "version": 2, "job_id": "raced", "status": "FAILED", "error": "recorded elsewhere",
        "attempts": 1, "failed_attempts": 1, "recoveries": 0, "submitted_at_ms": 1,
        "finished_at_ms": 2, "spec_hash": "x", "term": 1
    });
    etcd(&c)
        .await
        .put(
            "/baton/test/results/dirty/raced",
            serde_json::to_vec(&planted).unwrap(),
            None,
        )
        .await
        .unwrap();
    std::fs::remove_file(&gate).unwrap();
    wait_for("the stray entry to go", LONG, || async {
        (!present(&c, "registry/raced").await).then_some(())
    })
    .await;
    let j = c.get_job(1, "raced").await.unwrap();
    assert_eq!(state(&j), JobState::Failed);
    assert_eq!(j.error, "recorded elsewhere", "the recorded result stands");
    assert!(j.history.is_empty(), "no attempt was made: {:?}", j.history);
    assert!(!l.join("raced").exists(), "the command never ran");
}

/// What a release before cleanup steps stored for `sh -c true` (its hash included).
const OLD_RECORD: &str = r#"{"version":1,"job_id":"old","spec":{"command":["sh","-c","true"],"env":{},"cleanup_command":[],"max_attempts":3,"timeout":86400.0},"spec_hash":"HASH","submitted_at_ms":1700000000000,"submitted_by":"anonymous"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_submitted_before_the_upgrade_is_found_again_by_an_identical_resubmission() {
    let c = Cluster::start(opts(1, &["--cleanup-pause-after-stage", "0"]));
    c.leader_index().await;
    let hash = format!("{:016x}", {
        // FNV-1a 64 of the spec as the older release serialized it.
        let spec = r#"{"command":["sh","-c","true"],"env":{},"cleanup_command":[],"max_attempts":3,"timeout":86400.0}"#;
        spec.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        })
    });
    let mut e = etcd(&c).await;
    e.put(
        "/baton/test/jobs/old",
        OLD_RECORD.replace("HASH", &hash),
        None,
    )
    .await
    .unwrap();
    e.put(
        "/baton/test/registry/old",
        serde_json::to_vec(&baton::jobs::records::RegistryEntry::pending()).unwrap(),
        None,
    )
    .await
    .unwrap();
    let again = c
        .jobs(0)
        .await
        .submit_job(SubmitJobRequest {
            job_id: "old".into(),
            spec: Some(sh("true")),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        !again.created,
        "an identical re-submission returns the existing job"
    );
    assert_eq!(again.job.unwrap().spec_hash, hash);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_steps_and_conflicting_strategy_flags_are_refused_naming_the_field() {
    let c = Cluster::start(opts(1, &[]));
    c.leader_index().await;
    let mut jobs = c.jobs(0).await;
    let many: Vec<CleanupStep> = (0..17)
        .map(|i| step(&format!("s{i}"), Ordered, "true"))
        .collect();
    let cases = [
        ("seventeen", many),
        (
            "twice",
            vec![step("a", Ordered, "true"), step("a", Concurrent, "true")],
        ),
        ("upper", vec![step("Bad", Ordered, "true")]),
        ("long", vec![step(&"x".repeat(33), Ordered, "true")]),
        ("reserved", vec![step("folder", Ordered, "true")]),
        (
            "empty",
            vec![CleanupStep {
                name: "e".into(),
                command: vec![],
                mode: Ordered as i32,
            }],
        ),
    ];
    for (id, steps) in cases {
        let mut spec = sh("true");
        spec.cleanup_steps = steps;
        let e = jobs
            .submit_job(SubmitJobRequest {
                job_id: id.into(),
                spec: Some(spec),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{id}: {e:?}");
        assert!(
            e.message().contains("spec.cleanup_steps"),
            "{id}: {}",
            e.message()
        );
        for key in ["jobs", "registry"] {
            assert!(
                !present(&c, &format!("{key}/{id}")).await,
                "{id}: nothing written"
            );
        }
    }
    let etcd_ep = c.etcd.endpoints().join(",");
    for (flags, named) in [
        (
            vec![
                "--cleanup-strategy",
                "fixed-delay",
                "--cleanup-initial-delay",
                "1s",
            ],
            "--cleanup-initial-delay",
        ),
        (vec!["--cleanup-fixed-delay", "2s"], "--cleanup-fixed-delay"),
        (
            vec!["--cleanup-strategy", "none", "--cleanup-max-attempts", "3"],
            "--cleanup-max-attempts",
        ),
    ] {
        let mut args = vec![
            "serve",
            "--etcd-endpoints",
            &etcd_ep,
            "--cluster",
            "refused",
        ];
        args.extend(flags.iter().copied());
        let (code, _, err) = run_cli(&args, LONG);
        assert_eq!(code, Some(1), "{flags:?}: {err}");
        assert!(err.contains(named), "{flags:?}: {err}");
    }
    assert!(
        etcd(&c)
            .await
            .get(
                "/baton/refused/",
                Some(etcd_client::GetOptions::new().with_prefix())
            )
            .await
            .unwrap()
            .kvs()
            .is_empty(),
        "a refused start writes nothing"
    );
    // The CLI names the flag of a malformed step.
    let (code, _, err) = run_cli(
        &[
            "job",
            "submit",
            "--cleanup",
            "no name here",
            "--endpoints",
            &c.replicas[0].listen().to_string(),
            "--",
            "true",
        ],
        LONG,
    );
    assert_ne!(code, Some(0));
    assert!(err.contains("--cleanup"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_recorded_while_the_job_runs_stops_it_before_the_first_step_starts() {
    let (_t, l) = ledger_dir();
    let led = l.join("ledger.jsonl");
    let led_s = led.display().to_string();
    let c = Cluster::start(opts(3, &["--execution-ledger", &led_s]));
    c.leader_index().await;
    let out = l.display().to_string();
    let mut spec = sh(&format!(
        "echo $PPID > {out}/guard; echo run >> {out}/long; \
         while [ ! -e {out}/never ]; do sleep 0.05; done"
    ));
    spec.cleanup_steps = vec![step("after", Ordered, &format!("echo step >> {out}/step"))];
    c.submit(0, "long", spec).await;
    c.wait_job(&[1], "long", LONG, "running", |j| {
        state(j) == JobState::Running && !j.history.is_empty()
    })
    .await;
    wait_until("the job to start", LONG, || l.join("long").exists()).await;
    // Its guard frozen, the attempt cannot end: no step may start meanwhile.
    let guard = read_pids(&l.join("guard"))[0];
    let signal = |s| nix::sys::signal::kill(nix::unistd::Pid::from_raw(guard), s).unwrap();
    signal(nix::sys::signal::Signal::SIGSTOP);
    // Another writer records its result while it runs.
    let planted = serde_json::json!({
        "version": 2, "job_id": "long", "status": "FINISHED", "exit_code": 0,
        "attempts": 1, "failed_attempts": 0, "recoveries": 0, "submitted_at_ms": 1,
        "finished_at_ms": 2, "spec_hash": "x", "term": 1
    });
    etcd(&c)
        .await
        .put(
            "/baton/test/results/dirty/long",
            serde_json::to_vec(&planted).unwrap(),
            None,
        )
        .await
        .unwrap();
    wait_for("the stray entry to go", LONG, || async {
        (!present(&c, "registry/long").await).then_some(())
    })
    .await;
    holds_for(
        "no step to start while the attempt runs",
        Duration::from_millis(1500),
        || !l.join("step").exists(),
    )
    .await;
    signal(nix::sys::signal::Signal::SIGCONT);
    let j = c.wait_job(&[2], "long", LONG, "clean", clean).await;
    assert_eq!(state(&j), JobState::Finished);
    assert!(!present(&c, "registry/long").await);
    assert_eq!(lines(&l.join("long")).len(), 1, "the job ran once");
    assert_eq!(lines(&l.join("step")).len(), 1, "the step ran once");
    let entries = ledger(&led);
    let attempt_end = entries
        .iter()
        .find(|e| e.event == "end" && e.job_id == "long" && e.name.starts_with("attempt-"))
        .expect("the running attempt was stopped");
    let step_start = entries
        .iter()
        .find(|e| e.event == "start" && e.job_id == "long" && e.name.starts_with("cleanup-"))
        .expect("the step ran");
    assert!(
        attempt_end.boottime_ns <= step_start.boottime_ns,
        "the first step started before the stray attempt had ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_finishes_a_version_2_cleanup_an_older_one_gave_out() {
    let c = Cluster::start(opts(1, &[]));
    c.leader_index().await;
    c.wait_workers(&["r1"]).await;
    let (_t, l) = ledger_dir();
    let rev = worker_rev(&c, "r1").await;
    let runs = format!(
        "echo $BATON_CLEANUP_ATTEMPT $BATON_CLEANUP_STEP >> {}/runs",
        l.display()
    );
    let spec = serde_json::json!({
        "command": ["true"], "env": {}, "max_attempts": 3, "timeout": 60.0,
        "cleanup_command": ["sh", "-c", runs],
    });
    let record = serde_json::json!({
        "version": 1, "job_id": "legacy", "spec": spec, "spec_hash": "h",
        "submitted_at_ms": 1,
    });
    let dirty = serde_json::json!({
        "version": 2, "job_id": "legacy", "status": "FINISHED", "exit_code": 0,
        "attempts": 1, "failed_attempts": 0, "recoveries": 0, "submitted_at_ms": 1,
        "finished_at_ms": 2, "spec_hash": "h", "term": 1,
        "cleanup": {"stage": 0, "attempts": 2, "last_error": "exit 1",
            "assigned": {"worker": "r1", "worker_rev": rev, "worker_ttl_ms": 2500,
                "assign_timeout_ms": 10000, "step": "3"}},
    });
    let assignment = serde_json::json!({
        "version": 2, "kind": "cleanup", "job_id": "legacy", "attempt": 3,
        "spec": {"command": ["sh", "-c", runs], "env": {}, "max_attempts": 1, "timeout": 60.0},
        "term": 1,
    });
    let mut e = etcd(&c).await;
    e.put("/baton/test/jobs/legacy", record.to_string(), None)
        .await
        .unwrap();
    e.put(
        format!("/baton/test/assignments/r1/{rev}/cleanup/legacy"),
        assignment.to_string(),
        None,
    )
    .await
    .unwrap();
    e.put("/baton/test/results/dirty/legacy", dirty.to_string(), None)
        .await
        .unwrap();
    let j = c.wait_job(&[0], "legacy", LONG, "clean", clean).await;
    assert_eq!(
        lines(&l.join("runs")),
        ["3 command"],
        "the step given out by the older leader ran once, as its attempt 3"
    );
    let cl = j.cleanup.unwrap();
    assert_eq!(cl.attempts, 3);
    let stored: serde_json::Value = serde_json::from_slice(
        e.get("/baton/test/results/clean/legacy", None)
            .await
            .unwrap()
            .kvs()[0]
            .value(),
    )
    .unwrap();
    assert_eq!(
        stored["version"], 2,
        "still readable by the older release: {stored}"
    );
    assert!(stored["cleanup"].get("steps").is_none(), "{stored}");
}
