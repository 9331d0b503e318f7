//! A private PostgreSQL server started from the server binaries installed on the machine: process
//! and operating-system code (initdb, a keeper thread, signals), kept apart from the domain.
//!
//! Used by `compute-api dev` and by the tests when no `DATABASE_URL` is given. Layout of the data
//! directory (`--data-dir`, default `.compute/`):
//!
//! ```text
//! .compute/
//!   pg/             the cluster (PGDATA), owned by the server's user
//!   pg-password     the password of the `compute` superuser, mode 0600
//!   postgres.log    the server's output
//! ```
//!
//! The server listens on a free loopback port with password authentication (SCRAM), and no Unix
//! socket. When the process runs as root, the server runs as the `postgres` user (or `nobody`),
//! because `initdb` and `postgres` refuse root. The server is a child of a keeper thread that lives
//! as long as the handle: dropping the handle stops the server with a fast shutdown (SIGINT), and
//! if the whole process dies (a crash, SIGKILL) the kernel sends the server SIGINT through
//! `PR_SET_PDEATHSIG`, so no server outlives its process.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use sqlx::Connection;
use tracing::{info, warn};

pub mod pgbouncer;

/// Why the embedded server could not be started or used, in words for the operator.
#[derive(Debug)]
pub struct Error(String);

impl Error {
    fn new(why: impl std::fmt::Display) -> Error {
        Error(why.to_string())
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Error {
        Error::new(e)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The superuser the embedded cluster is created with.
pub const SUPERUSER: &str = "compute";

/// How to start the embedded server.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// The data directory; the cluster lives in `<data_dir>/pg`.
    pub data_dir: PathBuf,
    /// `false` turns off `fsync`, `synchronous_commit` and `full_page_writes` (and turns on
    /// `track_commit_timestamp`): for throwaway test clusters only.
    pub durable: bool,
    /// The server's `max_connections`.
    pub max_connections: u32,
}

impl EmbeddedOptions {
    /// Durable defaults for a data directory a user keeps.
    pub fn durable(data_dir: impl Into<PathBuf>) -> Self {
        EmbeddedOptions {
            data_dir: data_dir.into(),
            durable: true,
            max_connections: 100,
        }
    }
}

/// A running embedded server. Dropping it stops the server.
#[derive(Debug)]
pub struct EmbeddedPostgres {
    data_dir: PathBuf,
    port: u16,
    password: String,
    version: String,
    stop: Option<mpsc::Sender<()>>,
    keeper: Option<std::thread::JoinHandle<()>>,
}

/// The unprivileged account the server runs as when this process is root.
#[derive(Debug, Clone)]
struct RunAs {
    name: String,
    uid: u32,
    gid: u32,
}

impl EmbeddedPostgres {
    /// Creates the cluster if the data directory has none, then starts the server and waits until
    /// it accepts connections. Blocking while `initdb` runs; call it before serving traffic.
    pub async fn start(options: EmbeddedOptions) -> Result<EmbeddedPostgres> {
        let started = Instant::now();
        let bin = find_server_binaries()?;
        let run_as = run_as_user()?;
        let data_dir = absolute(&options.data_dir)?;
        let password = tokio::task::spawn_blocking({
            let (bin, data_dir, run_as) = (bin.clone(), data_dir.clone(), run_as.clone());
            move || init_cluster(&bin, &data_dir, run_as.as_ref())
        })
        .await
        .map_err(Error::new)??;
        let version = server_version(&bin)?;

        let mut last_error = None;
        for _ in 0..3 {
            let port = free_port()?;
            let (stop, exited, keeper) =
                spawn_server(&bin, &data_dir, port, &options, run_as.as_ref())?;
            let mut server = EmbeddedPostgres {
                data_dir: data_dir.clone(),
                port,
                password: password.clone(),
                version: version.clone(),
                stop: Some(stop),
                keeper: Some(keeper),
            };
            match server.wait_ready(&exited).await {
                Ok(()) => {
                    info!(
                        pg.version = %server.version,
                        pg.port = port,
                        pg.data_dir = %data_dir.display(),
                        duration_ms = started.elapsed().as_millis() as u64,
                        "embedded PostgreSQL is ready"
                    );
                    return Ok(server);
                }
                Err(e) => {
                    server.shutdown();
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.unwrap_or_else(|| Error::new("embedded PostgreSQL did not start")))
    }

    /// A connection URL for database `database` on this server.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{}@127.0.0.1:{}/{database}",
            self.password, self.port
        )
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The password of [`SUPERUSER`] (a pooler in front logs in with it).
    pub fn password(&self) -> &str {
        &self.password
    }

    /// The data directory (the parent of the cluster directory).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The server's version line, as `postgres --version` prints it.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Creates `database` unless it exists.
    pub async fn ensure_database(&self, database: &str) -> Result<()> {
        let mut conn = sqlx::PgConnection::connect(&self.url("postgres")).await?;
        let exists: Option<(i32,)> = sqlx::query_as("SELECT 1 FROM pg_database WHERE datname = $1")
            .bind(database)
            .fetch_optional(&mut conn)
            .await?;
        if exists.is_none() {
            sqlx::query(&format!("CREATE DATABASE {}", quote_ident(database)))
                .execute(&mut conn)
                .await?;
        }
        conn.close().await?;
        Ok(())
    }

    /// Starts the server again after [`shutdown`](Self::shutdown), on the same data directory
    /// and port: a database restart as its clients see one (their URLs stay valid).
    pub async fn start_again(&mut self, options: &EmbeddedOptions) -> Result<()> {
        self.shutdown();
        let bin = find_server_binaries()?;
        let run_as = run_as_user()?;
        let (stop, exited, keeper) =
            spawn_server(&bin, &self.data_dir, self.port, options, run_as.as_ref())?;
        self.stop = Some(stop);
        self.keeper = Some(keeper);
        self.wait_ready(&exited).await
    }

    /// Stops the server (fast shutdown) and waits for it to exit.
    pub fn shutdown(&mut self) {
        drop(self.stop.take());
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.join();
        }
    }

    async fn wait_ready(&self, exited: &mpsc::Receiver<String>) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let url = self.url("postgres");
        loop {
            if let Ok(status) = exited.try_recv() {
                return Err(Error::new(format!(
                    "embedded PostgreSQL exited during start-up ({status}); last lines of {}:\n{}",
                    self.log_path().display(),
                    log_tail(&self.log_path(), 15)
                )));
            }
            match sqlx::PgConnection::connect(&url).await {
                Ok(conn) => {
                    let _ = conn.close().await;
                    return Ok(());
                }
                Err(e) if Instant::now() > deadline => {
                    return Err(Error::new(format!(
                        "embedded PostgreSQL did not accept connections within 60 s: {e}; see {}",
                        self.log_path().display()
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    fn log_path(&self) -> PathBuf {
        self.data_dir.join("postgres.log")
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Quotes an SQL identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn absolute(path: &Path) -> Result<PathBuf> {
    if path.is_absolute() {
        Ok(path.to_path_buf())
    } else {
        Ok(std::env::current_dir().map_err(Error::new)?.join(path))
    }
}

/// The directory holding `initdb` and `postgres`: from `PATH` first, then the newest
/// `/usr/lib/postgresql/<version>/bin`.
fn find_server_binaries() -> Result<PathBuf> {
    find_server_binaries_in(std::env::var_os("PATH"), Path::new("/usr/lib/postgresql"))
}

fn find_server_binaries_in(path: Option<std::ffi::OsString>, lib_root: &Path) -> Result<PathBuf> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    if let Some(path) = path
        && let Some(dir) = std::env::split_paths(&path).find(|d| has_both(d))
    {
        return Ok(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir(lib_root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            has_both(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        Error::new(
            "no PostgreSQL server binaries (initdb, postgres) on PATH or under \
             /usr/lib/postgresql/<version>/bin. Install the server package (Debian/Ubuntu: \
             `apt install postgresql`; Fedora: `dnf install postgresql-server`; macOS: \
             `brew install postgresql`), or set DATABASE_URL to a server you run yourself",
        )
    })
}

fn server_version(bin: &Path) -> Result<String> {
    let out = Command::new(bin.join("postgres"))
        .arg("--version")
        .output()
        .map_err(Error::new)?;
    let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    // "postgres (PostgreSQL) 15.20 (Debian …)" → "PostgreSQL 15.20 (Debian …)"
    Ok(line
        .strip_prefix("postgres (PostgreSQL) ")
        .map(|rest| format!("PostgreSQL {rest}"))
        .unwrap_or(line))
}

/// When this process is root, the account the server runs as, read from `/etc/passwd`.
fn run_as_user() -> Result<Option<RunAs>> {
    if !is_root() {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd").map_err(Error::new)?;
    for wanted in ["postgres", "nobody"] {
        for line in passwd.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() >= 4
                && fields[0] == wanted
                && let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse())
            {
                return Ok(Some(RunAs {
                    name: wanted.to_owned(),
                    uid,
                    gid,
                }));
            }
        }
    }
    Err(Error::new(
        "running as root, and neither a `postgres` nor a `nobody` account exists to run the \
         embedded PostgreSQL server (it refuses root); create one or run as another user",
    ))
}

fn is_root() -> bool {
    fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

/// Creates the cluster when `<data_dir>/pg` has none; returns the superuser's password.
fn init_cluster(bin: &Path, data_dir: &Path, run_as: Option<&RunAs>) -> Result<String> {
    let pg_dir = data_dir.join("pg");
    let password_file = data_dir.join("pg-password");
    fs::create_dir_all(data_dir).map_err(|e| {
        Error::new(format!(
            "cannot create data directory {}: {e}",
            data_dir.display()
        ))
    })?;
    if pg_dir.join("PG_VERSION").is_file() {
        let password = fs::read_to_string(&password_file).map_err(|e| {
            Error::new(format!(
                "{} holds a cluster but {} is unreadable ({e}); remove the data directory to start afresh",
                pg_dir.display(),
                password_file.display()
            ))
        })?;
        return Ok(password.trim().to_owned());
    }
    let password = random_hex(16)?;
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&password_file)
        .map_err(Error::new)?;
    writeln!(file, "{password}").map_err(Error::new)?;
    drop(file);
    fs::create_dir_all(&pg_dir).map_err(Error::new)?;
    fs::set_permissions(&pg_dir, fs::Permissions::from_mode(0o700)).map_err(Error::new)?;
    if let Some(user) = run_as {
        for path in [&pg_dir, &password_file] {
            std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).map_err(Error::new)?;
        }
    }
    let mut initdb = Command::new(bin.join("initdb"));
    initdb
        .arg("-D")
        .arg(&pg_dir)
        .args([
            "-U",
            SUPERUSER,
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--no-locale",
        ])
        .arg(format!("--pwfile={}", password_file.display()))
        .env("TZ", "UTC");
    if let Some(user) = run_as {
        initdb.uid(user.uid).gid(user.gid);
    }
    let started = Instant::now();
    info!(pg.data_dir = %pg_dir.display(), "creating the embedded PostgreSQL cluster (initdb)");
    let out = initdb.output().map_err(Error::new)?;
    if !out.status.success() {
        let hint = match run_as {
            Some(user) => format!(
                " The server runs as `{}` because this process is root: every directory above {} \
                 must be searchable by it (or choose another --data-dir, such as one under /tmp).",
                user.name,
                pg_dir.display()
            ),
            None => String::new(),
        };
        let _ = fs::remove_dir_all(&pg_dir);
        return Err(Error::new(format!(
            "initdb failed ({}): {}{}{hint}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim(),
        )));
    }
    info!(
        duration_ms = started.elapsed().as_millis() as u64,
        "initdb done"
    );
    Ok(password)
}

/// Random bytes as lowercase hex (for the server's password; this crate uses no other of ours).
fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| Error::new(format!("getrandom: {e}")))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(Error::new)?;
    Ok(listener.local_addr().map_err(Error::new)?.port())
}

type Spawned = (
    mpsc::Sender<()>,
    mpsc::Receiver<String>,
    std::thread::JoinHandle<()>,
);

/// Starts `postgres` from a keeper thread that owns the child until told to stop.
fn spawn_server(
    bin: &Path,
    data_dir: &Path,
    port: u16,
    options: &EmbeddedOptions,
    run_as: Option<&RunAs>,
) -> Result<Spawned> {
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(data_dir.join("postgres.log"))
        .map_err(Error::new)?;
    let mut cmd = Command::new(bin.join("postgres"));
    cmd.arg("-D")
        .arg(data_dir.join("pg"))
        .arg("-p")
        .arg(port.to_string())
        .args(["-c", "listen_addresses=127.0.0.1"])
        .args(["-c", "unix_socket_directories="])
        .args(["-c", "timezone=UTC"])
        .arg("-c")
        .arg(format!("max_connections={}", options.max_connections))
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(Error::new)?)
        .stderr(log);
    if !options.durable {
        // Commit timestamps let the torture test check the order of commits.
        for setting in [
            "fsync=off",
            "synchronous_commit=off",
            "full_page_writes=off",
            "track_commit_timestamp=on",
        ] {
            cmd.args(["-c", setting]);
        }
    }
    if let Some(user) = run_as {
        cmd.uid(user.uid).gid(user.gid);
    }
    // Its own process group: a Ctrl-C in the terminal reaches this process, which drains its
    // requests and then stops the server, instead of the server dying under them.
    cmd.process_group(0);
    die_with_parent(&mut cmd, libc::SIGINT);

    keep(cmd, "postgres", |child| {
        // Fast shutdown; killed if it ignores that for 30 s.
        signal(child.id(), libc::SIGINT);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() > deadline => {
                    warn!("embedded PostgreSQL ignored fast shutdown for 30 s; killing it");
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        info!("embedded PostgreSQL stopped");
    })
}

/// Spawns `cmd` from a keeper thread that owns the child until told to stop (or until the sender
/// is dropped), then runs `stop` on it. The receiver hears of an exit the keeper did not ask
/// for. A thread of its own because the parent-death signal ([`die_with_parent`]) fires when the
/// *thread* that spawned the child ends, and callers (tests) may ask from short-lived threads.
fn keep(
    mut cmd: Command,
    name: &'static str,
    stop: impl FnOnce(&mut std::process::Child) + Send + 'static,
) -> Result<Spawned> {
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let (exit_tx, exit_rx) = mpsc::channel::<String>();
    let (spawned_tx, spawned_rx) = mpsc::channel::<std::io::Result<()>>();
    let keeper = std::thread::Builder::new()
        .name(format!("keeper-{name}"))
        .spawn(move || {
            let mut child = match cmd.spawn() {
                Ok(child) => {
                    let _ = spawned_tx.send(Ok(()));
                    child
                }
                Err(e) => {
                    let _ = spawned_tx.send(Err(e));
                    return;
                }
            };
            loop {
                match stop_rx.recv_timeout(Duration::from_millis(200)) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if let Ok(Some(status)) = child.try_wait() {
                            warn!(%status, "{name} exited");
                            let _ = exit_tx.send(status.to_string());
                            return;
                        }
                    }
                    // Told to stop, or the handle is gone.
                    Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                        stop(&mut child);
                        return;
                    }
                }
            }
        })
        .map_err(Error::new)?;
    match spawned_rx.recv() {
        Ok(Ok(())) => Ok((stop_tx, exit_rx, keeper)),
        Ok(Err(e)) => Err(Error::new(format!("cannot start {name}: {e}"))),
        Err(_) => Err(Error::new(format!("the {name} keeper thread died"))),
    }
}

/// Asks the kernel to send the child `sig` (SIGINT is PostgreSQL's fast shutdown) when the thread
/// that spawned it exits, which includes this whole process dying. It is set after the change of
/// user, which would otherwise clear it.
#[expect(unsafe_code, reason = "pre_exec and prctl have no safe wrapper in std")]
fn die_with_parent(cmd: &mut Command, sig: libc::c_int) {
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which is
    // async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[expect(unsafe_code, reason = "kill(2) has no safe wrapper in std")]
fn signal(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) takes plain integers; the pid is our own child, not yet reaped.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

fn log_tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Whether a process with this pid is alive (for cleaning up after dead test runs).
#[expect(
    unsafe_code,
    reason = "kill(2) with signal 0 has no safe wrapper in std"
)]
pub fn process_alive(pid: u32) -> bool {
    match libc::pid_t::try_from(pid) {
        // SAFETY: signal 0 only checks that the process exists.
        Ok(pid) => unsafe { libc::kill(pid, 0) == 0 },
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_server_binaries_name_the_package_to_install() {
        let nowhere = std::env::temp_dir().join("compute-no-such-dir");
        let err = find_server_binaries_in(Some(nowhere.clone().into_os_string()), &nowhere)
            .expect_err("nothing to find");
        let message = err.to_string();
        assert!(message.contains("apt install postgresql"), "{message}");
        assert!(message.contains("DATABASE_URL"), "{message}");
    }

    #[test]
    fn the_newest_version_under_the_library_root_wins() {
        let root = std::env::temp_dir().join(format!("compute-pgbin-{}", std::process::id()));
        for v in ["13", "15", "9"] {
            let bin = root.join(v).join("bin");
            fs::create_dir_all(&bin).expect("mkdir");
            fs::write(bin.join("initdb"), "").expect("initdb");
            fs::write(bin.join("postgres"), "").expect("postgres");
        }
        let found = find_server_binaries_in(None, &root).expect("found");
        assert_eq!(found, root.join("15").join("bin"));
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
