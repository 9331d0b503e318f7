//! Reservations: placement that cannot double-book, quotas, and the lifecycle.
//!
//! Durable state only. Reads are single statements on the pool, batched by id for the loaders;
//! every change is one `Db::tx` in [`commands`].

pub mod availability;
pub mod lifecycle;
pub mod model;
mod payload;
pub mod placement;
pub mod reconcile;
pub mod state;

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{FromRow, Postgres, QueryBuilder};

use crate::condition::Conditions;
use crate::db::Db;
use crate::error::Result;
use crate::fleet::model::{AtomKind, Labels};
use crate::ids::{AllocationId, AtomName, NodeId, PoolId, ReservationId, TenantId};
use crate::page::{Page, PageArgs};
use crate::quota::Charge;
use model::Toleration;
use state::State;

/// A reservation, read from rows (`query_reservations!`; the create's one round trip reads it
/// as JSON through its own decoded type, `lifecycle::ReservationJson`).
#[derive(Debug, Clone, FromRow)]
pub struct Reservation {
    pub id: ReservationId,
    pub tenant_id: TenantId,
    pub created_by: String,
    pub pool_id: PoolId,
    /// As time says (`compute_reservation_state`), not necessarily as stored.
    pub state: State,
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    pub conditions: Conditions,
    pub charge_gpu: f64,
    pub charge_vcpu: i64,
    pub charge_memory_mib: i64,
    /// The quota rows charged, as refunds read them.
    pub charged: Json<Vec<Charge>>,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    /// The gang's rule (migration 0036): `node` or `label`, the label, and whether spread.
    pub gang_colocate: Option<String>,
    pub gang_label: Option<String>,
    pub gang_spread: bool,
}

impl Reservation {
    /// The gang's rule, when it has one.
    pub fn gang(&self) -> Option<model::Gang> {
        let colocate = match self.gang_colocate.as_deref() {
            Some("node") => Some(model::Colocate::Node),
            Some("label") => Some(model::Colocate::Label),
            _ => None,
        };
        (colocate.is_some() || self.gang_spread).then(|| model::Gang {
            colocate,
            label: self.gang_label.clone(),
            spread: self.gang_spread,
        })
    }
}

/// One allocation of a reservation: what it asked for and where it was placed.
#[derive(Debug, Clone, FromRow)]
pub struct Allocation {
    pub id: AllocationId,
    pub reservation_id: ReservationId,
    pub ordinal: i32,
    pub gpu_kind: AtomKind,
    pub gpu_count: i32,
    pub model: Option<String>,
    pub profile: Option<String>,
    pub slots_per_gpu: Option<i32>,
    pub vcpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub node_selector: Json<Labels>,
    pub tolerations: Json<Vec<Toleration>>,
    pub node_id: Option<NodeId>,
    pub atoms: Vec<AtomName>,
    pub same_nvlink_domain: bool,
    pub same_numa_node: bool,
}

/// A checked `query_as!` of [`Reservation`]s: `$head` + the columns of `reservations r` + `$tail`.
/// The one home of a reservation's column list, for `SELECT … FROM reservations r …` and
/// `UPDATE reservations r … RETURNING …` alike. `state` is the state as time says
/// (`compute_reservation_state`, migration 0010); the reconcilers' guarded updates read the
/// stored `r.state`.
macro_rules! query_reservations {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $crate::reservations::Reservation,
            $head
                + r#" r.id AS "id: _", r.tenant_id AS "tenant_id: _", r.created_by, r.pool_id AS "pool_id: _",
                     compute_reservation_state(r.state, r.starts_at, r.ends_at) AS "state!: _",
                     r.starts_at, r.ends_at, r.conditions AS "conditions: _", r.charge_gpu::float8 AS "charge_gpu!",
                     r.charge_vcpu, r.charge_memory_mib, r.charged AS "charged: _", r.next_attempt_at, r.version,
                     r.created_at, r.updated_at, r.ended_at, r.gang_colocate, r.gang_label, r.gang_spread "#
                + $tail
            $(, $arg)*
        )
    };
}
pub(crate) use query_reservations;

/// A checked `query_as!` of [`Allocation`]s: `$head` + the columns of `allocations a` + `$tail`.
macro_rules! query_allocations {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $crate::reservations::Allocation,
            $head
                + r#" a.id AS "id: _", a.reservation_id AS "reservation_id: _", a.ordinal, a.gpu_kind AS "gpu_kind: _",
                     a.gpu_count, a.model, a.profile, a.slots_per_gpu, a.vcpu, a.memory_mib, a.disk_gib,
                     a.node_selector AS "node_selector: _", a.tolerations AS "tolerations: _",
                     a.node_id AS "node_id: _", a.atoms AS "atoms: _", a.same_nvlink_domain, a.same_numa_node "#
                + $tail
            $(, $arg)*
        )
    };
}
pub(crate) use query_allocations;

/// The reservation columns of the dynamic list query (its filters are built at run time).
const RSV_COLS: &str = "r.id, r.tenant_id, r.created_by, r.pool_id, \
     compute_reservation_state(r.state, r.starts_at, r.ends_at) AS state, r.starts_at, r.ends_at, \
     r.conditions, r.charge_gpu::float8 AS charge_gpu, r.charge_vcpu, r.charge_memory_mib, r.charged, r.next_attempt_at, \
     r.version, r.created_at, r.updated_at, r.ended_at, r.gang_colocate, r.gang_label, r.gang_spread";

/// Reservations by id.
pub async fn get_reservations(db: &Db, ids: &[ReservationId]) -> Result<Vec<Reservation>> {
    let ids: Vec<&str> = ids.iter().map(ReservationId::as_str).collect();
    Ok(query_reservations!(
        "SELECT",
        "FROM reservations r WHERE r.id = ANY($1)",
        &ids as &[&str]
    )
    .fetch_all(db.pool())
    .await?)
}

/// The allocations of each reservation, in order.
pub async fn allocations_by_reservations(
    db: &Db,
    ids: &[ReservationId],
) -> Result<Vec<Allocation>> {
    let ids: Vec<&str> = ids.iter().map(ReservationId::as_str).collect();
    Ok(query_allocations!(
        "SELECT",
        "FROM allocations a WHERE a.reservation_id = ANY($1) ORDER BY a.reservation_id, a.ordinal",
        &ids as &[&str],
    )
    .fetch_all(db.pool())
    .await?)
}

/// Filters of the reservations connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ReservationFilter {
    /// Only this tenant's (always set for members).
    pub tenant_id: Option<TenantId>,
    pub state: Option<State>,
    pub pool_id: Option<PoolId>,
    /// Only reservations whose window overlaps this one.
    pub window: Option<crate::fleet::model::Window>,
}

fn select<'a>(cols: &str, f: &ReservationFilter) -> QueryBuilder<'a, Postgres> {
    let mut qb = QueryBuilder::new(format!("SELECT {cols} FROM reservations r WHERE TRUE"));
    if let Some(t) = &f.tenant_id {
        qb.push(" AND r.tenant_id = ").push_bind(t.clone());
    }
    if let Some(s) = f.state {
        qb.push(" AND compute_reservation_state(r.state, r.starts_at, r.ends_at) = ")
            .push_bind(s);
    }
    if let Some(p) = &f.pool_id {
        qb.push(" AND r.pool_id = ").push_bind(p.clone());
    }
    if let Some(w) = f.window {
        qb.push(" AND tstzrange(r.starts_at, r.ends_at) && tstzrange(")
            .push_bind(w.start)
            .push(", ")
            .push_bind(w.end)
            .push(")");
    }
    qb
}

/// A page of reservations.
pub async fn list_reservations(
    db: &Db,
    filter: &ReservationFilter,
    page: &PageArgs,
) -> Result<Page<Reservation>> {
    crate::page::fetch_page(select(RSV_COLS, filter), "r.id", page, db).await
}

/// The pool rules that admitted each of these reservations (at its creation, or its latest
/// extension); `None` for one admitted before rules were recorded (migration 0034).
pub async fn admitted_under(
    db: &Db,
    ids: &[ReservationId],
) -> Result<Vec<(ReservationId, Option<crate::fleet::PoolRules>)>> {
    let ids: Vec<&str> = ids.iter().map(ReservationId::as_str).collect();
    let rows: Vec<(ReservationId, Option<Json<crate::fleet::PoolRules>>)> =
        sqlx::query_as("SELECT r.id, r.admitted_under FROM reservations r WHERE r.id = ANY($1)")
            .bind(&ids)
            .fetch_all(db.pool())
            .await?;
    Ok(rows
        .into_iter()
        .map(|(id, r)| (id, r.map(|r| r.0)))
        .collect())
}

/// How many reservations match.
pub async fn count_reservations(db: &Db, filter: &ReservationFilter) -> Result<i64> {
    let (n,): (i64,) = select("count(*)", filter)
        .build_query_as()
        .fetch_one(db.pool())
        .await?;
    Ok(n)
}
