//! `compute-agent`'s command line: every flag has an environment fallback
//! (`COMPUTE_AGENT_…`), so a systemd unit can set them in an environment file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tracing::{error, info, warn};

use crate::agent::{Agent, Fault, Settings};
use crate::inventory::{self, Discovered};
use crate::journal::Journal;
use crate::metrics::Metrics;
use crate::runtime::{self, Runtime};
use crate::session::{self, Ending, Identity, Token};

/// The node daemon of Better Compute: connects to a gateway (`/agent`), runs the commands the
/// control plane dispatches to this machine, and journals each of them in its state directory
/// so that no command runs twice or is lost, whatever kills it. Workloads outlive the agent:
/// stopping or restarting it never stops them (send `drain_workloads` first for that).
#[derive(Debug, Parser)]
#[command(name = "compute-agent", version)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// The gateway's agent endpoint, `ws://host:port/agent` (any compute-api process).
    #[arg(long, env = "COMPUTE_AGENT_URL", global = true)]
    pub url: Option<String>,
    /// This machine's node id (`node_…`), as registered in the control plane; after `join`,
    /// the one kept in the state directory (`node-id`).
    #[arg(long, env = "COMPUTE_AGENT_NODE_ID", global = true)]
    pub node_id: Option<String>,
    /// The node's credential: a JWT with the role `node` for this node; after `join`, the
    /// credential kept in the state directory (`credential`, mode 0600) when neither this nor
    /// `--token-file` is given.
    #[arg(
        long,
        env = "COMPUTE_AGENT_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,
    /// A file holding the node's credential (read again before every connection).
    #[arg(long, env = "COMPUTE_AGENT_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,
    /// The state directory: the journal (`journal.sqlite3`), workload logs (`logs/`) and
    /// working directories (`work/`). An emptied directory is a new journal.
    #[arg(
        long,
        env = "COMPUTE_AGENT_STATE_DIR",
        global = true,
        default_value = "/var/lib/compute-agent"
    )]
    pub state_dir: PathBuf,
    /// How workloads run: `process` (a child on the host; the image is recorded, not run) or
    /// `podman` (a container of the image).
    #[arg(
        long,
        env = "COMPUTE_AGENT_RUNTIME",
        global = true,
        value_enum,
        default_value = "process"
    )]
    pub runtime: runtime::Kind,
    /// Run workloads of the process runtime as this user and group (`UID:GID`); the agent's
    /// own user when not set.
    #[arg(long, env = "COMPUTE_AGENT_RUN_AS", value_parser = parse_run_as, global = true)]
    pub run_as: Option<(u32, u32)>,
    /// The podman program.
    #[arg(
        long,
        env = "COMPUTE_AGENT_PODMAN",
        default_value = "podman",
        global = true
    )]
    pub podman: PathBuf,
    /// Arguments of podman before `run`, split on whitespace (for example
    /// `--runtime runc --cgroup-manager=cgroupfs` where the default OCI runtime fails).
    #[arg(
        long,
        env = "COMPUTE_AGENT_PODMAN_GLOBAL_ARGS",
        global = true,
        default_value = "",
        allow_hyphen_values = true
    )]
    pub podman_global_args: String,
    /// Arguments of `podman run` before the image, split on whitespace (for example
    /// `--network none --ulimit nofile=1024:1024 --pull=never`).
    #[arg(
        long,
        env = "COMPUTE_AGENT_PODMAN_RUN_ARGS",
        global = true,
        default_value = "",
        allow_hyphen_values = true
    )]
    pub podman_run_args: String,
    /// Directories of CDI specs: when one names `nvidia.com/gpu`, containers get their GPUs
    /// as CDI devices.
    #[arg(
        long,
        env = "COMPUTE_AGENT_CDI_DIRS",
        global = true,
        value_delimiter = ',',
        default_value = "/etc/cdi,/var/run/cdi"
    )]
    pub cdi_dirs: Vec<PathBuf>,
    /// NVIDIA's `nvidia-smi`, for `reset_gpu` and `set_mig_layout` (they fail `UNSUPPORTED`
    /// where it is missing).
    #[arg(
        long,
        env = "COMPUTE_AGENT_NVIDIA_SMI",
        default_value = "nvidia-smi",
        global = true
    )]
    pub nvidia_smi: PathBuf,
    /// Seconds between SIGTERM and SIGKILL when a stop gives no `graceSeconds`.
    #[arg(
        long,
        env = "COMPUTE_AGENT_STOP_GRACE_SECONDS",
        default_value_t = 30.0,
        global = true
    )]
    pub stop_grace_seconds: f64,
    /// Seconds an ended workload's container, working directory and log (and the journal's
    /// rows of it and of the commands the control plane recorded) are kept for inspection
    /// before they are removed; 1 to 31536000.
    #[arg(
        long,
        env = "COMPUTE_AGENT_KEEP_ENDED_SECONDS",
        default_value_t = 86_400,
        global = true
    )]
    pub keep_ended_seconds: u64,
    /// Where to serve `/metrics` and `/healthz` (`off` for nowhere). The address bound is
    /// also written to `<state dir>/listen-address`.
    #[arg(
        long,
        env = "COMPUTE_AGENT_LISTEN",
        default_value = "127.0.0.1:9471",
        global = true
    )]
    pub listen: String,
    /// Log lines as `text` or `json` (the level from `RUST_LOG`, `info` by default).
    #[arg(
        long,
        env = "COMPUTE_AGENT_LOG_FORMAT",
        default_value = "text",
        global = true
    )]
    pub log_format: String,
    /// For crash tests only: kill this agent with SIGKILL at a step of a command
    /// (`after-ack`, `after-start-recorded`, `after-workload-started`,
    /// `after-outcome-recorded`, optionally `:<kind>`).
    #[arg(long, env = "COMPUTE_AGENT_FAULT", value_parser = Fault::parse, global = true)]
    pub fault: Option<Fault>,
    /// Describe the machine with this TOML file instead of discovering its GPUs through NVML
    /// (hosts without the NVIDIA driver; `docs/agent.md` shows the format). It is read again on
    /// SIGHUP and every `--inventory-interval-seconds`.
    #[arg(long, env = "COMPUTE_AGENT_INVENTORY", global = true)]
    pub inventory: Option<PathBuf>,
    /// Seconds between two reads of the machine (GPUs, health, resources); a change is
    /// reported at once.
    #[arg(
        long,
        env = "COMPUTE_AGENT_INVENTORY_INTERVAL_SECONDS",
        default_value_t = 60,
        global = true
    )]
    pub inventory_interval_seconds: u64,
}

/// What to do, besides running (the default).
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Joins the fleet with a one-time token (`createNodeJoinToken`): sends this machine's
    /// inventory, keeps the node id and credential it receives in the state directory, then
    /// runs. Run again (or restarted) with the same state directory, it just runs.
    Join {
        /// The join token's secret (`cjt_…`), as `createNodeJoinToken` showed it.
        #[arg(long, env = "COMPUTE_AGENT_JOIN_TOKEN", hide_env_values = true)]
        token: String,
        /// The pool this machine is meant for: the join is refused when the token is another
        /// pool's.
        #[arg(long, env = "COMPUTE_AGENT_POOL")]
        pool: Option<String>,
    },
    /// Prints what this machine has (hostname, vCPU, memory, disk, GPUs and their health) as
    /// JSON, and exits.
    Inventory,
}

fn parse_run_as(text: &str) -> Result<(u32, u32), String> {
    let (u, g) = text.split_once(':').unwrap_or((text, text));
    Ok((
        u.parse()
            .map_err(|_| format!("{u} is not a numeric user id"))?,
        g.parse()
            .map_err(|_| format!("{g} is not a numeric group id"))?,
    ))
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_owned).collect()
}

/// Makes the state directory (mode 0711) and checks it can be written; a message naming the
/// path when it cannot.
fn prepare_state_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create the state directory {}: {e}", dir.display()))?;
    // Crossable, not listable: `--run-as` workloads reach their own `work/<instance>` only.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).map_err(|e| {
        format!(
            "cannot set the mode of the state directory {}: {e}",
            dir.display()
        )
    })?;
    let probe = dir.join(".write-check");
    std::fs::write(&probe, b"ok")
        .map_err(|e| format!("the state directory {} is not writable: {e}", dir.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// The agent's `/metrics` and `/healthz`.
async fn serve_ops(listener: tokio::net::TcpListener, agent: Agent) {
    use axum::routing::get;
    let health = agent.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let agent = agent.clone();
                async move { crate::ops::metrics(&agent) }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let agent = health.clone();
                async move { crate::ops::health(&agent) }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        error!(error = %e, "the metrics server stopped");
    }
}

/// Runs the agent until SIGTERM or SIGINT (or prints the inventory, or joins first).
pub async fn main() -> ExitCode {
    let args = Args::parse();
    let format = if args.log_format == "json" {
        compute_telemetry::LogFormat::Json
    } else {
        compute_telemetry::LogFormat::Pretty
    };
    // Only the daemon itself traces; `inventory` and `join` are short commands.
    let telemetry = if args.command.is_none() {
        compute_telemetry::init("compute-agent", format, "info")
    } else {
        compute_telemetry::init_logs(format, "info");
        Ok(compute_telemetry::Telemetry::off())
    };
    let telemetry = match telemetry {
        Ok(t) => t,
        Err(e) => {
            eprintln!("compute-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let outcome = match &args.command {
        Some(Command::Inventory) => print_inventory(&args),
        Some(Command::Join { token, pool }) => {
            let (token, pool) = (token.clone(), pool.clone());
            match join(&args, &token, pool).await {
                Ok(()) => run(args).await,
                Err(e) => Err(e),
            }
        }
        None => run(args).await,
    };
    telemetry.shutdown().await;
    match outcome {
        Ok(code) => code,
        Err(Refusal { message, code }) => {
            error!("{message}");
            eprintln!("compute-agent: {message}");
            ExitCode::from(code)
        }
    }
}

/// Why the agent stops at start: the message, and the exit code (2: configuration or state
/// directory; 3: the control plane refused).
pub struct Refusal {
    message: String,
    code: u8,
}

impl From<String> for Refusal {
    fn from(message: String) -> Refusal {
        Refusal { message, code: 2 }
    }
}

impl From<&str> for Refusal {
    fn from(message: &str) -> Refusal {
        Refusal::from(message.to_owned())
    }
}

fn daemon_version() -> String {
    format!("compute-agent/{}", env!("CARGO_PKG_VERSION"))
}

/// Where the machine is read from: `--inventory` or NVML (with `nvidia-smi` for MIG), the
/// state directory's file system as the disk.
#[derive(Debug, Clone)]
struct Machine {
    file: Option<PathBuf>,
    nvidia_smi: PathBuf,
    state_dir: PathBuf,
    every: Duration,
}

impl Machine {
    fn of(args: &Args) -> Machine {
        Machine {
            file: args.inventory.clone(),
            nvidia_smi: args.nvidia_smi.clone(),
            state_dir: args.state_dir.clone(),
            every: Duration::from_secs(args.inventory_interval_seconds.max(1)),
        }
    }

    /// Reads the machine once.
    fn read(&self, xids: &crate::nvml::Xids) -> Result<Discovered, String> {
        let seen = xids.lock().map(|m| m.clone()).unwrap_or_default();
        let disk = if self.state_dir.exists() {
            self.state_dir.clone()
        } else {
            PathBuf::from("/")
        };
        inventory::discover(self.file.as_deref(), &self.nvidia_smi, &disk, &seen)
    }
}

/// `compute-agent inventory`: the machine as JSON on stdout; a host without GPUs says so on
/// stderr and still exits 0.
fn print_inventory(args: &Args) -> Result<ExitCode, Refusal> {
    let found = Machine::of(args).read(&Default::default())?;
    let health: serde_json::Map<String, serde_json::Value> = found
        .health
        .iter()
        .map(|(uuid, h)| {
            (
                uuid.clone(),
                serde_json::json!({ "health": h.health, "reason": h.reason }),
            )
        })
        .collect();
    let mut out = serde_json::to_value(&found.inventory).map_err(|e| e.to_string())?;
    out["health"] = serde_json::Value::Object(health);
    out["source"] = serde_json::Value::String(found.source.clone());
    let text = serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?;
    {
        use std::io::Write;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{text}").map_err(|e| format!("stdout: {e}"))?;
    }
    if found.inventory.gpus.is_empty() {
        eprintln!(
            "compute-agent: {} (give --inventory FILE to describe this machine's GPUs)",
            found.source
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn node_id_file(state: &std::path::Path) -> PathBuf {
    state.join("node-id")
}

fn credential_file(state: &std::path::Path) -> PathBuf {
    state.join("credential")
}

/// Writes `text` to `path` with mode 0600, durably (a temporary file, fsync, rename).
fn write_private(path: &std::path::Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            Ok(f)
        })
        .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    let _ = f.flush();
    std::fs::rename(&tmp, path).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// `compute-agent join`: unless the state directory already holds a node's credential, sends
/// the join and keeps what it gives.
async fn join(args: &Args, token: &str, pool: Option<String>) -> Result<(), Refusal> {
    let url = args
        .url
        .as_deref()
        .ok_or("no gateway: give --url (COMPUTE_AGENT_URL)")?;
    prepare_state_dir(&args.state_dir)?;
    let (id_file, cred_file) = (
        node_id_file(&args.state_dir),
        credential_file(&args.state_dir),
    );
    if let (Ok(node), true) = (std::fs::read_to_string(&id_file), cred_file.exists()) {
        info!(node = %node.trim(), "already joined (the state directory holds a node credential); running");
        return Ok(());
    }
    let machine = Machine::of(args).read(&Default::default())?;
    info!(hostname = %machine.inventory.hostname, gpus = machine.inventory.gpus.len(), source = %machine.source, "joining the fleet");
    let joined = session::join(url, token, pool, &daemon_version(), &machine.inventory)
        .await
        .map_err(|(code, message)| Refusal {
            message: format!("the join was refused ({code}): {message}"),
            code: 3,
        })?;
    // The credential first: a node id without it would make the next start look joined.
    write_private(&cred_file, &joined.credential)?;
    write_private(&id_file, &joined.node_id)?;
    info!(node = %joined.node_id, pool = %joined.pool_id, "joined: the node credential is kept in the state directory");
    Ok(())
}

async fn run(args: Args) -> Result<ExitCode, Refusal> {
    let url = args
        .url
        .clone()
        .ok_or("no gateway: give --url (COMPUTE_AGENT_URL)")?;
    let node_id = match &args.node_id {
        Some(n) => n.clone(),
        None => std::fs::read_to_string(node_id_file(&args.state_dir))
            .map(|s| s.trim().to_owned())
            .map_err(|_| {
                "no node id: give --node-id (COMPUTE_AGENT_NODE_ID), or join first (compute-agent join --token …)"
            })?,
    };
    let token = match (&args.token, &args.token_file) {
        (Some(t), _) => Token::Literal(t.clone()),
        (None, Some(f)) => Token::File(f.clone()),
        (None, None) if credential_file(&args.state_dir).exists() => {
            Token::File(credential_file(&args.state_dir))
        }
        (None, None) => {
            return Err(
                "no node credential: give --token or --token-file (COMPUTE_AGENT_TOKEN, COMPUTE_AGENT_TOKEN_FILE), or join first"
                    .into(),
            );
        }
    };
    if !(args.stop_grace_seconds.is_finite() && (0.0..=3600.0).contains(&args.stop_grace_seconds)) {
        return Err("--stop-grace-seconds is 0 to 3600".into());
    }
    if !(1..=31_536_000).contains(&args.keep_ended_seconds) {
        return Err("--keep-ended-seconds is 1 to 31536000".into());
    }
    prepare_state_dir(&args.state_dir)?;
    let journal = Journal::open(&args.state_dir).map_err(|e| format!("the journal: {e}"))?;
    info!(journal = %journal.id(), path = %journal.path().display(), runtime = args.runtime.as_str(), node = %node_id, "compute-agent starting");
    let runtime = Runtime {
        kind: args.runtime,
        state_dir: args.state_dir.clone(),
        run_as: args.run_as,
        podman: args.podman.clone(),
        podman_global_args: words(&args.podman_global_args),
        podman_run_args: words(&args.podman_run_args),
        cdi_dirs: args.cdi_dirs.clone(),
    };
    let settings = Settings {
        default_grace: Duration::from_secs_f64(args.stop_grace_seconds),
        nvidia_smi: args.nvidia_smi.clone(),
        fault: args.fault,
    };
    let metrics = Arc::new(Metrics::new());
    let stale = runtime.remove_stale_env_files();
    if stale > 0 {
        warn!(
            files = stale,
            "removed env files that a podman run interrupted by the agent's end left behind"
        );
    }
    let (agent, outgoing) = Agent::new(journal, runtime, settings, metrics);
    tokio::spawn(clean_ended(
        agent.clone(),
        Duration::from_secs(args.keep_ended_seconds),
    ));
    // What the machine has, read now (a broken inventory file stops the start) and again on
    // SIGHUP, every interval, and after each XID error NVML reports.
    let xids: crate::nvml::Xids = Default::default();
    let source = Machine::of(&args);
    let machine = source.read(&xids)?;
    info!(hostname = %machine.inventory.hostname, gpus = machine.inventory.gpus.len(), source = %machine.source, "machine read");
    agent.set_machine(machine);
    let reread = Arc::new(tokio::sync::Notify::new());
    if args.inventory.is_none() {
        let notify = reread.clone();
        crate::nvml::watch_xids(xids.clone(), move || notify.notify_one());
    }
    tokio::spawn(watch_machine(agent.clone(), source, xids, reread));
    let adopted = agent
        .adopt()
        .await
        .map_err(|e| format!("the journal: {e}"))?;
    info!(adopted, "workloads of earlier runs followed");
    if args.listen != "off" {
        let addr: SocketAddr = args
            .listen
            .parse()
            .map_err(|_| format!("--listen {} is not host:port or off", args.listen))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let bound = listener.local_addr().map_err(|e| e.to_string())?;
        let _ = std::fs::write(args.state_dir.join("listen-address"), bound.to_string());
        info!(%bound, "serving /metrics and /healthz");
        tokio::spawn(serve_ops(listener, agent.clone()));
    }
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    error!(error = %e, "cannot listen for SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: stopping (workloads keep running)"),
            _ = tokio::signal::ctrl_c() => info!("SIGINT: stopping (workloads keep running)"),
        }
        let _ = stop_tx.send(true);
    });
    let identity = Identity {
        url,
        node_id,
        token,
        daemon_version: daemon_version(),
    };
    Ok(match session::run(agent, identity, outgoing, stop).await {
        Ending::Stopped => ExitCode::SUCCESS,
        Ending::Refused(closed) => {
            eprintln!(
                "compute-agent: the gateway refused this node ({}: {})",
                closed.code, closed.reason
            );
            ExitCode::from(3)
        }
    })
}

/// Removes what ended workloads left (`Agent::clean`) at start and then every half of `keep`
/// (at least a second, at most an hour).
async fn clean_ended(agent: Agent, keep: Duration) {
    let every = (keep / 2).clamp(Duration::from_secs(1), Duration::from_secs(3600));
    loop {
        let removed = agent.clean(keep).await;
        if removed > 0 {
            info!(
                workloads = removed,
                keep_s = keep.as_secs(),
                "removed ended workloads past their keep time"
            );
        }
        tokio::time::sleep(every).await;
    }
}

/// Reads the machine again on SIGHUP, every `--inventory-interval-seconds`, and when NVML
/// reported an XID error; the agent sends what changed.
async fn watch_machine(
    agent: Agent,
    source: Machine,
    xids: crate::nvml::Xids,
    reread: Arc<tokio::sync::Notify>,
) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            error!(error = %e, "cannot listen for SIGHUP; the machine is read on the interval only");
            None
        }
    };
    loop {
        tokio::select! {
            () = tokio::time::sleep(source.every) => {}
            () = reread.notified() => {}
            Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                info!("SIGHUP: reading the machine again");
            }
        }
        let (m, x) = (source.clone(), xids.clone());
        match tokio::task::spawn_blocking(move || m.read(&x)).await {
            Ok(Ok(m)) => {
                if agent.set_machine(m) {
                    info!("the machine changed; reported");
                }
            }
            Ok(Err(e)) => error!(error = %e, "cannot read the machine; the last reading stands"),
            Err(e) => error!(error = %e, "the machine reader failed"),
        }
    }
}
