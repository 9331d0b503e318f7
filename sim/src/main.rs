//! `compute-sim`: runs simulated node daemons against a gateway until Ctrl-C.
//!
//! ```sh
//! compute-sim --url ws://127.0.0.1:8080/agent --nodes-file nodes.txt
//! ```
//! where each line of `nodes.txt` is `<node id> <node token>` (tokens from
//! `compute-api token --role node --node <id>`). Every 5 s it logs how many sessions are open.
//! `--partition-fraction 0.1 --partition-every-seconds 60 --partition-seconds 30` cuts a tenth of
//! the daemons off (no close frame) for 30 s every minute; running it again with another
//! `--journal-prefix` restarts the fleet as wiped daemons (new journal ids).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use clap::Parser;
use compute_sim::{Behaviour, DaemonConfig, run_daemon};

#[derive(Debug, Parser)]
#[command(
    name = "compute-sim",
    version,
    about = "Simulated node daemons for a Better Compute gateway"
)]
struct Args {
    /// The gateway's agent endpoint.
    #[arg(long, default_value = "ws://127.0.0.1:8080/agent")]
    url: String,
    /// Lines of `<node id> <token>`.
    #[arg(long)]
    nodes_file: std::path::PathBuf,
    /// The daemons' version.
    #[arg(long, default_value = "compute-sim/0.1")]
    daemon_version: String,
    /// The journal id each daemon presents is `<prefix>-<node id>`; change the prefix to
    /// simulate wiped daemons.
    #[arg(long, default_value = "journal")]
    journal_prefix: String,
    /// Heartbeat period in seconds (the gateway's when not set).
    #[arg(long)]
    heartbeat_seconds: Option<f64>,
    /// Partitions: the share of daemons (0 to 1) cut off at each draw, without a close frame.
    #[arg(long, default_value_t = 0.0)]
    partition_fraction: f64,
    /// Seconds between two partition draws.
    #[arg(long, default_value_t = 60.0)]
    partition_every_seconds: f64,
    /// Seconds a partitioned daemon stays away.
    #[arg(long, default_value_t = 30.0)]
    partition_seconds: f64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let telemetry = match compute_telemetry::init(
        "compute-sim",
        compute_telemetry::LogFormat::Pretty,
        "info",
    ) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("compute-sim: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let text = match std::fs::read_to_string(&args.nodes_file) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!("cannot read {}: {e}", args.nodes_file.display());
            return std::process::ExitCode::FAILURE;
        }
    };
    let open = Arc::new(AtomicI64::new(0));
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut daemons = tokio::task::JoinSet::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let Some((node, token)) = line.split_once(char::is_whitespace) else {
            tracing::error!("a line is not `<node id> <token>`: {line:.40}");
            return std::process::ExitCode::FAILURE;
        };
        let config = DaemonConfig {
            url: args.url.clone(),
            token: token.trim().to_owned(),
            node_id: node.to_owned(),
            daemon_version: args.daemon_version.clone(),
            journal_id: format!("{}-{node}", args.journal_prefix),
            observed_generation: 0,
        };
        let behaviour = Behaviour {
            heartbeat: args.heartbeat_seconds.map(Duration::from_secs_f64),
            partition: (args.partition_fraction > 0.0).then(|| compute_sim::Partition {
                every: Duration::from_secs_f64(args.partition_every_seconds.max(0.1)),
                fraction: args.partition_fraction.min(1.0),
                lasts: Duration::from_secs_f64(args.partition_seconds.max(0.0)),
            }),
            ..Behaviour::default()
        };
        let (open, stop) = (open.clone(), stop.clone());
        daemons.spawn(run_daemon(
            config,
            behaviour,
            stop,
            move |node, event| match event {
                Ok(w) => {
                    open.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(node, epoch = w.session_epoch, "session opened");
                }
                Err(c) => {
                    open.fetch_sub(1, Ordering::Relaxed);
                    tracing::info!(node, code = c.code, reason = %c.reason, "session ended");
                }
            },
        ));
    }
    let total = daemons.len();
    let report = {
        let open = open.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                tracing::info!(
                    daemons = total,
                    open = open.load(Ordering::Relaxed),
                    "sessions"
                );
            }
        })
    };
    let _ = tokio::signal::ctrl_c().await;
    let _ = stop_tx.send(true);
    while daemons.join_next().await.is_some() {}
    report.abort();
    telemetry.shutdown().await;
    std::process::ExitCode::SUCCESS
}
