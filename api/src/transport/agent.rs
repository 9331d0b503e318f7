//! `/agent`: the node-daemon protocol `compute-agent.v1` over WebSocket, as specified in
//! `docs/agent-protocol.md`. One connection per daemon; JSON text messages with a `type`.
//!
//! daemon → gateway: `hello` (first, within 10 s), `heartbeat`, `status`, `bye`, and for
//! commands `ack`, `progress`, `result`.
//! gateway → daemon: `welcome`, `error`, and for commands `command`, `proceed`, `cancelled`,
//! `recorded`.
//! Close codes: `4400` malformed, `4401` unauthenticated, `4403` forbidden, `4404` unknown or
//! retired node, `4408` timeout (no hello, or silent), `4409` superseded, `4410` session ended by
//! the control plane, `4429` flood, `1001` gateway stopping, `1009` too big, `1011` internal,
//! `1013` try again later (the gateway holds no lease, or the database is away).

use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use compute_domain::Error;
use compute_domain::fleet::changes as cmd;
use compute_domain::fleet::enrollment;
use compute_domain::ids::{CommandId, InstanceId, NodeId, PoolId};
use compute_domain::instances::{self, ReportedExit};
use compute_domain::node_commands::{self, AckAnswer, Report};
use compute_domain::node_sessions::{self, CloseReason, Hello, Label};
use futures_util::SinkExt;
use tokio::time::Instant;
use tracing::{Instrument, debug, info, warn};

use crate::auth::Role;
use crate::state::AppState;

pub use compute_protocol::PROTOCOL;
use compute_protocol::{FromDaemon, Outcome, ToDaemon};

/// Sends one message of the protocol; `false` when the connection is gone.
async fn send(socket: &mut WebSocket, message: &ToDaemon) -> bool {
    socket
        .send(Message::Text(message.to_text().into()))
        .await
        .is_ok()
}

/// The `error` message for a refused message (the session goes on).
fn refused(message: String, command: Option<&CommandId>) -> ToDaemon {
    ToDaemon::Error {
        code: "BAD_USER_INPUT".to_owned(),
        message,
        command_id: command.map(ToString::to_string),
    }
}

/// How a connection ends.
#[derive(Debug)]
struct End {
    code: u16,
    reason: String,
    /// Why the session closes in the database (when it was open and still this gateway's).
    session: CloseReason,
}

impl End {
    fn new(code: u16, reason: impl Into<String>, session: CloseReason) -> End {
        End {
            code,
            reason: reason.into(),
            session,
        }
    }
}

fn offered(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == PROTOCOL)
}

/// `GET /agent`: upgrades to the agent protocol.
pub async fn get(
    State(app): State<AppState>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    if !offered(&headers) {
        return (
            StatusCode::BAD_REQUEST,
            format!("Sec-WebSocket-Protocol must offer {PROTOCOL} (docs/agent-protocol.md)"),
        )
            .into_response();
    }
    let header_token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::auth::bearer)
        .map(str::to_owned);
    let ws = match ws {
        Ok(ws) => ws,
        Err(rejection) => return rejection.into_response(),
    };
    let max = app.gateway.config().max_message;
    ws.protocols([PROTOCOL])
        .read_buffer_size(4 * 1024)
        .write_buffer_size(0)
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| serve(app, socket, header_token))
}

/// How long a session opened with a node credential lasts before it must reconnect: the
/// credential does not expire (retiring the node revokes it), so only as a bound.
const CREDENTIAL_SESSION: std::time::Duration = std::time::Duration::from_secs(30 * 86_400);

/// `join`: registers the machine with a one-time token, answers `joined` with its credential
/// (or `error` with a `JOIN_TOKEN_*`, `BAD_USER_INPUT` or `CONFLICT` code, nothing written) and
/// closes; the daemon then opens its sessions with `hello`.
async fn join(
    app: &AppState,
    mut socket: WebSocket,
    token: &str,
    pool: Option<String>,
    daemon_version: &str,
    inventory: &compute_protocol::Inventory,
) {
    let refuse = |code: &str, message: String| ToDaemon::Error {
        code: code.to_owned(),
        message,
        command_id: None,
    };
    // Logged, not stored: checked all the same, so no log line carries what a daemon made up.
    let daemon_version = match Label::parse("daemonVersion", daemon_version) {
        Ok(v) => v,
        Err(e) => {
            send(&mut socket, &refuse("BAD_USER_INPUT", e.to_string())).await;
            return close(&mut socket, 4400, "daemonVersion is not a label").await;
        }
    };
    let pool = match pool.map(|p| PoolId::parse("poolId", &p)).transpose() {
        Ok(p) => p,
        Err(e) => {
            send(&mut socket, &refuse("BAD_USER_INPUT", e.to_string())).await;
            return close(&mut socket, 4400, "poolId is not a pool id").await;
        }
    };
    match enrollment::join(&app.db, token, pool.as_ref(), inventory).await {
        Ok(Ok(joined)) => {
            let node = &joined.registered.node;
            info!(node = %node.id, pool = %node.pool_id, hostname = %node.hostname,
                  gpus = joined.registered.devices.len(), version = %daemon_version, "machine joined");
            let reply = ToDaemon::Joined {
                node_id: node.id.to_string(),
                pool_id: node.pool_id.to_string(),
                credential: joined.credential,
            };
            send(&mut socket, &reply).await;
            close(&mut socket, 1000, "joined: open a session with hello").await;
        }
        Ok(Err(refused)) => {
            info!(code = refused.code, hostname = %compute_domain::error::bounded(&inventory.hostname), "join refused");
            send(&mut socket, &refuse(refused.code, refused.message.clone())).await;
            close(&mut socket, 4403, refused.code).await;
        }
        Err(e) => {
            let code = e.code().as_str();
            let message = match &e {
                Error::BadUserInput { .. } | Error::Conflict { .. } | Error::NotFound { .. } => {
                    e.to_string()
                }
                _ => {
                    warn!(error = %e, "join failed");
                    "the join failed; retry".to_owned()
                }
            };
            send(&mut socket, &refuse(code, message)).await;
            let end = end_of(&e);
            close(
                &mut socket,
                if end.code == 4404 { 4409 } else { end.code },
                &end.reason,
            )
            .await;
        }
    }
}

async fn close(socket: &mut WebSocket, code: u16, reason: &str) {
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code,
            reason: super::fit_reason(reason).into(),
        })))
        .await;
    let _ = socket.close().await;
}

/// Maps a domain error while opening or writing a session to a close.
fn end_of(e: &Error) -> End {
    match e {
        Error::NotFound { .. } => End::new(4404, "unknown node", CloseReason::ProtocolError),
        Error::Conflict { message, .. } => {
            End::new(4404, message.clone(), CloseReason::ProtocolError)
        }
        Error::BadUserInput { message, .. } => {
            End::new(4400, message.clone(), CloseReason::ProtocolError)
        }
        Error::LeaseLost(_) => End::new(
            1013,
            "the gateway lost its lease; reconnect",
            CloseReason::GatewayLost,
        ),
        e if e.code() == compute_domain::error::ErrorCode::Unavailable
            || e.code() == compute_domain::error::ErrorCode::LockTimeout =>
        {
            End::new(
                1013,
                "the control plane is unavailable; retry",
                CloseReason::GatewayLost,
            )
        }
        e => {
            warn!(error = %e, "agent session failed");
            End::new(1011, "internal error", CloseReason::ProtocolError)
        }
    }
}

async fn serve(app: AppState, mut socket: WebSocket, header_token: Option<String>) {
    let gateway = app.gateway.clone();
    let config = gateway.config().clone();
    // 1. hello, within the timeout.
    let first = tokio::time::timeout(config.hello_timeout, socket.recv()).await;
    let text = match first {
        Err(_) => return close(&mut socket, 4408, "no hello within the time allowed").await,
        Ok(None) | Ok(Some(Err(_))) | Ok(Some(Ok(Message::Close(_)))) => return,
        Ok(Some(Ok(Message::Text(t)))) => t,
        Ok(Some(Ok(_))) => {
            return close(&mut socket, 4400, "the first message must be a text hello").await;
        }
    };
    let (token, node, hello) = match FromDaemon::parse(text.as_str()) {
        Ok(FromDaemon::Hello {
            token,
            node_id,
            daemon_version,
            journal_id,
            observed_generation,
        }) => (
            token,
            node_id,
            // Parsed here, refused (as before) only after the token is checked.
            Label::parse("daemonVersion", &daemon_version).and_then(|daemon_version| {
                Ok(Hello {
                    daemon_version,
                    journal_id: Label::parse("journalId", &journal_id)?,
                    observed_generation,
                })
            }),
        ),
        Ok(FromDaemon::Join {
            token,
            pool_id,
            daemon_version,
            inventory,
        }) => return join(&app, socket, &token, pool_id, &daemon_version, &inventory).await,
        Ok(_) => return close(&mut socket, 4400, "the first message must be hello").await,
        Err(e) => {
            return close(
                &mut socket,
                4400,
                &format!(
                    "malformed hello: {}",
                    compute_domain::error::bounded(&e.to_string())
                ),
            )
            .await;
        }
    };
    // 2. the token: a node token for this very node.
    let Some(token) = token.or(header_token) else {
        return close(
            &mut socket,
            4401,
            "no token: send it in hello or the Authorization header",
        )
        .await;
    };
    let node = match NodeId::parse("nodeId", &node) {
        Ok(n) => n,
        Err(_) => return close(&mut socket, 4400, "nodeId is not a node id").await,
    };
    // A node credential (a machine that joined by itself) is checked in the database and does
    // not expire; anything else is a JWT with the node role for this very node.
    let valid_for = if enrollment::is_credential(&token) {
        match enrollment::credential_opens(&app.db, &node, &token).await {
            Ok(true) => CREDENTIAL_SESSION,
            Ok(false) => {
                // 4403, not 4401: retrying the same credential cannot help.
                return close(
                    &mut socket,
                    4403,
                    "this node credential is unknown or revoked (a retired node's is): join again with a new token",
                )
                .await;
            }
            Err(e) => {
                let end = end_of(&e);
                return close(&mut socket, end.code, &end.reason).await;
            }
        }
    } else {
        let viewer = match app.verifier.verify(&token) {
            Ok(v) => v,
            Err(e) => return close(&mut socket, 4401, &e.to_string()).await,
        };
        if !viewer.has_role(Role::Node) || viewer.node.as_ref() != Some(&node) {
            return close(
                &mut socket,
                4403,
                "this token may not open this node's session",
            )
            .await;
        }
        viewer.valid_for()
    };
    let hello = match hello {
        Ok(h) => h,
        Err(e) => {
            let end = end_of(&e);
            return close(&mut socket, end.code, &end.reason).await;
        }
    };
    // 3. the session, fenced by the gateway's lease. A fence that fails because the lease
    // lapsed unnoticed (a renewal late, a clock step) is renewed once and tried again.
    let mut attempt = 0;
    let (db, epoch) = loop {
        attempt += 1;
        let (db, fence) = match gateway.fenced_db().await {
            Ok(Some(held)) => held,
            Ok(None) => {
                return close(&mut socket, 1013, "this gateway holds no lease; retry").await;
            }
            Err(e) => {
                let end = end_of(&e);
                return close(&mut socket, end.code, &end.reason).await;
            }
        };
        match node_sessions::open(&db, &node, gateway.id(), fence.epoch, &hello).await {
            Ok(epoch) => break (db, epoch),
            Err(Error::LeaseLost(_)) if attempt == 1 => {
                let _ = gateway.refresh_lease().await;
            }
            Err(e) => {
                let end = end_of(&e);
                return close(&mut socket, end.code, &end.reason).await;
            }
        }
    };
    let mut registered = gateway.register(&node, epoch);
    info!(node = %node, epoch, gateway = %gateway.id(), version = %hello.daemon_version, "node session opened");
    let welcome = ToDaemon::Welcome {
        session_epoch: epoch,
        gateway_id: gateway.id().to_string(),
        heartbeat_seconds: config.heartbeat.as_secs_f64(),
        protocol: PROTOCOL.to_owned(),
    };
    if !send(&mut socket, &welcome).await {
        if gateway.unregister(&node, epoch) {
            let _ = node_sessions::close(&db, &node, epoch, CloseReason::DaemonClosed).await;
        }
        return;
    }
    // 4. the session's life.
    let stopping = {
        let mut rx = app.shutdown.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    tokio::pin!(stopping);
    // The session ends when its token expires, by business time.
    let expiry = {
        let clock = gateway.clock().clone();
        let until = clock.after(valid_for);
        async move { clock.sleep_until(until).await }
    };
    tokio::pin!(expiry);
    let mut window = (Instant::now(), 0u32);
    // The silence timer runs on business time: it sleeps for what is left of `silent_after`,
    // and looks again whenever the clock is sampled (simulated time moves only then).
    let end: End = loop {
        let silence = gateway
            .clock()
            .sleep_until(gateway.silence_ends(&registered));
        tokio::select! {
            msg = socket.recv() => {
                let msg = match msg {
                    None | Some(Err(_)) => break End::new(1006, "", CloseReason::DaemonClosed),
                    Some(Ok(m)) => m,
                };
                gateway.touch(&registered);
                if window.0.elapsed() >= std::time::Duration::from_secs(1) {
                    window = (Instant::now(), 0);
                }
                window.1 += 1;
                if window.1 > config.max_messages_per_second {
                    break End::new(4429, "too many messages", CloseReason::ProtocolError);
                }
                let text = match msg {
                    Message::Text(t) => t,
                    Message::Close(_) => break End::new(1000, "", CloseReason::DaemonClosed),
                    Message::Ping(_) | Message::Pong(_) => continue,
                    Message::Binary(_) => break End::new(4400, "binary messages are not part of the protocol", CloseReason::ProtocolError),
                };
                match FromDaemon::parse(text.as_str()) {
                    Ok(FromDaemon::Heartbeat {}) => {}
                    Ok(FromDaemon::Status { observed_generation }) => {
                        match node_sessions::observe_generation(&db, &node, epoch, observed_generation).await {
                            Ok(true) => {}
                            Ok(false) => break End::new(4410, "this session is no longer current", CloseReason::Superseded),
                            Err(Error::BadUserInput { message, .. }) => {
                                send(&mut socket, &refused(message, None)).await;
                            }
                            Err(e) => break end_of(&e),
                        }
                    }
                    Ok(FromDaemon::Bye { reason }) => {
                        debug!(node = %node, reason = ?reason, "daemon said bye");
                        break End::new(1000, "bye", CloseReason::DaemonClosed);
                    }
                    Ok(FromDaemon::Ack { command_id }) => {
                        let Ok(id) = CommandId::parse("commandId", &command_id) else {
                            break End::new(4400, "commandId is not a command id", CloseReason::ProtocolError);
                        };
                        let answer = match node_commands::ack(&db, &node, epoch, &id).await {
                            Ok(AckAnswer::Proceed) => ToDaemon::Proceed { command_id: id.to_string() },
                            Ok(AckAnswer::Refused(reason)) => {
                                debug!(node = %node, command = %id, %reason, "acknowledgement refused");
                                ToDaemon::Cancelled { command_id: id.to_string(), reason }
                            }
                            Err(e) => break end_of(&e),
                        };
                        if !send(&mut socket, &answer).await {
                            break End::new(1006, "", CloseReason::DaemonClosed);
                        }
                    }
                    Ok(FromDaemon::Progress { command_id, progress }) => {
                        let Ok(id) = CommandId::parse("commandId", &command_id) else {
                            break End::new(4400, "commandId is not a command id", CloseReason::ProtocolError);
                        };
                        match node_commands::progress(&db, &node, epoch, &id, &progress).await {
                            Ok(_) => {}
                            Err(Error::BadUserInput { message, .. }) => {
                                send(&mut socket, &refused(message, Some(&id))).await;
                            }
                            Err(e) => break end_of(&e),
                        }
                    }
                    Ok(FromDaemon::Result { command_id, outcome, output, error_code, error_message, traceparent }) => {
                        let Ok(id) = CommandId::parse("commandId", &command_id) else {
                            break End::new(4400, "commandId is not a command id", CloseReason::ProtocolError);
                        };
                        let span = result_span(&id, traceparent.as_deref());
                        let finished = match Report::parse(outcome == Outcome::Succeeded, output, error_code, error_message) {
                            Ok(report) => node_commands::finish(&db, &node, epoch, &id, &report).instrument(span).await,
                            Err(e) => Err(e),
                        };
                        let reply = match finished {
                            Ok(done) => {
                                if let Some(c) = &done {
                                    info!(node = %node, command = %id, kind = %c.kind, state = %c.state, "command finished");
                                }
                                ToDaemon::Recorded { command_id: id.to_string(), recorded: done.is_some() }
                            }
                            Err(Error::BadUserInput { message, .. }) => {
                                refused(message, Some(&id))
                            }
                            Err(e) => break end_of(&e),
                        };
                        if !send(&mut socket, &reply).await {
                            break End::new(1006, "", CloseReason::DaemonClosed);
                        }
                    }
                    Ok(FromDaemon::Exited { instance_id, exit_code, signal, exited_seconds_ago }) => {
                        // A workload the daemon ran for no instance of ours (an operator's
                        // run_instance by hand): nothing to record, and the daemon stops sending it.
                        let Ok(instance) = InstanceId::parse("instanceId", &instance_id) else {
                            let reply = ToDaemon::ExitRecorded { instance_id, recorded: false };
                            if !send(&mut socket, &reply).await {
                                break End::new(1006, "", CloseReason::DaemonClosed);
                            }
                            continue;
                        };
                        let recorded = match ReportedExit::parse(exit_code, signal, exited_seconds_ago) {
                            Ok(exit) => instances::record_exit(&db, &node, epoch, &instance, exit).await,
                            Err(e) => Err(e),
                        };
                        let reply = match recorded {
                            Ok(instances::ExitRecord::Recorded(i)) => {
                                info!(node = %node, instance = %instance, code = ?exit_code, signal = ?signal, state = %i.state, "workload exit recorded");
                                ToDaemon::ExitRecorded { instance_id: instance.to_string(), recorded: true }
                            }
                            Ok(instances::ExitRecord::Nothing) => {
                                ToDaemon::ExitRecorded { instance_id: instance.to_string(), recorded: false }
                            }
                            // Answered `recorded: false`, the daemon would forget an exit nothing
                            // recorded: it reports it again on its next session.
                            Ok(instances::ExitRecord::SessionNotCurrent) => {
                                break End::new(4410, "this session is no longer current", CloseReason::Superseded)
                            }
                            Err(Error::BadUserInput { message, .. }) => refused(message, None),
                            Err(e) => break end_of(&e),
                        };
                        if !send(&mut socket, &reply).await {
                            break End::new(1006, "", CloseReason::DaemonClosed);
                        }
                    }
                    Ok(FromDaemon::Inventory { inventory }) => {
                        let reply = match cmd::report_inventory(&db, &node, epoch, &inventory).await {
                            Ok(Some(differences)) => {
                                if differences.is_empty() {
                                    debug!(node = %node, "inventory agrees with the registration");
                                } else {
                                    warn!(node = %node, differences = ?differences, "inventory differs from the registration");
                                }
                                ToDaemon::InventoryChecked { differences }
                            }
                            Ok(None) => break End::new(4410, "this session is no longer current", CloseReason::Superseded),
                            Err(Error::BadUserInput { message, .. }) => refused(message, None),
                            Err(e) => break end_of(&e),
                        };
                        if !send(&mut socket, &reply).await {
                            break End::new(1006, "", CloseReason::DaemonClosed);
                        }
                    }
                    Ok(FromDaemon::DeviceHealth { uuid, health, reason }) => {
                        let reply = match cmd::report_health(&db, &node, epoch, &uuid, health, reason.as_deref()).await {
                            Ok(Some(recorded)) => {
                                info!(node = %node, uuid = %uuid, health = ?health, reason = ?reason.as_deref().map(compute_domain::error::bounded), recorded, "GPU health reported");
                                ToDaemon::HealthRecorded { uuid, recorded }
                            }
                            Ok(None) => break End::new(4410, "this session is no longer current", CloseReason::Superseded),
                            Err(Error::BadUserInput { message, .. }) => refused(message, None),
                            Err(e) => break end_of(&e),
                        };
                        if !send(&mut socket, &reply).await {
                            break End::new(1006, "", CloseReason::DaemonClosed);
                        }
                    }
                    Ok(FromDaemon::Join { .. }) => break End::new(4400, "join is a first message, of a machine that is not a node yet", CloseReason::ProtocolError),
                    Ok(FromDaemon::Hello { .. }) => break End::new(4400, "hello was already received", CloseReason::ProtocolError),
                    Err(e) => break End::new(4400, format!("malformed message: {}", compute_domain::error::bounded(&e.to_string())), CloseReason::ProtocolError),
                }
            }
            Some(message) = registered.push.recv() => {
                if !send(&mut socket, &message).await {
                    break End::new(1006, "", CloseReason::DaemonClosed);
                }
            }
            _ = registered.kick.changed() => {
                let kick = registered.kick.borrow().clone();
                if let Some(k) = kick {
                    let reason = if k.code == 1001 { CloseReason::GatewayStopped } else { CloseReason::Superseded };
                    break End::new(k.code, k.reason, reason);
                }
            }
            () = silence => {
                if gateway.silent_for(&registered) >= config.silent_after {
                    break End::new(4408, "no message within the time allowed", CloseReason::Silent);
                }
            }
            () = &mut expiry => break End::new(4401, "the token expired", CloseReason::DaemonClosed),
            () = &mut stopping => break End::new(1001, "the gateway is shutting down; reconnect", CloseReason::GatewayStopped),
        }
    };
    // 5. the end: close the session if it is still this gateway's.
    if gateway.unregister(&node, epoch) {
        match node_sessions::close(&db, &node, epoch, end.session).await {
            Ok(_) => {}
            Err(e) => {
                warn!(node = %node, epoch, error = %e, "closing a node session failed; the reconciler ends it with the gateway's lease")
            }
        }
    }
    info!(node = %node, epoch, code = end.code, reason = %end.reason, "node session closed");
    if end.code != 1006 && end.code != 1000 {
        close(&mut socket, end.code, &end.reason).await;
    } else {
        let _ = socket.close().await;
    }
}

/// The span in which a command's result is recorded: the child of the daemon's `traceparent`
/// (its run of the command, in the dispatch's trace), so the trace of a request reaches the
/// machine and comes back. A result without one is not traced on its own.
fn result_span(id: &CommandId, traceparent: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!(
        "command result",
        otel.kind = "consumer",
        command.id = %id,
    );
    if let Some(parent) = traceparent.and_then(compute_telemetry::TraceParent::parse) {
        compute_telemetry::context::continue_from(&span, &parent);
    }
    span
}
