//! The node-daemon gateway: the sessions this process holds for the daemons connected to
//! `/agent` (`transport::agent` speaks the protocol, `docs/agent-protocol.md`), its lease
//! `gateway:<id>`, and the flush that reports their ages.
//!
//! Everything here is a cache of `node_sessions` (`compute_domain::node_sessions`): a gateway that
//! dies loses nothing the daemons cannot rebuild by reconnecting. Every write it makes runs in a
//! transaction fenced by its lease and carries the session's epoch, so after it loses the lease
//! or a session it changes nothing.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use compute_domain::clock::Clock;
use compute_domain::db::Db;
use compute_domain::ids::{CommandId, GatewayId, NodeId};
use compute_domain::leases::Fence;
use compute_domain::leases::HeldLease;
use compute_domain::node_commands::{self, Command};
use compute_domain::node_sessions::{self, CloseReason, GATEWAY_TTL, Seen};
use compute_protocol::{CommandKind, ToDaemon};
use tokio::sync::{Notify, mpsc, watch};
use tracing::{debug, info, warn};

/// The gateway's settings (`compute-api serve --agent-…`).
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// This gateway's id; its lease is `gateway:<id>`. Unique per process.
    pub id: GatewayId,
    /// How often daemons send a heartbeat (told to them in `welcome`).
    pub heartbeat: Duration,
    /// How often the gateway writes its sessions' ages.
    pub flush_every: Duration,
    /// A daemon silent for this long of business time is disconnected (`4408`).
    pub silent_after: Duration,
    /// The time a daemon has to send `hello` after connecting.
    pub hello_timeout: Duration,
    /// The largest message a daemon may send.
    pub max_message: usize,
    /// Messages a daemon may send per second before it is cut off (`4429`): 1,000, so a daemon
    /// answering a burst of commands (three or four messages each: `ack`, `result`, `exited`,
    /// `progress`) is never taken for a flood; at 50, a burst of 100 `run_instance` was cut off
    /// again and again.
    pub max_messages_per_second: u32,
}

impl GatewayConfig {
    /// The defaults, with an id made of the host, the process id and a random suffix.
    pub fn new() -> GatewayConfig {
        let host = compute_domain::process::host_name();
        let suffix = compute_domain::process::random_hex(4).unwrap_or_default();
        GatewayConfig {
            id: GatewayId::for_process(&host, std::process::id(), &suffix),
            heartbeat: Duration::from_secs(5),
            flush_every: Duration::from_secs(2),
            silent_after: Duration::from_secs(15),
            hello_timeout: Duration::from_secs(10),
            max_message: 64 * 1024,
            max_messages_per_second: 1_000,
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig::new()
    }
}

/// Why the gateway tells a connection to close: the close code and its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kick {
    pub code: u16,
    pub reason: String,
}

/// One session this process holds.
struct Live {
    epoch: i64,
    last_seen: Arc<Mutex<DateTime<Utc>>>,
    kick: watch::Sender<Option<Kick>>,
    /// Messages for the daemon (`command`).
    push: mpsc::UnboundedSender<ToDaemon>,
    /// The commands pushed in this session: each at most once (`docs/commands.md`).
    pushed: HashSet<CommandId>,
}

/// What a connection holds of its session in the gateway.
pub struct Registered {
    /// Touch on every frame from the daemon ([`Gateway::touch`]): business time, so the silence
    /// timer and the ages the gateway flushes follow `compute_now()` (simulated in tests).
    pub last_seen: Arc<Mutex<DateTime<Utc>>>,
    /// Fires when the gateway ends the session (superseded, lease lost, shutdown).
    pub kick: watch::Receiver<Option<Kick>>,
    /// Commands for the daemon, pushed by [`Gateway::push_now`].
    pub push: mpsc::UnboundedReceiver<ToDaemon>,
}

/// The `command` message of a dispatched command (`docs/agent-protocol.md`).
pub fn command_message(c: &Command) -> ToDaemon {
    ToDaemon::Command {
        command_id: c.id.to_string(),
        kind: protocol_kind(c.kind),
        args: c.args.0.clone(),
        retry_safe: c.retry_safe,
        attempt: c.attempts,
        traceparent: c.traceparent.clone(),
    }
}

/// The protocol's name for a command kind of the domain (the same names: a test keeps them
/// so).
pub fn protocol_kind(kind: node_commands::Kind) -> CommandKind {
    match kind {
        node_commands::Kind::ApplySpec => CommandKind::ApplySpec,
        node_commands::Kind::ResetGpu => CommandKind::ResetGpu,
        node_commands::Kind::SetMigLayout => CommandKind::SetMigLayout,
        node_commands::Kind::DrainWorkloads => CommandKind::DrainWorkloads,
        node_commands::Kind::RunInstance => CommandKind::RunInstance,
        node_commands::Kind::StopInstance => CommandKind::StopInstance,
        node_commands::Kind::Noop => CommandKind::Noop,
    }
}

struct Inner {
    config: GatewayConfig,
    db: Db,
    clock: Clock,
    lease: tokio::sync::Mutex<Option<HeldLease>>,
    sessions: Mutex<HashMap<NodeId, Live>>,
    /// A dispatcher poked this gateway: push now.
    poked: Notify,
}

/// The gateway of this process. Cheap to clone.
#[derive(Clone)]
pub struct Gateway(Arc<Inner>);

impl Gateway {
    /// A gateway on `db`, its timers on business time (`clock`).
    pub fn new(db: Db, clock: Clock, config: GatewayConfig) -> Gateway {
        Gateway(Arc::new(Inner {
            config,
            db,
            clock,
            lease: tokio::sync::Mutex::new(None),
            sessions: Mutex::new(HashMap::new()),
            poked: Notify::new(),
        }))
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.0.config
    }

    pub fn id(&self) -> &GatewayId {
        &self.0.config.id
    }

    /// The business clock its timers read.
    pub fn clock(&self) -> &Clock {
        &self.0.clock
    }

    /// Business time since a session's daemon last sent anything.
    pub fn silent_for(&self, registered: &Registered) -> Duration {
        let since = registered.last_seen.lock().map(|t| *t).unwrap_or_default();
        self.0.clock.since(since)
    }

    /// When a session's daemon has been silent for `silent_after`, by business time.
    pub fn silence_ends(&self, registered: &Registered) -> DateTime<Utc> {
        let since = registered.last_seen.lock().map(|t| *t).unwrap_or_default();
        since
            .checked_add_signed(
                chrono::Duration::from_std(self.0.config.silent_after).unwrap_or_default(),
            )
            .unwrap_or(since)
    }

    /// Records a frame from a session's daemon, now by business time.
    pub fn touch(&self, registered: &Registered) {
        if let Ok(mut t) = registered.last_seen.lock() {
            *t = self.0.clock.now();
        }
    }

    /// The sessions open on this gateway.
    pub fn sessions(&self) -> usize {
        self.0.sessions.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// The lease's fence, acquiring (or re-acquiring) the lease when it is not held. If the
    /// lease comes back at another epoch (someone held it meanwhile), every session this process
    /// held is over: their connections are told to close (`4410`).
    pub async fn fence(&self) -> compute_domain::Result<Option<Fence>> {
        let mut lease = self.0.lease.lock().await;
        if let Some(held) = lease.as_ref()
            && !held.is_lost()
        {
            return Ok(Some(held.fence().clone()));
        }
        let before = lease.as_ref().map(|h| h.fence().epoch);
        let name = node_sessions::gateway_lease(self.id());
        let acquired = HeldLease::acquire_with(
            &self.0.db,
            &name,
            self.id().as_str(),
            GATEWAY_TTL,
            compute_domain::leases::RENEW_EVERY,
        )
        .await?;
        let fence = acquired.as_ref().map(|h| h.fence().clone());
        match (&before, &fence) {
            (Some(old), Some(f)) if *old == f.epoch => {}
            (Some(_), _) => {
                warn!(gateway = %self.id(), "the gateway's lease was lost: its sessions end");
                self.kick_all(4410, "the gateway lost its lease; reconnect");
            }
            (None, Some(f)) => {
                info!(gateway = %self.id(), lease.epoch = f.epoch, "gateway lease acquired")
            }
            (None, None) => {}
        }
        *lease = acquired;
        Ok(fence)
    }

    /// Renews the lease now (a test moving the simulated clock calls this, as workers do).
    pub async fn refresh_lease(&self) -> compute_domain::Result<bool> {
        {
            let lease = self.0.lease.lock().await;
            if let Some(held) = lease.as_ref()
                && held.refresh(&self.0.db).await?
            {
                return Ok(true);
            }
        }
        Ok(self.fence().await?.is_some())
    }

    /// Records a session this connection opened at `epoch`; an older session of the same node
    /// on this gateway is told to close (`4409`).
    pub fn register(&self, node: &NodeId, epoch: i64) -> Registered {
        let last_seen = Arc::new(Mutex::new(self.0.clock.now()));
        let (kick, rx) = watch::channel(None);
        let (push, push_rx) = mpsc::unbounded_channel();
        let old = self.0.sessions.lock().ok().and_then(|mut s| {
            s.insert(
                node.clone(),
                Live {
                    epoch,
                    last_seen: last_seen.clone(),
                    kick,
                    push,
                    pushed: HashSet::new(),
                },
            )
        });
        // Commands already dispatched to this session go out at once.
        self.0.poked.notify_one();
        if let Some(old) = old {
            let _ = old.kick.send(Some(Kick {
                code: 4409,
                reason: "superseded by a newer session of this node".into(),
            }));
        }
        Registered {
            last_seen,
            kick: rx,
            push: push_rx,
        }
    }

    /// Pushes every command dispatched to a session this gateway holds and not yet pushed in
    /// that session; returns how many it pushed. A command is pushed at most once per session:
    /// the session's set remembers it until the command leaves `dispatched`.
    pub async fn push_now(&self) -> compute_domain::Result<usize> {
        let due = node_commands::to_push(&self.0.db, self.id()).await?;
        let mut by_node: HashMap<&NodeId, Vec<&Command>> = HashMap::new();
        for c in &due {
            by_node.entry(&c.node_id).or_default().push(c);
        }
        let mut pushed = 0;
        let Ok(mut sessions) = self.0.sessions.lock() else {
            return Ok(0);
        };
        for (node, live) in sessions.iter_mut() {
            let mine: Vec<&Command> = by_node
                .get(node)
                .map(|cs| {
                    cs.iter()
                        .copied()
                        .filter(|c| c.session_epoch == Some(live.epoch))
                        .collect()
                })
                .unwrap_or_default();
            // Forget what left `dispatched`: it cannot come back to this session.
            let still: HashSet<&CommandId> = mine.iter().map(|c| &c.id).collect();
            live.pushed.retain(|id| still.contains(id));
            for c in mine {
                if live.pushed.contains(&c.id) {
                    continue;
                }
                if live.push.send(command_message(c)).is_ok() {
                    live.pushed.insert(c.id.clone());
                    pushed += 1;
                }
            }
        }
        Ok(pushed)
    }

    /// Wakes the push loop (a dispatcher's poke for this gateway).
    pub fn poke(&self) {
        self.0.poked.notify_one();
    }

    /// Forgets the session of `node` at `epoch`; `true` if it was still this gateway's (so the
    /// connection should close it in the database).
    pub fn unregister(&self, node: &NodeId, epoch: i64) -> bool {
        let Ok(mut s) = self.0.sessions.lock() else {
            return false;
        };
        match s.get(node) {
            Some(live) if live.epoch == epoch => {
                s.remove(node);
                true
            }
            _ => false,
        }
    }

    fn kick_all(&self, code: u16, reason: &str) {
        let drained: Vec<Live> = self
            .0
            .sessions
            .lock()
            .map(|mut s| s.drain().map(|(_, l)| l).collect())
            .unwrap_or_default();
        for live in drained {
            let _ = live.kick.send(Some(Kick {
                code,
                reason: reason.to_owned(),
            }));
        }
    }

    /// Writes every session's age in one statement; the connections of sessions that are no
    /// longer this gateway's at their epoch are told to close (`4409` when a newer session
    /// exists, `4410` when the control plane ended it). Returns how many sessions were written.
    pub async fn flush_now(&self) -> compute_domain::Result<usize> {
        let Some(fence) = self.fence().await? else {
            return Ok(0);
        };
        let seen: Vec<Seen> = self
            .0
            .sessions
            .lock()
            .map(|s| {
                s.iter()
                    .map(|(node, live)| Seen {
                        node: node.clone(),
                        epoch: live.epoch,
                        age_seconds: live
                            .last_seen
                            .lock()
                            .map(|t| self.0.clock.since(*t).as_secs_f64())
                            .unwrap_or(0.0),
                    })
                    .collect()
            })
            .unwrap_or_default();
        if seen.is_empty() {
            return Ok(0);
        }
        let db = self.0.db.fenced(&fence);
        let current = node_sessions::flush(&db, self.id(), &seen).await?;
        let written = current.len();
        if written < seen.len() {
            let current: std::collections::HashSet<NodeId> = current.into_iter().collect();
            let stale: Vec<&Seen> = seen.iter().filter(|s| !current.contains(&s.node)).collect();
            let ids: Vec<NodeId> = stale.iter().map(|s| s.node.clone()).collect();
            let now = node_sessions::sessions_of(&self.0.db, &ids).await?;
            for s in stale {
                let newer = now
                    .iter()
                    .any(|n| n.node_id == s.node && n.session_epoch > s.epoch);
                let (code, reason) = if newer {
                    (4409, "superseded by a newer session of this node")
                } else {
                    (4410, "the control plane ended this session; reconnect")
                };
                let live = self
                    .0
                    .sessions
                    .lock()
                    .ok()
                    .and_then(|mut m| match m.get(&s.node) {
                        Some(l) if l.epoch == s.epoch => m.remove(&s.node),
                        _ => None,
                    });
                if let Some(live) = live {
                    let _ = live.kick.send(Some(Kick {
                        code,
                        reason: reason.into(),
                    }));
                }
            }
        }
        Ok(written)
    }

    /// Holds the lease and flushes every [`GatewayConfig::flush_every`] until `stop`; then ends
    /// every session (`gateway_stopped`, the connections close with `1001`) and lets the lease
    /// go, so daemons reconnect elsewhere at once.
    pub async fn run(self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let mut ticker = tokio::time::interval(self.0.config.flush_every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let listener = tokio::spawn({
            let gateway = self.clone();
            async move {
                loop {
                    let me = gateway.clone();
                    let result = node_commands::listen_for_pokes(&gateway.0.db, move |id| {
                        if id == me.id().as_str() {
                            me.poke();
                        }
                    })
                    .await;
                    if let Err(e) = result {
                        debug!(error = %e, "listening for command pokes failed; polling meanwhile");
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        });
        loop {
            tokio::select! {
                () = &mut stop => break,
                _ = ticker.tick() => {
                    if let Err(e) = self.flush_now().await {
                        warn!(gateway = %self.id(), error = %e, "gateway flush failed");
                    }
                    // Polling: a lost poke only delays a command.
                    if let Err(e) = self.push_now().await {
                        warn!(gateway = %self.id(), error = %e, "pushing commands failed");
                    }
                }
                () = self.0.poked.notified() => {
                    if let Err(e) = self.push_now().await {
                        warn!(gateway = %self.id(), error = %e, "pushing commands failed");
                    }
                }
            }
        }
        listener.abort();
        let held: Vec<(NodeId, Live)> = self
            .0
            .sessions
            .lock()
            .map(|mut s| s.drain().collect())
            .unwrap_or_default();
        if let Ok(Some(fence)) = self.fence().await {
            let db = self.0.db.fenced(&fence);
            for (node, live) in &held {
                if let Err(e) =
                    node_sessions::close(&db, node, live.epoch, CloseReason::GatewayStopped).await
                {
                    warn!(node = %node, error = %e, "closing a session at shutdown failed");
                }
            }
        }
        for (_, live) in held {
            let _ = live.kick.send(Some(Kick {
                code: 1001,
                reason: "the gateway is shutting down; reconnect".into(),
            }));
        }
        if let Some(lease) = self.0.lease.lock().await.take() {
            lease.release(&self.0.db).await;
        }
        info!(gateway = %self.id(), "gateway stopped");
    }

    /// The database handle, fenced by the lease when it is held.
    pub async fn fenced_db(&self) -> compute_domain::Result<Option<(Db, Fence)>> {
        Ok(self.fence().await?.map(|f| (self.0.db.fenced(&f), f)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_kind_has_its_name_on_the_wire() {
        for kind in node_commands::Kind::ALL {
            assert_eq!(protocol_kind(*kind).as_str(), kind.as_str(), "{kind:?}");
        }
    }
}
