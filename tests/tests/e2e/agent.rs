//! Node daemons through the real `/agent` WebSocket: sessions with epochs, liveness on the
//! simulated clock (the reconciler stepped, never slept on), and bad input from daemons.

use std::time::Duration;

use compute_sim::{Closed, DaemonConfig, Session};
use compute_tests::TestApp;
use serde_json::json;

use crate::reservations::{CREATE, input, pool};

const WAIT: Duration = Duration::from_secs(10);

fn daemon(app: &TestApp, node: &str, journal: &str) -> DaemonConfig {
    DaemonConfig {
        url: app.agent_url(),
        token: app.node_token(node),
        node_id: node.to_owned(),
        daemon_version: "sim/1".into(),
        journal_id: journal.into(),
        observed_generation: 0,
    }
}

async fn reachability(app: &TestApp, node: &str) -> String {
    sqlx::query_scalar("SELECT reachability FROM nodes WHERE id = $1")
        .bind(node)
        .fetch_one(app.db.db.pool())
        .await
        .expect("node")
}

async fn events(app: &TestApp, node: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT type FROM outbox WHERE subject = $1 AND type IN ('node.connected', 'node.disconnected', 'node.unreachable', 'node.lost') ORDER BY txid, seq")
        .bind(node)
        .fetch_all(app.db.db.pool())
        .await
        .expect("events")
}

/// Moves simulated time `seconds` forward in steps of 10 s, renewing the gateway's lease and
/// running a reconciler pass after each step, as the running system would.
async fn step(app: &TestApp, reconciler: &mut compute_workers::Reconciler, seconds: i64) {
    let mut left = seconds;
    while left > 0 {
        let s = left.min(10);
        app.db.advance_clock(s).await;
        left -= s;
        app.gateway.refresh_lease().await.expect("gateway lease");
        reconciler.pass().await.expect("pass");
    }
}

/// Creates a reservation of one GPU on node h100-a (by its host label); the response.
pub async fn on_h100_a(app: &TestApp, member: &str, pool: &str, key: &str) -> serde_json::Value {
    app.ok(
        member,
        CREATE,
        input(
            pool,
            key,
            json!([{ "gpuCount": 1, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]),
        ),
    )
    .await
}

async fn setup() -> (
    TestApp,
    crate::reservations::Pool,
    compute_workers::Reconciler,
) {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway
        .refresh_lease()
        .await
        .expect("the gateway's lease in simulated time");
    let p = pool(&app).await;
    let mut reconciler = compute_workers::Reconciler::new(app.db.db.clone(), "worker-liveness");
    reconciler.pass().await.expect("first pass");
    (app, p, reconciler)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_connects_the_node_and_a_newer_one_supersedes_it() {
    let (app, p, _r) = setup().await;
    let node = &p.nodes[0];
    assert_eq!(
        reachability(&app, node).await,
        "disconnected",
        "before any session"
    );
    let mut first = Session::open(&daemon(&app, node, "j1"))
        .await
        .expect("open");
    assert_eq!(first.welcome.session_epoch, 1);
    assert_eq!(first.welcome.gateway_id, app.gateway.id().as_str());
    assert_eq!(reachability(&app, node).await, "connected");
    let d = app
        .ok(&app.operator(), "query($id: ID!) { computeNode: node(id: $id) { ... on ComputeNode { reachability session { epoch gatewayId daemonVersion journalId open } } } }", json!({ "id": node }))
        .await;
    assert_eq!(
        d["computeNode"],
        json!({ "reachability": "CONNECTED", "session": { "epoch": 1, "gatewayId": app.gateway.id().as_str(), "daemonVersion": "sim/1", "journalId": "j1", "open": true } })
    );

    // The daemon restarts (its old connection still open): the new session supersedes the old.
    let second = Session::open(&daemon(&app, node, "j1"))
        .await
        .expect("open again");
    assert_eq!(second.welcome.session_epoch, 2);
    let closed = first.closed(WAIT).await.expect("the first is closed");
    assert_eq!(closed.code, 4409, "{closed:?}");
    // Writes at the old epoch change nothing.
    let db = &app.db.db;
    let node_id = compute_domain::ids::NodeId::parse("node", node).expect("id");
    assert!(
        !compute_domain::node_sessions::close(
            db,
            &node_id,
            1,
            compute_domain::node_sessions::CloseReason::DaemonClosed
        )
        .await
        .expect("close"),
        "a close at epoch 1 finds nothing"
    );
    let flushed = compute_domain::node_sessions::flush(
        db,
        app.gateway.id(),
        &[compute_domain::node_sessions::Seen {
            node: node_id.clone(),
            epoch: 1,
            age_seconds: 0.0,
        }],
    )
    .await
    .expect("flush");
    assert!(flushed.is_empty(), "a heartbeat at epoch 1 is not written");
    assert_eq!(reachability(&app, node).await, "connected");

    // A clean goodbye: disconnected, nothing released, unreachable 40 s later.
    second.bye().await;
    compute_tests::eventually("the node is disconnected", WAIT, || async {
        (reachability(&app, node).await == "disconnected").then_some(())
    })
    .await;
    let (reason, after): (String, f64) = sqlx::query_as(
        "SELECT s.close_reason, extract(epoch FROM n.unreachable_at - compute_now())::float8 FROM node_sessions s JOIN nodes n ON n.id = s.node_id WHERE s.node_id = $1",
    )
    .bind(node)
    .fetch_one(db.pool())
    .await
    .expect("session");
    assert_eq!((reason.as_str(), after), ("daemon_closed", 40.0));
    assert_eq!(
        events(&app, node).await,
        ["node.connected", "node.connected", "node.disconnected"]
    );
}

/// The gateway's silence timer runs on business time: a daemon that sends nothing is cut off
/// (`4408`) when simulated time passes `silent_after`, at once and not after that long on the
/// wall clock; a second less leaves it open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_daemon_is_cut_off_when_business_time_passes_the_silence_limit() {
    let (app, p, _r) = setup().await;
    let node = &p.nodes[0];
    let mut s = Session::open(&daemon(&app, node, "j1"))
        .await
        .expect("open");
    let limit = app.gateway.config().silent_after.as_secs() as i64;
    assert_eq!(limit, 15);
    app.db.advance_clock(limit - 1).await;
    assert_eq!(
        s.closed(Duration::from_millis(500)).await,
        None,
        "14 s of silence is allowed"
    );
    app.db.advance_clock(1).await;
    let closed = s
        .closed(Duration::from_secs(5))
        .await
        .expect("cut off once 15 s of business time passed, without waiting 15 s");
    assert_eq!(closed.code, 4408, "{closed:?}");
    compute_tests::eventually("the node is disconnected", WAIT, || async {
        (reachability(&app, node).await == "disconnected").then_some(())
    })
    .await;
    let reason: String =
        sqlx::query_scalar("SELECT close_reason FROM node_sessions WHERE node_id = $1")
            .bind(node)
            .fetch_one(app.db.db.pool())
            .await
            .expect("session");
    assert_eq!(reason, "silent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silence_is_disconnected_then_unreachable_and_bookings_stay() {
    let (app, p, mut r) = setup().await;
    let (a, c) = (&p.nodes[0], &p.nodes[2]);
    // A reservation on node a (its host label), active now.
    let member = app.member("acme");
    let d = on_h100_a(&app, &member, &p.pool, "k1").await;
    assert_eq!(
        d["createReservation"]["reservation"]["state"], "ACTIVE",
        "{d}"
    );
    let rsv = d["createReservation"]["reservation"]["id"].clone();

    step(&app, &mut r, 20).await;
    let s = Session::open(&daemon(&app, a, "j1")).await.expect("open");
    s.cut();
    compute_tests::eventually("a is disconnected", WAIT, || async {
        (reachability(&app, a).await == "disconnected").then_some(())
    })
    .await;
    // c never opened a session: it counts from its join (40 s before now + 20 s ago).
    step(&app, &mut r, 10).await;
    assert_eq!(
        reachability(&app, c).await,
        "disconnected",
        "c: 30 s since join"
    );
    step(&app, &mut r, 10).await;
    assert_eq!(
        reachability(&app, c).await,
        "unreachable",
        "c: 40 s since join"
    );
    // a: 39 s of silence is still disconnected, 40 s is unreachable.
    app.db.advance_clock(19).await;
    r.pass().await.expect("pass");
    assert_eq!(reachability(&app, a).await, "disconnected", "39 s");
    app.db.advance_clock(1).await;
    r.pass().await.expect("pass");
    assert_eq!(reachability(&app, a).await, "unreachable", "40 s");
    let d = app
        .ok(&app.operator(), "query($id: ID!) { computeNode: node(id: $id) { ... on ComputeNode { reachability noScheduleReasons conditions { type status reason } } } }", json!({ "id": a }))
        .await;
    assert_eq!(
        d["computeNode"]["noScheduleReasons"],
        json!(["UNREACHABLE"])
    );
    assert_eq!(
        d["computeNode"]["conditions"],
        json!([{ "type": "NodeUnreachable", "status": "True", "reason": "NoSession" }])
    );
    // Out of placement; its reservation keeps its devices.
    let d = on_h100_a(&app, &member, &p.pool, "k2").await;
    assert_eq!(
        d["createReservation"]["reservation"]["state"], "PENDING",
        "{d}"
    );
    let d = app
        .ok(
            &member,
            "query($id: ID!) { reservation(id: $id) { state allocations { atoms } } }",
            json!({ "id": rsv }),
        )
        .await;
    assert_eq!(d["reservation"]["state"], "ACTIVE");
    assert_eq!(
        d["reservation"]["allocations"][0]["atoms"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );

    // The daemon comes back: connected, in placement again, the condition gone.
    let back = Session::open(&daemon(&app, a, "j1")).await.expect("back");
    assert_eq!(back.welcome.session_epoch, 2);
    let d = app
        .ok(&app.operator(), "query($id: ID!) { computeNode: node(id: $id) { ... on ComputeNode { reachability noScheduleReasons conditions { type } } } }", json!({ "id": a }))
        .await;
    assert_eq!(
        d["computeNode"],
        json!({ "reachability": "CONNECTED", "noScheduleReasons": [], "conditions": [] })
    );
    assert_eq!(
        events(&app, a).await,
        [
            "node.connected",
            "node.disconnected",
            "node.unreachable",
            "node.connected"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_gateway_gives_120_s_of_grace_and_a_zombie_writes_nothing() {
    let (app, p, mut r) = setup().await;
    let a = &p.nodes[0];
    let _s = Session::open(&daemon(&app, a, "j1")).await.expect("open");
    let fence = app.gateway.fence().await.expect("fence").expect("held");
    // Another process takes the gateway's lease over (as after a partition).
    sqlx::query("UPDATE leases SET owner = 'someone-else', epoch = epoch + 1, expires_at = compute_now() + interval '20 seconds' WHERE name = $1")
        .bind(&fence.name)
        .execute(app.db.db.pool())
        .await
        .expect("take over");
    // The zombie's writes fail their fence.
    let zombie = app.db.db.fenced(&fence);
    let node_id = compute_domain::ids::NodeId::parse("node", a).expect("id");
    let err = compute_domain::node_sessions::flush(
        &zombie,
        app.gateway.id(),
        &[compute_domain::node_sessions::Seen {
            node: node_id.clone(),
            epoch: 1,
            age_seconds: 0.0,
        }],
    )
    .await
    .expect_err("fenced");
    assert!(
        matches!(err, compute_domain::Error::LeaseLost(_)),
        "{err:?}"
    );
    let err = compute_domain::node_sessions::close(
        &zombie,
        &node_id,
        1,
        compute_domain::node_sessions::CloseReason::DaemonClosed,
    )
    .await
    .expect_err("fenced");
    assert!(
        matches!(err, compute_domain::Error::LeaseLost(_)),
        "{err:?}"
    );
    assert_eq!(
        reachability(&app, a).await,
        "connected",
        "the zombie changed nothing"
    );
    // The reconciler ends the session: gateway lost, 40 s + 120 s of grace.
    r.pass().await.expect("pass");
    assert_eq!(reachability(&app, a).await, "disconnected");
    let (reason,): (String,) =
        sqlx::query_as("SELECT close_reason FROM node_sessions WHERE node_id = $1")
            .bind(a)
            .fetch_one(app.db.db.pool())
            .await
            .expect("session");
    assert_eq!(reason, "gateway_lost");
    for _ in 0..15 {
        app.db.advance_clock(10).await;
        r.pass().await.expect("pass");
    }
    app.db.advance_clock(9).await;
    r.pass().await.expect("pass");
    assert_eq!(reachability(&app, a).await, "disconnected", "159 s");
    app.db.advance_clock(1).await;
    r.pass().await.expect("pass");
    assert_eq!(reachability(&app, a).await, "unreachable", "160 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_disconnected_nodes_get_five_minutes() {
    let (app, p, mut r) = setup().await;
    let a = &p.nodes[0];
    Session::open(&daemon(&app, a, "j1"))
        .await
        .expect("open")
        .bye()
        .await;
    compute_tests::eventually("a is disconnected", WAIT, || async {
        (reachability(&app, a).await == "disconnected").then_some(())
    })
    .await;
    // No pass for 60 s: the controllers (or the database) were away.
    app.db.advance_clock(60).await;
    let pass = r.pass().await.expect("pass");
    assert_eq!(pass.liveness.outage_seconds, Some(60.0));
    assert_eq!(
        reachability(&app, a).await,
        "disconnected",
        "the outage grace holds it"
    );
    for _ in 0..33 {
        app.db.advance_clock(10).await;
        r.pass().await.expect("pass");
    }
    app.db.advance_clock(9).await;
    r.pass().await.expect("pass");
    assert_eq!(
        reachability(&app, a).await,
        "disconnected",
        "339 s after the outage"
    );
    app.db.advance_clock(1).await;
    r.pass().await.expect("pass");
    assert_eq!(
        reachability(&app, a).await,
        "unreachable",
        "340 s after the outage"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_provider_and_vps_nodes_are_lost_and_then_their_reservations_fail() {
    let (app, p, mut r) = setup().await;
    let op = app.operator();
    let provider = app
        .ok(&op, crate::fleet::CREATE_POOL, json!({ "i": { "siteId": p.site, "name": "cloud", "kind": "PROVIDER", "lostAfterSeconds": 600 } }))
        .await["createPool"]["pool"]["id"]
        .as_str()
        .expect("pool")
        .to_owned();
    let d = app
        .ok(
            &op,
            crate::fleet::REGISTER,
            json!({ "i": { "poolId": provider, "hostname": "cloud-1",
            "resources": { "vcpu": 8, "memoryMib": 65536, "diskGib": 100 },
            "devices": [{ "uuid": "GPU-P0", "model": "L4", "memoryMib": 24000 }] } }),
        )
        .await;
    let cloud = d["registerNode"]["computeNode"]["id"]
        .as_str()
        .expect("node")
        .to_owned();
    app.ok(
        &op,
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": provider, "gpus": 8 } }),
    )
    .await;
    let d = app
        .ok(
            &app.member("acme"),
            CREATE,
            input(&provider, "kp", json!([{ "gpuCount": 1 }])),
        )
        .await;
    let rsv = d["createReservation"]["reservation"]["id"].clone();
    assert_eq!(
        d["createReservation"]["reservation"]["state"], "ACTIVE",
        "{d}"
    );

    step(&app, &mut r, 40).await;
    assert_eq!(reachability(&app, &cloud).await, "unreachable");
    assert_eq!(reachability(&app, &p.nodes[0]).await, "unreachable");
    step(&app, &mut r, 590).await;
    assert_eq!(
        reachability(&app, &cloud).await,
        "unreachable",
        "590 s unreachable"
    );
    step(&app, &mut r, 10).await;
    assert_eq!(
        reachability(&app, &cloud).await,
        "lost",
        "600 s: the pool's lostAfterSeconds"
    );
    assert_eq!(
        reachability(&app, &p.nodes[0]).await,
        "unreachable",
        "bare metal is never lost"
    );
    let d = app
        .ok(
            &app.member("acme"),
            "query($id: ID!) { reservation(id: $id) { state } }",
            json!({ "id": rsv }),
        )
        .await;
    assert_eq!(d["reservation"]["state"], "FAILED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_cannot_move_last_seen_into_the_future() {
    let (app, p, _r) = setup().await;
    let a = &p.nodes[0];
    let s = Session::open(&daemon(&app, a, "j1")).await.expect("open");
    let node_id = compute_domain::ids::NodeId::parse("node", a).expect("id");
    let (db, _) = app.gateway.fenced_db().await.expect("db").expect("held");
    for age in [-3600.0, f64::NEG_INFINITY, f64::NAN, 2.5] {
        let written = compute_domain::node_sessions::flush(
            &db,
            app.gateway.id(),
            &[compute_domain::node_sessions::Seen {
                node: node_id.clone(),
                epoch: s.welcome.session_epoch,
                age_seconds: age,
            }],
        )
        .await
        .expect("flush");
        assert_eq!(written.len(), 1);
        let (ahead,): (f64,) = sqlx::query_as(
            "SELECT extract(epoch FROM last_seen_at - compute_now())::float8 FROM node_sessions WHERE node_id = $1",
        )
        .bind(a)
        .fetch_one(app.db.db.pool())
        .await
        .expect("last seen");
        assert!(ahead <= 0.0, "age {age}: last seen {ahead} s from now");
    }
}

async fn refused(config: &DaemonConfig) -> Closed {
    match Session::open(config).await {
        Ok(_) => panic!("the session opened"),
        Err(c) => c,
    }
}

/// The close code the gateway answers `text`, sent as the first message of a new connection.
async fn first_message_closes(app: &TestApp, text: &str) -> u16 {
    let mut ws = compute_sim::connect_raw(&app.agent_url())
        .await
        .expect("connect");
    futures_util::SinkExt::send(
        &mut ws,
        tokio_tungstenite::tungstenite::Message::Text(text.to_owned().into()),
    )
    .await
    .expect("send");
    compute_sim::closed_of(&mut ws, WAIT)
        .await
        .expect("closed")
        .code
}

/// The gateway's next message in `session`, which must stay open.
pub async fn reply(session: &mut Session) -> serde_json::Value {
    session
        .next_message(WAIT)
        .await
        .expect("a reply")
        .expect("the session stays open")
}

/// The gateway's next message, which must be an `error` with `BAD_USER_INPUT` (the message
/// refused, the session kept); the message.
pub async fn refusal(session: &mut Session) -> serde_json::Value {
    let m = reply(session).await;
    assert_eq!(
        (m["type"].as_str(), m["code"].as_str()),
        (Some("error"), Some("BAD_USER_INPUT")),
        "{m}"
    );
    m
}

async fn stored_inventory(app: &TestApp, node: &str) -> Option<serde_json::Value> {
    sqlx::query_scalar("SELECT inventory FROM nodes WHERE id = $1")
        .bind(node)
        .fetch_one(app.db.db.pool())
        .await
        .expect("inventory")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_daemon_input_gets_a_close_code_and_changes_nothing() {
    let (app, p, _r) = setup().await;
    let a = &p.nodes[0];
    // Without the subprotocol: a plain 400.
    let res = app
        .http
        .get(app.url("/agent"))
        .header("Connection", "Upgrade")
        .header("Upgrade", "websocket")
        .header("Sec-WebSocket-Version", "13")
        .header("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")
        .send()
        .await
        .expect("get");
    assert_eq!(res.status(), 400);
    // Tokens: a member's, another node's, a forged one, none.
    let mut c = daemon(&app, a, "j1");
    c.token = app.member("acme");
    assert_eq!(refused(&c).await.code, 4403);
    c.token = app.node_token(&p.nodes[1]);
    assert_eq!(refused(&c).await.code, 4403);
    c.token = "not-a-jwt".into();
    assert_eq!(refused(&c).await.code, 4401);
    // An unknown node (a well-formed id), with a token for it.
    let ghost = "node_00000000000000000000000000000000";
    assert_eq!(refused(&daemon(&app, ghost, "j1")).await.code, 4404);
    // A generation the node was never given, an empty journal.
    let mut c = daemon(&app, a, "j1");
    c.observed_generation = 99;
    assert_eq!(refused(&c).await.code, 4400);
    let mut c = daemon(&app, a, "");
    c.journal_id = String::new();
    assert_eq!(refused(&c).await.code, 4400);
    // A malformed first message.
    assert_eq!(
        first_message_closes(&app, "{\"type\":\"hello\"").await,
        4400
    );
    assert_eq!(
        reachability(&app, a).await,
        "disconnected",
        "nothing was opened"
    );
    assert_eq!(app.count("node_sessions").await, 0);
    // A join whose daemonVersion is not a label (it is only logged, and checked all the same):
    // refused before its token is looked at.
    let join = json!({ "type": "join", "token": "cjt_unknown", "daemonVersion": "1.0\nINFO forged line",
                       "inventory": { "hostname": "new-box", "vcpu": 8, "memoryMib": 65536, "diskGib": 100 } });
    assert_eq!(first_message_closes(&app, &join.to_string()).await, 4400);
    assert_eq!(app.count("nodes").await, 3, "no node was made");

    // In a session: a bad status is an error message and the session stays; a binary frame
    // closes it with 4400; a flood with 4429.
    let mut s = Session::open(&daemon(&app, a, "j1")).await.expect("open");
    s.status(42).await.expect("send");
    refusal(&mut s).await;
    // An inventory with a NUL character (which PostgreSQL's jsonb cannot hold): an error
    // message, the session kept, nothing stored (it was an INTERNAL error that closed it).
    let before = stored_inventory(&app, a).await;
    s.send_raw(tokio_tungstenite::tungstenite::Message::Text(
        r#"{"type":"inventory","inventory":{"hostname":"h100-\u0000a","vcpu":8,"memoryMib":65536,"diskGib":100}}"#.into(),
    ))
    .await
    .expect("send");
    refusal(&mut s).await;
    assert_eq!(stored_inventory(&app, a).await, before, "nothing stored");
    // Reports larger than any machine: 65 GPUs, a 300-character model. Refused the same way
    // (a report is stored as it came, so it is bounded where it enters).
    let gpu = |i: usize, model: &str| json!({ "uuid": format!("GPU-{i:04}"), "model": model, "memoryMib": 81559 });
    let too_many: Vec<serde_json::Value> = (0..65).map(|i| gpu(i, "H100")).collect();
    let too_long = vec![gpu(0, &"H".repeat(300))];
    for (gpus, says) in [
        (too_many, "at most 64 GPUs"),
        (too_long, "`inventory.gpus[0].model` is longer"),
    ] {
        s.send(json!({ "type": "inventory", "inventory": {
            "hostname": "h100-a", "vcpu": 32, "memoryMib": 262144, "diskGib": 1000, "gpus": gpus } }))
            .await
            .expect("send");
        let m = refusal(&mut s).await;
        assert!(
            m["message"].as_str().is_some_and(|t| t.contains(says)),
            "{m}"
        );
    }
    assert_eq!(stored_inventory(&app, a).await, before, "nothing stored");
    s.status(1).await.expect("send");
    s.send_raw(tokio_tungstenite::tungstenite::Message::Binary(
        vec![1, 2, 3].into(),
    ))
    .await
    .expect("send");
    assert_eq!(s.closed(WAIT).await.expect("closed").code, 4400);
    let observed: i64 = sqlx::query_scalar("SELECT observed_generation FROM nodes WHERE id = $1")
        .bind(a)
        .fetch_one(app.db.db.pool())
        .await
        .expect("gen");
    assert_eq!(observed, 1, "the good status was recorded, the bad one not");
    let mut s = Session::open(&daemon(&app, a, "j1")).await.expect("open");
    for _ in 0..5_000 {
        if s.heartbeat().await.is_err() {
            break;
        }
    }
    assert_eq!(s.closed(WAIT).await.expect("closed").code, 4429);
    compute_tests::eventually("the flooding session is closed", WAIT, || async {
        (reachability(&app, a).await == "disconnected").then_some(())
    })
    .await;
}

/// A daemon may report a GPU model or memory that no device can hold (the report is stored as
/// it came, and shows as a mismatch); accepting that inventory is `CONFLICT` naming the GPU and
/// what to fix, with nothing written. Before session 41 the device's own check failed inside the
/// acceptance, as INTERNAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepting_an_inventory_no_device_can_hold_is_a_conflict_naming_the_gpu() {
    let (app, p, _r) = setup().await;
    let a = &p.nodes[0];
    let mut s = Session::open(&daemon(&app, a, "j1")).await.expect("open");
    s.send(json!({ "type": "inventory", "inventory": {
        "hostname": "h100-a", "vcpu": 32, "memoryMib": 262144, "diskGib": 1000,
        "gpus": [
            { "uuid": "GPU-A0", "model": "", "memoryMib": 0 },
            { "uuid": "GPU-A1", "model": "H100", "memoryMib": 81559 }
        ] } }))
    .await
    .expect("send");
    let m = reply(&mut s).await;
    assert_eq!(m["type"], "inventoryChecked", "{m}");
    assert!(
        m["differences"].as_array().is_some_and(|d| d
            .iter()
            .any(|d| d.as_str().is_some_and(|d| d.contains("GPU-A0")))),
        "the report differs from the registration on GPU-A0: {m}"
    );
    let devices = "SELECT string_agg(uuid || ' ' || model || ' ' || memory_mib, ', ' ORDER BY uuid) FROM devices WHERE node_id = $1";
    let before: String = sqlx::query_scalar(devices)
        .bind(a)
        .fetch_one(app.db.db.pool())
        .await
        .expect("devices");
    let version = "SELECT version FROM nodes WHERE id = $1";
    let node_version: i64 = sqlx::query_scalar(version)
        .bind(a)
        .fetch_one(app.db.db.pool())
        .await
        .expect("version");
    let (code, body) = app
        .fails(
            &app.operator(),
            "mutation($i: AcceptNodeInventoryInput!) { acceptNodeInventory(input: $i) { computeNode { id } } }",
            json!({ "i": { "id": a } }),
        )
        .await;
    assert_eq!(code, "CONFLICT", "{body}");
    let message = body.to_string();
    assert!(
        message.contains("GPU GPU-A0") && message.contains("cannot hold"),
        "{message}"
    );
    assert!(!message.contains("GPU GPU-A1"), "A1 is fine: {message}");
    let after: String = sqlx::query_scalar(devices)
        .bind(a)
        .fetch_one(app.db.db.pool())
        .await
        .expect("devices");
    assert_eq!(after, before, "no device changed");
    assert_eq!(before, "GPU-A0 H100 81559, GPU-A1 H100 81559");
    let after_version: i64 = sqlx::query_scalar(version)
        .bind(a)
        .fetch_one(app.db.db.pool())
        .await
        .expect("version");
    assert_eq!(after_version, node_version, "the node was not written");
    s.bye().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_gateway_leaves_its_nodes_disconnected_and_they_reconnect_elsewhere() {
    let (app, p, mut r) = setup().await;
    let member = app.member("acme");
    let d = on_h100_a(&app, &member, &p.pool, "kg").await;
    assert_eq!(
        d["createReservation"]["reservation"]["state"], "ACTIVE",
        "{d}"
    );
    let (mut g1, base1) = crate::crash::start_api_with(
        &app.db.process_env(),
        &["--gateway-only", "--gateway-id", "g1"],
    )
    .await;
    let (_g2, base2) = crate::crash::start_api_with(
        &app.db.process_env(),
        &["--gateway-only", "--gateway-id", "g2"],
    )
    .await;
    let res = app
        .http
        .post(format!("{base1}/graphql"))
        .body("{}")
        .send()
        .await
        .expect("post");
    assert_eq!(
        res.status(),
        404,
        "a gateway-only process serves no GraphQL"
    );
    let agent = |base: &str| format!("{}/agent", base.replace("http://", "ws://"));
    let nodes = [&p.nodes[0], &p.nodes[1]];
    let mut sessions = Vec::new();
    for n in nodes {
        let mut c = daemon(&app, n, "j1");
        c.url = agent(&base1);
        let s = Session::open(&c).await.expect("open on g1");
        assert_eq!(s.welcome.gateway_id, "g1");
        sessions.push(s);
    }
    for n in nodes {
        assert_eq!(reachability(&app, n).await, "connected");
    }
    let killed = std::time::Instant::now();
    g1.start_kill().expect("SIGKILL");
    let _ = g1.wait().await;
    for s in &mut sessions {
        assert!(
            s.closed(WAIT).await.is_some(),
            "the daemon sees its connection drop"
        );
    }
    // Until its lease expires, g1's sessions stand (a gateway may be slow, not dead).
    r.pass().await.expect("pass");
    assert_eq!(
        reachability(&app, nodes[0]).await,
        "connected",
        "the lease still holds"
    );
    app.db.advance_clock(21).await;
    r.pass().await.expect("pass");
    for n in nodes {
        assert_eq!(
            reachability(&app, n).await,
            "disconnected",
            "g1's lease expired"
        );
    }
    // The daemons reconnect through the second gateway.
    for n in nodes {
        let mut c = daemon(&app, n, "j1");
        c.url = agent(&base2);
        let opened = loop {
            match Session::open(&c).await {
                Ok(s) => break s,
                // g2's own lease lapsed with the clock jump; it takes it back at its next flush.
                Err(closed) if closed.code == 1013 => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                Err(closed) => panic!("{closed:?}"),
            }
        };
        assert_eq!(
            (
                opened.welcome.gateway_id.as_str(),
                opened.welcome.session_epoch
            ),
            ("g2", 2)
        );
        sessions.push(opened);
    }
    for n in nodes {
        assert_eq!(reachability(&app, n).await, "connected");
    }
    eprintln!(
        "gateway SIGKILL: nodes disconnected after the lease's 20 s (simulated), reconnected through g2 {:.2} s (real) after the kill",
        killed.elapsed().as_secs_f64()
    );
    // Nothing was released.
    let (active,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM reservations WHERE state = 'active'")
            .fetch_one(app.db.db.pool())
            .await
            .expect("count");
    assert_eq!(active, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_daemon_drops_off_and_comes_back_by_itself() {
    let (app, p, _r) = setup().await;
    let a = p.nodes[0].clone();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let behaviour = compute_sim::Behaviour {
        partition: Some(compute_sim::Partition {
            every: Duration::from_millis(300),
            fraction: 1.0,
            lasts: Duration::from_millis(200),
        }),
        ..compute_sim::Behaviour::default()
    };
    let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log = events.clone();
    let running = tokio::spawn(compute_sim::run_daemon(
        daemon(&app, &a, "j1"),
        behaviour,
        stopped,
        move |_, e| {
            if let Ok(mut l) = log.lock() {
                l.push(match e {
                    Ok(w) => format!("open {}", w.session_epoch),
                    Err(c) => format!("cut {}", c.reason),
                });
            }
        },
    ));
    // Each cut drops the connection without a close frame; the gateway notices, the node is
    // disconnected, and the daemon's next session supersedes by epoch.
    compute_tests::eventually("three sessions", WAIT, || async {
        let epoch: Option<i64> =
            sqlx::query_scalar("SELECT session_epoch FROM node_sessions WHERE node_id = $1")
                .bind(&a)
                .fetch_optional(app.db.db.pool())
                .await
                .expect("epoch");
        (epoch >= Some(3)).then_some(())
    })
    .await;
    let _ = stop.send(true);
    running.await.expect("the daemon stops");
    let seen = events.lock().expect("events").clone();
    assert!(
        seen.starts_with(&["open 1".into(), "cut partitioned".into(), "open 2".into()]),
        "{seen:?}"
    );
    compute_tests::eventually("bye leaves it disconnected", WAIT, || async {
        (reachability(&app, &a).await == "disconnected").then_some(())
    })
    .await;
}

/// The ages the gateways report decide: a session whose gateway keeps its lease but has not
/// reported the daemon seen for `STALE_AFTER` (60 s) is ended `silent` by the liveness pass, and
/// the node is disconnected; a session reported seen is kept; and no session is ended as stale
/// right after an outage, when no gateway could flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_not_seen_for_a_minute_is_ended_by_the_liveness_pass() {
    use compute_domain::leases;
    use compute_domain::node_sessions::{self as ns, Hello, Seen};
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = &app.db.db;
    let fleet = crate::fleet::small_fleet(&app, "stale").await;
    let node = compute_domain::ids::NodeId::parse("node", &fleet.node).expect("node");
    let gw = compute_domain::ids::GatewayId::parse("gateway", "gw-stuck").expect("gateway id");
    let ttl = ns::GATEWAY_TTL;
    let fence = leases::acquire(db, &ns::gateway_lease(&gw), "test", ttl)
        .await
        .expect("acquire")
        .expect("the gateway's lease");
    let gdb = db.fenced(&fence);
    let hello = Hello {
        daemon_version: compute_domain::node_sessions::Label::parse("daemonVersion", "sim/1")
            .expect("label"),
        journal_id: compute_domain::node_sessions::Label::parse("journalId", "j-stale")
            .expect("label"),
        observed_generation: 0,
    };
    let epoch = ns::open(&gdb, &node, &gw, fence.epoch, &hello)
        .await
        .expect("open");
    let seen = |age: f64| Seen {
        node: node.clone(),
        epoch,
        age_seconds: age,
    };
    let session = || async {
        sqlx::query_as::<_, (Option<String>,)>(
            "SELECT close_reason FROM node_sessions WHERE node_id = $1",
        )
        .bind(node.as_str())
        .fetch_one(db.pool())
        .await
        .expect("session")
        .0
    };
    ns::liveness_pass(db).await.expect("first pass");
    // 50 s without a flush (passes every 10 s, the lease renewed): kept.
    for _ in 0..5 {
        app.db.advance_clock(10).await;
        assert!(leases::renew(db, &fence, ttl).await.expect("renew"));
        ns::liveness_pass(db).await.expect("pass");
    }
    assert_eq!(session().await, None, "50 s: still open");
    // A flush reporting the daemon seen 5 s ago keeps it for another minute.
    ns::flush(&gdb, &gw, &[seen(5.0)]).await.expect("flush");
    for _ in 0..5 {
        app.db.advance_clock(10).await;
        assert!(leases::renew(db, &fence, ttl).await.expect("renew"));
        let pass = ns::liveness_pass(db).await.expect("pass");
        assert_eq!(pass.disconnected, 0);
    }
    assert_eq!(session().await, None, "seen 55 s ago: open");
    app.db.advance_clock(6).await;
    assert!(leases::renew(db, &fence, ttl).await.expect("renew"));
    let pass = ns::liveness_pass(db).await.expect("pass");
    assert_eq!(pass.disconnected, 1, "seen 61 s ago: ended");
    assert_eq!(session().await.as_deref(), Some("silent"));
    let reachability: String = sqlx::query_scalar("SELECT reachability FROM nodes WHERE id = $1")
        .bind(node.as_str())
        .fetch_one(db.pool())
        .await
        .expect("node");
    assert_eq!(reachability, "disconnected");

    // After an outage (no pass for two minutes), a session not seen since is kept until a
    // minute has passed with passes running again.
    let epoch = ns::open(&gdb, &node, &gw, fence.epoch, &hello)
        .await
        .expect("reopen");
    let _ = epoch;
    for _ in 0..12 {
        app.db.advance_clock(10).await;
        assert!(leases::renew(db, &fence, ttl).await.expect("renew"));
    }
    let pass = ns::liveness_pass(db).await.expect("pass after the outage");
    assert!(pass.outage_seconds.is_some(), "the outage is noticed");
    assert_eq!(
        pass.disconnected, 0,
        "not ended as stale in the outage's pass"
    );
    for _ in 0..5 {
        app.db.advance_clock(10).await;
        assert!(leases::renew(db, &fence, ttl).await.expect("renew"));
        assert_eq!(ns::liveness_pass(db).await.expect("pass").disconnected, 0);
    }
    assert_eq!(session().await, None, "50 s after the outage: open");
    app.db.advance_clock(11).await;
    assert!(leases::renew(db, &fence, ttl).await.expect("renew"));
    assert_eq!(ns::liveness_pass(db).await.expect("pass").disconnected, 1);
    assert_eq!(session().await.as_deref(), Some("silent"));
}
