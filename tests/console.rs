//! The console in a real headless Chromium over WebDriver, against real clusters: what a
//! person would see, what the page lets each role do, and what hostile text and foreign pages
//! cannot do.

mod support;

use std::path::Path;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use support::browser::Browser;
use support::pki::*;
use support::*;

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// `method path` on `base` with an optional token and JSON body; the status and JSON answer.
async fn call(
    base: &str,
    method: reqwest::Method,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut r = http().request(method, format!("{base}{path}"));
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if let Some(b) = body {
        r = r
            .header("content-type", "application/json")
            .body(b.to_string());
    }
    let resp = r.send().await.unwrap();
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

async fn submit(base: &str, token: Option<&str>, id: &str, spec: Value) {
    let (status, v) = call(
        base,
        reqwest::Method::POST,
        "/api/v1/jobs",
        token,
        Some(json!({"job_id": id, "spec": spec})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "submit {id}: {v}");
}

async fn job(base: &str, token: Option<&str>, id: &str) -> Value {
    call(
        base,
        reqwest::Method::GET,
        &format!("/api/v1/jobs/{id}"),
        token,
        None,
    )
    .await
    .1
}

/// Waits until `base` answers and names a leader; returns (leader id, term).
async fn leader(base: &str, token: Option<&str>) -> (String, i64) {
    wait_for(
        "the HTTP API to name a leader",
        Duration::from_secs(30),
        || async {
            let mut r = http().get(format!("{base}/api/v1/leader"));
            if let Some(t) = token {
                r = r.bearer_auth(t);
            }
            let v: Value = r.send().await.ok()?.json().await.ok()?;
            let l = &v["leader"];
            Some((
                l["replica_id"].as_str()?.to_string(),
                l["term"].as_str()?.parse().ok()?,
            ))
        },
    )
    .await
}

/// Signs in on the page with `token`.
async fn sign_in(b: &Browser, token: &str) {
    let input = wait_for("the sign-in form", Duration::from_secs(30), || async {
        b.client.find(fantoccini::Locator::Id("token")).await.ok()
    })
    .await;
    input.send_keys(token).await.unwrap();
    b.click("#signin button[type=submit]").await;
    b.wait_text("the caller's name", "#whoami", |t| !t.is_empty())
        .await;
}

/// One replica serving HTTP with the tokens of `file`, whose cleanups need an operator at
/// their first failure; its base URL, once it names a leader.
async fn guarded_replica(file: &Path) -> (Cluster, String) {
    let c = Cluster::start(Options {
        replicas: 1,
        http: true,
        extra_args: vec![
            "--auth-tokens-file".into(),
            file.display().to_string(),
            "--cleanup-strategy".into(),
            "none".into(),
        ],
        ..Options::default()
    });
    let base = format!("http://{}", c.replica_http[0]);
    leader(&base, Some(READ)).await;
    (c, base)
}

fn gate_spec(dir: &Path, gate: &str, text: &str) -> Value {
    json!({
        "command": ["sh", "-c", format!("echo {text}; while [ ! -e {}/{gate} ]; do sleep 0.1; done; echo done", dir.display())],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_the_leader_and_a_job_goes_running_then_finished_without_a_reload() {
    let c = Cluster::start(Options {
        replicas: 3,
        http: true,
        ..Options::default()
    });
    let base = format!("http://{}", c.replica_http[0]);
    let (id, term) = leader(&base, None).await;
    let b = Browser::start(&[]).await;
    b.goto(&format!("{base}/")).await;
    b.wait_text("the leader on the overview", "#overview-leader", |t| {
        t == id
    })
    .await;
    b.wait_text("the term on the overview", "#overview-term", |t| {
        t == term.to_string()
    })
    .await;
    b.wait_text("the live status", "#status", |t| t == "live")
        .await;
    wait_for("three replicas listed", Duration::from_secs(30), || async {
        (b.count("[data-replica]").await == 3).then_some(())
    })
    .await;
    // No reload from here on: this mark would be gone.
    b.run("window.__sameDocument = true; return true;").await;
    let dir = scratch(&c);
    submit(
        &base,
        None,
        "on-screen",
        gate_spec(&dir, "go", "hello-console"),
    )
    .await;
    b.goto(&format!("{base}/#/jobs/on-screen")).await;
    b.wait_text("the job running", "#job-state", |t| t == "running")
        .await;
    b.wait_text("its output", "#log", |t| t.contains("hello-console"))
        .await;
    std::fs::write(dir.join("go"), "").unwrap();
    b.wait_text("the job finished", "#job-state", |t| t == "finished")
        .await;
    assert_eq!(
        b.run("return window.__sameDocument === true;").await,
        json!(true),
        "the page reloaded"
    );
    // The jobs list shows it too.
    b.goto(&format!("{base}/#/jobs")).await;
    b.wait_text(
        "the job in the list",
        "[data-job='on-screen'] .state",
        |t| t == "finished",
    )
    .await;
    b.assert_clean_log(|_| false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_that_keeps_failing_needs_an_operator_and_an_admin_retries_it_from_the_page() {
    let secrets = tempfile::tempdir().unwrap();
    let file = tokens(secrets.path());
    let (c, base) = guarded_replica(&file).await;
    let dir = scratch(&c);
    let fixed = dir.join("fixed");
    let spec = json!({
        "command": ["true"],
        "cleanup_command": ["sh", "-c", format!("[ -e {} ] || {{ echo cleanup-broken >&2; exit 3; }}", fixed.display())],
    });
    submit(&base, Some(SUBMIT), "stuck", spec).await;
    wait_for(
        "the cleanup to need an operator",
        Duration::from_secs(60),
        || async {
            let j = job(&base, Some(READ), "stuck").await;
            (j["cleanup"]["state"] == "CLEANUP_NEEDS_OPERATOR").then_some(())
        },
    )
    .await;

    // A read token sees it, and no button anywhere.
    let b = Browser::start(&[]).await;
    b.goto(&format!("{base}/#/cleanups")).await;
    sign_in(&b, READ).await;
    b.wait_text(
        "the stuck job under needs-operator",
        "#needs-operator [data-job='stuck'] .last-error",
        |t| t.contains("cleanup-broken"),
    )
    .await;
    assert_eq!(
        b.count("button[data-action]").await,
        0,
        "a read token sees buttons"
    );
    for (page, shown) in [
        ("#/", "#overview-leader"),
        ("#/workers", "[data-worker]"),
        ("#/jobs/stuck", "#job-state"),
    ] {
        b.goto(&format!("{base}/{page}")).await;
        b.wait_text("the page", "#status", |t| t == "live").await;
        b.wait_text("the page drawn", shown, |t| !t.is_empty())
            .await;
        assert_eq!(
            b.count("button[data-action]").await,
            0,
            "{page}: a read token sees buttons"
        );
    }
    b.click("#signout").await;

    // An admin retries it from the page, once the cause is fixed.
    b.goto(&format!("{base}/#/cleanups")).await;
    sign_in(&b, ADMIN).await;
    std::fs::write(&fixed, "").unwrap();
    b.click("#needs-operator [data-job='stuck'] button[data-action='retry-cleanup']")
        .await;
    // Nothing happens before the question is answered.
    b.wait_text("the question", "#confirm-text", |t| t.contains("stuck"))
        .await;
    assert_eq!(
        job(&base, Some(READ), "stuck").await["cleanup"]["state"],
        "CLEANUP_NEEDS_OPERATOR"
    );
    b.click("#confirm-yes").await;
    wait_for(
        "the retried cleanup to finish",
        Duration::from_secs(60),
        || async {
            let j = job(&base, Some(READ), "stuck").await;
            (j["cleanup"]["state"] == "CLEANUP_DONE").then_some(())
        },
    )
    .await;
    wait_for(
        "the row to leave the page",
        Duration::from_secs(30),
        || async { (b.count("[data-job='stuck']").await == 0).then_some(()) },
    )
    .await;
    let log = std::fs::read_to_string(c.replicas[0].log_path()).unwrap();
    assert!(
        log.contains(r#""action":"retry-cleanup","job_id":"stuck","caller":"ops""#),
        "no audit line naming the admin"
    );
    b.assert_clean_log(|_| false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_on_a_follower_shows_the_new_term_and_the_failover_after_a_leader_sigkill() {
    let mut c = Cluster::start(Options {
        replicas: 3,
        http: true,
        ..Options::default()
    });
    let (old, term) = leader(&format!("http://{}", c.replica_http[0]), None).await;
    let li = c.index_of(&old);
    let fi = (li + 1) % 3;
    let base = format!("http://{}", c.replica_http[fi]);
    let b = Browser::start(&[]).await;
    b.goto(&format!("{base}/#/history")).await;
    b.wait_text("the current term in the header", "#term", |t| {
        t == term.to_string()
    })
    .await;
    b.wait_text(
        "the term in the history",
        &format!("[data-term='{term}'] td"),
        |t| t == term.to_string(),
    )
    .await;
    c.replicas[li].sigkill();
    let new_term = b
        .wait_text("a new term in the header", "#term", |t| {
            t.parse::<i64>().is_ok_and(|n| n > term)
        })
        .await;
    b.wait_text(
        "the new term in the history",
        &format!("[data-term='{new_term}'] td"),
        |t| t == new_term,
    )
    .await;
    // The killed term ended without a word (a crash); the new one followed it.
    let row = b
        .text(&format!("[data-term='{term}'] .ended"))
        .await
        .unwrap();
    assert_eq!(row, "", "a SIGKILLed leader recorded an end");
    let cells = b.run(&format!("return [...document.querySelectorAll(\"[data-term='{new_term}'] td\")].map(td => td.textContent);")).await;
    assert_eq!(
        cells[3],
        json!(term.to_string()),
        "the new term followed the old one: {cells}"
    );
    assert_eq!(b.text("#status").await.unwrap(), "live");
    b.assert_clean_log(|_| false).await;
}

/// Markup that would run script if a page ever parsed it as HTML.
const IMG: &str = "<img src=x onerror=window.__pwned=1>";
const SCRIPT: &str = "</script><script>window.__pwned=2</script>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_text_from_a_job_shows_literally_and_runs_no_script() {
    let secrets = tempfile::tempdir().unwrap();
    // The submitter's name is markup too.
    let name = "<img/src=x/onerror=window.__pwned=3>";
    let file = write(
        secrets.path(),
        "tokens",
        &format!("{SUBMIT} submit {name}\n{READ} read viewer\n"),
    );
    let (_cluster, base) = guarded_replica(&file).await;
    let spec = json!({
        "command": ["sh", "-c", "printf '%s\\n%s\\n' \"$A\" \"$B\"", IMG, SCRIPT],
        "env": {"A": IMG, "B": SCRIPT},
        "cleanup_command": ["sh", "-c", format!("echo '{IMG}' >&2; exit 3")],
    });
    submit(&base, Some(SUBMIT), "hostile", spec).await;
    wait_for("the cleanup to fail", Duration::from_secs(60), || async {
        let j = job(&base, Some(READ), "hostile").await;
        (j["cleanup"]["state"] == "CLEANUP_NEEDS_OPERATOR").then_some(())
    })
    .await;
    let b = Browser::start(&[]).await;
    b.goto(&format!("{base}/#/jobs/hostile")).await;
    sign_in(&b, READ).await;
    b.wait_text("the output, literally", "#log", |t| {
        t.contains(IMG) && t.contains(SCRIPT)
    })
    .await;
    let command = b.text("#job-command").await.unwrap();
    assert!(
        command.contains(IMG) && command.contains(SCRIPT),
        "{command}"
    );
    assert_eq!(b.text("#job-submitter").await.unwrap(), name);
    assert!(b.text("#cleanup-error").await.unwrap().contains(IMG));
    let env = b
        .run("return [...document.querySelectorAll('.env-value')].map(e => e.textContent);")
        .await;
    assert_eq!(env, json!([IMG, SCRIPT]));
    b.goto(&format!("{base}/#/cleanups")).await;
    b.wait_text(
        "the error in the list",
        "[data-job='hostile'] .last-error",
        |t| t.contains(IMG),
    )
    .await;
    // Nothing ran, nothing was parsed as markup, nothing broke the policy.
    assert_eq!(
        b.run("return window.__pwned === undefined;").await,
        json!(true),
        "a script ran"
    );
    assert_eq!(
        b.count("main img, main script").await,
        0,
        "markup became elements"
    );
    let log = b.log().await;
    assert!(
        log.iter()
            .all(|(_, m)| !m.contains("Content Security Policy")
                && !m.contains("Content-Security-Policy")),
        "a CSP violation: {log:#?}"
    );
    assert!(log.iter().all(|(l, _)| l != "SEVERE"), "errors: {log:#?}");
}

/// A page on another origin: its inline script sends `requests` to `target` and notes what
/// each fetch did.
fn attack_page(target: &str, token: Option<&str>) -> String {
    let auth = token
        .map(|t| format!(", 'Authorization': 'Bearer {t}'"))
        .unwrap_or_default();
    format!(
        r#"<!doctype html><html><body><form id="f" method="POST" action="{target}/api/v1/jobs" enctype="text/plain"><input name='{{"job_id":"form","spec":{{"command":["true"]}},"x":"' value='"}}'></form><script>
window.results = [];
const paths = [["/api/v1/jobs", {{job_id: "foreign", spec: {{command: ["true"]}}}}], ["/api/v1/jobs/victim/cancel", {{}}], ["/api/v1/workers/r1/drain", {{}}], ["/api/v1/leader/resign", {{}}]];
async function go() {{
  for (const [p, body] of paths) {{
    for (const mode of ["cors", "no-cors"]) {{
      try {{
        const headers = mode === "cors" ? {{"Content-Type": "application/json"{auth}}} : {{"Content-Type": "text/plain"}};
        const r = await fetch("{target}" + p, {{method: "POST", mode, headers, body: JSON.stringify(body), credentials: "include"}});
        window.results.push(p + " " + mode + " " + r.status);
      }} catch (e) {{ window.results.push(p + " " + mode + " failed"); }}
    }}
  }}
  window.done = true;
}}
go();
</script></body></html>"#
    )
}

/// What the attack page's script noted, once it has sent everything.
async fn attack_results(b: &Browser) -> Vec<String> {
    wait_for(
        "the attack page to finish",
        Duration::from_secs(30),
        || async { (b.run("return window.done === true;").await == json!(true)).then_some(()) },
    )
    .await;
    let results = b.run("return window.results;").await;
    results
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect()
}

/// Serves `page` at `/` on a free loopback port until dropped.
async fn serve_page(page: String) -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let page = page.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                    page.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    (port, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_from_another_port_or_a_rebound_name_cannot_submit_cancel_drain_or_resign() {
    let c = Cluster::start(Options {
        replicas: 1,
        http: true,
        ..Options::default()
    });
    let port = c.replica_http[0].port();
    let base = format!("http://127.0.0.1:{port}");
    leader(&base, None).await;
    let dir = scratch(&c);
    submit(&base, None, "victim", gate_spec(&dir, "never", "victim")).await;
    // Running, with its worker's `started` record written: the cluster is quiet from here.
    wait_for("the victim running", Duration::from_secs(60), || async {
        let j = job(&base, None, "victim").await;
        (j["state"] == "RUNNING" && j["history"][0]["state"] == "started").then_some(())
    })
    .await;
    let rev = || async {
        // Every key under the cluster with its mod revision.
        let mut e = etcd_client::Client::connect(c.etcd.endpoints(), None)
            .await
            .unwrap();
        let r = e
            .get(
                "/baton/",
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        r.kvs()
            .iter()
            .map(|kv| (kv.key().to_vec(), kv.mod_revision()))
            .collect::<Vec<_>>()
    };
    let before = rev().await;
    let b = Browser::start(&["--host-resolver-rules=MAP evil.test 127.0.0.1"]).await;
    for token in [None, Some("any-token-0123456789")] {
        // Another loopback port: a different origin.
        let (attacker, task) = serve_page(attack_page(&base, token)).await;
        b.goto(&format!("http://127.0.0.1:{attacker}/")).await;
        // A no-cors answer is opaque (status 0) whatever happened: what decides is etcd,
        // compared below. A cors request must fail at its preflight.
        for r in attack_results(&b).await {
            let r = r.as_str();
            if r.contains(" cors ") {
                assert!(r.ends_with("failed"), "a cors request got an answer: {r}");
            }
            assert!(
                !r.ends_with(" 200"),
                "a foreign page's request went through: {r}"
            );
        }
        // A form post (text/plain, no preflight).
        b.run("document.getElementById('f').submit(); return true;")
            .await;
        // The browser lands on Baton's refusal.
        wait_for("the form's answer", Duration::from_secs(30), || async {
            let url = b.client.current_url().await.ok()?;
            (url.port() == Some(port)).then_some(())
        })
        .await;
        b.wait_text("the refusal", "body", |t| t.contains("PERMISSION_DENIED"))
            .await;
        task.abort();

        // A rebound name: the page's origin is evil.test on Baton's own port, so its requests are
        // same-origin to the browser; Baton refuses the Host.
        let evil = format!("http://evil.test:{port}");
        b.goto(&format!("{evil}/")).await;
        let script = attack_page(&evil, token);
        let js = script
            .split("<script>")
            .nth(1)
            .unwrap()
            .split("</script>")
            .next()
            .unwrap()
            .to_string();
        b.run(&js).await;
        for r in attack_results(&b).await {
            let r = r.as_str();
            assert!(
                !r.ends_with(" 200"),
                "a rebound page's request went through: {r}"
            );
            assert!(
                r.ends_with(" 421") || r.ends_with(" 0") || r.ends_with("failed"),
                "{r}"
            );
        }
    }
    let after = rev().await;
    let changed: Vec<String> = after
        .iter()
        .filter(|kv| !before.contains(kv))
        .chain(before.iter().filter(|kv| !after.contains(kv)))
        .map(|(k, r)| format!("{} at {r}", String::from_utf8_lossy(k)))
        .collect();
    assert!(changed.is_empty(), "etcd shows writes: {changed:#?}");
    assert_eq!(job(&base, None, "victim").await["state"], "RUNNING");
    assert_eq!(job(&base, None, "foreign").await["code"], "NOT_FOUND");
    assert_eq!(job(&base, None, "form").await["code"], "NOT_FOUND");
}

/// The README's pictures, from a real cluster: written to `$BATON_SCREENSHOTS` (`make
/// screenshots` points it at `docs/screenshots`), else to a scratch folder. Each must be a PNG
/// of the page as a person sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn screenshots_of_each_page_show_a_live_cluster() {
    let c = Cluster::start(Options {
        replicas: 3,
        http: true,
        workers: 1,
        worker_args: vec!["--labels".into(), "pool=batch".into()],
        extra_args: vec!["--cleanup-strategy".into(), "none".into()],
        ..Options::default()
    });
    let base = format!("http://{}", c.replica_http[0]);
    leader(&base, None).await;
    let dir = scratch(&c);
    for (id, script) in [
        ("nightly-report-20261206", "echo report done"),
        (
            "backup-db-eu",
            "echo dumping; sleep 1; echo 4.2 GiB written",
        ),
        ("resize-images-0042", "exit 3"),
    ] {
        submit(&base, None, id, json!({"command": ["sh", "-c", script]})).await;
    }
    submit(
        &base,
        None,
        "train-model-7",
        json!({"command": ["sh", "-c", format!("for i in 1 2 3 4 5 6; do echo epoch $i: loss 0.$((9 - i)); sleep 0.2; done; while [ ! -e {}/stop ]; do sleep 0.1; done", dir.display())], "worker_selector": {"pool": "batch"}}),
    )
    .await;
    submit(
        &base,
        None,
        "etl-orders",
        json!({"command": ["true"], "cleanup_command": ["sh", "-c", "echo 'bucket s3://staging/orders: access denied' >&2; exit 1"]}),
    )
    .await;
    let (status, v) = call(
        &base,
        reqwest::Method::POST,
        "/api/v1/schedules",
        None,
        Some(json!({"name": "hourly-sync", "definition": {"cron": "0 * * * *", "tz": "Europe/Berlin", "spec": {"command": ["echo", "sync"]}}})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    wait_for("the jobs to settle", Duration::from_secs(60), || async {
        let ops = job(&base, None, "etl-orders").await;
        let run = job(&base, None, "train-model-7").await;
        (ops["cleanup"]["state"] == "CLEANUP_NEEDS_OPERATOR" && run["state"] == "RUNNING")
            .then_some(())
    })
    .await;
    let out = match std::env::var_os("BATON_SCREENSHOTS") {
        Some(d) => std::path::PathBuf::from(d),
        None => dir.join("screenshots"),
    };
    std::fs::create_dir_all(&out).unwrap();
    let b = Browser::start(&[]).await;
    let shots = [
        ("overview", "#/", "#overview-leader"),
        ("jobs", "#/jobs", "[data-job='train-model-7'] .state"),
        ("job", "#/jobs/train-model-7", "#log"),
        (
            "cleanups",
            "#/cleanups",
            "#needs-operator [data-job='etl-orders']",
        ),
        ("schedules", "#/schedules", "[data-schedule='hourly-sync']"),
        ("failovers", "#/history", "[data-term] td"),
    ];
    for (name, page, shown) in shots {
        b.goto(&format!("{base}/{page}")).await;
        b.wait_text(name, shown, |t| !t.is_empty()).await;
        if name == "job" {
            b.wait_text("the log", "#log", |t| t.contains("epoch 6"))
                .await;
        }
        b.wait_text("the live status", "#status", |t| t == "live")
            .await;
        let path = out.join(format!("{name}.png"));
        b.screenshot(&path).await;
        let png = std::fs::read(&path).unwrap();
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 10_000,
            "{name}: not a picture"
        );
    }
    std::fs::write(dir.join("stop"), "").unwrap();
    b.assert_clean_log(|_| false).await;
}
