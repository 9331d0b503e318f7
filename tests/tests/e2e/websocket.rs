use compute_api::auth::Role;
use compute_tests::spawn_app;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(app: &compute_tests::TestApp, protocol: &str) -> Ws {
    let mut req = format!("ws://{}/graphql", app.addr)
        .into_client_request()
        .expect("request");
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", protocol.parse().expect("header"));
    let (ws, res) = tokio_tungstenite::connect_async(req)
        .await
        .expect("upgrade");
    assert_eq!(
        res.headers()
            .get("sec-websocket-protocol")
            .and_then(|v| v.to_str().ok()),
        Some(protocol)
    );
    ws
}

async fn next_json(ws: &mut Ws) -> Value {
    loop {
        match ws.next().await.expect("a message").expect("no error") {
            Message::Text(t) => return serde_json::from_str(t.as_str()).expect("json"),
            Message::Ping(_) | Message::Pong(_) => continue,
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn graphql_transport_ws_authenticates_in_connection_init() {
    let app = spawn_app().await;
    let token = app.token("bob", Some("acme"), &[Role::Operator]);
    let mut ws = connect(&app, "graphql-transport-ws").await;
    ws.send(Message::Text(
        json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } })
            .to_string()
            .into(),
    ))
    .await
    .expect("send");
    assert_eq!(next_json(&mut ws).await["type"], "connection_ack");
    ws.send(Message::Text(
        json!({ "id": "1", "type": "subscribe", "payload": { "query": "{ viewer { subject roles } }" } })
            .to_string()
            .into(),
    ))
    .await
    .expect("send");
    let next = next_json(&mut ws).await;
    assert_eq!(next["type"], "next", "{next}");
    assert_eq!(
        next["payload"]["data"]["viewer"],
        json!({ "subject": "bob", "roles": ["OPERATOR"] })
    );
    assert_eq!(
        next_json(&mut ws).await,
        json!({ "id": "1", "type": "complete" })
    );
}

#[tokio::test]
async fn shutdown_closes_websockets_with_going_away() {
    let app = spawn_app().await;
    let mut ws = connect(&app, "graphql-transport-ws").await;
    let token = app.member("acme");
    ws.send(Message::Text(
        json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } })
            .to_string()
            .into(),
    ))
    .await
    .expect("send");
    assert_eq!(next_json(&mut ws).await["type"], "connection_ack");
    let closed = tokio::spawn(async move {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(frame))) => {
                    return frame.map(|f| (u16::from(f.code), f.reason.to_string()));
                }
                Some(Ok(_)) => continue,
                other => panic!("expected a close frame, got {other:?}"),
            }
        }
    });
    app.shutdown().await;
    let frame = closed.await.expect("join");
    assert_eq!(frame, Some((1001, "server shutting down".to_owned())));
}

async fn subscribe_events(app: &compute_tests::TestApp, token: &str, after: Option<&str>) -> Ws {
    let mut ws = connect(app, "graphql-transport-ws").await;
    ws.send(Message::Text(
        json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } })
            .to_string()
            .into(),
    ))
    .await
    .expect("init");
    assert_eq!(next_json(&mut ws).await["type"], "connection_ack");
    ws.send(Message::Text(
        json!({ "id": "e", "type": "subscribe", "payload": {
            "query": "subscription($after: String) { events(after: $after, types: [\"site.created\"]) { id cursor type subject data } }",
            "variables": { "after": after } } })
        .to_string()
        .into(),
    ))
    .await
    .expect("subscribe");
    ws
}

/// Waits for the next event of the subscription (the server polls the outbox; the wait is for an
/// event, bounded, never a sleep standing in for time passing).
async fn next_event(ws: &mut Ws) -> Value {
    let msg = tokio::time::timeout(std::time::Duration::from_secs(30), next_json(ws))
        .await
        .expect("an event within 30 s");
    assert_eq!(msg["type"], "next", "{msg}");
    msg["payload"]["data"]["events"].clone()
}

#[tokio::test]
async fn events_are_live_and_a_reconnect_with_the_cursor_misses_nothing() {
    let app = spawn_app().await;
    let op = app.token("root", Some("ops"), &[Role::Operator]);
    let create = |name: &'static str| {
        let (app, op) = (&app, op.clone());
        async move {
            app.graphql(
                "mutation($i: CreateSiteInput!) { createSite(input: $i) { site { id } } }",
                json!({ "i": { "name": name } }),
                Some(&op),
            )
            .await
        }
    };
    // From the present as the API reports it, so the subscription cannot start after the event.
    let now = app.ok(&op, "{ eventCursor }", json!({})).await["eventCursor"]
        .as_str()
        .expect("cursor")
        .to_owned();
    let mut ws = subscribe_events(&app, &op, Some(&now)).await;
    create("first").await;
    let first = next_event(&mut ws).await;
    assert_eq!(first["type"], "site.created");
    assert_eq!(first["data"]["site"]["name"], "first");
    let cursor = first["cursor"].as_str().expect("cursor").to_owned();
    drop(ws); // the connection drops

    create("second").await;
    create("third").await;
    let mut ws = subscribe_events(&app, &op, Some(&cursor)).await;
    let second = next_event(&mut ws).await;
    let third = next_event(&mut ws).await;
    assert_eq!(
        (
            second["data"]["site"]["name"].clone(),
            third["data"]["site"]["name"].clone()
        ),
        (json!("second"), json!("third")),
        "nothing missed, in order"
    );
    assert_ne!(second["id"], first["id"], "no duplicate at the seam");

    // A member sees only its tenant's events: fleet events are not its.
    let member = app.token("alice", Some("acme"), &[Role::Member]);
    let mut theirs = subscribe_events(&app, &member, Some(&cursor)).await;
    let nothing = tokio::time::timeout(
        std::time::Duration::from_millis(1500),
        next_json(&mut theirs),
    )
    .await;
    assert!(
        nothing.is_err(),
        "no fleet event reaches a member: {nothing:?}"
    );
}

async fn subscribe(app: &compute_tests::TestApp, token: &str, query: &str, variables: Value) -> Ws {
    let mut ws = connect(app, "graphql-transport-ws").await;
    ws.send(Message::Text(
        json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } }).to_string().into(),
    ))
    .await
    .expect("init");
    assert_eq!(next_json(&mut ws).await["type"], "connection_ack");
    ws.send(Message::Text(
        json!({ "id": "s", "type": "subscribe", "payload": { "query": query, "variables": variables } }).to_string().into(),
    ))
    .await
    .expect("subscribe");
    ws
}

/// The first update that satisfies `done`, within 30 s.
async fn until(ws: &mut Ws, done: impl Fn(&Value) -> bool) -> Value {
    tokio::time::timeout(std::time::Duration::from_secs(30), async {
        loop {
            let msg = next_json(ws).await;
            assert_eq!(msg["type"], "next", "{msg}");
            if done(&msg) {
                return msg;
            }
        }
    })
    .await
    .expect("the update within 30 s")
}

#[tokio::test]
async fn a_reservation_and_a_node_can_be_followed_live() {
    let app = spawn_app().await;
    // `reservations::input` ends at 2031-01-01T02:00Z: a reservation of two hours, not years.
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = crate::reservations::pool(&app).await;
    let member = app.member("acme");
    let d = app
        .ok(
            &member,
            crate::reservations::CREATE,
            crate::reservations::input(&p.pool, "live", json!([{ "gpuCount": 1 }])),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"].clone();
    let now = app.ok(&member, "{ eventCursor }", json!({})).await["eventCursor"].clone();
    let mut ws = subscribe(
        &app,
        &member,
        "subscription($id: ID!, $after: String) { reservation(id: $id, after: $after) { id state } }",
        json!({ "id": id, "after": now }),
    )
    .await;
    let mut node = subscribe(
        &app,
        &app.operator(),
        "subscription($id: ID!, $after: String) { computeNode(id: $id, after: $after) { hostname cordoned } }",
        json!({ "id": p.nodes[2], "after": now }),
    )
    .await;
    app.ok(&member, "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { id } } }", json!({ "i": { "id": id } }))
        .await;
    // Events that committed just before the subscription may still arrive first (the reader
    // waits for older transactions cluster-wide); each update carries the state as it is now.
    let msg = until(&mut ws, |m| {
        m["payload"]["data"]["reservation"]["state"] == "RELEASED"
    })
    .await;
    assert_eq!(msg["payload"]["data"]["reservation"]["id"], id);
    app.ok(
        &app.operator(),
        "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }",
        json!({ "i": { "id": p.nodes[2] } }),
    )
    .await;
    let msg = until(&mut node, |m| {
        m["payload"]["data"]["computeNode"]["cordoned"] == true
    })
    .await;
    assert_eq!(msg["payload"]["data"]["computeNode"]["hostname"], "a100-c");

    let other = app.member("globex");
    let mut theirs = subscribe(
        &app,
        &other,
        "subscription($id: ID!) { reservation(id: $id) { state } }",
        json!({ "id": id }),
    )
    .await;
    let msg = next_json(&mut theirs).await;
    // A subscription that cannot start is one `error` message, as the protocol has it.
    assert_eq!(msg["type"], "error", "{msg}");
    let errors = &msg["payload"];
    assert_eq!(errors[0]["extensions"]["code"], "NOT_FOUND", "{msg}");
}
