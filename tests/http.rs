//! The HTTP JSON API on a real cluster: every documented route behind its role, TLS, the
//! browser-safety refusals, and bad input answered 400 with nothing written.

mod support;

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use support::pki::*;
use support::*;

/// The document the server serves (and the repository keeps).
const OPENAPI: &str = include_str!("../docs/openapi.json");

/// What a request sends, and the status it must be refused with.
type Refusal<'a> = (&'a str, Vec<(&'a str, &'a str)>, StatusCode);

struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The gRPC code's name of an error answer.
    fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_string()
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn send(
    client: &reqwest::Client,
    method: Method,
    url: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<String>,
) -> Answer {
    let mut r = client.request(method.clone(), url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if method != Method::GET
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        r = r.header("content-type", "application/json");
    }
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    if let Some(b) = body {
        r = r.body(b);
    }
    let resp = r
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    Answer {
        status: resp.status(),
        headers: resp.headers().clone(),
        body: resp.text().await.unwrap_or_default(),
    }
}

async fn get(client: &reqwest::Client, url: &str, token: Option<&str>) -> Answer {
    send(client, Method::GET, url, token, &[], None).await
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    body: Option<String>,
) -> Answer {
    send(client, Method::POST, url, token, &[], body).await
}

/// Whether `url` answers 200 with `token`; `false` while the listener is not up yet.
async fn answers(client: &reqwest::Client, url: &str, token: Option<&str>) -> bool {
    let mut r = client.get(url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    r.send().await.is_ok_and(|a| a.status() == StatusCode::OK)
}

/// Waits until the cluster behind `base` is quiet: its leader's term confirmed (`elected_at`
/// written with the term's history record) and its worker registered. Nothing writes to etcd
/// after that until something is asked of it.
async fn settled(client: &reqwest::Client, base: &str, token: Option<&str>) {
    wait_for(
        "a confirmed leader and a worker",
        Duration::from_secs(30),
        || async {
            let ask = |path: &str| {
                let mut r = client.get(format!("{base}{path}"));
                if let Some(t) = token {
                    r = r.bearer_auth(t);
                }
                r.send()
            };
            let leader: Value = ask("/api/v1/leader").await.ok()?.json().await.ok()?;
            let workers: Value = ask("/api/v1/workers").await.ok()?.json().await.ok()?;
            let confirmed = !leader["leader"]["elected_at"].is_null();
            let registered = workers["workers"].as_array().is_some_and(|w| !w.is_empty());
            (confirmed && registered).then_some(())
        },
    )
    .await
}

/// The leader (id, term) every replica's HTTP API names, once they agree on one whose term
/// satisfies `term_ok` (with a read token).
async fn agreed_leader(
    http: &reqwest::Client,
    c: &Cluster,
    term_ok: impl Fn(i64) -> bool,
) -> (String, i64) {
    wait_for(
        "the replicas' HTTP APIs to agree on a leader",
        Duration::from_secs(30),
        || async {
            let mut seen = None;
            for addr in &c.replica_http {
                let r = http
                    .get(format!("http://{addr}/api/v1/leader"))
                    .bearer_auth(READ)
                    .send()
                    .await
                    .ok()?;
                let v: Value = r.json().await.ok()?;
                let l = &v["leader"];
                let this = (
                    l["replica_id"].as_str()?.to_string(),
                    l["term"].as_str()?.parse::<i64>().ok()?,
                );
                if seen.as_ref().is_some_and(|s| s != &this) {
                    return None;
                }
                seen = Some(this);
            }
            seen.filter(|s| term_ok(s.1))
        },
    )
    .await
}

/// A term as the JSON mapping writes it (64-bit integers as strings).
fn term_of(v: &Value) -> Option<i64> {
    v["term"].as_str()?.parse().ok()
}

/// Every `(method, route)` the OpenAPI document lists, with the role it says it needs.
fn documented() -> Vec<(Method, String, String)> {
    let doc: Value = serde_json::from_str(OPENAPI).unwrap();
    let mut out = Vec::new();
    for (route, ops) in doc["paths"].as_object().unwrap() {
        for (method, op) in ops.as_object().unwrap() {
            let m = Method::from_bytes(method.to_ascii_uppercase().as_bytes()).unwrap();
            let role = op["x-baton-role"].as_str().unwrap().to_string();
            out.push((m, route.clone(), role));
        }
    }
    out
}

fn concrete(route: &str) -> String {
    route
        .replace("{job_id}", "no-such-job")
        .replace("{name}", "no-such-schedule")
        .replace("{worker_id}", "no-such-worker")
}

/// The keys that differ between two [`etcd_state`]s.
fn changed(before: &[(String, i64)], after: &[(String, i64)]) -> Vec<String> {
    after
        .iter()
        .filter(|kv| !before.contains(kv))
        .chain(before.iter().filter(|kv| !after.contains(kv)))
        .map(|(k, r)| format!("{k} at {r}"))
        .collect()
}

/// Every key under the cluster's prefix with its mod revision: what a refused request must
/// leave as it was.
async fn etcd_state(c: &Cluster) -> Vec<(String, i64)> {
    let mut client = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    let resp = client
        .get(
            "/baton/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    resp.kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.mod_revision(),
            )
        })
        .collect()
}

fn http_opts(extra: Vec<String>) -> Options {
    Options {
        replicas: 1,
        http: true,
        extra_args: extra,
        ..Options::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_route_needs_a_token_and_writes_need_their_role() {
    let secrets = tempfile::tempdir().unwrap();
    let file = tokens(secrets.path());
    let c = Cluster::start(http_opts(vec![
        "--auth-tokens-file".into(),
        file.display().to_string(),
    ]));
    let base = format!("http://{}", c.replica_http[0]);
    let http = client();
    settled(&http, &base, Some(READ)).await;
    let routes = documented();
    assert!(
        routes.len() >= 20,
        "the document lists {} operations",
        routes.len()
    );
    let before = etcd_state(&c).await;
    for (method, route, role) in &routes {
        let url = format!("{base}{}", concrete(route));
        let body = (*method != Method::GET).then(|| "{}".to_string());
        let none = send(&http, method.clone(), &url, None, &[], body.clone()).await;
        assert_eq!(
            none.status,
            StatusCode::UNAUTHORIZED,
            "{method} {route} without a token"
        );
        assert_eq!(none.code(), "UNAUTHENTICATED", "{method} {route}");
        assert_eq!(none.headers["www-authenticate"], "Bearer");
        let wrong = send(
            &http,
            method.clone(),
            &url,
            Some("wrong-token-0123456789"),
            &[],
            body.clone(),
        )
        .await;
        assert_eq!(
            wrong.status,
            StatusCode::UNAUTHORIZED,
            "{method} {route} with a wrong token"
        );
        let read = if route.ends_with("/events") {
            // A stream: its status and headers are the answer.
            let r = http.get(&url).bearer_auth(READ).send().await.unwrap();
            Answer {
                status: r.status(),
                headers: r.headers().clone(),
                body: String::new(),
            }
        } else {
            send(&http, method.clone(), &url, Some(READ), &[], body.clone()).await
        };
        if role == "read" {
            assert!(
                ![StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN].contains(&read.status),
                "{method} {route} refused a read token: {} {}",
                read.status,
                read.body
            );
        } else {
            assert_eq!(
                read.status,
                StatusCode::FORBIDDEN,
                "{method} {route} with a read token"
            );
            assert_eq!(read.code(), "PERMISSION_DENIED");
            assert!(
                read.json()["message"]
                    .as_str()
                    .unwrap()
                    .contains(role.as_str()),
                "{}",
                read.body
            );
        }
    }
    let diff = changed(&before, &etcd_state(&c).await);
    assert!(
        diff.is_empty(),
        "a refused request wrote to etcd: {diff:#?}"
    );

    // The roles as the routes see them.
    for (token, role) in [(READ, "read"), (SUBMIT, "submit"), (ADMIN, "admin")] {
        let a = get(&http, &format!("{base}/api/v1/whoami"), Some(token)).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.json()["role"], role);
        assert_eq!(a.json()["authentication"], true);
    }
    // A submit token submits; what the API answers is what gRPC answers.
    let spec =
        json!({"job_id": "via-http", "spec": {"command": ["sh", "-c", "echo hello over http"]}});
    let a = post(
        &http,
        &format!("{base}/api/v1/jobs"),
        Some(SUBMIT),
        Some(spec.to_string()),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.json()["job"]["job_id"], "via-http");
    assert_eq!(a.json()["job"]["submitted_by"], "ci");
    let done = wait_for("the job to finish", Duration::from_secs(60), || async {
        let a = get(&http, &format!("{base}/api/v1/jobs/via-http"), Some(READ)).await;
        (a.json()["state"] == "FINISHED").then_some(a)
    })
    .await;
    assert_eq!(done.json()["exit_code"], 0);
    let logs = get(
        &http,
        &format!("{base}/api/v1/jobs/via-http/logs"),
        Some(READ),
    )
    .await;
    assert_eq!(logs.status, StatusCode::OK);
    assert!(logs.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    assert_eq!(logs.body, "hello over http\n");
    let grpc = c.get_job(0, "via-http").await;
    assert!(grpc.is_none(), "gRPC needs a token too");
    // Submitting the same id with another spec: 409, as ALREADY_EXISTS.
    let other = json!({"job_id": "via-http", "spec": {"command": ["true"]}});
    let a = post(
        &http,
        &format!("{base}/api/v1/jobs"),
        Some(SUBMIT),
        Some(other.to_string()),
    )
    .await;
    assert_eq!(
        (a.status, a.code().as_str()),
        (StatusCode::CONFLICT, "ALREADY_EXISTS")
    );
    // Cancelling a finished job: 409, as FAILED_PRECONDITION.
    let a = post(
        &http,
        &format!("{base}/api/v1/jobs/via-http/cancel"),
        Some(SUBMIT),
        None,
    )
    .await;
    assert_eq!(
        (a.status, a.code().as_str()),
        (StatusCode::CONFLICT, "FAILED_PRECONDITION"),
        "{}",
        a.body
    );
    let a = get(
        &http,
        &format!("{base}/api/v1/jobs/no-such-job"),
        Some(READ),
    )
    .await;
    assert_eq!(
        (a.status, a.code().as_str()),
        (StatusCode::NOT_FOUND, "NOT_FOUND")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_and_foreign_pages_are_refused_with_json_and_change_nothing() {
    let c = Cluster::start(http_opts(Vec::new()));
    let host = c.replica_http[0];
    let base = format!("http://{host}");
    let http = client();
    settled(&http, &base, None).await;
    let leader = get(&http, &format!("{base}/api/v1/leader"), None).await;
    // Every answer: a strict CSP, nosniff, no framing, no CORS.
    let csp = leader.headers["content-security-policy"].to_str().unwrap();
    for part in [
        "default-src 'self'",
        "frame-ancestors 'none'",
        "script-src 'self'",
    ] {
        assert!(csp.contains(part), "{csp}");
    }
    assert!(!csp.contains("unsafe-inline"));
    assert_eq!(leader.headers["x-content-type-options"], "nosniff");
    assert!(leader
        .headers
        .keys()
        .all(|k| !k.as_str().starts_with("access-control-")));
    let before = etcd_state(&c).await;
    let jobs = format!("{base}/api/v1/jobs");
    let huge = json!({"job_id": "huge", "spec": {"command": ["echo", "x".repeat(300 * 1024)]}});
    let bodies = [
        ("malformed JSON", "{\"job_id\": ".to_string()),
        ("not an object", "[1, 2]".to_string()),
        (
            "an unknown field",
            json!({"job_id": "u", "spec": {"command": ["true"]}, "priority": 9}).to_string(),
        ),
        (
            "an unknown spec field",
            json!({"job_id": "u", "spec": {"command": ["true"], "nice": 1}}).to_string(),
        ),
        (
            "a wrong type",
            json!({"job_id": "u", "spec": {"command": "true"}}).to_string(),
        ),
        ("no command", json!({"job_id": "u", "spec": {}}).to_string()),
        ("an oversized body", huge.to_string()),
        (
            "a path in the id",
            json!({"job_id": "../../etc/passwd", "spec": {"command": ["true"]}}).to_string(),
        ),
        (
            "markup in the id",
            json!({"job_id": "<img src=x onerror=alert(1)>", "spec": {"command": ["true"]}})
                .to_string(),
        ),
        (
            "a NUL in the id",
            json!({"job_id": "a\u{0}b", "spec": {"command": ["true"]}}).to_string(),
        ),
        (
            "a long id",
            json!({"job_id": "x".repeat(5000), "spec": {"command": ["true"]}}).to_string(),
        ),
    ];
    for (what, body) in bodies {
        let a = post(&http, &jobs, None, Some(body)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{what}: {}", a.body);
        assert_eq!(a.code(), "INVALID_ARGUMENT", "{what}");
        assert!(!a.json()["message"].as_str().unwrap().is_empty());
    }
    for id in ["..%2F..%2Fetc", "%3Cscript%3E", "a%00b", "%E2%80%AE"] {
        let a = get(&http, &format!("{jobs}/{id}"), None).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "GET {id}: {}", a.body);
        let a = post(&http, &format!("{jobs}/{id}/cancel"), None, None).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "cancel {id}: {}", a.body);
    }
    let a = get(&http, &format!("{jobs}?page_size=x"), None).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.body);
    let a = get(&http, &format!("{jobs}?state=SLEEPING"), None).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.body);
    // The path's id and the body's must agree.
    let a = post(
        &http,
        &format!("{jobs}/a/cleanup/abandon"),
        None,
        Some(json!({"job_id": "b"}).to_string()),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.body);

    // What a page on another site, or under a rebound name, would send.
    let good = json!({"job_id": "foreign", "spec": {"command": ["true"]}}).to_string();
    let other_port = format!("http://127.0.0.1:{}", host.port() + 1);
    let own = format!("http://{host}");
    let refusals: [Refusal; 6] = [
        (
            "a rebound name",
            vec![("host", "evil.test")],
            StatusCode::MISDIRECTED_REQUEST,
        ),
        (
            "a rebound name with a port",
            vec![("host", "evil.test:80")],
            StatusCode::MISDIRECTED_REQUEST,
        ),
        (
            "another origin",
            vec![("origin", other_port.as_str())],
            StatusCode::FORBIDDEN,
        ),
        (
            "an opaque origin",
            vec![("origin", "null")],
            StatusCode::FORBIDDEN,
        ),
        (
            "a cross-site fetch",
            vec![("sec-fetch-site", "cross-site")],
            StatusCode::FORBIDDEN,
        ),
        (
            "a form post",
            vec![("content-type", "text/plain")],
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
    ];
    for (what, headers, status) in &refusals {
        let a = send(
            &http,
            Method::POST,
            &jobs,
            None,
            headers,
            Some(good.clone()),
        )
        .await;
        assert_eq!(a.status, *status, "{what}: {}", a.body);
        assert!(
            a.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json"),
            "{what}"
        );
        assert!(
            a.headers
                .keys()
                .all(|k| !k.as_str().starts_with("access-control-")),
            "{what}"
        );
    }
    let a = send(
        &http,
        Method::GET,
        &format!("{base}/api/v1/leader"),
        None,
        &[("host", "evil.test")],
        None,
    )
    .await;
    assert_eq!(
        a.status,
        StatusCode::MISDIRECTED_REQUEST,
        "a read under a rebound name"
    );
    let diff = changed(&before, &etcd_state(&c).await);
    assert!(
        diff.is_empty(),
        "a refused request wrote to etcd: {diff:#?}"
    );

    // The console's own page passes, and so do names that are this server's.
    let a = send(
        &http,
        Method::POST,
        &jobs,
        None,
        &[("origin", own.as_str()), ("sec-fetch-site", "same-origin")],
        Some(good.clone()),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let localhost = format!("localhost:{}", host.port());
    let a = send(
        &http,
        Method::GET,
        &format!("{base}/api/v1/jobs/foreign"),
        None,
        &[("host", localhost.as_str())],
        None,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let a = get(&http, &format!("{base}/api/v1/nothing-here"), None).await;
    assert_eq!(
        (a.status, a.code().as_str()),
        (StatusCode::NOT_FOUND, "NOT_FOUND")
    );
    let doc = get(&http, &format!("{base}/api/v1/openapi.json"), None).await;
    assert_eq!(doc.body, OPENAPI);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_the_api_and_a_certificate_alone_does_not_authorise_a_browser() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let ca = Ca::new("http-ca");
    let ca_pem = ca.save(dir, "ca.pem");
    let (cert, key) = ca.issue(dir, "server", "server");
    let (ccert, ckey) = ca.issue(dir, "client", "ops-robot");
    let file = tokens(dir);
    let c = Cluster::start(http_opts(vec![
        "--tls-cert".into(),
        cert.display().to_string(),
        "--tls-key".into(),
        key.display().to_string(),
        "--tls-client-ca".into(),
        ca_pem.display().to_string(),
        "--tls-client-roles".into(),
        "ops-robot=admin".into(),
        "--auth-tokens-file".into(),
        file.display().to_string(),
    ]));
    let port = c.replica_http[0].port();
    let base = format!("https://127.0.0.1:{port}");
    let root = reqwest::Certificate::from_pem(&std::fs::read(&ca_pem).unwrap()).unwrap();
    let anonymous = reqwest::Client::builder()
        .add_root_certificate(root.clone())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let pem = [
        std::fs::read(&ccert).unwrap(),
        std::fs::read(&ckey).unwrap(),
    ]
    .concat();
    let robot = reqwest::Client::builder()
        .add_root_certificate(root)
        .identity(reqwest::Identity::from_pem(&pem).unwrap())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let leader = format!("{base}/api/v1/leader");
    wait_for(
        "the HTTPS API to name a leader",
        Duration::from_secs(30),
        || async {
            let r = anonymous.get(&leader).bearer_auth(READ).send().await.ok()?;
            (r.status() == StatusCode::OK).then_some(())
        },
    )
    .await;
    let a = send(&anonymous, Method::GET, &leader, None, &[], None).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    let a = send(
        &robot,
        Method::GET,
        &format!("{base}/api/v1/whoami"),
        None,
        &[],
        None,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.json()["name"], "ops-robot");
    assert_eq!(a.json()["role"], "admin");
    // From a page (an Origin, even its own), the certificate alone is not enough.
    let own = format!("https://127.0.0.1:{port}");
    let a = send(
        &robot,
        Method::GET,
        &leader,
        None,
        &[("origin", own.as_str())],
        None,
    )
    .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.body);
    let a = send(
        &robot,
        Method::GET,
        &leader,
        Some(READ),
        &[("origin", own.as_str())],
        None,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    // Plain HTTP on the TLS port gets no answer.
    let plain = client()
        .get(format!("http://127.0.0.1:{port}/api/v1/leader"))
        .send()
        .await;
    assert!(plain.is_err() || plain.unwrap().status() != StatusCode::OK);
}

/// Lists every page of `query`, returning the pages (jobs' ids, whether the scan limit cut
/// it short, its notice).
async fn pages(
    http: &reqwest::Client,
    base: &str,
    query: &str,
) -> Vec<(Vec<String>, bool, String)> {
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let url = format!("{base}/api/v1/jobs?{query}&page_token={token}");
        let a = send(http, Method::GET, &url, None, &[], None).await;
        assert_eq!(a.status, StatusCode::OK, "{url}: {}", a.body);
        let v = a.json();
        let ids = v["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["job_id"].as_str().unwrap().to_string())
            .collect();
        out.push((
            ids,
            v["scan_limit_reached"] == true,
            v["notice"].as_str().unwrap().to_string(),
        ));
        token = v["next_page_token"].as_str().unwrap().to_string();
        if token.is_empty() {
            return out;
        }
        assert!(out.len() < 100, "{query}: no end in sight");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_over_ten_thousand_jobs_is_complete_bounded_and_survives_compaction() {
    use futures_util::StreamExt;
    let c = Cluster::start(http_opts(Vec::new()));
    let base = format!("http://{}", c.replica_http[0]);
    let http = client();
    let url = format!("{base}/api/v1/leader");
    wait_for(
        "the HTTP API to name a leader",
        Duration::from_secs(30),
        || async { answers(&http, &url, None).await.then_some(()) },
    )
    .await;
    // 10,000 jobs no worker may run: they stay PENDING.
    const N: usize = 10_000;
    let ids: Vec<String> = (0..N).map(|i| format!("page-{i:05}")).collect();
    let jobs = format!("{base}/api/v1/jobs");
    futures_util::stream::iter(ids.iter())
        .for_each_concurrent(32, |id| {
            let (http, jobs) = (&http, &jobs);
            async move {
                let body = json!({"job_id": id, "spec": {"command": ["true"], "worker_selector": {"pool": "nowhere"}}});
                let a = send(http, Method::POST, jobs, None, &[], Some(body.to_string())).await;
                assert_eq!(a.status, StatusCode::OK, "{id}: {}", a.body);
            }
        })
        .await;

    // Every job once, in id order, in full pages.
    let all = pages(&http, &base, "page_size=1000").await;
    assert_eq!(all.len(), 10, "pages of 1000");
    assert!(all.iter().all(|(p, short, _)| p.len() == 1000 && !short));
    let listed: Vec<String> = all.into_iter().flat_map(|p| p.0).collect();
    assert_eq!(listed, ids);

    // A search by prefix reads only that prefix.
    let found = pages(&http, &base, "id_prefix=page-042&page_size=30").await;
    let listed: Vec<String> = found.iter().flat_map(|p| p.0.clone()).collect();
    let want: Vec<String> = ids
        .iter()
        .filter(|i| i.starts_with("page-042"))
        .cloned()
        .collect();
    assert_eq!(listed, want);
    assert_eq!(found.len(), 4, "100 jobs in pages of 30");

    // A filter nothing matches: short pages that say so, bounded by the scan limit, to the end.
    let none = pages(&http, &base, "state=RUNNING&page_size=50").await;
    assert!(none.iter().all(|(p, _, _)| p.is_empty()));
    assert!(none[0].1, "the first page does not say it was cut short");
    assert!(
        (2..=3).contains(&none.len()),
        "{} pages for 10,000 entries at 5,000 a request",
        none.len()
    );

    // A token whose revision etcd compacted goes on at the newest revision, with a notice.
    let first = get(&http, &format!("{jobs}?page_size=100"), None).await;
    let token = first.json()["next_page_token"]
        .as_str()
        .unwrap()
        .to_string();
    let extra = json!({"job_id": "page-zzz", "spec": {"command": ["true"], "worker_selector": {"pool": "nowhere"}}});
    let a = post(&http, &jobs, None, Some(extra.to_string())).await;
    assert_eq!(a.status, StatusCode::OK);
    let mut etcd = etcd_client::Client::connect(c.etcd.endpoints(), None)
        .await
        .unwrap();
    let now = etcd
        .get("x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    etcd.compact(now, None).await.unwrap();
    let next = get(
        &http,
        &format!("{jobs}?page_size=100&page_token={token}"),
        None,
    )
    .await;
    assert_eq!(next.status, StatusCode::OK, "{}", next.body);
    let v = next.json();
    assert!(
        v["notice"].as_str().unwrap().contains("compacted"),
        "{}",
        next.body
    );
    assert_eq!(
        v["jobs"][0]["job_id"], "page-00100",
        "it goes on from the same id"
    );
    assert!(v["revision"].as_str().unwrap().parse::<i64>().unwrap() >= now);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_forwards_a_resignation_to_the_leader_with_its_peer_token() {
    let secrets = tempfile::tempdir().unwrap();
    let file = tokens(secrets.path());
    let c = Cluster::start(Options {
        replicas: 2,
        http: true,
        extra_args: vec![
            "--auth-tokens-file".into(),
            file.display().to_string(),
            "--peer-token-file".into(),
            secrets.path().join("peer.token").display().to_string(),
        ],
        ..Options::default()
    });
    let http = client();
    let (old_id, old_term) = agreed_leader(&http, &c, |_| true).await;
    let fi = 1 - c.index_of(&old_id);
    let follower = format!("http://{}", c.replica_http[fi]);
    let body = json!({"term": old_term}).to_string();
    let url = format!("{follower}/api/v1/leader/resign");
    let a = post(&http, &url, Some(SUBMIT), Some(body.clone())).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.body);
    let a = post(&http, &url, Some(ADMIN), Some(body)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.json()["replica_id"], old_id.as_str());
    assert_eq!(a.json()["resigned_term"], old_term.to_string());
    let (_, new_term) = agreed_leader(&http, &c, |t| t > old_term).await;
    // The history shows the resigned term, and the one after it (once it is confirmed).
    let history = format!("{follower}/api/v1/leader/history");
    let terms = wait_for(
        "the new term in the history",
        Duration::from_secs(30),
        || async {
            let h = get(&http, &history, Some(READ)).await;
            let terms = h.json()["terms"].as_array()?.clone();
            terms
                .iter()
                .any(|x| term_of(x) == Some(new_term))
                .then_some(terms)
        },
    )
    .await;
    let find = |t: i64| terms.iter().find(|x| term_of(x) == Some(t)).cloned();
    let ended = find(old_term).expect("the old term in the history");
    assert_eq!(ended["ended_reason"], "resign requested", "{ended}");
    assert_eq!(find(new_term).unwrap()["followed"], old_term.to_string());
    let log = std::fs::read_to_string(c.replicas[fi].log_path()).unwrap();
    assert!(
        log.contains("resign-forward") && log.contains("\"caller\":\"ops\""),
        "no audit line of the forward"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_streams_are_bounded_and_end_when_their_token_is_removed() {
    let secrets = tempfile::tempdir().unwrap();
    let file = tokens(secrets.path());
    let c = Cluster::start(http_opts(vec![
        "--auth-tokens-file".into(),
        file.display().to_string(),
        "--http-max-streams".into(),
        "2".into(),
    ]));
    let base = format!("http://{}", c.replica_http[0]);
    let http = client();
    let leader = format!("{base}/api/v1/leader");
    wait_for(
        "the HTTP API to answer",
        Duration::from_secs(30),
        || async { answers(&http, &leader, Some(READ)).await.then_some(()) },
    )
    .await;
    let events = format!("{base}/api/v1/events");
    let open = |token: &'static str| {
        let (http, events) = (http.clone(), events.clone());
        async move { http.get(&events).bearer_auth(token).send().await.unwrap() }
    };
    let mut first = open(READ).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.headers()["content-type"], "text/event-stream");
    let chunk = String::from_utf8(first.chunk().await.unwrap().unwrap().to_vec()).unwrap();
    assert!(chunk.starts_with("event: snapshot\ndata: {"), "{chunk}");
    let second = open(ADMIN).await;
    assert_eq!(second.status(), StatusCode::OK);
    // The third is one too many.
    let third = get(&http, &events, Some(ADMIN)).await;
    assert_eq!(
        (third.status, third.code().as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE")
    );

    // A submission shows in the stream.
    let spec = json!({"job_id": "seen-live", "spec": {"command": ["true"]}});
    let a = post(
        &http,
        &format!("{base}/api/v1/jobs"),
        Some(SUBMIT),
        Some(spec.to_string()),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let mut seen = String::new();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(c)) = first.chunk().await {
            seen.push_str(&String::from_utf8_lossy(&c));
            if seen.contains("seen-live") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(
        found.ok(),
        Some(true),
        "the job never showed in the stream: {seen}"
    );

    // The read token is removed: its stream ends with an error; the admin's goes on.
    write(
        secrets.path(),
        "tokens.new",
        &format!("{SUBMIT} submit ci\n{ADMIN} admin ops\n"),
    );
    std::fs::rename(secrets.path().join("tokens.new"), &file).unwrap();
    let mut rest = String::new();
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(c)) = first.chunk().await {
            rest.push_str(&String::from_utf8_lossy(&c));
        }
    })
    .await;
    assert!(ended.is_ok(), "the stream outlived its token: {rest}");
    assert!(
        rest.contains("event: error") && rest.contains("UNAUTHENTICATED"),
        "{rest}"
    );
    // Its place is free again.
    let again = open(ADMIN).await;
    assert_eq!(again.status(), StatusCode::OK);
    drop(second);
}
