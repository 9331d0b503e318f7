//! The daemon's side of the command protocol (`docs/agent-protocol.md`, `docs/agent.md`): every
//! message from the gateway goes through [`Agent::handle`], every step is journaled before the
//! message that depends on it, and the work runs on its own task so the session keeps its
//! heartbeat.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use compute_protocol::{
    ApplySpecArgs, CommandKind, DrainArgs, FromDaemon, GpuHealth, ResetGpuArgs, RunInstanceArgs,
    SetMigLayoutArgs, StopInstanceArgs, ToDaemon,
};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::inventory::Discovered;
use crate::journal::{Entry, Journal, Step, Workload, WorkloadState};
use crate::metrics::Metrics;
use crate::runtime::{Exit, Failure, Runtime};
use crate::sys;

/// A step of a command at which a test can have the agent kill itself with SIGKILL
/// (`COMPUTE_AGENT_FAULT=<step>[:<kind>]`): the crash tests of `docs/agent.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// The `ack` was sent.
    AfterAck,
    /// The journal says started; the work has not begun.
    AfterStartRecorded,
    /// The workload runs and is recorded; the outcome is not.
    AfterWorkloadStarted,
    /// The outcome is recorded; the `result` is not sent.
    AfterOutcomeRecorded,
}

/// Where the agent kills itself, if anywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub point: FaultPoint,
    /// Only for commands of this kind (any when `None`).
    pub kind: Option<CommandKind>,
}

impl Fault {
    /// Parses `after-ack`, `after-start-recorded`, `after-workload-started` or
    /// `after-outcome-recorded`, optionally with `:<command kind>`.
    pub fn parse(text: &str) -> Result<Fault, String> {
        let (point, kind) = match text.split_once(':') {
            Some((p, k)) => (
                p,
                Some(CommandKind::parse(k).ok_or_else(|| format!("unknown command kind {k}"))?),
            ),
            None => (text, None),
        };
        let point = match point {
            "after-ack" => FaultPoint::AfterAck,
            "after-start-recorded" => FaultPoint::AfterStartRecorded,
            "after-workload-started" => FaultPoint::AfterWorkloadStarted,
            "after-outcome-recorded" => FaultPoint::AfterOutcomeRecorded,
            other => return Err(format!("unknown fault point {other}")),
        };
        Ok(Fault { point, kind })
    }
}

/// The agent's settings that commands need.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Seconds between SIGTERM and SIGKILL when a command gives none.
    pub default_grace: Duration,
    pub nvidia_smi: std::path::PathBuf,
    pub fault: Option<Fault>,
}

struct Inner {
    journal: Journal,
    runtime: Runtime,
    settings: Settings,
    metrics: Arc<Metrics>,
    /// Messages for the gateway (the session loop sends them while connected).
    out: mpsc::UnboundedSender<FromDaemon>,
    /// Commands whose work runs in this process now.
    working: Mutex<HashSet<String>>,
    /// Held while a `run_instance` checks its devices and records its workload, so two cannot
    /// both find the same devices free.
    placing: tokio::sync::Mutex<()>,
    /// Instances whose exit a task of this process waits for.
    watched: Mutex<HashSet<String>>,
    /// Instances a `run_instance` of this process is starting: a stop waits on the receiver
    /// until the start is over (the sender is dropped), and stops what it started.
    starting: Mutex<HashMap<String, tokio::sync::watch::Receiver<()>>>,
    /// What the machine has and how its GPUs are, as last read (`inventory`).
    machine: Mutex<Option<Discovered>>,
}

/// How long a stop (or a drain) waits for a workload's start to return before it fails
/// `STILL_STARTING`.
const START_WAIT: Duration = Duration::from_secs(300);

/// A `run_instance`'s start in flight, known to stops (`Inner::starting`) until dropped.
struct StartingGuard {
    agent: Agent,
    instance: String,
    _over: tokio::sync::watch::Sender<()>,
}

impl StartingGuard {
    fn new(agent: &Agent, instance: &str) -> StartingGuard {
        let (over, waiting) = tokio::sync::watch::channel(());
        agent
            .0
            .starting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(instance.to_owned(), waiting);
        StartingGuard {
            agent: agent.clone(),
            instance: instance.to_owned(),
            _over: over,
        }
    }
}

impl Drop for StartingGuard {
    fn drop(&mut self) {
        // Its own entry only: a later start of the same instance id (after this one failed)
        // may have put its own there.
        let mut starting = self
            .agent
            .0
            .starting
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if starting
            .get(&self.instance)
            .is_some_and(|r| r.same_channel(&self._over.subscribe()))
        {
            starting.remove(&self.instance);
        }
    }
}

/// The daemon's command side. Cheap to clone.
#[derive(Clone)]
pub struct Agent(Arc<Inner>);

fn die(point: FaultPoint) -> ! {
    warn!(
        ?point,
        "COMPUTE_AGENT_FAULT: killing this agent with SIGKILL"
    );
    sys::kill_self();
}

fn parse_args<T: DeserializeOwned>(args: &Value) -> Result<T, Failure> {
    serde_json::from_value(args.clone()).map_err(|e| {
        Failure::new(
            "BAD_ARGS",
            format!("the command's args do not fit its kind: {e}"),
        )
    })
}

fn as_result(id: &str, outcome: Result<Value, Failure>) -> FromDaemon {
    match outcome {
        Ok(output) => FromDaemon::succeeded(id, output),
        Err(f) => FromDaemon::failed(id, f.code, f.message),
    }
}

impl Agent {
    pub fn new(
        journal: Journal,
        runtime: Runtime,
        settings: Settings,
        metrics: Arc<Metrics>,
    ) -> (Agent, mpsc::UnboundedReceiver<FromDaemon>) {
        let (out, rx) = mpsc::unbounded_channel();
        (
            Agent(Arc::new(Inner {
                journal,
                runtime,
                settings,
                metrics,
                out,
                working: Mutex::new(HashSet::new()),
                placing: tokio::sync::Mutex::new(()),
                watched: Mutex::new(HashSet::new()),
                starting: Mutex::new(HashMap::new()),
                machine: Mutex::new(None),
            })),
            rx,
        )
    }

    pub fn journal(&self) -> &Journal {
        &self.0.journal
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.0.metrics
    }

    fn send(&self, m: FromDaemon) {
        let _ = self.0.out.send(m);
    }

    fn fault(&self, point: FaultPoint, kind: CommandKind) {
        if let Some(f) = self.0.settings.fault
            && f.point == point
            && f.kind.is_none_or(|k| k == kind)
        {
            die(point);
        }
    }

    /// After the session loop sent `m`: the crash test's first step.
    pub fn sent(&self, m: &FromDaemon) {
        if self.0.settings.fault.is_some()
            && let FromDaemon::Ack { command_id } = m
            && let Ok(Some(e)) = self.0.journal.command(command_id)
        {
            self.fault(FaultPoint::AfterAck, e.kind);
        }
    }

    /// What a new session must hear first: the machine's inventory and its GPUs' health, and
    /// the exits the control plane has not confirmed.
    pub fn on_session_open(&self) -> Vec<FromDaemon> {
        let mut out = self
            .0
            .machine
            .lock()
            .ok()
            .and_then(|m| m.as_ref().map(machine_messages))
            .unwrap_or_default();
        match self.0.journal.unreported_exits() {
            Ok(ws) => out.extend(ws.iter().map(exited_message)),
            Err(e) => error!(error = %e, "cannot read the journal's unreported exits"),
        }
        out
    }

    /// What the machine has now: kept, and sent when it changed (the inventory when it did,
    /// the health of each GPU whose health did). Whether anything changed.
    pub fn set_machine(&self, now: Discovered) -> bool {
        let Ok(mut m) = self.0.machine.lock() else {
            return false;
        };
        let mut changed = Vec::new();
        if m.as_ref().is_none_or(|old| old.inventory != now.inventory) {
            changed.push(FromDaemon::Inventory {
                inventory: now.inventory.clone(),
            });
        }
        for (uuid, h) in &now.health {
            if m.as_ref().and_then(|old| old.health.get(uuid)) != Some(h) {
                if h.health == GpuHealth::Unhealthy {
                    warn!(%uuid, reason = ?h.reason, "GPU unhealthy");
                } else {
                    info!(%uuid, "GPU healthy");
                }
                changed.push(FromDaemon::DeviceHealth {
                    uuid: uuid.clone(),
                    health: h.health,
                    reason: h.reason.clone(),
                });
            }
        }
        let first = m.is_none();
        *m = Some(now);
        drop(m);
        // The first read is sent by `on_session_open`.
        if !first {
            for c in &changed {
                self.send(c.clone());
            }
        }
        !changed.is_empty()
    }

    /// The MIG instance UUID of atom `<gpu uuid>/mig/<k>`, by the machine's inventory (the k-th
    /// instance of that GPU).
    pub fn mig_uuid(&self, atom: &str) -> Option<String> {
        let (gpu, k) = atom.split_once("/mig/")?;
        let k: usize = k.parse().ok()?;
        let m = self.0.machine.lock().ok()?;
        let g = m.as_ref()?.inventory.gpus.iter().find(|g| g.uuid == gpu)?;
        g.mig.get(k).map(|i| i.uuid.clone())
    }

    /// Follows every workload the journal says is live: adopted when it still runs (the same
    /// pid with the same start time, or the same container), recorded as ended when it does
    /// not. Run once at start, before the first session.
    pub async fn adopt(&self) -> Result<usize, crate::journal::JournalError> {
        let mut adopted = 0;
        for w in self.0.journal.live_workloads()? {
            let mut w = w;
            if w.state == WorkloadState::Starting {
                // Died between recording the start and recording the workload: look for it.
                match self
                    .0
                    .runtime
                    .find(&w.instance_id, self.0.journal.id())
                    .await
                {
                    Some(found) => {
                        self.0.journal.workload_running(
                            &w.instance_id,
                            found.pid,
                            found.start_time,
                            found.container_id.as_deref(),
                        )?;
                        w.pid = found.pid;
                        w.start_time = found.start_time;
                        w.container_id = found.container_id;
                        w.state = WorkloadState::Running;
                        info!(instance = %w.instance_id, pid = ?w.pid, container = ?w.container_id, "found a workload started before the crash");
                    }
                    None => {
                        self.0.journal.workload_move(
                            &w.instance_id,
                            &[WorkloadState::Starting],
                            WorkloadState::Stopped,
                        )?;
                        info!(instance = %w.instance_id, "a workload being started when the agent died never started");
                        continue;
                    }
                }
            }
            if self.0.runtime.running(&w).await {
                info!(instance = %w.instance_id, pid = ?w.pid, container = ?w.container_id, "adopted a running workload");
                adopted += 1;
                self.watch(w, None);
            } else {
                // It ended while the agent was down; a container's code is still known.
                let exit = if w.container_id.is_some() {
                    self.0.runtime.wait_adopted(&w).await
                } else {
                    Exit::default()
                };
                self.ended(&w.instance_id, exit, sys::now());
            }
        }
        Ok(adopted)
    }

    /// Handles one message from the gateway; the messages to send now.
    pub fn handle(&self, message: ToDaemon) -> Vec<FromDaemon> {
        match message {
            ToDaemon::Command {
                command_id,
                kind,
                args,
                retry_safe,
                attempt,
                ..
            } => self.on_command(command_id, kind, args, retry_safe, attempt),
            ToDaemon::Proceed { command_id } => {
                self.on_proceed(&command_id);
                vec![]
            }
            ToDaemon::Cancelled { command_id, reason } => {
                info!(command = %command_id, %reason, "command cancelled before it started");
                if let Err(e) = self.0.journal.forget(&command_id) {
                    warn!(command = %command_id, error = %e, "cannot forget a cancelled command");
                }
                vec![]
            }
            ToDaemon::Recorded {
                command_id,
                recorded,
            } => {
                debug!(command = %command_id, recorded, "result recorded by the control plane");
                // Only a result the control plane holds: `recorded: false` (the command is not
                // this session's now) means it comes again, and the journal must answer it.
                if recorded && let Err(e) = self.0.journal.result_recorded(&command_id) {
                    warn!(command = %command_id, error = %e, "cannot note that a result was recorded; the command is kept");
                }
                vec![]
            }
            ToDaemon::ExitRecorded {
                instance_id,
                recorded,
            } => {
                debug!(instance = %instance_id, recorded, "exit recorded by the control plane");
                if let Err(e) = self.0.journal.exit_reported(&instance_id) {
                    warn!(instance = %instance_id, error = %e, "cannot record that an exit was reported; it is sent again");
                }
                vec![]
            }
            ToDaemon::Error {
                code,
                message,
                command_id,
            } => {
                warn!(%code, %message, command = ?command_id, "the gateway refused a message");
                vec![]
            }
            ToDaemon::Welcome { .. } | ToDaemon::Joined { .. } => {
                warn!("a welcome or joined within a session; ignored");
                vec![]
            }
            ToDaemon::InventoryChecked { differences } => {
                if differences.is_empty() {
                    info!("the control plane's registration agrees with this machine");
                } else {
                    warn!(differences = %differences.join("; "), "this machine differs from its registration: the GPUs concerned are out of placement until an operator settles it");
                }
                vec![]
            }
            ToDaemon::HealthRecorded { uuid, recorded } => {
                if !recorded {
                    warn!(%uuid, "the control plane has no such GPU on this node");
                }
                vec![]
            }
        }
    }

    fn on_command(
        &self,
        id: String,
        kind: CommandKind,
        args: Value,
        retry_safe: bool,
        attempt: i32,
    ) -> Vec<FromDaemon> {
        let j = &self.0.journal;
        let held = match j.command(&id) {
            Ok(h) => h,
            Err(e) => return vec![self.journal_failed(&id, kind, &e)],
        };
        match held {
            Some(Entry {
                step: Step::Finished,
                result: Some(result),
                ..
            }) => {
                info!(command = %id, %kind, attempt, "command already finished: answered from the journal");
                vec![result]
            }
            Some(entry) if entry.step == Step::Started => {
                if self.is_working(&id) {
                    // Acknowledged again: the control plane put it back to pending when this
                    // session opened, and until it hears it runs, it could take it for never
                    // started. The outcome follows when the work ends.
                    debug!(command = %id, "command sent again while it runs here: acknowledged");
                    return vec![FromDaemon::Ack { command_id: id }];
                }
                self.recover(entry)
            }
            Some(_) => {
                info!(command = %id, %kind, attempt, "command received again: acknowledged");
                vec![FromDaemon::Ack { command_id: id }]
            }
            None => match j.receive(&id, kind, &args, retry_safe) {
                Ok(()) => {
                    info!(command = %id, %kind, attempt, "command received: journaled, acknowledged");
                    vec![FromDaemon::Ack { command_id: id }]
                }
                Err(e) => vec![self.journal_failed(&id, kind, &e)],
            },
        }
    }

    /// A journal write failed: the command fails (never acknowledged, never run).
    fn journal_failed(
        &self,
        id: &str,
        kind: CommandKind,
        e: &crate::journal::JournalError,
    ) -> FromDaemon {
        error!(command = %id, %kind, error = %e, "the journal cannot be written: the command fails");
        self.0.metrics.journal_errors.inc();
        self.0.metrics.finished(kind, false);
        FromDaemon::failed(
            id,
            "JOURNAL_UNWRITABLE",
            format!("the agent's journal cannot be written: {e}"),
        )
    }

    fn is_working(&self, id: &str) -> bool {
        self.0
            .working
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id)
    }

    /// A command the journal holds as started but not finished: this agent died while it ran.
    /// A `run_instance` whose workload the journal recorded as started (a pid or a container)
    /// succeeded, adopted; a retry-safe command runs again; any other fails `INTERRUPTED`.
    fn recover(&self, entry: Entry) -> Vec<FromDaemon> {
        let id = entry.id.clone();
        if entry.kind == CommandKind::RunInstance
            && let Ok(args) = parse_args::<RunInstanceArgs>(&entry.args)
            && let Ok(Some(w)) = self.0.journal.workload(&args.instance_id)
            && w.command_id == id
            && w.state != WorkloadState::Starting
            && (w.pid.is_some() || w.container_id.is_some())
        {
            let result = FromDaemon::succeeded(
                &id,
                json!({ "instanceId": w.instance_id, "pid": w.pid, "containerId": w.container_id, "adopted": true }),
            );
            info!(command = %id, instance = %w.instance_id, "run_instance interrupted after its workload started: succeeded, adopted");
            return vec![self.record_outcome(&id, entry.kind, result)];
        }
        if entry.retry_safe {
            info!(command = %id, kind = %entry.kind, "retry-safe command interrupted: running it again");
            self.work(entry);
            return vec![];
        }
        let result = FromDaemon::failed(
            &id,
            "INTERRUPTED",
            "the agent stopped while this command ran; it is not retry-safe, so it is not run again",
        );
        info!(command = %id, kind = %entry.kind, "command interrupted: failed INTERRUPTED");
        vec![self.record_outcome(&id, entry.kind, result)]
    }

    /// Records an outcome; the result to send (the journal's, if one was already there).
    fn record_outcome(&self, id: &str, kind: CommandKind, result: FromDaemon) -> FromDaemon {
        match self.0.journal.finish(id, &result) {
            Ok(kept) => {
                let ok = matches!(
                    kept,
                    FromDaemon::Result {
                        outcome: compute_protocol::Outcome::Succeeded,
                        ..
                    }
                );
                self.0.metrics.finished(kind, ok);
                kept
            }
            Err(e) => {
                // The outcome cannot be kept: the gateway learns it now, and if this result
                // is lost the command is answered INTERRUPTED later.
                error!(command = %id, error = %e, "cannot record a command's outcome");
                self.0.metrics.journal_errors.inc();
                result
            }
        }
    }

    fn on_proceed(&self, id: &str) {
        let entry = match self.0.journal.command(id) {
            Ok(Some(e)) => e,
            Ok(None) => {
                warn!(command = %id, "proceed for a command the journal does not hold");
                return;
            }
            Err(e) => {
                error!(command = %id, error = %e, "cannot read the journal");
                return;
            }
        };
        match self.0.journal.start(id) {
            Ok(true) => {
                info!(command = %id, kind = %entry.kind, "command started");
                self.work(entry);
            }
            Ok(false) => debug!(command = %id, "proceed for a command already started"),
            Err(e) => {
                let m = self.journal_failed(id, entry.kind, &e);
                self.send(m);
            }
        }
    }

    /// Runs a started command's work on its own task; records and sends its result.
    fn work(&self, entry: Entry) {
        self.0
            .working
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(entry.id.clone());
        let agent = self.clone();
        tokio::spawn(async move {
            agent.fault(FaultPoint::AfterStartRecorded, entry.kind);
            let outcome = agent.execute(&entry).await;
            let ok = outcome.is_ok();
            match &outcome {
                Ok(out) => {
                    info!(command = %entry.id, kind = %entry.kind, output = %out, "command succeeded")
                }
                Err(f) => {
                    info!(command = %entry.id, kind = %entry.kind, code = f.code, reason = %f.message, "command failed")
                }
            }
            let result = agent.record_outcome(&entry.id, entry.kind, as_result(&entry.id, outcome));
            agent.fault(FaultPoint::AfterOutcomeRecorded, entry.kind);
            agent.send(result);
            if ok && entry.kind == CommandKind::ApplySpec {
                match agent.0.journal.observed_generation() {
                    Ok(g) => agent.send(FromDaemon::Status {
                        observed_generation: g,
                    }),
                    Err(e) => warn!(error = %e, "cannot read the applied generation"),
                }
            }
            agent
                .0
                .working
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&entry.id);
        });
    }

    async fn execute(&self, entry: &Entry) -> Result<Value, Failure> {
        match entry.kind {
            CommandKind::Noop => Ok(json!({})),
            CommandKind::ApplySpec => {
                let a: ApplySpecArgs = parse_args(&entry.args)?;
                let applied = self
                    .0
                    .journal
                    .observed_generation()
                    .map_err(|e| Failure::new("JOURNAL_UNWRITABLE", e.to_string()))?;
                self.0
                    .journal
                    .set_observed_generation(applied.max(a.generation))
                    .map_err(|e| Failure::new("JOURNAL_UNWRITABLE", e.to_string()))?;
                Ok(json!({ "generation": a.generation }))
            }
            CommandKind::RunInstance => {
                let a: RunInstanceArgs = parse_args(&entry.args)?;
                if let Some(why) = a.problem() {
                    return Err(Failure::new("BAD_ARGS", why));
                }
                self.run_instance(&entry.id, &a).await
            }
            CommandKind::StopInstance => {
                let a: StopInstanceArgs = parse_args(&entry.args)?;
                if !compute_protocol::is_instance_id(&a.instance_id) {
                    return Err(Failure::new(
                        "BAD_ARGS",
                        format!("instanceId {:?} is not an instance id", a.instance_id),
                    ));
                }
                let grace = self.grace(a.grace_seconds)?;
                self.stop_instance(&a.instance_id, grace, None).await
            }
            CommandKind::DrainWorkloads => {
                let a: DrainArgs = parse_args(&entry.args)?;
                let grace = self.grace(a.grace_seconds)?;
                let live = self
                    .0
                    .journal
                    .live_workloads()
                    .map_err(|e| Failure::new("JOURNAL_UNWRITABLE", e.to_string()))?;
                // All at once: each waits out its own grace. Their instances did not ask: each
                // is marked drained before it is signalled, so its end is recorded as an exit
                // and reported as it happens (also when another fails to stop, and after a
                // crash in the middle of the drain: unreported exits are sent at the next
                // session). One whose instance's own stop was under way ends `stopped`.
                let stops = live
                    .iter()
                    .map(|w| self.stop_instance(&w.instance_id, grace, Some(&entry.id)));
                let results = futures_util::future::join_all(stops).await;
                let mut failed = None;
                for (w, r) in live.iter().zip(results) {
                    if let Err(f) = r {
                        warn!(instance = %w.instance_id, code = %f.code, "a drained workload did not stop: {}", f.message);
                        failed.get_or_insert(f);
                    }
                }
                if let Some(f) = failed {
                    return Err(f);
                }
                let stopped: Vec<&str> = live.iter().map(|w| w.instance_id.as_str()).collect();
                Ok(json!({ "stopped": stopped }))
            }
            CommandKind::ResetGpu => {
                let a: ResetGpuArgs = parse_args(&entry.args)?;
                let held = self
                    .0
                    .journal
                    .live_workloads()
                    .map_err(|e| Failure::new("JOURNAL_UNWRITABLE", e.to_string()))?
                    .into_iter()
                    .find(|w| w.devices.iter().any(|d| gpu_of(d) == a.device));
                if let Some(w) = held {
                    return Err(Failure::new(
                        "DEVICE_BUSY",
                        format!("{} is held by instance {}", a.device, w.instance_id),
                    ));
                }
                crate::nvidia::reset(&self.0.settings.nvidia_smi, &a.device).await
            }
            CommandKind::SetMigLayout => {
                let a: SetMigLayoutArgs = parse_args(&entry.args)?;
                crate::nvidia::set_mig_layout(&self.0.settings.nvidia_smi, &a.device, &a.layout)
                    .await
            }
        }
    }

    fn grace(&self, seconds: Option<f64>) -> Result<Duration, Failure> {
        match seconds {
            None => Ok(self.0.settings.default_grace),
            Some(s) if s.is_finite() && (0.0..=3600.0).contains(&s) => {
                Ok(Duration::from_secs_f64(s))
            }
            Some(_) => Err(Failure::new("BAD_ARGS", "graceSeconds is 0 to 3600")),
        }
    }

    async fn run_instance(&self, command: &str, a: &RunInstanceArgs) -> Result<Value, Failure> {
        let visible = crate::runtime::visible_devices(&a.devices, |atom| self.mig_uuid(atom))?;
        let journal_failure = |e: crate::journal::JournalError| {
            self.0.metrics.journal_errors.inc();
            Failure::new("JOURNAL_UNWRITABLE", e.to_string())
        };
        // Dropped when this start is over, however it ends: a stop waiting on it goes on.
        let starting;
        {
            let _placing = self.0.placing.lock().await;
            let live = self.0.journal.live_workloads().map_err(journal_failure)?;
            if let Some(same) = live.iter().find(|w| w.instance_id == a.instance_id) {
                // The instance already runs here (another command started it): never twice.
                return Ok(
                    json!({ "instanceId": same.instance_id, "pid": same.pid, "containerId": same.container_id, "adopted": true }),
                );
            }
            let taken: Vec<String> = live
                .iter()
                .flat_map(|w| w.devices.iter())
                .filter(|d| a.devices.contains(d))
                .cloned()
                .collect();
            if !taken.is_empty() {
                return Err(Failure::new(
                    "DEVICE_OVERLAP",
                    format!("devices {taken:?} are held by another workload on this node"),
                ));
            }
            let log = self.0.runtime.log_path(&a.instance_id);
            // Known as starting before the journal says so: a stop that reads `starting` finds
            // the start to wait for (or, when it is over, a state that moved on).
            starting = StartingGuard::new(self, &a.instance_id);
            self.0
                .journal
                .workload_starting(
                    &a.instance_id,
                    command,
                    self.0.runtime.kind.as_str(),
                    &a.devices,
                    &log.display().to_string(),
                )
                .map_err(journal_failure)?;
        }
        let started = match self.0.runtime.start(a, &visible, self.0.journal.id()).await {
            Ok(s) => s,
            Err(f) => {
                let _ = self.0.journal.workload_move(
                    &a.instance_id,
                    &[WorkloadState::Starting],
                    WorkloadState::Stopped,
                );
                return Err(f);
            }
        };
        let running = self
            .0
            .journal
            .workload_running(
                &a.instance_id,
                started.pid,
                started.start_time,
                started.container_id.as_deref(),
            )
            .map_err(journal_failure)?;
        if !running {
            // A drain or a stop found it starting, with nothing to signal yet, and recorded
            // it ended: what just started is stopped now, not left on the GPUs.
            warn!(instance = %a.instance_id, pid = ?started.pid, container = ?started.container_id, "workload stopped while it started: stopping it");
            if let Ok(Some(w)) = self.0.journal.workload(&a.instance_id) {
                drop(started.child);
                self.0.runtime.stop(&w, Duration::ZERO).await?;
            }
            return Err(Failure::new(
                "STOPPED_WHILE_STARTING",
                "the workload was stopped (a stop or a drain) while it started; it was stopped once it had",
            ));
        }
        drop(starting);
        info!(instance = %a.instance_id, pid = ?started.pid, container = ?started.container_id, devices = %visible.join(","), "workload started");
        self.fault(FaultPoint::AfterWorkloadStarted, CommandKind::RunInstance);
        let output = json!({ "instanceId": a.instance_id, "pid": started.pid, "containerId": started.container_id });
        if let Ok(Some(w)) = self.0.journal.workload(&a.instance_id) {
            self.watch(w, started.child);
        }
        Ok(output)
    }

    /// Stops `instance`'s workload: at its instance's request, or for drain `drain`.
    async fn stop_instance(
        &self,
        instance: &str,
        grace: Duration,
        drain: Option<&str>,
    ) -> Result<Value, Failure> {
        let journal_failure = |e: crate::journal::JournalError| {
            self.0.metrics.journal_errors.inc();
            Failure::new("JOURNAL_UNWRITABLE", e.to_string())
        };
        let Some(w) = self.0.journal.workload(instance).map_err(journal_failure)? else {
            return Ok(json!({ "instanceId": instance, "running": false }));
        };
        if !w.state.is_live() {
            return Ok(
                json!({ "instanceId": instance, "running": false, "exitCode": w.exit_code, "signal": w.signal }),
            );
        }
        // A start in flight, taken before the move below: once the workload is `stopping`,
        // the start stops what it started, and this stop answers only after that (answered
        // at once, the control plane would hand the GPUs on while a slow start, a podman
        // pull say, still ran on them).
        let start = self
            .0
            .starting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(instance)
            .cloned();
        match drain {
            Some(drain) => self.0.journal.workload_draining(instance, drain),
            None => self.0.journal.workload_move(
                instance,
                &[WorkloadState::Starting, WorkloadState::Running],
                WorkloadState::Stopping,
            ),
        }
        .map_err(journal_failure)?;
        if let Some(mut start) = start {
            info!(
                instance,
                "the workload is starting: the stop waits for its start to end"
            );
            // Err once the start is over and its sender dropped: that is the wait's end. A
            // start that never returns (a pull or a podman that hangs) fails the stop after
            // `START_WAIT` instead of holding it (and a drain) for good: the workload is not
            // known to be stopped, and the start still stops it if it ever returns.
            if tokio::time::timeout(START_WAIT, start.changed())
                .await
                .is_err()
            {
                return Err(Failure::new(
                    "STILL_STARTING",
                    format!(
                        "the workload is still starting after {} s; it is stopped as soon as its start returns: try the stop again later",
                        START_WAIT.as_secs()
                    ),
                ));
            }
        }
        // Read again: a start that ended meanwhile recorded the pid or container to stop.
        let w = self
            .0
            .journal
            .workload(instance)
            .map_err(journal_failure)?
            .unwrap_or(w);
        info!(instance, grace_s = grace.as_secs_f64(), "stopping workload");
        let signal = self.0.runtime.stop(&w, grace).await?;
        // Gone: recorded as stopped (the watcher may have recorded it first).
        self.ended(
            instance,
            Exit {
                code: None,
                signal: Some(signal).filter(|s| *s != 0),
            },
            sys::now(),
        );
        info!(instance, signal, "workload stopped");
        Ok(json!({ "instanceId": instance, "running": false, "signal": signal }))
    }

    /// Removes what ended longer than `keep` ago and the control plane holds: each such
    /// workload's container, working directory, log and journal row, and the journal's
    /// finished commands whose result was recorded. How many workloads it removed.
    pub async fn clean(&self, keep: Duration) -> usize {
        let before = sys::now() - keep.as_secs_f64();
        let mut removed = 0;
        match self.0.journal.ended_before(before) {
            Ok(ended) => {
                for w in ended {
                    match self.0.runtime.remove(&w).await {
                        Ok(()) => match self.0.journal.forget_workload(&w.instance_id) {
                            Ok(()) => {
                                removed += 1;
                                info!(instance = %w.instance_id, "removed an ended workload's container, working directory and log");
                            }
                            Err(e) => {
                                warn!(instance = %w.instance_id, error = %e, "cannot forget an ended workload")
                            }
                        },
                        Err(e) => {
                            warn!(instance = %w.instance_id, error = %e, "cannot remove an ended workload; trying again at the next cleanup")
                        }
                    }
                }
            }
            Err(e) => warn!(error = %e, "cannot read the ended workloads"),
        }
        match self.0.journal.forget_recorded_commands(before) {
            Ok(0) => {}
            Ok(n) => debug!(
                commands = n,
                "forgot finished commands the control plane recorded"
            ),
            Err(e) => warn!(error = %e, "cannot forget finished commands"),
        }
        removed
    }

    /// Waits on a workload's end on its own task: the child when this agent started it,
    /// otherwise `/proc` or `podman wait`.
    fn watch(&self, w: Workload, child: Option<tokio::process::Child>) {
        if !self
            .0
            .watched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(w.instance_id.clone())
        {
            return;
        }
        let agent = self.clone();
        tokio::spawn(async move {
            let exit = match child {
                Some(mut child) => match child.wait().await {
                    Ok(status) => Exit::of(status),
                    Err(e) => {
                        warn!(instance = %w.instance_id, error = %e, "waiting on a workload failed; following it by its pid");
                        agent.0.runtime.wait_adopted(&w).await
                    }
                },
                None => agent.0.runtime.wait_adopted(&w).await,
            };
            // The leader ended; what it left in its process group (`sleep 600 &`) ends too,
            // as a stop ends it (TERM, the grace, KILL): a workload is over only when no
            // process of it is left, and its GPUs are booked again once its end is reported.
            if w.container_id.is_none()
                && let Some(pgrp) = w.pid
                && crate::sys::group_alive(pgrp)
            {
                warn!(instance = %w.instance_id, pgrp, "the workload's leader exited and left processes behind: stopping them");
                if let Err(f) = agent
                    .0
                    .runtime
                    .stop(&w, agent.0.settings.default_grace)
                    .await
                {
                    warn!(instance = %w.instance_id, pgrp, code = %f.code, "{}", f.message);
                }
            }
            agent
                .0
                .watched
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&w.instance_id);
            agent.ended(&w.instance_id, exit, sys::now());
        });
    }

    /// A workload is gone: `stopped` when asked to stop, otherwise `exited` and reported.
    fn ended(&self, instance: &str, exit: Exit, at: f64) {
        match self
            .0
            .journal
            .workload_ended(instance, exit.code, exit.signal, at)
        {
            Ok(Some(WorkloadState::Exited)) => {
                info!(instance, code = ?exit.code, signal = ?exit.signal, "workload exited (on its own, or drained): its instance hears of it");
                self.0.metrics.exits.inc();
                if let Ok(Some(w)) = self.0.journal.workload(instance) {
                    self.send(exited_message(&w));
                }
            }
            Ok(Some(state)) => {
                debug!(instance, state = state.as_str(), code = ?exit.code, signal = ?exit.signal, "workload ended")
            }
            Ok(None) => {}
            Err(e) => {
                self.0.metrics.journal_errors.inc();
                error!(instance, error = %e, "cannot record a workload's end");
            }
        }
    }
}

/// The GPU of an atom (`<uuid>`, `<uuid>/s<k>`, `<uuid>/mig/<k>`).
fn gpu_of(atom: &str) -> &str {
    atom.split('/').next().unwrap_or(atom)
}

fn exited_message(w: &Workload) -> FromDaemon {
    FromDaemon::Exited {
        instance_id: w.instance_id.clone(),
        exit_code: w.exit_code,
        signal: w.signal,
        exited_seconds_ago: w.ended_at.map_or(0.0, |t| (sys::now() - t).max(0.0)),
    }
}

/// The messages that say what the machine has: its inventory, then each GPU's health.
fn machine_messages(m: &Discovered) -> Vec<FromDaemon> {
    let mut out = vec![FromDaemon::Inventory {
        inventory: m.inventory.clone(),
    }];
    out.extend(m.health.iter().map(|(uuid, h)| FromDaemon::DeviceHealth {
        uuid: uuid.clone(),
        health: h.health,
        reason: h.reason.clone(),
    }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A result the control plane answers `recorded: false` to (the command is not this
    /// session's any more: it will come again) stays in the journal whatever its age, so the
    /// command sent again is answered from it and never run twice; `recorded: true` lets the
    /// cleanup forget it.
    #[test]
    fn only_a_result_recorded_by_the_control_plane_may_be_forgotten() {
        let dir =
            std::env::temp_dir().join(format!("compute-agent-recorded-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let journal = Journal::open(&dir).expect("journal");
        journal
            .receive("cmd_1", CommandKind::Noop, &json!({}), false)
            .expect("receive");
        assert!(journal.start("cmd_1").expect("start"));
        journal
            .finish("cmd_1", &FromDaemon::succeeded("cmd_1", json!({})))
            .expect("finish");
        let runtime = Runtime {
            kind: crate::runtime::Kind::Process,
            state_dir: dir.clone(),
            run_as: None,
            podman: "podman".into(),
            podman_global_args: vec![],
            podman_run_args: vec![],
            cdi_dirs: vec![],
        };
        let settings = Settings {
            default_grace: Duration::from_secs(1),
            nvidia_smi: "nvidia-smi".into(),
            fault: None,
        };
        let (agent, _out) = Agent::new(journal, runtime, settings, Arc::new(Metrics::new()));
        let later = sys::now() + 60.0;
        agent.handle(ToDaemon::Recorded {
            command_id: "cmd_1".into(),
            recorded: false,
        });
        assert_eq!(
            agent
                .0
                .journal
                .forget_recorded_commands(later)
                .expect("forget"),
            0
        );
        agent.handle(ToDaemon::Recorded {
            command_id: "cmd_1".into(),
            recorded: true,
        });
        assert_eq!(
            agent
                .0
                .journal
                .forget_recorded_commands(later)
                .expect("forget"),
            1
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
