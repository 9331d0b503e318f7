//! Subscriptions through the real transports: graphql-transport-ws (every close code of its
//! protocol), the legacy graphql-ws, and Server-Sent Events; resuming with a cursor; the
//! late-commit case; tenant isolation; a slow subscriber that falls back to the database and
//! catches up; CURSOR_EXPIRED after pruning; the metrics.

use std::time::Duration;

use compute_api::auth::Role;
use compute_api::tailer::StreamConfig;
use compute_tests::{TestApp, metric, spawn_app, test_db};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

pub(crate) type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

const WAIT: Duration = Duration::from_secs(30);

pub(crate) async fn connect(app: &TestApp, protocol: &str) -> Ws {
    let mut req = format!("ws://{}/graphql", app.addr)
        .into_client_request()
        .expect("request");
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", protocol.parse().expect("header"));
    tokio_tungstenite::connect_async(req)
        .await
        .expect("upgrade")
        .0
}

pub(crate) async fn send(ws: &mut Ws, v: Value) {
    ws.send(Message::Text(v.to_string().into()))
        .await
        .expect("send");
}

/// The next text message, skipping the server's keep-alive pings.
pub(crate) async fn next_msg(ws: &mut Ws) -> Value {
    tokio::time::timeout(WAIT, async {
        loop {
            match ws.next().await.expect("a message").expect("no error") {
                Message::Text(t) => {
                    let v: Value = serde_json::from_str(t.as_str()).expect("json");
                    if v["type"] == "ping" || v["type"] == "ka" {
                        continue;
                    }
                    return v;
                }
                Message::Ping(_) | Message::Pong(_) => continue,
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
    .expect("a message within 30 s")
}

/// Reads until the server closes; returns the close code and reason.
pub(crate) async fn close_of(ws: &mut Ws) -> (u16, String) {
    tokio::time::timeout(WAIT, async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(Some(f)))) => {
                    return (u16::from(f.code), f.reason.to_string());
                }
                Some(Ok(Message::Close(None))) => return (1005, String::new()),
                Some(Ok(_)) => continue,
                other => panic!("expected a close frame, got {other:?}"),
            }
        }
    })
    .await
    .expect("a close within 30 s")
}

pub(crate) async fn init(ws: &mut Ws, token: &str) {
    send(ws, json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } })).await;
    assert_eq!(next_msg(ws).await["type"], "connection_ack");
}

pub(crate) async fn subscribe(
    app: &TestApp,
    token: &str,
    id: &str,
    query: &str,
    variables: Value,
) -> Ws {
    let mut ws = connect(app, "graphql-transport-ws").await;
    init(&mut ws, token).await;
    send(&mut ws, json!({ "id": id, "type": "subscribe", "payload": { "query": query, "variables": variables } })).await;
    ws
}

pub(crate) const EVENTS: &str = "subscription($after: String, $types: [String!]) { events(after: $after, types: $types) { id cursor type tenantId subject data } }";

/// Commits one event per subject, each in its own transaction, in order.
async fn emit(app: &TestApp, tenant: Option<&str>, subjects: &[&str]) {
    for s in subjects {
        sqlx::query("SELECT compute_emit('test.tick', $1, $2, jsonb_build_object('n', $2::text))")
            .bind(tenant)
            .bind(*s)
            .execute(app.db.db.pool())
            .await
            .expect("emit");
    }
}

fn event_of(msg: &Value) -> &Value {
    assert_eq!(msg["type"], "next", "{msg}");
    &msg["payload"]["data"]["events"]
}

/// The subjects of the next `n` events.
async fn subjects(ws: &mut Ws, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..n {
        let msg = next_msg(ws).await;
        let e = event_of(&msg);
        assert_eq!(
            msg["payload"]["extensions"]["cursor"], e["cursor"],
            "each next carries its cursor"
        );
        out.push(e["subject"].as_str().expect("subject").to_owned());
    }
    out
}

/// The cursor of the present, read through the API once it is exact: subscribing after it
/// misses nothing committed from now on, however long the subscription takes to start, and
/// repeats nothing committed before.
///
/// `eventCursor` alone promises only the first half. It stops before the events of every
/// transaction younger than the oldest one still running on the server, in any database (the
/// other tests' included), so a change that committed just before the query can still come
/// after the cursor: the documented repeat at the seam, harmless to a client that deduplicates
/// by event id. These tests count messages exactly, so they read the cursor again until no
/// committed event lies beyond it. (Run as threads of one process through PgBouncer, they used
/// to fail now and then on such a repeat: a node's earlier event delivered after the cursor and
/// showing the node as it was then, a command's `PENDING` event before its `DISPATCHED`.)
pub(crate) async fn now(app: &TestApp) -> Value {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let cursor = app
            .ok(&app.member("acme"), "{ eventCursor }", json!({}))
            .await["eventCursor"]
            .clone();
        let c = compute_domain::outbox::Cursor::decode("after", cursor.as_str().expect("a cursor"))
            .expect("a cursor");
        let beyond: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE (txid::text::bigint, seq) > ($1, $2))",
        )
        .bind(c.txid)
        .bind(c.seq)
        .fetch_one(app.db.db.pool())
        .await
        .expect("events beyond the cursor");
        if !beyond {
            return cursor;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "eventCursor stayed behind committed events for {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn every_close_code_of_graphql_transport_ws() {
    let app = compute_tests::TestApp::builder()
        .on(test_db().await)
        .stream(StreamConfig {
            init_timeout: Duration::from_millis(300),
            ..StreamConfig::default()
        })
        .start()
        .await;
    let member = app.member("acme");

    // 4408: no connection_init in time.
    let mut ws = connect(&app, "graphql-transport-ws").await;
    assert_eq!(
        close_of(&mut ws).await,
        (4408, "Connection initialisation timeout".into())
    );

    // 4429: a second connection_init.
    let mut ws = connect(&app, "graphql-transport-ws").await;
    init(&mut ws, &member).await;
    send(&mut ws, json!({ "type": "connection_init" })).await;
    assert_eq!(
        close_of(&mut ws).await,
        (4429, "Too many initialisation requests".into())
    );

    // 4401: subscribe before the acknowledgement.
    let mut ws = connect(&app, "graphql-transport-ws").await;
    send(
        &mut ws,
        json!({ "id": "1", "type": "subscribe", "payload": { "query": "{ serverTime }" } }),
    )
    .await;
    assert_eq!(close_of(&mut ws).await, (4401, "Unauthorized".into()));

    // 4403: a bad token in connection_init.
    let mut ws = connect(&app, "graphql-transport-ws").await;
    send(
        &mut ws,
        json!({ "type": "connection_init", "payload": { "Authorization": "Bearer nope" } }),
    )
    .await;
    let (code, reason) = close_of(&mut ws).await;
    assert_eq!(code, 4403, "{reason}");
    assert!(reason.starts_with("Forbidden"), "{reason}");
    assert!(reason.len() <= 123);

    // 4409: a subscribe with the id of a running operation.
    let mut ws = subscribe(&app, &member, "dup", EVENTS, json!({})).await;
    send(
        &mut ws,
        json!({ "id": "dup", "type": "subscribe", "payload": { "query": EVENTS } }),
    )
    .await;
    assert_eq!(
        close_of(&mut ws).await,
        (4409, "Subscriber for dup already exists".into())
    );

    // 4400: not JSON, and a type the protocol does not have.
    let mut ws = connect(&app, "graphql-transport-ws").await;
    ws.send(Message::Text("{nope".into())).await.expect("send");
    assert_eq!(
        close_of(&mut ws).await,
        (4400, "Invalid message received: not JSON".into())
    );
    let mut ws = connect(&app, "graphql-transport-ws").await;
    init(&mut ws, &member).await;
    send(&mut ws, json!({ "type": "start", "id": "x" })).await;
    let (code, reason) = close_of(&mut ws).await;
    assert_eq!(code, 4400);
    assert!(reason.contains("`start`"), "{reason}");

    // 4403 again when the token expires while the connection is open. Business time moves to
    // the token's last second (its hour plus the 5 s leeway): it is accepted, and has no time
    // left, so the connection closes at once (no waiting on the wall clock).
    let late = app.token("late", Some("acme"), &[Role::Member]);
    app.db.advance_clock(3600 + 5).await;
    let mut ws = subscribe(&app, &late, "s", EVENTS, json!({})).await;
    assert_eq!(
        close_of(&mut ws).await,
        (4403, "Forbidden: the bearer token has expired".into())
    );
    // And while it is open: the connection's expiry runs on business time, so moving simulated
    // time past the token's hour and leeway closes it at once (on the wall clock it would stay
    // open for the hour).
    let hour = app.token("hour", Some("acme"), &[Role::Member]);
    let mut ws = subscribe(&app, &hour, "s", EVENTS, json!({})).await;
    app.db.advance_clock(3600 + 6).await;
    assert_eq!(
        close_of(&mut ws).await,
        (4403, "Forbidden: the bearer token has expired".into())
    );
}

#[tokio::test]
async fn pings_pongs_keep_alive_and_operation_errors() {
    let app = compute_tests::TestApp::builder()
        .on(test_db().await)
        .stream(StreamConfig {
            keep_alive: Duration::from_millis(200),
            ..StreamConfig::default()
        })
        .start()
        .await;
    let member = app.member("acme");
    let mut ws = connect(&app, "graphql-transport-ws").await;
    init(&mut ws, &member).await;
    send(&mut ws, json!({ "type": "ping", "payload": { "n": 1 } })).await;
    assert_eq!(
        next_msg(&mut ws).await,
        json!({ "type": "pong", "payload": { "n": 1 } })
    );
    // The server pings on its own.
    let ping = tokio::time::timeout(WAIT, async {
        loop {
            if let Message::Text(t) = ws.next().await.expect("msg").expect("ok") {
                let v: Value = serde_json::from_str(t.as_str()).expect("json");
                if v["type"] == "ping" {
                    return v;
                }
            }
        }
    })
    .await
    .expect("a keep-alive ping");
    assert_eq!(ping, json!({ "type": "ping" }));

    // A document that does not validate: one `error` message with the code, and no complete.
    send(
        &mut ws,
        json!({ "id": "v", "type": "subscribe", "payload": { "query": "subscription { nope }" } }),
    )
    .await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "error", "{msg}");
    assert_eq!(msg["id"], "v");
    assert_eq!(
        msg["payload"][0]["extensions"]["code"],
        "GRAPHQL_VALIDATION_FAILED"
    );
    // A document that does not parse: the same, coded as over HTTP.
    send(
        &mut ws,
        json!({ "id": "p", "type": "subscribe", "payload": { "query": "subscription {" } }),
    )
    .await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "error", "{msg}");
    assert_eq!(msg["id"], "p");
    assert_eq!(
        msg["payload"][0]["extensions"]["code"], "GRAPHQL_PARSE_FAILED",
        "{msg}"
    );
    // Sixty unknown fields: at most 50 errors in one response, the last saying so, as over HTTP.
    let unknown: String = (0..60).map(|i| format!("nope{i} ")).collect();
    send(
        &mut ws,
        json!({ "id": "m", "type": "subscribe", "payload": { "query": format!("{{ viewer {{ {unknown} }} }}") } }),
    )
    .await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "error", "{msg}");
    let errors = msg["payload"].as_array().expect("errors");
    assert_eq!(errors.len(), 51, "{msg}");
    assert_eq!(errors[50]["extensions"]["limit"], "errors", "{msg}");
    // A query's one result carries its cost, as over HTTP.
    send(
        &mut ws,
        json!({ "id": "q", "type": "subscribe", "payload": { "query": "{ viewer { subject } }" } }),
    )
    .await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "next", "{msg}");
    assert!(
        msg["payload"]["extensions"]["cost"]["requested"].is_number(),
        "{msg}"
    );
    assert_eq!(next_msg(&mut ws).await["type"], "complete");
    // A subscription that cannot start: `error` with the domain code.
    send(&mut ws, json!({ "id": "c", "type": "subscribe", "payload": { "query": "subscription { events(after: \"zz\") { id } }" } })).await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "error", "{msg}");
    assert_eq!(msg["payload"][0]["extensions"]["code"], "BAD_USER_INPUT");
    send(&mut ws, json!({ "id": "r", "type": "subscribe", "payload": { "query": "subscription { reservation(id: \"rsv_0000000000000000000000000000000a\") { id } }" } })).await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "error", "{msg}");
    assert_eq!(msg["payload"][0]["extensions"]["code"], "NOT_FOUND");
    // The ids of failed operations are free again; a query still gets next then complete.
    send(
        &mut ws,
        json!({ "id": "v", "type": "subscribe", "payload": { "query": "{ viewer { subject } }" } }),
    )
    .await;
    assert_eq!(
        next_msg(&mut ws).await["payload"]["data"]["viewer"]["subject"],
        "alice@acme"
    );
    assert_eq!(
        next_msg(&mut ws).await,
        json!({ "id": "v", "type": "complete" })
    );
}

/// An operation's task writes its own messages and leaves the connection's operations before it
/// writes its last one: a client that reuses an id the moment it reads `complete` (or `error`)
/// is never told the id is still running (4409), and every run gets its own answer.
#[tokio::test]
async fn an_id_is_free_the_moment_its_last_message_is_read() {
    let app = spawn_app().await;
    let member = app.member("acme");
    let mut ws = connect(&app, "graphql-transport-ws").await;
    init(&mut ws, &member).await;
    for n in 0..100 {
        let query = if n % 2 == 0 {
            "{ viewer { subject } }"
        } else {
            "subscription { nope }"
        };
        send(
            &mut ws,
            json!({ "id": "same", "type": "subscribe", "payload": { "query": query } }),
        )
        .await;
        let msg = next_msg(&mut ws).await;
        assert_eq!(msg["id"], "same", "run {n}: {msg}");
        if n % 2 == 0 {
            assert_eq!(
                msg["payload"]["data"]["viewer"]["subject"], "alice@acme",
                "run {n}"
            );
            assert_eq!(
                next_msg(&mut ws).await,
                json!({ "id": "same", "type": "complete" }),
                "run {n}"
            );
        } else {
            assert_eq!(msg["type"], "error", "run {n}: {msg}");
        }
    }
    // Still open: a ping is answered.
    send(&mut ws, json!({ "type": "ping" })).await;
    assert_eq!(next_msg(&mut ws).await, json!({ "type": "pong" }));
}

#[tokio::test]
async fn resume_over_websocket_with_nothing_lost_or_doubled() {
    let app = spawn_app().await;
    let after = now(&app).await;
    let member = app.member("acme");
    let mut ws = subscribe(
        &app,
        &member,
        "e",
        EVENTS,
        json!({ "after": after, "types": ["test.tick"] }),
    )
    .await;
    emit(&app, Some("acme"), &["a", "b"]).await;
    let first = next_msg(&mut ws).await;
    assert_eq!(event_of(&first)["subject"], "a");
    let cursor = event_of(&first)["cursor"].clone();
    // The connection drops before "b" is read; more commit while it is away.
    drop(ws);
    emit(&app, Some("acme"), &["c", "d"]).await;
    let mut ws = subscribe(
        &app,
        &member,
        "e",
        EVENTS,
        json!({ "after": cursor, "types": ["test.tick"] }),
    )
    .await;
    assert_eq!(subjects(&mut ws, 3).await, ["b", "c", "d"]);
    emit(&app, Some("acme"), &["e"]).await;
    assert_eq!(subjects(&mut ws, 1).await, ["e"], "then live, no duplicate");
}

#[tokio::test]
async fn a_late_commit_is_neither_skipped_nor_overtaken_on_the_wire() {
    let app = spawn_app().await;
    let after = now(&app).await;
    let op = app.operator();
    let mut ws = subscribe(
        &app,
        &op,
        "e",
        EVENTS,
        json!({ "after": after, "types": ["test.tick"] }),
    )
    .await;
    // The earlier transaction takes the lower seq and stays open.
    let mut early = app.db.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT compute_emit('test.tick', NULL, 'early', '{}')")
        .execute(&mut *early)
        .await
        .expect("emit early");
    emit(&app, None, &["later"]).await;
    let nothing = tokio::time::timeout(Duration::from_millis(800), next_msg(&mut ws)).await;
    assert!(
        nothing.is_err(),
        "the later event waits for the earlier transaction: {nothing:?}"
    );
    early.commit().await.expect("commit");
    assert_eq!(subjects(&mut ws, 2).await, ["early", "later"]);
}

#[tokio::test]
async fn tenants_see_only_their_own_events() {
    let app = spawn_app().await;
    let after = now(&app).await;
    let mut acme = subscribe(
        &app,
        &app.member("acme"),
        "e",
        EVENTS,
        json!({ "after": after, "types": ["test.tick"] }),
    )
    .await;
    let mut op = subscribe(
        &app,
        &app.operator(),
        "e",
        EVENTS,
        json!({ "after": after, "types": ["test.tick"] }),
    )
    .await;
    emit(&app, Some("globex"), &["theirs"]).await;
    emit(&app, None, &["fleet"]).await;
    emit(&app, Some("acme"), &["ours"]).await;
    assert_eq!(
        subjects(&mut acme, 1).await,
        ["ours"],
        "nothing of globex, nothing of the fleet"
    );
    assert_eq!(subjects(&mut op, 3).await, ["theirs", "fleet", "ours"]);
    // Another tenant's reservation and a node are not a member's to follow.
    let mut ws = subscribe(
        &app,
        &app.member("acme"),
        "n",
        "subscription { computeNode(id: \"node_0000000000000000000000000000000a\") { id } }",
        json!({}),
    )
    .await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "error");
    assert_eq!(msg["payload"][0]["extensions"]["code"], "FORBIDDEN");
}

/// Subscriptions of one shape (the selection, the variables it uses, what the caller may see)
/// share each event's rendered payload, whatever cursor they resumed from; another tenant, or
/// another selection, never gets a payload rendered for someone else (issue 36).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_of_one_shape_share_each_payload_and_tenants_never_do() {
    let app = spawn_app().await;
    const SHAPE: &str = "subscription($after: String, $types: [String!]) { events(after: $after, types: $types) { id cursor tenantId subject data } }";
    let first = now(&app).await;
    emit(&app, Some("acme"), &["earlier"]).await;
    let second = now(&app).await;
    let ticks = json!(["test.tick"]);
    // Three of acme's: two people, two resume points, one shape.
    let mut a1 = subscribe(
        &app,
        &app.member("acme"),
        "a",
        SHAPE,
        json!({ "after": first, "types": ticks }),
    )
    .await;
    let bob = app.token("bob", Some("acme"), &[Role::Member]);
    let mut a2 = subscribe(
        &app,
        &bob,
        "b",
        SHAPE,
        json!({ "after": second, "types": ticks }),
    )
    .await;
    let mut a3 = subscribe(
        &app,
        &app.member("acme"),
        "c",
        SHAPE,
        json!({ "after": second }),
    )
    .await;
    // The same document for another tenant, and another selection for acme.
    let mut g = subscribe(
        &app,
        &app.member("globex"),
        "a",
        SHAPE,
        json!({ "after": second, "types": ticks }),
    )
    .await;
    let mut other = subscribe(
        &app,
        &app.member("acme"),
        "a",
        "subscription($after: String) { events(after: $after, types: [\"test.tick\"]) { subject type } }",
        json!({ "after": second }),
    )
    .await;
    assert_eq!(subjects(&mut a1, 1).await, ["earlier"]);
    let shared = |text: &str| metric(text, "compute_subscription_frames_shared_total");
    let before = shared(&app.metrics().await);
    let names = ["t1", "t2", "t3", "t4", "t5"];
    emit(&app, Some("globex"), &["theirs"]).await;
    emit(&app, Some("acme"), &names).await;
    for _ in names {
        let (m1, m2, m3) = (
            next_msg(&mut a1).await,
            next_msg(&mut a2).await,
            next_msg(&mut a3).await,
        );
        assert_eq!(m1["payload"], m2["payload"], "one shape, one payload");
        assert_eq!(m1["payload"], m3["payload"]);
        assert_eq!(event_of(&m1)["tenantId"], "acme");
        assert_eq!(
            (m1["id"].as_str(), m2["id"].as_str(), m3["id"].as_str()),
            (Some("a"), Some("b"), Some("c")),
            "each frame carries its own operation id"
        );
        let o = next_msg(&mut other).await;
        assert_eq!(event_of(&o)["subject"], event_of(&m1)["subject"]);
        assert_eq!(event_of(&o)["type"], "test.tick");
        assert!(
            event_of(&o).get("id").is_none(),
            "another selection renders its own: {o}"
        );
    }
    let theirs = next_msg(&mut g).await;
    assert_eq!(event_of(&theirs)["subject"], "theirs");
    assert_eq!(event_of(&theirs)["tenantId"], "globex");
    // globex's subscriber gets nothing of acme's five: its next message is the next event of its own.
    emit(&app, Some("globex"), &["theirs-too"]).await;
    assert_eq!(event_of(&next_msg(&mut g).await)["subject"], "theirs-too");
    let after = shared(&app.metrics().await);
    assert!(
        after - before >= 1.0,
        "three subscriptions of one shape rendered every one of five events themselves ({before} -> {after})"
    );
}

#[tokio::test]
async fn a_slow_subscriber_falls_back_to_the_database_and_catches_up() {
    // Channels of 2 events and a ring of 4: a burst of 60 events overflows both, so every
    // subscriber behind it must read the database to catch up.
    let app = compute_tests::TestApp::builder()
        .on(test_db().await)
        .stream(StreamConfig {
            channel_capacity: 2,
            ring: 4,
            ..StreamConfig::default()
        })
        .start()
        .await;
    let after = now(&app).await;
    let member = app.member("acme");
    let mut slow = subscribe(
        &app,
        &member,
        "e",
        EVENTS,
        json!({ "after": after, "types": ["test.tick"] }),
    )
    .await;
    let mut fast = subscribe(
        &app,
        &member,
        "e",
        EVENTS,
        json!({ "after": after, "types": ["test.tick"] }),
    )
    .await;
    // Both feeds must be on the live channel before the burst, or one may simply read it from
    // the database from the start.
    open_subscriptions(&app, 2).await;
    // One transaction, so the tailer reads and publishes the 60 at once.
    sqlx::query("SELECT compute_emit('test.tick', 'acme', 's' || lpad(g::text, 2, '0'), '{}') FROM generate_series(1, 60) g")
        .execute(app.db.db.pool())
        .await
        .expect("burst");
    let expected: Vec<String> = (1..=60).map(|g| format!("s{g:02}")).collect();
    // The fast one reads everything while the slow one reads nothing.
    assert_eq!(subjects(&mut fast, 60).await, expected);
    emit(&app, Some("acme"), &["after"]).await;
    assert_eq!(subjects(&mut fast, 1).await, ["after"]);
    // The slow one then gets every event, in order, once, and rejoins the live stream.
    let mut all = expected.clone();
    all.push("after".into());
    assert_eq!(subjects(&mut slow, 61).await, all);
    emit(&app, Some("acme"), &["live"]).await;
    assert_eq!(subjects(&mut slow, 1).await, ["live"]);
    let metrics = app.metrics().await;
    let fallbacks: f64 = metric(&metrics, "compute_subscription_fallbacks_total");
    assert!(
        fallbacks >= 2.0,
        "both fell behind the channel and caught up: {fallbacks}"
    );
    assert_eq!(metric(&metrics, "compute_subscriptions_open"), 2.0);
    assert!(metric(&metrics, "compute_subscription_events_delivered_total") >= 124.0);
}

/// Waits until the server has `n` subscriptions running (each has joined the tailer).
async fn open_subscriptions(app: &TestApp, n: usize) {
    compute_tests::eventually(&format!("{n} subscriptions running"), WAIT, || async {
        let m = app.metrics().await;
        (metric(&m, "compute_subscriptions_open") >= n as f64).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_cursor_before_the_pruned_front_is_expired() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2030-01-01T00:00:00Z").await;
    let after = now(&app).await;
    let member = app.member("acme");
    let mut ws = subscribe(
        &app,
        &member,
        "e",
        EVENTS,
        json!({ "after": after, "types": ["test.tick"] }),
    )
    .await;
    emit(&app, Some("acme"), &["old", "older"]).await;
    let old = next_msg(&mut ws).await;
    let cursor = event_of(&old)["cursor"].clone();
    let older = next_msg(&mut ws).await;
    assert_eq!(event_of(&older)["subject"], "older");
    let older_cursor = event_of(&older)["cursor"].clone();
    app.db.advance_clock(8 * 24 * 3600).await;
    // A week is past the subscriber's token: its connection ends (business time).
    assert_eq!(
        close_of(&mut ws).await,
        (4403, "Forbidden: the bearer token has expired".into())
    );
    emit(&app, Some("acme"), &["new"]).await;
    // Both old events go; the front is "older", so a client that saw only "old" has lost one.
    // The pruner leaves events at or past the cluster's snapshot xmin, which an open transaction
    // of another test (another database, the same server) can hold back for a moment: it runs
    // again until they are gone, as the hourly pruner would.
    let deadline = std::time::Instant::now() + WAIT;
    let mut pruned = 0;
    loop {
        pruned += compute_domain::outbox::prune(
            &app.db.db,
            compute_domain::outbox::RETENTION,
            None,
            1000,
        )
        .await
        .expect("prune");
        let (left,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM outbox WHERE subject IN ('old', 'older')")
                .fetch_one(app.db.db.pool())
                .await
                .expect("count");
        if left == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the week-old events are pruned: {left} left after {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pruned >= 2, "the week-old events are pruned");
    // A client that reconnects, to another API process, with the cursor of "old".
    let other = compute_tests::TestApp::builder()
        .sharing(&app)
        .start()
        .await;
    // Its token is new: the first expired in the week that passed.
    let member = other.member("acme");
    let mut again = subscribe(&other, &member, "e", EVENTS, json!({ "after": cursor })).await;
    let msg = next_msg(&mut again).await;
    assert_eq!(msg["type"], "error", "{msg}");
    assert_eq!(msg["payload"][0]["extensions"]["code"], "CURSOR_EXPIRED");
    // The new event was kept: a cursor after the pruned front still works.
    let mut fresh = subscribe(
        &other,
        &member,
        "f",
        EVENTS,
        json!({ "after": older_cursor, "types": ["test.tick"] }),
    )
    .await;
    let front = next_msg(&mut fresh).await;
    assert_eq!(event_of(&front)["subject"], "new");
}

#[tokio::test]
async fn the_legacy_graphql_ws_protocol() {
    let app = spawn_app().await;
    let after = now(&app).await;
    let member = app.member("acme");
    let mut ws = connect(&app, "graphql-ws").await;
    send(&mut ws, json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {member}") } })).await;
    assert_eq!(next_msg(&mut ws).await["type"], "connection_ack");
    send(&mut ws, json!({ "id": "1", "type": "start", "payload": { "query": EVENTS, "variables": { "after": after, "types": ["test.tick"] } } })).await;
    emit(&app, Some("acme"), &["x"]).await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "data", "{msg}");
    assert_eq!(msg["id"], "1");
    assert_eq!(msg["payload"]["data"]["events"]["subject"], "x");
    send(
        &mut ws,
        json!({ "id": "2", "type": "start", "payload": { "query": "subscription { nope }" } }),
    )
    .await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(msg["type"], "error");
    assert_eq!(
        msg["payload"][0]["extensions"]["code"],
        "GRAPHQL_VALIDATION_FAILED"
    );
    send(&mut ws, json!({ "id": "1", "type": "stop" })).await;
    // Messages are handled in order: once query 3 has completed, the stop was handled too.
    let query = |id: &str| json!({ "id": id, "type": "start", "payload": { "query": "{ viewer { subject } }" } });
    send(&mut ws, query("3")).await;
    assert_eq!(next_msg(&mut ws).await["id"], "3");
    assert_eq!(
        next_msg(&mut ws).await,
        json!({ "id": "3", "type": "complete" })
    );
    emit(&app, Some("acme"), &["y"]).await;
    send(&mut ws, query("4")).await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(
        (msg["type"].clone(), msg["id"].clone()),
        (json!("data"), json!("4")),
        "nothing more of the stopped one: {msg}"
    );
    assert_eq!(
        next_msg(&mut ws).await,
        json!({ "id": "4", "type": "complete" })
    );
    let mut bad = connect(&app, "graphql-ws").await;
    send(
        &mut bad,
        json!({ "type": "connection_init", "payload": { "Authorization": "Bearer nope" } }),
    )
    .await;
    assert_eq!(next_msg(&mut bad).await["type"], "connection_error");
    assert_eq!(close_of(&mut bad).await.0, 4403);
}

/// One server-sent event.
#[derive(Debug, Default, Clone)]
pub(crate) struct Sse {
    pub(crate) event: String,
    id: Option<String>,
    pub(crate) data: String,
}

pub(crate) struct SseStream {
    res: reqwest::Response,
    buf: String,
}

impl SseStream {
    pub(crate) async fn open(
        app: &TestApp,
        token: &str,
        body: Value,
        last_event_id: Option<&str>,
    ) -> (u16, SseStream) {
        let mut req = app
            .http
            .post(app.url("/graphql/stream"))
            .header("Accept", "text/event-stream")
            .bearer_auth(token)
            .json(&body);
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id);
        }
        let res = req.send().await.expect("POST /graphql/stream");
        let status = res.status().as_u16();
        assert_eq!(
            res.headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("text/event-stream")
        );
        (
            status,
            SseStream {
                res,
                buf: String::new(),
            },
        )
    }

    /// The next event, skipping keep-alive comments.
    pub(crate) async fn next(&mut self) -> Sse {
        tokio::time::timeout(WAIT, async {
            loop {
                if let Some(end) = self.buf.find("\n\n") {
                    let block: String = self.buf.drain(..end + 2).collect();
                    let mut e = Sse::default();
                    for line in block.lines() {
                        if let Some(v) = line.strip_prefix("event:") {
                            e.event = v.trim().to_owned();
                        } else if let Some(v) = line.strip_prefix("id:") {
                            e.id = Some(v.trim().to_owned());
                        } else if let Some(v) = line.strip_prefix("data:") {
                            e.data.push_str(v.trim_start());
                        }
                    }
                    if e.event.is_empty() {
                        continue; // a comment
                    }
                    return e;
                }
                let chunk = self
                    .res
                    .chunk()
                    .await
                    .expect("read")
                    .expect("the stream is open");
                self.buf
                    .push_str(std::str::from_utf8(&chunk).expect("utf-8"));
            }
        })
        .await
        .expect("an event within 30 s")
    }

    async fn subjects(&mut self, n: usize) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for _ in 0..n {
            let e = self.next().await;
            assert_eq!(e.event, "next", "{e:?}");
            let v: Value = serde_json::from_str(&e.data).expect("json");
            let ev = &v["data"]["events"];
            assert_eq!(
                e.id.as_deref(),
                ev["cursor"].as_str(),
                "the id line holds the cursor"
            );
            out.push((
                ev["subject"].as_str().expect("subject").to_owned(),
                e.id.expect("id"),
            ));
        }
        out
    }
}

#[tokio::test]
async fn sse_streams_and_resumes_with_last_event_id() {
    let app = spawn_app().await;
    let after = now(&app).await;
    let member = app.member("acme");
    let body = json!({ "query": EVENTS, "variables": { "after": after, "types": ["test.tick"] } });
    let (status, mut sse) = SseStream::open(&app, &member, body.clone(), None).await;
    assert_eq!(status, 200);
    emit(&app, Some("acme"), &["a", "b"]).await;
    let got = sse.subjects(2).await;
    assert_eq!(got[0].0, "a");
    assert_eq!(got[1].0, "b");
    let last = got[0].1.clone();
    drop(sse); // the connection drops after "a" was handled
    emit(&app, Some("acme"), &["c"]).await;
    let (_, mut sse) = SseStream::open(&app, &member, body.clone(), Some(&last)).await;
    let got: Vec<String> = sse.subjects(2).await.into_iter().map(|(s, _)| s).collect();
    assert_eq!(
        got,
        ["b", "c"],
        "from Last-Event-ID: nothing lost, nothing doubled"
    );
    emit(&app, Some("acme"), &["d"]).await;
    assert_eq!(sse.subjects(1).await[0].0, "d");

    // The same on /graphql with Accept: text/event-stream, and a query ends with complete.
    let res = app
        .http
        .post(app.url("/graphql"))
        .header("Accept", "text/event-stream")
        .bearer_auth(&member)
        .json(&json!({ "query": "{ viewer { subject } }" }))
        .send()
        .await
        .expect("post");
    let mut q = SseStream {
        res,
        buf: String::new(),
    };
    let e = q.next().await;
    assert_eq!(e.event, "next");
    assert!(e.data.contains("alice@acme"), "{e:?}");
    assert_eq!(q.next().await.event, "complete");

    // urql's default Accept names the event stream beside the JSON types, at the same quality:
    // a query is answered in JSON (its cost included), a subscription streams.
    const URQL: &str = "application/graphql-response+json, application/graphql+json, application/json, text/event-stream, multipart/mixed";
    let res = app
        .http
        .post(app.url("/graphql"))
        .header("Accept", URQL)
        .bearer_auth(&member)
        .json(&json!({ "query": "{ viewer { subject } }" }))
        .send()
        .await
        .expect("post");
    assert_eq!(
        res.headers()["content-type"],
        "application/graphql-response+json; charset=utf-8"
    );
    let v: Value = res.json().await.expect("json");
    assert_eq!(v["data"]["viewer"]["subject"], "alice@acme", "{v}");
    assert!(v["extensions"]["cost"].is_object(), "{v}");
    let res = app
        .http
        .post(app.url("/graphql"))
        .header("Accept", URQL)
        .bearer_auth(&member)
        .json(&json!({ "query": EVENTS, "variables": { "after": last, "types": ["test.tick"] } }))
        .send()
        .await
        .expect("post");
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let mut urql = SseStream {
        res,
        buf: String::new(),
    };
    let got: Vec<String> = urql.subjects(3).await.into_iter().map(|(s, _)| s).collect();
    assert_eq!(
        got,
        ["b", "c", "d"],
        "the subscription streams from its cursor"
    );
    // A stream refused by quality is not one: the subscription is a plain request's error.
    let res = app
        .http
        .post(app.url("/graphql"))
        .header("Accept", "application/json, text/event-stream;q=0")
        .bearer_auth(&member)
        .json(&json!({ "query": EVENTS }))
        .send()
        .await
        .expect("post");
    assert_eq!(
        res.headers()["content-type"],
        "application/json; charset=utf-8"
    );
    let v: Value = res.json().await.expect("json");
    assert_eq!(v["errors"][0]["extensions"]["code"], "BAD_REQUEST", "{v}");
    // A mutation over GET is 405 on the stream too, with `Allow: POST`.
    let res = app
        .http
        .get(app.url("/graphql/stream"))
        .query(&[(
            "query",
            "mutation { cancelReservation(input: { id: \"rsv_x\" }) { __typename } }",
        )])
        .header("Accept", "text/event-stream")
        .bearer_auth(&member)
        .send()
        .await
        .expect("get");
    assert_eq!(res.status().as_u16(), 405);
    assert_eq!(res.headers()["allow"], "POST");

    // A validation error is a `next` with errors on an accepted stream, then complete.
    let (status, mut bad) = SseStream::open(
        &app,
        &member,
        json!({ "query": "subscription { nope }" }),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let e = bad.next().await;
    let v: Value = serde_json::from_str(&e.data).expect("json");
    assert_eq!(
        v["errors"][0]["extensions"]["code"],
        "GRAPHQL_VALIDATION_FAILED"
    );
    assert_eq!(bad.next().await.event, "complete");
    // A bad token is 401, so an EventSource does not retry it.
    let (status, _) = SseStream::open(&app, "nope", body, None).await;
    assert_eq!(status, 401);
    // A token that expires while the stream is open ends it: UNAUTHENTICATED, then complete.
    // (Business time moves to the token's last second, so it ends at once.)
    let late_token = app.token("late", Some("acme"), &[Role::Member]);
    app.db.advance_clock(3600 + 5).await;
    let (status, mut late) = SseStream::open(
        &app,
        &late_token,
        json!({ "query": EVENTS, "variables": { "types": ["test.tick"] } }),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let e = late.next().await;
    let v: Value = serde_json::from_str(&e.data).expect("json");
    assert_eq!(
        v["errors"][0]["extensions"]["code"], "UNAUTHENTICATED",
        "{e:?}"
    );
    assert_eq!(late.next().await.event, "complete");
}

#[tokio::test]
async fn pool_capacity_follows_reservations_on_the_pool() {
    let app = spawn_app().await;
    // `reservations::input` ends at 2031-01-01T02:00Z: a reservation of two hours, not years.
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = crate::reservations::pool(&app).await;
    let after = now(&app).await;
    let member = app.member("acme");
    let mut ws = subscribe(
        &app,
        &member,
        "p",
        "subscription($id: ID!, $after: String) { poolCapacity(id: $id, after: $after) { id capacity { kind total free } } }",
        json!({ "id": p.pool, "after": after }),
    )
    .await;
    app.ok(
        &member,
        crate::reservations::CREATE,
        crate::reservations::input(&p.pool, "dash", json!([{ "gpuCount": 2 }])),
    )
    .await;
    // The fleet's own setup events can still arrive first (the reader waits for older
    // transactions cluster-wide); each update is the pool as it is now, so wait for the one
    // that shows the reservation.
    let booked = |msg: &Value| {
        assert_eq!(msg["type"], "next", "{msg}");
        let pool = &msg["payload"]["data"]["poolCapacity"];
        assert_eq!(pool["id"], json!(p.pool));
        assert!(msg["payload"]["extensions"]["cursor"].is_string());
        let gpu = pool["capacity"]
            .as_array()
            .expect("capacity")
            .iter()
            .find(|c| c["kind"] == "GPU")
            .expect("a GPU row")
            .clone();
        gpu["total"].as_i64().expect("total") - gpu["free"].as_i64().expect("free")
    };
    let mut seen = Vec::new();
    loop {
        let n = booked(&next_msg(&mut ws).await);
        seen.push(n);
        if n == 2 {
            break;
        }
        assert!(
            seen.len() < 20,
            "the two GPUs just reserved never showed as booked: {seen:?}"
        );
    }
}

/// The cursor of the last event in the outbox, as the streams write it.
async fn last_event_cursor(app: &TestApp) -> String {
    let (txid, seq): (i64, i64) = sqlx::query_as(
        "SELECT txid::text::bigint, seq FROM outbox ORDER BY txid::text::bigint DESC, seq DESC LIMIT 1",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("an event");
    compute_domain::outbox::Cursor { txid, seq }.encode()
}

/// A member's `poolCapacity` stream is paced: the changes of one interval (here two other
/// tenant's reservations, read together on the catch-up) make one item, at the last one's
/// cursor, so a member cannot watch another tenant's activity event by event. An operator of
/// the pool, subscribed after the same cursor, gets an item for each change.
#[tokio::test]
async fn a_members_pool_capacity_stream_is_paced_an_operators_shows_every_change() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = crate::reservations::pool(&app).await;
    let op = app.operator();
    crate::reservations::quota_for(&app, "globex", &p.pool).await;
    let other = app.member("globex");
    let create = |key: &str| crate::reservations::input(&p.pool, key, json!([{ "gpuCount": 1 }]));
    let after = now(&app).await;
    let mut ids = Vec::new();
    for key in ["g1", "g2"] {
        let d = app
            .ok(&other, crate::reservations::CREATE, create(key))
            .await;
        ids.push(
            d["createReservation"]["reservation"]["id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let second = last_event_cursor(&app).await;
    const Q: &str = "subscription($id: ID!, $after: String) { poolCapacity(id: $id, after: $after) { capacity { kind total free } } }";
    let item = |msg: &Value| -> (String, i64) {
        assert_eq!(msg["type"], "next", "{msg}");
        let gpu = msg["payload"]["data"]["poolCapacity"]["capacity"]
            .as_array()
            .expect("capacity")
            .iter()
            .find(|c| c["kind"] == "GPU")
            .expect("a GPU row")
            .clone();
        (
            msg["payload"]["extensions"]["cursor"]
                .as_str()
                .expect("a cursor")
                .to_owned(),
            gpu["total"].as_i64().expect("total") - gpu["free"].as_i64().expect("free"),
        )
    };
    let vars = json!({ "id": p.pool, "after": after });
    let mut operator = subscribe(&app, &op, "o", Q, vars.clone()).await;
    let mut operator_items = Vec::new();
    loop {
        let (cursor, _) = item(&next_msg(&mut operator).await);
        operator_items.push(cursor.clone());
        if cursor == second {
            break;
        }
    }
    assert!(
        operator_items.len() >= 2,
        "the operator sees each change: {operator_items:?}"
    );
    let member = app.member("acme");
    let mut ws = subscribe(&app, &member, "m", Q, vars).await;
    assert_eq!(
        item(&next_msg(&mut ws).await),
        (second.clone(), 2),
        "one item for both of the other tenant's reservations, at the last one's cursor"
    );
    // The next item is the next interval's (one of the two released), not a second item for
    // the catch-up.
    app.ok(
        &other,
        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
        json!({ "i": { "id": ids[0] } }),
    )
    .await;
    let third = last_event_cursor(&app).await;
    assert_ne!(third, second);
    assert_eq!(item(&next_msg(&mut ws).await), (third, 1));
}

/// Shutdown ends every subscription without `complete`: to graphql-ws and graphql-sse clients
/// (and an `EventSource` application) `complete` means the operation is over, and they would
/// not subscribe again. A WebSocket closes `1001 Going Away`, which graphql-ws's client retries;
/// an SSE stream just ends, and an `EventSource` reconnects with `Last-Event-ID`.
#[tokio::test]
async fn shutdown_ends_subscriptions_without_complete_so_clients_come_back() {
    let app = spawn_app().await;
    let member = app.member("acme");
    let mut ws = subscribe(&app, &member, "e", EVENTS, json!({})).await;
    let (status, mut sse) = SseStream::open(&app, &member, json!({ "query": EVENTS }), None).await;
    assert_eq!(status, 200);
    // The subscriptions are running once the server counts them.
    open_subscriptions(&app, 2).await;
    let closing = tokio::spawn(async move {
        let mut seen = Vec::new();
        let close = tokio::time::timeout(WAIT, async {
            loop {
                match ws.next().await {
                    Some(Ok(Message::Close(Some(f)))) => {
                        return (u16::from(f.code), f.reason.to_string());
                    }
                    Some(Ok(Message::Text(t))) => seen.push(t.to_string()),
                    Some(Ok(_)) => continue,
                    other => panic!("expected a close frame, got {other:?}"),
                }
            }
        })
        .await
        .expect("a close");
        (seen, close)
    });
    let ended = tokio::spawn(async move {
        let mut rest = std::mem::take(&mut sse.buf);
        while let Ok(Some(chunk)) = sse.res.chunk().await {
            rest.push_str(&String::from_utf8_lossy(&chunk));
        }
        rest
    });
    app.shutdown().await;
    let (seen, close) = closing.await.expect("join");
    assert!(seen.iter().all(|m| !m.contains("complete")), "{seen:?}");
    assert_eq!(close, (1001, "server shutting down".into()));
    let rest = tokio::time::timeout(WAIT, ended)
        .await
        .expect("the stream ends")
        .expect("join");
    assert!(!rest.contains("event: complete"), "{rest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compute_node_subscription_shows_liveness_live() {
    let app = spawn_app().await;
    let p = crate::reservations::pool(&app).await;
    let node = p.nodes[0].clone();
    let after = now(&app).await;
    let mut ws = subscribe(
        &app,
        &app.operator(),
        "n",
        "subscription($id: ID!, $after: String) { computeNode(id: $id, after: $after) { reachability session { epoch open } } }",
        json!({ "id": node, "after": after }),
    )
    .await;
    let daemon = compute_sim::DaemonConfig {
        url: app.agent_url(),
        token: app.node_token(&node),
        node_id: node.clone(),
        daemon_version: "sim/1".into(),
        journal_id: "j1".into(),
        observed_generation: 0,
    };
    let session = compute_sim::Session::open(&daemon).await.expect("open");
    let msg = next_msg(&mut ws).await;
    assert_eq!(
        msg["payload"]["data"]["computeNode"],
        json!({ "reachability": "CONNECTED", "session": { "epoch": 1, "open": true } }),
        "{msg}"
    );
    session.bye().await;
    let msg = next_msg(&mut ws).await;
    assert_eq!(
        msg["payload"]["data"]["computeNode"],
        json!({ "reachability": "DISCONNECTED", "session": { "epoch": 1, "open": false } }),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_subscription_follows_a_command_live() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let nodes = crate::commands::seed_nodes(&app, 1).await;
    let node = nodes[0].clone();
    let mut session =
        compute_sim::Session::open(&crate::commands::daemon_config(&app, &node, "j1", 1))
            .await
            .expect("open");
    let run = "mutation($i: RunCommandInput!) { runCommand(input: $i) { command { id } } }";
    let id = app
        .ok(
            &app.operator(),
            run,
            json!({ "i": { "computeNodeId": node, "kind": "NOOP", "idempotencyKey": "s1" } }),
        )
        .await["runCommand"]["command"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let query = "subscription($id: ID!, $after: String) { command(id: $id, after: $after) { state attempts } }";
    // Members may not follow commands.
    let mut denied = subscribe(
        &app,
        &app.member("acme"),
        "c",
        query,
        json!({ "id": id, "after": null }),
    )
    .await;
    let msg = next_msg(&mut denied).await;
    assert_eq!(msg["type"], "error", "{msg}");
    assert_eq!(
        msg["payload"][0]["extensions"]["code"], "FORBIDDEN",
        "{msg}"
    );

    let after = now(&app).await;
    let mut ws = subscribe(
        &app,
        &app.operator(),
        "c",
        query,
        json!({ "id": id, "after": after }),
    )
    .await;
    let mut dispatcher = compute_workers::queue::QueueWorker::new(
        app.db.db.clone(),
        "dispatcher-a",
        &compute_workers::queue::DISPATCH_KINDS,
    )
    .in_family("dispatch");
    dispatcher.rebalance().await.expect("shards");
    dispatcher.step().await.expect("dispatch");
    let msg = next_msg(&mut ws).await;
    assert_eq!(
        msg["payload"]["data"]["command"],
        json!({ "state": "DISPATCHED", "attempts": 1 }),
        "{msg}"
    );
    // The daemon, step by step: acknowledged (running), then its result.
    let command = loop {
        let m = session
            .next_message(WAIT)
            .await
            .expect("a message")
            .expect("open");
        if m["type"] == "command" {
            break m;
        }
    };
    session
        .send(json!({ "type": "ack", "commandId": command["commandId"] }))
        .await
        .expect("ack");
    assert_eq!(
        session
            .next_message(WAIT)
            .await
            .expect("proceed")
            .expect("open")["type"],
        "proceed"
    );
    let msg = next_msg(&mut ws).await;
    assert_eq!(
        msg["payload"]["data"]["command"]["state"], "RUNNING",
        "{msg}"
    );
    session
        .send(json!({ "type": "result", "commandId": command["commandId"], "outcome": "succeeded", "output": { "ok": true } }))
        .await
        .expect("result");
    let msg = next_msg(&mut ws).await;
    assert_eq!(
        msg["payload"]["data"]["command"]["state"], "SUCCEEDED",
        "{msg}"
    );
    session.bye().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_instance_subscription_is_its_tenants_only() {
    let app = spawn_app().await;
    // `reservations::input` ends at 2031-01-01T02:00Z: a reservation of two hours, not years.
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    let r = app
        .ok(
            &acme,
            crate::reservations::CREATE,
            crate::reservations::input(&p.pool, "r1", json!([{ "gpuCount": 1 }])),
        )
        .await;
    let allocation = r["createReservation"]["reservation"]["allocations"][0]["id"].clone();
    let create =
        "mutation($i: CreateInstanceInput!) { createInstance(input: $i) { instance { id } } }";
    let id = app
        .ok(
            &acme,
            create,
            json!({ "i": { "allocationId": allocation, "image": "img", "idempotencyKey": "i1" } }),
        )
        .await["createInstance"]["instance"]["id"]
        .clone();
    let query = "subscription($id: ID!, $after: String) { instance(id: $id, after: $after) { state stopRequested } }";
    let mut other = subscribe(
        &app,
        &app.member("globex"),
        "i",
        query,
        json!({ "id": id, "after": null }),
    )
    .await;
    let msg = next_msg(&mut other).await;
    assert_eq!(
        msg["payload"][0]["extensions"]["code"], "NOT_FOUND",
        "{msg}"
    );
    let after = now(&app).await;
    let mut ws = subscribe(&app, &acme, "i", query, json!({ "id": id, "after": after })).await;
    let stop = "mutation($i: StopInstanceInput!) { stopInstance(input: $i) { instance { state stopRequested } } }";
    let stopped = app.ok(&acme, stop, json!({ "i": { "id": id } })).await;
    assert_eq!(
        stopped["stopInstance"]["instance"],
        json!({ "state": "PROVISIONING", "stopRequested": true })
    );
    // The workflow's step: its run command was never dispatched, so it is withdrawn and the
    // instance stops at once (stopping, then stopped, in one transaction).
    let iid = compute_domain::ids::InstanceId::parse("id", id.as_str().expect("id"))
        .expect("instance id");
    let step = compute_domain::instances::reconcile(&app.db.db, &iid)
        .await
        .expect("step");
    assert_eq!(
        step.moved,
        [
            compute_domain::instances::State::Stopping,
            compute_domain::instances::State::Stopped
        ]
    );
    let msg = next_msg(&mut ws).await;
    assert_eq!(
        msg["payload"]["data"]["instance"]["state"], "STOPPED",
        "{msg}"
    );
}

#[tokio::test]
async fn event_payloads_are_typed_by_family_and_match_their_data() {
    let app = spawn_app().await;
    let after = now(&app).await;
    let operator = app.operator();
    let query = "subscription($after: String) { events(after: $after, types: [\"site.created\", \"test.tick\"]) { \
        type data payload { __typename ... on SiteEventPayload { site { id name region version } } } } }";
    let mut ws = subscribe(&app, &operator, "p", query, json!({ "after": after })).await;
    app.ok(
        &operator,
        "mutation { createSite(input: { name: \"typed-1\", region: \"eu-north\" }) { site { id } } }",
        json!({}),
    )
    .await;
    let msg = next_msg(&mut ws).await;
    let e = event_of(&msg);
    assert_eq!(e["type"], "site.created", "{msg}");
    let p = &e["payload"];
    assert_eq!(p["__typename"], "SiteEventPayload", "{msg}");
    assert_eq!(p["site"]["name"], "typed-1");
    assert_eq!(p["site"]["region"], "eu-north");
    assert_eq!(p["site"]["id"], e["data"]["site"]["id"], "the same as data");
    assert_eq!(p["site"]["version"], e["data"]["site"]["version"]);
    // A type this build does not know has a null payload, and its data.
    emit(&app, None, &["x"]).await;
    let msg = next_msg(&mut ws).await;
    let e = event_of(&msg);
    assert_eq!(e["type"], "test.tick", "{msg}");
    assert!(e["payload"].is_null(), "{msg}");
    assert!(msg["payload"]["errors"].is_null(), "{msg}");
    assert_eq!(e["data"]["n"], "x");
}
