//! The connection to the control plane: a session with a gateway, kept open with heartbeats,
//! and opened again with backoff (0.5 s doubling to 30 s) whenever it ends, as
//! `docs/agent-protocol.md` says for each close code.

use std::path::PathBuf;
use std::time::Duration;

use compute_protocol::client::{self, Closed, Received, Ws};
use compute_protocol::{FromDaemon, MAX_OBJECT_BYTES};
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};

use crate::agent::Agent;

/// Where the node's credential comes from.
#[derive(Debug, Clone)]
pub enum Token {
    /// Given on the command line or in the environment.
    Literal(String),
    /// Read again before every connection (so a rotated credential is picked up).
    File(PathBuf),
}

impl Token {
    pub fn read(&self) -> Result<String, String> {
        match self {
            Token::Literal(t) => Ok(t.clone()),
            Token::File(p) => std::fs::read_to_string(p)
                .map(|t| t.trim().to_owned())
                .map_err(|e| format!("{}: {e}", p.display())),
        }
    }
}

/// Who this daemon is to the gateway.
#[derive(Debug, Clone)]
pub struct Identity {
    pub url: String,
    pub node_id: String,
    pub token: Token,
    pub daemon_version: String,
}

/// Why the session loop returned.
#[derive(Debug)]
pub enum Ending {
    /// Asked to stop (SIGTERM, SIGINT): said `bye`.
    Stopped,
    /// The gateway said retrying cannot help (`4403`, `4404`, `4409`).
    Refused(Closed),
}

async fn send(agent: &Agent, ws: &mut Ws, m: &FromDaemon) -> Result<(), Closed> {
    client::send(ws, m).await?;
    agent.sent(m);
    Ok(())
}

/// `write` (a send or a ping), or the session closed when it has not finished in `stall`. A
/// gateway that stops reading (a partition that drops packets, a host gone without a FIN) lets
/// the socket's buffer fill, and a write then waits for as long as TCP retries: the silence
/// check runs between messages, not inside a write, so without this bound it never ran.
async fn within(
    stall: Duration,
    write: impl std::future::Future<Output = Result<(), Closed>>,
) -> Result<(), Closed> {
    tokio::time::timeout(stall, write)
        .await
        .unwrap_or_else(|_| {
            Err(Closed::abnormal(format!(
                "a write to the gateway did not finish in {:.0} s",
                stall.as_secs_f64()
            )))
        })
}

/// A text frame that is not a message of the protocol: a `command` among them is answered
/// `failed` (`BAD_COMMAND`) so it does not hang; anything else is logged.
fn refuse_malformed(text: &str) -> Option<FromDaemon> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    if v["type"] != "command" {
        return None;
    }
    let id = v["commandId"].as_str()?;
    Some(FromDaemon::failed(
        id,
        "BAD_COMMAND",
        "the command is not well-formed for compute-agent.v1 (unknown kind or fields)",
    ))
}

/// Runs sessions until `stop` fires or the gateway refuses for good.
pub async fn run(
    agent: Agent,
    identity: Identity,
    mut outgoing: mpsc::UnboundedReceiver<FromDaemon>,
    mut stop: watch::Receiver<bool>,
) -> Ending {
    let first_backoff = Duration::from_millis(500);
    let mut backoff = first_backoff;
    loop {
        if *stop.borrow() {
            return Ending::Stopped;
        }
        let closed = match session(&agent, &identity, &mut outgoing, &mut stop).await {
            Ok(Some(closed)) => {
                backoff = first_backoff;
                closed
            }
            Ok(None) => return Ending::Stopped,
            Err(closed) => closed,
        };
        agent.metrics().connected.set(0);
        if closed.is_final() {
            error!(code = closed.code, reason = %closed.reason, "the gateway refused this node's session for good; stopping");
            return Ending::Refused(closed);
        }
        let wait = if matches!(closed.code, 1001 | 4410) {
            Duration::ZERO
        } else {
            backoff
        };
        info!(code = closed.code, reason = %closed.reason, retry_in_s = wait.as_secs_f64(), "session ended; reconnecting");
        tokio::select! {
            _ = stop.changed() => return Ending::Stopped,
            () = tokio::time::sleep(wait) => {}
        }
        if !wait.is_zero() {
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
    }
}

/// One session: `Ok(None)` when asked to stop, `Ok(Some)` when an open session ended,
/// `Err` when it could not be opened.
async fn session(
    agent: &Agent,
    identity: &Identity,
    outgoing: &mut mpsc::UnboundedReceiver<FromDaemon>,
    stop: &mut watch::Receiver<bool>,
) -> Result<Option<Closed>, Closed> {
    let token = identity.token.read().map_err(|e| {
        warn!(error = %e, "cannot read the node token");
        Closed::abnormal(e)
    })?;
    let observed_generation = agent.journal().observed_generation().unwrap_or(0);
    // Bounded: a gateway that takes the TCP connection and never answers the upgrade held the
    // agent here for good.
    let mut ws = tokio::time::timeout(Duration::from_secs(30), client::connect(&identity.url))
        .await
        .map_err(|_| Closed::abnormal("no answer to the WebSocket upgrade in 30 s"))??;
    let hello = FromDaemon::Hello {
        token: Some(token),
        node_id: identity.node_id.clone(),
        daemon_version: identity.daemon_version.clone(),
        journal_id: agent.journal().id().to_owned(),
        observed_generation,
    };
    let welcome = client::hello(&mut ws, &hello, Duration::from_secs(30)).await?;
    info!(
        epoch = welcome.session_epoch,
        gateway = %welcome.gateway_id,
        journal = %agent.journal().id(),
        observed_generation,
        "session opened"
    );
    agent.metrics().connected.set(1);
    agent.metrics().sessions.inc();
    // What was queued for an older session is stale: results are answered from the journal
    // when their commands come again, and exits are sent again below.
    while outgoing.try_recv().is_ok() {}
    // Clamped: the gateway's figure is 1 to 60 s; a hostile one (1e20, NaN) panicked here.
    let heartbeat = Duration::from_secs_f64(heartbeat_interval(welcome.heartbeat_seconds));
    // Every write of the session is bounded by the same limit as the silence.
    let stall = silence_limit(heartbeat);
    for m in agent.on_session_open() {
        if let Err(c) = within(stall, send(agent, &mut ws, &m)).await {
            return Ok(Some(c));
        }
    }
    // The trace context of each command in progress, handed back with its result.
    let mut traces: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut ticker = tokio::time::interval(heartbeat);
    ticker.tick().await;
    // The last word from the gateway. A silent partition or a gateway host gone without a FIN
    // left writes "succeeding" into the socket's buffer for as long as TCP retried (about 15
    // minutes), the node unreachable meanwhile: each heartbeat also pings, and a session
    // without a word for `silence_limit` is closed and opened again.
    let mut heard = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = stop.changed() => {
                // Bounded too: a stopping agent does not wait on a gateway that stopped reading.
                let _ = tokio::time::timeout(stall, client::bye(&mut ws, "the agent is stopping")).await;
                info!("session closed: the agent is stopping");
                return Ok(None);
            }
            _ = ticker.tick() => {
                let silent = heard.elapsed();
                if silent > silence_limit(heartbeat) {
                    warn!(silent_s = silent.as_secs_f64(), "no word from the gateway: connecting again");
                    return Ok(Some(Closed::abnormal(format!(
                        "no word from the gateway in {:.0} s",
                        silent.as_secs_f64()
                    ))));
                }
                if let Err(c) = within(stall, send(agent, &mut ws, &FromDaemon::Heartbeat {})).await {
                    return Ok(Some(c));
                }
                if let Err(c) = within(stall, client::ping(&mut ws)).await {
                    return Ok(Some(c));
                }
            }
            Some(m) = outgoing.recv() => {
                let m = with_trace(m, &mut traces);
                if let Err(c) = within(stall, send(agent, &mut ws, &m)).await {
                    warn!(error = %c, "connecting again");
                    return Ok(Some(c));
                }
            }
            r = client::receive(&mut ws) => {
                heard = tokio::time::Instant::now();
                let replies = match r {
                    Err(c) => return Ok(Some(c)),
                    Ok(Received::Pong) => continue,
                    Ok(Received::Message(m)) => {
                        let span = command_span(&m, &mut traces);
                        let _entered = span.enter();
                        if let compute_protocol::ToDaemon::Command { command_id, args, .. } = &m
                            && args.to_string().len() > MAX_OBJECT_BYTES
                        {
                            warn!(command = %command_id, "command args over 16 KiB: refused");
                            vec![FromDaemon::failed(command_id, "BAD_COMMAND", "the command's args are larger than 16 KiB")]
                        } else {
                            agent.handle(m)
                        }
                    }
                    Ok(Received::Malformed { error, text }) => {
                        warn!(%error, message = %format!("{text:.200}"), "a message from the gateway is not of compute-agent.v1");
                        refuse_malformed(&text).into_iter().collect()
                    }
                };
                for m in replies {
                    let m = with_trace(m, &mut traces);
                    if let Err(c) = within(stall, send(agent, &mut ws, &m)).await {
                        warn!(error = %c, "connecting again");
                        return Ok(Some(c));
                    }
                }
            }
        }
    }
}

/// The heartbeat interval from the gateway's `heartbeatSeconds`: 0.2 to 300 s, 5 s for a value
/// that is not a number.
fn heartbeat_interval(seconds: f64) -> f64 {
    if seconds.is_nan() {
        5.0
    } else {
        seconds.clamp(0.2, 300.0)
    }
}

/// How long the agent waits without a word from the gateway (a message or the pong of its
/// heartbeat's ping) before it takes the session for dead and connects again: three heartbeats,
/// and at least 15 s.
fn silence_limit(heartbeat: Duration) -> Duration {
    (heartbeat * 3).max(Duration::from_secs(15))
}

/// The span in which a `command` is received (journaled, acknowledged or answered): the child
/// of the dispatch's `traceparent`, whose context the command's result carries back
/// ([`with_trace`]). Any other message gets no span.
fn command_span(
    m: &compute_protocol::ToDaemon,
    traces: &mut std::collections::HashMap<String, String>,
) -> tracing::Span {
    let compute_protocol::ToDaemon::Command {
        command_id,
        kind,
        traceparent,
        ..
    } = m
    else {
        return tracing::Span::none();
    };
    let span = tracing::info_span!(
        "command",
        otel.name = %format_args!("receive {}", kind.as_str()),
        otel.kind = "consumer",
        command.id = %command_id,
    );
    let received = traceparent
        .as_deref()
        .and_then(compute_telemetry::TraceParent::parse);
    if let Some(parent) = &received {
        compute_telemetry::context::continue_from(&span, parent);
    }
    if let Some(tp) = compute_telemetry::context::of_span(&span).or(received) {
        // Bounded: a gateway dispatches a node's commands a batch at a time.
        if traces.len() >= 4096 {
            traces.clear();
        }
        traces.insert(command_id.clone(), tp.to_string());
    }
    span
}

/// A `result` with the trace context of its command, when the command came with one.
fn with_trace(m: FromDaemon, traces: &mut std::collections::HashMap<String, String>) -> FromDaemon {
    match &m {
        FromDaemon::Result { command_id, .. } => {
            let tp = traces.remove(command_id);
            m.with_traceparent(tp)
        }
        _ => m,
    }
}

/// What `join` gave: the node this machine is now, and its credential.
#[derive(Debug, Clone)]
pub struct Joined {
    pub node_id: String,
    pub pool_id: String,
    pub credential: String,
}

/// Joins the fleet with one-time token `token`: sends `join` with the machine's inventory and
/// waits (30 s) for `joined`. A refusal is its code (`JOIN_TOKEN_USED`, …) and message.
pub async fn join(
    url: &str,
    token: &str,
    pool: Option<String>,
    daemon_version: &str,
    inventory: &compute_protocol::Inventory,
) -> Result<Joined, (String, String)> {
    let closed = |c: Closed| ("CONNECTION_FAILED".to_owned(), c.to_string());
    let mut ws = tokio::time::timeout(Duration::from_secs(30), client::connect(url))
        .await
        .map_err(|_| {
            closed(Closed::abnormal(
                "no answer to the WebSocket upgrade in 30 s",
            ))
        })?
        .map_err(closed)?;
    client::send(
        &mut ws,
        &FromDaemon::Join {
            token: token.to_owned(),
            pool_id: pool,
            daemon_version: daemon_version.to_owned(),
            inventory: inventory.clone(),
        },
    )
    .await
    .map_err(closed)?;
    let answer = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match client::receive(&mut ws).await.map_err(closed)? {
                Received::Message(compute_protocol::ToDaemon::Joined {
                    node_id,
                    pool_id,
                    credential,
                }) => {
                    return Ok(Joined {
                        node_id,
                        pool_id,
                        credential,
                    });
                }
                Received::Message(compute_protocol::ToDaemon::Error { code, message, .. }) => {
                    return Err((code, message));
                }
                _ => {}
            }
        }
    })
    .await;
    answer.unwrap_or_else(|_| Err(("TIMEOUT".into(), "no answer to join in 30 s".into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway that accepts and then never reads: the writes fill the socket's buffers, and
    /// the bounded write closes the session instead of waiting for as long as TCP retries.
    #[tokio::test]
    async fn a_write_to_a_gateway_that_stopped_reading_closes_the_session() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("ws://{}/agent", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.expect("accept");
            // Answers with the daemon's subprotocol, as a gateway does. The signature is
            // tungstenite's `Callback`, whose error is a whole HTTP response.
            #[allow(clippy::result_large_err)]
            fn agree(
                _: &tokio_tungstenite::tungstenite::handshake::server::Request,
                mut response: tokio_tungstenite::tungstenite::handshake::server::Response,
            ) -> Result<
                tokio_tungstenite::tungstenite::handshake::server::Response,
                tokio_tungstenite::tungstenite::handshake::server::ErrorResponse,
            > {
                response.headers_mut().insert(
                    "Sec-WebSocket-Protocol",
                    compute_protocol::PROTOCOL.parse().expect("a header value"),
                );
                Ok(response)
            }
            let ws = tokio_tungstenite::accept_hdr_async(tcp, agree)
                .await
                .expect("handshake");
            // Holds the connection open and reads nothing.
            tokio::time::sleep(Duration::from_secs(120)).await;
            drop(ws);
        });
        let mut ws = client::connect(&url).await.expect("connect");
        let big = "x".repeat(1 << 20);
        let outcome = tokio::time::timeout(Duration::from_secs(60), async {
            let mut sent = 0usize;
            loop {
                let write = async {
                    use futures_util::SinkExt;
                    ws.send(tokio_tungstenite::tungstenite::Message::Text(
                        big.clone().into(),
                    ))
                    .await
                    .map_err(Closed::abnormal)
                };
                match within(Duration::from_millis(500), write).await {
                    Ok(()) => sent += 1,
                    Err(c) => return (sent, c),
                }
            }
        })
        .await;
        let (sent, closed) =
            outcome.expect("a stalled write ends the session, not the test's minute");
        assert!(
            format!("{closed:?}").contains("did not finish"),
            "{closed:?} after {sent} MiB"
        );
        server.abort();
    }

    #[test]
    fn a_hostile_heartbeat_is_clamped_not_a_panic() {
        for (given, used) in [
            (5.0, 5.0),
            (0.0, 0.2),
            (-1.0, 0.2),
            (1e20, 300.0),
            (f64::INFINITY, 300.0),
            (f64::NAN, 5.0),
        ] {
            let got = heartbeat_interval(given);
            assert_eq!(got, used, "{given}");
            let _ = Duration::from_secs_f64(got);
        }
    }

    #[test]
    fn a_malformed_command_is_answered_failed_and_other_garbage_is_not() {
        let answer =
            refuse_malformed(r#"{"type":"command","commandId":"cmd_1","kind":"reboot","args":{}}"#)
                .expect("answered");
        let FromDaemon::Result {
            command_id,
            outcome,
            error_code,
            ..
        } = answer
        else {
            panic!("not a result: {answer:?}");
        };
        assert_eq!(command_id, "cmd_1");
        assert_eq!(outcome, compute_protocol::Outcome::Failed);
        assert_eq!(error_code.as_deref(), Some("BAD_COMMAND"));
        assert_eq!(refuse_malformed(r#"{"type":"shutdown"}"#), None);
        assert_eq!(refuse_malformed("not json"), None);
        assert_eq!(refuse_malformed(r#"{"type":"command"}"#), None);
    }
}
