//! The transactional outbox: every state change writes one event row in its own transaction.
//!
//! Writers call [`emit`] (the SQL function `compute_emit`) inside the transaction that made the
//! change, so the event exists exactly when the change committed. The row's `txid` is the writing
//! transaction's id and `seq` comes from a sequence; readers (subscriptions, SSE, webhooks) take
//! rows only below the oldest running transaction, so nothing appears behind their cursor.
//! `compute_emit` also sends a `NOTIFY compute_outbox` poke; it only wakes readers early, they
//! poll anyway.

use serde_json::Value;
use sqlx::PgConnection;

use crate::error::Result;

/// The channel of the poke `compute_emit` sends.
pub const NOTIFY_CHANNEL: &str = "compute_outbox";

/// An event to write.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    /// Dotted type, such as `reservation.scheduled`.
    pub event_type: &'a str,
    /// The tenant the event belongs to; `None` for fleet events only operators see.
    pub tenant_id: Option<&'a str>,
    /// The id of the entity that changed.
    pub subject: &'a str,
    /// The entity as it is after the change.
    pub data: Value,
}

/// Writes `event` in the caller's transaction; returns the event id (`evt_…`).
pub async fn emit(conn: &mut PgConnection, event: NewEvent<'_>) -> Result<String> {
    let (id,): (String,) = sqlx::query_as("SELECT compute_emit($1, $2, $3, $4)")
        .bind(event.event_type)
        .bind(event.tenant_id)
        .bind(event.subject)
        .bind(event.data)
        .fetch_one(conn)
        .await?;
    Ok(id)
}
