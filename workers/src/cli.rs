//! The `compute-worker` command line.

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use compute_domain::db::{Db, PoolSettings};
use compute_domain::process::{LogFormat, Secret};
use compute_domain::work_queue::WorkKind;

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
    pub database_url: Secret,
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
    /// Seconds between two passes of the reservation reconciler (liveness, activation, expiry,
    /// retries), 1 to 86,400; a value above 5 runs as 5 (with a warning at start), because the
    /// pass also renews its lease every 5 s.
    #[arg(long, env = "COMPUTE_RESYNC_EVERY", default_value = "5", value_parser = seconds(1.0, 86_400.0))]
    pub resync_seconds: Duration,
    /// The work-queue kinds this process runs (comma-separated); `noop` is for benchmarks.
    #[arg(
        long,
        env = "COMPUTE_QUEUE_KINDS",
        default_value = "reservation,pool_capacity,instance",
        value_delimiter = ',',
        value_parser = parse_kind
    )]
    pub queue_kinds: Vec<WorkKind>,
    /// Log format: pretty (for a person) or json (one object a line, for a log shipper).
    #[arg(long, env = "COMPUTE_LOG_FORMAT", default_value = "pretty")]
    pub log_format: LogFormat,
    /// Let webhooks reach private, loopback and link-local addresses (on-premises receivers).
    /// Without it, a sink whose host is or resolves to such an address fails with
    /// `refused: the target is not a public address`.
    #[arg(long, env = "COMPUTE_WEBHOOKS_ALLOW_PRIVATE")]
    pub webhooks_allow_private: bool,
    /// The key sink secrets are sealed with (64 hex digits): the same as the API's. Without it,
    /// only secrets stored unsealed can be delivered with.
    #[arg(long, env = "COMPUTE_SECRETS_KEY", hide_env_values = true)]
    pub secrets_key: Option<Secret>,
    /// Seconds between two passes of the usage meter (closing usage windows for billing; 0.05
    /// to 3600).
    #[arg(long, env = "COMPUTE_USAGE_EVERY", default_value = "10", value_parser = seconds(0.05, 3_600.0))]
    pub usage_every_seconds: Duration,
    /// Sets the length of the usage windows opened from now on (60 to 86400 s; the meter keeps
    /// the length it has when not given; the default is 3600). Give every worker the same value.
    #[arg(long, env = "COMPUTE_USAGE_WINDOW_SECONDS", value_parser = clap::value_parser!(i32).range(60..=86_400))]
    pub usage_window_seconds: Option<i32>,
    /// Former keys, comma-separated, still accepted during a rotation.
    #[arg(long, env = "COMPUTE_SECRETS_OLD_KEYS", hide_env_values = true)]
    pub secrets_old_keys: Option<Secret>,
}

/// A parser of a duration given in seconds, from `min` to `max`.
fn seconds(min: f64, max: f64) -> impl Fn(&str) -> Result<Duration, String> + Clone {
    move |s| {
        let v: f64 = s
            .parse()
            .map_err(|_| format!("`{s}` is not a number of seconds"))?;
        if (min..=max).contains(&v) {
            Ok(Duration::from_secs_f64(v))
        } else {
            Err(format!("{min} to {max} seconds"))
        }
    }
}

fn parse_kind(s: &str) -> Result<WorkKind, String> {
    WorkKind::parse(s.trim()).ok_or_else(|| {
        let known: Vec<&str> = crate::queue::ALL_KINDS.iter().map(|k| k.as_str()).collect();
        format!("unknown work kind `{s}` (known: {})", known.join(", "))
    })
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
    let telemetry = match compute_domain::process::init_telemetry("compute-worker", args.log_format)
    {
        Ok(t) => t,
        Err(e) => {
            eprintln!("compute-worker: {e}");
            return ExitCode::FAILURE;
        }
    };
    let db = match Db::connect(
        args.database_url.expose(),
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
        args.secrets_key.as_ref().map(Secret::expose),
        args.secrets_old_keys.as_ref().map(Secret::expose),
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
    let clock = match compute_domain::clock::Clock::anchored(&db).await {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "compute-worker: cannot read compute_now(): {e}"
            );
            return ExitCode::FAILURE;
        }
    };
    if args.resync_seconds > compute_domain::leases::RENEW_EVERY {
        tracing::warn!(
            resync_seconds = args.resync_seconds.as_secs_f64(),
            "--resync-seconds above 5 runs as 5: the reconciler's pass also renews its lease every 5 s"
        );
    }
    let registry = compute_domain::metrics::Registry::default();
    db.register_metrics(&registry);
    let options = Options {
        kinds: args.queue_kinds,
        role: args.role,
        owner: owner(),
        // `Reconciler::run` passes at most every `RENEW_EVERY`, whatever this says (warned above).
        resync_every: args.resync_seconds,
        queue_idle: Duration::from_millis(200),
        metrics: Some(registry.clone()),
        webhooks_allow_private: args.webhooks_allow_private,
        usage_every: args.usage_every_seconds,
        usage_window_seconds: args.usage_window_seconds,
        clock: Some(clock.clone()),
        listen_pokes: !args.db_pooled,
    };
    tracing::info!(listen = %args.listen, "worker /healthz and /metrics");
    let server = axum::serve(listener, crate::http::router(registry, clock));
    tokio::spawn(async move {
        let _ = server.await;
    });
    crate::run(db, options, compute_domain::process::stop_signal()).await;
    telemetry.shutdown().await;
    ExitCode::SUCCESS
}
