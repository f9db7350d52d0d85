//! The lease guard on its own (`baton-guard`, the small program): it never starts a job whose
//! first deadline has passed, kills the job's whole process group at the deadline without a
//! renewal or as soon as its pipe closes, enforces the attempt timeout, records every
//! execution, is the job's direct parent, takes its job with it when it is killed, and tells a
//! command that cannot start from one that exits 127.

mod support;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton::clock::BootInstant;
use baton::exec::guard::{Spec, NOT_STARTED, PROTOCOL};
use baton::exec::program::{GuardKind, GuardProgram};
use baton::exec::record::{read_exit, KilledBy, LedgerEntry};
use support::{alive, guard_bin, line_count, read_pids, stat_field, wait_until};

fn spec(dir: &Path, timeout_ms: u64, command: &[&str]) -> Spec {
    Spec {
        protocol: PROTOCOL,
        job_id: "g".into(),
        attempt: 1,
        term: 7,
        dir: dir.to_path_buf(),
        name: "attempt-1".into(),
        margin_ms: 200,
        timeout_ms,
        kill_grace_ms: 1000,
        go_within_ms: 5000,
        ledger: None,
        nice: 0,
        parent_pid: None,
        unsafe_ignore_deadlines: false,
        nofile: None,
        command: command.iter().map(|s| s.to_string()).collect(),
    }
}

fn start(spec: &Spec) -> Child {
    start_with(Command::new(guard_bin()), spec)
}

/// Starts the guard as a worker does: through the descriptor of the program it opened.
fn start_as_worker(spec: &Spec) -> Child {
    let program = GuardProgram::open(std::path::Path::new(guard_bin()), GuardKind::Small).unwrap();
    let json = serde_json::to_string(spec).unwrap();
    let mut cmd = program.command(["run", json.as_str()]);
    let child = cmd
        .env("BATON_JOB_DIR", &spec.dir)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    // The child has exec'd (spawn returns after it), so the descriptor may close now.
    drop(program);
    child
}

fn start_with(mut cmd: Command, spec: &Spec) -> Child {
    cmd.arg("run")
        .arg(serde_json::to_string(spec).unwrap())
        .env("BATON_JOB_DIR", &spec.dir)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap()
}

fn guard(dir: &Path, timeout: &str, script: &str) -> Child {
    let ms = humantime::parse_duration(timeout).unwrap().as_millis() as u64;
    start(&spec(dir, ms, &["sh", "-c", script]))
}

fn feed(child: &mut Child, deadline: BootInstant) {
    let line = format!("D {}\n", deadline.as_nanos());
    child
        .stdin
        .as_mut()
        .unwrap()
        .write_all(line.as_bytes())
        .unwrap();
}

fn wait_exit(child: &mut Child) -> i32 {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the guard did not exit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until every process the job listed in `pids` is gone.
async fn all_die(pids: &Path) {
    for p in read_pids(pids) {
        wait_until(
            "every process of the job to die",
            Duration::from_secs(5),
            || !alive(p),
        )
        .await;
    }
}

const FAMILY: &str =
    "sleep 60 & echo $! >> $BATON_JOB_DIR/pids; echo $$ >> $BATON_JOB_DIR/pids; wait";

#[test]
fn a_job_whose_first_deadline_has_passed_never_starts() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "10s", "touch $BATON_JOB_DIR/ran");
    feed(&mut g, BootInstant::now() + Duration::from_millis(100));
    assert_eq!(wait_exit(&mut g), NOT_STARTED);
    assert!(!dir.path().join("ran").exists());
    assert!(read_exit(dir.path(), "attempt-1").is_none());
}

#[tokio::test]
async fn without_renewal_the_whole_group_dies_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "60s", FAMILY);
    let deadline = BootInstant::now() + Duration::from_millis(1500);
    feed(&mut g, deadline);
    let pids_file = dir.path().join("pids");
    wait_until(
        "the job and its child to start",
        Duration::from_secs(10),
        || read_pids(&pids_file).len() == 2,
    )
    .await;
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    assert_eq!(rec.killed_by, Some(KilledBy::Deadline));
    assert_eq!(rec.signal, Some(9));
    // Killed at deadline - margin, not later.
    assert!(
        rec.ended_boottime_ns <= (deadline + Duration::from_millis(300)).as_nanos(),
        "{rec:?}"
    );
    for p in read_pids(&pids_file) {
        wait_until("the grandchild to die too", Duration::from_secs(5), || {
            !alive(p)
        })
        .await;
    }
}

#[tokio::test]
async fn renewals_keep_the_job_alive_and_a_closed_pipe_kills_it_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "60s", FAMILY);
    let pids_file = dir.path().join("pids");
    feed(&mut g, BootInstant::now() + Duration::from_millis(800));
    wait_until("the job to start", Duration::from_secs(10), || {
        read_pids(&pids_file).len() == 2
    })
    .await;
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        feed(&mut g, BootInstant::now() + Duration::from_millis(800));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        g.try_wait().unwrap().is_none(),
        "renewed, yet the guard ended the job"
    );
    drop(g.stdin.take());
    let closed = Instant::now();
    assert_eq!(wait_exit(&mut g), 0);
    assert!(closed.elapsed() < Duration::from_secs(2));
    assert_eq!(
        read_exit(dir.path(), "attempt-1").unwrap().killed_by,
        Some(KilledBy::LeaderGone)
    );
    all_die(&pids_file).await;
}

/// Zombie children of `guard`, from /proc (by parent, so a reused pid cannot confuse it).
fn zombies_of(guard: i32) -> usize {
    let guard = guard.to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| {
            stat_field(p, 4).as_ref() == Some(&guard) && stat_field(p, 3).as_deref() == Some("Z")
        })
        .count()
}

/// Each inner shell exits at once, so its subshell is orphaned to the guard (the subreaper);
/// the subshell notes its end in `gone` as its last act.
const ORPHANS: &str =
    "for i in 1 2 3 4 5 6 7 8; do sh -c '(sleep 0.2; echo x >> $BATON_JOB_DIR/gone) &'; done";

#[tokio::test]
async fn orphans_the_job_leaves_behind_are_reaped_while_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!("{ORPHANS}; echo $$ > $BATON_JOB_DIR/job; sleep 60");
    let mut g = guard(dir.path(), "60s", &script);
    feed(&mut g, BootInstant::now() + Duration::from_secs(60));
    let gone = dir.path().join("gone");
    wait_until("every orphan to end", Duration::from_secs(10), || {
        line_count(&gone) == 8
    })
    .await;
    let guard_pid = g.id() as i32;
    wait_until(
        "the guard to reap the orphans while the job runs",
        Duration::from_secs(10),
        || zombies_of(guard_pid) == 0,
    )
    .await;
    let job = read_pids(&dir.path().join("job"))[0];
    assert!(alive(job), "the job itself must still run");
    assert!(g.try_wait().unwrap().is_none());
    drop(g.stdin.take());
    assert_eq!(wait_exit(&mut g), 0);
    assert_eq!(
        read_exit(dir.path(), "attempt-1").unwrap().killed_by,
        Some(KilledBy::LeaderGone)
    );
}

#[test]
fn a_job_that_exits_among_its_orphans_keeps_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    // The job ends only after its orphans did, so their zombies may still wait for the guard.
    let script = format!(
        "{ORPHANS}; until [ \"$(cat $BATON_JOB_DIR/gone 2>/dev/null | wc -l)\" -ge 8 ]; do sleep 0.02; done; exit 3"
    );
    let mut g = guard(dir.path(), "60s", &script);
    feed(&mut g, BootInstant::now() + Duration::from_secs(60));
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    assert_eq!((rec.exit_code, rec.killed_by), (Some(3), None));
    assert_eq!(line_count(&dir.path().join("gone")), 8);
}

#[test]
fn the_attempt_timeout_is_enforced_and_a_normal_exit_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "300ms", "sleep 30");
    feed(&mut g, BootInstant::now() + Duration::from_secs(30));
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    assert_eq!(rec.killed_by, Some(KilledBy::Timeout));

    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "30s", "echo hi; exit 5");
    feed(&mut g, BootInstant::now() + Duration::from_secs(30));
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    assert_eq!((rec.exit_code, rec.killed_by, rec.term), (Some(5), None, 7));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("attempt-1.log")).unwrap(),
        "hi\n"
    );
}

/// The job starts as a fresh process would: no signal blocked (the guard blocks some, and the
/// clone that starts the job blocks all) and SIGPIPE not ignored (Rust's runtime ignores it in
/// the guard), stdin from /dev/null, stdout and stderr to its log, none of the guard's own
/// descriptors, its folder as working directory, and a process group of its own.
#[test]
fn the_job_starts_with_a_clean_state_in_its_folder_and_its_own_group() {
    // What a job sees, from its log. A shell may reset its own signal mask: the signals are
    // read by `grep` started as the job itself.
    let job_log = |command: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut g = start(&spec(dir.path(), 10_000, command));
        // The guard's stdin pipe, as `/proc/<pid>/fd` names it (`pipe:[<inode>]`).
        let fd = std::os::fd::AsRawFd::as_raw_fd(g.stdin.as_ref().unwrap());
        let pipe = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
        feed(&mut g, BootInstant::now() + Duration::from_secs(30));
        assert_eq!(wait_exit(&mut g), 0);
        let rec = read_exit(dir.path(), "attempt-1").unwrap();
        assert_eq!((rec.exit_code, rec.start_error), (Some(0), None));
        let log_path = dir.path().canonicalize().unwrap().join("attempt-1.log");
        let log = std::fs::read_to_string(&log_path).unwrap();
        (log, log_path, pipe.display().to_string(), dir)
    };
    let field = |log: &str, name: &str| {
        log.lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {log}"))
            .trim()
            .to_string()
    };
    let (log, _, _, _dir) = job_log(&["grep", "-E", "^Sig(Blk|Ign):", "/proc/self/status"]);
    assert_eq!(field(&log, "SigBlk:"), "0000000000000000", "{log}");
    let ignored = u64::from_str_radix(&field(&log, "SigIgn:"), 16).unwrap();
    assert_eq!(ignored & (1 << (nix::libc::SIGPIPE - 1)), 0, "{log}");

    let script = "echo cwd $(pwd); set -- $(sed 's/.*) //' /proc/$$/stat); echo group $3 pid $$";
    let (log, _, _, dir) = job_log(&["sh", "-c", script]);
    let field = |name: &str| field(&log, name);
    assert_eq!(
        field("cwd "),
        dir.path().canonicalize().unwrap().display().to_string()
    );
    let group = field("group ");
    let mut f = group.split_whitespace();
    assert_eq!(f.next(), f.nth(1), "the job leads its own group: {log}");

    // The descriptors, listed by `ls` started as the job itself (a shell opens its own).
    let (log, log_path, pipe, _dir) = job_log(&["ls", "-l", "/proc/self/fd/"]);
    // `ls -l /proc/self/fd/`: `<n> -> <target>` per descriptor.
    let fds: Vec<(u32, &str)> = log
        .lines()
        .filter_map(|l| l.split_once(" -> "))
        .filter_map(|(l, target)| Some((l.rsplit(' ').next()?.parse().ok()?, target)))
        .collect();
    let log_target = log_path.display().to_string();
    assert!(fds.contains(&(0, "/dev/null")), "{log}");
    assert!(fds.contains(&(1, log_target.as_str())), "{log}");
    assert!(fds.contains(&(2, log_target.as_str())), "{log}");
    // Beyond 0-2 and `ls`'s own folder, only what the guard was given to pass on (this test
    // process's descriptors without close-on-exec: cargo's jobserver, say), never one of the
    // guard's own: its stdin pipe (and the copy it reads the feed from), its signalfd,
    // /dev/null or the log it opened for the job.
    assert!(pipe.starts_with("pipe:["), "{pipe}");
    let inherited = |n: u32, target: &str| {
        let ours = std::fs::read_link(format!("/proc/self/fd/{n}"))
            .is_ok_and(|t| t.display().to_string() == target);
        let flags = std::fs::read_to_string(format!("/proc/self/fdinfo/{n}")).unwrap_or_default();
        let cloexec = flags
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
            .is_none_or(|f| f & nix::libc::O_CLOEXEC as u32 != 0);
        ours && !cloexec && target != pipe
    };
    for (n, target) in fds.iter().filter(|(n, _)| *n > 2) {
        assert!(
            target.starts_with("/proc/") && target.ends_with("/fd") || inherited(*n, target),
            "descriptor {n} ({target}) of the job is not one the guard was given: {log}"
        );
        assert!(
            !target.contains("signalfd") && *target != log_target,
            "the guard's descriptor {n} ({target}) leaked into the job: {log}"
        );
    }
}

/// The job owns its folder: one that empties it (its log and the guard's pid file with it),
/// removes it, or leaves something of its own where the record is about to be written (a file,
/// a symlink, a FIFO, a folder), still gets its exit recorded (else a new leader would run a
/// finished job again), and nothing outside its folder is written.
#[test]
fn a_job_that_clears_its_folder_still_gets_its_exit_recorded() {
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, "untouched").unwrap();
    // Each job first waits for the guard's pid file, which is written after the job started.
    let wait = "until [ -s attempt-1.exit.tmp ]; do sleep 0.01; done";
    let tmp = "attempt-1.exit.tmp";
    for then in [
        "rm -rf ./* ./.[!.]*".to_string(),
        "cd /; rm -rf \"$BATON_JOB_DIR\"".to_string(),
        format!("rm -f {tmp}; echo not-a-record > {tmp}"),
        format!("rm -f {tmp}; ln -s {} {tmp}", victim.display()),
        format!("rm -f {tmp}; mkfifo {tmp}"),
        format!("rm -f {tmp}; mkdir {tmp}; touch {tmp}/x"),
    ] {
        let script = format!("{wait}; {then}; exit 4");
        let dir = tempfile::tempdir().unwrap();
        let mut g = guard(dir.path(), "10s", &script);
        feed(&mut g, BootInstant::now() + Duration::from_secs(30));
        assert_eq!(wait_exit(&mut g), 0, "{script}");
        let rec = read_exit(dir.path(), "attempt-1").expect(&script);
        assert_eq!((rec.exit_code, rec.killed_by), (Some(4), None), "{script}");
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "untouched",
            "{script}"
        );
    }
}

/// The parent-death signal follows the thread that spawned the guard (which is why Baton spawns
/// from one thread that lives as long as the process): when that thread ends, the guard kills
/// its job at once, even though its pipe is still open and its deadline far away.
#[tokio::test]
async fn a_guard_whose_spawning_thread_dies_kills_its_job() {
    let dir = tempfile::tempdir().unwrap();
    let pids_file = dir.path().join("pids");
    let (path, pids) = (dir.path().to_path_buf(), pids_file.clone());
    let mut g = std::thread::spawn(move || {
        let mut g = guard(&path, "60s", FAMILY);
        feed(&mut g, BootInstant::now() + Duration::from_secs(60));
        // The guard arms its parent-death signal before it starts the job.
        let until = Instant::now() + Duration::from_secs(10);
        while read_pids(&pids).len() < 2 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        g
    })
    .join()
    .unwrap();
    assert_eq!(read_pids(&pids_file).len(), 2, "the job did not start");
    assert_eq!(wait_exit(&mut g), 0);
    assert_eq!(
        read_exit(dir.path(), "attempt-1").unwrap().killed_by,
        Some(KilledBy::LeaderGone)
    );
    all_die(&pids_file).await;
}

/// `(ppid, nice)` of a process, from `/proc/<pid>/stat`.
fn parent_and_nice(pid: i32) -> (i32, i64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = stat.rsplit_once(')').unwrap().1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    (f[1].parse().unwrap(), f[16].parse().unwrap())
}

async fn job_pid(dir: &Path) -> i32 {
    let file = dir.join("pids");
    wait_until("the job to start", Duration::from_secs(10), || {
        !read_pids(&file).is_empty()
    })
    .await;
    read_pids(&file)[0]
}

#[tokio::test]
async fn the_job_runs_niced_as_the_direct_child_of_the_small_guard() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        nice: 10,
        ..spec(
            dir.path(),
            60_000,
            &["sh", "-c", "echo $$ > $BATON_JOB_DIR/pids; exec sleep 60"],
        )
    };
    // Through `/proc/self/fd/<n>`, as a worker starts it: the kernel would name the process
    // after the number; the guard names itself.
    let mut g = start_as_worker(&spec);
    feed(&mut g, BootInstant::now() + Duration::from_secs(60));
    let job = job_pid(dir.path()).await;
    let guard = g.id() as i32;
    let (parent, job_nice) = parent_and_nice(job);
    assert_eq!(parent, guard, "the job's parent is its guard");
    let exe = std::fs::read_link(format!("/proc/{guard}/exe")).unwrap();
    assert_eq!(exe.file_name().unwrap(), "baton-guard", "{exe:?}");
    let comm = std::fs::read_to_string(format!("/proc/{guard}/comm")).unwrap();
    assert_eq!(comm.trim(), "baton-guard");
    // As it ships (scripts/build-guard): statically linked, so no loader or shared library
    // is mapped into it.
    let maps = std::fs::read_to_string(format!("/proc/{guard}/maps")).unwrap();
    let shared: std::collections::BTreeSet<&str> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|path| {
            let name = path.rsplit('/').next().unwrap_or(path);
            name.ends_with(".so") || name.contains(".so.")
        })
        .collect();
    assert!(
        shared.is_empty(),
        "the guard maps shared objects: {shared:?}"
    );
    let (_, own_nice) = parent_and_nice(std::process::id() as i32);
    let (_, guard_nice) = parent_and_nice(guard);
    assert_eq!(
        guard_nice, own_nice,
        "the guard keeps its parent's priority"
    );
    assert_eq!(job_nice, 10.max(own_nice), "the job is niced");
    drop(g.stdin.take());
    assert_eq!(wait_exit(&mut g), 0);
}

#[tokio::test]
async fn a_sigkilled_guard_takes_its_job_within_100_ms() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(
        dir.path(),
        "60s",
        "echo $$ > $BATON_JOB_DIR/pids; exec sleep 60",
    );
    feed(&mut g, BootInstant::now() + Duration::from_secs(60));
    let job = job_pid(dir.path()).await;
    let job_fd = baton_guard::pidfd_open(job as u32).unwrap();
    g.kill().unwrap();
    g.wait().unwrap();
    // The guard's death is seen; its job must follow at once (its parent-death SIGKILL), not
    // at some later check.
    let dead = Instant::now();
    let mut fds = [nix::poll::PollFd::new(
        std::os::fd::AsFd::as_fd(&job_fd),
        nix::poll::PollFlags::POLLIN,
    )];
    let ready = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u8)).unwrap();
    assert_eq!(
        ready,
        1,
        "the job outlived its SIGKILLed guard by {:?}",
        dead.elapsed()
    );
    wait_until("the job to be gone", Duration::from_secs(5), || !alive(job)).await;
}

#[test]
fn a_command_that_cannot_start_is_a_start_error_not_an_exit_127() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = start(&spec(dir.path(), 10_000, &["/nonexistent/program", "x"]));
    feed(&mut g, BootInstant::now() + Duration::from_secs(30));
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    let err = rec.start_error.expect("a start error");
    assert_eq!(err.errno, Some(2), "{err:?}");
    assert!(err.message.contains("/nonexistent/program"), "{err:?}");
    assert_eq!((rec.exit_code, rec.signal), (None, None));

    let dir = tempfile::tempdir().unwrap();
    let mut g = guard(dir.path(), "10s", "exit 127");
    feed(&mut g, BootInstant::now() + Duration::from_secs(30));
    assert_eq!(wait_exit(&mut g), 0);
    let rec = read_exit(dir.path(), "attempt-1").unwrap();
    assert_eq!((rec.exit_code, rec.start_error), (Some(127), None));
}

#[test]
fn every_execution_leaves_a_start_and_an_end_line_in_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger.jsonl");
    let spec = Spec {
        ledger: Some(ledger.clone()),
        ..spec(
            dir.path(),
            10_000,
            &["sh", "-c", "echo $$ > $BATON_JOB_DIR/pids; exit 3"],
        )
    };
    let mut g = start(&spec);
    feed(&mut g, BootInstant::now() + Duration::from_secs(30));
    assert_eq!(wait_exit(&mut g), 0);
    let job = read_pids(&dir.path().join("pids"))[0];
    let lines: Vec<LedgerEntry> = std::fs::read_to_string(&ledger)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let events: Vec<(&str, i32, &str, i64)> = lines
        .iter()
        .map(|e| (e.event.as_str(), e.pid, e.job_id.as_str(), e.term))
        .collect();
    assert_eq!(events, [("start", job, "g", 7), ("end", job, "g", 7)]);
    assert!(lines[0].boottime_ns <= lines[1].boottime_ns);
    assert_eq!(lines[1].exit.as_ref().unwrap().exit_code, Some(3));
}

#[test]
fn the_guard_answers_its_protocol_and_refuses_a_bad_spec() {
    for (bin, pre) in [(guard_bin(), None), (support::BIN, Some("__guard"))] {
        let out = Command::new(bin)
            .args(pre)
            .arg("protocol")
            .output()
            .unwrap();
        assert!(out.status.success(), "{bin}: {out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            PROTOCOL.to_string()
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let bad = serde_json::to_string(&Spec {
        protocol: PROTOCOL + 1,
        ..spec(&dir.path().join("job"), 1000, &["touch", "ran"])
    })
    .unwrap();
    let out = Command::new(guard_bin())
        .args(["run", &bad])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(baton::exec::guard::GUARD_FAILED));
    assert!(String::from_utf8_lossy(&out.stderr).contains("protocol"));
    assert!(
        !dir.path().join("job").exists(),
        "a refused spec touched nothing"
    );
}
