//! Placement: where a reservation's allocations go, every one or none, each on one node. The
//! search and the booking are one SQL function, `compute_place` (migration 0015), called in the
//! transaction of the change that places: creating a reservation (inside
//! `compute_create_reservation`) and the reconciler's retry of a pending one ([`place`]).
//!
//! * The search walks the pool's nodes from a random point and keeps those that fit (eligible,
//!   enough matching atoms free over the window, each probed through the exclusion constraint's
//!   index, vCPU, memory and disk), stopping after [`SAMPLE`] of them; it takes the tightest of
//!   those. Its cost follows the pool and the request, not the bookings of the whole fleet.
//! * An attempt locks the node and the atoms `FOR SHARE`, books the atoms (the exclusion
//!   constraint is the last word) and charges the scalars it asks for with a guarded update,
//!   in a block of its own; a lost race (or a lock timeout, or a deadlock) undoes the attempt
//!   and the search runs again without that node, at most 3 attempts per allocation.
//! * When nothing fits, the `Unschedulable` condition says why, node by node across the pool
//!   ([`crate::condition::ReasonCount`]), in the same call.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;

use crate::condition::Condition;
use crate::error::{Error, Result};
use crate::ids::ReservationId;

/// How many fitting nodes the search looks at before it takes the tightest of them: two, the
/// "power of two choices" (the fuller of two random nodes packs far better than one random
/// node, and concurrent requests still spread). Four packed tighter but cost 20% of the
/// throughput at 8 clients: each node looked at is a probe per matching atom, and requests that
/// all prefer the same nearly full nodes queue on their `node_resources` rows
/// (`docs/performance.md`).
pub const SAMPLE: i32 = 2;

/// What placing a whole reservation came to.
pub(crate) enum Placement {
    Placed,
    /// Nothing is booked; the condition says why, in words and counted by reason.
    Unschedulable(Condition),
}

/// What `compute_place` answers (`domain/sql/compute_place.sql`).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PlaceAnswer {
    placed: bool,
    /// Searches taken again after lost races.
    #[expect(dead_code, reason = "counted by the create's answer, not by a retry")]
    replans: u32,
    /// Why nothing fits, when nothing was placed.
    #[serde(default)]
    condition: Option<Condition>,
}

/// Reads what `compute_place` returned.
pub(crate) fn outcome(v: Value) -> Result<Placement> {
    let answer: PlaceAnswer = serde_json::from_value(v.clone())
        .map_err(|e| Error::internal(format!("compute_place returned {v}: {e}")))?;
    match answer {
        PlaceAnswer { placed: true, .. } => Ok(Placement::Placed),
        PlaceAnswer {
            condition: Some(condition),
            ..
        } => Ok(Placement::Unschedulable(condition)),
        PlaceAnswer { .. } => Err(Error::internal(format!(
            "compute_place placed nothing and gave no reason: {v}"
        ))),
    }
}

/// Places every allocation of reservation `id` over `window`, or none; `describe` is each
/// allocation's request in words, by ordinal.
pub(crate) async fn place(
    conn: &mut PgConnection,
    id: &ReservationId,
    window: (DateTime<Utc>, DateTime<Utc>),
    describe: &[String],
) -> Result<Placement> {
    let v = sqlx::query_scalar!(
        r#"SELECT compute_place($1, $2, $3, $4, $5) AS "placed!""#,
        id.as_str(),
        window.0,
        window.1,
        SAMPLE,
        describe,
    )
    .fetch_one(&mut *conn)
    .await?;
    outcome(v)
}
