//! The test harness of Better Compute: a real PostgreSQL for every test, and the real server on a
//! loopback port.
//!
//! * Without `DATABASE_URL`, the first test of a run starts a throwaway embedded cluster under
//!   `$TMPDIR/compute-tests/<pid>` (cleaned up by the next run); with it, that server is used.
//! * Migrations run once per run into a template database; each test gets
//!   `CREATE DATABASE … TEMPLATE`, named after the test, so tests run in parallel and never
//!   share state.
//! * A failing test keeps its database and prints how to reach it.
//! * With `COMPUTE_TEST_PGBOUNCER=1` (and no `DATABASE_URL`), the tests' connections go through a
//!   PgBouncer in transaction pooling mode in front of the embedded cluster (`TestDb::url` is the
//!   pooler's, `TestDb::direct_url` the server's; processes a test starts get
//!   [`TestDb::process_env`]); migrations and `LISTEN` go to the server itself.

/// The allocator the API and the workers run on (their `main.rs`): the benchmarks and test
/// servers here host them in process, so they measure what production runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod bench;
pub mod cdp;
pub mod sqlscan;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use compute_api::auth::{Claims, KeySource, Role, Secret, Verifier};
use compute_api::server::Server;
use compute_domain::db::{Db, MIGRATOR, PoolSettings};
use compute_embedded_pg::pgbouncer::{PgBouncer, PgBouncerOptions};
use compute_embedded_pg::{EmbeddedOptions, EmbeddedPostgres, process_alive, quote_ident};
use serde_json::Value;
use sqlx::Connection;
use tokio::sync::OnceCell;

/// Where the tests' databases live for this run.
struct Cluster {
    /// URL of a database to run `CREATE DATABASE` from.
    admin_url: String,
    /// Builds the URL of another database on the same server.
    base: url_base::Base,
    /// The same through the pooler, when the run goes through one.
    pooled: Option<url_base::Base>,
    template: String,
    /// Keeps the pooler alive for the whole run (dropped before the server).
    _pooler: Option<PgBouncer>,
    /// Keeps the embedded server alive for the whole run.
    _embedded: Option<EmbeddedPostgres>,
    description: String,
}

/// Whether this run's connections go through PgBouncer (`COMPUTE_TEST_PGBOUNCER=1`).
pub fn through_pgbouncer() -> bool {
    std::env::var("COMPUTE_TEST_PGBOUNCER").is_ok_and(|v| v == "1" || v == "true")
}

mod url_base {
    /// A URL split around its database name.
    #[derive(Debug, Clone)]
    pub struct Base {
        pub prefix: String,
        pub query: String,
    }

    impl Base {
        pub fn parse(url: &str) -> Base {
            let (main, query) = match url.split_once('?') {
                Some((m, q)) => (m, format!("?{q}")),
                None => (url, String::new()),
            };
            // postgres://user:pw@host:port/dbname → keep everything up to the last '/'.
            let after_scheme = main.find("://").map(|i| i + 3).unwrap_or(0);
            let prefix = match main[after_scheme..].rfind('/') {
                Some(i) => main[..after_scheme + i].to_owned(),
                None => main.to_owned(),
            };
            Base { prefix, query }
        }
        pub fn url(&self, database: &str) -> String {
            format!("{}/{}{}", self.prefix, database, self.query)
        }
    }
}

static CLUSTER: OnceCell<Cluster> = OnceCell::const_new();
static COUNTER: AtomicU32 = AtomicU32::new(0);

async fn cluster() -> &'static Cluster {
    CLUSTER
        .get_or_init(|| async {
            match start_cluster().await {
                Ok(c) => c,
                Err(e) => panic!("cannot prepare the test database server: {e}"),
            }
        })
        .await
}

fn test_root() -> PathBuf {
    std::env::temp_dir().join("compute-tests")
}

/// Removes the clusters of earlier runs whose process is gone.
fn remove_stale_clusters() {
    let Ok(entries) = std::fs::read_dir(test_root()) else {
        return;
    };
    for entry in entries.flatten() {
        let pid = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok());
        if pid.is_some_and(|pid| pid != std::process::id() && !process_alive(pid)) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

async fn start_cluster() -> compute_domain::Result<Cluster> {
    let checksum: u64 = MIGRATOR
        .iter()
        .flat_map(|m| m.checksum.iter().copied())
        .fold(0xcbf29ce484222325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
        });
    match std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => {
            let base = url_base::Base::parse(&url);
            let template = format!("compute_tpl_{:016x}", checksum);
            prepare_template(&url, &base, &template, true).await?;
            Ok(Cluster {
                admin_url: url.clone(),
                base,
                pooled: None,
                template,
                _embedded: None,
                _pooler: None,
                description: "the server of DATABASE_URL".into(),
            })
        }
        None => {
            remove_stale_clusters();
            let dir = test_root().join(std::process::id().to_string());
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).map_err(compute_domain::Error::internal)?;
            let pg = EmbeddedPostgres::start(EmbeddedOptions {
                data_dir: dir.clone(),
                durable: false,
                max_connections: 300,
            })
            .await
            .map_err(compute_domain::Error::internal)?;
            let admin_url = pg.url("postgres");
            let base = url_base::Base::parse(&admin_url);
            let template = "compute_template".to_owned();
            prepare_template(&admin_url, &base, &template, false).await?;
            let pooler = if through_pgbouncer() {
                Some(
                    PgBouncer::start(PgBouncerOptions {
                        dir: dir.join("pgbouncer"),
                        upstream_port: pg.port(),
                        user: compute_embedded_pg::SUPERUSER.to_owned(),
                        password: pg.password().to_owned(),
                        pool_size: 20,
                        max_client_conn: 2000,
                    })
                    .await
                    .map_err(compute_domain::Error::internal)?,
                )
            } else {
                None
            };
            Ok(Cluster {
                admin_url,
                base,
                pooled: pooler
                    .as_ref()
                    .map(|p| url_base::Base::parse(&p.url("postgres"))),
                _pooler: pooler,
                template,
                description: format!(
                    "the embedded cluster in {} (kept until the next test run; start it with \
                     `postgres -D {}/pg -p <port>` as its owner)",
                    dir.display(),
                    dir.display()
                ),
                _embedded: Some(pg),
            })
        }
    }
}

/// Creates and migrates the template database unless it exists. On a shared server, concurrent
/// runs serialize on a session advisory lock (test harness only; see docs/database-locks.md),
/// and the template appears under its final name only once it is complete.
async fn prepare_template(
    admin_url: &str,
    base: &url_base::Base,
    template: &str,
    shared: bool,
) -> compute_domain::Result<()> {
    let mut admin = sqlx::PgConnection::connect(admin_url).await?;
    if shared {
        sqlx::query(
            "SELECT pg_advisory_lock(hashtextextended('compute-tests:template:' || $1, 0))",
        )
        .bind(template)
        .execute(&mut admin)
        .await?;
    }
    let exists: Option<(i32,)> = sqlx::query_as("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(template)
        .fetch_optional(&mut admin)
        .await?;
    if exists.is_none() {
        let building = format!("{template}_building");
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote_ident(&building)
        ))
        .execute(&mut admin)
        .await?;
        sqlx::query(&format!("CREATE DATABASE {}", quote_ident(&building)))
            .execute(&mut admin)
            .await?;
        // One connection of our own, closed before the rename: a pooled connection may outlive
        // `Pool::close`, and a rename waits 5 s for every other session, then fails.
        let mut conn = sqlx::PgConnection::connect(&base.url(&building)).await?;
        MIGRATOR.run(&mut conn).await?;
        conn.close().await?;
        let rename = format!(
            "ALTER DATABASE {} RENAME TO {}",
            quote_ident(&building),
            quote_ident(template)
        );
        // A backend that is still exiting makes the rename fail (55006): end it and try again.
        let mut tries = 0;
        loop {
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                  WHERE datname = $1 AND pid <> pg_backend_pid()",
            )
            .bind(&building)
            .execute(&mut admin)
            .await?;
            match sqlx::query(&rename).execute(&mut admin).await {
                Ok(_) => break,
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some("55006") && tries < 5 =>
                {
                    tries += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    admin.close().await?;
    Ok(())
}

/// The secrets key every test database's handle seals sink secrets with (and every worker
/// process a test starts is given), so every webhook test runs with secrets sealed at rest.
pub const SECRETS_KEY: &str = "5ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2";

/// The keyring of [`SECRETS_KEY`].
pub fn test_keyring() -> Option<Arc<compute_domain::secrets::Keyring>> {
    compute_domain::secrets::Keyring::from_config(Some(SECRETS_KEY), None).expect("the test key")
}

/// A migrated database of one's own.
pub struct TestDb {
    pub name: String,
    /// What the system connects to: PostgreSQL, or the pooler in front of it.
    pub url: String,
    /// PostgreSQL itself (the same as `url` without a pooler).
    pub direct_url: String,
    pub db: Db,
    external: bool,
    /// The business clocks of the servers started on this database, re-anchored at once when
    /// the test moves simulated time (a server samples `compute_now()` only every 30 s).
    clocks: std::sync::Mutex<Vec<compute_domain::clock::Clock>>,
}

/// A fresh database cloned from the migrated template, named after the running test, on
/// simulated time: `compute_now()` stands at the second the test began and moves only when the
/// test moves it ([`TestDb::advance_clock`]). A test that needs time to pass by itself asks for
/// [`test_db_on_wall_clock`] and says why.
pub async fn test_db() -> TestDb {
    test_db_with(8).await
}

/// [`test_db`] with a pool of `max_connections`, on simulated time.
pub async fn test_db_with(max_connections: u32) -> TestDb {
    let db = test_db_on_wall_clock_with(max_connections).await;
    let start = chrono::Timelike::with_nanosecond(&chrono::Utc::now(), 0)
        .expect("a whole second")
        .to_rfc3339();
    db.use_sim_clock(&start).await;
    db
}

/// A fresh database whose `compute_now()` is the wall clock: for a test of something that
/// passes by itself (a lease left to expire by a killed process, a retry's back-off, a real
/// daemon's timers), where stepping simulated time cannot reach.
pub async fn test_db_on_wall_clock() -> TestDb {
    test_db_on_wall_clock_with(8).await
}

/// [`test_db_on_wall_clock`] with a pool of `max_connections`.
pub async fn test_db_on_wall_clock_with(max_connections: u32) -> TestDb {
    let cluster = cluster().await;
    let test = std::thread::current()
        .name()
        .unwrap_or("test")
        .rsplit("::")
        .next()
        .unwrap_or("test")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(40)
        .collect::<String>();
    let name = format!(
        "t_{}_{}_{}",
        test,
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let mut admin = sqlx::PgConnection::connect(&cluster.admin_url)
        .await
        .expect("connect to the admin database");
    let create = format!(
        "CREATE DATABASE {} TEMPLATE {}",
        quote_ident(&name),
        quote_ident(&cluster.template)
    );
    let mut tries = 0;
    loop {
        match sqlx::query(&create).execute(&mut admin).await {
            Ok(_) => break,
            // 55006: the template is briefly in use by another CREATE DATABASE.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55006") && tries < 50 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("cannot create test database {name}: {e}"),
        }
    }
    let _ = admin.close().await;
    let direct_url = cluster.base.url(&name);
    let url = match &cluster.pooled {
        Some(pooled) => pooled.url(&name),
        None => direct_url.clone(),
    };
    let db = Db::connect(&url, &pool_settings(max_connections, &url, &direct_url))
        .await
        .expect("connect to the test database")
        .with_keyring(test_keyring())
        // The tests' receivers listen on loopback, as an on-premises receiver would on a
        // private address (`--webhooks-allow-private`).
        .allowing_private_webhooks(true);
    TestDb {
        name,
        url,
        direct_url,
        db,
        external: cluster._embedded.is_none(),
        clocks: Default::default(),
    }
}

/// The pool's settings for `url`; behind a pooler (`url` is not `direct_url`): no startup
/// options, and `LISTEN` on the server itself, as `compute-api serve --db-pooled` connects.
fn pool_settings(max_connections: u32, url: &str, direct_url: &str) -> PoolSettings {
    let pooled = url != direct_url;
    PoolSettings {
        max_connections,
        statement_timeout: if pooled {
            None
        } else {
            PoolSettings::default().statement_timeout
        },
        listen_url: pooled.then(|| direct_url.to_owned()),
        ..PoolSettings::default()
    }
}

/// A test database at `url` (a database that exists, on a server of the test's own or as
/// another role): connected, and migrated when `migrate`. Dropping it leaves the database be.
pub async fn test_db_at(url: &str, name: &str, migrate: bool) -> TestDb {
    let db = Db::connect(url, &PoolSettings::default())
        .await
        .expect("connect to the test database")
        .with_keyring(test_keyring())
        // The tests' receivers listen on loopback, as an on-premises receiver would on a
        // private address (`--webhooks-allow-private`).
        .allowing_private_webhooks(true);
    if migrate {
        db.migrate().await.expect("migrate");
    }
    TestDb {
        name: name.to_owned(),
        url: url.to_owned(),
        direct_url: url.to_owned(),
        db,
        external: false,
        clocks: Default::default(),
    }
}

/// The environment a `compute-api` or `compute-worker` process needs to reach a database at
/// `url`: `DATABASE_URL`, and when `url` is a pooler in front of `direct_url`,
/// `COMPUTE_DB_POOLED` and `COMPUTE_LISTEN_DATABASE_URL`.
pub fn process_env(url: &str, direct_url: &str) -> Vec<(&'static str, String)> {
    let mut env = vec![("DATABASE_URL", url.to_owned())];
    if url != direct_url {
        env.push(("COMPUTE_DB_POOLED", "true".to_owned()));
        env.push(("COMPUTE_LISTEN_DATABASE_URL", direct_url.to_owned()));
    }
    env
}

/// A database reached through a PgBouncer of its own (transaction pooling).
pub struct PooledDb {
    /// The database through the pooler.
    pub url: String,
    /// The database on the server itself.
    pub direct_url: String,
    pub pooler: PgBouncer,
    database: String,
}

impl PooledDb {
    /// See [`process_env`].
    pub fn process_env(&self) -> Vec<(&'static str, String)> {
        process_env(&self.url, &self.direct_url)
    }

    /// What the pooler did for this database so far.
    pub async fn stats(&self) -> compute_embedded_pg::pgbouncer::PoolerStats {
        self.pooler
            .stats(&self.database)
            .await
            .expect("the pooler's admin console")
    }
}

/// Starts a PgBouncer (transaction pooling, `pool_size` server connections) in front of
/// `db`'s server, for `db`'s database. Builds PgBouncer with `scripts/pgbouncer-build` when
/// none of 1.21 or later is found.
pub async fn pgbouncer_for(db: &TestDb, pool_size: u32) -> PooledDb {
    if compute_embedded_pg::pgbouncer::find_binary().is_err() {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/pgbouncer-build");
        let status = std::process::Command::new(&script)
            .status()
            .expect("run scripts/pgbouncer-build");
        assert!(status.success(), "scripts/pgbouncer-build failed");
    }
    // postgres://user:password@127.0.0.1:port/database
    let rest = db.direct_url.split_once("://").expect("a URL").1;
    let (credentials, rest) = rest.rsplit_once('@').expect("user@host");
    let (user, password) = credentials.split_once(':').expect("user:password");
    let (host_port, database) = rest.split_once('/').expect("host/database");
    let database = database.split('?').next().unwrap_or(database).to_owned();
    let port = host_port
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("a port");
    let dir = test_root()
        .join(std::process::id().to_string())
        .join(format!("pgbouncer-{database}"));
    let pooler = PgBouncer::start(PgBouncerOptions {
        dir,
        upstream_port: port,
        user: user.to_owned(),
        password: password.to_owned(),
        pool_size,
        max_client_conn: 2000,
    })
    .await
    .expect("start PgBouncer");
    PooledDb {
        url: pooler.url(&database),
        direct_url: db.direct_url.clone(),
        pooler,
        database,
    }
}

impl TestDb {
    /// See [`process_env`].
    pub fn process_env(&self) -> Vec<(&'static str, String)> {
        process_env(&self.url, &self.direct_url)
    }

    /// Switches this database to simulated time at `start` (RFC 3339).
    pub async fn use_sim_clock(&self, start: &str) {
        sqlx::query("SELECT compute_use_sim_clock($1::timestamptz)")
            .bind(start)
            .execute(self.db.pool())
            .await
            .expect("switch to simulated time");
        self.resample_clocks().await;
    }

    /// Moves simulated time forward by `seconds`.
    pub async fn advance_clock(&self, seconds: i64) {
        sqlx::query("SELECT compute_advance_sim_clock(make_interval(secs => $1))")
            .bind(seconds as f64)
            .execute(self.db.pool())
            .await
            .expect("advance simulated time");
        self.resample_clocks().await;
    }

    /// Waits as [`eventually`] does, while simulated time moves at the wall clock's pace: for
    /// a test whose worker or API *processes* run on a simulated clock it does not step. A work
    /// item that failed once is due again after a backoff measured in `compute_now()`; on a
    /// frozen clock it would never be, and the test would stall on a retry production makes
    /// within seconds. On timeout the panic shows the work queue, the commands and the
    /// sessions, so a stall says where it stalled.
    pub async fn eventually_as_time_passes<T, F, Fut>(
        &self,
        what: &str,
        within: std::time::Duration,
        mut check: F,
    ) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = std::time::Instant::now() + within;
        let mut last = std::time::Instant::now();
        loop {
            if let Some(value) = check().await {
                return value;
            }
            if std::time::Instant::now() >= deadline {
                panic!(
                    "{what}: not within {within:?}\n{}",
                    self.work_report().await
                );
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            let now = std::time::Instant::now();
            sqlx::query("SELECT compute_advance_sim_clock(make_interval(secs => $1))")
                .bind(now.duration_since(last).as_secs_f64())
                .execute(self.db.pool())
                .await
                .expect("advance simulated time");
            last = now;
            self.resample_clocks().await;
        }
    }

    /// The work queue's rows, the commands and the open sessions, as text: what a stalled
    /// test prints.
    pub async fn work_report(&self) -> String {
        let rows = |sql: &'static str| async move {
            sqlx::query_scalar::<_, String>(sql)
                .fetch_all(self.db.pool())
                .await
                .map(|r| r.join("\n  "))
                .unwrap_or_else(|e| format!("({e})"))
        };
        format!(
            "compute_now(): {}\nwork queue:\n  {}\ncommands:\n  {}\nsessions:\n  {}\nbusy connections:\n  {}",
            rows("SELECT compute_now()::text").await,
            rows(
                "SELECT format('%s %s gen %s attempts %s not_before %s claimed_until %s error %s', \
                        kind, key, gen, attempts, not_before, claimed_until, last_error) \
                   FROM work_queue ORDER BY kind, key"
            )
            .await,
            rows(
                "SELECT format('%s %s %s on %s attempts %s error %s %s', \
                        id, kind, state, node_id, attempts, error_code, error_message) \
                   FROM commands ORDER BY id"
            )
            .await,
            rows(
                "SELECT format('%s epoch %s gateway %s closed %s', node_id, session_epoch, gateway, closed_at) \
                   FROM node_sessions ORDER BY node_id"
            )
            .await,
            rows(
                "SELECT format('%s [%s] %s since %s waiting on %s: %s', application_name, pid, state, \
                        xact_start, wait_event_type || ':' || wait_event, left(query, 160)) \
                   FROM pg_stat_activity \
                  WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle' \
                  ORDER BY xact_start"
            )
            .await,
        )
    }

    /// Re-anchors the clocks of the servers on this database to `compute_now()`.
    async fn resample_clocks(&self) {
        let clocks = self.clocks.lock().map(|c| c.clone()).unwrap_or_default();
        for clock in clocks {
            clock.sample(&self.db).await.expect("sample compute_now()");
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Some(cluster) = CLUSTER.get() else { return };
        if std::thread::panicking() {
            eprintln!(
                "test failed: its database `{}` is kept in {}; connect with: psql '{}'",
                self.name, cluster.description, self.url
            );
            return;
        }
        if !self.external {
            return; // the whole throwaway cluster goes at the next run
        }
        let (admin_url, name) = (cluster.admin_url.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url).await {
                    let _ = sqlx::query(&format!(
                        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                        quote_ident(&name)
                    ))
                    .execute(&mut admin)
                    .await;
                    let _ = admin.close().await;
                }
            });
        })
        .join();
    }
}

/// How long [`TestApp::operator`], [`TestApp::member`] and [`TestApp::node_token`] tokens last,
/// in seconds of business time: 23 hours, an hour short of the most the verifier accepts
/// ([`compute_api::auth::DEFAULT_MAX_TOKEN_LIFETIME`]), so another server on the database whose
/// clock has not yet seen the test's last move of simulated time accepts them too.
const DAY: i64 = 23 * 3600;

/// The issuer of the tests' tokens.
pub const TEST_ISSUER: &str = "compute-test";
/// The audience of the tests' tokens.
pub const TEST_AUDIENCE: &str = "compute-api";
/// The tests' HS256 secret.
pub const TEST_SECRET: &str = "test-secret-test-secret-test-secret-0123";

/// The real server on a loopback port, on a database of its own.
pub struct TestApp {
    pub addr: SocketAddr,
    /// The database; shared with any other API process started on it ([`AppBuilder::sharing`]).
    pub db: Arc<TestDb>,
    pub http: reqwest::Client,
    /// The server's node-daemon gateway (`/agent`), for tests that step it.
    pub gateway: compute_api::gateway::Gateway,
    /// The server's business clock: tokens are minted on it and verified against it.
    pub clock: compute_domain::clock::Clock,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

/// The value of `series` (a metric's name and labels as `/metrics` writes them, such as
/// `compute_subscriptions_open` or `compute_api_refusals_total{reason="cost"}`) in the text of
/// [`TestApp::metrics`]; panics when it has no such series.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {series} in /metrics:\n{text}"))
}

/// The one wait of the tests: polls `check` until it yields a value, every 5 ms, and panics
/// naming `what` after `within`. A test waits for a state it observes, never for a guessed time.
pub async fn eventually<T, F, Fut>(what: &str, within: std::time::Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Waits until one transaction of this database waits for an advisory lock (`what` names it in
/// the failure): how a test knows that a request it sent has reached a lock another transaction
/// holds.
pub async fn until_one_waits_for_an_advisory_lock(pool: &sqlx::PgPool, what: &str) {
    eventually(what, std::time::Duration::from_secs(10), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(pool)
        .await
        .expect("locks");
        (waiting == 1).then_some(())
    })
    .await;
}

/// Starts the API on `127.0.0.1:0` over a fresh database, with the defaults
/// ([`TestApp::builder`] for anything else).
pub async fn spawn_app() -> TestApp {
    TestApp::builder().start().await
}

/// Ends this process (SIGTERM, so it shuts down as it would on a stop) when the thread that
/// started it ends, which includes its test process dying or being killed: the test binaries
/// (`test-api`, `test-worker`, `test-agent`) call it first, so a test run that is killed leaves
/// no API, worker or daemon behind. A process whose parent was already gone exits at once.
#[expect(
    unsafe_code,
    reason = "prctl(2) and getppid(2) have no safe wrapper in std"
)]
pub fn end_with_parent() {
    // SAFETY: both calls take and return plain integers and touch no memory of this process.
    let orphaned = unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
        libc::getppid() == 1
    };
    if orphaned {
        std::process::exit(1);
    }
}

/// Logs to the test's captured output (shown when a test fails); `RUST_LOG` filters.
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new("warn,compute_api=info,compute_domain=info")
        });
        // Plain text, as `compute-api` writes when its stderr is not a terminal: the captured
        // output is read in CI logs, where escape codes are noise.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_test_writer()
            .try_init();
    });
}

/// How a test's API starts: the one builder behind [`spawn_app`]. Each setting defaults to what
/// `compute-api serve` does (a fresh database, the default stream settings and limits, no
/// persisted operations, no browser origins).
#[derive(Default)]
pub struct AppBuilder {
    db: Option<Arc<TestDb>>,
    stream: compute_api::tailer::StreamConfig,
    limits: compute_api::limits::Limits,
    frontends: Option<(
        compute_api::persisted::Persisted,
        Vec<axum::http::HeaderValue>,
    )>,
    authz_source: compute_api::authz::Source,
    authz_trust: Option<std::time::Duration>,
    public_webhooks_only: bool,
}

impl AppBuilder {
    /// Over `db` instead of a fresh database.
    pub fn on(mut self, db: TestDb) -> Self {
        self.db = Some(Arc::new(db));
        self
    }

    /// A second API process (as far as the database can tell) on the database of `other`.
    pub fn sharing(mut self, other: &TestApp) -> Self {
        self.db = Some(other.db.clone());
        self
    }

    /// With the streaming settings `stream`.
    pub fn stream(mut self, stream: compute_api::tailer::StreamConfig) -> Self {
        self.stream = stream;
        self
    }

    /// With the published limits `limits`.
    pub fn limits(mut self, limits: compute_api::limits::Limits) -> Self {
        self.limits = limits;
        self
    }

    /// With persisted operations `persisted` and the browser origins `cors` allowed.
    pub fn frontends(
        mut self,
        persisted: compute_api::persisted::Persisted,
        cors: &[&str],
    ) -> Self {
        let origins = cors
            .iter()
            .map(|o| axum::http::HeaderValue::from_str(o).expect("an origin"))
            .collect();
        self.frontends = Some((persisted, origins));
        self
    }

    /// Taking roles from grants only (`serve --authz grants`).
    pub fn grants_only(mut self) -> Self {
        self.authz_source = compute_api::authz::Source::GrantsOnly;
        self
    }

    /// Trusting its grants for `trust` after each read (`authz::TRUST` by default).
    pub fn authz_trust(mut self, trust: std::time::Duration) -> Self {
        self.authz_trust = Some(trust);
        self
    }

    /// Letting sinks name public targets only, as `serve` does without
    /// `--webhooks-allow-private` (the tests' default allows them: their receivers are local).
    pub fn public_webhooks_only(mut self) -> Self {
        self.public_webhooks_only = true;
        self
    }

    /// Starts the API on `127.0.0.1:0`.
    pub async fn start(self) -> TestApp {
        let db = match self.db {
            Some(db) => db,
            None => Arc::new(test_db().await),
        };
        let private = !self.public_webhooks_only;
        let (frontends, source, trust) = (self.frontends, self.authz_source, self.authz_trust);
        start_app_configured(db, private, self.stream, self.limits, move |s| {
            let s = match frontends {
                Some((persisted, origins)) => s.with_frontends(persisted, origins),
                None => s,
            };
            let s = s.with_authz_source(source);
            match trust {
                Some(t) => s.with_authz_trust(t),
                None => s,
            }
        })
        .await
    }
}

async fn start_app_configured(
    db: Arc<TestDb>,
    private_webhooks: bool,
    stream: compute_api::tailer::StreamConfig,
    limits: compute_api::limits::Limits,
    configure: impl FnOnce(Server) -> Server,
) -> TestApp {
    init_logging();
    let verifier = Verifier::new(
        KeySource::Hs256(Secret::new(TEST_SECRET)),
        TEST_ISSUER,
        TEST_AUDIENCE,
    )
    .expect("verifier");
    let registry = compute_domain::metrics::Registry::default();
    db.db.register_metrics(&registry);
    let server = configure(
        Server::with_limits(
            db.db.clone().allowing_private_webhooks(private_webhooks),
            verifier,
            stream,
            limits,
            registry,
        )
        .await
        .expect("server state"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let gateway = server.state().gateway.clone();
    let clock = server.state().clock.clone();
    if let Ok(mut clocks) = db.clocks.lock() {
        clocks.push(clock.clone());
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(server.run(listener, async move {
        let _ = stopped.await;
    }));
    TestApp {
        addr,
        db,
        gateway,
        http: reqwest::Client::new(),
        clock,
        stop: Some(stop),
        server: Some(handle),
    }
}

impl TestApp {
    /// How to start one with other than the defaults.
    pub fn builder() -> AppBuilder {
        AppBuilder::default()
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The text of `/metrics` now.
    pub async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("the body of /metrics")
    }

    /// Claims as the tests' issuer signs them, made on this server's business clock: valid
    /// for `ttl_seconds` from now, and since an hour ago (`nbf`), so another server on the same
    /// database whose clock has not yet seen the test's last move of simulated time accepts
    /// them. A test expires them by moving simulated time ([`TestDb::advance_clock`]), not by
    /// waiting.
    pub fn claims(
        &self,
        sub: &str,
        tenant: Option<&str>,
        roles: &[Role],
        ttl_seconds: i64,
    ) -> Claims {
        let now = self.clock.now().timestamp();
        let mut c = claims(sub, tenant, roles, ttl_seconds);
        (c.iat, c.nbf, c.exp) = (Some(now), Some(now - 3600), now + ttl_seconds);
        c
    }

    /// A node daemon's token for `node`, valid for 23 hours of business time.
    pub fn node_token(&self, node: &str) -> String {
        let mut c = self.claims(&format!("node:{node}"), None, &[Role::Node], DAY);
        c.node = Some(node.to_owned());
        mint(c)
    }

    /// `ws://127.0.0.1:<port>/agent`.
    pub fn agent_url(&self) -> String {
        format!("ws://{}/agent", self.addr)
    }

    /// A token with `roles` for `tenant`, valid for an hour of business time.
    pub fn token(&self, sub: &str, tenant: Option<&str>, roles: &[Role]) -> String {
        mint(self.claims(sub, tenant, roles, 3600))
    }

    /// POSTs a GraphQL request; returns the status and the JSON body.
    pub async fn graphql(
        &self,
        query: &str,
        variables: Value,
        token: Option<&str>,
    ) -> (u16, Value) {
        let mut req = self
            .http
            .post(self.url("/graphql"))
            .header("Accept", "application/graphql-response+json")
            .json(&serde_json::json!({ "query": query, "variables": variables }));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let res = req.send().await.expect("POST /graphql");
        let status = res.status().as_u16();
        let body = res.json::<Value>().await.expect("JSON body");
        (status, body)
    }

    /// Sends a GraphQL request on a task of its own and returns at once; the handle yields the
    /// JSON body. For tests that order concurrent requests with row locks.
    pub fn graphql_in_background(
        &self,
        token: &str,
        query: &str,
        variables: Value,
    ) -> tokio::task::JoinHandle<Value> {
        let request = self
            .http
            .post(self.url("/graphql"))
            .header("Accept", "application/graphql-response+json")
            .bearer_auth(token)
            .json(&serde_json::json!({ "query": query, "variables": variables }));
        tokio::spawn(async move {
            let res = request.send().await.expect("POST /graphql");
            res.json::<Value>().await.expect("JSON body")
        })
    }

    /// Waits until `n` backends of this test's database wait on a lock (a row, a key, a
    /// transaction), so a test can order concurrent requests without sleeping on a guess.
    pub async fn until_lock_waiters(&self, n: i64) {
        let pool = self.db.db.pool();
        eventually(
            &format!("{n} transactions waiting on a lock"),
            std::time::Duration::from_secs(10),
            || async move {
                let (waiting,): (i64,) = sqlx::query_as(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(pool)
                .await
                .expect("pg_stat_activity");
                (waiting >= n).then_some(())
            },
        )
        .await;
    }

    /// An operator's token (tenant `ops`), valid for 23 hours of business time.
    pub fn operator(&self) -> String {
        mint(self.claims("root@ops", Some("ops"), &[Role::Operator], DAY))
    }

    /// A member's token for `tenant`, valid for 23 hours of business time (about the longest
    /// the verifier accepts), so a test that moves simulated time by hours keeps its tokens.
    pub fn member(&self, tenant: &str) -> String {
        mint(self.claims(
            &format!("alice@{tenant}"),
            Some(tenant),
            &[Role::Member],
            DAY,
        ))
    }

    /// Runs a GraphQL request that must succeed; returns its `data`.
    pub async fn ok(&self, token: &str, query: &str, variables: Value) -> Value {
        let (status, body) = self.graphql(query, variables, Some(token)).await;
        assert!(
            status == 200 && body.get("errors").is_none(),
            "expected success, got {status}: {body}"
        );
        body["data"].clone()
    }

    /// Runs a GraphQL request that must fail; returns the first error's code and the error.
    pub async fn fails(&self, token: &str, query: &str, variables: Value) -> (String, Value) {
        let (_, body) = self.graphql(query, variables, Some(token)).await;
        let error = body["errors"][0].clone();
        let code = error["extensions"]["code"]
            .as_str()
            .unwrap_or_else(|| panic!("expected an error, got {body}"));
        (code.to_owned(), error)
    }

    /// Rows in `table` (for checking that a failed mutation wrote nothing).
    pub async fn count(&self, table: &str) -> i64 {
        let (n,): (i64,) = sqlx::query_as(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(self.db.db.pool())
            .await
            .expect("count");
        n
    }

    /// Starts a graceful shutdown and waits for the server to finish.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.expect("server task").expect("server result");
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

/// Claims as the tests' issuer signs them, made on the wall clock (a test with a server mints on its
/// business clock: [`TestApp::claims`]).
pub fn claims(sub: &str, tenant: Option<&str>, roles: &[Role], ttl_seconds: i64) -> Claims {
    let mut c = compute_api::auth::dev_claims(sub, tenant, roles, ttl_seconds);
    c.iss = TEST_ISSUER.into();
    c.aud = TEST_AUDIENCE.into();
    c
}

/// Signs claims with the tests' secret.
pub fn mint(claims: Claims) -> String {
    compute_api::auth::mint_hs256(&Secret::new(TEST_SECRET), &claims).expect("mint")
}

/// The `extensions.code` of the first error of a GraphQL response.
pub fn first_code(body: &Value) -> Option<&str> {
    body["errors"][0]["extensions"]["code"].as_str()
}

/// A tenant id for tests.
pub fn tenant(id: &str) -> compute_domain::ids::TenantId {
    compute_domain::ids::TenantId::parse("tenant", id).expect("a valid tenant id")
}
