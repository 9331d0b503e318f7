//! Idempotency keys with exact semantics, scoped to `(tenant, identity, key)`.
//!
//! The key is claimed in the same transaction as the change it protects: the first request
//! inserts its row and the change; a retry of the same request finds the row and gets the first
//! one's result; the same key with a different request is `IDEMPOTENCY_KEY_REUSED`. A retry that
//! arrives while the first is still running waits on the first's uncommitted row (the unique
//! index), and past the lock timeout gets `IDEMPOTENCY_IN_PROGRESS`.

use serde_json::Value;
use sqlx::PgConnection;

use crate::error::{Error, Result};

/// Who is calling, for scoping keys and recording actions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub subject: String,
    pub tenant: Option<String>,
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key is new: go ahead and create the object with the id given to the claim.
    New,
    /// The same request ran before: its result is this id.
    Replay(String),
}

/// Claims `key` for `operation` with `request`, promising `result_id` as its result.
pub async fn claim(
    conn: &mut PgConnection,
    actor: &Actor,
    key: &str,
    operation: &str,
    request: &Value,
    result_id: &str,
) -> Result<Claim> {
    if key.is_empty() || key.len() > 200 {
        return Err(Error::bad_input(
            "idempotencyKey",
            "the idempotency key must be 1 to 200 characters",
        ));
    }
    let tenant = actor.tenant.as_deref().unwrap_or("");
    let inserted: Option<(String,)> = sqlx::query_as(
        "INSERT INTO idempotency_keys (tenant_id, subject, key, operation, request, result_id) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING RETURNING result_id",
    )
    .bind(tenant)
    .bind(&actor.subject)
    .bind(key)
    .bind(operation)
    .bind(request)
    .bind(result_id)
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| match Error::from(e) {
        Error::LockTimeout => Error::IdempotencyInProgress(format!(
            "a request with idempotency key `{key}` is still running; retry shortly with the same key"
        )),
        other => other,
    })?;
    if inserted.is_some() {
        return Ok(Claim::New);
    }
    let (existing, same): (String, bool) = sqlx::query_as(
        "SELECT result_id, operation = $4 AND request = $5 FROM idempotency_keys \
         WHERE tenant_id = $1 AND subject = $2 AND key = $3",
    )
    .bind(tenant)
    .bind(&actor.subject)
    .bind(key)
    .bind(operation)
    .bind(request)
    .fetch_one(&mut *conn)
    .await?;
    if same {
        Ok(Claim::Replay(existing))
    } else {
        Err(Error::IdempotencyKeyReused(format!(
            "idempotency key `{key}` was already used for a different request"
        )))
    }
}
