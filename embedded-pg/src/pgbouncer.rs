//! A private PgBouncer in transaction pooling mode in front of a PostgreSQL server, for the
//! scale-out tests and benchmarks (several API and worker processes sharing few server
//! connections), started and stopped like the embedded server.
//!
//! It needs PgBouncer 1.21 or later: sqlx prepares every statement under a name of its own, and
//! only from 1.21 does PgBouncer carry named prepared statements in transaction mode
//! (`max_prepared_statements`, rewritten per server connection). Found as `COMPUTE_PGBOUNCER`,
//! else `target/pgbouncer/bin/pgbouncer` (built by `scripts/pgbouncer-build` from Debian's
//! source package), else `pgbouncer` on the `PATH` or in `/usr/sbin`.

use std::fs;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use sqlx::Connection;
use tracing::info;

use crate::{Error, Result, die_with_parent, free_port, keep, log_tail, run_as_user};

/// The oldest PgBouncer that carries prepared statements in transaction mode.
pub const MIN_VERSION: (u32, u32) = (1, 21);

/// How to start the pooler.
#[derive(Debug, Clone)]
pub struct PgBouncerOptions {
    /// Where its configuration and log go (created; made readable by the account it runs as).
    pub dir: PathBuf,
    /// The PostgreSQL server behind it, on 127.0.0.1.
    pub upstream_port: u16,
    /// The one user clients log in as, with its password (checked by PgBouncer with SCRAM and
    /// used for its own logins to the server).
    pub user: String,
    pub password: String,
    /// Server connections per database and user (`default_pool_size`).
    pub pool_size: u32,
    /// Client connections it accepts in all (`max_client_conn`).
    pub max_client_conn: u32,
}

/// What a pooler did for one database.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolerStats {
    /// Client connections attached now (active or waiting for a server).
    pub clients: i64,
    /// Server connections open now.
    pub servers: i64,
    /// Transactions it passed to the server so far (its statistics are updated every second).
    pub transactions: i64,
}

/// A running PgBouncer. Dropping it stops it.
///
/// The child belongs to a keeper thread that lives as long as the handle: the kernel's
/// parent-death signal (`PR_SET_PDEATHSIG`, so no pooler outlives this process) fires when the
/// *thread* that spawned the child exits, and the thread that asks for a pooler may be a test's,
/// which ends long before the run.
#[derive(Debug)]
pub struct PgBouncer {
    stop: Option<mpsc::Sender<()>>,
    keeper: Option<std::thread::JoinHandle<()>>,
    exited: std::sync::Mutex<mpsc::Receiver<String>>,
    port: u16,
    user: String,
    password: String,
    dir: PathBuf,
}

impl PgBouncer {
    /// Writes the configuration, starts the pooler and waits until a client can run a
    /// statement through it.
    pub async fn start(options: PgBouncerOptions) -> Result<PgBouncer> {
        let binary = find_binary()?;
        let run_as = run_as_user()?;
        fs::create_dir_all(&options.dir).map_err(Error::new)?;
        let port = free_port()?;
        let quote = |s: &str| s.replace('"', "\"\"");
        write_private(
            &options.dir.join("userlist.txt"),
            &format!(
                "\"{}\" \"{}\"\n",
                quote(&options.user),
                quote(&options.password)
            ),
        )?;
        // Idle server connections close after 5 s (PgBouncer's default is 10 minutes): every
        // test has a database of its own, so a pool's connections outlive its test, and a run
        // of some 80 tests through the pooler held the server's 300 connections with the idle
        // pools of finished tests ("too many clients" at the next test's connect).
        // `extra_float_digits` is a startup parameter sqlx always sends: PgBouncer passes it on
        // to each server connection it hands out. No `options` may be sent (a statement
        // timeout belongs on the role behind a pooler).
        let config = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={upstream}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = scram-sha-256\n\
             auth_file = {dir}/userlist.txt\n\
             pool_mode = transaction\n\
             max_prepared_statements = 500\n\
             default_pool_size = {pool}\n\
             max_client_conn = {clients}\n\
             track_extra_parameters = extra_float_digits\n\
             server_lifetime = 3600\n\
             server_idle_timeout = 5\n\
             stats_period = 1\n\
             admin_users = {user}\n\
             log_connections = 0\n\
             log_disconnections = 0\n",
            upstream = options.upstream_port,
            dir = options.dir.display(),
            pool = options.pool_size,
            clients = options.max_client_conn,
            user = options.user,
        );
        write_private(&options.dir.join("pgbouncer.ini"), &config)?;
        if let Some(user) = &run_as {
            for file in ["", "userlist.txt", "pgbouncer.ini"] {
                std::os::unix::fs::chown(options.dir.join(file), Some(user.uid), Some(user.gid))
                    .map_err(Error::new)?;
            }
        }
        let log_path = options.dir.join("pgbouncer.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(Error::new)?;
        let mut cmd = Command::new(&binary);
        cmd.arg(options.dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(Error::new)?)
            .stderr(log);
        // PgBouncer refuses root: run it as the account the embedded server runs as.
        if let Some(user) = &run_as {
            cmd.uid(user.uid).gid(user.gid);
        }
        cmd.process_group(0);
        die_with_parent(&mut cmd, libc::SIGKILL);
        // It keeps nothing: no need for its safe shutdown.
        let (stop, exited, keeper) = keep(cmd, "pgbouncer", |child| {
            let _ = child.kill();
            let _ = child.wait();
        })?;
        let pooler = PgBouncer {
            stop: Some(stop),
            keeper: Some(keeper),
            exited: std::sync::Mutex::new(exited),
            port,
            user: options.user.clone(),
            password: options.password.clone(),
            dir: options.dir.clone(),
        };
        pooler.wait_ready(&log_path).await?;
        info!(pgbouncer.port = port, pgbouncer.binary = %binary.display(), "PgBouncer is ready");
        Ok(pooler)
    }

    /// A connection URL for `database` through the pooler.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{}:{}@127.0.0.1:{}/{database}",
            self.user, self.password, self.port
        )
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// What the pooler has done for `database` so far, from its admin console (`SHOW POOLS`,
    /// `SHOW STATS`).
    pub async fn stats(&self, database: &str) -> Result<PoolerStats> {
        use sqlx::Row;
        let mut admin = sqlx::PgConnection::connect(&self.url("pgbouncer")).await?;
        let mut stats = PoolerStats::default();
        // The admin console speaks only the simple query protocol (`raw_sql`), so every value
        // comes as text, whatever its type (int4, or numeric for the totals).
        let text = |row: &sqlx::postgres::PgRow, col: &str| -> i64 {
            row.try_get_raw(col)
                .ok()
                .and_then(|v| v.as_str().ok().and_then(|t| t.parse().ok()))
                .unwrap_or(0)
        };
        for row in sqlx::raw_sql("SHOW POOLS").fetch_all(&mut admin).await? {
            if row.try_get::<String, _>("database").ok().as_deref() == Some(database) {
                stats.clients += text(&row, "cl_active") + text(&row, "cl_waiting");
                stats.servers +=
                    text(&row, "sv_active") + text(&row, "sv_idle") + text(&row, "sv_used");
            }
        }
        for row in sqlx::raw_sql("SHOW STATS").fetch_all(&mut admin).await? {
            if row.try_get::<String, _>("database").ok().as_deref() == Some(database) {
                stats.transactions += text(&row, "total_xact_count");
            }
        }
        admin.close().await?;
        Ok(stats)
    }

    /// Where its configuration and log are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    async fn wait_ready(&self, log_path: &Path) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = self.url("postgres");
        loop {
            let exited = self
                .exited
                .lock()
                .map_err(|_| Error::new("poisoned"))?
                .try_recv();
            if let Ok(status) = exited {
                return Err(Error::new(format!(
                    "PgBouncer exited during start-up ({status}); last lines of {}:\n{}",
                    log_path.display(),
                    log_tail(log_path, 15)
                )));
            }
            let attempt = async {
                let mut conn = sqlx::PgConnection::connect(&url).await?;
                sqlx::query("SELECT 1").execute(&mut conn).await?;
                conn.close().await
            };
            match attempt.await {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(Error::new(format!(
                        "PgBouncer did not pass a statement within 30 s: {e}; see {}",
                        log_path.display()
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.join();
        }
    }
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    let _ = fs::remove_file(path);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(Error::new)?;
    std::io::Write::write_all(&mut file, text.as_bytes()).map_err(Error::new)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(Error::new)
}

/// The PgBouncer binary to run, checked to be recent enough.
pub fn find_binary() -> Result<PathBuf> {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/pgbouncer/bin/pgbouncer");
    let candidates: Vec<PathBuf> = match std::env::var_os("COMPUTE_PGBOUNCER") {
        Some(path) => vec![PathBuf::from(path)],
        None => {
            let mut c = vec![built];
            if let Some(path) = std::env::var_os("PATH") {
                c.extend(std::env::split_paths(&path).map(|d| d.join("pgbouncer")));
            }
            c.push(PathBuf::from("/usr/sbin/pgbouncer"));
            c
        }
    };
    let mut too_old = Vec::new();
    for candidate in candidates.iter().filter(|c| c.is_file()) {
        match version(candidate) {
            Some(v) if v >= MIN_VERSION => return Ok(candidate.clone()),
            Some(v) => too_old.push(format!("{} is {}.{}", candidate.display(), v.0, v.1)),
            None => too_old.push(format!("{} printed no version", candidate.display())),
        }
    }
    Err(Error::new(format!(
        "no PgBouncer {}.{} or later found ({}): run scripts/pgbouncer-build, or set \
         COMPUTE_PGBOUNCER to one",
        MIN_VERSION.0,
        MIN_VERSION.1,
        if too_old.is_empty() {
            "none at all".to_owned()
        } else {
            too_old.join(", ")
        }
    )))
}

/// `(major, minor)` from `pgbouncer --version` ("PgBouncer 1.24.1").
fn version(binary: &Path) -> Option<(u32, u32)> {
    let out = Command::new(binary).arg("--version").output().ok()?;
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

fn parse_version(text: &str) -> Option<(u32, u32)> {
    let rest = text.lines().next()?.strip_prefix("PgBouncer ")?;
    let mut parts = rest.split(['.', ' ', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_version_line() {
        assert_eq!(
            parse_version("PgBouncer 1.24.1\nlibevent 2.1.12-stable\n"),
            Some((1, 24))
        );
        assert_eq!(parse_version("PgBouncer 1.18.0\n"), Some((1, 18)));
        assert!(parse_version("PgBouncer 1.18.0\n").is_some_and(|v| v < MIN_VERSION));
        assert_eq!(parse_version("pgbouncer"), None);
    }
}
