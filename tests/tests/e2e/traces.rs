//! One trace from a request to the machine and back (issue 37, section 1): real `compute-api`
//! and `compute-worker` processes export their spans over OTLP/HTTP (JSON) to a receiver inside
//! this test; a client's `traceparent` is continued by the request, its transaction, the
//! reconcile, the command's dispatch, the node's result and the webhook POST. With the collector
//! down, requests still succeed and the dropped-span counter rises. Without an exporter, the
//! response still names the trace (`X-Trace-Id`, `extensions.traceId`).

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use compute_tests::eventually;
use serde_json::{Value, json};

use crate::instances::CREATE_INSTANCE;
use crate::reservations::{CREATE, input, pool};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn traceparent() -> String {
    format!("00-{TRACE}-{CALLER_SPAN}-01")
}

/// A span as the receiver got it.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    attributes: HashMap<String, Value>,
}

/// What the receiver holds: spans, and the webhook deliveries' `traceparent` headers.
#[derive(Default)]
struct Received {
    spans: Vec<Span>,
    hooks: Vec<Option<String>>,
}

/// OTLP/JSON writes ids as hex (the specification's JSON mapping); anything else is kept as it
/// came, and fails the comparisons.
fn id(v: &Value) -> String {
    v.as_str().unwrap_or("").to_ascii_lowercase()
}

fn attribute_value(v: &Value) -> Value {
    for k in ["stringValue", "intValue", "boolValue", "doubleValue"] {
        if let Some(x) = v.get(k) {
            return x.clone();
        }
    }
    v.clone()
}

fn attributes(list: &Value) -> HashMap<String, Value> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| Some((a["key"].as_str()?.to_owned(), attribute_value(&a["value"]))))
        .collect()
}

fn parse_export(body: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in body["resourceSpans"].as_array().into_iter().flatten() {
        let resource = attributes(&rs["resource"]["attributes"]);
        let service = resource
            .get("service.name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for s in ss["spans"].as_array().into_iter().flatten() {
                out.push(Span {
                    service: service.clone(),
                    trace_id: id(&s["traceId"]),
                    span_id: id(&s["spanId"]),
                    parent: id(&s["parentSpanId"]),
                    name: s["name"].as_str().unwrap_or("").to_owned(),
                    attributes: attributes(&s["attributes"]),
                });
            }
        }
    }
    out
}

/// An OTLP/HTTP receiver (`POST /v1/traces`, JSON) and a webhook receiver (`POST /hook`) on one
/// port.
async fn receiver() -> (String, Arc<Mutex<Received>>) {
    use axum::routing::post;
    let got = Arc::new(Mutex::new(Received::default()));
    let (traces, hooks) = (got.clone(), got.clone());
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            post(move |body: axum::body::Bytes| {
                let got = traces.clone();
                async move {
                    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
                        return (axum::http::StatusCode::BAD_REQUEST, "not JSON");
                    };
                    got.lock().expect("lock").spans.extend(parse_export(&v));
                    (axum::http::StatusCode::OK, "{}")
                }
            }),
        )
        .route(
            "/hook",
            post(move |headers: axum::http::HeaderMap| {
                let got = hooks.clone();
                async move {
                    let tp = headers
                        .get("traceparent")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    got.lock().expect("lock").hooks.push(tp);
                    "ok"
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), got)
}

/// The first span the receiver got that `matches`, once it arrives.
async fn arrived(got: &Arc<Mutex<Received>>, what: &str, matches: impl Fn(&Span) -> bool) -> Span {
    eventually(
        &format!("{what} reaches the collector"),
        Duration::from_secs(30),
        || {
            let found = got
                .lock()
                .expect("lock")
                .spans
                .iter()
                .find(|s| matches(s))
                .cloned();
            async move { found }
        },
    )
    .await
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The environment that turns tracing on, toward `endpoint`, with a short batching delay and
/// export timeout so the test does not wait on defaults.
fn otel_env(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.to_owned()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json".into()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "500".into()),
    ]
}

/// A `compute-api serve` process tracing to `endpoint`; its base URL once ready.
async fn start_api(
    app: &compute_tests::TestApp,
    endpoint: &str,
) -> (tokio::process::Child, String) {
    let env: Vec<_> = app
        .db
        .process_env()
        .into_iter()
        .chain(otel_env(endpoint))
        .collect();
    crate::crash::start_api_with(&env, &["--webhooks-allow-private"]).await
}

/// A request to `base` with the caller's `traceparent`: the body and the `X-Trace-Id` header.
async fn traced(base: &str, token: &str, query: &str, variables: Value) -> (Value, String) {
    let res = reqwest::Client::new()
        .post(format!("{base}/graphql"))
        .bearer_auth(token)
        .header("traceparent", traceparent())
        .json(&json!({ "query": query, "variables": variables }))
        .send()
        .await
        .expect("request");
    let trace_id = res
        .headers()
        .get("x-trace-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    (res.json().await.expect("JSON"), trace_id)
}

/// The node daemon of the traced test.
#[derive(Clone, Copy, PartialEq)]
enum NodeDaemon {
    /// `compute-sim`'s daemon in this process (not exporting: its result carries the dispatch's
    /// context back as it came).
    Simulator,
    /// A real `compute-agent` process, exporting its own spans.
    Agent,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_trace_runs_through_the_request_the_worker_the_node_and_the_webhook() {
    traced_end_to_end(NodeDaemon::Simulator).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_agent_continues_the_trace_and_hands_it_back_with_its_result() {
    traced_end_to_end(NodeDaemon::Agent).await;
}

async fn traced_end_to_end(daemon: NodeDaemon) {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    let acme = app.member("acme");
    let (endpoint, got) = receiver().await;
    // acme's webhook, to the receiver: its deliveries carry the trace on.
    app.ok(
        &acme,
        "mutation($i: CreateEventSinkInput!) { createEventSink(input: $i) { eventSink { id } } }",
        json!({ "i": { "url": format!("{endpoint}/hook") } }),
    )
    .await;

    let (_api, base) = start_api(&app, &endpoint).await;
    let worker_port = free_port();
    let _worker = tokio::process::Command::new(env!("CARGO_BIN_EXE_test-worker"))
        .args([
            "--role",
            "all",
            "--listen",
            &format!("127.0.0.1:{worker_port}"),
        ])
        .arg("--webhooks-allow-private")
        .envs(app.db.process_env())
        .envs(otel_env(&endpoint))
        .env("COMPUTE_SECRETS_KEY", compute_tests::SECRETS_KEY)
        .env(
            "RUST_LOG",
            std::env::var("TRACED_WORKER_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start a worker");

    // The reservation, with the caller's trace.
    let (body, trace_id) = traced(
        &base,
        &acme,
        CREATE,
        input(
            &p.pool,
            "traced",
            json!([{ "gpuCount": 1, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]),
        ),
    )
    .await;
    assert_eq!(trace_id, TRACE, "the response names the caller's trace");
    let r = body["data"]["createReservation"]["reservation"].clone();
    assert_eq!(r["state"], "ACTIVE", "{body}");
    let allocation = r["allocations"][0]["id"]
        .as_str()
        .expect("allocation")
        .to_owned();
    let node = r["allocations"][0]["computeNodeId"]
        .as_str()
        .expect("node")
        .to_owned();

    // The node's daemon, connected to the traced API's gateway.
    let agent_url = format!("{}/agent", base.replace("http://", "ws://"));
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let state = std::env::temp_dir().join(format!("compute-traced-agent-{}", std::process::id()));
    let _agent = match daemon {
        NodeDaemon::Simulator => {
            let config = compute_sim::DaemonConfig {
                url: agent_url,
                token: app.node_token(&node),
                node_id: node.clone(),
                daemon_version: "sim/1".into(),
                journal_id: "j-traced".into(),
                observed_generation: 1,
            };
            tokio::spawn(compute_sim::run_daemon(
                config,
                compute_sim::Behaviour::default(),
                stopped,
                |_, _| {},
            ));
            None
        }
        NodeDaemon::Agent => {
            let _ = std::fs::remove_dir_all(&state);
            Some(
                tokio::process::Command::new(env!("CARGO_BIN_EXE_test-agent"))
                    .args(["--url", &agent_url, "--node-id", &node])
                    .arg("--state-dir")
                    .arg(&state)
                    .args(["--listen", "127.0.0.1:0", "--stop-grace-seconds", "1"])
                    .env("COMPUTE_AGENT_TOKEN", app.node_token(&node))
                    .envs(otel_env(&endpoint))
                    .env("RUST_LOG", "warn")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .kill_on_drop(true)
                    .spawn()
                    .expect("compute-agent starts"),
            )
        }
    };

    // An instance on it, in the same trace: its workflow's command goes to the node and back.
    let (body, _) = traced(
        &base,
        &acme,
        CREATE_INSTANCE,
        json!({ "i": { "allocationId": allocation, "image": "registry.example/train:1",
                       "command": ["/bin/sh", "-c", "sleep 10"], "idempotencyKey": "traced-i" } }),
    )
    .await;
    let instance = body["data"]["createInstance"]["instance"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("an instance: {body}"))
        .to_owned();
    // The worker process retries a failed item after a backoff in simulated time: time moves.
    // (This wait found a lost finish: an item enqueued again while its run finished stayed
    // claimed until its claim expired, a minute; `leases::a_finish_racing_an_enqueue…`.)
    app.db
        .eventually_as_time_passes("the instance runs", Duration::from_secs(30), || async {
            let s = app
                .ok(
                    &acme,
                    "query($id: ID!) { instance(id: $id) { state } }",
                    json!({ "id": instance }),
                )
                .await;
            (s["instance"]["state"] == "RUNNING").then_some(())
        })
        .await;

    // Every hop's span arrives in the caller's trace.
    let wanted: [(&str, &str, &str); 8] = [
        ("compute-api", "POST /graphql", "the HTTP request"),
        ("compute-api", "mutation anonymous", "the GraphQL operation"),
        (
            "compute-api",
            "create_reservation",
            "the reservation's transaction",
        ),
        (
            "compute-worker",
            "reconcile instance",
            "the instance's reconcile",
        ),
        (
            "compute-worker",
            "dispatch node_commands",
            "the command's dispatch",
        ),
        (
            "compute-worker",
            "dispatch_commands",
            "the dispatch's transaction",
        ),
        (
            "compute-api",
            "command result",
            "the node's result, recorded",
        ),
        ("compute-worker", "POST", "a webhook POST"),
    ];
    let spans = eventually(
        "every hop's span reaches the collector",
        Duration::from_secs(30),
        || {
            let got = got.clone();
            async move {
                let spans: Vec<Span> = got
                    .lock()
                    .expect("lock")
                    .spans
                    .iter()
                    .filter(|s| s.trace_id == TRACE)
                    .cloned()
                    .collect();
                wanted
                    .iter()
                    .all(|(service, name, _)| {
                        spans
                            .iter()
                            .any(|s| s.service == *service && s.name == *name)
                    })
                    .then_some(spans)
            }
        },
    )
    .await;
    let find = |service: &str, name: &str| {
        spans
            .iter()
            .find(|s| s.service == service && s.name == name)
            .unwrap_or_else(|| panic!("no {service} span {name}: {spans:#?}"))
    };
    // The request continues the caller's span, with HTTP's and GraphQL's conventions.
    let request = find("compute-api", "POST /graphql");
    assert!(
        spans
            .iter()
            .any(|s| s.name == "POST /graphql" && s.parent == CALLER_SPAN),
        "a request span is the child of the caller's"
    );
    assert_eq!(request.attributes["http.request.method"], "POST");
    assert_eq!(request.attributes["http.route"], "/graphql");
    let operation = find("compute-api", "mutation anonymous");
    assert_eq!(operation.attributes["graphql.operation.type"], "mutation");
    let tx = find("compute-api", "create_reservation");
    assert_eq!(tx.attributes["db.system.name"], "postgresql");
    assert_eq!(tx.attributes["db.query.summary"], "create_reservation");
    // The dispatch is the child of the work item's stored context, not a trace of its own; the
    // node's result is the child of what the daemon answered with.
    let ids: std::collections::HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    for (service, name, what) in wanted.iter().skip(3) {
        let s = find(service, name);
        assert!(
            ids.contains(s.parent.as_str()),
            "{what} ({name}) has its parent in the trace: {s:#?}"
        );
    }
    // The real agent exports its own span for the command, in the trace, and hands its context
    // back: the result is recorded as its child.
    if daemon == NodeDaemon::Agent {
        let received = arrived(&got, "the agent's span", |s| {
            s.service == "compute-agent" && s.name == "receive run_instance"
        })
        .await;
        assert_eq!(received.trace_id, TRACE, "{received:#?}");
        assert!(
            ids.contains(received.parent.as_str()),
            "the agent's span is the child of the dispatch: {received:#?}"
        );
        let result = got
            .lock()
            .expect("lock")
            .spans
            .iter()
            .filter(|s| s.name == "command result" && s.trace_id == TRACE)
            .map(|s| s.parent.clone())
            .collect::<Vec<_>>();
        assert!(
            result.contains(&received.span_id),
            "the result is the child of the agent's span: {result:?}, agent {}",
            received.span_id
        );
    }
    // The webhook receiver was handed the trace.
    let hooks = got.lock().expect("lock").hooks.clone();
    assert!(
        hooks
            .iter()
            .flatten()
            .any(|tp| tp.starts_with(&format!("00-{TRACE}-"))),
        "a webhook POST carries the trace: {hooks:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_collector_down_requests_succeed_and_dropped_spans_are_counted() {
    let app = compute_tests::spawn_app().await;
    // Nothing listens there.
    let down = format!("http://127.0.0.1:{}", free_port());
    let (_api, base) = start_api(&app, &down).await;
    let member = app.member("acme");
    for _ in 0..5 {
        let (body, trace_id) = traced(&base, &member, "{ serverTime }", json!({})).await;
        assert!(body["data"]["serverTime"].is_string(), "{body}");
        assert_eq!(trace_id, TRACE);
    }
    let http = reqwest::Client::new();
    let dropped = eventually(
        "the exporter counts what it could not send",
        Duration::from_secs(30),
        || async {
            let text = http
                .get(format!("{base}/metrics"))
                .send()
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            let line = text
                .lines()
                .find(|l| {
                    l.starts_with("compute_trace_spans_dropped_total{reason=\"export_failed\"}")
                })?
                .to_owned();
            let n: f64 = line.rsplit(' ').next()?.parse().ok()?;
            (n > 0.0).then_some(n)
        },
    )
    .await;
    assert!(dropped >= 1.0);
    // And the API still answers (no request waits on the collector: spans are only queued,
    // `telemetry`'s unit test holds an export forever and spans still end).
    let (body, _) = traced(&base, &member, "{ serverTime }", json!({})).await;
    assert!(body["data"]["serverTime"].is_string());
}

#[tokio::test]
async fn without_an_exporter_the_response_still_names_the_trace() {
    let app = compute_tests::spawn_app().await;
    let http = reqwest::Client::new();
    let ask = |tp: Option<String>| {
        let mut req = http
            .post(app.url("/graphql"))
            .json(&json!({ "query": "{ reservation(id: \"nope\") { id } }" }))
            .bearer_auth(app.member("acme"));
        if let Some(tp) = tp {
            req = req.header("traceparent", tp);
        }
        req.send()
    };
    // The caller's trace is named, in the header and in every error.
    let res = ask(Some(traceparent())).await.expect("request");
    assert_eq!(res.headers()["x-trace-id"], TRACE);
    let body: Value = res.json().await.expect("JSON");
    assert_eq!(body["errors"][0]["extensions"]["traceId"], TRACE, "{body}");
    // An invalid traceparent starts a trace of its own, as the specification asks.
    let res = ask(Some(format!("00-{}-{CALLER_SPAN}-01", "0".repeat(32))))
        .await
        .expect("request");
    let id = res.headers()["x-trace-id"]
        .to_str()
        .expect("ascii")
        .to_owned();
    assert_eq!(id.len(), 32);
    assert_ne!(id, "0".repeat(32));
    let body: Value = res.json().await.expect("JSON");
    assert_eq!(body["errors"][0]["extensions"]["traceId"], id.as_str());
    // Two requests without one are two traces.
    let a = ask(None).await.expect("request").headers()["x-trace-id"].clone();
    let b = ask(None).await.expect("request").headers()["x-trace-id"].clone();
    assert_ne!(a, b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_operation_continues_the_trace_of_connection_init() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;

    let app = compute_tests::spawn_app().await;
    let (endpoint, got) = receiver().await;
    let (_api, base) = start_api(&app, &endpoint).await;
    let mut req = format!("{}/graphql", base.replace("http://", "ws://"))
        .into_client_request()
        .expect("request");
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        "graphql-transport-ws".parse().expect("header"),
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(req)
        .await
        .expect("upgrade");
    let mut send = async |v: Value| {
        ws.send(Message::Text(v.to_string().into()))
            .await
            .expect("send");
    };
    send(json!({ "type": "connection_init", "payload": {
        "Authorization": format!("Bearer {}", app.member("acme")), "traceparent": traceparent() } }))
    .await;
    send(json!({ "id": "1", "type": "subscribe", "payload": { "query": "query Now { serverTime }", "operationName": "Now" } }))
    .await;
    send(json!({ "id": "2", "type": "subscribe", "payload": { "query": "{ nope }" } })).await;
    let mut error = None;
    let mut answered = 0;
    while answered < 2 {
        let Some(Ok(Message::Text(t))) = ws.next().await else {
            panic!("the connection ended")
        };
        let m: Value = serde_json::from_str(t.as_str()).expect("JSON");
        match m["type"].as_str() {
            Some("next") if m["id"] == "1" => answered += 1,
            Some("error") if m["id"] == "2" => {
                error = Some(m["payload"].clone());
                answered += 1;
            }
            _ => {}
        }
    }
    let error = error.expect("the bad operation's error");
    assert_eq!(error[0]["extensions"]["traceId"], TRACE, "{error}");
    let span = arrived(&got, "the operation's span", |s| s.name == "graphql Now").await;
    assert_eq!(span.trace_id, TRACE, "{span:#?}");
    assert_eq!(span.parent, CALLER_SPAN, "{span:#?}");
    assert_eq!(span.attributes["graphql.operation.name"], "Now");
}
