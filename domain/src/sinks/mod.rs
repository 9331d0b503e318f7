//! Webhook sinks: where a tenant (or an operator, for every event) wants its events POSTed, and
//! each sink's position in the outbox.
//!
//! A sink starts at the present when it is created. Its worker (the holder of
//! `singleton:outbox-dispatch:<sink id>`) reads the events after the sink's cursor, delivers them
//! in order, and saves the new cursor in a transaction fenced by that lease after every batch.
//! Failures back off exponentially (2, 4, 8 … 300 s) and, after [`FAILING_AFTER`] in a row, mark
//! the sink `failing`; other sinks are not held up. A sink whose undelivered events were pruned
//! past the outbox's hard maximum age is marked `behind` and resumes at the pruned front.

use crate::events::{self, EventSinkPayload, EventType};
use crate::ids::{SinkId, TenantId};
use sqlx::{FromRow, PgConnection};

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::outbox::{Cursor, EventFilter};
use crate::page::{Page, PageArgs};

pub mod egress;
pub mod model;
mod payload;

pub use model::SinkState;

/// Consecutive failures after which a sink shows as `failing`.
pub const FAILING_AFTER: i32 = 3;
/// The most events one POST of a batching sink carries.
pub const MAX_BATCH_SIZE: i32 = 100;
/// The longest wait between two attempts of a failing sink.
pub const MAX_BACKOFF_SECONDS: f64 = 300.0;

/// The most event sinks one tenant (or the fleet, for the sinks of no tenant) may have: each is
/// a task of the dispatcher polling the outbox, and they share its connections.
pub const MAX_SINKS_PER_SCOPE: i64 = 100;

/// A sink, with its position.
#[derive(Debug, Clone, FromRow)]
pub struct Sink {
    pub id: SinkId,
    pub tenant_id: Option<TenantId>,
    pub url: String,
    pub types: Vec<String>,
    pub active: bool,
    /// Events per POST: 1 sends each event alone, more sends batches ([`MAX_BATCH_SIZE`]).
    pub batch_size: i32,
    pub state: SinkState,
    pub failures: i32,
    pub next_attempt_at: Option<chrono::DateTime<chrono::Utc>>,
    pub last_success_at: Option<chrono::DateTime<chrono::Utc>>,
    pub last_error: Option<String>,
    pub last_error_at: Option<chrono::DateTime<chrono::Utc>>,
    pub created_by: String,
    pub version: i64,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub updated_at: chrono::DateTime<chrono::Utc>,
    pub cursor_txid: i64,
    pub cursor_seq: i64,
    /// Events delivered so far.
    pub delivered: i64,
    /// `compute_now()` minus the time of the oldest event the sink has not received yet, in
    /// seconds; 0 when it has everything.
    pub lag_seconds: f64,
}

impl Sink {
    /// After the last event delivered.
    pub fn cursor(&self) -> Cursor {
        Cursor {
            txid: self.cursor_txid,
            seq: self.cursor_seq,
        }
    }
}

/// The sinks a caller may see (`tenant`: `None` for every sink), one (`id`) or a page of them:
/// the one statement that reads sink rows, with their position and lag.
async fn select_sinks(
    conn: &mut PgConnection,
    tenant: Option<&TenantId>,
    id: Option<&SinkId>,
    page: &PageArgs,
) -> Result<Vec<Sink>> {
    Ok(sqlx::query_as!(
        Sink,
        r#"SELECT s.id AS "id: _", s.tenant_id AS "tenant_id: _", s.url, s.types, s.active, s.batch_size, s.state AS "state: _",
                  s.failures, s.next_attempt_at, s.last_success_at, s.last_error, s.last_error_at, s.created_by,
                  s.version, s.created_at, s.updated_at,
                  c.txid::text::bigint AS "cursor_txid!", c.seq AS cursor_seq, c.delivered,
                  coalesce(extract(epoch FROM compute_now() - (
                     SELECT o.time FROM outbox o
                      WHERE (o.txid, o.seq) > (c.txid, c.seq) AND o.txid < pg_snapshot_xmin(pg_current_snapshot())
                        AND (s.tenant_id IS NULL OR o.tenant_id = s.tenant_id)
                        AND (cardinality(s.types) = 0 OR o.type = ANY(s.types))
                      ORDER BY o.txid, o.seq LIMIT 1)), 0)::float8 AS "lag_seconds!"
             FROM event_sinks s JOIN outbox_cursors c ON c.sink_id = s.id
            WHERE ($1::text IS NULL OR s.tenant_id = $1) AND ($2::text IS NULL OR s.id = $2)
              AND ($3::text IS NULL OR s.id > $3) AND ($4::text IS NULL OR s.id < $4)
            ORDER BY CASE WHEN $5 THEN s.id END DESC, s.id
            LIMIT $6"#,
        tenant.map(TenantId::as_str),
        id.map(SinkId::as_str),
        page.after.as_deref(),
        page.before.as_deref(),
        page.backward,
        page.limit + 1,
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// Who is asking: a tenant sees its own sinks; an operator (`None`) its fleet sinks and every
/// tenant's.
#[derive(Debug, Clone)]
pub struct Scope {
    pub tenant_id: Option<TenantId>,
}

fn check_url(url: &str) -> Result<()> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| Error::bad_input("url", "the url must start with http:// or https://"))?;
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    if host.contains('@') {
        return Err(Error::bad_input(
            "url",
            "`url` must not carry credentials (user:password@): the receiver verifies the \
             signature instead",
        ));
    }
    // Parsed as the dispatcher parses it when it posts (a port past 65535, a host with `^` in
    // it): whether or not private targets are allowed, a URL it cannot post to is refused here,
    // not retried without end.
    let parses = url::Url::parse(url).is_ok_and(|u| u.host().is_some());
    if host.is_empty()
        || host.contains(char::is_whitespace)
        || url.chars().any(char::is_control)
        || url.len() > 2000
        || !parses
    {
        // The URL is not echoed: it may be long, and is the caller's own.
        return Err(Error::bad_input(
            "url",
            "`url` is not a URL this server can POST to (http or https, a host, at most 2000 characters)",
        ));
    }
    Ok(())
}

fn check_batch_size(size: i32) -> Result<()> {
    if !(1..=MAX_BATCH_SIZE).contains(&size) {
        return Err(Error::bad_input(
            "batchSize",
            format!(
                "`batchSize` must be between 1 and {MAX_BATCH_SIZE} (events per POST), not {size}"
            ),
        ));
    }
    Ok(())
}

/// A fresh signing secret: 32 random bytes from the operating system, hex.
fn new_secret() -> Result<String> {
    Ok(format!("whsec_{}", crate::process::random_hex(32)?))
}

/// Reads one sink in `conn`.
async fn get_in(conn: &mut PgConnection, id: &SinkId) -> Result<Option<Sink>> {
    let one = PageArgs {
        after: None,
        before: None,
        limit: 1,
        backward: false,
    };
    Ok(select_sinks(conn, None, Some(id), &one).await?.pop())
}

/// One sink as `scope` may see it, or `NOT_FOUND`.
pub async fn get(db: &Db, scope: &Scope, id: &SinkId) -> Result<Sink> {
    let mut conn = db.pool().acquire().await?;
    match get_in(&mut conn, id).await? {
        Some(s) if visible(scope, &s) => Ok(s),
        _ => Err(Error::NotFound {
            kind: "event sink",
            id: id.to_string(),
        }),
    }
}

fn visible(scope: &Scope, sink: &Sink) -> bool {
    scope.tenant_id.is_none() || scope.tenant_id == sink.tenant_id
}

/// Creates a sink for `scope` that starts at the present; returns it and its signing secret
/// (which is never shown again).
#[tracing::instrument(level = "debug", skip_all, fields(created_by = created_by))]
pub async fn create(
    db: &Db,
    scope: &Scope,
    created_by: &str,
    url: &str,
    types: Vec<String>,
    batch_size: i32,
) -> Result<(Sink, String)> {
    check_url(url)?;
    egress::check_target(url, db.private_webhooks_allowed())?;
    crate::outbox::check_types(&types)?;
    check_batch_size(batch_size)?;
    let secret = new_secret()?;
    let id = SinkId::generate();
    // Stored sealed under the configured key, bound to this sink's id (docs/security.md).
    let stored = crate::secrets::seal(db.keyring(), &secret, id.as_str())?;
    let sink = db
        .tx("create_event_sink", TxKind::Write, |conn| {
            let (id, url, types, secret) = (id.clone(), url.to_owned(), types.clone(), stored.clone());
            let (tenant, by) = (scope.tenant_id.clone(), created_by.to_owned());
            Box::pin(async move {
                // At most MAX_SINKS_PER_SCOPE per tenant: creates of one tenant take turns on its
                // `sinks` advisory lock (docs/database-locks.md), so two cannot both fit the last
                // place. The count is a statement of its own, after the lock: its snapshot (READ
                // COMMITTED) then sees the sink of a create it waited for.
                let scope = tenant.as_ref().map(TenantId::as_str);
                sqlx::query!(
                    "SELECT pg_advisory_xact_lock(hashtextextended('sinks:' || coalesce($1, ''), 0))",
                    scope,
                )
                .execute(&mut *conn)
                .await?;
                let held = sqlx::query_scalar!(
                    r#"SELECT count(*) AS "n!" FROM event_sinks WHERE tenant_id IS NOT DISTINCT FROM $1"#,
                    scope,
                )
                .fetch_one(&mut *conn)
                .await?;
                if held >= MAX_SINKS_PER_SCOPE {
                    return Err(Error::Conflict {
                        message: format!(
                            "{} has {held} event sinks, the most it may have ({MAX_SINKS_PER_SCOPE}): delete one first",
                            tenant.as_ref().map_or_else(|| "the fleet".to_owned(), |t| format!("tenant {t}"))
                        ),
                        current_version: None,
                    });
                }
                sqlx::query!(
                    "INSERT INTO event_sinks (id, tenant_id, url, types, secret, created_by, batch_size) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    id.as_str(),
                    tenant.as_ref().map(TenantId::as_str),
                    url,
                    &types,
                    secret,
                    by,
                    batch_size,
                )
                .execute(&mut *conn)
                .await?;
                // The present: after the last event any reader can take now.
                let present = crate::outbox::head_in(conn).await?;
                sqlx::query!(
                    "INSERT INTO outbox_cursors (sink_id, txid, seq) VALUES ($1, $2::text::xid8, $3)",
                    id.as_str(),
                    present.txid.to_string(),
                    present.seq,
                )
                .execute(&mut *conn)
                .await?;
                let sink = get_in(conn, &id)
                    .await?
                    .ok_or_else(|| Error::internal("a sink vanished in its own transaction"))?;
                emit_change(conn, EventType::EventSinkCreated, &sink).await?;
                Ok(sink)
            })
        })
        .await?;
    Ok((sink, secret))
}

/// What `update` changes; `None` leaves a field as it is.
#[derive(Debug, Clone, Default)]
pub struct SinkChange {
    pub url: Option<String>,
    pub types: Option<Vec<String>>,
    pub active: Option<bool>,
    pub batch_size: Option<i32>,
    /// A new signing secret, returned once by [`update`].
    pub rotate_secret: bool,
    pub expected_version: Option<i64>,
}

/// Changes a sink for `by` (the caller's subject); with the new signing secret when the change
/// rotated it. Re-activating a sink clears its failures, so it is tried at once.
///
/// A paused sink whose creator has lost what covered it (a managed principal without an
/// administrator, fleet operator or member grant of the sink's tenant, or a revoked or expired
/// service account) still delivers to the URL that creator chose, signed with the secret that
/// creator was shown. Someone else resumes it only by taking it over: the same change gives the
/// `url` and rotates the secret, and the sink becomes theirs (`created_by`). Without both it is
/// `FORBIDDEN`, and nothing changes.
#[tracing::instrument(level = "debug", skip_all, fields(sink = %id))]
pub async fn update(
    db: &Db,
    scope: &Scope,
    by: &str,
    id: &SinkId,
    change: SinkChange,
) -> Result<(Sink, Option<String>)> {
    if let Some(url) = &change.url {
        check_url(url)?;
        egress::check_target(url, db.private_webhooks_allowed())?;
    }
    if let Some(types) = &change.types {
        crate::outbox::check_types(types)?;
    }
    if let Some(size) = change.batch_size {
        check_batch_size(size)?;
    }
    let secret = change.rotate_secret.then(new_secret).transpose()?;
    // Sealed bound to this sink's id, as at creation (docs/security.md).
    let sealed = secret
        .as_deref()
        .map(|s| crate::secrets::seal(db.keyring(), s, id.as_str()))
        .transpose()?;
    let sink = db
        .tx("update_event_sink", TxKind::Write, |conn| {
            let (id, change, scope, by, sealed) =
                (id.clone(), change.clone(), scope.clone(), by.to_owned(), sealed.clone());
            Box::pin(async move {
                // The row lock first, in a statement of its own; what the row and the grants
                // say is read in the next one, whose snapshot sees a revocation that committed
                // while this waited. A revocation that comes later locks the creator's sinks
                // first (`pause_uncovered`), so it waits for this change and then pauses the
                // sink if this left it active under an uncovered creator.
                let locked = sqlx::query_scalar!(
                    r#"SELECT 1 AS "one!" FROM event_sinks s
                        WHERE s.id = $1 AND ($2::text IS NULL OR s.tenant_id = $2) FOR UPDATE"#,
                    id.as_str(),
                    scope.tenant_id.as_ref().map(TenantId::as_str),
                )
                .fetch_optional(&mut *conn)
                .await?;
                if locked.is_none() {
                    return Err(Error::NotFound {
                        kind: "event sink",
                        id: id.to_string(),
                    });
                }
                let Some(row) = sqlx::query!(
                    r#"SELECT s.active, s.created_by, s.version,
                              (EXISTS (SELECT 1 FROM service_accounts a
                                        WHERE a.id = s.created_by
                                          AND (a.revoked_at IS NOT NULL OR a.expires_at <= compute_now()))
                               OR EXISTS (SELECT 1 FROM authz_principals p
                                           WHERE p.subject = s.created_by
                                             AND NOT EXISTS (
                                                   SELECT 1 FROM authz_grants g
                                                    WHERE g.issuer = p.issuer AND g.subject = p.subject
                                                      AND (g.role = 'admin'
                                                           OR (g.role = 'operator' AND g.scope_kind IS NULL)
                                                           OR (g.role = 'member' AND g.tenant_id = s.tenant_id))))
                              ) AS "orphaned!"
                         FROM event_sinks s
                        WHERE s.id = $1 AND ($2::text IS NULL OR s.tenant_id = $2)"#,
                    id.as_str(),
                    scope.tenant_id.as_ref().map(TenantId::as_str),
                )
                .fetch_optional(&mut *conn)
                .await?
                else {
                    return Err(Error::NotFound {
                        kind: "event sink",
                        id: id.to_string(),
                    });
                };
                if let Some(expected) = change.expected_version
                    && expected != row.version
                {
                    return Err(Error::Conflict {
                        message: format!(
                            "event sink {id} is at version {}, not {expected}",
                            row.version
                        ),
                        current_version: Some(row.version),
                    });
                }
                let resumes = change.active == Some(true) && !row.active;
                let takes_over = resumes && row.orphaned && row.created_by != by;
                if takes_over && (change.url.is_none() || sealed.is_none()) {
                    return Err(Error::Forbidden(format!(
                        "event sink {id} was paused because its creator no longer has a grant that \
                         covers it, and it would deliver to the URL they chose, signed with the \
                         secret they were shown: to resume it, give `url` and `rotateSecret: true` \
                         in the same change, which makes it yours"
                    )));
                }
                sqlx::query!(
                    "UPDATE event_sinks SET url = coalesce($2, url), types = coalesce($3, types), \
                            active = coalesce($4, active), batch_size = coalesce($5, batch_size), \
                            secret = coalesce($6, secret), \
                            created_by = CASE WHEN $7 THEN $8 ELSE created_by END, \
                            failures = CASE WHEN $4 THEN 0 ELSE failures END, \
                            next_attempt_at = CASE WHEN $4 THEN NULL ELSE next_attempt_at END, \
                            state = CASE WHEN $4 AND state = 'failing' THEN 'healthy' ELSE state END, \
                            version = version + 1, updated_at = compute_now() \
                      WHERE id = $1",
                    id.as_str(),
                    change.url,
                    change.types.as_deref(),
                    change.active,
                    change.batch_size,
                    sealed,
                    takes_over,
                    by,
                )
                .execute(&mut *conn)
                .await?;
                let sink = get_in(conn, &id)
                    .await?
                    .ok_or_else(|| Error::internal("a sink vanished under its row lock"))?;
                if takes_over {
                    tracing::info!(sink = %id, from = %row.created_by, to = %by, "an event sink of an uncovered creator was taken over and resumed");
                }
                emit_change(conn, EventType::EventSinkUpdated, &sink).await?;
                Ok(sink)
            })
        })
        .await?;
    Ok((sink, secret))
}

/// Pauses the event sinks `subject` created that its grants no longer cover (all of them with
/// `all`, when its identity itself is revoked), in the caller's transaction, after the
/// principal's lock (docs/database-locks.md), each with its `event_sink.updated` event. A sink
/// of every event needs an administrator or an operator grant over the whole fleet; a tenant's
/// sink, that or a member grant of that tenant. The ids of the sinks paused.
pub async fn pause_uncovered(
    conn: &mut PgConnection,
    issuer: &str,
    subject: &str,
    all: bool,
) -> Result<Vec<SinkId>> {
    // Every sink the subject created, active or not, locked first in id order: a resume in
    // flight (`update`) holds its row, and the pause below must see what it commits. Filtered
    // on `active` alone, the pause skipped a row its snapshot showed paused without waiting for
    // the resume that was making it active.
    sqlx::query_scalar!(
        r#"SELECT s.id AS "id!" FROM event_sinks s WHERE s.created_by = $1 ORDER BY s.id FOR UPDATE"#,
        subject,
    )
    .fetch_all(&mut *conn)
    .await?;
    let paused = sqlx::query_scalar!(
        r#"UPDATE event_sinks s SET active = false, version = s.version + 1, updated_at = compute_now()
            WHERE s.created_by = $2 AND s.active
              AND ($3 OR NOT EXISTS (
                    SELECT 1 FROM authz_grants g
                     WHERE g.issuer = $1 AND g.subject = $2
                       AND (g.role = 'admin' OR (g.role = 'operator' AND g.scope_kind IS NULL)
                            OR (g.role = 'member' AND g.tenant_id = s.tenant_id))))
            RETURNING s.id AS "id: SinkId""#,
        issuer,
        subject,
        all,
    )
    .fetch_all(&mut *conn)
    .await?;
    for id in &paused {
        if let Some(sink) = get_in(conn, id).await? {
            emit_change(conn, EventType::EventSinkUpdated, &sink).await?;
        }
    }
    Ok(paused)
}

/// The event (`event_sink.created`, `.updated`, `.deleted`) of `sink` as it is now, in the
/// caller's transaction.
async fn emit_change(conn: &mut PgConnection, event_type: EventType, sink: &Sink) -> Result<()> {
    crate::outbox::emit(
        conn,
        crate::outbox::NewEvent {
            event_type,
            tenant_id: sink.tenant_id.as_ref(),
            subject: sink.id.as_str(),
            data: events::to_data(&EventSinkPayload {
                event_sink: sink.into(),
            })?,
        },
    )
    .await?;
    Ok(())
}

/// Deletes a sink and its position.
#[tracing::instrument(level = "debug", skip_all, fields(sink = %id))]
pub async fn delete(db: &Db, scope: &Scope, id: &SinkId) -> Result<Sink> {
    db.tx("delete_event_sink", TxKind::Write, |conn| {
        let (id, scope) = (id.clone(), scope.clone());
        Box::pin(async move {
            let sink = get_in(conn, &id)
                .await?
                .filter(|s| visible(&scope, s))
                .ok_or_else(|| Error::NotFound {
                    kind: "event sink",
                    id: id.to_string(),
                })?;
            sqlx::query!("DELETE FROM event_sinks WHERE id = $1", sink.id.as_str())
                .execute(&mut *conn)
                .await?;
            emit_change(conn, EventType::EventSinkDeleted, &sink).await?;
            Ok(sink)
        })
    })
    .await
}

/// A page of the sinks `scope` may see, by id.
pub async fn list(db: &Db, scope: &Scope, page: &PageArgs) -> Result<Page<Sink>> {
    let mut conn = db.pool().acquire().await?;
    let rows = select_sinks(&mut conn, scope.tenant_id.as_ref(), None, page).await?;
    Ok(Page::from_rows(rows, page))
}

/// How many sinks are active (delivered or backing off).
pub async fn count_active(db: &Db) -> Result<i64> {
    Ok(
        sqlx::query_scalar!(r#"SELECT count(*) AS "n!" FROM event_sinks WHERE active"#)
            .fetch_one(db.pool())
            .await?,
    )
}

/// The ids of active sinks that are due (not backing off), oldest first.
pub async fn due(db: &Db) -> Result<Vec<SinkId>> {
    Ok(sqlx::query_scalar!(
        r#"SELECT id AS "id: SinkId" FROM event_sinks WHERE active AND (next_attempt_at IS NULL OR next_attempt_at <= compute_now()) ORDER BY id"#,
    )
    .fetch_all(db.pool())
    .await?)
}

/// What `reseal_all` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resealed {
    /// Secrets sealed again under the current key (they were plain or under an old key).
    pub resealed: u64,
    /// Secrets already sealed under the current key.
    pub current: u64,
}

/// Seals every sink secret under the keyring's current key: plain ones (stored before a key was
/// configured) and ones under an old key. Each row is rewritten only if it still holds what was
/// read (a guarded update), so it is safe to run beside the API and the workers and to run again.
pub async fn reseal_all(db: &Db) -> Result<Resealed> {
    let keyring = db.keyring().ok_or_else(|| {
        Error::bad_input(
            "secrets-key",
            "resealing needs a key: set COMPUTE_SECRETS_KEY",
        )
    })?;
    let rows = sqlx::query!(r#"SELECT id AS "id: SinkId", secret FROM event_sinks ORDER BY id"#)
        .fetch_all(db.pool())
        .await?;
    let mut done = Resealed::default();
    for row in rows {
        if keyring.is_current(&row.secret) {
            done.current += 1;
            continue;
        }
        let plain = keyring.open(&row.secret, row.id.as_str())?;
        let sealed = keyring.seal(&plain, row.id.as_str())?;
        let n = sqlx::query!(
            "UPDATE event_sinks SET secret = $3 WHERE id = $1 AND secret = $2",
            row.id.as_str(),
            row.secret,
            sealed,
        )
        .execute(db.pool())
        .await?
        .rows_affected();
        done.resealed += n;
    }
    Ok(done)
}

/// A sink with its secret, for its dispatcher.
#[derive(Debug, Clone, FromRow)]
pub struct Delivery {
    pub id: SinkId,
    pub tenant_id: Option<TenantId>,
    pub url: String,
    pub types: Vec<String>,
    /// As stored: sealed when a key is configured; open it with [`crate::secrets::open`] and
    /// the sink's id.
    pub secret: String,
    pub active: bool,
    /// Events per POST.
    pub batch_size: i32,
    pub next_attempt_at: Option<chrono::DateTime<chrono::Utc>>,
    pub cursor_txid: i64,
    pub cursor_seq: i64,
    /// The cursor has not moved for [`QUIET_ADVANCE_SECONDS`]: a caught-up pass may move it
    /// past what the filter does not take ([`advance_caught_up`]).
    pub cursor_quiet: bool,
}

impl Delivery {
    pub fn cursor(&self) -> Cursor {
        Cursor {
            txid: self.cursor_txid,
            seq: self.cursor_seq,
        }
    }
    /// What the sink receives.
    pub fn filter(&self) -> EventFilter {
        EventFilter {
            tenant_id: self.tenant_id.clone(),
            types: self.types.clone(),
            subjects: vec![],
        }
    }
}

/// The dispatcher's view of a sink (read inside its fenced transaction or alone).
pub async fn delivery(conn: &mut PgConnection, id: &SinkId) -> Result<Option<Delivery>> {
    Ok(sqlx::query_as!(
        Delivery,
        r#"SELECT s.id AS "id: _", s.tenant_id AS "tenant_id: _", s.url, s.types, s.secret, s.active, s.batch_size, s.next_attempt_at,
                c.txid::text::bigint AS "cursor_txid!", c.seq AS cursor_seq,
                c.updated_at <= compute_now() - make_interval(secs => $2) AS "cursor_quiet!"
           FROM event_sinks s JOIN outbox_cursors c ON c.sink_id = s.id WHERE s.id = $1"#,
        id.as_str(),
        QUIET_ADVANCE_SECONDS,
    )
    .fetch_optional(&mut *conn)
    .await?)
}

/// Whether sink `id` is still to get its batch at `url`: it exists, is active and posts there.
/// Read before each POST of a batch after the first, so a pause, a revocation's pause, a
/// deletion or a new URL stops the rest of the batch (at most the POST in flight lands).
pub async fn still_delivering(db: &Db, id: &SinkId, url: &str) -> Result<bool> {
    Ok(sqlx::query_scalar!(
        r#"SELECT s.active AND s.url = $2 AS "go!" FROM event_sinks s WHERE s.id = $1"#,
        id.as_str(),
        url,
    )
    .fetch_optional(db.pool())
    .await?
    .unwrap_or(false))
}

/// Saves a sink's progress after a delivered batch (in the dispatcher's fenced transaction):
/// the new cursor, the count, and a healthy state.
pub async fn save_progress(
    conn: &mut PgConnection,
    id: &SinkId,
    cursor: Cursor,
    delivered: i64,
) -> Result<()> {
    // The sink's row, then its cursor (docs/database-locks.md), as a deletion (the cursor by
    // cascade) and the pruning that marks a sink `behind` take them.
    sqlx::query(
        "UPDATE event_sinks SET failures = 0, next_attempt_at = NULL, last_success_at = compute_now(), \
                state = CASE WHEN state = 'behind' THEN 'behind' ELSE 'healthy' END, updated_at = compute_now() \
          WHERE id = $1",
    )
    .bind(id.as_str())
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE outbox_cursors SET txid = $2::text::xid8, seq = $3, delivered = delivered + $4, updated_at = compute_now() \
          WHERE sink_id = $1 AND ($2::text::xid8, $3) >= (txid, seq)",
    )
    .bind(id.as_str())
    .bind(cursor.txid.to_string())
    .bind(cursor.seq)
    .bind(delivered)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// How often a caught-up sink's cursor is moved past events its filter does not take.
pub const QUIET_ADVANCE_SECONDS: f64 = 60.0;

/// Moves the cursor of a caught-up sink to the present, past events its filter does not take,
/// when it has not moved for [`QUIET_ADVANCE_SECONDS`] (in the dispatcher's fenced transaction);
/// whether it moved. Its `updated_at` is set either way, so a sink with nothing to pass over is
/// looked at once a period, not at every pass. Without it a sink whose filter matched nothing for days kept the outbox
/// from being pruned (30 days instead of 7), rescanned everything after its cursor at each
/// pass, and was marked `BEHIND` at the hard maximum with nothing missed.
///
/// One statement, so one snapshot: the present is the last event of a transaction older than
/// every one still running (as [`crate::outbox::read_after`] reads), so no event can still
/// appear at or before it, and the cursor moves only when no event between it and the present
/// passes `filter`. An event held back by a running transaction lies after the present. The
/// cursor only moves forward (a pruning may have moved it meanwhile, never past the present),
/// and never from before the pruned front: a cursor there may have lost events it takes, which
/// the pruning marks `BEHIND` after it moved the front, and moving it would hide that.
pub async fn advance_caught_up(
    conn: &mut PgConnection,
    id: &SinkId,
    filter: &EventFilter,
) -> Result<bool> {
    Ok(sqlx::query_scalar!(
        r#"WITH p AS (SELECT o.txid, o.seq FROM outbox o WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot())
                        ORDER BY o.txid DESC, o.seq DESC LIMIT 1),
                go AS (SELECT p.txid, p.seq FROM p, outbox_cursors c, outbox_retention r
                        WHERE c.sink_id = $1 AND (p.txid, p.seq) > (c.txid, c.seq) AND r.singleton
                          AND (c.txid, c.seq) >= (r.pruned_txid, r.pruned_seq)
                          AND NOT EXISTS (SELECT 1 FROM outbox o
                                           WHERE (o.txid, o.seq) > (c.txid, c.seq) AND (o.txid, o.seq) <= (p.txid, p.seq)
                                             AND ($3::text IS NULL OR o.tenant_id = $3)
                                             AND (cardinality($4::text[]) = 0 OR o.type = ANY($4))))
           UPDATE outbox_cursors c
              SET txid = CASE WHEN (SELECT (go.txid, go.seq) > (c.txid, c.seq) FROM go) THEN (SELECT go.txid FROM go) ELSE c.txid END,
                  seq = CASE WHEN (SELECT (go.txid, go.seq) > (c.txid, c.seq) FROM go) THEN (SELECT go.seq FROM go) ELSE c.seq END,
                  updated_at = compute_now()
            WHERE c.sink_id = $1 AND c.updated_at <= compute_now() - make_interval(secs => $2)
        RETURNING EXISTS (SELECT 1 FROM go) AS "moved!""#,
        id.as_str(),
        QUIET_ADVANCE_SECONDS,
        filter.tenant_id.as_ref().map(TenantId::as_str),
        &filter.types,
    )
    .fetch_optional(&mut *conn)
    .await?
    .unwrap_or(false))
}

/// Records a failed delivery (in the dispatcher's fenced transaction): the error, one more
/// failure, and the time of the next attempt. Returns the wait before it, in seconds, or `None`
/// when the sink was deleted while it was posted to (nothing to record). The
/// exponent stops at 30 (the wait is capped far below): 2^1024 overflows PostgreSQL's float8,
/// and the failure of a sink that had failed 1,023 times could not be recorded, so it was
/// posted to again every second, for ever.
pub async fn record_failure(
    conn: &mut PgConnection,
    id: &SinkId,
    error: &str,
) -> Result<Option<f64>> {
    let error: String = error.chars().take(1000).collect();
    Ok(sqlx::query_scalar!(
        r#"UPDATE event_sinks SET failures = failures + 1, last_error = $2, last_error_at = compute_now(),
                next_attempt_at = compute_now() + make_interval(secs => least(power(2, least(failures + 1, 30)), $3)::float8),
                state = CASE WHEN failures + 1 >= $4 AND state <> 'behind' THEN 'failing' ELSE state END,
                updated_at = compute_now()
          WHERE id = $1 RETURNING least(power(2, least(failures, 30)), $3)::float8 AS "wait!""#,
        id.as_str(),
        error,
        MAX_BACKOFF_SECONDS,
        FAILING_AFTER,
    )
    .fetch_optional(&mut *conn)
    .await?)
}

/// Prunes the outbox: events past `retention` that every active sink and the usage meter have
/// passed, and events past `hard_max_age` whatever they have; a sink left before the pruned
/// front is moved to it and marked `behind`. Returns how many events were deleted.
#[tracing::instrument(level = "debug", skip_all, fields(retention_seconds = retention.as_secs()))]
pub async fn prune_outbox(
    db: &Db,
    retention: std::time::Duration,
    hard_max_age: std::time::Duration,
) -> Result<u64> {
    // The slowest reader that must not lose events: an active sink, or the usage meter, which
    // reads reservations' changes after its checked position to correct closed windows (read
    // past the retention's front, it would miss a late release and bill the old end). The
    // meter reads only the reservation changes that can move bookings (`compute_usage_reads`,
    // migration 0050), and its position moves only with them: it holds back the first such
    // event after its position, not the other events around it (`seq - 1` is just before that
    // event in the `(txid, seq)` order).
    let slowest = sqlx::query!(
        r#"SELECT x.txid::text::bigint AS "txid!", x.seq AS "seq!" FROM (
             SELECT c.txid, c.seq FROM outbox_cursors c JOIN event_sinks s ON s.id = c.sink_id WHERE s.active
             UNION ALL
             SELECT o.txid, o.seq - 1 FROM usage_meter m
               CROSS JOIN LATERAL (SELECT o.txid, o.seq FROM outbox o
                                    WHERE (o.txid, o.seq) > (m.checked_txid, m.checked_seq) AND compute_usage_reads(o.type)
                                    ORDER BY o.txid, o.seq LIMIT 1) o
              WHERE m.closed_through IS NOT NULL AND m.checked_txid IS NOT NULL AND m.checked_seq IS NOT NULL) x
          ORDER BY x.txid, x.seq LIMIT 1"#,
    )
    .fetch_optional(db.pool())
    .await?;
    let limit = slowest.map(|r| Cursor {
        txid: r.txid,
        seq: r.seq,
    });
    let mut pruned = 0;
    loop {
        let n = crate::outbox::prune(db, retention, limit, 10_000).await?;
        pruned += n;
        if n < 10_000 {
            break;
        }
    }
    loop {
        let n = crate::outbox::prune(db, hard_max_age, None, 10_000).await?;
        pruned += n;
        if n < 10_000 {
            break;
        }
    }
    // The sinks before their cursors, in id order, as a save (the dispatcher's) and a deletion
    // take them (docs/database-locks.md): moving the cursors first waited in a cycle with them.
    let behind = db
        .tx("mark_sinks_behind", TxKind::Write, |conn| {
            Box::pin(async move {
                sqlx::query(
                    "SELECT 1 FROM event_sinks s JOIN outbox_cursors c ON c.sink_id = s.id \
                       JOIN outbox_retention f ON f.singleton \
                      WHERE (c.txid, c.seq) < (f.pruned_txid, f.pruned_seq) ORDER BY s.id FOR UPDATE OF s",
                )
                .execute(&mut *conn)
                .await?;
                Ok(sqlx::query!(
                    "WITH f AS (SELECT pruned_txid, pruned_seq FROM outbox_retention WHERE singleton), \
                          moved AS (UPDATE outbox_cursors c SET txid = f.pruned_txid, seq = f.pruned_seq, updated_at = compute_now() \
                                      FROM f WHERE (c.txid, c.seq) < (f.pruned_txid, f.pruned_seq) RETURNING c.sink_id) \
                     UPDATE event_sinks s SET state = 'behind', \
                            last_error = CASE WHEN s.active \
                                              THEN 'events this sink had not received were pruned past the outbox''s hard maximum age' \
                                              ELSE 'events this sink had not received were pruned past the outbox''s retention while it was paused' END, \
                            last_error_at = compute_now(), updated_at = compute_now() \
                       FROM moved m WHERE s.id = m.sink_id",
                )
                .execute(&mut *conn)
                .await?)
            })
        })
        .await?;
    if behind.rows_affected() > 0 {
        tracing::warn!(
            sinks = behind.rows_affected(),
            "event sinks fell behind the outbox's hard maximum age: undelivered events were pruned"
        );
    }
    Ok(pruned)
}

/// How many sinks `scope` may see.
pub async fn count(db: &Db, scope: &Scope) -> Result<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM event_sinks WHERE $1::text IS NULL OR tenant_id = $1"#,
        scope.tenant_id.as_ref().map(TenantId::as_str),
    )
    .fetch_one(db.pool())
    .await?)
}
