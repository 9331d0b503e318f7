//! Connections, migrations and transactions.
//!
//! Every transaction of the system opens through [`Db::tx`], which knows the transaction's
//! [`TxKind`]: it states the isolation level explicitly (READ COMMITTED), sets `lock_timeout` and
//! `statement_timeout` with `SET LOCAL` (so nothing leaks into a pooled connection), and retries
//! deadlocks and serialization failures a bounded number of times. Nothing here keeps session state
//! on a connection, so the system runs unchanged behind a transaction-pooling proxy.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgConnection, PgPool};
use tracing::{Instrument, debug, warn};

use crate::error::{Error, Result};

pub mod fence;
pub mod poke;

/// The migrations of the system, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// A future borrowed from a transaction's connection, as [`Db::tx`] takes it.
pub type TxFuture<'c, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'c>>;

/// How a transaction behaves: its timeouts and whether it may write.
///
/// All kinds run at READ COMMITTED: the invariants live in constraints, guarded updates and row
/// locks, which are correct at that level (see `docs/database-locks.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxKind {
    /// A read for a query; `READ ONLY`, short statement timeout.
    Read,
    /// A change made by a request: short lock wait, so a caller sees `LOCK_TIMEOUT` quickly.
    Write,
    /// Background work (reconcilers, pruning): longer lock waits and statements.
    Maintenance,
}

impl TxKind {
    /// The kind's label in spans and metrics.
    pub fn label(self) -> &'static str {
        match self {
            TxKind::Read => "read",
            TxKind::Write => "write",
            TxKind::Maintenance => "maintenance",
        }
    }

    /// `lock_timeout` of the kind.
    pub fn lock_timeout(self) -> Duration {
        match self {
            TxKind::Read | TxKind::Write => Duration::from_secs(2),
            TxKind::Maintenance => Duration::from_secs(10),
        }
    }

    /// `statement_timeout` of the kind.
    pub fn statement_timeout(self) -> Duration {
        match self {
            TxKind::Read | TxKind::Write => Duration::from_secs(10),
            TxKind::Maintenance => Duration::from_secs(60),
        }
    }

    fn read_only(self) -> bool {
        matches!(self, TxKind::Read)
    }

    /// The statement that opens a transaction of this kind: one round trip for `BEGIN` and the
    /// kind's settings.
    pub fn begin_statement(self) -> String {
        format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED{}; SET LOCAL lock_timeout = '{}ms'; SET LOCAL statement_timeout = '{}ms'",
            if self.read_only() { " READ ONLY" } else { "" },
            self.lock_timeout().as_millis(),
            self.statement_timeout().as_millis(),
        )
    }

    /// [`TxKind::begin_statement`], and with `retry_contention` false also
    /// `SET LOCAL compute.contention_retry = 'off'`, which tells the SQL functions that replan
    /// on a deadlock (`compute_place`, migration 0025) to fail instead ([`Db::without_contention_retry`]).
    fn begin_statement_retrying(self, retry_contention: bool) -> String {
        let begin = self.begin_statement();
        if retry_contention {
            begin
        } else {
            format!("{begin}; SET LOCAL compute.contention_retry = 'off'")
        }
    }
}

/// How many times a transaction is attempted when it hits a deadlock or serialization failure.
pub const MAX_ATTEMPTS: u32 = 3;

/// Settings for the connection pool.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    /// The connections' default `statement_timeout`, which bounds single-statement reads that run
    /// outside `Db::tx` (transactions set their own with `SET LOCAL`). Sent as a startup
    /// parameter: behind PgBouncer, allow it with `ignore_startup_parameters = options`, or set
    /// it on the role instead and pass `None`.
    pub statement_timeout: Option<Duration>,
    /// Where `LISTEN` connects when `url` is a transaction pooler (PgBouncer's transaction mode
    /// hands a session's server connection to others between transactions, so a `LISTEN` through
    /// it hears nothing): PostgreSQL itself. `None` listens on `url`. The listeners are
    /// wake-ups only: without one, readers fall back to their polls.
    pub listen_url: Option<String>,
}

impl Default for PoolSettings {
    fn default() -> Self {
        PoolSettings {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Some(Duration::from_secs(30)),
            listen_url: None,
        }
    }
}

/// The database handle every component shares: a pool and the transaction runner.
#[derive(Debug, Clone)]
pub struct Db {
    pool: PgPool,
    metrics: crate::metrics::TxMetrics,
    /// When set, every transaction of this handle checks the lease first ([`Db::fenced`]).
    fence: Option<fence::Fence>,
    /// The keys that seal sink secrets at rest; none stores them as they are (development).
    keyring: Option<std::sync::Arc<crate::secrets::Keyring>>,
    /// Whether sinks may name private, loopback and link-local targets
    /// (`--webhooks-allow-private`, [`crate::sinks::egress`]).
    private_webhooks: bool,
    /// Wakes the outbox readers after a writing commit (`poke::Poker`).
    poker: Option<poke::Poker>,
    /// Where `LISTEN` connects, when not through the pool ([`PoolSettings::listen_url`]).
    listen_url: Option<std::sync::Arc<str>>,
    /// Whether deadlocks and serialization failures run the transaction again (always, but in
    /// the tests that prove the lock order: [`Db::without_contention_retry`]).
    retry_contention: bool,
}

/// How long a pooled connection may sit idle and still be handed out without a ping.
const ALIVE_BYPASS: Duration = Duration::from_millis(500);

impl Db {
    /// Connects a pool to `url`. Statement logging is at `debug` level with slow statements at
    /// `warn`.
    pub async fn connect(url: &str, settings: &PoolSettings) -> Result<Db> {
        let mut options: PgConnectOptions = url
            .parse::<PgConnectOptions>()
            .map_err(|e| Error::internal(format!("invalid database URL: {e}")))?;
        if let Some(t) = settings.statement_timeout {
            options = options.options([("statement_timeout", format!("{}ms", t.as_millis()))]);
        }
        let options = options
            .application_name("compute")
            .log_statements(tracing::log::LevelFilter::Debug)
            .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_millis(500));
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections)
            .acquire_timeout(settings.acquire_timeout)
            // sqlx pings every connection it hands out by default: a round trip more for every
            // statement or transaction. A connection used in the last half second is handed out
            // as it is (HikariCP's `aliveBypassWindowMs` does the same); one idle for longer, which
            // a database restart or a pooler's idle timeout may have cut, is pinged first and
            // replaced if the ping fails. A connection that dies within the window fails its
            // statement with `UNAVAILABLE`, which is retryable, as a death mid-statement does.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for >= ALIVE_BYPASS {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .connect_with(options)
            .await?;
        let mut db = Db::from_pool(pool);
        db.listen_url = settings.listen_url.as_deref().map(std::sync::Arc::from);
        Ok(db)
    }

    /// A connection for `LISTEN` of its own: on [`PoolSettings::listen_url`] when set (PostgreSQL
    /// itself, past a transaction pooler), else with the pool's options.
    pub async fn listener(&self) -> Result<sqlx::postgres::PgListener> {
        Ok(match &self.listen_url {
            Some(url) => sqlx::postgres::PgListener::connect(url).await?,
            None => sqlx::postgres::PgListener::connect_with(&self.pool).await?,
        })
    }

    /// Listens on `channel` (a poke sent after a commit, [`Db::poke_after_commit`]) and calls
    /// `on_poke` for each, until the listening connection fails (the error is returned; call
    /// again to reconnect). Every listener also polls: a lost poke only delays.
    pub async fn listen(&self, channel: &str, on_poke: impl Fn()) -> Result<()> {
        let mut listener = self.listener().await?;
        listener.listen(channel).await?;
        tracing::debug!(channel, "listening for pokes");
        loop {
            listener.recv().await?;
            on_poke();
        }
    }

    /// Wraps an existing pool.
    pub fn from_pool(pool: PgPool) -> Db {
        let poker = poke::Poker::start(pool.clone());
        Db {
            pool,
            metrics: crate::metrics::TxMetrics::default(),
            fence: None,
            keyring: None,
            private_webhooks: false,
            poker,
            listen_url: None,
            retry_contention: true,
        }
    }

    /// This handle with deadlocks (40P01) and serialization failures (40001) returned at once as
    /// [`Error::Contention`] instead of retried, by `Db::tx` and by the placement's replanning
    /// inside `compute_place`: a test mode, in which an inversion of the documented lock order
    /// fails a test instead of being retried away.
    pub fn without_contention_retry(mut self) -> Db {
        self.retry_contention = false;
        self
    }

    /// This handle with `keyring` sealing and opening sink secrets.
    pub fn with_keyring(mut self, keyring: Option<std::sync::Arc<crate::secrets::Keyring>>) -> Db {
        self.keyring = keyring;
        self
    }

    /// This handle letting sinks name private, loopback and link-local targets, or not (the
    /// default): `--webhooks-allow-private`.
    pub fn allowing_private_webhooks(mut self, allow: bool) -> Db {
        self.private_webhooks = allow;
        self
    }

    /// Whether sinks may name private targets ([`Db::allowing_private_webhooks`]).
    pub fn private_webhooks_allowed(&self) -> bool {
        self.private_webhooks
    }

    /// The keys that seal and open sink secrets, when configured.
    pub fn keyring(&self) -> Option<&crate::secrets::Keyring> {
        self.keyring.as_deref()
    }

    /// Registers the transaction metrics (latency and errors by transaction name) in `registry`.
    pub fn register_metrics(&self, registry: &crate::metrics::Registry) {
        self.metrics.register(registry);
        // Every process that serves with a database traces the same way.
        crate::metrics::register_trace_metrics(registry);
    }

    /// Counts one `createReservation` by its outcome (`compute_reservation_creates_total`).
    pub(crate) fn count_create(&self, outcome: &'static str) {
        self.metrics
            .creates
            .get_or_create(&crate::metrics::OutcomeLabels { outcome })
            .inc();
    }

    /// The underlying pool, for metrics and for tests.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The pool's connections, for metrics.
    pub fn pool_stats(&self) -> PoolStats {
        PoolStats {
            size: self.pool.size(),
            idle: self.pool.num_idle() as u32,
            max: self.pool.options().get_max_connections(),
        }
    }

    /// Applies every pending migration.
    pub async fn migrate(&self) -> Result<()> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// Grants `role` what the API and the workers need at run time, and nothing more: reading and
    /// writing every table's rows, the sequences, and executing the schema's functions. Not
    /// `CREATE` in the schema, not `TRUNCATE`, and only reading `_sqlx_migrations`; tables belong
    /// to the owner who migrates, so the role cannot alter or drop them. Run by the owner after
    /// migrating (`compute-api migrate --runtime-role`), again after each migration (new tables).
    pub async fn grant_runtime(&self, role: &str) -> Result<()> {
        let ok = !role.is_empty()
            && role.len() <= 63
            && role.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && role
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !ok {
            return Err(Error::bad_input(
                "runtime-role",
                format!("`{role}` is not a role name: lowercase letters, digits and `_`"),
            ));
        }
        // The name is checked above, so it can stand unquoted in the statements.
        let statements = format!(
            "GRANT USAGE ON SCHEMA public TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role};
             REVOKE INSERT, UPDATE, DELETE ON _sqlx_migrations FROM {role};
             GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {role};
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO {role};"
        );
        sqlx::raw_sql(&statements).execute(&self.pool).await?;
        Ok(())
    }

    /// Compares the applied migrations with the ones this binary carries.
    pub async fn migration_status(&self) -> Result<MigrationStatus> {
        let applied: Vec<(i64, bool)> =
            sqlx::query!("SELECT version, success FROM _sqlx_migrations ORDER BY version")
                .fetch_all(&self.pool)
                .await
                .map(|rows| rows.into_iter().map(|r| (r.version, r.success)).collect())
                .or_else(|e| match &e {
                    // 42P01: the table does not exist yet, nothing was ever applied.
                    sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => {
                        Ok(Vec::new())
                    }
                    _ => Err(e),
                })?;
        let expected: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
        let applied_ok: Vec<i64> = applied
            .iter()
            .filter(|(_, ok)| *ok)
            .map(|(v, _)| *v)
            .collect();
        let pending = expected.iter().filter(|v| !applied_ok.contains(v)).count();
        let unknown = applied_ok.iter().filter(|v| !expected.contains(v)).count();
        Ok(MigrationStatus {
            expected: expected.len(),
            applied: applied_ok.len(),
            pending,
            unknown,
            failed: applied.iter().filter(|(_, ok)| !ok).count(),
        })
    }

    /// Runs `body` in a transaction of `kind`, committing when it returns `Ok`.
    ///
    /// Deadlocks (40P01) and serialization failures (40001) roll back and run `body` again, up to
    /// [`MAX_ATTEMPTS`] times in all; past that the caller gets [`Error::Contention`]
    /// (`LOCK_TIMEOUT`). A lock wait past the kind's `lock_timeout` is [`Error::LockTimeout`] at
    /// once: waiting again would only wait again.
    ///
    /// `name` names the transaction in its span, its log lines and its metrics
    /// (`compute_db_transaction_seconds`, `compute_db_transaction_errors`): the command it
    /// serves, such as `create_reservation`.
    pub async fn tx<T, F>(&self, name: &'static str, kind: TxKind, body: F) -> Result<T>
    where
        T: Send,
        F: for<'c> FnMut(&'c mut PgConnection) -> TxFuture<'c, T> + Send,
    {
        self.run(name, kind, Mode::Transaction(self.fence.as_ref()), body)
            .await
    }

    /// Runs `body`, which sends exactly one statement, in that statement's own implicit
    /// transaction: one round trip in all where [`Db::tx`] takes three (`BEGIN`, the work,
    /// `COMMIT`), and no backend waits idle in a transaction on this process meanwhile. For a
    /// write done by one SQL function that states what a `BEGIN` of `kind` would: it checks READ
    /// COMMITTED and sets `lock_timeout` ([`TxKind::lock_timeout`]) and the contention switch
    /// ([`Db::retries_contention`]) with `set_config(…, true)`; its time is bounded by the
    /// connection's `statement_timeout` ([`PoolSettings::statement_timeout`]). Deadlocks and
    /// serialization failures run it again as [`Db::tx`] does, with the same span and metrics.
    /// A fenced handle refuses it (the fence is a statement of the transaction).
    pub async fn statement<T, F>(&self, name: &'static str, kind: TxKind, body: F) -> Result<T>
    where
        T: Send,
        F: for<'c> FnMut(&'c mut PgConnection) -> TxFuture<'c, T> + Send,
    {
        if self.fence.is_some() {
            return Err(Error::internal(format!(
                "{name}: a fenced handle runs transactions, not single statements"
            )));
        }
        self.run(name, kind, Mode::Statement, body).await
    }

    /// Whether deadlocks and serialization failures are retried (false only in the lock-order
    /// tests, [`Db::without_contention_retry`]); a single-statement call passes it to its SQL.
    pub fn retries_contention(&self) -> bool {
        self.retry_contention
    }

    /// This handle with every transaction fenced by `fence`: the first statement of each checks
    /// the lease (`FOR SHARE`, [`fence::check`]) and fails with `LeaseLost` when another
    /// holder took it, so a worker that lost its lease mid-pass writes nothing more. Workers hand
    /// it to every domain step they run under a lease (the reconciler's passes, the work
    /// queue's items).
    pub fn fenced(&self, fence: &fence::Fence) -> Db {
        Db {
            fence: Some(fence.clone()),
            ..self.clone()
        }
    }

    async fn run<T, F>(
        &self,
        name: &'static str,
        kind: TxKind,
        mode: Mode<'_>,
        body: F,
    ) -> Result<T>
    where
        T: Send,
        F: for<'c> FnMut(&'c mut PgConnection) -> TxFuture<'c, T> + Send,
    {
        // OpenTelemetry's database conventions: the system, and the transaction's name as the
        // query's summary (never a statement's text).
        let span = tracing::debug_span!(
            "tx",
            otel.name = name,
            otel.kind = "client",
            tx.name = name,
            tx.kind = kind.label(),
            db.system.name = "postgresql",
            db.query.summary = name,
        );
        let started = std::time::Instant::now();
        let result = self
            .run_in_span(name, kind, mode, body)
            .instrument(span)
            .await;
        let labels = crate::metrics::TxLabels {
            transaction: name,
            kind: kind.label(),
        };
        self.metrics
            .seconds
            .get_or_create(&labels)
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            self.metrics
                .errors
                .get_or_create(&crate::metrics::TxErrorLabels {
                    transaction: name,
                    code: e.code().as_str(),
                })
                .inc();
        }
        result
    }

    async fn run_in_span<T, F>(
        &self,
        name: &'static str,
        kind: TxKind,
        mode: Mode<'_>,
        mut body: F,
    ) -> Result<T>
    where
        T: Send,
        F: for<'c> FnMut(&'c mut PgConnection) -> TxFuture<'c, T> + Send,
    {
        let mut attempt = 1;
        loop {
            let attempt_result = match mode {
                Mode::Transaction(fence) => self.try_tx(kind, fence, &mut body).await,
                Mode::Statement => self.try_statement(kind, &mut body).await,
            };
            match attempt_result {
                Err(Error::Contention { sqlstate, .. })
                    if attempt < MAX_ATTEMPTS && self.retry_contention =>
                {
                    debug!(
                        tx.name = name,
                        tx.attempt = attempt,
                        sqlstate,
                        "transaction retried"
                    );
                    attempt += 1;
                }
                Err(Error::Contention { sqlstate, .. }) => {
                    warn!(
                        tx.name = name,
                        tx.attempts = attempt,
                        sqlstate,
                        "transaction gave up after repeated contention"
                    );
                    return Err(Error::Contention {
                        sqlstate,
                        attempts: attempt,
                    });
                }
                other => return other,
            }
        }
    }

    /// Runs `body` in a transaction of `kind` whose first statement is the lease fence: the lease
    /// row `FOR SHARE` at the holder's epoch. A lost lease is [`Error::LeaseLost`] and nothing is
    /// written; a takeover waits for this transaction to end.
    pub async fn fenced_tx<T, F>(
        &self,
        name: &'static str,
        fence: &fence::Fence,
        kind: TxKind,
        body: F,
    ) -> Result<T>
    where
        T: Send,
        F: for<'c> FnMut(&'c mut PgConnection) -> TxFuture<'c, T> + Send,
    {
        self.run(name, kind, Mode::Transaction(Some(fence)), body)
            .await
    }

    async fn try_tx<T, F>(
        &self,
        kind: TxKind,
        fence: Option<&fence::Fence>,
        body: &mut F,
    ) -> Result<T>
    where
        F: for<'c> FnMut(&'c mut PgConnection) -> TxFuture<'c, T>,
    {
        let mut conn = Abandonable::new(self.pool.acquire().await?);
        let mut begin = kind.begin_statement_retrying(self.retry_contention);
        if let Some(tp) = sampled_traceparent() {
            // Hex digits and dashes only (`TraceParent`'s `Display`): nothing to quote.
            begin.push_str("; SET LOCAL compute.traceparent = '");
            begin.push_str(&tp);
            begin.push('\'');
        }
        let ran = async {
            let mut tx = sqlx::Connection::begin_with(conn.get(), begin).await?;
            if let Some(fence) = fence {
                fence::check(&mut tx, fence).await?;
            }
            let value = body(&mut tx).await?;
            tx.commit().await?;
            Ok::<T, Error>(value)
        }
        .await;
        // Ran to its end, committed or not: a transaction that failed was dropped whole, and
        // sqlx rolls it back before the connection is reused.
        conn.finished();
        let value = ran?;
        if !kind.read_only()
            && let Some(poker) = &self.poker
        {
            poker.poke();
        }
        Ok(value)
    }

    async fn try_statement<T, F>(&self, kind: TxKind, body: &mut F) -> Result<T>
    where
        F: for<'c> FnMut(&'c mut PgConnection) -> TxFuture<'c, T>,
    {
        // No guard: a statement abandoned mid-flight leaves no transaction open (its implicit
        // one ends with it), and sqlx reads its answer before reusing the connection.
        let mut conn = self.pool.acquire().await?;
        let value = body(&mut conn).await?;
        if !kind.read_only()
            && let Some(poker) = &self.poker
        {
            poker.poke();
        }
        Ok(value)
    }

    /// Sends `NOTIFY channel, payload` after the caller's transaction committed, from a
    /// transaction of its own, folded with the other pokes of the next [`poke::POKE_INTERVAL`]:
    /// never inside a writing transaction (a notifying commit takes PostgreSQL's one
    /// cluster-wide notify lock). Outside a Tokio runtime it sends nothing; the listeners poll.
    pub fn poke_after_commit(&self, channel: &str, payload: &str) {
        if let Some(poker) = &self.poker {
            poker.poke_to(channel, payload);
        }
    }

    /// Reads `compute_now()`, the one clock of the system.
    pub async fn compute_now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        Ok(sqlx::query_scalar!(r#"SELECT compute_now() AS "now!""#)
            .fetch_one(&self.pool)
            .await?)
    }

    /// `compute_now()`, and whether it reads the simulated clock, in one round trip (what
    /// [`crate::clock::Clock`] samples).
    pub async fn compute_now_and_mode(&self) -> Result<(chrono::DateTime<chrono::Utc>, bool)> {
        let row = sqlx::query!(
            r#"SELECT compute_now() AS "now!", compute_clock_is_simulated() AS "simulated!""#
        )
        .fetch_one(&self.pool)
        .await?;
        Ok((row.now, row.simulated))
    }

    /// Whether `compute_now()` reads the simulated clock (tests and the simulator only).
    pub async fn clock_is_simulated(&self) -> Result<bool> {
        Ok(
            sqlx::query_scalar!(r#"SELECT compute_clock_is_simulated() AS "simulated!""#)
                .fetch_one(&self.pool)
                .await?,
        )
    }

    /// A cheap round trip, for readiness.
    pub async fn ping(&self) -> Result<()> {
        sqlx::query!("SELECT 1 AS one")
            .fetch_one(&self.pool)
            .await?;
        Ok(())
    }
}

/// The W3C `traceparent` of the current span when it is traced and sampled: what a transaction
/// names in `compute.traceparent` (migration 0033), so the outbox events, work-queue items and
/// commands it writes carry the trace on to the processes that act on them.
pub fn sampled_traceparent() -> Option<String> {
    compute_telemetry::context::current()
        .filter(|t| t.sampled)
        .map(|t| t.to_string())
}

/// A pooled connection that is closed, not returned to the pool, when the future using it is
/// dropped before [`Abandonable::finished`] (a request abandoned by its client, a worker loop
/// stopped mid-step). sqlx queues a `ROLLBACK` for a dropped [`sqlx::Transaction`], but not for one
/// dropped while its `BEGIN` is still in flight: that connection would go back to the pool inside
/// an open transaction, and every later autocommit statement on it (a lease taken, a lease
/// released) would hold its row locks until the connection's next `COMMIT`. Closing the connection
/// ends whatever transaction it had on the server.
struct Abandonable {
    conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
    finished: bool,
}

impl Abandonable {
    fn new(conn: sqlx::pool::PoolConnection<sqlx::Postgres>) -> Self {
        Self {
            conn,
            finished: false,
        }
    }

    fn get(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// The work ran to its end (committed, or failed with its transaction dropped whole, which
    /// sqlx rolls back): the connection may go back to the pool.
    fn finished(&mut self) {
        self.finished = true;
    }
}

impl Drop for Abandonable {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.close_on_drop();
        }
    }
}

/// How [`Db::run`] runs its body: in a transaction (fenced or not), or as one statement.
#[derive(Clone, Copy)]
enum Mode<'f> {
    Transaction(Option<&'f fence::Fence>),
    Statement,
}

/// Connection counts of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Open connections, idle or in use.
    pub size: u32,
    pub idle: u32,
    pub max: u32,
}

/// How the applied migrations compare with the ones the binary carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationStatus {
    pub expected: usize,
    pub applied: usize,
    pub pending: usize,
    /// Applied versions this binary does not know: a newer binary migrated the database.
    pub unknown: usize,
    pub failed: usize,
}

impl MigrationStatus {
    /// Every migration this binary carries is applied and none failed.
    pub fn is_current(&self) -> bool {
        self.pending == 0 && self.failed == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn begin_statement_states_isolation_and_timeouts() {
        assert_eq!(
            TxKind::Read.begin_statement(),
            "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; SET LOCAL lock_timeout = '2000ms'; SET LOCAL statement_timeout = '10000ms'"
        );
        assert!(
            TxKind::Write
                .begin_statement()
                .starts_with("BEGIN ISOLATION LEVEL READ COMMITTED;")
        );
    }
}
