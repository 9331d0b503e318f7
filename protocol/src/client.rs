//! The daemon side's connection (feature `client`): a WebSocket to `/agent` that offers the
//! protocol, and how a connection ended. Used by `compute-agent` and `compute-sim`.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};

use crate::{FromDaemon, PROTOCOL, ToDaemon};

/// A daemon's WebSocket.
pub type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How a connection ended: the close code and reason (`1006` when it ended without a close
/// frame, or could not be opened).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    pub code: u16,
    pub reason: String,
}

impl Closed {
    /// An end without a close frame.
    pub fn abnormal(reason: impl std::fmt::Display) -> Closed {
        Closed {
            code: 1006,
            reason: reason.to_string(),
        }
    }

    fn of(frame: Option<CloseFrame>) -> Closed {
        frame.map_or(
            Closed {
                code: 1005,
                reason: String::new(),
            },
            |f| Closed {
                code: f.code.into(),
                reason: f.reason.to_string(),
            },
        )
    }

    /// Whether reconnecting cannot help (`docs/agent-protocol.md`, close codes): the token is
    /// not this node's (`4403`), the node is unknown or retired (`4404`), or a newer session
    /// of the node is live (`4409`).
    pub fn is_final(&self) -> bool {
        matches!(self.code, 4403 | 4404 | 4409)
    }
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "closed {}: {}", self.code, self.reason)
    }
}

/// Opens a WebSocket to `url` (`ws://host:port/agent`) offering the protocol; nothing is sent.
pub async fn connect(url: &str) -> Result<Ws, Closed> {
    let mut req = url.into_client_request().map_err(Closed::abnormal)?;
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", HeaderValue::from_static(PROTOCOL));
    // Without Nagle's algorithm: a daemon's small messages leave at once.
    let (ws, _) = tokio_tungstenite::connect_async_with_config(req, None, true)
        .await
        .map_err(Closed::abnormal)?;
    Ok(ws)
}

/// Sends one message.
pub async fn send(ws: &mut Ws, message: &FromDaemon) -> Result<(), Closed> {
    ws.send(Message::Text(message.to_text().into()))
        .await
        .map_err(Closed::abnormal)
}

/// What arrived on a daemon's connection.
#[derive(Debug)]
pub enum Received {
    /// A message of the protocol.
    Message(ToDaemon),
    /// A text frame that is not one: why, and the frame.
    Malformed { error: String, text: String },
    /// A pong: the gateway answered a [`ping`].
    Pong,
}

/// The next text frame or pong from the gateway (pings and other frames are skipped); the
/// close as `Err`.
pub async fn receive(ws: &mut Ws) -> Result<Received, Closed> {
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(t))) => {
                return Ok(match ToDaemon::parse(t.as_str()) {
                    Ok(m) => Received::Message(m),
                    Err(e) => Received::Malformed {
                        error: e.to_string(),
                        text: t.as_str().to_owned(),
                    },
                });
            }
            Some(Ok(Message::Close(frame))) => return Err(Closed::of(frame)),
            Some(Ok(Message::Pong(_))) => return Ok(Received::Pong),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(Closed::abnormal(e)),
            None => return Err(Closed::abnormal("the connection ended")),
        }
    }
}

/// Sends a WebSocket ping: the peer's pong ([`Received::Pong`]) says it still reads.
pub async fn ping(ws: &mut Ws) -> Result<(), Closed> {
    ws.send(Message::Ping(Vec::new().into()))
        .await
        .map_err(Closed::abnormal)
}

/// Waits for the close of `ws` (skipping other messages), at most `within`.
pub async fn closed_of(ws: &mut Ws, within: Duration) -> Option<Closed> {
    tokio::time::timeout(within, async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(frame))) => return Closed::of(frame),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Closed::abnormal(e),
                None => return Closed::abnormal("the connection ended"),
            }
        }
    })
    .await
    .ok()
}

/// Says `bye`, closes with `1000` and waits (at most 5 s) for the gateway's close.
pub async fn bye(ws: &mut Ws, reason: &str) {
    let _ = send(
        ws,
        &FromDaemon::Bye {
            reason: Some(reason.to_owned()),
        },
    )
    .await;
    let _ = ws
        .close(Some(CloseFrame {
            code: 1000.into(),
            reason: Utf8Bytes::from_static("bye"),
        }))
        .await;
    let _ = closed_of(ws, Duration::from_secs(5)).await;
}

/// The gateway's `welcome`.
#[derive(Debug, Clone, PartialEq)]
pub struct Welcome {
    pub session_epoch: i64,
    pub gateway_id: String,
    pub heartbeat_seconds: f64,
}

/// Sends `hello` and waits (at most `within`) for `welcome`; how the gateway refused it
/// otherwise.
pub async fn hello(ws: &mut Ws, hello: &FromDaemon, within: Duration) -> Result<Welcome, Closed> {
    send(ws, hello).await?;
    let answer = tokio::time::timeout(within, async {
        loop {
            if let Received::Message(ToDaemon::Welcome {
                session_epoch,
                gateway_id,
                heartbeat_seconds,
                ..
            }) = receive(ws).await?
            {
                return Ok(Welcome {
                    session_epoch,
                    gateway_id,
                    heartbeat_seconds,
                });
            }
        }
    })
    .await;
    answer.unwrap_or_else(|_| Err(Closed::abnormal("no welcome in time")))
}
