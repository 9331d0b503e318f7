//! Idempotency keys with exact semantics, scoped to `(tenant, identity, key)`, after Stripe and the
//! IETF Idempotency-Key draft.
//!
//! * The first request inserts its key row (operation and fingerprint of its arguments) as the
//!   first statement of the transaction of its effect, and writes its response as the last: a
//!   crash leaves both or neither.
//! * A repeat with the same fingerprint gets the stored response ([`Claim::Replay`]).
//! * The same key with other arguments is `IDEMPOTENCY_KEY_REUSED`.
//! * A repeat while the first still runs waits on the first's uncommitted row (the primary key);
//!   past the lock timeout it is `IDEMPOTENCY_IN_PROGRESS`.
//! * A final error (quota, conflict, not found) is recorded by [`record_error`] in a transaction
//!   of its own, and replayed too; validation and authentication failures never reach here, and
//!   transient errors (lock timeouts, internal) are not recorded, so a retry runs again.
//! * Keys are kept at least [`RETENTION_HOURS`] hours, then pruned by [`prune`].

use serde_json::{Value, json};
use sqlx::PgConnection;

use crate::db::{Db, TxKind};
use crate::error::{Error, ErrorCode, Result};

/// How long keys are kept, at least.
pub const RETENTION_HOURS: i64 = 24;

/// Who is calling, for scoping keys and recording actions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub subject: String,
    pub tenant: Option<String>,
}

/// A result, and whether it is the replay of an earlier request with the same idempotency key.
#[derive(Debug, Clone)]
pub struct Outcome<T> {
    pub value: T,
    pub replayed: bool,
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The key is new: run the operation, then [`complete`] it in the same transaction.
    New,
    /// The same request ran before; this is its stored response.
    Replay(Value),
}

/// Checks a key: 1 to 255 printable characters.
pub fn parse_key(field: &str, key: &str) -> Result<String> {
    if key.is_empty() || key.chars().count() > 255 || key.chars().any(char::is_control) {
        return Err(Error::bad_input(
            field,
            "an idempotency key is 1 to 255 printable characters",
        ));
    }
    Ok(key.to_owned())
}

fn tenant(actor: &Actor) -> &str {
    actor.tenant.as_deref().unwrap_or("")
}

/// Claims `key` for `operation` with arguments `fingerprint`.
pub async fn claim(
    conn: &mut PgConnection,
    actor: &Actor,
    key: &str,
    operation: &str,
    fingerprint: &Value,
) -> Result<Claim> {
    let inserted: Option<(i32,)> = sqlx::query_as(
        "INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING RETURNING 1",
    )
    .bind(tenant(actor))
    .bind(&actor.subject)
    .bind(key)
    .bind(operation)
    .bind(fingerprint)
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| match Error::from(e) {
        Error::LockTimeout => in_progress(key),
        other => other,
    })?;
    if inserted.is_some() {
        return Ok(Claim::New);
    }
    let (same, response): (bool, Option<Value>) = sqlx::query_as(
        "SELECT operation = $4 AND fingerprint = $5, response FROM idempotency_keys \
         WHERE tenant_id = $1 AND subject = $2 AND key = $3",
    )
    .bind(tenant(actor))
    .bind(&actor.subject)
    .bind(key)
    .bind(operation)
    .bind(fingerprint)
    .fetch_one(&mut *conn)
    .await?;
    match (same, response) {
        (false, _) => Err(Error::IdempotencyKeyReused(format!(
            "idempotency key `{key}` was already used with different arguments; use a new key for a new request"
        ))),
        (true, Some(response)) => Ok(Claim::Replay(response)),
        (true, None) => Err(in_progress(key)),
    }
}

fn in_progress(key: &str) -> Error {
    Error::IdempotencyInProgress(format!(
        "a request with idempotency key `{key}` is still running; retry shortly with the same key"
    ))
}

/// Stores the response of a claimed key, in the transaction of the effect.
pub async fn complete(
    conn: &mut PgConnection,
    actor: &Actor,
    key: &str,
    response: &Value,
) -> Result<()> {
    sqlx::query("UPDATE idempotency_keys SET response = $4 WHERE tenant_id = $1 AND subject = $2 AND key = $3")
        .bind(tenant(actor))
        .bind(&actor.subject)
        .bind(key)
        .bind(response)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Whether an error is the final answer to a request, to be replayed to its repeats.
pub fn is_final(err: &Error) -> bool {
    matches!(
        err.code(),
        ErrorCode::QuotaExceeded
            | ErrorCode::Conflict
            | ErrorCode::NotFound
            | ErrorCode::Forbidden
            | ErrorCode::Unschedulable
    )
}

/// Records a final error as the key's response, in a transaction of its own (the effect's
/// transaction rolled back). A repeat that ran meanwhile keeps its own response.
pub async fn record_error(
    db: &Db,
    actor: &Actor,
    key: &str,
    operation: &str,
    fingerprint: &Value,
    err: &Error,
) -> Result<()> {
    if !is_final(err) {
        return Ok(());
    }
    let response = json!({ "error": { "code": err.code().as_str(), "message": err.to_string() } });
    let (actor, key, operation, fingerprint) = (
        actor.clone(),
        key.to_owned(),
        operation.to_owned(),
        fingerprint.clone(),
    );
    db.tx(TxKind::Write, move |conn| {
        let (actor, key, operation, fingerprint, response) =
            (actor.clone(), key.clone(), operation.clone(), fingerprint.clone(), response.clone());
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint, response) \
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
            )
            .bind(tenant(&actor))
            .bind(&actor.subject)
            .bind(&key)
            .bind(&operation)
            .bind(&fingerprint)
            .bind(&response)
            .execute(conn)
            .await?;
            Ok(())
        })
    })
    .await
}

/// The error a stored response holds, if it holds one.
pub fn stored_error(response: &Value) -> Option<Error> {
    let e = response.get("error")?;
    let code = e.get("code")?.as_str()?;
    let message = e
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    Some(Error::from_code(code, message))
}

/// Deletes keys older than `hours` (at least [`RETENTION_HOURS`]); returns how many.
pub async fn prune(db: &Db, hours: i64) -> Result<u64> {
    let hours = hours.max(RETENTION_HOURS);
    let done = sqlx::query("DELETE FROM idempotency_keys WHERE created_at < compute_now() - make_interval(hours => $1::int)")
        .bind(hours as i32)
        .execute(db.pool())
        .await?;
    Ok(done.rows_affected())
}
