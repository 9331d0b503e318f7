//! `compute-agent`'s command line: every flag has an environment fallback
//! (`COMPUTE_AGENT_…`), so a systemd unit can set them in an environment file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tracing::{error, info};

use crate::agent::{Agent, Fault, Settings};
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
    /// The gateway's agent endpoint, `ws://host:port/agent` (any compute-api process).
    #[arg(long, env = "COMPUTE_AGENT_URL")]
    pub url: String,
    /// This machine's node id (`node_…`), as registered in the control plane.
    #[arg(long, env = "COMPUTE_AGENT_NODE_ID")]
    pub node_id: String,
    /// The node's credential: a JWT with the role `node` for this node.
    #[arg(
        long,
        env = "COMPUTE_AGENT_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,
    /// A file holding the node's credential (read again before every connection).
    #[arg(long, env = "COMPUTE_AGENT_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// The state directory: the journal (`journal.sqlite3`), workload logs (`logs/`) and
    /// working directories (`work/`). An emptied directory is a new journal.
    #[arg(
        long,
        env = "COMPUTE_AGENT_STATE_DIR",
        default_value = "/var/lib/compute-agent"
    )]
    pub state_dir: PathBuf,
    /// How workloads run: `process` (a child on the host; the image is recorded, not run) or
    /// `podman` (a container of the image).
    #[arg(
        long,
        env = "COMPUTE_AGENT_RUNTIME",
        value_enum,
        default_value = "process"
    )]
    pub runtime: runtime::Kind,
    /// Run workloads of the process runtime as this user and group (`UID:GID`); the agent's
    /// own user when not set.
    #[arg(long, env = "COMPUTE_AGENT_RUN_AS", value_parser = parse_run_as)]
    pub run_as: Option<(u32, u32)>,
    /// The podman program.
    #[arg(long, env = "COMPUTE_AGENT_PODMAN", default_value = "podman")]
    pub podman: PathBuf,
    /// Arguments of podman before `run`, split on whitespace (for example
    /// `--runtime runc --cgroup-manager=cgroupfs` where the default OCI runtime fails).
    #[arg(
        long,
        env = "COMPUTE_AGENT_PODMAN_GLOBAL_ARGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    pub podman_global_args: String,
    /// Arguments of `podman run` before the image, split on whitespace (for example
    /// `--network none --ulimit nofile=1024:1024 --pull=never`).
    #[arg(
        long,
        env = "COMPUTE_AGENT_PODMAN_RUN_ARGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    pub podman_run_args: String,
    /// Directories of CDI specs: when one names `nvidia.com/gpu`, containers get their GPUs
    /// as CDI devices.
    #[arg(
        long,
        env = "COMPUTE_AGENT_CDI_DIRS",
        value_delimiter = ',',
        default_value = "/etc/cdi,/var/run/cdi"
    )]
    pub cdi_dirs: Vec<PathBuf>,
    /// NVIDIA's `nvidia-smi`, for `reset_gpu` and `set_mig_layout` (they fail `UNSUPPORTED`
    /// where it is missing).
    #[arg(long, env = "COMPUTE_AGENT_NVIDIA_SMI", default_value = "nvidia-smi")]
    pub nvidia_smi: PathBuf,
    /// Seconds between SIGTERM and SIGKILL when a stop gives no `graceSeconds`.
    #[arg(long, env = "COMPUTE_AGENT_STOP_GRACE_SECONDS", default_value_t = 30.0)]
    pub stop_grace_seconds: f64,
    /// Where to serve `/metrics` and `/healthz` (`off` for nowhere). The address bound is
    /// also written to `<state dir>/listen-address`.
    #[arg(long, env = "COMPUTE_AGENT_LISTEN", default_value = "127.0.0.1:9471")]
    pub listen: String,
    /// Log lines as `text` or `json` (the level from `RUST_LOG`, `info` by default).
    #[arg(long, env = "COMPUTE_AGENT_LOG_FORMAT", default_value = "text")]
    pub log_format: String,
    /// For crash tests only: kill this agent with SIGKILL at a step of a command
    /// (`after-ack`, `after-start-recorded`, `after-workload-started`,
    /// `after-outcome-recorded`, optionally `:<kind>`).
    #[arg(long, env = "COMPUTE_AGENT_FAULT", value_parser = Fault::parse)]
    pub fault: Option<Fault>,
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

fn init_logs(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false);
    let _ = if format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
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

/// Runs the agent until SIGTERM or SIGINT.
pub async fn main() -> ExitCode {
    let args = Args::parse();
    init_logs(&args.log_format);
    match run(args).await {
        Ok(code) => code,
        Err(message) => {
            error!("{message}");
            eprintln!("compute-agent: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, String> {
    let token = match (&args.token, &args.token_file) {
        (Some(t), _) => Token::Literal(t.clone()),
        (None, Some(f)) => Token::File(f.clone()),
        (None, None) => {
            return Err(
                "no node credential: give --token or --token-file (COMPUTE_AGENT_TOKEN, COMPUTE_AGENT_TOKEN_FILE)"
                    .into(),
            );
        }
    };
    if !(args.stop_grace_seconds.is_finite() && (0.0..=3600.0).contains(&args.stop_grace_seconds)) {
        return Err("--stop-grace-seconds is 0 to 3600".into());
    }
    prepare_state_dir(&args.state_dir)?;
    let journal = Journal::open(&args.state_dir).map_err(|e| format!("the journal: {e}"))?;
    info!(journal = %journal.id(), path = %journal.path().display(), runtime = args.runtime.as_str(), node = %args.node_id, "compute-agent starting");
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
    let (agent, outgoing) = Agent::new(journal, runtime, settings, metrics);
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
        url: args.url.clone(),
        node_id: args.node_id.clone(),
        token,
        daemon_version: format!("compute-agent/{}", env!("CARGO_PKG_VERSION")),
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
