//! `compute-api dev`: the whole system in one process (the API, every worker role, a simulated
//! daemon for each demonstration node) on the embedded database, with a development token; and
//! the embedded database itself, which `serve`, `migrate` and `reseal-secrets` start without
//! `DATABASE_URL`. Only this module uses `compute-workers`, `compute-sim` and
//! `compute-embedded-pg` (the `dev` feature).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use compute_domain::db::{Db, PoolSettings};
use compute_domain::secrets::Keyring;
use compute_domain::{Error, Result};
use compute_embedded_pg::{EmbeddedOptions, EmbeddedPostgres};
use tracing::info;

use super::{
    DatabaseArgs, EMBEDDED_DATABASE, LogFormat, bind, cors_origins, data_dir_key, open_database,
    shutdown_signal,
};
use crate::auth::{self, Role, Secret, Verifier};
use crate::server::Server;

/// The embedded PostgreSQL server, which only a build with the `dev` feature can start.
pub type Embedded = EmbeddedPostgres;

/// Starts (or reuses) the durable embedded server in `data_dir` and connects to its database.
pub(super) async fn embedded(
    data_dir: &Path,
    settings: &PoolSettings,
) -> Result<(Db, EmbeddedPostgres)> {
    let pg = EmbeddedPostgres::start(EmbeddedOptions::durable(data_dir))
        .await
        .map_err(Error::internal)?;
    pg.ensure_database(EMBEDDED_DATABASE)
        .await
        .map_err(Error::internal)?;
    let db = Db::connect(&pg.url(EMBEDDED_DATABASE), settings).await?;
    Ok((db, pg))
}

#[derive(Debug, Args)]
pub struct DevArgs {
    /// Address to listen on.
    #[arg(long, env = "COMPUTE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Where the embedded database and the development key live.
    #[arg(long, env = "COMPUTE_DATA_DIR", default_value = ".compute")]
    pub data_dir: PathBuf,
    /// Log format: pretty (for a person) or json (one object a line, for a log shipper).
    #[arg(long, env = "COMPUTE_LOG_FORMAT", default_value = "pretty")]
    pub log_format: LogFormat,
}

/// `compute-api dev`.
pub async fn dev(args: DevArgs) -> Result<()> {
    // The API, the workers and the simulated daemons of one process: one service, `compute-dev`.
    let telemetry = compute_domain::process::init_telemetry("compute-dev", args.log_format)
        .map_err(|e| Error::bad_input("otel", e))?;
    let started = Instant::now();
    let database = open_database(
        &DatabaseArgs {
            database_url: None,
            data_dir: args.data_dir.clone(),
            db_max_connections: 16,
            db_pooled: false,
            listen_database_url: None,
            log_format: args.log_format,
        },
        16,
    )
    .await?;
    database.db.migrate().await?;
    compute_domain::fleet::demo::seed_if_empty(&database.db).await?;
    let keyring = Keyring::from_config(Some(&data_dir_key(&args.data_dir)?), None)?;
    // `dev` is for trying the system on one machine, receivers included: sinks may name
    // private targets, as its workers may post to them.
    let db = database
        .db
        .clone()
        .with_keyring(keyring)
        .allowing_private_webhooks(true);
    let secret = auth::dev_secret(&args.data_dir, true)?;
    let verifier = Verifier::new(
        auth::KeySource::Hs256(secret.clone()),
        auth::DEV_ISSUER,
        auth::DEV_AUDIENCE,
    )
    .map_err(Error::internal)?;
    let ttl = 30 * 86_400;
    // The development token printed below lives 30 days; `dev` accepts it.
    let verifier = verifier.with_max_lifetime(Duration::from_secs(31 * 86_400));
    let token = auth::mint_hs256(
        &secret,
        &auth::dev_claims(
            "dev@localhost",
            Some("dev"),
            &[Role::Operator, Role::Member],
            ttl,
        ),
    )?;
    let listener = bind(args.listen).await?;
    let addr = listener.local_addr().map_err(Error::internal)?;
    // One registry for the process: the API's metrics, the workers' and the transactions'.
    let registry = compute_domain::metrics::Registry::default();
    db.register_metrics(&registry);
    // `dev` serves pages of its own origin, which browsers may call it from.
    let own = [
        format!("http://{addr}"),
        format!("http://localhost:{}", addr.port()),
    ];
    let server = Server::with_registry(
        db.clone(),
        verifier,
        crate::tailer::StreamConfig::default(),
        registry.clone(),
    )
    .await?
    .with_frontends(
        crate::persisted::Persisted::automatic(),
        cors_origins(&own)?,
    )
    .with_dev_token(&token);
    let pg = database.embedded.as_ref();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "\nBetter Compute is running (ready in {:.1} s).\n\
         \n  Console    http://{addr}/   (Sign in: \"Use the development token\")\
         \n  GraphiQL   http://{addr}/graphiql\n  Ready      http://{addr}/readyz\n  Metrics    http://{addr}/metrics\
         \n  Data       {} ({}, port {})\n\
         \nA development token (roles operator and member, tenant \"dev\", valid 30 days).\
         \nIn GraphiQL, open Headers and paste:\n\n  {{\"Authorization\": \"Bearer {token}\"}}\n\
         \nMore tokens: cargo run -p compute-api -- token --role member --tenant acme --sub alice\
         \nPress Ctrl-C to stop.\n",
        started.elapsed().as_secs_f64(),
        pg.map(|p| p.data_dir().display().to_string())
            .unwrap_or_default(),
        pg.map(|p| p.version().to_owned()).unwrap_or_default(),
        pg.map(|p| p.port()).unwrap_or_default(),
    );
    drop(out);
    // Every worker role in-process: the work queue, the resync, pruning and webhook delivery.
    let (stop_workers, workers_stopped) = tokio::sync::oneshot::channel::<()>();
    let reconciler = tokio::spawn(compute_workers::run(
        db.clone(),
        compute_workers::Options {
            role: compute_workers::Role::All,
            kinds: compute_workers::queue::KINDS.to_vec(),
            owner: format!("dev:{}", std::process::id()),
            resync_every: std::time::Duration::from_secs(5),
            queue_idle: std::time::Duration::from_millis(200),
            metrics: Some(registry),
            // `dev` is for trying the system on one machine, receivers included.
            webhooks_allow_private: true,
            usage_every: std::time::Duration::from_secs(5),
            usage_window_seconds: None,
            // The API's clock samples compute_now() for the whole process.
            clock: None,
            listen_pokes: true,
        },
        async move {
            let _ = workers_stopped.await;
        },
    ));
    // A simulated daemon for every demonstration node, so nodes show CONNECTED.
    let (stop_sim, sim_stopped) = tokio::sync::watch::channel(false);
    let simulator = tokio::spawn(dev_simulator(
        db.clone(),
        secret.clone(),
        format!("ws://{addr}/agent"),
        args.data_dir.join(SIM_STOPPED_FILE),
        sim_stopped,
    ));
    let served = server.run(listener, shutdown_signal()).await;
    let _ = stop_sim.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), simulator).await;
    let _ = stop_workers.send(());
    let _ = reconciler.await;
    served.map_err(Error::internal)?;
    drop(database);
    info!("stopped");
    telemetry.shutdown().await;
    Ok(())
}

/// The file in `dev`'s data directory that lists, a host name per line, the demonstration nodes
/// whose simulated daemon should stay stopped (`docs/nodes.md`, "Trying it").
pub const SIM_STOPPED_FILE: &str = "sim-stopped";

/// `dev`'s in-process fleet simulator: a `compute-sim` daemon for each node (up to 100),
/// connected to this process's own `/agent`. Every second it reads `stopped_file`: a daemon
/// whose host is listed says `bye` (its node goes DISCONNECTED, then UNREACHABLE 40 s later);
/// removing the line starts it again.
async fn dev_simulator(
    db: Db,
    secret: Secret,
    url: String,
    stopped_file: std::path::PathBuf,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let first = compute_domain::page::PageArgs {
        after: None,
        before: None,
        limit: 100,
        backward: false,
    };
    let nodes = match compute_domain::fleet::list_nodes(
        &db,
        &compute_domain::fleet::NodeFilter::default(),
        &first,
    )
    .await
    {
        Ok(page) => page.items,
        Err(e) => {
            tracing::warn!(error = %e, "the dev simulator could not list the nodes");
            return;
        }
    };
    let mut running: std::collections::HashMap<String, tokio::sync::watch::Sender<bool>> =
        std::collections::HashMap::new();
    loop {
        let stopped: std::collections::HashSet<String> = std::fs::read_to_string(&stopped_file)
            .unwrap_or_default()
            .lines()
            .map(|l| l.trim().to_owned())
            .filter(|l| !l.is_empty())
            .collect();
        for node in &nodes {
            let wanted = !stopped.contains(&node.hostname);
            match (wanted, running.contains_key(&node.hostname)) {
                (true, false) => {
                    let mut claims = auth::dev_claims(
                        &format!("node:{}", node.id),
                        None,
                        &[Role::Node],
                        30 * 86_400,
                    );
                    claims.node = Some(node.id.to_string());
                    let Ok(token) = auth::mint_hs256(&secret, &claims) else {
                        continue;
                    };
                    let config = compute_sim::DaemonConfig {
                        url: url.clone(),
                        token,
                        node_id: node.id.to_string(),
                        daemon_version: "compute-sim (dev)".into(),
                        journal_id: format!("dev-{}", node.id),
                        observed_generation: node.observed_generation,
                    };
                    let (tx, rx) = tokio::sync::watch::channel(false);
                    tokio::spawn(compute_sim::run_daemon(
                        config,
                        compute_sim::Behaviour::default(),
                        rx,
                        |_, _| {},
                    ));
                    running.insert(node.hostname.clone(), tx);
                }
                (false, true) => {
                    if let Some(tx) = running.remove(&node.hostname) {
                        info!(host = %node.hostname, "dev simulator: daemon stopped");
                        let _ = tx.send(true);
                    }
                }
                _ => {}
            }
        }
        tokio::select! {
            _ = stop.changed() => break,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
    for (_, tx) in running {
        let _ = tx.send(true);
    }
}
