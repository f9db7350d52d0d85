//! `make modelcheck`: the protocol model with more faults than `make test` affords.
//!
//! `modelcheck [FAULTS] [THREADS] [SECONDS] [JOBS]`: with SECONDS (0: none), a random simulation
//! for that long (deep runs, not every state); without, an exhaustive breadth-first search (it
//! may take very long: two faults of any kinds were not exhausted within 5 minutes on 2 cores).
//! Faults may hit every replica and worker here; JOBS (default 1) jobs are submitted.
//!
//! `modelcheck replay FILE`: replays a drill's history (`baton drill --history FILE`) through
//! the model's etcd and invariants (see `baton_model::replay`); exit 1 on a finding, 2 when the
//! file cannot be read as a history.

use baton_model::{BatonModel, ALL_FAULTS};
use stateright::{Checker, Model, UniformChooser};

fn main() {
    if std::env::args().nth(1).as_deref() == Some("replay") {
        std::process::exit(replay(std::env::args().nth(2)));
    }
    let mut args = std::env::args().skip(1);
    let faults: u8 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    // stateright's timeout does not stop a single-threaded run.
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2).max(2);
    let seconds: Option<u64> = args.next().and_then(|a| a.parse().ok()).filter(|s| *s > 0);
    let jobs: u8 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let started = std::time::Instant::now();
    let model = BatonModel::new(2, 2, jobs)
        .with_faults(&ALL_FAULTS, faults)
        .everywhere();
    let builder = model.checker().threads(threads);
    match seconds {
        Some(s) => {
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs());
            println!("simulating {faults} fault(s) for {s} s, seed {seed}");
            let checker = builder
                .timeout(std::time::Duration::from_secs(s))
                .spawn_simulation(seed, UniformChooser)
                .join();
            report(&checker, faults, started);
        }
        None => {
            println!("exhausting {faults} fault(s) breadth-first");
            report(&builder.spawn_bfs().join(), faults, started);
        }
    }
}

fn report(checker: &impl Checker<BatonModel>, faults: u8, started: std::time::Instant) {
    println!(
        "{faults} fault(s): {} unique states, {} generated, in {:.1} s",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed().as_secs_f64()
    );
    checker.assert_properties();
    println!("every property holds");
}

fn replay(path: Option<String>) -> i32 {
    let Some(path) = path else {
        eprintln!("usage: modelcheck replay FILE");
        return 2;
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("modelcheck: reading {path}: {e}");
            return 2;
        }
    };
    match baton_model::replay::replay(&text) {
        Err(e) => {
            eprintln!("modelcheck: {path} is not a drill history: {e}");
            2
        }
        Ok((summary, findings)) => {
            println!("{summary:#?}");
            for f in &findings {
                println!("line {}: {}", f.line, f.what);
            }
            if findings.is_empty() {
                println!("every step enabled, every invariant held");
                0
            } else {
                println!("{} finding(s)", findings.len());
                1
            }
        }
    }
}
