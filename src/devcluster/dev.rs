//! `baton dev`: a private etcd and N replicas in one command, stopped cleanly on Ctrl-C.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;

use super::{free_port, EtcdCluster, ReplicaProcess, ReplicaSpec};
use crate::config::{ClientArgs, DevArgs, Output};
use crate::proto::cluster_service_client::ClusterServiceClient;
use crate::proto::GetLeaderRequest;

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let bin = std::env::current_exe().context("locating the baton binary")?;
    let (_tmp, dir) = match &args.dir {
        Some(d) => (None, d.clone()),
        None => {
            let t = tempfile::Builder::new()
                .prefix("baton-dev-")
                .tempdir()
                .context("creating a temporary folder")?;
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    };
    let mut etcd = EtcdCluster::start(&args.etcd_bin, &dir.join("etcd"), 1)?;
    println!(
        "etcd:     {} (data in {})",
        etcd.endpoints().join(","),
        etcd.dir().display()
    );

    let mut replicas = Vec::new();
    for i in 0..args.replicas.max(1) {
        let port = if args.base_port == 0 {
            free_port()
        } else {
            args.base_port + i as u16
        };
        let listen: SocketAddr = ([127, 0, 0, 1], port).into();
        std::net::TcpListener::bind(listen).with_context(|| {
            format!("port {port} is taken; pass --base-port 0 to pick free ports")
        })?;
        let spec = ReplicaSpec {
            id: format!("replica-{}", i + 1),
            bin: bin.clone(),
            etcd_endpoints: etcd.endpoints(),
            cluster: "dev".into(),
            listen,
            lease_ttl: args.lease_ttl,
            dir: dir.join("replicas"),
            extra_args: vec![
                "--storage-dir".into(),
                dir.join("storage").display().to_string(),
            ],
            worker: false,
        };
        let r = ReplicaProcess::spawn(spec).context("starting a replica")?;
        println!("{}: {} (log {})", r.id(), listen, r.log_path().display());
        replicas.push(r);
    }
    let endpoints: Vec<String> = replicas.iter().map(|r| r.listen().to_string()).collect();
    println!(
        "\ntry:  baton leader get --endpoints {}",
        endpoints.join(",")
    );
    println!("stop: Ctrl-C\n");

    let client = ClientArgs {
        endpoints,
        timeout: Duration::from_secs(2),
        output: Output::Text,
    };
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
                if let Ok(l) = leader(&client).await {
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
