//! Security: TLS (with rotation), mTLS, tokens and roles on a leader, a follower and a
//! worker, the CLI's options, etcd with TLS and a prefix-limited user, and the refusal to
//! listen beyond loopback unprotected.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use baton::proto::cluster_service_client::ClusterServiceClient;
use baton::proto::fleet_service_client::FleetServiceClient;
use baton::proto::job_service_client::JobServiceClient;
use baton::proto::worker_service_client::WorkerServiceClient;
use baton::proto::{
    CancelJobRequest, GetJobLogsRequest, GetJobRequest, GetLeaderRequest, ListJobsRequest,
    ListWorkersRequest, ReadLogRequest, ResignLeadershipRequest, RetryCleanupRequest,
    SubmitJobRequest, UndrainWorkerRequest,
};
use baton::security::{AuthChannel, Bearer, ClientSecurity, ClientTlsFiles};
use support::pki::*;
use support::*;
use tonic::Code;

async fn conn(
    addr: &str,
    token: Option<&str>,
    tls: Option<ClientTlsFiles>,
) -> Result<AuthChannel, String> {
    let dir = tempfile::tempdir().unwrap();
    let bearer = match token {
        Some(t) => Bearer::from_file(&write(dir.path(), "t", t)).unwrap(),
        None => Bearer::default(),
    };
    let sec = ClientSecurity {
        tls: tls.map(|f| f.config().unwrap()).unwrap_or_default(),
        bearer,
    };
    sec.connect(addr, Duration::from_secs(2), Duration::from_secs(10))
        .await
}

async fn chan(addr: &str, token: Option<&str>) -> AuthChannel {
    conn(addr, token, None).await.unwrap()
}

fn code<T>(r: Result<tonic::Response<T>, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// Which replica leads, asked with the admin token.
async fn leader(c: &Cluster) -> (usize, i64) {
    wait_for("a leader", Duration::from_secs(30), || async {
        let ch = conn(&c.replicas[0].listen().to_string(), Some(READ), None)
            .await
            .ok()?;
        let l = ClusterServiceClient::new(ch)
            .get_leader(GetLeaderRequest {})
            .await
            .ok()?
            .into_inner()
            .leader?;
        Some((c.index_of(&l.replica_id), l.term))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_give_each_role_its_calls_on_the_leader_a_follower_and_a_worker() {
    let secrets = tempfile::tempdir().unwrap();
    let file = tokens(secrets.path());
    let f = file.display().to_string();
    let peer = secrets.path().join("peer.token").display().to_string();
    let c = Cluster::start(Options {
        replicas: 2,
        workers: 1,
        embedded: false,
        extra_args: vec![
            "--auth-tokens-file".into(),
            f.clone(),
            "--peer-token-file".into(),
            peer,
        ],
        worker_args: vec!["--auth-tokens-file".into(), f],
        ..Options::default()
    });
    let (li, _) = leader(&c).await;
    let fi = 1 - li;
    c.wait_workers(&["w1"]).await;

    for (i, who) in [(li, "leader"), (fi, "follower")] {
        let addr = c.replicas[i].listen().to_string();
        // Health is open; everything else needs a token.
        let mut health =
            tonic_health::pb::health_client::HealthClient::new(chan(&addr, None).await);
        let h = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await;
        assert_eq!(code(h), Code::Ok, "{who}: health");
        let get = |t: Option<&'static str>| {
            let addr = addr.clone();
            async move {
                let mut j = JobServiceClient::new(chan(&addr, t).await);
                code(j.list_jobs(ListJobsRequest::default()).await)
            }
        };
        assert_eq!(get(None).await, Code::Unauthenticated, "{who}: no token");
        assert_eq!(
            get(Some("wrong-token-0123456789")).await,
            Code::Unauthenticated,
            "{who}: wrong token"
        );
        for t in [READ, SUBMIT, ADMIN] {
            assert_eq!(get(Some(t)).await, Code::Ok, "{who}: list with {t}");
        }
        let submit = |t: &'static str, id: String| {
            let addr = addr.clone();
            async move {
                let mut j = JobServiceClient::new(chan(&addr, Some(t)).await);
                code(
                    j.submit_job(SubmitJobRequest {
                        job_id: id,
                        spec: Some(sh("echo hello-from-the-job")),
                    })
                    .await,
                )
            }
        };
        assert_eq!(
            submit(READ, format!("{who}-r")).await,
            Code::PermissionDenied,
            "{who}"
        );
        assert_eq!(submit(SUBMIT, format!("{who}-s")).await, Code::Ok, "{who}");
        assert_eq!(submit(ADMIN, format!("{who}-a")).await, Code::Ok, "{who}");
        let mut j = JobServiceClient::new(chan(&addr, Some(SUBMIT)).await);
        let job = j
            .get_job(GetJobRequest {
                job_id: format!("{who}-s"),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(job.submitted_by, "ci", "{who}: the submitter is recorded");
        let cancel = |t: &'static str| {
            let addr = addr.clone();
            async move {
                let mut j = JobServiceClient::new(chan(&addr, Some(t)).await);
                code(
                    j.cancel_job(CancelJobRequest {
                        job_id: "nope".into(),
                    })
                    .await,
                )
            }
        };
        // Allowed through to the handler, which knows no such job.
        assert_eq!(cancel(READ).await, Code::PermissionDenied, "{who}");
        assert_eq!(cancel(SUBMIT).await, Code::NotFound, "{who}");
        let retry = |t: &'static str| {
            let addr = addr.clone();
            async move {
                let mut j = JobServiceClient::new(chan(&addr, Some(t)).await);
                code(
                    j.retry_cleanup(RetryCleanupRequest {
                        job_id: "nope".into(),
                    })
                    .await,
                )
            }
        };
        assert_eq!(retry(SUBMIT).await, Code::PermissionDenied, "{who}");
        assert_eq!(retry(ADMIN).await, Code::NotFound, "{who}");
        let mut fleet = FleetServiceClient::new(chan(&addr, Some(READ)).await);
        assert_eq!(
            code(fleet.list_workers(ListWorkersRequest::default()).await),
            Code::Ok
        );
        let undrain = |t: &'static str| {
            let addr = addr.clone();
            async move {
                let mut f = FleetServiceClient::new(chan(&addr, Some(t)).await);
                code(
                    f.undrain_worker(UndrainWorkerRequest {
                        worker_id: "w1".into(),
                    })
                    .await,
                )
            }
        };
        assert_eq!(undrain(SUBMIT).await, Code::PermissionDenied, "{who}");
        assert_eq!(undrain(ADMIN).await, Code::Ok, "{who}");
        let mut cl = ClusterServiceClient::new(chan(&addr, Some(SUBMIT)).await);
        assert_eq!(
            code(
                cl.resign_leadership(ResignLeadershipRequest { term: 0 })
                    .await
            ),
            Code::PermissionDenied,
            "{who}"
        );
    }

    // The job ran on the worker; its output comes through a replica, which called the
    // worker with its own peer token.
    let addr = c.replicas[fi].listen().to_string();
    let logs = wait_for(
        "the job's output through a follower",
        Duration::from_secs(60),
        || {
            let addr = addr.clone();
            async move {
                let mut j = JobServiceClient::new(chan(&addr, Some(READ)).await);
                let r = j
                    .get_job_logs(GetJobLogsRequest {
                        job_id: "follower-s".into(),
                        ..Default::default()
                    })
                    .await
                    .ok()?
                    .into_inner();
                let text = String::from_utf8_lossy(&r.content).into_owned();
                text.contains("hello-from-the-job").then_some(text)
            }
        },
    )
    .await;
    assert!(logs.contains("hello-from-the-job"));

    // The worker's own service: admin (coordinators) only.
    let waddr = c.workers[0].listen().to_string();
    let read_log = |t: Option<&'static str>| {
        let waddr = waddr.clone();
        async move {
            let mut w = WorkerServiceClient::new(chan(&waddr, t).await);
            code(
                w.read_log(ReadLogRequest {
                    job_id: "follower-s".into(),
                    attempt: 1,
                    offset: 0,
                    max_bytes: 1024,
                    worker_id: "w1".into(),
                })
                .await,
            )
        }
    };
    assert_eq!(read_log(None).await, Code::Unauthenticated);
    assert_eq!(read_log(Some(SUBMIT)).await, Code::PermissionDenied);
    assert_eq!(read_log(Some(PEER)).await, Code::Ok);

    // Admin resigns the leader.
    let mut cl =
        ClusterServiceClient::new(chan(&c.replicas[li].listen().to_string(), Some(ADMIN)).await);
    assert_eq!(
        code(
            cl.resign_leadership(ResignLeadershipRequest { term: 0 })
                .await
        ),
        Code::Ok
    );

    // The CLI with --token-file, and without.
    let eps = c
        .replicas
        .iter()
        .map(|r| r.listen().to_string())
        .collect::<Vec<_>>()
        .join(",");
    let submit_file = secrets.path().join("submit.token").display().to_string();
    let read_file = secrets.path().join("read.token").display().to_string();
    let (rc, out, err) = run_cli(
        &[
            "job",
            "submit",
            "--endpoints",
            &eps,
            "--token-file",
            &submit_file,
            "--id",
            "cli-1",
            "-o",
            "json",
            "--",
            "true",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(rc, Some(0), "{out}{err}");
    let (rc, out, err) = run_cli(
        &[
            "job",
            "get",
            "cli-1",
            "--endpoints",
            &eps,
            "--token-file",
            &read_file,
            "-o",
            "json",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(rc, Some(0), "{out}{err}");
    assert!(out.contains("\"submitted_by\":\"ci\""), "{out}");
    let (rc, _, err) = run_cli(
        &[
            "job",
            "submit",
            "--endpoints",
            &eps,
            "--token-file",
            &read_file,
            "--",
            "true",
        ],
        Duration::from_secs(30),
    );
    assert_ne!(rc, Some(0));
    assert!(err.contains("PermissionDenied"), "{err}");
    let (rc, _, err) = run_cli(
        &["job", "list", "--endpoints", &eps],
        Duration::from_secs(30),
    );
    assert_ne!(rc, Some(0));
    assert!(err.contains("Unauthenticated"), "{err}");

    // The tokens file is re-read when it changes: a removed token stops working on every
    // process, a malformed version is ignored, the others go on.
    let text = std::fs::read_to_string(&file).unwrap();
    let tmp = write(secrets.path(), ".tokens.new", "not a tokens line\n");
    std::fs::rename(&tmp, &file).unwrap();
    let revoked: String = text
        .lines()
        .filter(|l| !l.starts_with(READ))
        .map(|l| format!("{l}\n"))
        .collect();
    let list = |addr: String, t: &'static str| async move {
        let mut j = JobServiceClient::new(chan(&addr, Some(t)).await);
        code(j.list_jobs(ListJobsRequest::default()).await)
    };
    for r in &c.replicas {
        wait_until(
            "the malformed file to be seen",
            Duration::from_secs(30),
            || {
                std::fs::read_to_string(r.log_path())
                    .is_ok_and(|l| l.contains("changed but cannot be used"))
            },
        )
        .await;
        let addr = r.listen().to_string();
        assert_eq!(
            list(addr, READ).await,
            Code::Ok,
            "a bad file revoked tokens"
        );
    }
    let tmp = write(secrets.path(), ".tokens.new", &revoked);
    std::fs::rename(&tmp, &file).unwrap();
    for i in [li, fi] {
        let addr = c.replicas[i].listen().to_string();
        wait_for(
            "the read token to be revoked",
            Duration::from_secs(30),
            || {
                let addr = addr.clone();
                async move { (list(addr, READ).await == Code::Unauthenticated).then_some(()) }
            },
        )
        .await;
        assert_eq!(list(addr, SUBMIT).await, Code::Ok);
    }

    // Audit lines name the caller; no log holds any part of a token.
    let logs: String = c
        .replicas
        .iter()
        .chain(c.workers.iter())
        .map(|r| std::fs::read_to_string(r.log_path()).unwrap_or_default())
        .collect();
    assert!(logs.contains("baton::audit"), "no audit lines");
    assert!(
        logs.contains(r#""action":"submit","job_id":"leader-s","caller":"ci""#),
        "no submit audit line naming its caller"
    );
    assert!(
        logs.contains(r#""action":"resign","caller":"ops""#),
        "no resign audit line"
    );
    assert!(logs.contains(r#""action":"undrain","worker":"w1","caller":"ops""#));
    for t in [READ, SUBMIT, ADMIN, PEER, "wrong-token-0123456789"] {
        assert!(!logs.contains(&t[..12]), "a token appears in the logs");
    }
}

fn tls(ca: &Path, client: Option<&(PathBuf, PathBuf)>) -> Option<ClientTlsFiles> {
    Some(ClientTlsFiles {
        ca: Some(ca.to_path_buf()),
        cert: client.map(|c| c.0.clone()),
        key: client.map(|c| c.1.clone()),
    })
}

async fn leader_over(addr: &str, files: Option<ClientTlsFiles>) -> Result<Code, String> {
    let ch = conn(addr, None, files).await?;
    Ok(code(
        ClusterServiceClient::new(ch)
            .get_leader(GetLeaderRequest {})
            .await,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_mtls_check_both_sides_and_a_rotated_certificate_is_served_without_restart() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (ca1, ca2) = (Ca::new("ca-one"), Ca::new("ca-two"));
    let (ca1_pem, ca2_pem) = (ca1.save(dir, "ca1.pem"), ca2.save(dir, "ca2.pem"));
    let (cert, key) = ca1.issue(dir, "server", "replica");
    let cli = ca1.issue(dir, "cli", "cli");
    let nobody = ca1.issue(dir, "nobody", "nobody");
    let stranger = ca2.issue(dir, "stranger", "cli");
    let s = |p: &Path| p.display().to_string();
    let c = Cluster::start(Options {
        replicas: 1,
        extra_args: vec![
            "--tls-cert".into(),
            s(&cert),
            "--tls-key".into(),
            s(&key),
            "--tls-client-ca".into(),
            s(&ca1_pem),
            "--tls-client-roles".into(),
            "cli=admin".into(),
        ],
        ..Options::default()
    });
    let addr = c.replicas[0].listen().to_string();
    let pid = c.replicas[0].pid();
    wait_for(
        "the replica to serve over mTLS",
        Duration::from_secs(30),
        || async {
            (leader_over(&addr, tls(&ca1_pem, Some(&cli))).await == Ok(Code::Ok)).then_some(())
        },
    )
    .await;
    // Wrong CA: the client refuses the server.
    assert!(leader_over(&addr, tls(&ca2_pem, Some(&cli))).await != Ok(Code::Ok));
    // No client certificate, a certificate from another CA, plain HTTP/2: refused.
    assert!(leader_over(&addr, tls(&ca1_pem, None)).await != Ok(Code::Ok));
    assert!(leader_over(&addr, tls(&ca1_pem, Some(&stranger))).await != Ok(Code::Ok));
    assert!(leader_over(&addr, None).await != Ok(Code::Ok));
    // A verified certificate whose CN has no role.
    assert_eq!(
        leader_over(&addr, tls(&ca1_pem, Some(&nobody))).await,
        Ok(Code::PermissionDenied)
    );

    // The CLI with --ca, --cert and --key; without --cert it is refused.
    let (rc, out, err) = run_cli(
        &[
            "leader",
            "get",
            "--endpoints",
            &addr,
            "--ca",
            &s(&ca1_pem),
            "--cert",
            &s(&cli.0),
            "--key",
            &s(&cli.1),
            "-o",
            "json",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(rc, Some(0), "{out}{err}");
    assert!(out.contains("\"replica_id\":\"r1\""), "{out}");
    let (rc, _, err) = run_cli(
        &[
            "leader",
            "get",
            "--endpoints",
            &addr,
            "--ca",
            &s(&ca1_pem),
            "--timeout",
            "2s",
        ],
        Duration::from_secs(30),
    );
    assert_ne!(rc, Some(0), "{err}");

    // Rotate the server certificate to one from the second CA, in place.
    ca2.issue(dir, "server", "replica-rotated");
    wait_for(
        "the rotated certificate to be served",
        Duration::from_secs(30),
        || async {
            (leader_over(&addr, tls(&ca2_pem, Some(&cli))).await == Ok(Code::Ok)).then_some(())
        },
    )
    .await;
    assert!(leader_over(&addr, tls(&ca1_pem, Some(&cli))).await != Ok(Code::Ok));
    assert_eq!(c.replicas[0].pid(), pid);
    assert!(support::alive(pid), "the replica restarted");
}

#[test]
fn listening_beyond_loopback_without_tls_and_authentication_is_refused() {
    // Refused before anything is bound, so nothing listens beyond loopback.
    for cmd in [&["serve"][..], &["worker"][..]] {
        let mut args = cmd.to_vec();
        args.extend(["--listen", "0.0.0.0:1", "--etcd-endpoints", "127.0.0.1:1"]);
        let (rc, out, err) = run_cli(&args, Duration::from_secs(30));
        assert!(rc.is_some() && rc != Some(0), "{out}{err}");
        assert!(err.contains("refusing to listen on 0.0.0.0:1"), "{err}");
        assert!(err.contains("--insecure-allow-unauthenticated"), "{err}");
    }
}

/// etcd's client port requires a certificate signed by its CA once `--trusted-ca-file` is set,
/// so etcdctl presents one (whose CN is no etcd user) and authenticates with `user` if given.
fn etcdctl(
    endpoint: &str,
    tls: &(PathBuf, PathBuf, PathBuf),
    user: Option<&str>,
    args: &[&str],
) -> (bool, String) {
    let (ca, cert, key) = tls;
    let mut cmd = std::process::Command::new("etcdctl");
    cmd.env("ETCDCTL_API", "3")
        .args(["--endpoints", &format!("https://{endpoint}")])
        .arg("--cacert")
        .arg(ca)
        .arg("--cert")
        .arg(cert)
        .arg("--key")
        .arg(key)
        .args(["--dial-timeout", "5s", "--command-timeout", "10s"]);
    if let Some(u) = user {
        cmd.args(["--user", u]);
    }
    let out = cmd
        .args(args)
        .output()
        .expect("etcdctl (apt-get install etcd-client)");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn baton_works_against_etcd_with_tls_and_a_user_limited_to_its_prefix() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let ca = Ca::new("etcd-ca");
    let ca_pem = ca.save(dir, "etcd-ca.pem");
    let (cert, key) = ca.issue(dir, "etcd", "etcd");
    let etcd = baton::devcluster::EtcdCluster::start_with(
        Path::new("etcd"),
        &dir.join("etcd"),
        1,
        Some(baton::devcluster::EtcdTls {
            cert,
            key,
            ca: ca_pem.clone(),
        }),
    )
    .unwrap_or_else(|e| panic!("cannot start etcd for the tests: {e}"));
    let ep = etcd.endpoints()[0].clone();
    let (ctl_cert, ctl_key) = ca.issue(dir, "etcdctl", "etcdctl");
    let ctl = (ca_pem.clone(), ctl_cert, ctl_key);
    let (baton_cert, baton_key) = ca.issue(dir, "baton-client", "baton-client");
    let ok = |args: &[&str]| {
        let (ok, out) = etcdctl(&ep, &ctl, None, args);
        assert!(ok, "etcdctl {args:?}: {out}");
    };
    ok(&["user", "add", "root:root-password"]);
    let _ = etcdctl(&ep, &ctl, None, &["role", "add", "root"]);
    let _ = etcdctl(&ep, &ctl, None, &["user", "grant-role", "root", "root"]);
    ok(&["role", "add", "baton"]);
    ok(&[
        "role",
        "grant-permission",
        "baton",
        "--prefix=true",
        "readwrite",
        "/baton/sec/",
    ]);
    ok(&["user", "add", "baton:baton-password"]);
    ok(&["user", "grant-role", "baton", "baton"]);
    ok(&["auth", "enable"]);
    // The role really limits: outside the prefix, baton's user is refused.
    let (outside, _) = etcdctl(
        &ep,
        &ctl,
        Some("baton:baton-password"),
        &["put", "/other", "x"],
    );
    assert!(!outside, "the role does not limit baton to its prefix");

    let pw = write(dir, "password", "baton-password\n");
    let bad = write(dir, "bad-password", "nope\n");
    let s = |p: &Path| p.display().to_string();
    let spec = |id: &str, password: &Path| baton::devcluster::ReplicaSpec {
        id: id.into(),
        bin: BIN.into(),
        etcd_endpoints: vec![ep.clone()],
        cluster: "sec".into(),
        listen: ([127, 0, 0, 1], baton::devcluster::free_port()).into(),
        lease_ttl: Duration::from_secs(2),
        dir: dir.join("replicas"),
        extra_args: vec![
            "--storage-dir".into(),
            s(&dir.join("storage")),
            "--etcd-ca".into(),
            s(&ca_pem),
            "--etcd-cert".into(),
            s(&baton_cert),
            "--etcd-key".into(),
            s(&baton_key),
            "--etcd-user".into(),
            "baton".into(),
            "--etcd-password-file".into(),
            s(password),
        ],
        worker: false,
    };
    let r1 = baton::devcluster::ReplicaProcess::spawn(spec("r1", &pw)).unwrap();
    let addr = r1.listen();
    wait_for(
        "r1 to lead under the limited user",
        Duration::from_secs(30),
        || async {
            let l = get_leader_at(addr).await.ok()?.leader?;
            (l.replica_id == "r1").then_some(())
        },
    )
    .await;
    let mut jobs = jobs_at(addr).await;
    jobs.submit_job(SubmitJobRequest {
        job_id: "under-auth".into(),
        spec: Some(sh("echo ok")),
    })
    .await
    .unwrap();
    wait_for(
        "the job to finish and be cleaned up",
        Duration::from_secs(60),
        || {
            let mut jobs = jobs.clone();
            async move {
                let j = jobs
                    .get_job(GetJobRequest {
                        job_id: "under-auth".into(),
                    })
                    .await
                    .ok()?
                    .into_inner();
                let clean = j
                    .cleanup
                    .as_ref()
                    .is_some_and(|c| c.state == baton::proto::CleanupState::CleanupDone as i32);
                (state(&j) == baton::proto::JobState::Finished && clean).then_some(())
            }
        },
    )
    .await;
    let (ok, out) = etcdctl(
        &ep,
        &ctl,
        Some("baton:baton-password"),
        &["get", "--prefix", "--keys-only", "/baton/sec/"],
    );
    assert!(ok && out.contains("/baton/sec/"), "{out}");

    // A wrong password: a clear error and a non-zero exit.
    let b = spec("r2", &bad);
    let mut args = vec![
        "serve".to_string(),
        "--replica-id".into(),
        "r2".into(),
        "--listen".into(),
        b.listen.to_string(),
        "--etcd-endpoints".into(),
        ep.clone(),
        "--cluster".into(),
        "sec".into(),
    ];
    args.extend(b.extra_args.clone());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (rc, out, err) = run_cli(&args, Duration::from_secs(60));
    assert!(rc.is_some() && rc != Some(0), "{out}{err}");
    assert!(err.contains("etcd refused the user \"baton\""), "{err}");
    assert!(!err.contains("nope"), "the password appears in the error");
    drop(r1);
}
