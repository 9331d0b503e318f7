//! A headless Chromium driven over the Chrome DevTools Protocol, for the console's browser
//! tests: navigate, evaluate JavaScript, click like a mouse, wait for the page, take
//! screenshots, and record every URL the page asked for (requests and WebSockets) and every
//! script error or Content-Security-Policy report.
//!
//! Chromium is Debian's `chromium` (`.ci/run` installs it when missing), or the binary named by
//! `COMPUTE_TEST_CHROMIUM`. It runs with `--host-resolver-rules` that resolve no host but
//! `127.0.0.1`, so a page that tried to reach the internet would fail, and the recorded URLs
//! show the attempt.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::Message;

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;
type Sink = futures_util::stream::SplitSink<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    Message,
>;

/// One browser with one page.
pub struct Browser {
    _child: tokio::process::Child,
    _profile: TempDir,
    sink: tokio::sync::Mutex<Sink>,
    pending: Pending,
    next: std::sync::atomic::AtomicU64,
    session: String,
    /// Every URL the page requested (documents, scripts, fetches, WebSockets).
    pub urls: Arc<Mutex<Vec<String>>>,
    /// Uncaught exceptions, `console.error` calls and CSP violations, as text.
    pub problems: Arc<Mutex<Vec<String>>>,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Browser {
    /// Starts Chromium headless, `width`×`height`, with one blank page attached.
    pub async fn launch(width: u32, height: u32) -> Browser {
        let binary = std::env::var("COMPUTE_TEST_CHROMIUM").unwrap_or_else(|_| "chromium".into());
        static LAUNCHED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let profile = std::env::temp_dir().join(format!(
            "compute-chromium-{}-{}",
            std::process::id(),
            LAUNCHED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&profile).expect("a profile directory");
        let mut child = tokio::process::Command::new(&binary)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--remote-debugging-port=0",
                &format!("--window-size={width},{height}"),
                &format!("--user-data-dir={}", profile.display()),
                "about:blank",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start {binary} ({e}): the browser tests need Chromium (apt-get install \
                     chromium, which .ci/run does), or COMPUTE_TEST_CHROMIUM"
                )
            });
        let stderr = child.stderr.take().expect("stderr");
        let mut lines = BufReader::new(stderr).lines();
        let endpoint = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(at) = line.find("ws://") {
                    return line[at..].trim().to_owned();
                }
            }
            panic!("Chromium exited without printing its DevTools endpoint");
        })
        .await
        .expect("Chromium's DevTools endpoint within 30 s");
        // Keep draining its stderr so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let (ws, _) = tokio_tungstenite::connect_async(endpoint.as_str())
            .await
            .expect("connect to DevTools");
        let (sink, mut stream) = ws.split();
        let pending: Pending = Arc::default();
        let urls: Arc<Mutex<Vec<String>>> = Arc::default();
        let problems: Arc<Mutex<Vec<String>>> = Arc::default();
        {
            let (pending, urls, problems) = (pending.clone(), urls.clone(), problems.clone());
            tokio::spawn(async move {
                while let Some(Ok(msg)) = stream.next().await {
                    let Message::Text(text) = msg else { continue };
                    let Ok(v) = serde_json::from_str::<Value>(&text) else {
                        continue;
                    };
                    if let Some(id) = v["id"].as_u64() {
                        if let Some(tx) = pending.lock().expect("lock").remove(&id) {
                            let _ = tx.send(v);
                        }
                        continue;
                    }
                    record(&v, &urls, &problems);
                }
            });
        }
        let mut browser = Browser {
            _child: child,
            _profile: TempDir(profile),
            sink: tokio::sync::Mutex::new(sink),
            pending,
            next: std::sync::atomic::AtomicU64::new(1),
            session: String::new(),
            urls,
            problems,
        };
        let target = browser
            .call("Target.createTarget", json!({ "url": "about:blank" }))
            .await;
        let attached = browser
            .call(
                "Target.attachToTarget",
                json!({ "targetId": target["targetId"], "flatten": true }),
            )
            .await;
        browser.session = attached["sessionId"]
            .as_str()
            .expect("a session")
            .to_owned();
        for domain in [
            "Page.enable",
            "Network.enable",
            "Runtime.enable",
            "Log.enable",
        ] {
            browser.call(domain, json!({})).await;
        }
        browser
    }

    /// Sends a DevTools command to the page (the browser itself before the page is attached)
    /// and returns its `result`; panics on a protocol error.
    pub async fn call(&self, method: &str, params: Value) -> Value {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if !self.session.is_empty() {
            msg["sessionId"] = json!(self.session);
        }
        let (tx, rx) = oneshot::channel();
        self.pending.lock().expect("lock").insert(id, tx);
        self.sink
            .lock()
            .await
            .send(Message::text(msg.to_string()))
            .await
            .expect("send to DevTools");
        let answer = tokio::time::timeout(Duration::from_secs(60), rx)
            .await
            .unwrap_or_else(|_| panic!("{method}: no answer within 60 s"))
            .expect("an answer");
        assert!(answer["error"].is_null(), "{method}: {}", answer["error"]);
        answer["result"].clone()
    }

    /// Opens `url` and waits for its `load` event (or 30 s).
    pub async fn goto(&self, url: &str) {
        self.call("Page.navigate", json!({ "url": url })).await;
        self.wait_for(
            "document.readyState === 'complete'",
            Duration::from_secs(30),
        )
        .await;
    }

    /// Evaluates `expression` in the page (awaiting a promise) and returns its value; panics
    /// with the exception when it throws.
    pub async fn eval(&self, expression: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "awaitPromise": true, "returnByValue": true }),
            )
            .await;
        assert!(
            r["exceptionDetails"].is_null(),
            "`{expression}` threw: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    /// Waits until `condition` (a JavaScript expression) is truthy.
    pub async fn wait_for(&self, condition: &str, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let r = self
                .call(
                    "Runtime.evaluate",
                    json!({ "expression": format!("!!({condition})"), "returnByValue": true }),
                )
                .await;
            if r["result"]["value"] == json!(true) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "`{condition}` not true within {within:?}; problems: {:?}",
                self.problems.lock().expect("lock")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Clicks the centre of the first element matching `selector` with real mouse events,
    /// `times` times in a row (a double click is `2`), once it is shown (a hidden element has
    /// no box to click).
    pub async fn click(&self, selector: &str, times: u32) {
        let sel = serde_json::to_string(selector).expect("json");
        self.wait_for(
            &format!(
                "(e => e && e.getClientRects().length > 0 && !e.disabled)(document.querySelector({sel}))"
            ),
            Duration::from_secs(30),
        )
        .await;
        let at = self
            .eval(&format!(
                "(() => {{ const e = document.querySelector({sel}); e.scrollIntoView({{block: 'center'}}); \
                 const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
            ))
            .await;
        let (x, y) = (at[0].as_f64().unwrap_or(0.0), at[1].as_f64().unwrap_or(0.0));
        for _ in 0..times {
            for kind in ["mousePressed", "mouseReleased"] {
                self.call(
                    "Input.dispatchMouseEvent",
                    json!({ "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1 }),
                )
                .await;
            }
        }
    }

    /// Sets an input's value as typing would (an `input` and a `change` event).
    pub async fn fill(&self, selector: &str, value: &str) {
        let sel = serde_json::to_string(selector).expect("json");
        let val = serde_json::to_string(value).expect("json");
        self.eval(&format!(
            "(() => {{ const e = document.querySelector({sel}); e.value = {val}; \
             e.dispatchEvent(new Event('input', {{bubbles: true}})); \
             e.dispatchEvent(new Event('change', {{bubbles: true}})); }})()"
        ))
        .await;
    }

    /// Saves a PNG of the page to `path`.
    pub async fn screenshot(&self, path: &Path) {
        let r = self
            .call("Page.captureScreenshot", json!({ "format": "png" }))
            .await;
        let png = decode_base64(r["data"].as_str().expect("data"));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("the screenshot directory");
        }
        std::fs::write(path, png).expect("write the screenshot");
    }
}

fn record(v: &Value, urls: &Mutex<Vec<String>>, problems: &Mutex<Vec<String>>) {
    let p = &v["params"];
    match v["method"].as_str() {
        Some("Network.requestWillBeSent") => {
            if let Some(u) = p["request"]["url"].as_str() {
                urls.lock().expect("lock").push(u.to_owned());
            }
        }
        Some("Network.webSocketCreated") => {
            if let Some(u) = p["url"].as_str() {
                urls.lock().expect("lock").push(u.to_owned());
            }
        }
        Some("Runtime.exceptionThrown") => problems.lock().expect("lock").push(format!(
            "exception: {}",
            p["exceptionDetails"]["exception"]["description"]
                .as_str()
                .unwrap_or_else(|| p["exceptionDetails"]["text"].as_str().unwrap_or("?"))
        )),
        Some("Runtime.consoleAPICalled") if p["type"] == "error" => {
            problems
                .lock()
                .expect("lock")
                .push(format!("console.error: {}", p["args"]));
        }
        Some("Log.entryAdded") => {
            let e = &p["entry"];
            let text = e["text"].as_str().unwrap_or_default();
            if e["level"] == "error" || text.contains("Content Security Policy") {
                problems.lock().expect("lock").push(format!(
                    "log {}: {text} ({})",
                    e["source"],
                    e["url"].as_str().unwrap_or_default()
                ));
            }
        }
        _ => {}
    }
}

/// Standard base64 (with padding), as DevTools sends screenshots.
fn decode_base64(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => 0,
        }
    };
    let bytes: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for chunk in bytes.chunks(4) {
        let pad = chunk.iter().filter(|&&b| b == b'=').count();
        let n = chunk.iter().fold(0u32, |acc, &b| {
            (acc << 6) | if b == b'=' { 0 } else { value(b) }
        });
        let n = n << (6 * (4 - chunk.len() as u32));
        let three = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&three[..3 - pad.min(2)]);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_decodes_what_it_should() {
        assert_eq!(super::decode_base64("aGVsbG8="), b"hello");
        assert_eq!(super::decode_base64("aGk="), b"hi");
        assert_eq!(super::decode_base64("YWJj"), b"abc");
        assert_eq!(super::decode_base64("YQ=="), b"a");
    }
}
