//! GraphQL over WebSocket on `/graphql`, our own protocol layer over
//! `Schema::execute_stream`: the `graphql-transport-ws` protocol of graphql-ws (its
//! `PROTOCOL.md`), and the legacy `graphql-ws` subprotocol of `subscriptions-transport-ws`,
//! chosen by `Sec-WebSocket-Protocol`.
//!
//! `graphql-transport-ws`, case by case:
//! * credentials in the `connection_init` payload (`{"Authorization": "Bearer <jwt>"}`), or in
//!   the upgrade request's `Authorization` header; a bad token closes with `4403 Forbidden`;
//! * no `connection_init` within the init timeout: `4408 Connection initialisation timeout`;
//! * a second `connection_init`: `4429 Too many initialisation requests`;
//! * `subscribe` before the acknowledgement: `4401 Unauthorized`;
//! * `subscribe` with the id of an operation still running:
//!   `4409 Subscriber for <id> already exists`;
//! * anything that is not a valid message: `4400` with what was wrong;
//! * `ping` is answered with `pong`; the server also pings every keep-alive interval;
//! * an operation that fails before it yields (the document does not parse or validate, or the
//!   subscription cannot start: `NOT_FOUND`, `CURSOR_EXPIRED`, …) gets one `error` message and
//!   no `complete`; otherwise `next` messages, each subscription item with
//!   `extensions.cursor`, then `complete` when it ends;
//! * a token that expires while the connection is open closes it with `4403 Forbidden`;
//! * a `connection_init` of an identity holding its streams already: `1013 Too many streams`
//!   (Try Again Later, which graphql-ws's client retries; 4429 it takes as final);
//! * on shutdown the connection closes `1001` with no `complete` (a client takes `complete` as
//!   the operation's end and would not subscribe again; it retries 1001).
//!
//! The legacy protocol has no close codes of its own for these cases: it gets
//! `connection_error` before the same close codes, `ka` keep-alives, and `start`/`stop`/`data`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::time::Instant;
use tracing::{Instrument, debug};

use crate::auth::{Viewer, bearer};
use crate::graph::events::{Direct, Streaming};
use crate::state::AppState;
use crate::transport::build_request;
use crate::transport::prepare;

/// The two subprotocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `graphql-transport-ws`, of the graphql-ws library.
    TransportWs,
    /// `graphql-ws`, of the legacy subscriptions-transport-ws library.
    Legacy,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::TransportWs => "graphql-transport-ws",
            Protocol::Legacy => "graphql-ws",
        }
    }
}

/// Whether the request asks for a WebSocket upgrade.
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// The first subprotocol the client offers that this server speaks.
fn select_protocol(headers: &HeaderMap) -> Option<Protocol> {
    headers
        .get(header::SEC_WEBSOCKET_PROTOCOL)?
        .to_str()
        .ok()?
        .split(',')
        .find_map(|p| match p.trim() {
            "graphql-transport-ws" => Some(Protocol::TransportWs),
            "graphql-ws" => Some(Protocol::Legacy),
            _ => None,
        })
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
    let header_viewer = match crate::transport::authenticate(&app, &parts.headers) {
        Ok(v) => v,
        Err(why) => return (StatusCode::UNAUTHORIZED, why).into_response(),
    };
    let traceparent = parts
        .headers
        .get(crate::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(compute_telemetry::TraceParent::parse);
    let ws = match WebSocketUpgrade::from_request_parts(parts, &()).await {
        Ok(ws) => ws,
        Err(rejection) => return rejection.into_response(),
    };
    // tungstenite's defaults (128 KiB read and write buffers per connection) would cost
    // ~150 KiB for every idle subscriber; GraphQL messages are small, and the buffers grow when
    // one is not.
    let max = app.limits.max_ws_message;
    ws.protocols([protocol.name()])
        .read_buffer_size(4 * 1024)
        // An operation writes the frames it has at hand together (`COALESCE`); the buffer
        // grows only as far as one such batch needs.
        .write_buffer_size(WRITE_BUFFER)
        // tungstenite's default would take a 64 MiB message from anyone who connects.
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| serve(app, socket, protocol, header_viewer, traceparent))
}

/// How many bytes of frames a connection gathers before it writes them, without a flush.
const WRITE_BUFFER: usize = 16 * 1024;
/// How many frames an operation queues, at most, before it writes them.
const COALESCE: usize = 64;

/// What an operation says to its client.
enum Out {
    /// The payload, as JSON text (serialized once, where the response lies).
    Next(std::sync::Arc<str>),
    /// The errors, as a JSON array.
    Error(Value),
    Complete,
}

/// Why the connection loop ended.
enum End {
    /// The client went away or closed.
    Gone,
    /// Close with this code and reason.
    Close(u16, String),
}

/// The connection's writing half, shared by its loop and its operations' tasks: an operation
/// writes its own messages, so a frame costs one task's wake-up, not a hop through the
/// connection's task as well. The lock is fair (first come, first served), which is what makes
/// "abort, then take the lock" mean that an aborted operation writes nothing more.
#[derive(Clone)]
struct Writer {
    sink: Arc<tokio::sync::Mutex<SplitSink<WebSocket, Message>>>,
    protocol: Protocol,
}

impl Writer {
    async fn send(&self, message: Message) -> Result<(), axum::Error> {
        self.sink.lock().await.send(message).await
    }

    /// The message of an operation's output.
    fn message_of(&self, id: &str, out: Out) -> Message {
        let text = match (self.protocol, out) {
            // The payload is already JSON: the frame is written around it, not parsed again.
            (protocol, Out::Next(payload)) => {
                let kind = match protocol {
                    Protocol::TransportWs => "next",
                    Protocol::Legacy => "data",
                };
                // One allocation of the frame's size: this runs once per delivery.
                let mut text = String::with_capacity(payload.len() + id.len() + 40);
                text.push_str(r#"{"id":"#);
                push_json_string(&mut text, id);
                text.push_str(r#","type":""#);
                text.push_str(kind);
                text.push_str(r#"","payload":"#);
                text.push_str(&payload);
                text.push('}');
                text
            }
            (_, Out::Error(p)) => json!({ "id": id, "type": "error", "payload": p }).to_string(),
            (_, Out::Complete) => json!({ "id": id, "type": "complete" }).to_string(),
        };
        Message::Text(text.into())
    }
}

/// The operations running on one connection, by id: the connection adds and aborts them, and
/// an operation that ends removes itself before it writes its last message, so a client that
/// has read `complete` (or `error`) may reuse the id at once.
type Ops = Arc<std::sync::Mutex<HashMap<String, Op>>>;

struct Op {
    /// Tells this operation from a later one with the same id.
    generation: u64,
    /// `None` for the moment between its entry and its task's start.
    abort: Option<tokio::task::AbortHandle>,
}

fn ops_of(ops: &Ops) -> std::sync::MutexGuard<'_, HashMap<String, Op>> {
    ops.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where one operation writes.
struct Output {
    id: String,
    generation: u64,
    writer: Writer,
    ops: Ops,
}

impl Output {
    /// Queues a `next` without flushing it; `false` when the connection is gone.
    async fn feed(&self, payload: Arc<str>) -> bool {
        let message = self.writer.message_of(&self.id, Out::Next(payload));
        self.writer.sink.lock().await.feed(message).await.is_ok()
    }

    /// Writes what was queued; `false` when the connection is gone.
    async fn flush(&self) -> bool {
        self.writer.sink.lock().await.flush().await.is_ok()
    }

    /// Sends the operation's last message, after it has left the connection's operations.
    async fn end(self, out: Out) {
        let message = self.writer.message_of(&self.id, out);
        let mut sink = self.writer.sink.lock().await;
        {
            let mut ops = ops_of(&self.ops);
            if ops
                .get(&self.id)
                .is_some_and(|op| op.generation == self.generation)
            {
                ops.remove(&self.id);
            }
        }
        let _ = sink.send(message).await;
    }
}

struct Conn {
    app: AppState,
    writer: Writer,
    viewer: Option<Viewer>,
    init_received: bool,
    acked: bool,
    ops: Ops,
    /// The generation of the next operation.
    generation: u64,
    /// Ends when the token expires, by business time ([`Clock::sleep_until`]).
    ///
    /// [`Clock::sleep_until`]: compute_domain::clock::Clock::sleep_until
    expiry: Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    /// Ends when a change to the caller's grants leaves it less than it had
    /// ([`crate::authz::Authz::shrinks`]).
    revoked: Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    /// The connection's place among its identity's streams, from the acknowledgement on.
    stream: Option<crate::limits::StreamGuard>,
    /// What every operation's trace continues: the `traceparent` of `connection_init`'s
    /// payload, else the upgrade request's header.
    traceparent: Option<compute_telemetry::TraceParent>,
}

/// Ends when `viewer`'s token stops being valid, by business time; never without a token.
fn expiry_of(
    app: &AppState,
    viewer: Option<&Viewer>,
) -> Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    match viewer {
        None => Box::pin(std::future::pending()),
        Some(v) => {
            let clock = app.clock.clone();
            let until = clock.after(v.valid_for());
            Box::pin(async move { clock.sleep_until(until).await })
        }
    }
}

async fn serve(
    app: AppState,
    socket: WebSocket,
    protocol: Protocol,
    viewer: Option<Viewer>,
    traceparent: Option<compute_telemetry::TraceParent>,
) {
    let (sink, mut stream) = socket.split();
    let config = app.tailer.config().clone();
    let mut conn = Conn {
        expiry: expiry_of(&app, viewer.as_ref()),
        revoked: app.authz.shrinks(viewer.as_ref()),
        app: app.clone(),
        writer: Writer {
            sink: Arc::new(tokio::sync::Mutex::new(sink)),
            protocol,
        },
        viewer,
        init_received: false,
        acked: false,
        stream: None,
        ops: Ops::default(),
        generation: 0,
        traceparent,
    };
    let init_deadline = tokio::time::sleep(config.init_timeout);
    tokio::pin!(init_deadline);
    let mut keep_alive =
        tokio::time::interval_at(Instant::now() + config.keep_alive, config.keep_alive);
    let mut shutdown = app.shutdown.clone();
    let stopping = async move {
        let _ = shutdown.wait_for(|stopping| *stopping).await;
    };
    tokio::pin!(stopping);
    // The operations write their own messages ([`Writer`]): this loop wakes only for the
    // client's messages, its timers and shutdown.
    let end = loop {
        tokio::select! {
            message = stream.next() => {
                let text = match message {
                    Some(Err(e)) if too_big(&e) => {
                        app.metrics.record_refusal("ws_message_bytes");
                        break End::Close(
                            1009,
                            format!("Message too big: at most {} bytes", app.limits.max_ws_message),
                        );
                    }
                    None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break End::Gone,
                    Some(Ok(Message::Text(t))) => t.as_str().to_owned(),
                    Some(Ok(Message::Binary(b))) => match String::from_utf8(b.to_vec()) {
                        Ok(t) => t,
                        Err(_) => break End::Close(4400, "Invalid message received: not UTF-8".into()),
                    },
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                };
                match conn.handle(&text).await {
                    Ok(()) => {}
                    Err(end) => break end,
                }
            }
            () = &mut init_deadline, if !conn.init_received => {
                break End::Close(4408, "Connection initialisation timeout".into());
            }
            _ = keep_alive.tick(), if conn.acked => {
                let ka = match protocol {
                    Protocol::TransportWs => json!({ "type": "ping" }),
                    Protocol::Legacy => json!({ "type": "ka" }),
                };
                if conn.send(ka).await.is_err() {
                    break End::Gone;
                }
            }
            () = &mut conn.expiry => {
                if protocol == Protocol::Legacy {
                    let _ = conn.send(json!({ "type": "connection_error", "payload": { "message": "the bearer token has expired" } })).await;
                }
                break End::Close(4403, "Forbidden: the bearer token has expired".into());
            }
            () = &mut conn.revoked => {
                if protocol == Protocol::Legacy {
                    let _ = conn.send(json!({ "type": "connection_error", "payload": { "message": "your access was revoked" } })).await;
                }
                break End::Close(4403, "Forbidden: your access was revoked".into());
            }
            () = &mut stopping => {
                // No `complete`: to a client it means the operation is over, and graphql-ws's
                // would not subscribe again; 1001 (Going Away) it retries, and resubscribes.
                break End::Close(1001, "server shutting down".into());
            }
        }
    };
    conn.abort_all();
    let mut sink = conn.writer.sink.lock().await;
    match end {
        End::Gone => {
            let _ = sink.close().await;
        }
        End::Close(code, reason) => {
            debug!(code, reason = %reason, "closing a GraphQL WebSocket");
            let _ = sink
                .send(Message::Close(Some(CloseFrame {
                    code,
                    reason: super::fit_reason(&reason).into(),
                })))
                .await;
            if code == 1009 {
                // The rest of the oversized message is still arriving and is not read (reading
                // it is what the limit refuses): closing the socket over unread bytes would
                // reset the connection, and a client could lose the close frame with it. A
                // moment lets it read the frame and close first.
                tokio::time::sleep(TOO_BIG_LINGER).await;
            }
            let _ = sink.close().await;
        }
    }
}

/// How long a connection closed for an oversized message stays open after its close frame.
const TOO_BIG_LINGER: std::time::Duration = std::time::Duration::from_millis(500);

/// Whether a read failed because a message or frame was over the limit (tungstenite's
/// `Error::Capacity`, which axum wraps without naming it).
fn too_big(e: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.to_string().starts_with("Space limit exceeded") {
            return true;
        }
        cause = c.source();
    }
    false
}

fn invalid(what: impl std::fmt::Display) -> End {
    End::Close(4400, format!("Invalid message received: {what}"))
}

impl Conn {
    async fn send(&mut self, message: Value) -> Result<(), axum::Error> {
        self.writer
            .send(Message::Text(message.to_string().into()))
            .await
    }

    async fn send_out(&mut self, id: &str, out: Out) -> Result<(), axum::Error> {
        let message = self.writer.message_of(id, out);
        self.writer.send(message).await
    }

    /// Aborts the operation `id`, if it runs; once this returns it writes nothing more.
    async fn abort(&mut self, id: &str) {
        let op = ops_of(&self.ops).remove(id);
        if let Some(abort) = op.and_then(|op| op.abort) {
            abort.abort();
            // Waits for a message it may be writing now (the lock is fair, so it cannot take
            // it again before this has had it).
            drop(self.writer.sink.lock().await);
        }
    }

    /// Aborts every operation; returns their ids.
    fn abort_all(&mut self) -> Vec<String> {
        let ops = std::mem::take(&mut *ops_of(&self.ops));
        ops.into_iter()
            .map(|(id, op)| {
                if let Some(abort) = op.abort {
                    abort.abort();
                }
                id
            })
            .collect()
    }

    /// Handles one client message; `Err` ends the connection.
    async fn handle(&mut self, text: &str) -> Result<(), End> {
        let message: Value = serde_json::from_str(text).map_err(|_| invalid("not JSON"))?;
        let Some(kind) = message.get("type").and_then(Value::as_str) else {
            return Err(invalid("no `type`"));
        };
        match (self.writer.protocol, kind) {
            (_, "connection_init") => self.init(message.get("payload")).await,
            (Protocol::TransportWs, "ping") => {
                let mut pong = json!({ "type": "pong" });
                if let Some(p) = message.get("payload") {
                    pong["payload"] = p.clone();
                }
                self.send(pong).await.map_err(|_| End::Gone)
            }
            (Protocol::TransportWs, "pong") => Ok(()),
            (Protocol::TransportWs, "subscribe") | (Protocol::Legacy, "start") => {
                self.subscribe(&message).await
            }
            (Protocol::TransportWs, "complete") | (Protocol::Legacy, "stop") => {
                let id = op_id(&message)?;
                self.abort(&id).await;
                Ok(())
            }
            (Protocol::Legacy, "connection_terminate") => {
                Err(End::Close(1000, "connection terminated".into()))
            }
            (_, other) => Err(invalid(format!("unexpected message type `{other}`"))),
        }
    }

    async fn init(&mut self, payload: Option<&Value>) -> Result<(), End> {
        if self.init_received {
            return Err(End::Close(4429, "Too many initialisation requests".into()));
        }
        self.init_received = true;
        let token = match payload {
            None | Some(Value::Null) => None,
            Some(Value::Object(map)) => ["Authorization", "authorization", "token"]
                .iter()
                .find_map(|k| map.get(*k))
                .map(|v| {
                    v.as_str().ok_or_else(|| {
                        invalid("the `Authorization` of the payload is not a string")
                    })
                })
                .transpose()?,
            Some(_) => return Err(invalid("the `connection_init` payload is not an object")),
        };
        // W3C trace context, as an HTTP header would carry it; an invalid one is ignored, as
        // the specification asks of a header.
        if let Some(tp) = payload
            .and_then(|p| p.get(crate::trace::TRACEPARENT))
            .and_then(Value::as_str)
            .and_then(compute_telemetry::TraceParent::parse)
        {
            self.traceparent = Some(tp);
        }
        if token.is_none() && self.viewer.is_none() {
            // A connection without a token could only hold a socket open: nothing to subscribe
            // to needs no token.
            self.app.metrics.record_refusal("anonymous_stream");
            return Err(self
                .forbid("a bearer token is required (in the payload or the upgrade request)")
                .await);
        }
        if let Some(token) = token {
            let token = bearer(token).unwrap_or(token);
            match self.app.identify(token) {
                Ok(viewer) => {
                    self.expiry = expiry_of(&self.app, Some(&viewer));
                    self.revoked = self.app.authz.shrinks(Some(&viewer));
                    self.viewer = Some(viewer);
                }
                Err(e) => return Err(self.forbid(&e).await),
            }
        }
        let key = crate::graph::admission::identity_key(self.viewer.as_ref(), None);
        let max = self.app.limits.max_streams_per_identity;
        match self.app.streams.open(key, max) {
            Some(guard) => self.stream = Some(guard),
            None => {
                self.app.metrics.record_refusal("streams");
                if self.writer.protocol == Protocol::Legacy {
                    let _ = self
                        .send(json!({ "type": "connection_error", "payload": { "message": "too many streams" } }))
                        .await;
                }
                // 1013 (Try Again Later): graphql-ws's client retries it with backoff, where it
                // takes 4429 (its "too many initialisation requests") as final.
                return Err(End::Close(
                    1013,
                    format!("Too many streams: at most {max} per identity"),
                ));
            }
        }
        self.acked = true;
        self.send(json!({ "type": "connection_ack" }))
            .await
            .map_err(|_| End::Gone)?;
        if self.writer.protocol == Protocol::Legacy {
            self.send(json!({ "type": "ka" }))
                .await
                .map_err(|_| End::Gone)?;
        }
        Ok(())
    }

    /// Refuses the connection's credentials: `4403`, after `connection_error` on the legacy
    /// protocol.
    async fn forbid(&mut self, why: &str) -> End {
        if self.writer.protocol == Protocol::Legacy {
            let _ = self
                .send(json!({ "type": "connection_error", "payload": { "message": why } }))
                .await;
        }
        End::Close(4403, super::fit_reason(&format!("Forbidden: {why}")))
    }

    async fn subscribe(&mut self, message: &Value) -> Result<(), End> {
        if !self.acked {
            return Err(End::Close(4401, "Unauthorized".into()));
        }
        let id = op_id(message)?;
        let Some(payload) = message.get("payload").and_then(Value::as_object) else {
            return Err(invalid("the subscribe message has no payload object"));
        };
        let running = ops_of(&self.ops).contains_key(&id);
        if running {
            match self.writer.protocol {
                Protocol::TransportWs => {
                    return Err(End::Close(
                        4409,
                        format!("Subscriber for {id} already exists"),
                    ));
                }
                // subscriptions-transport-ws replaces the operation with the same id.
                Protocol::Legacy => self.abort(&id).await,
            }
        }
        let request = match build_request(
            &self.app.persisted,
            payload.get("query").cloned(),
            payload.get("operationName").cloned(),
            payload.get("variables").cloned(),
            payload.get("extensions").cloned(),
        ) {
            Ok(r) => r,
            Err(crate::transport::Refused::Malformed(why)) => return Err(invalid(why)),
            // A persisted query that cannot run fails the operation, not the connection.
            Err(crate::transport::Refused::Persisted(r)) => {
                let errors = json!([{ "message": r.message, "extensions": { "code": r.code } }]);
                return self
                    .send_out(&id, Out::Error(errors))
                    .await
                    .map_err(|_| End::Gone);
            }
        };
        let running = ops_of(&self.ops).len();
        if running >= self.app.tailer.config().max_operations {
            let errors = json!([{
                "message": format!("at most {} operations may run at once on one connection", self.app.tailer.config().max_operations),
                "extensions": { "code": compute_domain::ErrorCode::RateLimited.as_str() }
            }]);
            return self
                .send_out(&id, Out::Error(errors))
                .await
                .map_err(|_| End::Gone);
        }
        // Entered before its task starts, so the task finds itself when it ends, however soon.
        let generation = self.generation;
        self.generation += 1;
        ops_of(&self.ops).insert(
            id.clone(),
            Op {
                generation,
                abort: None,
            },
        );
        let output = Output {
            id: id.clone(),
            generation,
            writer: self.writer.clone(),
            ops: self.ops.clone(),
        };
        // Each operation runs as the grants make its caller now, as each HTTP request does:
        // a revocation that leaves the connection open (a fleet operator who was also a
        // member of a tenant keeps seeing that tenant's streams) still takes the revoked
        // role and tenant from what it starts next, and a stale projection refuses it.
        let viewer = self.viewer.clone().map(|v| self.app.authz.resolve(v));
        let handle = tokio::spawn(run_operation(
            self.app.clone(),
            request,
            viewer,
            output,
            self.traceparent,
        ));
        if let Some(op) = ops_of(&self.ops).get_mut(&id)
            && op.generation == generation
        {
            op.abort = Some(handle.abort_handle());
        }
        Ok(())
    }
}

/// Appends `s` as a JSON string.
fn push_json_string(out: &mut String, s: &str) {
    if s.chars().all(|c| c != '"' && c != '\\' && !c.is_control()) {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&Value::from(s).to_string());
    }
}

fn op_id(message: &Value) -> Result<String, End> {
    match message.get("id").and_then(Value::as_str) {
        Some(id) if !id.is_empty() => Ok(id.to_owned()),
        _ => Err(invalid("the message has no `id`")),
    }
}

/// Runs one operation and hands its messages to the connection, in the operation's span.
async fn run_operation(
    app: AppState,
    request: async_graphql::Request,
    viewer: Option<Viewer>,
    out: Output,
    traceparent: Option<compute_telemetry::TraceParent>,
) {
    let (span, trace) = super::request_span(
        "websocket",
        &request,
        viewer.as_ref(),
        None,
        crate::trace::Trace::continuing(traceparent),
    );
    crate::trace::scope(trace, operation(app, request, viewer, out))
        .instrument(span)
        .await;
}

async fn operation(
    app: AppState,
    request: async_graphql::Request,
    viewer: Option<Viewer>,
    out: Output,
) {
    let mut request = crate::graph::with_loaders(request, &app.db);
    // No peer: every operation here has a viewer (`connection_init` refuses a connection
    // without a token, and nothing runs before its acknowledgement), so its budget is the
    // subject's.
    let admitted = app
        .admission
        .parse(&mut request)
        .map_err(|mut e| {
            // async-graphql's parser error has no code: a document that does not parse is
            // `GRAPHQL_PARSE_FAILED` here as over HTTP and SSE (`prepare` would call any
            // uncoded request error a validation failure).
            if super::code_of(&e).is_none() {
                super::set_code(&mut e, super::PARSE_FAILED);
            }
            e
        })
        .and_then(|()| app.admission.admit(&mut request, viewer.as_ref(), None));
    let (request, mut streaming) = Streaming::attach(request, viewer, app.tailer.frames(), true);
    // An `events` subscription hands its feed over once it has started: from then on this
    // loop reads the events, sends each payload another subscriber of the same shape stored as
    // it is, and has the operation's stream render only the others ([`Direct`]).
    let mut handover = streaming.handover();
    let mut direct: Option<Direct> = None;
    // An event handed back to be rendered: the next one waits for its response, so frames
    // leave in the feed's order.
    let mut rendering = false;
    let mut responses = super::execute_streaming(&app, request, admitted);
    let mut first = true;
    // Frames queued and not written yet. A frame is written once nothing else is ready, so an
    // operation that fell behind writes the frames it has at hand with one system call, and a
    // backlog costs less per frame rather than more.
    let mut unflushed = 0usize;
    loop {
        if unflushed >= COALESCE {
            if !out.flush().await {
                return;
            }
            unflushed = 0;
        }
        tokio::select! {
            biased;
            // The operation's stream has something to say only before the handover, or when
            // it was handed an event to render: polling it otherwise would run async-graphql's
            // stream machinery for every shared frame.
            response = responses.next(), if direct.is_none() || rendering => {
                let Some(mut response) = response else { break };
                rendering = false;
                let request_error = prepare(&app, &mut response);
                if first && response.data == async_graphql::Value::Null && !response.errors.is_empty() {
                    let errors = serde_json::to_value(&response.errors).unwrap_or(Value::Null);
                    out.end(Out::Error(errors)).await;
                    return;
                }
                first = false;
                streaming.decorate(&mut response);
                let payload = streaming.payload(&response, || {
                    crate::transport::response_json(&response, request_error).text()
                });
                if !out.feed(payload).await {
                    return;
                }
                unflushed += 1;
            }
            handed = async { handover.as_mut().expect("checked").await }, if handover.is_some() => {
                handover = None;
                direct = handed.ok();
                // The subscription has started: what follows, errors included, is `next`.
                if direct.is_some() {
                    first = false;
                }
            }
            event = async { direct.as_mut().expect("checked").feed.next().await }, if direct.is_some() && !rendering => {
                let Some(d) = &direct else { continue };
                match event {
                    Ok(Some(event)) => match d.stored(event.cursor) {
                        Some(payload) => {
                            if !out.feed(payload).await {
                                return;
                            }
                            unflushed += 1;
                        }
                        // Not rendered yet: the stream renders it (and stores it for the others
                        // of its shape); the feed waits for that response.
                        None => {
                            if !d.render(Ok(event)) {
                                return;
                            }
                            rendering = true;
                        }
                    },
                    // The server is shutting down: dropping the feed ends the stream, and with
                    // it the operation.
                    Ok(None) => direct = None,
                    // The stream reports it and ends.
                    Err(e) => {
                        rendering = d.render(Err(e));
                        direct = None;
                    }
                }
            }
            // Nothing else is ready: what was queued goes out now.
            written = out.flush(), if unflushed > 0 => {
                if !written {
                    return;
                }
                unflushed = 0;
            }
        }
    }
    // A stream that ended because the server is shutting down (the tailer stops first) is not
    // complete: the connection closes with `1001`, which clients retry.
    if *app.shutdown.borrow() {
        return;
    }
    out.end(Out::Complete).await;
}
