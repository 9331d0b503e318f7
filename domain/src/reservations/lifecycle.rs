//! Creating, extending, releasing and cancelling reservations.
//!
//! Lock order (docs/database-locks.md): the idempotency key and the reservation row first, then
//! `quota_usage` (in key order), `pools` (key share, by the foreign key), `nodes` (`FOR SHARE`),
//! `devices` and `device_atoms` (`FOR SHARE`), `device_bookings` (inserts), `node_resources`
//! (guarded updates). Reserving charges quota first; releasing refunds it first.
//!
//! Conflicts do not abort the request: each placement attempt runs under a savepoint; a node,
//! atom or counter conflict (including a lock timeout or deadlock inside the attempt) rolls back
//! to it and replans without that node (`placement.rs`), at most three times; then it is `pending`
//! with an `Unschedulable` condition, still holding its quota.

use chrono::{DateTime, Duration, Utc};
use serde_json::{Value, json};
use sqlx::PgConnection;
use sqlx::types::Json;

use super::model::{AllocationRequest, ReservationRequest};
use super::placement::{Placement, place};
use super::state::{Action, State, allowed_from};
use super::{Reservation, query_reservations};
use crate::condition::{Condition, ConditionStatus};
use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::EventType;
use crate::fleet::model::BookingReason;
use crate::idempotency::{self, Actor, Claim, Outcome, StoredError};
use crate::ids::{AllocationId, AtomName, ReservationId, TenantId};
use crate::quota;

/// How long a pending reservation waits before placement is tried again.
pub const RETRY_SECONDS: i64 = 30;
/// How far in the past a start may be (clock differences between client and server).
pub const START_GRACE_SECONDS: i64 = 60;

fn conflict(message: impl Into<String>) -> Error {
    Error::Conflict {
        message: message.into(),
        current_version: None,
    }
}

fn tenant_of(actor: &Actor) -> Result<TenantId> {
    actor.tenant.clone().ok_or_else(|| {
        Error::bad_input(
            "tenantId",
            "the caller's token names no tenant to reserve for",
        )
    })
}

async fn load(conn: &mut PgConnection, id: &ReservationId) -> Result<Reservation> {
    Ok(
        query_reservations!("SELECT", "FROM reservations r WHERE r.id = $1", id.as_str())
            .fetch_one(&mut *conn)
            .await?,
    )
}

/// Writes the reservation's event (`compute_reservation_changed`: its payload is built in SQL,
/// the one definition) and has its reconciler look at it again (and set its next wake-up), in
/// this transaction.
async fn emit(conn: &mut PgConnection, rsv: &Reservation, event_type: EventType) -> Result<()> {
    emit_changed(conn, &rsv.id, event_type).await
}

/// The event of a change to reservation `id` (its row already written in this transaction),
/// with its work-queue row (`compute_reservation_changed`).
pub(crate) async fn emit_changed(
    conn: &mut PgConnection,
    id: &ReservationId,
    event_type: EventType,
) -> Result<()> {
    sqlx::query_scalar!(
        r#"SELECT compute_reservation_changed($1, $2, $3) AS "event!""#,
        id.as_str(),
        event_type.as_str(),
        crate::work_queue::SHARDS,
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(())
}

/// Ends a locked reservation in a terminal state: quota first, then bookings and scalars come
/// back; `ended_at` is now, or its end when it expired; its event follows.
async fn close_out(
    conn: &mut PgConnection,
    rsv: &Reservation,
    to: State,
    conditions: Option<Vec<Condition>>,
) -> Result<Reservation> {
    give_back(conn, rsv).await?;
    record_end(conn, rsv, to, conditions).await
}

/// The reservation's terminal state, its conditions and its event. A reservation whose window
/// started while its stored state was still `scheduled` (a reader saw it active) first records
/// that activation and its `reservation.active` event (`compute_record_activation`, migration
/// 0031), so the events tell the story the reads told.
async fn record_end(
    conn: &mut PgConnection,
    rsv: &Reservation,
    to: State,
    conditions: Option<Vec<Condition>>,
) -> Result<Reservation> {
    sqlx::query_scalar!("SELECT compute_record_activation($1)", rsv.id.as_str())
        .fetch_one(&mut *conn)
        .await?;
    let rsv = query_reservations!(
        "UPDATE reservations r SET state = $2, next_attempt_at = NULL,
           ended_at = CASE WHEN $2 = 'expired' THEN r.ends_at ELSE compute_now() END,
           conditions = coalesce($3, r.conditions), version = r.version + 1, updated_at = compute_now()
         WHERE r.id = $1 RETURNING",
        "",
        rsv.id.as_str(),
        to.as_str(),
        conditions.map(Json) as _,
    )
    .fetch_one(&mut *conn)
    .await?;
    emit(conn, &rsv, EventType::of_reservation(to)).await?;
    Ok(rsv)
}

/// The stored states `action` may start from, as text for `= ANY($n)`.
fn states(action: Action) -> Vec<&'static str> {
    allowed_from(action)
        .into_iter()
        .map(State::as_str)
        .collect()
}

/// What creating a reservation did, beyond the reservation itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct CreateStats {
    /// Placement attempts that lost a race and were replanned.
    pub replans: usize,
}

/// Creates a reservation: charges quota, places every allocation or none, and records the
/// response under the idempotency key, all in one transaction and one round trip inside it
/// (`compute_create_reservation`, migration 0015, which follows the lock order and the
/// idempotency rules of [`idempotency`]). The same statement answers with the reservation it
/// wrote or replays (`compute_reservation_json`, migration 0018), so nothing is read back; and
/// it is one statement in its own implicit transaction (`compute_create_reservation_call`,
/// migration 0026, through [`Db::statement`]): one round trip in all.
#[tracing::instrument(level = "debug", skip_all, fields(pool = %req.pool_id, subject = %actor.subject))]
pub async fn create_reservation(
    db: &Db,
    actor: &Actor,
    req: ReservationRequest,
    key: &str,
) -> Result<(Outcome<Reservation>, CreateStats)> {
    let tenant = tenant_of(actor)?;
    let key = idempotency::parse_key("idempotencyKey", key)?;
    let fingerprint = json!(req);
    let rsv_id = ReservationId::generate();
    let allocations: Vec<serde_json::Value> = req
        .allocations
        .iter()
        .map(|a| {
            json!({
                "id": AllocationId::generate(),
                "gpu_kind": a.gpu_kind.as_str(),
                "gpu_count": a.gpu_count,
                "model": a.model,
                "profile": a.profile,
                "slots_per_gpu": a.slots_per_gpu,
                "vcpu": a.vcpu,
                "memory_mib": a.memory_mib,
                "disk_gib": a.disk_gib,
                "node_selector": a.node_selector,
                "tolerations": a.tolerations,
                "same_nvlink_domain": a.same_nvlink_domain,
                "same_numa_node": a.same_numa_node,
                "describe": a.describe(),
            })
        })
        .collect();
    let allocations = serde_json::Value::Array(allocations);
    let gpu = super::model::gpu_charge(&req.allocations);
    let scope = actor.idempotency_scope();
    let retry_contention = db.retries_contention();
    let lock_timeout_ms = TxKind::Write.lock_timeout().as_millis() as i32;
    let created = db.statement("create_reservation", TxKind::Write, |conn| {
        let (actor, key, fingerprint, req, rsv_id, allocations, tenant, scope) = (
            actor.clone(),
            key.clone(),
            fingerprint.clone(),
            req.clone(),
            rsv_id.clone(),
            allocations.clone(),
            tenant.clone(),
            scope.clone(),
        );
        let cancel = CancelOnDrop::new(db, &rsv_id);
        let traceparent = crate::db::sampled_traceparent();
        let gang = req.gang.as_ref().map(|g| json!(g));
        Box::pin(async move {
            let mut cancel = cancel;
            let answer: std::result::Result<Value, sqlx::Error> = sqlx::query_scalar!(
                r#"SELECT compute_create_reservation_call($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
                                                         $13::float8::numeric, $14, $15, $16, $17, $18, $19, $20) AS "answer!""#,
                scope,
                actor.subject,
                key,
                fingerprint,
                tenant.as_str(),
                actor.subject,
                rsv_id.as_str(),
                req.pool_id.as_str(),
                req.starts_at,
                req.ends_at,
                START_GRACE_SECONDS as i32,
                allocations,
                gpu,
                RETRY_SECONDS as i32,
                crate::work_queue::SHARDS,
                super::placement::SAMPLE,
                lock_timeout_ms,
                retry_contention,
                traceparent,
                gang,
            )
            .fetch_one(&mut *conn)
            .await;
            // Answered or failed: the statement ended, there is nothing left to cancel.
            cancel.disarm();
            let mut answer = answer?;
            let reservation = answer
                .get_mut("reservation")
                .map(serde_json::Value::take)
                .filter(|r| !r.is_null());
            let outcome = answer
                .get_mut("outcome")
                .map(serde_json::Value::take)
                .unwrap_or_default();
            Ok(match CreateAnswer::decode(outcome)? {
                CreateAnswer::Refused { error } => Err(error.into()),
                CreateAnswer::Created { replans, .. } => Ok((
                    Outcome {
                        value: ReservationJson::decode(reservation)?,
                        replayed: false,
                    },
                    CreateStats { replans },
                )),
                CreateAnswer::Replay { .. } => Ok((
                    Outcome {
                        value: ReservationJson::decode(reservation)?,
                        replayed: true,
                    },
                    CreateStats { replans: 0 },
                )),
            })
        })
    })
    .await;
    let outcome = match &created {
        Ok(Ok((o, _))) if o.replayed => "replayed",
        Ok(Ok((o, _))) if o.value.state == State::Pending => "pending",
        Ok(Ok(_)) => "placed",
        Ok(Err(e)) | Err(e) if e.code() == crate::ErrorCode::QuotaExceeded => "quota_exceeded",
        _ => "refused",
    };
    db.count_create(outcome);
    created?
}

/// Cancels the create's statement when the request is dropped before its answer (its client
/// left): the call runs in its own implicit transaction, which commits when the statement ends
/// whether or not anyone still waits for it. The call names its backend
/// `compute create <reservation id>` for its transaction (migration 0026); dropped armed, this
/// sends `pg_cancel_backend` to the backend of that name from another connection, so a call
/// still waiting on a lock or working fails and writes nothing. One that already ended is not
/// touched: the name goes with its transaction.
struct CancelOnDrop {
    db: Db,
    name: Option<String>,
}

impl CancelOnDrop {
    fn new(db: &Db, id: &ReservationId) -> Self {
        CancelOnDrop {
            db: db.clone(),
            name: Some(format!("compute create {id}")),
        }
    }

    /// The statement answered: nothing to cancel.
    fn disarm(&mut self) {
        self.name = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let (Some(name), Ok(runtime)) = (self.name.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let pool = self.db.pool().clone();
        runtime.spawn(async move {
            let cancelled = sqlx::query_scalar!(
                r#"SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) AS "n!" FROM pg_stat_activity
                    WHERE application_name = $1 AND datname = current_database()"#,
                name,
            )
            .fetch_one(&pool)
            .await;
            match cancelled {
                Ok(n) => tracing::info!(statement = %name, cancelled = n, "the client left: its create is cancelled"),
                Err(e) => tracing::warn!(statement = %name, error = %e, "cancelling an abandoned create failed; it commits if it can"),
            }
        });
    }
}

/// What `compute_create_reservation` answers (`domain/sql/compute_create_reservation.sql`),
/// tagged by `outcome`.
#[derive(Debug, serde::Deserialize)]
#[serde(
    tag = "outcome",
    rename_all = "lowercase",
    rename_all_fields = "camelCase"
)]
enum CreateAnswer {
    /// Made now; placement took `replans` searches again after lost races.
    Created {
        #[expect(
            dead_code,
            reason = "the reservation comes beside the answer, read in the same statement"
        )]
        reservation_id: ReservationId,
        replans: usize,
    },
    /// The key's earlier request made it.
    Replay {
        #[expect(
            dead_code,
            reason = "the reservation comes beside the answer, read in the same statement"
        )]
        reservation_id: ReservationId,
    },
    /// A final error, now or stored under the key.
    Refused { error: StoredError },
}

impl CreateAnswer {
    fn decode(v: Value) -> Result<CreateAnswer> {
        serde_json::from_value(v.clone())
            .map_err(|e| Error::internal(format!("compute_create_reservation answered {v}: {e}")))
    }
}

/// A reservation as `compute_reservation_json` writes it: the row's `to_jsonb`, with `state` as
/// time says and `charge_gpu` as a float. Decoded here only, into a [`Reservation`].
#[derive(Debug, serde::Deserialize)]
struct ReservationJson {
    id: ReservationId,
    tenant_id: TenantId,
    created_by: String,
    pool_id: crate::ids::PoolId,
    state: State,
    starts_at: DateTime<Utc>,
    ends_at: DateTime<Utc>,
    conditions: crate::condition::Conditions,
    charge_gpu: f64,
    charge_vcpu: i64,
    charge_memory_mib: i64,
    charged: Vec<crate::quota::Charge>,
    next_attempt_at: Option<DateTime<Utc>>,
    version: i64,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    ended_at: Option<DateTime<Utc>>,
    #[serde(default)]
    gang_colocate: Option<String>,
    #[serde(default)]
    gang_label: Option<String>,
    #[serde(default)]
    gang_spread: bool,
}

impl ReservationJson {
    /// The reservation a create answered with; none is our bug.
    fn decode(v: Option<Value>) -> Result<Reservation> {
        let v =
            v.ok_or_else(|| Error::internal("createReservation answered without its reservation"))?;
        let r: ReservationJson = serde_json::from_value(v).map_err(|e| {
            Error::internal(format!(
                "the reservation of createReservation did not decode: {e}"
            ))
        })?;
        Ok(Reservation {
            id: r.id,
            tenant_id: r.tenant_id,
            created_by: r.created_by,
            pool_id: r.pool_id,
            state: r.state,
            starts_at: r.starts_at,
            ends_at: r.ends_at,
            conditions: r.conditions,
            charge_gpu: r.charge_gpu,
            charge_vcpu: r.charge_vcpu,
            charge_memory_mib: r.charge_memory_mib,
            charged: Json(r.charged),
            next_attempt_at: r.next_attempt_at,
            version: r.version,
            created_at: r.created_at,
            updated_at: r.updated_at,
            ended_at: r.ended_at,
            gang_colocate: r.gang_colocate,
            gang_label: r.gang_label,
            gang_spread: r.gang_spread,
        })
    }
}

/// Locks a reservation the caller may act on (its tenant's; operators any), for `action`.
async fn lock_for(
    conn: &mut PgConnection,
    actor: &Actor,
    id: &ReservationId,
    version: Option<i64>,
    action: Action,
) -> Result<Reservation> {
    let not_found = || Error::NotFound {
        kind: "reservation",
        id: id.to_string(),
    };
    // Only a row the caller may see is locked: another tenant's busy reservation neither makes
    // it wait nor answers otherwise than NOT_FOUND.
    let Ok(tenant) = actor.visible_tenant() else {
        return Err(not_found());
    };
    let rsv = query_reservations!(
        "SELECT",
        "FROM reservations r WHERE r.id = $1 AND ($2::text IS NULL OR r.tenant_id = $2) FOR UPDATE",
        id.as_str(),
        tenant.map(TenantId::as_str)
    )
    .fetch_optional(&mut *conn)
    .await?;
    let rsv = match rsv {
        Some(r) if actor.may_access(&r.tenant_id) => r,
        _ => {
            return Err(Error::NotFound {
                kind: "reservation",
                id: id.to_string(),
            });
        }
    };
    if let Some(v) = version
        && v != rsv.version
    {
        return Err(Error::StaleVersion {
            kind: "reservation",
            id: id.to_string(),
            expected: v,
            current: rsv.version,
        });
    }
    // `rsv.state` is the state as time says: a reservation whose window has started is active
    // (it can be released, no longer cancelled), one whose window has ended is expired.
    if !allowed_from(action).contains(&rsv.state) {
        let hint = match (action, rsv.state) {
            (Action::Cancel, State::Active) => Some(format!(
                "it started at {} and can no longer be cancelled; release it to end it now",
                rsv.starts_at.to_rfc3339()
            )),
            (_, State::Expired) => Some(format!("it ended at {}", rsv.ends_at.to_rfc3339())),
            _ => None,
        };
        return Err(Error::IllegalTransition {
            kind: "reservation",
            id: id.to_string(),
            state: rsv.state.as_str(),
            action: action.name(),
            current_version: Some(rsv.version),
            hint: hint.map(String::into_boxed_str),
        });
    }
    Ok(rsv)
}

/// Ends bookings at now (future ones are removed) and gives back quota and scalars, in the
/// lock order: quota first.
async fn give_back(conn: &mut PgConnection, rsv: &Reservation) -> Result<Vec<OverlapHold>> {
    // The atoms a daemon refused (`DEVICE_OVERLAP`: a workload it runs holds one) stay booked
    // to the window's end however the reservation ends: released or cancelled before the
    // reconciler failed it, they went back to placement, and the next tenant's instance met
    // the same workload. Read before the bookings end.
    let holds = overlap_holds(conn, &rsv.id).await?;
    quota::refund(conn, &rsv.tenant_id, &rsv.charged).await?;
    sqlx::query!(
        "WITH mine AS (SELECT id FROM allocations WHERE reservation_id = $1), \
         gone AS (DELETE FROM device_bookings b USING mine WHERE b.allocation_id = mine.id AND lower(b.during) >= compute_now() RETURNING 1) \
         UPDATE device_bookings b SET during = tstzrange(lower(b.during), compute_now()) FROM mine \
          WHERE b.allocation_id = mine.id AND lower(b.during) < compute_now() AND upper(b.during) > compute_now()",
        rsv.id.as_str(),
    )
    .execute(&mut *conn)
    .await?;
    // The holds in the bookings' place, before the node's counters (docs/database-locks.md).
    if !holds.is_empty() {
        let atoms: Vec<&str> = holds.iter().map(|h| h.atom.as_str()).collect();
        let devices: Vec<&str> = holds.iter().map(|h| h.device_id.as_str()).collect();
        let froms: Vec<DateTime<Utc>> = holds.iter().map(|h| h.from).collect();
        let untils: Vec<DateTime<Utc>> = holds.iter().map(|h| h.until).collect();
        sqlx::query!(
            "INSERT INTO device_bookings (atom, device_id, reason, during) \
             SELECT h.atom, h.device_id, 'overlap_hold', tstzrange(h.f, h.t) \
               FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::timestamptz[]) AS h(atom, device_id, f, t)",
            &atoms as &[&str],
            &devices as &[&str],
            &froms,
            &untils,
        )
        .execute(&mut *conn)
        .await?;
    }
    // Locked in (node, resource) order first, as placement locks them.
    sqlx::query!(
        "WITH back AS (SELECT a.node_id, v.res, sum(v.amount)::bigint AS amount FROM allocations a, \
                   LATERAL (VALUES ('vcpu', a.vcpu), ('memory_mib', a.memory_mib), ('disk_gib', a.disk_gib)) v(res, amount) \
                  WHERE a.reservation_id = $1 AND a.node_id IS NOT NULL GROUP BY a.node_id, v.res), \
         locked AS (SELECT r.node_id, r.resource FROM node_resources r JOIN back b ON b.node_id = r.node_id AND b.res = r.resource \
                     ORDER BY r.node_id, r.resource FOR UPDATE OF r) \
         UPDATE node_resources r SET allocated = r.allocated - b.amount FROM back b, locked l \
          WHERE r.node_id = l.node_id AND r.resource = l.resource AND b.node_id = l.node_id AND b.res = l.resource",
        rsv.id.as_str(),
    )
    .execute(&mut *conn)
    .await?;
    Ok(holds)
}

/// An atom a daemon refused to the reservation, to hold from now (or its booking's start) to
/// its booking's end.
struct OverlapHold {
    atom: String,
    device_id: String,
    /// The node's id (tenants see nodes by id, never by hostname).
    node: String,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
}

/// The atoms of reservation `id` whose instance a daemon refused with `DEVICE_OVERLAP`, with
/// what their holds cover (a partial index finds the refusals, migration 0024).
async fn overlap_holds(conn: &mut PgConnection, id: &ReservationId) -> Result<Vec<OverlapHold>> {
    Ok(sqlx::query_as!(
        OverlapHold,
        r#"SELECT DISTINCT b.atom AS "atom!", b.device_id AS "device_id!", n.id AS "node!",
                  greatest(lower(b.during), compute_now()) AS "from!", upper(b.during) AS "until!"
             FROM instances i
             JOIN commands c ON c.workflow_id = i.id AND c.error_code = 'DEVICE_OVERLAP'
             JOIN allocations a ON a.id = i.allocation_id
             JOIN nodes n ON n.id = a.node_id
             JOIN device_bookings b ON b.allocation_id = a.id AND upper(b.during) > compute_now()
            WHERE i.reservation_id = $1 AND i.state = 'failed'
            ORDER BY b.atom"#,
        id.as_str(),
    )
    .fetch_all(&mut *conn)
    .await?)
}

async fn finish(
    db: &Db,
    actor: &Actor,
    id: &ReservationId,
    version: Option<i64>,
    action: Action,
) -> Result<Reservation> {
    let to = match action {
        Action::Release => State::Released,
        _ => State::Cancelled,
    };
    let name = match action {
        Action::Release => "release_reservation",
        _ => "cancel_reservation",
    };
    db.tx(name, TxKind::Write, |conn| {
        let (actor, id) = (actor.clone(), id.clone());
        Box::pin(async move {
            let rsv = lock_for(conn, &actor, &id, version, action).await?;
            close_out(conn, &rsv, to, None).await
        })
    })
    .await
}

/// Expires a reservation whose window has ended (the reconciler's step): quota first, then scalars
/// come back; its bookings already end at its end. A batch of one ([`expire_in`]); a `CONFLICT`
/// when the reservation is not due to expire (ended otherwise, or its end moved later).
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub(crate) async fn expire(db: &Db, id: &ReservationId) -> Result<()> {
    let ids = vec![id.as_str().to_owned()];
    let expired = db
        .tx("expire_reservation", TxKind::Maintenance, |conn| {
            let ids = ids.clone();
            Box::pin(async move { expire_in(conn, &ids).await })
        })
        .await?;
    if expired.is_empty() {
        return Err(conflict(format!("reservation {id} is not due to expire")));
    }
    Ok(())
}

/// Expires every reservation among `ids` that is due to expire, in one transaction
/// ([`expire_in`]). Returns the ids it expired; the others (not due, or ended otherwise
/// meanwhile) are untouched.
#[tracing::instrument(level = "debug", skip_all, fields(reservations = ids.len()))]
pub(crate) async fn expire_batch(db: &Db, ids: &[ReservationId]) -> Result<Vec<ReservationId>> {
    let ids: Vec<String> = ids.iter().map(|id| id.as_str().to_owned()).collect();
    let expired = db
        .tx("expire_reservations", TxKind::Maintenance, |conn| {
            let ids = ids.clone();
            Box::pin(async move { expire_in(conn, &ids).await })
        })
        .await?;
    Ok(expired
        .iter()
        .filter_map(|id| ReservationId::from_trusted(id))
        .collect())
}

/// One call of `compute_expire_reservations` (migration 0032): [`close_out`]'s writes for every
/// due reservation among `ids`, summed per row over them and taken in the lock order. The ids
/// it expired.
async fn expire_in(conn: &mut PgConnection, ids: &[String]) -> Result<Vec<String>> {
    let from = states(Action::Expire);
    Ok(sqlx::query_scalar!(
        r#"SELECT compute_expire_reservations($1, $2, $3, $4) AS "expired!""#,
        ids,
        &from as &[&str],
        State::Expired.as_str(),
        EventType::of_reservation(State::Expired).as_str(),
    )
    .fetch_one(&mut *conn)
    .await?)
}

/// Marks a reservation idle (the reconciler's step; `compute_reservation_idle`, migration 0034,
/// is its guard, read once the reservation's row is locked, in a statement of its own): it gets the `Idle` condition and a `reservation.idle` event; where
/// the rules that admitted it say `releaseIdle`, it is released instead, as its holder's release
/// would (quota and scalars back, bookings and usage end now), the condition saying why.
/// `false` when it is not idle (any more).
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub(crate) async fn mark_idle(db: &Db, id: &ReservationId) -> Result<bool> {
    db.tx("mark_reservation_idle", TxKind::Maintenance, |conn| {
        let id = id.clone();
        Box::pin(async move {
            // The row lock first, then the guard in the next statement: its snapshot sees what
            // a creation holding the row `FOR SHARE` committed while this waited (an instance
            // just made). A guard in the locking statement is re-checked after the wait only
            // when the row itself changed, and a creation does not change it: the reservation
            // was released (`releaseIdle`) under its new instance.
            sqlx::query!("SELECT 1 AS one FROM reservations WHERE id = $1 FOR UPDATE", id.as_str())
                .fetch_optional(&mut *conn)
                .await?;
            let Some(rsv) = query_reservations!(
                "SELECT",
                "FROM reservations r WHERE r.id = $1 AND compute_reservation_idle(r)",
                id.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?
            else {
                return Ok(false);
            };
            let rules = sqlx::query_scalar!(
                r#"SELECT r.admitted_under AS "rules!: Json<crate::fleet::PoolRules>" FROM reservations r WHERE r.id = $1"#,
                id.as_str(),
            )
            .fetch_one(&mut *conn)
            .await?
            .0;
            let grace = rules.idle_grace_seconds.unwrap_or_default();
            let release = rules.release_idle == Some(true);
            let idle = Condition {
                kind: "Idle".into(),
                status: ConditionStatus::True,
                reason: Some(if release { "ReleasedIdle" } else { "NoRunningInstance" }.into()),
                message: Some(format!(
                    "no instance ran on it for {grace} s, the idle grace of the pool's rules that admitted it{}",
                    if release { ": released" } else { "" }
                )),
                since: None,
                counts: Vec::new(),
            };
            let mut conditions = rsv.conditions.0.clone();
            conditions.push(idle);
            if release {
                close_out(conn, &rsv, State::Released, Some(conditions)).await?;
            } else {
                let rsv = query_reservations!(
                    "UPDATE reservations r SET conditions = $2, version = r.version + 1, updated_at = compute_now()
                     WHERE r.id = $1 RETURNING",
                    "",
                    id.as_str(),
                    Json(&conditions) as _,
                )
                .fetch_one(&mut *conn)
                .await?;
                emit(conn, &rsv, EventType::ReservationIdle).await?;
            }
            Ok(true)
        })
    })
    .await
}

/// Locks a reservation that may fail now (scheduled or active, and not past its end: one whose
/// window is over is expiry's, even when the expiry pass is behind), or says it cannot.
async fn lock_to_fail(conn: &mut PgConnection, id: &ReservationId) -> Result<Reservation> {
    let from = states(Action::Fail);
    query_reservations!(
        "SELECT",
        "FROM reservations r WHERE r.id = $1 AND r.state = ANY($2) AND r.ends_at > compute_now() FOR UPDATE",
        id.as_str(),
        &from as &[&str],
    )
    .fetch_optional(&mut *conn)
    .await?
    .ok_or_else(|| conflict(format!("reservation {id} cannot fail now")))
}

/// Fails a scheduled or active reservation one of whose nodes is lost (the reconciler's step):
/// its bookings end now, quota first, then scalars come back.
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub(crate) async fn fail_lost(db: &Db, id: &ReservationId) -> Result<()> {
    db.tx(
        "fail_reservation_on_lost_node",
        TxKind::Maintenance,
        |conn| {
            let id = id.clone();
            Box::pin(async move {
                let rsv = lock_to_fail(conn, &id).await?;
                // Named by id, as tenants see nodes (`Allocation.computeNodeId`): a hostname is
                // the operators' (conditions and events reach the tenant).
                let hosts = sqlx::query_scalar!(
                    "SELECT DISTINCT n.id FROM allocations a JOIN nodes n ON n.id = a.node_id \
                  WHERE a.reservation_id = $1 AND n.reachability = 'lost' ORDER BY 1",
                    id.as_str(),
                )
                .fetch_all(&mut *conn)
                .await?;
                if hosts.is_empty() {
                    return Err(conflict(format!("reservation {id} has no lost node")));
                }
                let condition = vec![Condition {
                    kind: "NodeLost".into(),
                    status: ConditionStatus::True,
                    reason: Some("NodeLost".into()),
                    message: Some(format!("its node {} was lost", hosts.join(", "))),
                    since: None,
                    counts: Vec::new(),
                }];
                close_out(conn, &rsv, State::Failed, Some(condition)).await?;
                Ok(())
            })
        },
    )
    .await
}

/// Fails a scheduled or active reservation one of whose instances the node's daemon refused with
/// `DEVICE_OVERLAP` (the reconciler's step): quota and scalars come back, but the refused
/// allocations' atoms stay booked, as `overlap_hold` bookings (never billed), until the end of
/// the window they were booked for: the daemon says something else runs on them, so placement
/// must not hand them to anyone else before an operator has looked. One transaction, in the
/// lock order of every release: the reservation row, quota, the bookings (the allocation's end,
/// then the holds), `node_resources`, the reservation's state and its `reservation.failed` event,
/// whose `DeviceOverlap` condition names the node, the atoms and until when they are held.
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub(crate) async fn fail_overlapped(db: &Db, id: &ReservationId) -> Result<()> {
    db.tx(
        "fail_reservation_on_device_overlap",
        TxKind::Maintenance,
        |conn| {
            let id = id.clone();
            Box::pin(async move {
                let rsv = lock_to_fail(conn, &id).await?;
                let refused: bool = sqlx::query_scalar!(
                    r#"SELECT EXISTS (SELECT 1 FROM instances i
                         JOIN commands c ON c.workflow_id = i.id AND c.error_code = 'DEVICE_OVERLAP'
                        WHERE i.reservation_id = $1 AND i.state = 'failed') AS "refused!""#,
                    id.as_str(),
                )
                .fetch_one(&mut *conn)
                .await?;
                if !refused {
                    return Err(conflict(format!(
                        "reservation {id} has no instance refused with DEVICE_OVERLAP"
                    )));
                }
                // The refused allocations' atoms are held from now (or the booking's start, if
                // later) to the booking's end.
                let holds = give_back(conn, &rsv).await?;
                let atoms: Vec<&str> = holds.iter().map(|h| h.atom.as_str()).collect();
                let untils: Vec<DateTime<Utc>> = holds.iter().map(|h| h.until).collect();
                let mut hosts: Vec<&str> = holds.iter().map(|h| h.node.as_str()).collect();
                hosts.dedup();
                let held = match untils.iter().max() {
                    Some(until) => format!(
                        "; {} stay booked until {}, the end of its window, for an operator to look at the node",
                        atoms.join(", "),
                        until.to_rfc3339()
                    ),
                    None => String::new(),
                };
                let condition = vec![Condition {
                    kind: "DeviceOverlap".into(),
                    status: ConditionStatus::True,
                    reason: Some("DaemonRefused".into()),
                    message: Some(format!(
                        "the daemon of node {} refused its devices: a workload it runs holds one (DEVICE_OVERLAP){held}",
                        hosts.join(", ")
                    )),
                    since: None,
                    counts: Vec::new(),
                }];
                record_end(conn, &rsv, State::Failed, Some(condition)).await?;
                Ok(())
            })
        },
    )
    .await
}

/// Places a pending reservation again (the reconciler's retry). Returns whether it was placed;
/// otherwise its `Unschedulable` condition says the latest reason and it is tried again later.
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub(crate) async fn place_pending(
    db: &Db,
    id: &ReservationId,
    allocations: Vec<(AllocationId, AllocationRequest)>,
) -> Result<bool> {
    db.tx("place_pending", TxKind::Write, |conn| {
        let (id, allocations) = (id.clone(), allocations.clone());
        Box::pin(async move {
            // Lock order: the reservation row, then (no quota: a pending reservation already holds
            // its charge) the fleet rows in `place`.
            let rsv = sqlx::query!(
                r#"SELECT r.starts_at, r.ends_at, compute_now() AS "now!"
                     FROM reservations r WHERE r.id = $1 AND r.state = 'pending' FOR UPDATE OF r"#,
                id.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?
            .map(|r| (r.starts_at, r.ends_at, r.now));
            let Some((starts_at, ends_at, now)) = rsv else {
                return Err(conflict(format!("reservation {id} is no longer pending")));
            };
            // A window that already started is placed from now on.
            let start = starts_at.max(now);
            // Its end may have passed since the retry was chosen (the retry's read and this
            // transaction see two clocks): nothing is left to place, and its expiry is due.
            if start >= ends_at {
                return Err(conflict(format!(
                    "reservation {id}'s window ended before it was placed"
                )));
            }
            let describe: Vec<String> = allocations.iter().map(|(_, a)| a.describe()).collect();
            let placement = place(conn, &id, (start, ends_at), &describe).await?;
            match placement {
                Placement::Placed => {
                    let state = if start <= now { State::Active } else { State::Scheduled };
                    // `startsAt` says when the reservation holds its devices from: placed after
                    // the start it asked for, it starts at its placement.
                    let rsv = query_reservations!(
                        "UPDATE reservations r SET state = $2, starts_at = $3, conditions = '[]', next_attempt_at = NULL,
                           version = r.version + 1, updated_at = compute_now() WHERE r.id = $1 RETURNING",
                        "",
                        id.as_str(),
                        state.as_str(),
                        start,
                    )
                    .fetch_one(&mut *conn)
                    .await?;
                    emit(conn, &rsv, EventType::of_reservation(state)).await?;
                    Ok(true)
                }
                Placement::Unschedulable(why) => {
                    // A retry that finds the same reason (type, status, reason and counts; the
                    // message names the window, whose start moves with the clock) changes only
                    // when the next retry is: no version, no event, the condition as first
                    // written. A new reason is a change: the condition, `version`, `updatedAt`
                    // and a `reservation.conditions_changed` event.
                    let changed = sqlx::query_scalar!(
                        r#"WITH cmp AS (
                             SELECT r.id,
                                    (SELECT jsonb_agg(c - 'message' - 'since' ORDER BY o) FROM jsonb_array_elements(r.conditions) WITH ORDINALITY x(c, o))
                                      IS DISTINCT FROM
                                    (SELECT jsonb_agg(c - 'message' - 'since' ORDER BY o) FROM jsonb_array_elements($2::jsonb) WITH ORDINALITY x(c, o)) AS changed
                               FROM reservations r WHERE r.id = $1)
                           UPDATE reservations r
                              SET conditions = CASE WHEN cmp.changed THEN $2 ELSE r.conditions END,
                                  version = r.version + CASE WHEN cmp.changed THEN 1 ELSE 0 END,
                                  updated_at = CASE WHEN cmp.changed THEN compute_now() ELSE r.updated_at END,
                                  next_attempt_at = compute_now() + make_interval(secs => $3::float8)
                             FROM cmp WHERE r.id = cmp.id
                           RETURNING cmp.changed AS "changed!""#,
                        id.as_str(),
                        Json(vec![why]) as _,
                        RETRY_SECONDS as f64,
                    )
                    .fetch_one(&mut *conn)
                    .await?;
                    if changed {
                        emit_changed(conn, &id, EventType::ReservationConditionsChanged).await?;
                    }
                    Ok(false)
                }
            }
        })
    })
    .await
}

/// Ends a scheduled or active reservation now: bookings end at `compute_now()`, quota and scalars
/// come back.
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub async fn release_reservation(
    db: &Db,
    actor: &Actor,
    id: &ReservationId,
    version: Option<i64>,
) -> Result<Reservation> {
    finish(db, actor, id, version, Action::Release).await
}

/// Withdraws a pending or not yet started reservation.
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub async fn cancel_reservation(
    db: &Db,
    actor: &Actor,
    id: &ReservationId,
    version: Option<i64>,
) -> Result<Reservation> {
    finish(db, actor, id, version, Action::Cancel).await
}

/// Moves the end of a scheduled or active reservation later: every booking grows, or none.
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub async fn extend_reservation(
    db: &Db,
    actor: &Actor,
    id: &ReservationId,
    ends_at: DateTime<Utc>,
    key: &str,
) -> Result<Outcome<Reservation>> {
    let key = idempotency::parse_key("idempotencyKey", key)?;
    let ends_at = crate::fleet::model::parse_time("endsAt", ends_at)?;
    let fingerprint = json!({ "reservationId": id, "endsAt": ends_at });
    db.tx("extend_reservation", TxKind::Write, |conn| {
        let (actor, id, key, fingerprint) =
            (actor.clone(), id.clone(), key.clone(), fingerprint.clone());
        Box::pin(async move {
            match idempotency::claim(conn, &actor, &key, "extendReservation", &fingerprint).await? {
                Claim::New => {}
                Claim::Refused(e) => return Ok(Err(e)),
                Claim::Replay(_) => {
                    return Ok(Ok(Outcome {
                        value: load(conn, &id).await?,
                        replayed: true,
                    }));
                }
            }
            let extended = extend_effect(conn, &actor, &id, ends_at).await;
            idempotency::settle(conn, &actor, Some(&key), extended, |o| {
                o.value.id.to_string()
            })
            .await
        })
    })
    .await?
}

/// The effect of `extend_reservation`, under the savepoint of its idempotency key.
async fn extend_effect(
    conn: &mut PgConnection,
    actor: &Actor,
    id: &ReservationId,
    ends_at: DateTime<Utc>,
) -> Result<Outcome<Reservation>> {
    // The pool's rules in force now judge the extension (a new request for more), and are
    // recorded on the reservation as what admitted it. The GPU-hours rule serializes the
    // tenant's admissions on the pool with the advisory lock `compute_create_reservation` takes,
    // before any row lock (docs/database-locks.md).
    // Another tenant's reservation takes none of its tenant's locks: `lock_for` answers
    // NOT_FOUND for it.
    let Ok(tenant) = actor.visible_tenant() else {
        return Err(Error::NotFound {
            kind: "reservation",
            id: id.to_string(),
        });
    };
    let tenant = tenant.map(TenantId::as_str);
    let ruled = sqlx::query!(
        r#"SELECT r.tenant_id, r.pool_id, p.rules AS "rules: Json<crate::fleet::PoolRules>", compute_now() AS "now!"
             FROM reservations r JOIN pools p ON p.id = r.pool_id
            WHERE r.id = $1 AND ($2::text IS NULL OR r.tenant_id = $2)"#,
        id.as_str(),
        tenant,
    )
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(r) = &ruled
        && r.rules.max_future_gpu_hours.is_some()
    {
        sqlx::query!(
            "SELECT pg_advisory_xact_lock(hashtextextended('gpuhours:' || $1 || '/' || $2, 0))",
            r.tenant_id,
            r.pool_id,
        )
        .execute(&mut *conn)
        .await?;
    }
    let rsv = lock_for(conn, actor, id, None, Action::Extend).await?;
    // `lock_for` found it, so the read above did too.
    let Some(ruled) = ruled else {
        return Err(Error::internal("a locked reservation was not read before"));
    };
    let rules = ruled.rules.0;
    if ends_at <= rsv.ends_at {
        return Err(Error::bad_input(
            "endsAt",
            format!(
                "`endsAt` must be later than the current end, {}",
                rsv.ends_at.to_rfc3339()
            ),
        ));
    }
    if ends_at - rsv.starts_at > Duration::days(super::model::MAX_DAYS) {
        return Err(Error::bad_input(
            "endsAt",
            format!(
                "a reservation lasts at most {} days",
                super::model::MAX_DAYS
            ),
        ));
    }
    if rules.extend_after_start == Some(false) && rsv.starts_at <= ruled.now {
        return Err(Error::PolicyViolation {
            rule: "extendAfterStart".into(),
            limit: Value::Bool(false),
            message: format!(
                "pool {} does not allow extending a reservation once its window has started; reservation {id} started at {}",
                rsv.pool_id,
                rsv.starts_at.to_rfc3339()
            ),
        });
    }
    if let Some(max) = rules.max_duration_seconds
        // In microseconds, as the create compares (a whole-second count let an extension
        // run up to a second past the limit).
        && (ends_at - rsv.starts_at)
            .num_microseconds()
            .is_none_or(|us| us > max.saturating_mul(1_000_000))
    {
        return Err(Error::PolicyViolation {
            rule: "maxDurationSeconds".into(),
            limit: json!(max),
            message: format!(
                "pool {} allows reservations of at most {max} seconds; extended to {} reservation {id} would last {} seconds",
                rsv.pool_id,
                ends_at.to_rfc3339(),
                (ends_at - rsv.starts_at).num_seconds()
            ),
        });
    }
    if let Some(max) = rules.max_future_gpu_hours {
        // What the tenant holds besides this reservation, and this one as extended, from now on.
        let held = sqlx::query_scalar!(
            r#"SELECT compute_future_gpu_hours($1, $2, $3, $4)::float8 AS "held!""#,
            rsv.tenant_id.as_str(),
            rsv.pool_id.as_str(),
            id.as_str(),
            ruled.now,
        )
        .fetch_one(&mut *conn)
        .await?;
        let left = (ends_at - rsv.starts_at.max(ruled.now)).num_milliseconds() as f64 / 3_600_000.0;
        let asked = rsv.charge_gpu * left;
        if held + asked > max {
            return Err(Error::PolicyViolation {
                rule: "maxFutureGpuHours".into(),
                limit: json!(max),
                message: format!(
                    "pool {} allows a tenant at most {max} GPU-hours booked ahead; tenant {} holds {:.3} besides reservation {id}, which extended would hold {:.3}",
                    rsv.pool_id, rsv.tenant_id, held, asked
                ),
            });
        }
    }
    // An extension is new time on its nodes and GPUs, which the operator is taking out of
    // service: a node cordoned (a drain cordons it) or retired, or lost; a GPU unhealthy or
    // quarantined. Not a node that is only unreachable: a partition of a minute must not stop
    // a tenant extending what still runs (its reservations are kept and billed meanwhile).
    // Read without locks (a health change holds its GPU while it waits for this reservation's
    // row: locking the GPU here would close that cycle); one that commits after this read
    // tells the reservation as it tells any holder.
    let out_of_service = sqlx::query_scalar!(
        r#"SELECT DISTINCT CASE
                    WHEN n.lifecycle <> 'active' OR n.reachability = 'lost'
                    THEN format('node %s is %s', n.id, CASE WHEN n.lifecycle <> 'active' THEN n.lifecycle ELSE n.reachability END)
                    ELSE format('GPU %s is %s', d.uuid, CASE WHEN d.quarantined THEN 'quarantined' ELSE d.health END) END AS "why!"
             FROM allocations a JOIN nodes n ON n.id = a.node_id
             JOIN device_bookings b ON b.allocation_id = a.id JOIN devices d ON d.id = b.device_id
            WHERE a.reservation_id = $1
              AND (n.lifecycle <> 'active' OR n.reachability = 'lost' OR NOT compute_device_schedulable(d.health, d.quarantined))
            ORDER BY 1"#,
        id.as_str(),
    )
    .fetch_all(&mut *conn)
    .await?;
    if !out_of_service.is_empty() {
        return Err(conflict(format!(
            "reservation {id} cannot be extended: {} (no new time is booked on it; the reservation keeps its current end)",
            out_of_service.join("; ")
        )));
    }
    // Each blocker with its tenant: another tenant's allocation is not named (its id, made
    // from its creation time, is that tenant's, and a caller bisecting `endsAt` would learn
    // when it starts and who holds it); the time it blocks from is the caller's to know.
    let blockers = sqlx::query!(
        r#"SELECT b.atom AS "atom: AtomName", b.allocation_id AS "allocation_id: AllocationId", b.reason AS "reason: BookingReason",
                  lower(b.during) AS "from!",
                  (SELECT r.tenant_id = $4 FROM allocations a JOIN reservations r ON r.id = a.reservation_id
                    WHERE a.id = b.allocation_id) AS "own?"
             FROM device_bookings b
          WHERE b.atom IN (SELECT unnest(atoms) FROM allocations WHERE reservation_id = $1)
            AND NOT EXISTS (SELECT 1 FROM allocations x WHERE x.reservation_id = $1 AND x.id = b.allocation_id)
            AND b.during && tstzrange($2, $3) ORDER BY b.atom, lower(b.during)"#,
        id.as_str(),
        rsv.ends_at,
        ends_at,
        rsv.tenant_id.as_str(),
    )
    .fetch_all(&mut *conn)
    .await?;
    if !blockers.is_empty() {
        let list: Vec<String> = blockers
            .iter()
            .map(|b| {
                let by = match (&b.allocation_id, b.own) {
                    (Some(a), Some(true)) => format!("your allocation {a}"),
                    (Some(_), _) => "another tenant's reservation".to_owned(),
                    (None, _) => format!("a {} hold", b.reason),
                };
                format!("{} is booked from {} by {by}", b.atom, b.from.to_rfc3339())
            })
            .collect();
        return Err(conflict(format!(
            "reservation {id} cannot be extended to {}: {}",
            ends_at.to_rfc3339(),
            list.join("; ")
        )));
    }
    // All bookings grow in one statement; a booking that raced in is refused by the
    // exclusion constraint, and then none grows.
    // One booking at a time, in atom order (lock rule 4, `docs/database-locks.md`): an update
    // of several rows takes them, and waits on the exclusion constraint, in its scan's order,
    // which a booking moved by an earlier update makes differ from the atoms' order; a create
    // booking the same atoms from this end (in atom order) then deadlocked with it.
    let bookings = sqlx::query_scalar!(
        "SELECT b.id FROM device_bookings b \
          WHERE b.allocation_id IN (SELECT id FROM allocations WHERE reservation_id = $1) AND upper(b.during) = $2 \
          ORDER BY b.atom",
        id.as_str(),
        rsv.ends_at,
    )
    .fetch_all(&mut *conn)
    .await?;
    for booking in bookings {
        sqlx::query!(
            "UPDATE device_bookings b SET during = tstzrange(lower(b.during), $2) WHERE b.id = $1",
            booking,
            ends_at,
        )
        .execute(&mut *conn)
        .await
        .map_err(
            |e| match e.as_database_error().and_then(|d| d.constraint()) {
                Some("device_bookings_no_overlap") => conflict(format!(
                    "reservation {id} cannot be extended: an atom was booked meanwhile"
                )),
                _ => Error::from(e),
            },
        )?;
    }
    let rsv = query_reservations!(
        "UPDATE reservations r SET ends_at = $2, admitted_under = $3, version = r.version + 1, updated_at = compute_now()
         WHERE r.id = $1 RETURNING",
        "",
        id.as_str(),
        ends_at,
        Json(&rules) as _,
    )
    .fetch_one(&mut *conn)
    .await?;
    emit(conn, &rsv, EventType::ReservationExtended).await?;
    Ok(Outcome {
        value: rsv,
        replayed: false,
    })
}
