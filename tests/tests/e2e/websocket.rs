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
    ws.send(Message::Text(
        json!({ "type": "connection_init" }).to_string().into(),
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
