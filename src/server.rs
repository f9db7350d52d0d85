//! `baton serve`: one replica. Wires etcd, the election, the API and signals together.
//!
//! Shutdown order on SIGTERM/SIGINT: the election ends its term (leader work stops, resign,
//! lease revoked), then the embedded worker drains (no new jobs; running ones get
//! `--drain-timeout`, then are recorded `preempted`, so the leader reschedules them at once)
//! and revokes its lease, then the API drains, then the process
//! exits 0. The next replica takes over as soon as the resign lands, not a TTL later.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::api::{self, ClusterApi, FleetApi, JobApi, ScheduleApi, Services};
use crate::config::{ConfigError, ServeArgs};
use crate::config::{EtcdArgs, RunArgs, WorkerArgs};
use crate::coordinator::{self, CleanupConfig, CoordinatorConfig};
use crate::election::{self, ElectionConfig, Role};
use crate::exec::program::GuardProgram;
use crate::exec::spawner::GuardSettings;
use crate::security::Security;
use crate::store::{self, Keys, Store};
use crate::worker::{self, WorkerConfig, WorkerLogs};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Etcd(#[from] store::Error),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the gRPC server failed")]
    Serve(#[from] tonic::transport::Error),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("cannot use --storage-dir {0}")]
    Storage(std::path::PathBuf, #[source] std::io::Error),
    #[error("the election task failed: {0}")]
    Crashed(String),
    #[error("security settings: {0}")]
    Security(String),
    #[error("cannot find the guard binary next to baton")]
    GuardBinary(#[source] std::io::Error),
    #[error(transparent)]
    GuardProgram(#[from] crate::exec::program::ProgramError),
    #[error(transparent)]
    Descriptors(#[from] crate::worker::descriptors::TooFew),
}

pub async fn run(args: ServeArgs) -> Result<(), Error> {
    args.validate()?;
    crate::schedule::clock::set_offset_ms(args.test_clock_offset_ms);
    let security = Security::load(&args.security).map_err(Error::Security)?;
    // Before etcd is reached, so a process stuck waiting for it can be seen.
    let ready = api::Ready::default();
    serve_metrics(args.metrics_listen, ready.clone()).await?;
    let replica_id = args.replica_id();
    let Opened {
        keys,
        store,
        storage_dir,
        guard_bin,
        job_nofile,
        listener,
    } = open(&args.etcd, &args.cluster, &args.run, args.listen).await?;
    let http_listener = match args.http.http_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Listen { addr, source })?,
        ),
        None => None,
    };

    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone())?;
    let (role_tx, role_rx) = watch::channel(Role::Follower);
    let (cmd_tx, cmd_rx) = mpsc::channel(16);
    let config = ElectionConfig {
        replica_id: replica_id.clone(),
        advertise: args.advertise(),
        ttl: args.lease_ttl,
        margin: args.margin(),
        work_grace: args.shutdown_grace,
    };
    tracing::info!(
        replica = %replica_id,
        cluster = %args.cluster,
        ttl = ?config.ttl,
        margin = ?config.margin,
        advertise = %config.advertise,
        "replica starting"
    );
    let guard = guard_settings(&args.run, guard_bin, job_nofile, config.margin);
    let coordinator_config = CoordinatorConfig {
        replica_id: replica_id.clone(),
        storage_dir: storage_dir.clone(),
        max_starts_per_second: args.max_starts_per_second,
        max_recoveries: args.max_recoveries,
        retry_initial: args.retry_initial_delay,
        retry_max: args.retry_max_delay,
        cleanup: CleanupConfig {
            policy: args.cleanup_policy()?,
            concurrency: args.cleanup_concurrency,
            timeout: args.cleanup_timeout,
            retention: args.result_retention,
            pause_after_stage: args.cleanup_pause_after_stage,
            pause_after_step: args.test_cleanup_pause_after_step.clone(),
        },
        pause_before_assign: args.test_pause_before_assign.clone(),
    };
    tokio::spawn(coordinator::run(
        store.clone(),
        keys.clone(),
        coordinator_config,
        role_rx.clone(),
    ));
    let election = tokio::spawn(election::run(
        store.clone(),
        keys.clone(),
        config,
        role_tx,
        cmd_rx,
        shutdown.clone(),
    ));
    let worker_stop = CancellationToken::new();
    let embedded = args.worker.then(|| {
        let cfg = worker_config(
            &replica_id,
            args.advertise(),
            &args.run,
            &storage_dir,
            guard,
            args.lease_ttl,
        );
        tokio::spawn(worker::run(
            store.clone(),
            keys.clone(),
            cfg,
            worker_stop.clone(),
        ))
    });
    tokio::spawn(election::observe(
        store.clone(),
        keys.clone(),
        shutdown.clone(),
    ));
    fast_failover(
        &args,
        &replica_id,
        &store,
        &keys,
        &security,
        &role_rx,
        &shutdown,
    )
    .await;
    let api_stop = CancellationToken::new();
    let jobs = JobApi::new(
        store.clone(),
        keys.clone(),
        replica_id.clone(),
        security.peer.clone(),
    );
    let fleet = FleetApi::new(store.clone(), keys.clone(), replica_id.clone());
    let schedules = ScheduleApi::new(
        store.clone(),
        keys.clone(),
        replica_id.clone(),
        crate::schedule::service::Retention {
            results: args.result_retention,
        },
    );
    let cluster = ClusterApi::new(
        store.clone(),
        keys.clone(),
        replica_id.clone(),
        role_rx,
        cmd_tx,
        security.peer.clone(),
    );
    let services = Services {
        store: store.clone(),
        probe_key: keys.prefix().to_string(),
        jobs,
        fleet,
        schedules,
        cluster,
        worker: args
            .worker
            .then(|| WorkerLogs::new(replica_id.clone(), storage_dir)),
        security,
        ready,
    };
    let http_server = http_listener.map(|l| {
        let s = crate::http::HttpServices::new(
            &services,
            keys.clone(),
            replica_id.clone(),
            args.advertise(),
            args.http.clone(),
            api_stop.clone(),
        );
        tokio::spawn(crate::http::serve(l, s))
    });
    let server = tokio::spawn(api::serve(
        listener,
        services,
        shutdown.clone(),
        api_stop.clone(),
    ));

    let finished = election.await;
    worker_stop.cancel();
    if let Some(w) = embedded {
        let _ = w.await;
    }
    api_stop.cancel();
    match tokio::time::timeout(Duration::from_secs(5), server).await {
        Ok(Ok(r)) => r?,
        Ok(Err(_)) | Err(_) => tracing::warn!("API did not drain in time"),
    }
    if let Some(h) = http_server {
        match tokio::time::timeout(Duration::from_secs(5), h).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the HTTP listener failed"),
            Ok(_) => {}
            Err(_) => tracing::warn!("HTTP API did not drain in time"),
        }
    }
    if let Err(e) = finished {
        return Err(Error::Crashed(e.to_string()));
    }
    tracing::info!(replica = %replica_id, "replica stopped");
    Ok(())
}

/// Starts the follower's side of fast failover, unless it is off or this replica's advertise
/// address gives followers no one socket to test (then it is off, with a warning). A name that
/// does not resolve yet (DNS not propagated at start) does not turn it off.
async fn fast_failover(
    args: &ServeArgs,
    replica_id: &str,
    store: &Store,
    keys: &Keys,
    security: &Security,
    role: &watch::Receiver<Role>,
    shutdown: &CancellationToken,
) {
    if !args.fast_failover {
        tracing::info!("fast failover is off (--fast-failover false): a dead leader is replaced when its lease expires");
        return;
    }
    match crate::failover::target::resolve(&args.advertise()).await {
        Ok(_) => {}
        Err(e @ crate::failover::target::NotSpecific::Unresolved(..)) => {
            tracing::warn!(error = %e, "the advertise address does not resolve yet; other replicas cannot watch this one until it does");
        }
        Err(e) => {
            tracing::warn!(error = %e, "fast failover is off: set --advertise to one specific address to have a dead leader replaced in milliseconds");
            return;
        }
    }
    let config = crate::failover::Config {
        replica_id: replica_id.to_string(),
        ttl: args.lease_ttl,
        peer: security.peer.clone(),
    };
    tokio::spawn(crate::failover::run(
        store.clone(),
        keys.clone(),
        config,
        role.clone(),
        shutdown.clone(),
    ));
}

/// What both `serve` and `worker` need before they start: etcd reached, the scratch folder,
/// the guard binary, the listener.
struct Opened {
    keys: Keys,
    store: Store,
    storage_dir: std::path::PathBuf,
    guard_bin: Arc<GuardProgram>,
    /// The jobs' soft descriptor limit (the process's before the worker raised it).
    job_nofile: u64,
    listener: TcpListener,
}

async fn open(
    etcd: &EtcdArgs,
    cluster: &str,
    run: &RunArgs,
    listen: std::net::SocketAddr,
) -> Result<Opened, Error> {
    // A worker that could not run its jobs says so before it reaches for etcd.
    let nofile = worker::descriptors::hold(run.max_running, run.max_cleanups)?;
    tracing::debug!(
        limit = nofile.limit,
        jobs = nofile.original,
        "descriptor limits"
    );
    let guard_bin = guard_program(run).await?;
    let keys = Keys::new(cluster);
    let store = Store::connect(etcd.etcd_config()?).await?;
    store
        .wait_reachable(keys.prefix(), etcd.startup_timeout)
        .await?;
    let storage_dir = storage_dir(run)?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| Error::Listen {
            addr: listen,
            source,
        })?;
    Ok(Opened {
        keys,
        store,
        storage_dir,
        guard_bin,
        job_nofile: nofile.original,
        listener,
    })
}

/// Binds `--metrics-listen`, if given, and serves `/metrics`, `/livez` and `/readyz` there for
/// the process's life.
async fn serve_metrics(
    listen: Option<std::net::SocketAddr>,
    ready: api::Ready,
) -> Result<(), Error> {
    let Some(addr) = listen else { return Ok(()) };
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Listen { addr, source })?;
    tokio::spawn(async move {
        if let Err(e) = api::serve_metrics(listener, ready).await {
            tracing::error!(error = %e, "the metrics server failed");
        }
    });
    Ok(())
}

fn storage_dir(run: &RunArgs) -> Result<std::path::PathBuf, Error> {
    let dir = &run.storage_dir;
    std::fs::create_dir_all(dir).map_err(|e| Error::Storage(dir.clone(), e))?;
    worker::folders::prepare(dir);
    std::fs::canonicalize(dir).map_err(|e| Error::Storage(dir.clone(), e))
}

fn worker_config(
    id: &str,
    advertise: String,
    run: &RunArgs,
    storage_dir: &std::path::Path,
    guard: GuardSettings,
    lease_ttl: Duration,
) -> WorkerConfig {
    WorkerConfig {
        worker_id: id.to_string(),
        advertise,
        capacity: run.max_running,
        max_cleanups: run.max_cleanups,
        labels: run.labels(),
        storage_dir: storage_dir.to_path_buf(),
        guard,
        lease_ttl,
        assign_timeout: run.assign_timeout,
        drain_timeout: run.drain_timeout,
    }
}

/// Opens and checks the guard program `run` names (see [`GuardProgram`]).
async fn guard_program(run: &RunArgs) -> Result<Arc<GuardProgram>, Error> {
    let path = match &run.guard_bin {
        Some(p) => p.clone(),
        None => GuardProgram::default_path(run.guard).map_err(Error::GuardBinary)?,
    };
    let kind = run.guard;
    let program = tokio::task::spawn_blocking(move || GuardProgram::open(&path, kind))
        .await
        .map_err(|e| Error::Crashed(e.to_string()))??;
    tracing::info!(guard = %program.path().display(), kind = ?program.kind(), "guard program checked");
    Ok(Arc::new(program))
}

fn guard_settings(
    run: &RunArgs,
    program: Arc<GuardProgram>,
    job_nofile: u64,
    margin: Duration,
) -> GuardSettings {
    GuardSettings {
        program,
        job_nofile: Some(job_nofile),
        margin,
        kill_grace: run.kill_grace,
        nice: run.job_nice,
        ledger: run.execution_ledger.clone(),
        unsafe_ignore_deadlines: run.unsafe_ignore_guard_deadlines,
    }
}

/// `baton worker`: runs assigned jobs until SIGTERM/SIGINT, then drains (running jobs get
/// `--drain-timeout`, the rest are preempted), revokes its lease and returns.
pub async fn run_worker(args: WorkerArgs) -> Result<(), Error> {
    args.validate()?;
    let security = Security::load(&args.security).map_err(Error::Security)?;
    let ready = api::Ready::default();
    serve_metrics(args.metrics_listen, ready.clone()).await?;
    let Opened {
        keys,
        store,
        storage_dir,
        guard_bin,
        job_nofile,
        listener,
    } = open(&args.etcd, &args.cluster, &args.run, args.listen).await?;
    let worker_id = args.worker_id();
    let advertise = args.advertise();
    let guard = guard_settings(&args.run, guard_bin, job_nofile, args.margin());
    let cfg = worker_config(
        &worker_id,
        advertise,
        &args.run,
        &storage_dir,
        guard,
        args.lease_ttl,
    );
    tracing::info!(worker = %worker_id, cluster = %args.cluster, capacity = cfg.capacity, "worker starting");
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone())?;
    let api_stop = CancellationToken::new();
    let logs = WorkerLogs::new(worker_id.clone(), storage_dir);
    let services = api::WorkerServices {
        logs,
        store: store.clone(),
        probe_key: keys.prefix().to_string(),
        security,
        ready,
    };
    let health = tokio::spawn(api::serve_worker(
        listener,
        services,
        shutdown.clone(),
        api_stop.clone(),
    ));
    worker::run(store, keys, cfg, shutdown).await;
    api_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), health).await;
    Ok(())
}

fn spawn_signal_handler(shutdown: CancellationToken) -> Result<(), Error> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(Error::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(Error::Signals)?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down: handing over leadership");
        shutdown.cancel();
        // A second signal means "now": exit at once; the guards' pipes close and they kill
        // the jobs, and the lease expires.
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::warn!("second signal: exiting without finishing the handover");
        std::process::exit(1);
    });
    Ok(())
}
