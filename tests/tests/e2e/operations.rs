//! What an operator reads: every metric each binary exports is in `docs/operations.md`'s list,
//! and nothing listed there is missing from the binary; the dashboard and the alert rules in
//! `deploy/` name only listed metrics.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use compute_tests::{TestApp, spawn_app};
use serde_json::json;

/// The metric names a `/metrics` text exports, as a query names them: a counter with `_total`,
/// a histogram by its base name (its `_bucket`, `_sum` and `_count` implied), a gauge as it is.
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let (name, kind) = (parts.next()?, parts.next()?);
            Some(match kind {
                "counter" => format!("{name}_total"),
                _ => name.to_owned(),
            })
        })
        .collect()
}

/// The metric names `docs/operations.md` lists for `binary`: the first cell of each row of the
/// table under `### <binary>` in the metrics section.
fn documented(binary: &str) -> BTreeSet<String> {
    let doc =
        std::fs::read_to_string(root().join("docs/operations.md")).expect("docs/operations.md");
    let start = doc
        .find(&format!("### `{binary}`"))
        .unwrap_or_else(|| panic!("docs/operations.md has no section for {binary}"));
    let rest = &doc[start + 4..];
    let section = &rest[..rest
        .find("\n### ")
        .or_else(|| rest.find("\n## "))
        .unwrap_or(rest.len())];
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|n| n.starts_with("compute_"))
        .map(str::to_owned)
        .collect()
}

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn compare(binary: &str, text: &str) -> BTreeSet<String> {
    let exported = exported(text);
    let documented = documented(binary);
    let unlisted: Vec<_> = exported.difference(&documented).collect();
    let missing: Vec<_> = documented.difference(&exported).collect();
    assert!(
        unlisted.is_empty() && missing.is_empty(),
        "{binary}: exported but not in docs/operations.md: {unlisted:?}; listed but not exported: {missing:?}"
    );
    assert!(
        exported.iter().all(|n| n.starts_with("compute_")),
        "{binary}: every metric is under compute_: {exported:?}"
    );
    exported
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port()
}

/// `/metrics` at `url` once the process serves every family `docs/operations.md` lists for
/// `binary`: a process starts serving a moment before its roles have declared all their metrics,
/// and on a loaded machine that moment is long. What is still unlisted or missing after 30 s is
/// the failure [`compare`] reports.
async fn scrape(app: &TestApp, binary: &str, url: &str) -> String {
    let documented = documented(binary);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut last = String::new();
    loop {
        if let Ok(res) = app.http.get(url).send().await
            && res.status().is_success()
            && let Ok(text) = res.text().await
        {
            if exported(&text) == documented {
                return text;
            }
            last = text;
        }
        if std::time::Instant::now() >= deadline {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn every_metric_of_every_binary_is_listed_and_every_listed_one_exported() {
    let app = spawn_app().await;
    // A request, so that the request families have series (their names are exported either way).
    let (status, _) = app
        .graphql("{ serverTime }", json!({}), Some(&app.member("acme")))
        .await;
    assert_eq!(status, 200);
    let api = compare(
        "compute-api",
        &scrape(&app, "compute-api", &app.url("/metrics")).await,
    );

    let worker_port = free_port();
    let port = worker_port;
    let _worker = tokio::process::Command::new(env!("CARGO_BIN_EXE_test-worker"))
        .args(["--role", "all", "--listen", &format!("127.0.0.1:{port}")])
        .envs(app.db.process_env())
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start a worker process");
    let worker = compare(
        "compute-worker",
        &scrape(
            &app,
            "compute-worker",
            &format!("http://127.0.0.1:{port}/metrics"),
        )
        .await,
    );

    // The fleet's gauges come from the database: the first reading, at the worker's start,
    // gives every reachability and state a series (zero here).
    let read = compute_tests::eventually(
        "the worker reads the fleet's gauges",
        Duration::from_secs(30),
        || async {
            let text = app
                .http
                .get(format!("http://127.0.0.1:{worker_port}/metrics"))
                .send()
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            text.contains("compute_nodes{reachability=\"lost\"} 0")
                .then_some(text)
        },
    )
    .await;
    assert!(
        read.contains("compute_reservations{state=\"pending\"} 0"),
        "{read}"
    );
    assert!(
        read.contains("compute_webhook_sinks{state=\"behind\"} 0"),
        "{read}"
    );

    let port = free_port();
    let state = std::env::temp_dir().join(format!("compute-ops-agent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    // The daemon declares its families when it starts, whether or not a gateway answers; it is
    // pointed at a port nothing listens on, so it keeps retrying (and serving `/metrics`). The
    // test's gateway would refuse this unregistered node for good (`4404`), and the daemon
    // would exit, sometimes before the scrape.
    let nowhere = format!("ws://127.0.0.1:{}/agent", free_port());
    let _agent = tokio::process::Command::new(env!("CARGO_BIN_EXE_test-agent"))
        .args([
            "--url",
            &nowhere,
            "--node-id",
            "node_00000000000000000000000000000001",
        ])
        .arg("--state-dir")
        .arg(&state)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env(
            "COMPUTE_AGENT_TOKEN",
            app.node_token("node_00000000000000000000000000000001"),
        )
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start compute-agent");
    let agent = compare(
        "compute-agent",
        &scrape(
            &app,
            "compute-agent",
            &format!("http://127.0.0.1:{port}/metrics"),
        )
        .await,
    );

    // The dashboard and the alert rules name only metrics some binary exports.
    let all: BTreeSet<String> = api.into_iter().chain(worker).chain(agent).collect();
    for file in [
        "deploy/grafana/compute.json",
        "deploy/prometheus/alerts.yml",
    ] {
        let text = std::fs::read_to_string(root().join(file)).expect(file);
        let mut named = BTreeSet::new();
        let bytes = text.as_bytes();
        let mut i = 0;
        while let Some(at) = text[i..].find("compute_") {
            let begin = i + at;
            let end = begin
                + text[begin..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(text.len() - begin);
            // Only a whole word (`compute_` inside another identifier is not a metric), and not
            // a function's name (`compute_now()` in a summary).
            let word = begin == 0
                || !(bytes[begin - 1].is_ascii_alphanumeric() || bytes[begin - 1] == b'_');
            if word && bytes.get(end) != Some(&b'(') {
                named.insert(text[begin..end].to_owned());
            }
            i = end;
        }
        assert!(!named.is_empty(), "{file} names metrics");
        let unknown: Vec<_> = named
            .iter()
            .filter(|n| {
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| n.strip_suffix(s))
                    .unwrap_or(n);
                !all.contains(*n) && !all.contains(base)
            })
            .collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics no binary exports: {unknown:?}"
        );
    }
}
