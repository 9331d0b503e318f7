use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use compute_domain::db::{Db, PoolSettings};
use compute_workers::{Reconciler, Role};

/// compute-worker: runs reconcilers (and, later, outbox delivery) under leases.
#[derive(Debug, Parser)]
#[command(name = "compute-worker", version)]
struct Args {
    /// Which work to run: reconcile, outbox or all.
    #[arg(long, default_value = "reconcile", value_parser = parse_role)]
    role: Role,
    /// PostgreSQL URL (the same database as the API's).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Seconds between reconciler passes.
    #[arg(long, env = "COMPUTE_RECONCILE_EVERY", default_value_t = 1.0)]
    every_seconds: f64,
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s).ok_or_else(|| format!("unknown role `{s}`: use reconcile, outbox or all"))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    if args.role != Role::Reconcile {
        let _ = writeln!(
            std::io::stderr(),
            "compute-worker: role {:?} is not built yet (outbox delivery arrives with the workers issue); run --role reconcile",
            args.role
        );
        return ExitCode::from(2);
    }
    let db = match Db::connect(
        &args.database_url,
        &PoolSettings {
            max_connections: 4,
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
    let owner = format!("worker:{}:{}", hostname(), std::process::id());
    Reconciler::new(db, owner)
        .run(
            Duration::from_secs_f64(args.every_seconds.max(0.1)),
            stop_signal(),
        )
        .await;
    ExitCode::SUCCESS
}

/// SIGINT or SIGTERM: the reconciler then releases its lease, so another worker takes over at
/// once instead of after the lease's TTL.
async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}
