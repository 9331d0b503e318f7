//! Level-triggered steps that move reservations with time: the reconcilers of the workers call
//! them (under their leases); tests step them directly with the simulated clock.
//!
//! Each step handles what is due now and returns how many it moved; running it again with
//! nothing due does nothing, so a repeated or concurrent run is harmless.

use super::lifecycle;
use super::model::AllocationRequest;
use super::state::State;
use super::{Allocation, query_allocations, query_reservations};
use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{self, EventType, ReservationPayload};
use crate::ids::{AllocationId, ReservationId};
use crate::outbox::{self, NewEvent};

/// Moves every scheduled reservation whose window has started to `active`, with its event, in one
/// statement.
pub async fn activate_due(db: &Db) -> Result<u64> {
    activate(db, None).await
}

/// [`activate_due`] for every due reservation, or only `id`; the moved ones are enqueued for
/// their reconciler (their next wake-up is their end), and their `reservation.active` events are
/// written in one statement, with the payload every other path writes.
async fn activate(db: &Db, id: Option<&ReservationId>) -> Result<u64> {
    db.tx("activate_reservations", TxKind::Maintenance, |conn| {
        let id = id.cloned();
        Box::pin(async move {
            // The due rows are locked first, in id order: several reservations' rows are
            // always locked in key order (`docs/database-locks.md`); an update of many rows
            // locks them in scan order, and deadlocked against a health change's update of the
            // reservations on a GPU. The reconciler of each moved reservation is woken in the
            // same statement (its next wake-up is its end).
            let moved = query_reservations!(
                "WITH due AS (SELECT r.id FROM reservations r
                   WHERE r.state = 'scheduled' AND r.starts_at <= compute_now() AND r.ends_at > compute_now()
                     AND ($1::text IS NULL OR r.id = $1)
                   ORDER BY r.id FOR UPDATE),
                      moved AS (UPDATE reservations r SET state = 'active', version = r.version + 1, updated_at = compute_now()
                   FROM due WHERE r.id = due.id RETURNING r.*),
                      woken AS (SELECT compute_enqueue($2, array_agg(m.id), $3) AS n FROM moved m)
                 SELECT",
                "FROM moved r CROSS JOIN (SELECT count(n) FROM woken) w ORDER BY r.id",
                id.as_ref().map(ReservationId::as_str),
                crate::work_queue::WorkKind::Reservation.as_str(),
                crate::work_queue::SHARDS,
            )
            .fetch_all(&mut *conn)
            .await?;
            if moved.is_empty() {
                return Ok(0);
            }
            let ids: Vec<&str> = moved.iter().map(|r| r.id.as_str()).collect();
            let allocations = query_allocations!(
                "SELECT",
                "FROM allocations a WHERE a.reservation_id = ANY($1) ORDER BY a.reservation_id, a.ordinal",
                &ids as &[&str],
            )
            .fetch_all(&mut *conn)
            .await?;
            let mut data = Vec::with_capacity(moved.len());
            for r in &moved {
                let mine: Vec<Allocation> = allocations
                    .iter()
                    .filter(|a| a.reservation_id == r.id)
                    .cloned()
                    .collect();
                data.push(events::to_data(&ReservationPayload::of(r, &mine))?);
            }
            let batch: Vec<NewEvent<'_>> = moved
                .iter()
                .zip(data)
                .map(|(r, data)| NewEvent {
                    event_type: EventType::ReservationActive,
                    tenant_id: Some(&r.tenant_id),
                    subject: r.id.as_str(),
                    data,
                })
                .collect();
            outbox::emit_all(conn, &batch).await?;
            Ok(moved.len() as u64)
        })
    })
    .await
}

/// What [`reconcile_one`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Nothing,
    Placed,
    StillPending,
    Started,
    Expired,
}

/// The stored columns the reservation reconciler decides on.
#[derive(sqlx::FromRow)]
struct Stored {
    state: State,
    starts_at: chrono::DateTime<chrono::Utc>,
    ends_at: chrono::DateTime<chrono::Utc>,
    next_attempt_at: Option<chrono::DateTime<chrono::Utc>>,
    /// `compute_now()` when it was read.
    now: chrono::DateTime<chrono::Utc>,
}

/// The reservation reconciler's work for one reservation (a work-queue key): does what is due
/// now (place a pending one whose retry time has come, start a scheduled one whose window has
/// begun, expire one whose window has ended), and returns when it is due again (`None` when it
/// is terminal). Level-triggered: running it again, or early, does nothing wrong.
#[tracing::instrument(level = "debug", skip_all, fields(reservation = %id))]
pub async fn reconcile_one(
    db: &Db,
    id: &ReservationId,
) -> Result<(Step, Option<chrono::DateTime<chrono::Utc>>)> {
    // The stored state, not the state as time says: this is the code that moves it.
    // The row and the clock in one round trip.
    let load = || async {
        let found = sqlx::query_as!(
            Stored,
            r#"SELECT r.state AS "state: _", r.starts_at, r.ends_at, r.next_attempt_at, compute_now() AS "now!"
                 FROM reservations r WHERE r.id = $1"#,
            id.as_str(),
        )
        .fetch_optional(db.pool())
        .await?;
        Ok::<_, Error>(found)
    };
    let Some(rsv) = load().await? else {
        return Ok((Step::Nothing, None));
    };
    let now = rsv.now;
    let live = !rsv.state.is_terminal();
    let mut step = Step::Nothing;
    if live && rsv.ends_at <= now {
        match lifecycle::expire(db, id).await {
            // Expired is terminal: nothing is due again, no need to read it back.
            Ok(()) => return Ok((Step::Expired, None)),
            Err(e) if e.code() == crate::ErrorCode::Conflict => step = Step::Expired,
            Err(e) => return Err(e),
        }
    } else if rsv.state == State::Pending && rsv.next_attempt_at.is_none_or(|t| t <= now) {
        let requests = requests_of(db, id).await?;
        step = match lifecycle::place_pending(db, id, requests).await {
            Ok(true) => Step::Placed,
            Ok(false) => Step::StillPending,
            Err(e) if e.code() == crate::ErrorCode::Conflict => Step::StillPending,
            Err(e) => return Err(e),
        };
    } else if rsv.state == State::Scheduled && rsv.starts_at <= now {
        activate(db, Some(id)).await?;
        step = Step::Started;
    }
    let next = match load().await? {
        Some(r) => match r.state {
            State::Pending => Some(r.next_attempt_at.map_or(r.ends_at, |t| t.min(r.ends_at))),
            State::Scheduled => Some(r.starts_at.min(r.ends_at)),
            State::Active => Some(r.ends_at),
            _ => None,
        },
        None => None,
    };
    Ok((step, next))
}

/// Expires, in one transaction, every reservation among `ids` that is due to expire (a worker's
/// claimed batch); returns those it expired, whose reconcile is then done (expired is terminal).
/// The rest are for [`reconcile_one`].
pub async fn expire_batch(db: &Db, ids: &[ReservationId]) -> Result<Vec<ReservationId>> {
    lifecycle::expire_batch(db, ids).await
}

/// Whether a step's error only says the reservation moved on without it (a conflict), as
/// opposed to this worker having lost its lease, which ends the pass.
fn moved_by_someone_else(e: &Error) -> bool {
    e.code() == crate::ErrorCode::Conflict && !matches!(e, Error::LeaseLost(_))
}

/// After a reservation's step failed in a resync pass: a lost lease or an unavailable
/// database ends the pass (returned); anything else is logged and the pass goes on, so one
/// reservation that fails at every pass (it comes first again, by id) does not hold up every
/// one after it.
fn go_on(e: Error, id: &ReservationId, step: &str) -> Result<()> {
    if matches!(e, Error::LeaseLost(_) | Error::Unavailable(_)) {
        return Err(e);
    }
    tracing::warn!(reservation = %id, error = %e, "{step} failed; the resync goes on with the others");
    Ok(())
}

/// Expires every pending, scheduled or active reservation whose window has ended: quota first,
/// then scalars come back. One transaction per reservation.
pub async fn expire_due(db: &Db) -> Result<u64> {
    let due = sqlx::query_scalar!(
        r#"SELECT id AS "id: ReservationId" FROM reservations
            WHERE state IN ('pending', 'scheduled', 'active') AND ends_at <= compute_now() ORDER BY id LIMIT 500"#,
    )
    .fetch_all(db.pool())
    .await?;
    let mut moved = 0;
    for id in due {
        match lifecycle::expire(db, &id).await {
            Ok(()) => moved += 1,
            // Someone else moved it first (released, or another worker): nothing to do.
            Err(e) if moved_by_someone_else(&e) => {}
            Err(e) => go_on(e, &id, "expiring a reservation")?,
        }
    }
    Ok(moved)
}

/// Marks (or releases, where its rules say so) every reservation idle past the idle grace of the
/// rules that admitted it ([`lifecycle::mark_idle`]); one transaction per reservation.
/// Level-triggered: a crash between the sweep and a mark loses nothing.
pub async fn mark_idle(db: &Db) -> Result<u64> {
    let due = sqlx::query_scalar!(
        r#"SELECT r.id AS "id: ReservationId" FROM reservations r
            WHERE r.state IN ('scheduled', 'active') AND r.admitted_under ? 'idleGraceSeconds'
              AND compute_reservation_idle(r) ORDER BY r.id LIMIT 500"#,
    )
    .fetch_all(db.pool())
    .await?;
    let mut marked = 0;
    for id in due {
        match lifecycle::mark_idle(db, &id).await {
            Ok(true) => marked += 1,
            Ok(false) => {}
            Err(e) => go_on(e, &id, "marking a reservation idle")?,
        }
    }
    Ok(marked)
}

/// Fails every scheduled or active reservation placed on a node that is `lost`; one
/// transaction per reservation.
pub async fn fail_lost(db: &Db) -> Result<u64> {
    let due = sqlx::query_scalar!(
        r#"SELECT DISTINCT r.id AS "id: ReservationId" FROM reservations r JOIN allocations a ON a.reservation_id = r.id
           JOIN nodes n ON n.id = a.node_id JOIN pools p ON p.id = n.pool_id
          WHERE r.state IN ('scheduled', 'active') AND r.ends_at > compute_now() AND n.reachability = 'lost'
            AND p.kind IN ('provider', 'vps_host') ORDER BY r.id LIMIT 500"#,
    )
    .fetch_all(db.pool())
    .await?;
    let mut moved = 0;
    for id in due {
        match lifecycle::fail_lost(db, &id).await {
            Ok(()) => moved += 1,
            Err(e) if moved_by_someone_else(&e) => {}
            Err(e) => go_on(e, &id, "failing a reservation on a lost node")?,
        }
    }
    Ok(moved)
}

/// Fails every scheduled or active reservation one of whose instances the node's daemon refused
/// with `DEVICE_OVERLAP` (its devices held until the window's end: [`lifecycle::fail_overlapped`]);
/// one transaction per reservation. Level-triggered: it finds them by the failed run commands
/// (a partial index, migration 0024), so a crash between the instance's failure and this loses
/// nothing.
pub async fn fail_overlapped(db: &Db) -> Result<u64> {
    let due = sqlx::query_scalar!(
        r#"SELECT DISTINCT r.id AS "id: ReservationId" FROM commands c
             JOIN instances i ON i.id = c.workflow_id AND i.state = 'failed'
             JOIN reservations r ON r.id = i.reservation_id
            WHERE c.error_code = 'DEVICE_OVERLAP' AND r.state IN ('scheduled', 'active') AND r.ends_at > compute_now()
            ORDER BY r.id LIMIT 500"#,
    )
    .fetch_all(db.pool())
    .await?;
    let mut moved = 0;
    for id in due {
        match lifecycle::fail_overlapped(db, &id).await {
            Ok(()) => moved += 1,
            Err(e) if moved_by_someone_else(&e) => {}
            Err(e) => go_on(
                e,
                &id,
                "failing a reservation whose devices a workload held",
            )?,
        }
    }
    Ok(moved)
}

fn request_of(a: &Allocation) -> AllocationRequest {
    AllocationRequest {
        gpu_kind: a.gpu_kind,
        gpu_count: a.gpu_count,
        model: a.model.clone(),
        profile: a.profile.clone(),
        slots_per_gpu: a.slots_per_gpu,
        vcpu: a.vcpu,
        memory_mib: a.memory_mib,
        disk_gib: a.disk_gib,
        node_selector: a.node_selector.0.clone(),
        tolerations: a.tolerations.0.clone(),
        same_nvlink_domain: a.same_nvlink_domain,
        same_numa_node: a.same_numa_node,
    }
}

/// What each allocation of a reservation asked for, to place it again.
async fn requests_of(
    db: &Db,
    id: &ReservationId,
) -> Result<Vec<(AllocationId, AllocationRequest)>> {
    let allocations = query_allocations!(
        "SELECT",
        "FROM allocations a WHERE a.reservation_id = $1 ORDER BY a.ordinal",
        id.as_str(),
    )
    .fetch_all(db.pool())
    .await?;
    Ok(allocations
        .iter()
        .map(|a| (a.id.clone(), request_of(a)))
        .collect())
}

/// Tries again to place every pending reservation whose `next_attempt_at` has come; returns how
/// many were placed. Those still without capacity get the latest reason and a new attempt time.
pub async fn retry_pending(db: &Db) -> Result<u64> {
    let due = query_reservations!(
        "SELECT",
        "FROM reservations r WHERE r.state = 'pending' AND r.next_attempt_at <= compute_now()
          AND r.ends_at > compute_now() ORDER BY r.next_attempt_at, r.id LIMIT 100",
    )
    .fetch_all(db.pool())
    .await?;
    let mut placed = 0;
    for rsv in due {
        let requests = match requests_of(db, &rsv.id).await {
            Ok(r) => r,
            Err(e) => {
                go_on(e, &rsv.id, "reading a pending reservation")?;
                continue;
            }
        };
        match lifecycle::place_pending(db, &rsv.id, requests).await {
            Ok(true) => placed += 1,
            Ok(_) => {}
            Err(e) if moved_by_someone_else(&e) => {}
            Err(e) => go_on(e, &rsv.id, "placing a pending reservation")?,
        }
    }
    Ok(placed)
}
