//! Idempotency keys with exact semantics, scoped to `(tenant, identity, key)`, after Stripe and the
//! IETF Idempotency-Key draft.
//!
//! * The first request inserts its key row (operation and fingerprint of its arguments) as the
//!   first statement of the transaction of its effect, and writes its response as the last: a
//!   crash leaves both or neither.
//! * A repeat with the same fingerprint gets the stored response ([`Claim::Replay`]), or the
//!   stored final error ([`Claim::Refused`]).
//! * The same key with other arguments is `IDEMPOTENCY_KEY_REUSED`.
//! * A repeat while the first still runs waits on the first's uncommitted row (the primary key);
//!   past the lock timeout it is `IDEMPOTENCY_IN_PROGRESS`.
//! * The effect runs under the savepoint [`claim`] takes. [`settle`] ends it: a success stores
//!   its response; a final error (quota, conflict, not found) rolls the effect back to the
//!   savepoint and stores the error instead, and the transaction commits with the key and that
//!   error only. So the key row is never released while a repeat waits on it: every request with
//!   one key gets the one answer the first to finish stored, a final error included.
//!   Validation and authentication failures never reach here, and transient errors (lock
//!   timeouts, internal) roll everything back, key included, so a retry runs again.
//! * Keys are kept at least [`RETENTION_HOURS`] hours, then pruned by [`prune`].
//! * A key's answer has one shape, [`Stored`], whoever writes it: Rust ([`settle`]) or
//!   PL/pgSQL (`compute_create_reservation`, `domain/sql/compute_create_reservation.sql`).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgConnection;

use crate::db::Db;
use crate::error::{Error, ErrorCode, Result};

/// How long keys are kept, at least.
pub const RETENTION_HOURS: i64 = 24;

pub use crate::actor::Actor;

/// A result, and whether it is the replay of an earlier request with the same idempotency key.
#[derive(Debug, Clone)]
pub struct Outcome<T> {
    pub value: T,
    pub replayed: bool,
}

/// What a claim found.
#[derive(Debug)]
pub enum Claim {
    /// The key is new and the savepoint of the effect is taken: run the operation, then
    /// [`settle`] it in the same transaction.
    New,
    /// The same request ran before and made the object with this id; the caller reads it again.
    Replay(String),
    /// The same request ran before and got this final error; it is the answer again.
    Refused(Error),
}

/// A key's stored answer (`idempotency_keys.response`), the one shape every writer uses:
/// `{"id": "<the object the request made or changed>"}`, or
/// `{"error": {"code": "QUOTA_EXCEEDED", "message": "…"}}` for a final error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stored {
    Refused {
        error: StoredError,
    },
    Done {
        /// The aliases read what the previous binary stored while both run (migration 0022
        /// converted the rows it found); a later migration drops them.
        #[serde(alias = "reservationId", alias = "commandId", alias = "instanceId")]
        id: String,
    },
}

/// A final error as stored under its key and as `compute_create_reservation` answers it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredError {
    pub code: ErrorCode,
    pub message: String,
    /// A `POLICY_VIOLATION`'s rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// A `POLICY_VIOLATION`'s limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<Value>,
}

impl StoredError {
    /// The stored form of `e`.
    pub fn of(e: &Error) -> StoredError {
        let (rule, limit) = match e {
            Error::PolicyViolation { rule, limit, .. } => (Some(rule.clone()), Some(limit.clone())),
            _ => (None, None),
        };
        StoredError {
            code: e.code(),
            message: e.to_string(),
            rule,
            limit,
        }
    }
}

impl From<StoredError> for Error {
    fn from(e: StoredError) -> Error {
        match (e.code, e.rule) {
            (ErrorCode::PolicyViolation, Some(rule)) => Error::PolicyViolation {
                rule,
                limit: e.limit.unwrap_or(Value::Null),
                message: e.message,
            },
            (code, _) => Error::from_code(code.as_str(), e.message),
        }
    }
}

impl Stored {
    /// Reads a stored response; one of another shape is our bug (`INTERNAL`).
    pub fn decode(response: Value) -> Result<Stored> {
        serde_json::from_value(response.clone()).map_err(|e| {
            Error::internal(format!(
                "an idempotency key's stored response {response} is not of the stored shape: {e}"
            ))
        })
    }
}

/// The savepoint the effect of a claimed key runs under.
const EFFECT_SAVEPOINT: &str = "idempotent_effect";

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

/// Claims `key` for `operation` with arguments `fingerprint`.
pub async fn claim(
    conn: &mut PgConnection,
    actor: &Actor,
    key: &str,
    operation: &str,
    fingerprint: &Value,
) -> Result<Claim> {
    let scope = actor.idempotency_scope();
    let inserted = sqlx::query_scalar!(
        "INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING RETURNING 1 AS claimed",
        scope,
        actor.subject,
        key,
        operation,
        fingerprint,
    )
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| match Error::from(e) {
        Error::LockTimeout => in_progress(key),
        other => other,
    })?;
    if inserted.is_some() {
        sqlx::query(&format!("SAVEPOINT {EFFECT_SAVEPOINT}"))
            .execute(&mut *conn)
            .await?;
        return Ok(Claim::New);
    }
    let stored = sqlx::query!(
        r#"SELECT operation = $4 AND fingerprint = $5 AS "same!", response FROM idempotency_keys
         WHERE tenant_id = $1 AND subject = $2 AND key = $3"#,
        scope,
        actor.subject,
        key,
        operation,
        fingerprint,
    )
    .fetch_one(&mut *conn)
    .await?;
    match (stored.same, stored.response) {
        (false, _) => Err(Error::IdempotencyKeyReused(format!(
            "idempotency key `{key}` was already used with different arguments; use a new key for a new request"
        ))),
        (true, Some(response)) => Ok(match Stored::decode(response)? {
            Stored::Refused { error } => Claim::Refused(error.into()),
            Stored::Done { id } => Claim::Replay(id),
        }),
        (true, None) => Err(in_progress(key)),
    }
}

fn in_progress(key: &str) -> Error {
    Error::IdempotencyInProgress(format!(
        "a request with idempotency key `{key}` is still running; retry shortly with the same key"
    ))
}

/// Stores the response of a claimed key, in the transaction of the effect.
async fn complete(
    conn: &mut PgConnection,
    actor: &Actor,
    key: &str,
    response: &Stored,
) -> Result<()> {
    let response = serde_json::to_value(response).map_err(Error::internal)?;
    sqlx::query!(
        "UPDATE idempotency_keys SET response = $4 WHERE tenant_id = $1 AND subject = $2 AND key = $3",
        actor.idempotency_scope(),
        actor.subject,
        key,
        response,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Whether an error is the final answer to a request, to be replayed to its repeats.
pub fn is_final(err: &Error) -> bool {
    matches!(
        err.code(),
        ErrorCode::QuotaExceeded
            | ErrorCode::PolicyViolation
            | ErrorCode::Conflict
            | ErrorCode::NotFound
            | ErrorCode::Forbidden
            | ErrorCode::Unschedulable
    )
}

/// Ends the effect of a claimed key (`key` is `None` for a request sent without one), in the
/// transaction of the claim:
///
/// * a success stores `id(&value)`, the id of what it made or changed, as the key's answer:
///   `Ok(Ok(value))`, commit;
/// * a final error ([`is_final`]) rolls the effect back to the claim's savepoint and stores the
///   error as the key's answer: `Ok(Err(error))`, commit (the key and its answer, nothing else);
/// * any other error is returned as it is, and the whole transaction rolls back, key included;
///   so is a final error whose recording failed (the caller gets the final error, not the
///   recording's).
pub async fn settle<T>(
    conn: &mut PgConnection,
    actor: &Actor,
    key: Option<&str>,
    result: Result<T>,
    id: impl FnOnce(&T) -> String,
) -> Result<Result<T>> {
    let Some(key) = key else {
        return result.map(Ok);
    };
    match result {
        Ok(value) => {
            complete(conn, actor, key, &Stored::Done { id: id(&value) }).await?;
            Ok(Ok(value))
        }
        Err(e) if is_final(&e) => {
            let stored = Stored::Refused {
                error: StoredError::of(&e),
            };
            let recorded = async {
                sqlx::query(&format!("ROLLBACK TO SAVEPOINT {EFFECT_SAVEPOINT}"))
                    .execute(&mut *conn)
                    .await?;
                complete(conn, actor, key, &stored).await
            }
            .await;
            match recorded {
                Ok(()) => Ok(Err(e)),
                // Recording the answer failed: the transaction rolls back, key included (a
                // retry runs again), and the caller still gets the answer, not the recording's
                // failure.
                Err(why) => {
                    tracing::warn!(error = %why, idempotency.key = key, "a final error could not be stored under its key");
                    Err(e)
                }
            }
        }
        Err(e) => Err(e),
    }
}

/// Deletes keys older than `hours` (at least [`RETENTION_HOURS`]); returns how many.
pub async fn prune(db: &Db, hours: i64) -> Result<u64> {
    let hours = hours.max(RETENTION_HOURS);
    let done = sqlx::query!(
        "DELETE FROM idempotency_keys WHERE created_at < compute_now() - make_interval(hours => $1::int)",
        hours as i32,
    )
    .execute(db.pool())
    .await?;
    Ok(done.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_stored_answer_has_one_shape() {
        let done = Stored::Done { id: "rsv_1".into() };
        assert_eq!(
            serde_json::to_value(&done).expect("json"),
            json!({ "id": "rsv_1" })
        );
        let refused = Stored::Refused {
            error: StoredError {
                code: ErrorCode::QuotaExceeded,
                message: "over".into(),
                rule: None,
                limit: None,
            },
        };
        let v = serde_json::to_value(&refused).expect("json");
        assert_eq!(
            v,
            json!({ "error": { "code": "QUOTA_EXCEEDED", "message": "over" } })
        );
        assert_eq!(Stored::decode(v).expect("reads back"), refused);
        // What the previous binary stored still reads, as the same id.
        for legacy in [
            json!({ "reservationId": "rsv_2", "state": "active" }),
            json!({ "reservationId": "rsv_2", "endsAt": "2026-01-01T00:00:00Z" }),
        ] {
            assert_eq!(
                Stored::decode(legacy).expect("legacy"),
                Stored::Done { id: "rsv_2".into() }
            );
        }
        // Anything else is our bug, not a replay of nothing.
        for bad in [
            json!({}),
            json!({ "error": { "code": "NOPE", "message": "x" } }),
            json!("rsv_1"),
        ] {
            let err = Stored::decode(bad.clone()).expect_err("not a stored answer");
            assert_eq!(err.code(), ErrorCode::Internal, "{bad}");
        }
    }
}
