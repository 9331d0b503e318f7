//! Simulated node daemons: clients of `/agent` speaking `compute-agent.v1`
//! (`docs/agent-protocol.md`), and nothing else of the system: no SQL, no domain types. Tests
//! drive one [`Session`] step by step (with a [`Daemon`] answering commands from its
//! [`Journal`]); the `compute-sim` binary runs many [`run_daemon`] loops.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};

/// The subprotocol a daemon offers.
pub const PROTOCOL: &str = "compute-agent.v1";

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Who a daemon is and what it says in `hello`.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// `ws://host:port/agent`.
    pub url: String,
    /// A `node` token for `node_id` (`compute-api token --role node --node <id>`).
    pub token: String,
    pub node_id: String,
    pub daemon_version: String,
    /// The daemon's journal: the same across restarts that keep its memory, new after a wipe.
    pub journal_id: String,
    pub observed_generation: i64,
}

/// What the gateway says when it accepts a session.
#[derive(Debug, Clone, PartialEq)]
pub struct Welcome {
    pub session_epoch: i64,
    pub gateway_id: String,
    pub heartbeat_seconds: f64,
}

/// How a connection ended: the close code and reason (`1006` when it ended without a close
/// frame, or could not be opened).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    pub code: u16,
    pub reason: String,
}

impl Closed {
    fn abnormal(reason: impl std::fmt::Display) -> Closed {
        Closed {
            code: 1006,
            reason: reason.to_string(),
        }
    }
}

/// An open session.
pub struct Session {
    ws: Ws,
    pub welcome: Welcome,
}

/// Opens a WebSocket to `url` offering the protocol; `hello` is not sent.
pub async fn connect_raw(url: &str) -> Result<Ws, Closed> {
    let mut req = url.into_client_request().map_err(Closed::abnormal)?;
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", HeaderValue::from_static(PROTOCOL));
    // Without Nagle's algorithm: a daemon's small messages leave at once.
    let (ws, _) = tokio_tungstenite::connect_async_with_config(req, None, true)
        .await
        .map_err(Closed::abnormal)?;
    Ok(ws)
}

/// Waits for the close of `ws` (skipping other messages), at most `within`.
pub async fn closed_of(ws: &mut Ws, within: Duration) -> Option<Closed> {
    tokio::time::timeout(within, async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(frame))) => {
                    return frame.map_or(
                        Closed {
                            code: 1005,
                            reason: String::new(),
                        },
                        |f| Closed {
                            code: f.code.into(),
                            reason: f.reason.to_string(),
                        },
                    );
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Closed::abnormal(e),
                None => return Closed::abnormal("the connection ended"),
            }
        }
    })
    .await
    .ok()
}

impl Session {
    /// Connects and says `hello`; the session, or how the gateway refused it.
    pub async fn open(config: &DaemonConfig) -> Result<Session, Closed> {
        let mut ws = connect_raw(&config.url).await?;
        let hello = json!({
            "type": "hello",
            "token": config.token,
            "nodeId": config.node_id,
            "daemonVersion": config.daemon_version,
            "journalId": config.journal_id,
            "observedGeneration": config.observed_generation,
        });
        ws.send(Message::Text(hello.to_string().into()))
            .await
            .map_err(Closed::abnormal)?;
        loop {
            match tokio::time::timeout(Duration::from_secs(30), ws.next()).await {
                Err(_) => return Err(Closed::abnormal("no welcome within 30 s")),
                Ok(Some(Ok(Message::Text(t)))) => {
                    let v: Value = serde_json::from_str(t.as_str()).map_err(Closed::abnormal)?;
                    if v["type"] == "welcome" {
                        return Ok(Session {
                            ws,
                            welcome: Welcome {
                                session_epoch: v["sessionEpoch"].as_i64().unwrap_or(0),
                                gateway_id: v["gatewayId"].as_str().unwrap_or("").to_owned(),
                                heartbeat_seconds: v["heartbeatSeconds"].as_f64().unwrap_or(5.0),
                            },
                        });
                    }
                }
                Ok(Some(Ok(Message::Close(frame)))) => {
                    return Err(frame.map_or(Closed::abnormal("closed"), |f| Closed {
                        code: f.code.into(),
                        reason: f.reason.to_string(),
                    }));
                }
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(e))) => return Err(Closed::abnormal(e)),
                Ok(None) => return Err(Closed::abnormal("the connection ended")),
            }
        }
    }

    /// Sends one protocol message.
    pub async fn send(&mut self, message: Value) -> Result<(), Closed> {
        self.ws
            .send(Message::Text(message.to_string().into()))
            .await
            .map_err(Closed::abnormal)
    }

    /// Sends a frame as it is (tests of malformed input).
    pub async fn send_raw(&mut self, message: Message) -> Result<(), Closed> {
        self.ws.send(message).await.map_err(Closed::abnormal)
    }

    pub async fn heartbeat(&mut self) -> Result<(), Closed> {
        self.send(json!({ "type": "heartbeat" })).await
    }

    /// Reports the generation this daemon has applied.
    pub async fn status(&mut self, observed_generation: i64) -> Result<(), Closed> {
        self.send(json!({ "type": "status", "observedGeneration": observed_generation }))
            .await
    }

    /// Ends the session cleanly.
    pub async fn bye(mut self) {
        let _ = self
            .send(json!({ "type": "bye", "reason": "stopping" }))
            .await;
        let _ = self
            .ws
            .close(Some(CloseFrame {
                code: 1000.into(),
                reason: Utf8Bytes::from_static("bye"),
            }))
            .await;
        let _ = closed_of(&mut self.ws, Duration::from_secs(5)).await;
    }

    /// The next message from the gateway within `within` (closes are returned as `Err`).
    pub async fn next_message(&mut self, within: Duration) -> Option<Result<Value, Closed>> {
        let got = tokio::time::timeout(within, self.ws.next()).await.ok()?;
        Some(match got {
            Some(Ok(Message::Text(t))) => {
                serde_json::from_str(t.as_str()).map_err(Closed::abnormal)
            }
            Some(Ok(Message::Close(frame))) => {
                Err(frame.map_or(Closed::abnormal("closed"), |f| Closed {
                    code: f.code.into(),
                    reason: f.reason.to_string(),
                }))
            }
            Some(Ok(_)) => return None,
            Some(Err(e)) => Err(Closed::abnormal(e)),
            None => Err(Closed::abnormal("the connection ended")),
        })
    }

    /// Waits for the gateway to close the session, at most `within`.
    pub async fn closed(&mut self, within: Duration) -> Option<Closed> {
        closed_of(&mut self.ws, within).await
    }

    /// Drops the connection without a close frame (a crash or a cut cable).
    pub fn cut(self) {
        drop(self.ws);
    }
}

/// A daemon's journal: the commands it ran and what came of them, kept across its sessions
/// while it keeps its memory (the same `journalId`). A daemon that is wiped starts a new one
/// with a new id. `executions` is the proof the torture checks: how many times each command id
/// was run under this journal.
#[derive(Debug, Clone, Default)]
pub struct Journal {
    pub id: String,
    /// Per command id: how many times it ran here, and the `result` message it produced.
    pub entries: HashMap<String, Entry>,
    /// Devices held by running instances (`run_instance` / `stop_instance`): device → instance.
    pub devices: HashMap<String, String>,
}

/// One command in a [`Journal`].
#[derive(Debug, Clone, Default)]
pub struct Entry {
    pub kind: String,
    /// How many `command` messages for it arrived (across this journal's sessions).
    pub received: u32,
    /// How many sessions of this journal it arrived in (at most once per session).
    pub sessions: Vec<i64>,
    pub executions: u32,
    /// The `result` message, once it finished.
    pub result: Option<Value>,
}

/// A journal shared by the sessions of one daemon (and read by tests).
pub type SharedJournal = Arc<Mutex<Journal>>;

/// A new, empty journal with `id`.
pub fn journal(id: &str) -> SharedJournal {
    Arc::new(Mutex::new(Journal {
        id: id.to_owned(),
        ..Journal::default()
    }))
}

/// What a simulated daemon does with commands: the protocol's daemon side, without I/O. Feed
/// it every message from the gateway ([`Daemon::on_message`]) and send what it returns.
///
/// - A `command` it has already finished (in its journal) is answered from the journal, never
///   run again; a new one is acknowledged (`ack`) and run when the gateway says `proceed`
///   (never when it says `cancelled`).
/// - `apply_spec` applies the generation and reports it (`status`).
/// - `run_instance` refuses devices another running instance holds (`DEVICE_OVERLAP`), the
///   last line of defence against a double booking the control plane should never make; set
///   `refuse_overlaps` to `false` to see what a daemon without it would do.
pub struct Daemon {
    pub journal: SharedJournal,
    pub observed_generation: i64,
    /// The epoch of the session it is in (set it from `welcome`; recorded with each command).
    pub session_epoch: i64,
    pub refuse_overlaps: bool,
    /// Commands acknowledged and waiting for `proceed`.
    awaiting: HashMap<String, Value>,
}

impl Daemon {
    pub fn new(journal: SharedJournal, observed_generation: i64) -> Daemon {
        Daemon {
            journal,
            observed_generation,
            session_epoch: 0,
            refuse_overlaps: true,
            awaiting: HashMap::new(),
        }
    }

    /// The messages to send in answer to `message` from the gateway.
    pub fn on_message(&mut self, message: &Value) -> Vec<Value> {
        let id = message["commandId"].as_str().unwrap_or_default().to_owned();
        match message["type"].as_str() {
            Some("command") => {
                let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
                let entry = j.entries.entry(id.clone()).or_insert_with(|| Entry {
                    kind: message["kind"].as_str().unwrap_or_default().to_owned(),
                    ..Entry::default()
                });
                entry.received += 1;
                entry.sessions.push(self.session_epoch);
                if let Some(done) = entry.result.clone() {
                    return vec![done];
                }
                self.awaiting.insert(id.clone(), message.clone());
                vec![json!({ "type": "ack", "commandId": id })]
            }
            Some("proceed") => match self.awaiting.remove(&id) {
                Some(command) => self.run(&id, &command),
                None => vec![],
            },
            Some("cancelled") => {
                self.awaiting.remove(&id);
                vec![]
            }
            _ => vec![],
        }
    }

    fn run(&mut self, id: &str, command: &Value) -> Vec<Value> {
        let args = &command["args"];
        let mut out = Vec::new();
        if args["progress"] == json!(true) {
            out.push(json!({ "type": "progress", "commandId": id, "progress": { "percent": 50 } }));
        }
        let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        let outcome: Result<Value, (&str, String)> = match command["kind"].as_str() {
            Some("apply_spec") => {
                let g = args["generation"].as_i64().unwrap_or(0);
                self.observed_generation = self.observed_generation.max(g);
                Ok(json!({ "generation": g }))
            }
            Some("run_instance") => {
                let instance = args["instanceId"].as_str().unwrap_or(id).to_owned();
                let devices: Vec<String> = args["devices"]
                    .as_array()
                    .map(|d| {
                        d.iter()
                            .filter_map(|v| v.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default();
                let taken: Vec<&String> = devices
                    .iter()
                    .filter(|d| j.devices.get(*d).is_some_and(|holder| *holder != instance))
                    .collect();
                if self.refuse_overlaps && !taken.is_empty() {
                    Err((
                        "DEVICE_OVERLAP",
                        format!("devices {taken:?} are held by another instance"),
                    ))
                } else {
                    for d in devices {
                        j.devices.insert(d, instance.clone());
                    }
                    Ok(json!({ "instanceId": instance }))
                }
            }
            Some("stop_instance") => {
                let instance = args["instanceId"].as_str().unwrap_or_default().to_owned();
                j.devices.retain(|_, holder| *holder != instance);
                Ok(json!({ "instanceId": instance }))
            }
            _ => Ok(json!({})),
        };
        let result = match outcome {
            Ok(output) => {
                json!({ "type": "result", "commandId": id, "outcome": "succeeded", "output": output })
            }
            Err((code, message)) => json!({ "type": "result", "commandId": id, "outcome": "failed",
                "errorCode": code, "errorMessage": message }),
        };
        let entry = j.entries.entry(id.to_owned()).or_default();
        entry.executions += 1;
        entry.result = Some(result.clone());
        out.push(result);
        if command["kind"] == "apply_spec" {
            out.push(json!({ "type": "status", "observedGeneration": self.observed_generation }));
        }
        out
    }
}

/// A network partition a simulated daemon may fall into.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Partition {
    /// How often each daemon draws whether it is cut off.
    pub every: Duration,
    /// The share of daemons cut off at each draw (0 to 1), chosen by a hash of the node id and
    /// the draw's number, so a run is reproducible.
    pub fraction: f64,
    /// How long a cut-off daemon stays away (its connection dropped without a close frame).
    pub lasts: Duration,
}

/// What a long-running simulated daemon does.
#[derive(Debug, Clone)]
pub struct Behaviour {
    /// Heartbeat period (the gateway's `heartbeatSeconds` when `None`).
    pub heartbeat: Option<Duration>,
    /// Wait before reconnecting after a session ends (doubles up to 30 s; reset on success).
    pub reconnect_after: Duration,
    /// Partitions of a fraction of the fleet, if any.
    pub partition: Option<Partition>,
    /// The daemon's journal (kept across its sessions); a new one for `journal_id` when `None`.
    pub journal: Option<SharedJournal>,
    /// How long a command takes between `proceed` and its `result` (it has run, and is
    /// recorded in the journal, when the wait starts: a daemon cut off meanwhile reports it
    /// from its journal in its next session, or loses it with a wipe).
    pub command_time: Duration,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            heartbeat: None,
            reconnect_after: Duration::from_millis(500),
            partition: None,
            journal: None,
            command_time: Duration::ZERO,
        }
    }
}

/// Whether `node` is cut off at draw `n` (FNV-1a of both, compared with `fraction`).
pub fn partitioned(node: &str, n: u64, fraction: f64) -> bool {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes().chain(n.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % 10_000) as f64 / 10_000.0 < fraction
}

/// Runs one daemon until `stop` fires: opens its session, heartbeats, and reconnects with
/// backoff whenever the session ends (except after `4403` or `4404`, which retrying cannot fix,
/// and `4409`: a newer session of the node is live, and reconnecting would supersede it).
/// Calls `on_event` when a session opens and when an open session ends (refusals are logged).
pub async fn run_daemon(
    config: DaemonConfig,
    behaviour: Behaviour,
    mut stop: tokio::sync::watch::Receiver<bool>,
    on_event: impl Fn(&str, Result<&Welcome, &Closed>) + Send + Sync,
) {
    let mut backoff = behaviour.reconnect_after;
    let mut draw = 0u64;
    let mut daemon = Daemon::new(
        behaviour
            .journal
            .clone()
            .unwrap_or_else(|| journal(&config.journal_id)),
        config.observed_generation,
    );
    let mut config = config;
    while !*stop.borrow() {
        // A reconnecting daemon reports what it has applied since.
        config.observed_generation = daemon.observed_generation;
        match Session::open(&config).await {
            Ok(mut session) => {
                backoff = behaviour.reconnect_after;
                daemon.session_epoch = session.welcome.session_epoch;
                on_event(&config.node_id, Ok(&session.welcome));
                let period = behaviour.heartbeat.unwrap_or(Duration::from_secs_f64(
                    session.welcome.heartbeat_seconds.max(0.1),
                ));
                let mut ticker = tokio::time::interval(period);
                let draw_every = behaviour
                    .partition
                    .map_or(Duration::from_secs(86_400), |p| p.every);
                let mut draws =
                    tokio::time::interval_at(tokio::time::Instant::now() + draw_every, draw_every);
                let closed = loop {
                    tokio::select! {
                        _ = stop.changed() => {
                            session.bye().await;
                            return;
                        }
                        _ = draws.tick() => {
                            draw += 1;
                            if let Some(p) = behaviour.partition
                                && partitioned(&config.node_id, draw, p.fraction)
                            {
                                session.cut();
                                on_event(&config.node_id, Err(&Closed::abnormal("partitioned")));
                                tokio::select! {
                                    _ = stop.changed() => return,
                                    () = tokio::time::sleep(p.lasts) => {}
                                }
                                break None;
                            }
                        }
                        _ = ticker.tick() => {
                            if let Err(c) = session.heartbeat().await {
                                break Some(c);
                            }
                        }
                        m = session.next_message(Duration::from_secs(3600)) => {
                            match m {
                                Some(Err(c)) => break Some(c),
                                Some(Ok(message)) => {
                                    let replies = daemon.on_message(&message);
                                    // A command takes its time between `proceed` and its result.
                                    if message["type"] == "proceed" && !behaviour.command_time.is_zero() {
                                        tokio::select! {
                                            _ = stop.changed() => return,
                                            () = tokio::time::sleep(behaviour.command_time) => {}
                                        }
                                    }
                                    let mut failed = None;
                                    for reply in replies {
                                        if let Err(c) = session.send(reply).await {
                                            failed = Some(c);
                                            break;
                                        }
                                    }
                                    if let Some(c) = failed {
                                        break Some(c);
                                    }
                                }
                                None => {}
                            }
                        }
                    }
                };
                // A partition reconnects at once when it heals.
                let Some(closed) = closed else {
                    continue;
                };
                on_event(&config.node_id, Err(&closed));
                if matches!(closed.code, 4403 | 4404 | 4409) {
                    return;
                }
            }
            Err(closed) => {
                tracing::info!(node = %config.node_id, code = closed.code, reason = %closed.reason, "the gateway refused the session");
                if matches!(closed.code, 4401 | 4403 | 4404) {
                    return;
                }
            }
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}
