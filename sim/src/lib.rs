//! Simulated node daemons: clients of `/agent` speaking `compute-agent.v1`
//! (`docs/agent-protocol.md`), and nothing else of the system: no SQL, no domain types. Tests
//! drive one [`Session`] step by step (with a [`Daemon`] answering commands from its
//! [`Journal`]); the `compute-sim` binary runs many [`run_daemon`] loops.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use compute_protocol::PROTOCOL;
use compute_protocol::client::{self, Ws};
pub use compute_protocol::client::{Closed, Welcome};
use compute_protocol::{CommandKind, FromDaemon, ToDaemon};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

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

/// An open session.
pub struct Session {
    ws: Ws,
    pub welcome: Welcome,
}

/// Opens a WebSocket to `url` offering the protocol; `hello` is not sent.
pub async fn connect_raw(url: &str) -> Result<Ws, Closed> {
    client::connect(url).await
}

/// Waits for the close of `ws` (skipping other messages), at most `within`.
pub async fn closed_of(ws: &mut Ws, within: Duration) -> Option<Closed> {
    client::closed_of(ws, within).await
}

impl Session {
    /// Connects and says `hello`; the session, or how the gateway refused it.
    pub async fn open(config: &DaemonConfig) -> Result<Session, Closed> {
        let mut ws = connect_raw(&config.url).await?;
        let hello = FromDaemon::Hello {
            token: Some(config.token.clone()),
            node_id: config.node_id.clone(),
            daemon_version: config.daemon_version.clone(),
            journal_id: config.journal_id.clone(),
            observed_generation: config.observed_generation,
        };
        let welcome = client::hello(&mut ws, &hello, Duration::from_secs(30)).await?;
        Ok(Session { ws, welcome })
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

    /// Sends one typed protocol message.
    pub async fn send_message(&mut self, message: &FromDaemon) -> Result<(), Closed> {
        let text = serde_json::to_string(message).map_err(Closed::abnormal)?;
        self.ws
            .send(Message::Text(text.into()))
            .await
            .map_err(Closed::abnormal)
    }

    pub async fn heartbeat(&mut self) -> Result<(), Closed> {
        self.send_message(&FromDaemon::Heartbeat {}).await
    }

    /// Reports the generation this daemon has applied.
    pub async fn status(&mut self, observed_generation: i64) -> Result<(), Closed> {
        self.send_message(&FromDaemon::Status {
            observed_generation,
        })
        .await
    }

    /// Ends the session cleanly.
    pub async fn bye(mut self) {
        client::bye(&mut self.ws, "stopping").await;
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
    pub result: Option<FromDaemon>,
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
    awaiting: HashMap<String, ToDaemon>,
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

    /// The messages to send in answer to `message` from the gateway (messages that are not
    /// of the protocol are ignored).
    pub fn on_message(&mut self, message: &Value) -> Vec<Value> {
        let Ok(message) = serde_json::from_value::<ToDaemon>(message.clone()) else {
            return vec![];
        };
        self.answer(message)
            .iter()
            .map(|m| serde_json::to_value(m).unwrap_or_default())
            .collect()
    }

    /// The messages to send in answer to `message`.
    pub fn answer(&mut self, message: ToDaemon) -> Vec<FromDaemon> {
        match &message {
            ToDaemon::Command {
                command_id, kind, ..
            } => {
                let command_id = command_id.clone();
                let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
                let entry = j
                    .entries
                    .entry(command_id.clone())
                    .or_insert_with(|| Entry {
                        kind: kind.as_str().to_owned(),
                        ..Entry::default()
                    });
                entry.received += 1;
                entry.sessions.push(self.session_epoch);
                if let Some(done) = entry.result.clone() {
                    return vec![done];
                }
                self.awaiting.insert(command_id.clone(), message);
                vec![FromDaemon::Ack { command_id }]
            }
            ToDaemon::Proceed { command_id } => match self.awaiting.remove(command_id) {
                Some(command) => self.run(command_id, &command),
                None => vec![],
            },
            ToDaemon::Cancelled { command_id, .. } => {
                self.awaiting.remove(command_id);
                vec![]
            }
            _ => vec![],
        }
    }

    fn run(&mut self, id: &str, command: &ToDaemon) -> Vec<FromDaemon> {
        let ToDaemon::Command {
            kind,
            args,
            traceparent,
            ..
        } = command
        else {
            return vec![];
        };
        // The command's run on the node, in the dispatch's trace; the result carries it back.
        let span = tracing::info_span!(
            "command",
            otel.name = %format_args!("run {}", kind.as_str()),
            otel.kind = "consumer",
            command.id = id,
            command.kind = kind.as_str(),
        );
        let received = traceparent
            .as_deref()
            .and_then(compute_telemetry::TraceParent::parse);
        if let Some(parent) = &received {
            compute_telemetry::context::continue_from(&span, parent);
        }
        let _entered = span.enter();
        let traceparent = compute_telemetry::context::of_span(&span)
            .or(received)
            .map(|t| t.to_string());
        let mut out = Vec::new();
        if args["progress"] == json!(true) {
            out.push(FromDaemon::Progress {
                command_id: id.to_owned(),
                progress: json!({ "percent": 50 }),
            });
        }
        let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        let outcome: Result<Value, (&str, String)> = match kind {
            CommandKind::ApplySpec => {
                let g = args["generation"].as_i64().unwrap_or(0);
                self.observed_generation = self.observed_generation.max(g);
                Ok(json!({ "generation": g }))
            }
            CommandKind::RunInstance => {
                let instance = args["instanceId"].as_str().unwrap_or(id).to_owned();
                let devices: Vec<String> = args["devices"]
                    .as_array()
                    .map(|d| {
                        d.iter()
                            .filter_map(|v| v.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default();
                let taken: Vec<(&String, &String)> = devices
                    .iter()
                    .filter_map(|d| {
                        j.devices
                            .get(d)
                            .filter(|holder| **holder != instance)
                            .map(|holder| (d, holder))
                    })
                    .collect();
                if self.refuse_overlaps && !taken.is_empty() {
                    // Naming each device and the workload holding it (a long name makes a long
                    // message, as a runtime's stderr can be).
                    let held: Vec<String> = taken
                        .iter()
                        .map(|(d, holder)| format!("{d} is held by workload {holder}"))
                        .collect();
                    Err(("DEVICE_OVERLAP", held.join("; ")))
                } else {
                    for d in devices {
                        j.devices.insert(d, instance.clone());
                    }
                    Ok(json!({ "instanceId": instance }))
                }
            }
            CommandKind::StopInstance => {
                let instance = args["instanceId"].as_str().unwrap_or_default().to_owned();
                j.devices.retain(|_, holder| *holder != instance);
                Ok(json!({ "instanceId": instance }))
            }
            CommandKind::ResetGpu
            | CommandKind::SetMigLayout
            | CommandKind::DrainWorkloads
            | CommandKind::Noop => Ok(json!({})),
        };
        let result = match outcome {
            Ok(output) => FromDaemon::succeeded(id, output),
            Err((code, message)) => FromDaemon::failed(id, code, message),
        }
        .with_traceparent(traceparent);
        let entry = j.entries.entry(id.to_owned()).or_default();
        entry.executions += 1;
        entry.result = Some(result.clone());
        out.push(result);
        if *kind == CommandKind::ApplySpec {
            out.push(FromDaemon::Status {
                observed_generation: self.observed_generation,
            });
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
                                    let parsed = serde_json::from_value::<ToDaemon>(message).ok();
                                    let proceed = matches!(parsed, Some(ToDaemon::Proceed { .. }));
                                    let replies = parsed.map(|m| daemon.answer(m)).unwrap_or_default();
                                    // A command takes its time between `proceed` and its result.
                                    if proceed && !behaviour.command_time.is_zero() {
                                        tokio::select! {
                                            _ = stop.changed() => return,
                                            () = tokio::time::sleep(behaviour.command_time) => {}
                                        }
                                    }
                                    let mut failed = None;
                                    for reply in &replies {
                                        if let Err(c) = session.send_message(reply).await {
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
