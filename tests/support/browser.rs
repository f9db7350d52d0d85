//! A real headless Chromium driven over WebDriver (Debian's `chromium` and `chromium-driver`):
//! one chromedriver per browser on a free loopback port, stopped with its browser on drop.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::wd::WebDriverCompatibleCommand;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

use super::{wait_for, wait_seeing};
use baton::devcluster::free_port;

pub struct Browser {
    pub client: Client,
    driver: Child,
}

/// Chromium's console log (`goog:loggingPrefs`), through chromedriver's log endpoint.
#[derive(Debug)]
struct BrowserLog;

impl WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base: &url::Url,
        session: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base.join(&format!("session/{}/se/log", session.unwrap_or_default()))
    }

    fn method_and_body(&self, _: &url::Url) -> (http::Method, Option<String>) {
        (
            http::Method::POST,
            Some(json!({"type": "browser"}).to_string()),
        )
    }
}

impl Browser {
    /// A fresh browser; `args` are added to Chromium's (say, `--host-resolver-rules=...`).
    pub async fn start(args: &[&str]) -> Browser {
        let port = free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start chromedriver ({e}); install Chromium and its driver: \
                     sudo apt-get install -y chromium chromium-driver (or run scripts/install-deps)"
                )
            });
        let url = format!("http://127.0.0.1:{port}");
        let status = format!("{url}/status");
        wait_for(
            "chromedriver to answer",
            Duration::from_secs(30),
            || async { reqwest::get(&status).await.ok().map(|_| ()) },
        )
        .await;
        let mut chrome_args = vec![
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1280,900",
        ];
        chrome_args.extend_from_slice(args);
        let mut caps = serde_json::Map::new();
        caps.insert("goog:chromeOptions".into(), json!({"args": chrome_args}));
        caps.insert("goog:loggingPrefs".into(), json!({"browser": "ALL"}));
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("cannot open a Chromium session: {e}"));
        Browser { client, driver }
    }

    pub async fn goto(&self, url: &str) {
        self.client.goto(url).await.unwrap();
    }

    /// The text of the first element matching `css`, if there is one now (a page that
    /// redraws may replace it between the find and the read).
    pub async fn text_once(&self, css: &str) -> Option<String> {
        let e = self.client.find(Locator::Css(css)).await.ok()?;
        e.text().await.ok()
    }

    /// The text of the first element matching `css`, waiting for one that can be read.
    pub async fn text(&self, css: &str) -> Option<String> {
        Some(
            wait_for(
                &format!("{css} to be readable"),
                Duration::from_secs(30),
                || self.text_once(css),
            )
            .await,
        )
    }

    /// Waits until the element matching `css` shows text that satisfies `ok`; returns it.
    /// On a timeout, says what the element showed last.
    pub async fn wait_text(&self, what: &str, css: &str, ok: impl Fn(&str) -> bool) -> String {
        wait_seeing(what, Duration::from_secs(45), || async {
            match self.text_once(css).await {
                Some(t) if ok(&t) => Ok(t),
                shown => Err(shown),
            }
        })
        .await
    }

    /// How many elements match `css`.
    pub async fn count(&self, css: &str) -> usize {
        self.client
            .find_all(Locator::Css(css))
            .await
            .map(|v| v.len())
            .unwrap_or(0)
    }

    pub async fn click(&self, css: &str) {
        wait_for(
            &format!("{css} to appear and take a click"),
            Duration::from_secs(30),
            || async {
                let e = self.client.find(Locator::Css(css)).await.ok()?;
                match e.click().await {
                    Ok(()) => Some(()),
                    // The live view re-rendered between the find and the click (a person's
                    // click lands on the new element): find it again.
                    Err(err) if err.is_stale_element_reference() => None,
                    Err(err) => panic!("clicking {css}: {err}"),
                }
            },
        )
        .await;
    }

    /// Runs `script` in the page and returns its value (an async script: call
    /// `arguments[arguments.length - 1]` with the result).
    pub async fn run_async(&self, script: &str) -> Value {
        self.client.execute_async(script, vec![]).await.unwrap()
    }

    pub async fn run(&self, script: &str) -> Value {
        self.client.execute(script, vec![]).await.unwrap()
    }

    /// The browser's console since the last call: `(level, message)`.
    pub async fn log(&self) -> Vec<(String, String)> {
        let v = self.client.issue_cmd(BrowserLog).await.unwrap();
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|e| {
                        (
                            e["level"].as_str().unwrap_or_default().to_string(),
                            e["message"].as_str().unwrap_or_default().to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Fails if the console holds an error or warning (a script error, a CSP violation, a
    /// failed load), other than the ones `expected` matches.
    pub async fn assert_clean_log(&self, expected: impl Fn(&str) -> bool) {
        let bad: Vec<_> = self
            .log()
            .await
            .into_iter()
            .filter(|(level, msg)| (level == "SEVERE" || level == "WARNING") && !expected(msg))
            .collect();
        assert!(bad.is_empty(), "the browser logged: {bad:#?}");
    }

    pub async fn screenshot(&self, path: &std::path::Path) {
        let png = self.client.screenshot().await.unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The driver's process group holds the browser it started.
        let pgid = nix::unistd::Pid::from_raw(-(self.driver.id() as i32));
        let _ = nix::sys::signal::kill(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.driver.wait();
    }
}
