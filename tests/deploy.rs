//! The deployment, checked without a Kubernetes cluster or a Docker engine: the kustomize base
//! and overlay render and validate against the Kubernetes schemas; every flag and variable they
//! use exists; the image's user, working directory and filesystem (uid 65532 from `/`, writing
//! only to the mounted scratch folder) start coordinators and a worker that elect a leader and
//! run a job; `/metrics` parses as Prometheus text and follows leadership; health follows
//! etcd's reach; and a rolling restart of the coordinators, then of the workers, loses nothing
//! and restarts only what outlives the drain timeout.
//!
//! The Python tools (kubernetes-validate, prometheus_client's parser) come from the venv that
//! `make test` creates (`target/test-venv`, or `BATON_TEST_PYTHON`).

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton::devcluster::{free_port, Mode};
use serde_json::Value;
use support::*;

const LONG: Duration = Duration::from_secs(60);
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn python() -> PathBuf {
    let p = std::env::var_os("BATON_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(ROOT).join("target/test-venv/bin/python"));
    assert!(
        p.exists(),
        "{} is missing: run `make pydeps` (or `make test`), which creates target/test-venv with \
         tests/tools/requirements.txt, or point BATON_TEST_PYTHON at a python that has them",
        p.display()
    );
    p
}

fn tool(script: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(python())
        .arg(Path::new(ROOT).join("tests/tools").join(script))
        .args(args)
        .output()
        .expect("running the test's python");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `kubectl kustomize <dir>` written to a file in `into`.
fn render(dir: &str, into: &Path) -> PathBuf {
    let out = Command::new("kubectl")
        .args(["kustomize", &format!("{ROOT}/{dir}")])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run kubectl ({e}): install it (./scripts/install-deps does: Debian's \
                 kubernetes-client; kubectl 1.21 or newer, for kustomize 4+), or see \
                 https://kubernetes.io/docs/tasks/tools/"
            )
        });
    assert!(
        out.status.success(),
        "kubectl kustomize {dir} failed (kubectl 1.21 or newer is needed): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = into.join(format!("{}.yaml", dir.replace('/', "_")));
    std::fs::write(&file, &out.stdout).unwrap();
    file
}

fn objects(file: &Path) -> Vec<Value> {
    let (ok, text) = tool("k8s.py", &["json", file.to_str().unwrap()]);
    assert!(ok, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// The object `kind/name`; generated ConfigMaps match by name and their hash suffix.
fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let named = |o: &Value| {
        let n = o["metadata"]["name"].as_str().unwrap_or_default();
        n == name || (kind == "ConfigMap" && n.starts_with(&format!("{name}-")))
    };
    objs.iter()
        .find(|o| o["kind"] == kind && named(o))
        .unwrap_or_else(|| panic!("no {kind}/{name} in the rendered manifests"))
}

fn container(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]["containers"][0]
}

fn env_of(c: &Value, name: &str) -> Option<String> {
    c["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str().map(String::from))
}

#[test]
fn the_manifests_render_and_validate_against_the_kubernetes_schemas() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in ["deploy/kubernetes", "deploy/kubernetes/external-etcd"] {
        let file = render(dir, tmp.path());
        let (ok, report) = tool("k8s.py", &["validate", file.to_str().unwrap()]);
        println!("{dir}:\n{report}");
        assert!(ok, "{dir} does not validate:\n{report}");
        let objs = objects(&file);
        let with_etcd = dir == "deploy/kubernetes";
        let has_etcd = objs
            .iter()
            .any(|o| o["metadata"]["name"] == "baton-etcd" && o["kind"] == "StatefulSet");
        assert_eq!(has_etcd, with_etcd, "{dir}: etcd StatefulSet");
        for (kind, name) in [
            ("StatefulSet", "baton"),
            ("StatefulSet", "baton-worker"),
            ("Service", "baton"),
            ("Service", "baton-api"),
            ("PodDisruptionBudget", "baton"),
            ("NetworkPolicy", "baton-coordinators"),
            ("NetworkPolicy", "baton-workers"),
            ("ConfigMap", "baton-config"),
        ] {
            find(&objs, kind, name);
        }
        let coord = find(&objs, "StatefulSet", "baton");
        assert_eq!(coord["spec"]["replicas"], 3);
        // Workers are named through their headless Service, so a certificate can name them:
        // only a StatefulSet's pods get those DNS records.
        let w = find(&objs, "StatefulSet", "baton-worker");
        assert_eq!(w["spec"]["serviceName"], "baton-worker");
        assert_eq!(
            find(&objs, "Service", "baton-worker")["spec"]["clusterIP"],
            "None"
        );
        assert_eq!(
            env_of(container(w), "BATON_ADVERTISE").unwrap(),
            "$(POD_NAME).baton-worker.$(POD_NAMESPACE).svc:7071"
        );
        let args = container(coord)["args"].as_array().unwrap();
        assert_eq!(args[0], "serve");
        assert!(args.iter().any(|a| a == "--worker=false"), "{args:?}");
        // Workers get longer than their drain to leave, or Kubernetes SIGKILLs them mid-drain.
        let worker = find(&objs, "StatefulSet", "baton-worker");
        let grace = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap();
        let drain = humantime::parse_duration(
            &env_of(container(worker), "BATON_DRAIN_TIMEOUT").expect("workers set a drain"),
        )
        .unwrap();
        assert!(
            Duration::from_secs(grace) > drain + Duration::from_secs(10),
            "grace {grace}s vs drain {drain:?}"
        );
        for w in [coord, worker] {
            let pod = &w["spec"]["template"]["spec"];
            let c = container(w);
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
            assert_eq!(
                pod["securityContext"]["seccompProfile"]["type"],
                "RuntimeDefault"
            );
            let sc = &c["securityContext"];
            assert_eq!(sc["readOnlyRootFilesystem"], true);
            assert_eq!(sc["allowPrivilegeEscalation"], false);
            assert_eq!(sc["capabilities"]["drop"][0], "ALL");
            assert!(c["resources"]["limits"]["memory"].is_string());
            // kubelet's gRPC probes cannot speak TLS: HTTP on the metrics port.
            for (probe, path) in [
                ("startupProbe", "/livez"),
                ("livenessProbe", "/livez"),
                ("readinessProbe", "/readyz"),
            ] {
                assert_eq!(c[probe]["httpGet"]["path"], path, "{probe}");
                assert_eq!(c[probe]["httpGet"]["port"], "metrics", "{probe}");
            }
            // TLS and tokens come from mounted Secrets; whole volumes, so updates reach them.
            for var in ["BATON_TLS_CERT", "BATON_TLS_KEY", "BATON_AUTH_TOKENS_FILE"] {
                let file = env_of(c, var).unwrap_or_else(|| panic!("{var} is not set"));
                let mount = c["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|m| file.starts_with(m["mountPath"].as_str().unwrap()))
                    .unwrap_or_else(|| panic!("{file} is not in a mounted volume"));
                assert!(
                    mount["subPath"].is_null(),
                    "{var}: subPath mounts never update"
                );
                let volume = pod["volumes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|v| v["name"] == mount["name"])
                    .unwrap();
                assert!(volume["secret"]["secretName"].is_string(), "{volume}");
            }
            // The one folder Baton writes is a mounted volume.
            let storage = env_of(c, "BATON_STORAGE_DIR").unwrap();
            assert!(
                c["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|m| m["mountPath"] == storage.as_str()),
                "{storage} is not mounted"
            );
        }
    }
    let (ok, report) = tool(
        "k8s.py",
        &[
            "validate",
            &format!("{ROOT}/deploy/kubernetes/examples/worker-hpa.yaml"),
        ],
    );
    assert!(ok, "{report}");
}

#[test]
fn every_flag_and_variable_in_the_manifests_exists_in_its_commands_help() {
    let tmp = tempfile::tempdir().unwrap();
    let objs = objects(&render("deploy/kubernetes", tmp.path()));
    let config = &find(&objs, "ConfigMap", "baton-config")["data"];
    let mut checked = 0;
    for (kind, name) in [("StatefulSet", "baton"), ("StatefulSet", "baton-worker")] {
        let c = container(find(&objs, kind, name));
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let help = Command::new(BIN)
            .args([args[0], "--help"])
            .output()
            .unwrap();
        assert!(help.status.success());
        let mut help = String::from_utf8_lossy(&help.stdout).into_owned();
        // The CLI run by `kubectl exec` in the pod reads the pod's variables too.
        let cli = Command::new(BIN)
            .args(["job", "list", "--help"])
            .output()
            .unwrap();
        assert!(cli.status.success());
        let cli_help = String::from_utf8_lossy(&cli.stdout).into_owned();
        for a in &args[1..] {
            let flag = a.split('=').next().unwrap();
            assert!(
                help.contains(&format!("{flag} "))
                    || help.contains(&format!("{flag}="))
                    || help.contains(&format!("{flag} <")),
                "{name}: {flag} is not a flag of `baton {}`",
                args[0]
            );
            checked += 1;
        }
        let mut vars: Vec<String> = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect();
        vars.extend(config.as_object().unwrap().keys().cloned());
        help += &cli_help;
        for v in vars.iter().filter(|v| v.starts_with("BATON_")) {
            assert!(
                help.contains(&format!("[env: {v}=")),
                "{name}: {v} is not a variable of `baton {}`",
                args[0]
            );
            checked += 1;
        }
    }
    println!("{checked} flags and variables found in --help");
    assert!(checked > 15, "{checked}");
}

/// A process that is SIGKILLed when the test ends, however it ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a pod mounts from Secrets: secret name to a folder holding one file per key.
type Secrets = BTreeMap<String, PathBuf>;

/// Builds each Secret volume of `workload` under `into` as the kubelet would (the listed
/// items, or every key; readable by the pod's group) and returns its mount path and folder.
fn secret_mounts(workload: &Value, secrets: &Secrets, into: &Path) -> Vec<(String, PathBuf)> {
    let pod = &workload["spec"]["template"]["spec"];
    let mut mounts = Vec::new();
    for m in container(workload)["volumeMounts"].as_array().unwrap() {
        let v = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap();
        let Some(name) = v["secret"]["secretName"].as_str() else {
            continue;
        };
        let src = &secrets[name];
        let dir = into.join(m["name"].as_str().unwrap());
        std::fs::create_dir_all(&dir).unwrap();
        let items: Vec<(String, String)> = match v["secret"]["items"].as_array() {
            Some(items) => items
                .iter()
                .map(|i| {
                    (
                        i["key"].as_str().unwrap().into(),
                        i["path"].as_str().unwrap().into(),
                    )
                })
                .collect(),
            None => std::fs::read_dir(src)
                .unwrap()
                .flatten()
                .map(|f| f.file_name().to_string_lossy().into_owned())
                .map(|k| (k.clone(), k))
                .collect(),
        };
        for (key, path) in items {
            let to = dir.join(path);
            std::fs::copy(src.join(&key), &to)
                .unwrap_or_else(|e| panic!("secret {name} has no key {key}: {e}"));
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o440)).unwrap();
            if nix::unistd::geteuid().is_root() {
                std::os::unix::fs::chown(&to, Some(0), Some(65532)).unwrap();
            }
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        mounts.push((m["mountPath"].as_str().unwrap().to_string(), dir));
    }
    mounts
}

/// What every pod shares: the image's binary, the ConfigMap, the Secrets, and where the
/// kubelet would build the pods' Secret volumes.
#[derive(Clone, Copy)]
struct Image<'a> {
    bin: &'a Path,
    config: &'a Value,
    secrets: &'a Secrets,
    volumes: &'a Path,
}

/// Starts `baton` as the image does (uid 65532 when the test runs as root, from `/`, with
/// only `scratch` writable), with a workload's args, variables, ConfigMap and Secret volumes
/// (under `volumes`), loopback addresses in place of the pod's, and the test's etcd.
fn start_as_image(
    image: &Image,
    workload: &Value,
    pod: &str,
    overrides: &[(&str, String)],
    log: &Path,
) -> (Proc, BTreeMap<String, String>) {
    let Image {
        bin,
        config,
        secrets,
        volumes,
    } = *image;
    let c = container(workload);
    let args: Vec<String> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    let mounts = secret_mounts(workload, secrets, &volumes.join(pod));
    let mut env: BTreeMap<String, String> = config
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    for e in c["env"].as_array().unwrap() {
        let mut value = match (
            &e["value"],
            e["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        ) {
            (Value::String(v), _) => v
                .replace("$(POD_NAME)", pod)
                .replace("$(POD_NAMESPACE)", "default")
                .replace("$(POD_IP)", "127.0.0.1"),
            (_, Some("metadata.name")) => pod.to_string(),
            (_, Some("metadata.namespace")) => "default".to_string(),
            (_, Some("status.podIP")) => "127.0.0.1".to_string(),
            other => panic!("unexpected variable source {other:?}"),
        };
        for (mount, dir) in &mounts {
            if let Some(rest) = value.strip_prefix(mount.as_str()) {
                value = format!("{}{rest}", dir.display());
            }
        }
        env.insert(e["name"].as_str().unwrap().to_string(), value);
    }
    for (k, v) in overrides {
        env.insert(k.to_string(), v.clone());
    }
    let mut cmd = Command::new(bin);
    cmd.args(&args)
        .env_clear()
        .envs(&env)
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(log).unwrap())
        .stderr(std::fs::File::create(log.with_extension("err")).unwrap());
    if nix::unistd::geteuid().is_root() {
        cmd.uid(65532).gid(65532);
    }
    (Proc(cmd.spawn().unwrap()), env)
}

/// The status code of `GET path` on `addr` (what an httpGet probe sees), if it answers.
async fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let get = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut head = Vec::new();
        s.read_to_end(&mut head).await.ok()?;
        String::from_utf8_lossy(&head)
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    tokio::time::timeout(Duration::from_secs(5), get)
        .await
        .ok()
        .flatten()
}

async fn health_of(addr: SocketAddr, service: &str) -> Option<i32> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .ok()?;
    let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
    h.check(tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    })
    .await
    .ok()
    .map(|r| r.into_inner().status)
}

const SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
const NOT_SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;

/// The Secrets the manifests mount, made by `examples/make-secrets.sh` as the README says;
/// returns them and the folder holding every generated file (tokens per role included).
fn make_secrets(into: &Path) -> (Secrets, PathBuf) {
    let all = into.join("generated");
    let out = Command::new(format!("{ROOT}/deploy/kubernetes/examples/make-secrets.sh"))
        .args(["default", all.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "make-secrets.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut secrets = Secrets::new();
    for (name, keys) in [
        ("baton-tls", &["tls.crt", "tls.key", "ca.crt"][..]),
        ("baton-tokens", &["tokens", "peer-token"][..]),
    ] {
        let d = into.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for k in keys {
            std::fs::copy(all.join(k), d.join(k)).unwrap();
        }
        secrets.insert(name.to_string(), d);
    }
    (secrets, all)
}

/// The names the trial certificate carries, as `openssl x509` prints them.
fn certificate_names(cert: &Path) -> Vec<String> {
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-ext", "subjectAltName", "-in"])
        .arg(cert)
        .output()
        .expect("openssl (apt-get install openssl)");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut names: Vec<String> = text
        .lines()
        .skip(1)
        .flat_map(|l| l.split(','))
        .map(|n| {
            let n = n.trim();
            n.split_once(':').map_or(n, |(_, v)| v).to_string()
        })
        .collect();
    names.sort();
    names
}

/// A channel as a client of the secured deployment: its CA and the `admin.token` of `dir`.
async fn secured(addr: SocketAddr, dir: &Path) -> baton::security::AuthChannel {
    let sec = baton::security::ClientSecurity {
        tls: baton::security::ClientTlsFiles {
            ca: Some(dir.join("ca.crt")),
            cert: None,
            key: None,
        }
        .config()
        .unwrap(),
        bearer: baton::security::Bearer::from_file(&dir.join("admin.token")).unwrap(),
    };
    sec.connect(
        &addr.to_string(),
        Duration::from_secs(2),
        Duration::from_secs(10),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_images_user_and_read_only_filesystem_start_coordinators_and_a_worker() {
    let tmp = tempfile::Builder::new()
        .prefix("baton-image-")
        .tempdir()
        .unwrap();
    let objs = objects(&render("deploy/kubernetes", tmp.path()));
    let etcd = start_etcd(&tmp.path().join("etcd"), 1);
    let (secrets, generated) = make_secrets(&tmp.path().join("secrets"));
    // The trial certificate and cert-manager's name the same peers.
    let cm = objects(Path::new(&format!(
        "{ROOT}/deploy/kubernetes/examples/certificate.yaml"
    )));
    let spec = &find(&cm, "Certificate", "baton-tls")["spec"];
    let mut want: Vec<String> = ["dnsNames", "ipAddresses"]
        .iter()
        .flat_map(|k| spec[k].as_array().unwrap().iter())
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    want.sort();
    assert_eq!(certificate_names(&generated.join("tls.crt")), want);
    // What the image holds: the release binary (`make test` builds it; the test's own build
    // otherwise), readable and executable by anyone.
    let bin_dir = tmp.path().join("image");
    std::fs::create_dir(&bin_dir).unwrap();
    let bin = bin_dir.join("baton");
    let source = std::env::var("BATON_TEST_RELEASE_BIN").unwrap_or_else(|_| BIN.to_string());
    // The guard the worker starts for every job, next to `baton` as in the image.
    let guard_source = Path::new(&source).with_file_name("baton-guard");
    let guard = bin_dir.join("baton-guard");
    println!("image binaries: {source}, {}", guard_source.display());
    for (from, to) in [(Path::new(&source), &bin), (guard_source.as_path(), &guard)] {
        std::fs::copy(from, to)
            .unwrap_or_else(|e| panic!("copying the image binary {}: {e}", from.display()));
    }
    for (p, mode) in [
        (tmp.path(), 0o755),
        (bin_dir.as_path(), 0o755),
        (bin.as_path(), 0o755),
        (guard.as_path(), 0o755),
    ] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let root = nix::unistd::geteuid().is_root();
    // What Kubernetes mounts: an emptyDir per pod at BATON_STORAGE_DIR, owned by the pod's user.
    let scratch = |pod: &str| {
        let d = tmp.path().join("volumes").join(pod);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(
            tmp.path().join("volumes"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        if root {
            std::os::unix::fs::chown(&d, Some(65532), Some(65532)).unwrap();
        }
        d.display().to_string()
    };
    let secret_volumes = tmp.path().join("secret-volumes");
    std::fs::create_dir_all(&secret_volumes).unwrap();
    std::fs::set_permissions(&secret_volumes, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = &find(&objs, "ConfigMap", "baton-config")["data"];
    let coord = find(&objs, "StatefulSet", "baton");
    let worker = find(&objs, "StatefulSet", "baton-worker");
    let endpoints = etcd.endpoints().join(",");
    let image = Image {
        bin: &bin,
        config,
        secrets: &secrets,
        volumes: &secret_volumes,
    };
    let mut procs = Vec::new();
    let mut api = Vec::new();
    let mut probes = Vec::new();
    let mut coord_env = Vec::new();
    for i in 0..3 {
        let pod = format!("baton-{i}");
        let listen: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        api.push(listen);
        probes.push(metrics);
        let (p, env) = start_as_image(
            &image,
            coord,
            &pod,
            &[
                ("BATON_ETCD_ENDPOINTS", endpoints.clone()),
                ("BATON_LISTEN", listen.to_string()),
                ("BATON_ADVERTISE", listen.to_string()),
                ("BATON_METRICS_LISTEN", metrics.to_string()),
                ("BATON_STORAGE_DIR", scratch(&pod)),
            ],
            &tmp.path().join(format!("{pod}.log")),
        );
        procs.push(p);
        coord_env.push(env);
    }
    // The worker's listener holds its job output: replicas reach it over TLS with their token.
    let worker_listen: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let worker_metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    probes.push(worker_metrics);
    procs.push(
        start_as_image(
            &image,
            worker,
            "baton-worker-0",
            &[
                ("BATON_ETCD_ENDPOINTS", endpoints.clone()),
                ("BATON_LISTEN", worker_listen.to_string()),
                ("BATON_ADVERTISE", worker_listen.to_string()),
                ("BATON_METRICS_LISTEN", worker_metrics.to_string()),
                ("BATON_STORAGE_DIR", scratch("baton-worker-0")),
            ],
            &tmp.path().join("worker.log"),
        )
        .0,
    );
    let logs = || {
        let mut s = String::new();
        for f in std::fs::read_dir(tmp.path()).unwrap().flatten() {
            if f.path().extension().is_some_and(|e| e == "err") {
                s += &std::fs::read_to_string(f.path()).unwrap_or_default();
            }
        }
        s
    };
    // What the kubelet's probes ask.
    for addr in &probes {
        for path in ["/livez", "/readyz"] {
            let addr = *addr;
            wait_for(
                &format!("{addr}{path} to answer 200"),
                LONG,
                || async move { (http_status(addr, path).await == Some(200)).then_some(()) },
            )
            .await;
        }
    }
    for (i, p) in procs.iter_mut().enumerate() {
        assert!(
            p.0.try_wait().unwrap().is_none(),
            "process {i} exited: {}",
            logs()
        );
    }
    // Without the token, nothing; in clear, nothing.
    let mut anonymous = baton::proto::cluster_service_client::ClusterServiceClient::new(
        baton::security::ClientSecurity {
            tls: baton::security::ClientTlsFiles {
                ca: Some(generated.join("ca.crt")),
                cert: None,
                key: None,
            }
            .config()
            .unwrap(),
            bearer: Default::default(),
        }
        .connect(
            &api[0].to_string(),
            Duration::from_secs(2),
            Duration::from_secs(10),
        )
        .await
        .unwrap(),
    );
    let refused = anonymous
        .get_leader(baton::proto::GetLeaderRequest {})
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    // In clear, the call fails in transport: no gRPC status comes back at all.
    let clear = get_leader_at(api[0]).await.unwrap_err();
    for status in ["Unauthenticated", "PermissionDenied", "Unimplemented"] {
        assert!(!clear.contains(status), "plaintext was served: {clear}");
    }
    let leader = wait_for("a leader", LONG, || async {
        for a in &api {
            let mut c = baton::proto::cluster_service_client::ClusterServiceClient::new(
                secured(*a, &generated).await,
            );
            if let Ok(r) = c.get_leader(baton::proto::GetLeaderRequest {}).await {
                return r.into_inner().leader;
            }
        }
        None
    })
    .await;
    assert!(leader.replica_id.starts_with("baton-"), "{leader:?}");
    // A job runs on the worker: its folder lives in the worker's scratch volume.
    let jobs = |i: usize| {
        let (addr, dir) = (api[i], generated.clone());
        async move { baton::proto::job_service_client::JobServiceClient::new(secured(addr, &dir).await) }
    };
    jobs(1)
        .await
        .submit_job(baton::proto::SubmitJobRequest {
            job_id: "image-job".into(),
            spec: Some(sh(
                "echo written as $(id -u) | tee \"$BATON_JOB_DIR/out\"; \
                 while [ ! -e \"$BATON_JOB_DIR/done\" ]; do sleep 0.1; done",
            )),
        })
        .await
        .unwrap();
    // Read while it runs: once it has a result, cleanup removes its folder.
    let job_dir =
        baton::exec::record::job_dir(&tmp.path().join("volumes/baton-worker-0"), "image-job");
    wait_until("the job to write its file", LONG, || {
        std::fs::read_to_string(job_dir.join("out")).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    let written = std::fs::read_to_string(job_dir.join("out")).unwrap_or_default();
    let uid = if root {
        65532
    } else {
        nix::unistd::geteuid().as_raw()
    };
    assert_eq!(written.trim(), format!("written as {uid}"), "{}", logs());
    // Its output through a coordinator, which reads it from the worker over TLS with the
    // coordinators' token.
    let output = wait_for("the job's output through a coordinator", LONG, || async {
        let r = jobs(0)
            .await
            .get_job_logs(baton::proto::GetJobLogsRequest {
                job_id: "image-job".into(),
                ..Default::default()
            })
            .await
            .ok()?
            .into_inner();
        let text = String::from_utf8_lossy(&r.content).into_owned();
        text.contains("written as").then_some(text)
    })
    .await;
    assert!(output.contains(&format!("written as {uid}")), "{output}");
    // The CLI in a coordinator's pod (`kubectl exec baton-0 -- baton job get image-job`) works
    // from the pod's variables alone, the API address aside.
    let mut cli_env = coord_env[0].clone();
    cli_env.insert("BATON_ENDPOINTS".into(), api[0].to_string());
    let cli = Command::new(&bin)
        .args(["job", "get", "image-job", "-o", "json"])
        .env_clear()
        .envs(&cli_env)
        .output()
        .unwrap();
    assert!(
        cli.status.success(),
        "{}",
        String::from_utf8_lossy(&cli.stderr)
    );
    let shown: Value = serde_json::from_slice(&cli.stdout).unwrap();
    assert_eq!(shown["submitted_by"], "ops", "{shown}");
    std::fs::write(job_dir.join("done"), "").unwrap();
    let j = wait_for("the job to finish", LONG, || async {
        let j = jobs(2)
            .await
            .get_job(baton::proto::GetJobRequest {
                job_id: "image-job".into(),
            })
            .await
            .ok()?
            .into_inner();
        terminal(&j).then_some(j)
    })
    .await;
    assert_eq!(state(&j), JobState::Finished, "{j:?}\n{}", logs());
    println!(
        "3 coordinators and a worker as uid {uid} from /, over TLS with tokens: leader {}",
        leader.replica_id
    );
}

/// `/metrics` of `addr`, parsed by prometheus_client's parser.
fn scrape(addr: SocketAddr) -> BTreeMap<String, f64> {
    let (ok, text) = tool("prom.py", &[&format!("http://{addr}/metrics")]);
    assert!(ok, "/metrics of {addr} does not parse: {text}");
    serde_json::from_str(&text).unwrap()
}

/// Scrapes in a blocking thread (the parser is a child process).
async fn scrape_async(addr: SocketAddr) -> BTreeMap<String, f64> {
    tokio::task::spawn_blocking(move || scrape(addr))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text_and_follow_leadership() {
    let mut c = Cluster::start(Options {
        metrics: true,
        ..Options::default()
    });
    let (leader, info) = c.leader_index().await;
    for (i, addr) in c.replica_metrics.clone().into_iter().enumerate() {
        let want = if i == leader { 1.0 } else { 0.0 };
        let m = wait_for(
            &format!("replica {i}'s is-leader to be {want}"),
            LONG,
            || async {
                let m = scrape_async(addr).await;
                (m.get("baton_is_leader{}") == Some(&want)
                    && m.get("baton_term{}") == Some(&(info.term as f64)))
                .then_some(m)
            },
        )
        .await;
        for family in [
            "baton_leader_changes_total{}",
            "baton_lease_keepalive_age_seconds{lease=election}",
            "baton_lease_margin_left_seconds{lease=election}",
            "baton_lease_keepalive_age_seconds{lease=worker}",
            "baton_jobs{state=pending}",
            "baton_jobs{state=running}",
            "baton_workers{state=live}",
            "baton_workers{state=draining}",
            "baton_cleanups_pending{}",
            "baton_cleanups_needing_operator{}",
            "baton_cleanup_failures_total{}",
            "baton_corrupt_values_total{}",
            "baton_submit_duration_seconds_count{}",
            "baton_job_restarts_total{cause=worker_lost}",
            "baton_job_restarts_total{cause=failed_attempt}",
            &format!("baton_worker_capacity{{worker=r{}}}", i + 1),
            &format!("baton_worker_running_executions{{worker=r{}}}", i + 1),
        ] {
            assert!(m.contains_key(family), "replica {i}: no {family} in {m:?}");
        }
        let age = m["baton_lease_keepalive_age_seconds{lease=election}"];
        assert!((0.0..2.0).contains(&age), "keepalive age {age}");
        assert!(m["baton_lease_margin_left_seconds{lease=election}"] > 0.0);
    }
    // The leader counts its workers; submissions and etcd requests are timed.
    c.submit(leader, "m1", sh("sleep 30")).await;
    let addr = c.replica_metrics[leader];
    wait_for(
        "the leader to count a running job and 3 workers",
        LONG,
        || async {
            let m = scrape_async(addr).await;
            (m.get("baton_jobs{state=running}") == Some(&1.0)
                && m.get("baton_workers{state=live}") == Some(&3.0)
                && m.get("baton_submit_duration_seconds_count{}") == Some(&1.0)
                && m.get("baton_etcd_request_duration_seconds_count{op=submit}") >= Some(&1.0))
            .then_some(())
        },
    )
    .await;
    // A SIGKILLed leader: the others count a leader change; the new one leads in a higher term.
    c.replicas[leader].sigkill();
    let (next, next_info) = c.wait_new_leader(&c.others(leader), info.term).await;
    for i in c.others(leader) {
        let addr = c.replica_metrics[i];
        let want = if i == next { 1.0 } else { 0.0 };
        wait_for(
            &format!("replica {i} to count the leader change"),
            LONG,
            || async {
                let m = scrape_async(addr).await;
                (m.get("baton_leader_changes_total{}") >= Some(&1.0)
                    && m.get("baton_is_leader{}") == Some(&want)
                    && m.get("baton_term{}") == Some(&(next_info.term as f64)))
                .then_some(())
            },
        )
        .await;
    }
    println!(
        "metrics: leader {} (term {}) killed; replica {} leads term {}",
        info.replica_id, info.term, next_info.replica_id, next_info.term
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_not_serving_while_cut_off_from_etcd_and_liveness_stays_serving() {
    let mut c = Cluster::start(Options {
        replicas: 1,
        proxied: true,
        metrics: true,
        ..worker_opts(1, &[])
    });
    c.leader_index().await;
    c.wait_workers(&["w1"]).await;
    let targets = [
        (
            "replica",
            c.replicas[0].listen(),
            c.replica_metrics[0],
            &c.proxies[0],
        ),
        (
            "worker",
            c.workers[0].listen(),
            c.worker_metrics[0],
            &c.worker_proxies[0],
        ),
    ];
    for (what, addr, http, proxy) in targets {
        for s in ["", "liveness"] {
            assert_eq!(health_of(addr, s).await, Some(SERVING), "{what} {s:?}");
        }
        for path in ["/livez", "/readyz"] {
            assert_eq!(http_status(http, path).await, Some(200), "{what} {path}");
        }
        proxy.set_mode(Mode::Blackhole);
        let cut = Instant::now();
        wait_for(
            &format!("the {what} to report NOT_SERVING"),
            LONG,
            || async { (health_of(addr, "").await == Some(NOT_SERVING)).then_some(()) },
        )
        .await;
        let took = cut.elapsed();
        // 3 s without an answer plus a probe's 2 s bound, with room for a loaded machine.
        assert!(took < Duration::from_secs(15), "{what}: {took:?}");
        assert_eq!(health_of(addr, "liveness").await, Some(SERVING), "{what}");
        // The HTTP probes say the same.
        assert_eq!(http_status(http, "/readyz").await, Some(503), "{what}");
        assert_eq!(http_status(http, "/livez").await, Some(200), "{what}");
        proxy.set_mode(Mode::Pass);
        wait_for(
            &format!("the {what} to report SERVING again"),
            LONG,
            || async { (health_of(addr, "").await == Some(SERVING)).then_some(()) },
        )
        .await;
        assert_eq!(http_status(http, "/readyz").await, Some(200), "{what}");
        println!("{what}: NOT_SERVING {} ms after the cut", ms(took));
    }
    // A draining worker is not ready, though etcd answers, and stays live until it exits.
    let out = scratch(&c);
    c.submit(0, "held", gated(&out, "go")).await;
    wait_until("the job to start", LONG, || runs(&out, "held") == 1).await;
    let addr = c.workers[0].listen();
    c.workers[0].sigterm();
    wait_for(
        "the draining worker to report NOT_SERVING",
        LONG,
        || async { (health_of(addr, "").await == Some(NOT_SERVING)).then_some(()) },
    )
    .await;
    assert_eq!(health_of(addr, "liveness").await, Some(SERVING));
    let http = c.worker_metrics[0];
    assert_eq!(http_status(http, "/readyz").await, Some(503));
    assert_eq!(http_status(http, "/livez").await, Some(200));
    assert!(c.workers[0].try_exit().is_none(), "the drain lasts 60s");
    std::fs::write(out.join("go"), "").unwrap();
    let status = c.workers[0].wait_exit(LONG);
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_the_coordinators_then_the_workers_loses_nothing_and_restarts_only_long_jobs() {
    let mut c = Cluster::start(worker_opts(2, &["--drain-timeout", "3s"]));
    c.leader_index().await;
    c.wait_workers(&["w1", "w2"]).await;
    let out = scratch(&c);
    // 20 running jobs: 10 end before the workers roll, 10 outlive any drain.
    let short: Vec<String> = (0..10).map(|i| format!("short-{i}")).collect();
    let long: Vec<String> = (0..10).map(|i| format!("long-{i}")).collect();
    for (i, id) in short.iter().enumerate() {
        c.submit(i % 3, id, gated(&out, "short-done")).await;
    }
    for (i, id) in long.iter().enumerate() {
        c.submit(i % 3, id, gated(&out, "long-done")).await;
    }
    for id in short.iter().chain(&long) {
        wait_until("the 20 jobs to start", LONG, || runs(&out, id) == 1).await;
    }
    let mut brief_ids: Vec<String> = Vec::new();
    // Coordinators, one after another; submissions go on through the others.
    for k in 0..3 {
        c.replicas[k].sigterm();
        let t = Instant::now();
        while c.replicas[k].try_exit().is_none() {
            assert!(t.elapsed() < LONG, "replica {k} did not hand over");
            submit_brief(&c, (k + 1) % 3, &out, &mut brief_ids).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        c.replicas[k].restart().unwrap();
        for _ in 0..3 {
            submit_brief(&c, (k + 2) % 3, &out, &mut brief_ids).await;
        }
        c.leader_index().await;
    }
    for id in short.iter().chain(&long) {
        assert_eq!(
            runs(&out, id),
            1,
            "{id}: the coordinators' roll restarted it"
        );
        let j = c.wait_job(&[0, 1, 2], id, LONG, "read", |_| true).await;
        assert_eq!(state(&j), JobState::Running, "{id}: {j:?}");
    }
    println!("coordinators rolled: 20 jobs, 0 restarts");
    std::fs::write(out.join("short-done"), "").unwrap();
    for id in &short {
        c.wait_job(&[0, 1, 2], id, LONG, "finished", terminal).await;
    }
    // Workers, one after another: what outlives the 3 s drain moves, nothing else.
    for w in 0..2 {
        c.workers[w].sigterm();
        let t = Instant::now();
        while c.workers[w].try_exit().is_none() {
            assert!(t.elapsed() < LONG, "w{} did not drain", w + 1);
            submit_brief(&c, w, &out, &mut brief_ids).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        c.workers[w].restart().unwrap();
        c.wait_workers(&["w1", "w2"]).await;
    }
    std::fs::write(out.join("long-done"), "").unwrap();
    let mut moved = 0;
    for id in short.iter().chain(&long).chain(&brief_ids) {
        let j = c.wait_job(&[0, 1, 2], id, LONG, "terminal", terminal).await;
        assert_eq!(state(&j), JobState::Finished, "{id}: {j:?}");
        assert_eq!(j.recoveries, 0, "{id}: no worker was lost: {j:?}");
        assert_eq!(runs(&out, id), 1 + j.preemptions as usize, "{id}: {j:?}");
        if id.starts_with("long-") {
            assert!(j.preemptions >= 1, "{id} outlived a drain: {j:?}");
            moved += j.preemptions;
        } else {
            assert_eq!(j.preemptions, 0, "{id} ended within the drain: {j:?}");
        }
    }
    println!(
        "workers rolled: {} jobs in all, {moved} preemptions, all of the 10 long jobs, 0 recoveries",
        20 + brief_ids.len()
    );
}

/// A job of 0.3 s (`brief-<n>`), submitted through replica `via`.
async fn submit_brief(c: &Cluster, via: usize, out: &Path, ids: &mut Vec<String>) {
    let id = format!("brief-{}", ids.len());
    c.submit(via, &id, brief(out, 0.3)).await;
    ids.push(id);
}
