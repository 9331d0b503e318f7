//! What the benchmark binaries share: real `test-api` gateway processes, a free port, a fleet of
//! bare nodes seeded in one statement, daemon configurations, and the one wait.

use std::time::{Duration, Instant};

use compute_api::auth::Role;
use compute_sim::DaemonConfig;

/// A port free now on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a port")
}

/// This package's build of a binary beside the running one (`test-api`, `test-worker`); exits
/// with a hint when it was not built.
pub fn sibling(name: &str) -> std::path::PathBuf {
    let path = std::env::current_exe()
        .expect("own path")
        .with_file_name(name);
    if !path.exists() {
        eprintln!(
            "{} is missing: build with `cargo build --release -p compute-tests`",
            path.display()
        );
        std::process::exit(2);
    }
    path
}

/// A `compute-api serve --gateway-only` process on `port` with gateway id `id`, ready.
pub async fn spawn_gateway(
    binary: &std::path::Path,
    url: &str,
    port: u16,
    id: &str,
) -> tokio::process::Child {
    spawn_api(
        binary,
        &[("DATABASE_URL", url.to_owned())],
        port,
        &["--gateway-only", "--gateway-id", id],
    )
    .await
}

/// A `compute-api serve` process on `port` with the environment `env` (the database's,
/// [`crate::TestDb::process_env`]) and more `serve` arguments, ready; it accepts the tests'
/// tokens.
pub async fn spawn_api(
    binary: &std::path::Path,
    env: &[(&'static str, String)],
    port: u16,
    args: &[&str],
) -> tokio::process::Child {
    let child = tokio::process::Command::new(binary)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--max-connections", "20000"])
        .args(args)
        .envs(env.iter().cloned())
        .env("COMPUTE_JWT_HS256_SECRET", crate::TEST_SECRET)
        .env("COMPUTE_JWT_ISSUER", crate::TEST_ISSUER)
        .env("COMPUTE_JWT_AUDIENCE", crate::TEST_AUDIENCE)
        .env("COMPUTE_SECRETS_KEY", crate::SECRETS_KEY)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start an API process");
    let http = reqwest::Client::new();
    let ready = format!("http://127.0.0.1:{port}/readyz");
    for _ in 0..600 {
        if http
            .get(&ready)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return child;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the API process did not become ready");
}

/// Seeds `n` bare nodes (`node_<g as 32 hex digits>`, g from 1) in one pool; their ids.
pub async fn seed_nodes(db: &compute_domain::db::Db, n: i64) -> Vec<String> {
    sqlx::raw_sql(&format!(
        "INSERT INTO sites (id, name) VALUES ('site_{z}', 'bench');
         INSERT INTO pools (id, site_id, name, kind) VALUES ('pool_{z}', 'site_{z}', 'bench', 'bare_metal');
         INSERT INTO nodes (id, pool_id, hostname)
              SELECT 'node_' || lpad(to_hex(g), 32, '0'), 'pool_{z}', 'bench-' || g FROM generate_series(1, {n}) g;",
        z = "0".repeat(32)
    ))
    .execute(db.pool())
    .await
    .expect("seed the nodes");
    (1..=n).map(|g| format!("node_{g:032x}")).collect()
}

/// The configuration of a simulated daemon of `node` talking to the gateway on `port`.
pub fn daemon(port: u16, node: &str, journal: &str, observed_generation: i64) -> DaemonConfig {
    let mut claims = crate::claims(&format!("node:{node}"), None, &[Role::Node], 3600);
    claims.node = Some(node.to_owned());
    DaemonConfig {
        url: format!("ws://127.0.0.1:{port}/agent"),
        token: crate::mint(claims),
        node_id: node.to_owned(),
        daemon_version: "bench".into(),
        journal_id: journal.to_owned(),
        observed_generation,
    }
}

/// Waits until `done`, at most `limit` (then panics: a benchmark that cannot finish says so);
/// how long it took.
pub async fn until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// Starts a simulated daemon for each of `nodes` (journal `j<n>`, reporting
/// `observed_generation`) against the gateway on `port`; the switch that stops them all, and the
/// count of sessions they opened (reconnections included).
pub fn start_daemons(
    port: u16,
    nodes: &[String],
    observed_generation: i64,
) -> (
    tokio::sync::watch::Sender<bool>,
    std::sync::Arc<std::sync::atomic::AtomicI64>,
) {
    use std::sync::atomic::Ordering;
    let opened = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    for (n, node) in nodes.iter().enumerate() {
        let opened = opened.clone();
        tokio::spawn(compute_sim::run_daemon(
            daemon(port, node, &format!("j{n}"), observed_generation),
            compute_sim::Behaviour::default(),
            stopped.clone(),
            move |_, event| {
                if event.is_ok() {
                    opened.fetch_add(1, Ordering::Relaxed);
                }
            },
        ));
    }
    (stop, opened)
}

/// Builds a GPU fleet through the product's own commands: one site, `pools` bare-metal pools,
/// each with `nodes_per_pool` nodes (`p<pool>-n<node>`) of 256 vCPU, 2 TiB memory, 10 TB disk
/// and `gpus_per_node` whole H100s, registered four at a time. Returns the pools' ids. Shared by
/// the benchmarks and the statement-count test, so they measure the same fleet.
pub async fn gpu_fleet(
    db: &compute_domain::db::Db,
    pools: usize,
    nodes_per_pool: usize,
    gpus_per_node: usize,
) -> Vec<compute_domain::ids::PoolId> {
    use compute_domain::fleet::changes::{self, NewDevice, NewNode, NewPool, NewSite};
    use compute_domain::fleet::model::{GpuUuid, Labels, Layout, PoolKind};
    use futures_util::StreamExt;
    let operator = compute_domain::idempotency::Actor::operator("bench");
    let site = changes::create_site(
        db,
        &operator,
        NewSite {
            name: "fleet".into(),
            region: None,
        },
        None,
    )
    .await
    .expect("site")
    .value;
    let mut ids = Vec::new();
    for p in 0..pools {
        let pool = changes::create_pool(
            db,
            &operator,
            NewPool {
                site_id: site.id.clone(),
                name: format!("pool-{p}"),
                kind: PoolKind::BareMetal,
                lost_after_seconds: None,
                vcpu_ratio: 1.0,
                memory_ratio: 1.0,
                disk_ratio: 1.0,
            },
            None,
        )
        .await
        .expect("pool")
        .value;
        futures_util::stream::iter(0..nodes_per_pool)
            .map(|n| {
                let (db, pool_id) = (db.clone(), pool.id.clone());
                async move {
                    changes::register_node(
                        &db,
                        NewNode {
                            pool_id,
                            hostname: format!("p{p}-n{n}"),
                            labels: Labels::new(),
                            taints: vec![],
                            vcpu: 256,
                            memory_mib: 1 << 21,
                            disk_gib: 10_000,
                            devices: (0..gpus_per_node)
                                .map(|g| NewDevice {
                                    uuid: GpuUuid::parse("uuid", &format!("GPU-p{p}-n{n}-g{g}"))
                                        .expect("a GPU uuid"),
                                    vendor: "nvidia".into(),
                                    model: "H100".into(),
                                    memory_mib: 81_559,
                                    layout: Layout::Exclusive,
                                    topology: Default::default(),
                                })
                                .collect(),
                        },
                    )
                    .await
                    .expect("node");
                }
            })
            .buffer_unordered(4)
            .collect::<Vec<()>>()
            .await;
        ids.push(pool.id);
    }
    ids
}

/// p50 and p99 of `finished_at - created_at` in milliseconds, and how many failed, of the
/// commands whose idempotency key is `LIKE pattern` (as the database timed them).
pub async fn command_latency(db: &compute_domain::db::Db, pattern: &str) -> (f64, f64, i64) {
    sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), \
                count(*) FILTER (WHERE state = 'failed') \
           FROM (SELECT extract(epoch FROM finished_at - created_at) * 1000 AS ms, state FROM commands \
                  WHERE idempotency_key LIKE $1) x",
    )
    .bind(pattern)
    .fetch_one(db.pool())
    .await
    .expect("latency")
}
