//! The `compute-worker` command line.

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use compute_domain::db::{Db, PoolSettings};

use crate::{Options, Role};

/// compute-worker: runs the reconcilers and webhook delivery under leases.
#[derive(Debug, Parser)]
#[command(name = "compute-worker", version)]
pub struct Args {
    /// Which work to run: reconcile (work queue, resync, pruning), outbox (webhooks), dispatch
    /// (commands to node daemons) or all.
    #[arg(long, default_value = "all", value_parser = parse_role)]
    pub role: Role,
    /// PostgreSQL URL (the same database as the API's).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Connections of the database pool.
    #[arg(long, env = "COMPUTE_DB_MAX_CONNECTIONS", default_value_t = 8)]
    pub db_max_connections: u32,
    /// DATABASE_URL is a transaction pooler (PgBouncer 1.21 or later with `pool_mode =
    /// transaction` and `max_prepared_statements` above 0): no startup options are sent; set
    /// `statement_timeout` on the role instead. The workers keep no session state (leases are
    /// rows, locks are transactions'), so nothing else changes.
    #[arg(long, env = "COMPUTE_DB_POOLED")]
    pub db_pooled: bool,
    /// Address of the worker's own `/healthz` and `/metrics`.
    #[arg(long, env = "COMPUTE_WORKER_LISTEN", default_value = "127.0.0.1:9091")]
    pub listen: SocketAddr,
    /// Seconds between two resync passes of the reservation reconciler.
    #[arg(long, env = "COMPUTE_RESYNC_EVERY", default_value_t = 60.0)]
    pub resync_seconds: f64,
    /// The work-queue kinds this process runs (comma-separated); `noop` is for benchmarks.
    #[arg(
        long,
        env = "COMPUTE_QUEUE_KINDS",
        default_value = "reservation,pool_capacity,instance"
    )]
    pub queue_kinds: String,
    /// Log format: pretty or json.
    #[arg(long, env = "COMPUTE_LOG_FORMAT", default_value = "pretty")]
    pub log_format: String,
    /// Let webhooks reach private, loopback and link-local addresses (on-premises receivers).
    /// Without it, a sink whose host is or resolves to such an address fails with
    /// `refused: the target is not a public address`.
    #[arg(long, env = "COMPUTE_WEBHOOKS_ALLOW_PRIVATE")]
    pub webhooks_allow_private: bool,
    /// The key sink secrets are sealed with (64 hex digits): the same as the API's. Without it,
    /// only secrets stored unsealed can be delivered with.
    #[arg(long, env = "COMPUTE_SECRETS_KEY", hide_env_values = true)]
    pub secrets_key: Option<String>,
    /// Seconds between two passes of the usage meter (closing usage windows for billing).
    #[arg(long, env = "COMPUTE_USAGE_EVERY", default_value_t = 10.0)]
    pub usage_every_seconds: f64,
    /// Sets the length of the usage windows opened from now on (60 to 86400 s; the meter keeps
    /// the length it has when not given; the default is 3600). Give every worker the same value.
    #[arg(long, env = "COMPUTE_USAGE_WINDOW_SECONDS")]
    pub usage_window_seconds: Option<i32>,
    /// Former keys, comma-separated, still accepted during a rotation.
    #[arg(long, env = "COMPUTE_SECRETS_OLD_KEYS", hide_env_values = true)]
    pub secrets_old_keys: Option<String>,
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s)
        .ok_or_else(|| format!("unknown role `{s}`: use reconcile, outbox, dispatch or all"))
}

/// This process's name in the leases it takes: `worker:<host>:<pid>`.
pub fn owner() -> String {
    format!(
        "worker:{}:{}",
        compute_domain::process::host_name(),
        std::process::id()
    )
}

/// The binary's `main`.
pub async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    // Colours only for a person at a terminal, as `compute-api` does.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = if args.log_format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    let db = match Db::connect(
        &args.database_url,
        &PoolSettings {
            max_connections: args.db_max_connections.max(2),
            statement_timeout: if args.db_pooled {
                None
            } else {
                PoolSettings::default().statement_timeout
            },
            ..PoolSettings::default()
        },
    )
    .await
    {
        Ok(db) => db,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "compute-worker: cannot connect: {e}");
            return ExitCode::FAILURE;
        }
    };
    let db = match compute_domain::secrets::Keyring::from_config(
        args.secrets_key.as_deref(),
        args.secrets_old_keys.as_deref(),
    ) {
        Ok(Some(k)) => {
            tracing::info!(
                key = k.current_id(),
                "sink secrets open with the configured keys"
            );
            db.with_keyring(Some(k))
        }
        Ok(None) => {
            tracing::warn!(
                "no secrets key (COMPUTE_SECRETS_KEY): sinks whose secrets are sealed cannot be \
                 delivered to"
            );
            db
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "compute-worker: {e}");
            return ExitCode::from(2);
        }
    };
    match db.migration_status().await {
        Ok(s) if s.is_current() => {}
        Ok(s) => {
            let _ = writeln!(
                std::io::stderr(),
                "compute-worker: the database has {} of {} migrations; run `compute-api migrate` first",
                s.applied,
                s.expected
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "compute-worker: {e}");
            return ExitCode::FAILURE;
        }
    }
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "compute-worker: cannot listen on {} for /healthz and /metrics: {e} (set --listen)",
                args.listen
            );
            return ExitCode::FAILURE;
        }
    };
    let mut kinds = Vec::new();
    for k in args
        .queue_kinds
        .split(',')
        .map(str::trim)
        .filter(|k| !k.is_empty())
    {
        match compute_domain::work_queue::WorkKind::parse(k) {
            Some(known) => kinds.push(known),
            None => {
                let known: Vec<&str> = crate::queue::ALL_KINDS.iter().map(|k| k.as_str()).collect();
                let _ = writeln!(
                    std::io::stderr(),
                    "compute-worker: unknown work kind `{k}` (known: {})",
                    known.join(", ")
                );
                return ExitCode::from(2);
            }
        }
    }
    let registry = compute_domain::metrics::Registry::default();
    db.register_metrics(&registry);
    let options = Options {
        kinds,
        role: args.role,
        owner: owner(),
        resync_every: Duration::from_secs_f64(args.resync_seconds.max(1.0)),
        queue_idle: Duration::from_millis(200),
        metrics: Some(registry.clone()),
        webhooks_allow_private: args.webhooks_allow_private,
        usage_every: Duration::from_secs_f64(args.usage_every_seconds.max(0.05)),
        usage_window_seconds: args.usage_window_seconds,
    };
    tracing::info!(listen = %args.listen, "worker /healthz and /metrics");
    let server = axum::serve(listener, crate::http::router(registry));
    tokio::spawn(async move {
        let _ = server.await;
    });
    crate::run(db, options, compute_domain::process::stop_signal()).await;
    ExitCode::SUCCESS
}
