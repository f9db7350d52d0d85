//! `baton dev`: a private etcd, N replicas (each with an embedded worker) and M separate
//! workers in one command, with a demo job on a separate worker; stopped cleanly on Ctrl-C.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;

use super::{free_port, EtcdCluster, ReplicaProcess, ReplicaSpec};
use crate::config::{ClientArgs, DevArgs, Output};
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::GetLeaderRequest;

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let bin = std::env::current_exe().context("locating the baton binary")?;
    let (_tmp, dir) =
        super::workdir(args.dir.as_deref(), "baton-dev-").context("creating a temporary folder")?;
    let mut etcd = EtcdCluster::start(&args.etcd_bin, &dir.join("etcd"), 1)?;
    println!(
        "etcd:     {} (data in {})",
        etcd.endpoints().join(","),
        etcd.dir().display()
    );

    let storage = dir.join("storage");
    let port_for = |n: u16| -> anyhow::Result<SocketAddr> {
        let port = if args.base_port == 0 {
            free_port()
        } else {
            args.base_port + n
        };
        let listen: SocketAddr = ([127, 0, 0, 1], port).into();
        std::net::TcpListener::bind(listen).with_context(|| {
            format!("port {port} is taken; pass --base-port 0 to pick free ports")
        })?;
        Ok(listen)
    };
    let spec = |id: String,
                listen: SocketAddr,
                metrics: SocketAddr,
                http: Option<SocketAddr>,
                worker: bool| {
        // A short drain, so Ctrl-C stops everything in seconds.
        let mut extra = vec![
            "--storage-dir".into(),
            storage.join(&id).display().to_string(),
            "--drain-timeout".into(),
            "5s".into(),
            "--metrics-listen".into(),
            metrics.to_string(),
        ];
        if worker {
            extra.extend(["--labels".into(), "pool=workers".into()]);
        }
        if let Some(h) = http {
            extra.extend(["--http-listen".into(), h.to_string()]);
        }
        ReplicaSpec {
            id,
            bin: bin.clone(),
            etcd_endpoints: etcd.endpoints(),
            cluster: "dev".into(),
            listen,
            lease_ttl: args.lease_ttl,
            dir: dir.join("replicas"),
            extra_args: extra,
            worker,
        }
    };
    let mut replicas = Vec::new();
    let mut consoles = Vec::new();
    for i in 0..args.replicas.max(1) {
        let listen = port_for(i as u16)?;
        let metrics = port_for(200 + i as u16)?;
        let http = port_for(400 + i as u16)?;
        let id = format!("replica-{}", i + 1);
        let r = ReplicaProcess::spawn(spec(id, listen, metrics, Some(http), false))
            .context("starting a replica")?;
        println!(
            "{}: {} (console http://{http}/; metrics http://{metrics}/metrics; log {})",
            r.id(),
            listen,
            r.log_path().display()
        );
        consoles.push(http);
        replicas.push(r);
    }
    for i in 0..args.workers {
        let listen = port_for(100 + i as u16)?;
        let metrics = port_for(300 + i as u16)?;
        let w = ReplicaProcess::spawn(spec(
            format!("worker-{}", i + 1),
            listen,
            metrics,
            None,
            true,
        ))
        .context("starting a worker")?;
        println!(
            "{}: {} (separate worker, pool=workers; metrics http://{metrics}/metrics; log {})",
            w.id(),
            listen,
            w.log_path().display()
        );
        replicas.push(w);
    }
    let endpoints: Vec<String> = replicas
        .iter()
        .filter(|r| !r.spec().worker)
        .map(|r| r.listen().to_string())
        .collect();
    let client = ClientArgs {
        endpoints: endpoints.clone(),
        timeout: Duration::from_secs(10),
        output: Output::Text,
        security: Default::default(),
    };
    let poll = ClientArgs {
        timeout: Duration::from_secs(2),
        ..client.clone()
    };
    let eps = endpoints.join(",");
    // The binary's own path, so the commands work as printed without `baton` on PATH.
    let b = bin.display();
    if let Some(c) = consoles.first() {
        println!("\nconsole: http://{c}/");
        println!("      curl -s http://{c}/api/v1/leader");
    }
    println!("\ntry:  {b} leader get --endpoints {eps}");
    println!("      {b} worker list --endpoints {eps}");
    if args.workers > 0 && !args.no_demo {
        match demo(&client).await {
            Ok(on) => {
                println!("      {b} job logs -f demo --endpoints {eps}    (running on {on})");
                println!("      {b} job get demo --endpoints {eps}");
            }
            Err(e) => println!("(the demo job could not be submitted: {e:#})"),
        }
    }
    println!(
        "      {b} schedule create every-minute --cron '* * * * *' --endpoints {eps} -- sh -c 'echo tick $BATON_SCHEDULED_TIME'"
    );
    println!("      {b} schedule get every-minute --endpoints {eps}");
    println!("(`cargo install --path .` puts `baton` on your PATH)");
    println!("stop: Ctrl-C\n");

    let mut shown: Option<(String, i64)> = None;
    let mut ticker = tokio::time::interval(Duration::from_millis(250));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = ticker.tick() => {
                for r in replicas.iter_mut() {
                    if let Some(status) = r.try_exit() {
                        println!("{} exited unexpectedly ({status}); see {}", r.id(), r.log_path().display());
                        r.restart()?;
                    }
                }
                if let Ok(l) = leader(&poll).await {
                    if shown.as_ref() != Some(&(l.0.clone(), l.1)) {
                        println!("leader: {} (term {})", l.0, l.1);
                        shown = Some(l);
                    }
                }
            }
        }
    }
    println!("\nstopping replicas...");
    for r in &replicas {
        r.sigterm();
    }
    for r in replicas.iter_mut() {
        r.stop(Duration::from_secs(15));
    }
    etcd.stop();
    println!("stopped");
    Ok(())
}

/// A job that runs on a separate worker (its selector) for a minute, printing as it goes;
/// returns the worker it runs on.
async fn demo(c: &ClientArgs) -> anyhow::Result<String> {
    use crate::proto::JobSpec;
    let spec = JobSpec {
        command: vec![
            "sh".into(),
            "-c".into(),
            "i=1; while [ $i -le 60 ]; do echo \"demo on $BATON_WORKER: $i\"; i=$((i+1)); sleep 1; done"
                .into(),
        ],
        worker_selector: [("pool".to_string(), "workers".to_string())].into(),
        ..Default::default()
    };
    crate::cli::jobs::submit_spec(c, "demo", spec).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let job = crate::cli::jobs::get_job(c, "demo").await?;
        if !job.worker.is_empty() {
            return Ok(job.worker);
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("it did not start within 30s: {}", job.waiting_reason);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn leader(c: &ClientArgs) -> anyhow::Result<(String, i64)> {
    crate::cli::call_any(c, |ch| async move {
        let l = ClusterServiceClient::new(ch)
            .get_leader(GetLeaderRequest {})
            .await?
            .into_inner()
            .leader
            .unwrap_or_default();
        Ok((l.replica_id, l.term))
    })
    .await
}
