//! GraphQL over WebSocket on `/graphql`: the `graphql-transport-ws` protocol and the legacy
//! `graphql-ws` subprotocol of `subscriptions-transport-ws`, chosen by `Sec-WebSocket-Protocol`.
//!
//! Credentials come in the `connection_init` payload (`{"Authorization": "Bearer <jwt>"}`), or
//! in the upgrade request's `Authorization` header. On shutdown every connection gets a close
//! frame (1001, going away).

use std::future::ready;
use std::str::FromStr;

use async_graphql::Data;
use async_graphql::http::{WebSocket as GqlWebSocket, WebSocketProtocols, WsMessage};
use axum::extract::FromRequestParts;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};

use crate::auth::bearer;
use crate::server::AppState;

/// Whether the request asks for a WebSocket upgrade.
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// The first subprotocol the client offers that this server speaks.
fn select_protocol(headers: &HeaderMap) -> Option<WebSocketProtocols> {
    headers
        .get(header::SEC_WEBSOCKET_PROTOCOL)?
        .to_str()
        .ok()?
        .split(',')
        .find_map(|p| WebSocketProtocols::from_str(p.trim()).ok())
}

/// Upgrades `GET /graphql` to a GraphQL WebSocket.
pub async fn upgrade(app: AppState, parts: &mut Parts) -> Response {
    let Some(protocol) = select_protocol(&parts.headers) else {
        return (
            StatusCode::BAD_REQUEST,
            "Sec-WebSocket-Protocol must offer graphql-transport-ws or graphql-ws",
        )
            .into_response();
    };
    let header_viewer = match parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
    {
        Some(token) => match app.verifier.verify(token) {
            Ok(v) => Some(v),
            Err(e) => return (StatusCode::UNAUTHORIZED, e.to_string()).into_response(),
        },
        None => None,
    };
    let ws = match WebSocketUpgrade::from_request_parts(parts, &()).await {
        Ok(ws) => ws,
        Err(rejection) => return rejection.into_response(),
    };
    ws.protocols([protocol.sec_websocket_protocol()])
        .on_upgrade(move |socket| serve(app, socket, protocol, header_viewer))
}

async fn serve(
    app: AppState,
    socket: WebSocket,
    protocol: WebSocketProtocols,
    header_viewer: Option<crate::auth::Viewer>,
) {
    let (mut sink, stream) = socket.split();
    let input = stream
        .take_while(|m| ready(!matches!(m, Err(_) | Ok(Message::Close(_)))))
        .filter_map(|m| {
            ready(match m {
                Ok(Message::Text(t)) => Some(t.as_str().as_bytes().to_vec()),
                Ok(Message::Binary(b)) => Some(b.to_vec()),
                _ => None,
            })
        });
    let mut connection_data = Data::default();
    if let Some(viewer) = header_viewer {
        connection_data.insert(viewer);
    }
    let init_app = app.clone();
    let mut messages = GqlWebSocket::new(app.schema.clone(), input, protocol)
        .connection_data(connection_data)
        .on_connection_init(move |payload| async move {
            let mut data = Data::default();
            let token = ["Authorization", "authorization", "token"]
                .iter()
                .find_map(|k| payload.get(*k).and_then(|v| v.as_str()));
            if let Some(token) = token {
                let token = bearer(token).unwrap_or(token);
                let viewer = init_app
                    .verifier
                    .verify(token)
                    .map_err(|e| async_graphql::Error::new(e.to_string()))?;
                data.insert(viewer);
            }
            Ok(data)
        });
    let mut shutdown = app.shutdown.clone();
    let stopping = async move {
        let _ = shutdown.wait_for(|stopping| *stopping).await;
    };
    tokio::pin!(stopping);
    loop {
        tokio::select! {
            message = messages.next() => match message {
                Some(WsMessage::Text(text)) => {
                    if sink.send(Message::Text(text.into())).await.is_err() {
                        return;
                    }
                }
                Some(WsMessage::Close(code, reason)) => {
                    let _ = sink
                        .send(Message::Close(Some(CloseFrame { code, reason: reason.into() })))
                        .await;
                    return;
                }
                None => {
                    let _ = sink.send(Message::Close(None)).await;
                    return;
                }
            },
            () = &mut stopping => {
                let _ = sink
                    .send(Message::Close(Some(CloseFrame {
                        code: 1001,
                        reason: "server shutting down".into(),
                    })))
                    .await;
                return;
            }
        }
    }
}
