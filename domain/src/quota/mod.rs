//! Quota limits per tenant and scope (a pool or a site). Reservations charge them; here they are
//! set and read.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgConnection};

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{self, EventType, QuotaPayload, QuotaView};
use crate::idempotency::Actor;
use crate::ids::{ScopeId, TenantId};
use crate::outbox::{self, NewEvent};
pub mod model;
mod payload;

pub use model::QuotaResource;

/// One quota row a reservation charged, as its refund reads it back (`reservations.charged`,
/// `[{"scope_kind", "scope_id", "resource", "amount"}]`; `scope_kind` is kept for readers of
/// the column, and is always `scope_id`'s kind).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Charge {
    pub scope_kind: String,
    pub scope_id: ScopeId,
    pub resource: QuotaResource,
    pub amount: f64,
}

/// One limit and its usage.
#[derive(Debug, Clone, FromRow)]
pub struct Quota {
    pub tenant_id: TenantId,
    #[sqlx(rename = "scope_id")]
    pub scope: ScopeId,
    pub resource: QuotaResource,
    pub max_amount: f64,
    pub used: f64,
    pub version: i64,
    pub updated_at: DateTime<Utc>,
}

/// The largest vCPU or memory limit (the column holds 12 digits before the point).
pub const MAX_SCALAR_LIMIT: i64 = 100_000_000_000;

/// Limits to set; `None` leaves a resource as it is.
#[derive(Debug, Clone, Default)]
pub struct QuotaLimits {
    pub gpus: Option<f64>,
    pub vcpu: Option<i64>,
    pub memory_mib: Option<i64>,
}

/// Sets limits for `tenant` on a pool (`pool_…`) or a site (`site_…`).
#[tracing::instrument(level = "debug", skip_all, fields(tenant = %tenant, scope = %scope))]
pub async fn set_quota(
    db: &Db,
    actor: &Actor,
    tenant: &TenantId,
    scope: &ScopeId,
    limits: QuotaLimits,
) -> Result<Vec<Quota>> {
    let mut rows: Vec<(QuotaResource, f64)> = Vec::new();
    if let Some(g) = limits.gpus {
        if !(0.0..=1_000_000.0).contains(&g) || !g.is_finite() {
            return Err(Error::bad_input(
                "gpus",
                "`gpus` must be between 0 and 1000000",
            ));
        }
        rows.push((QuotaResource::Gpu, g));
    }
    if let Some(v) = limits.vcpu {
        if !(0..=MAX_SCALAR_LIMIT).contains(&v) {
            return Err(Error::bad_input(
                "vcpu",
                format!("`vcpu` must be between 0 and {MAX_SCALAR_LIMIT}"),
            ));
        }
        rows.push((QuotaResource::Vcpu, v as f64));
    }
    if let Some(m) = limits.memory_mib {
        if !(0..=MAX_SCALAR_LIMIT).contains(&m) {
            return Err(Error::bad_input(
                "memoryMib",
                format!("`memoryMib` must be between 0 and {MAX_SCALAR_LIMIT}"),
            ));
        }
        rows.push((QuotaResource::MemoryMib, m as f64));
    }
    if rows.is_empty() {
        return Err(Error::bad_input(
            "gpus",
            "give at least one of `gpus`, `vcpu`, `memoryMib`",
        ));
    }
    // Upserted in key order (gpu, memory_mib, vcpu), as every charge and refund locks them
    // (docs/database-locks.md): in the order given, `vcpu` came before `memory_mib` and a create
    // holding one while waiting for the other closed a cycle.
    rows.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    let subject = actor.subject.clone();
    db.tx("set_quota", TxKind::Write, move |conn| {
        let (tenant, scope, rows, subject) = (tenant.clone(), scope.clone(), rows.clone(), subject.clone());
        Box::pin(async move {
            // Lock order (docs/database-locks.md): the tenant's quota lock, exclusive (every
            // create holds it shared while it charges, so none is in flight while what the
            // tenant holds is counted); then, for a limit new on this scope, the tenant's live
            // reservations on it in id order; then quota_usage, its rows in key order (the INSERT
            // takes them in `unnest`'s order); then the scope's row (FOR KEY SHARE: it must exist
            // and stay).
            sqlx::query!(
                "SELECT pg_advisory_xact_lock(hashtextextended('quota:' || $1, 0))",
                tenant.as_str(),
            )
            .execute(&mut *conn)
            .await?;
            let resources: Vec<&str> = rows.iter().map(|(r, _)| r.as_str()).collect();
            let amounts: Vec<f64> = rows.iter().map(|(_, a)| *a).collect();
            let fresh: Vec<String> = sqlx::query_scalar!(
                r#"SELECT n.resource AS "resource!" FROM unnest($4::text[]) AS n(resource)
                    WHERE NOT EXISTS (SELECT 1 FROM quota_usage q WHERE q.tenant_id = $1 AND q.scope_kind = $2
                                         AND q.scope_id = $3 AND q.resource = n.resource)"#,
                tenant.as_str(),
                scope.kind(),
                scope.as_str(),
                &resources as &[&str],
            )
            .fetch_all(&mut *conn)
            .await?;
            // A limit new on this scope starts from what the tenant holds there: each live
            // reservation of the scope is charged to the new row (its `charged` says so, so its
            // end refunds it). Before, the row started at 0 and a tenant holding 8 GPUs under
            // a new limit of 4 could take 4 more.
            let held: Vec<(String, f64)> = if fresh.is_empty() {
                Vec::new()
            } else {
                sqlx::query!(
                    r#"WITH live AS (
                           SELECT r.id, r.charge_gpu, r.charge_vcpu, r.charge_memory_mib
                             FROM reservations r JOIN pools p ON p.id = r.pool_id
                            WHERE r.tenant_id = $1 AND r.state IN ('pending', 'scheduled', 'active')
                              AND CASE $2 WHEN 'pool' THEN r.pool_id = $3 ELSE p.site_id = $3 END
                            ORDER BY r.id FOR UPDATE OF r),
                       asks AS (
                           SELECT l.id, n.resource,
                                  CASE n.resource WHEN 'gpu' THEN l.charge_gpu WHEN 'vcpu' THEN l.charge_vcpu::numeric
                                                  ELSE l.charge_memory_mib::numeric END AS amount
                             FROM live l CROSS JOIN unnest($4::text[]) AS n(resource)),
                       noted AS (
                           UPDATE reservations r SET charged = r.charged || a.entries
                             FROM (SELECT id, jsonb_agg(jsonb_build_object('scope_kind', $2::text, 'scope_id', $3::text,
                                                                           'resource', resource, 'amount', amount::float8)
                                                        ORDER BY resource) AS entries
                                     FROM asks WHERE amount > 0 GROUP BY id) a
                            WHERE r.id = a.id)
                       SELECT n.resource AS "resource!", coalesce(sum(a.amount), 0)::float8 AS "used!"
                         FROM unnest($4::text[]) AS n(resource) LEFT JOIN asks a ON a.resource = n.resource AND a.amount > 0
                        GROUP BY n.resource"#,
                    tenant.as_str(),
                    scope.kind(),
                    scope.as_str(),
                    &fresh as &[String],
                )
                .fetch_all(&mut *conn)
                .await?
                .into_iter()
                .map(|r| (r.resource, r.used))
                .collect()
            };
            let used: Vec<f64> = resources
                .iter()
                .map(|r| held.iter().find(|(h, _)| h == r).map_or(0.0, |(_, u)| *u))
                .collect();
            let quotas = sqlx::query_as!(
                Quota,
                r#"INSERT INTO quota_usage AS q (tenant_id, scope_kind, scope_id, resource, max_amount, used)
                 SELECT $1, $2, $3, r, a, u FROM unnest($4::text[], $5::float8[], $6::float8[]) AS t(r, a, u)
                 ON CONFLICT (tenant_id, scope_kind, scope_id, resource) DO UPDATE
                   SET max_amount = EXCLUDED.max_amount, version = q.version + 1, updated_at = compute_now()
                 RETURNING q.tenant_id AS "tenant_id: _", q.scope_id AS "scope: _", q.resource AS "resource: _",
                           q.max_amount::float8 AS "max_amount!", q.used::float8 AS "used!", q.version, q.updated_at"#,
                tenant.as_str(),
                scope.kind(),
                scope.as_str(),
                &resources as &[&str],
                &amounts,
                &used,
            )
            .fetch_all(&mut *conn)
            .await?;
            let exists = match &scope {
                ScopeId::Pool(p) => sqlx::query_scalar!("SELECT 1 AS found FROM pools WHERE id = $1 FOR KEY SHARE", p.as_str())
                    .fetch_optional(&mut *conn)
                    .await?,
                ScopeId::Site(site) => sqlx::query_scalar!("SELECT 1 AS found FROM sites WHERE id = $1 FOR KEY SHARE", site.as_str())
                    .fetch_optional(&mut *conn)
                    .await?,
            };
            if exists.is_none() {
                return Err(Error::NotFound { kind: scope.kind(), id: scope.to_string() });
            }
            outbox::emit(
                conn,
                NewEvent {
                    event_type: EventType::QuotaSet,
                    tenant_id: Some(&tenant),
                    subject: scope.as_str(),
                    data: events::to_data(&QuotaPayload {
                        tenant_id: tenant.clone(),
                        scope_id: scope.clone(),
                        quotas: quotas.iter().map(QuotaView::from).collect(),
                        set_by: subject.clone(),
                    })?,
                },
            )
            .await?;
            Ok(quotas)
        })
    })
    .await
}

/// The quotas of a tenant.
pub async fn quotas_of(db: &Db, tenant: &TenantId) -> Result<Vec<Quota>> {
    Ok(sqlx::query_as!(
        Quota,
        r#"SELECT tenant_id AS "tenant_id: _", scope_id AS "scope: _", resource AS "resource: _",
                  max_amount::float8 AS "max_amount!", used::float8 AS "used!", version, updated_at
             FROM quota_usage WHERE tenant_id = $1 ORDER BY scope_kind, scope_id, resource"#,
        tenant.as_str(),
    )
    .fetch_all(db.pool())
    .await?)
}

/// Gives back what a reservation charged, in key order.
pub(crate) async fn refund(
    conn: &mut PgConnection,
    tenant: &TenantId,
    charges: &[Charge],
) -> Result<()> {
    if charges.is_empty() {
        return Ok(());
    }
    let kinds: Vec<&str> = charges.iter().map(|c| c.scope_id.kind()).collect();
    let ids: Vec<&str> = charges.iter().map(|c| c.scope_id.as_str()).collect();
    let resources: Vec<&str> = charges.iter().map(|c| c.resource.as_str()).collect();
    let amounts: Vec<f64> = charges.iter().map(|c| c.amount).collect();
    sqlx::query!(
        "WITH back AS (SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::float8[]) AS w(scope_kind, scope_id, resource, amount)), \
         locked AS (SELECT q.scope_kind, q.scope_id, q.resource FROM quota_usage q JOIN back b USING (scope_kind, scope_id, resource) \
                     WHERE q.tenant_id = $1 ORDER BY q.scope_kind, q.scope_id, q.resource FOR UPDATE OF q) \
         UPDATE quota_usage q SET used = q.used - b.amount::numeric, version = q.version + 1, updated_at = compute_now() \
           FROM back b, locked l \
          WHERE q.tenant_id = $1 AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource \
            AND b.scope_kind = l.scope_kind AND b.scope_id = l.scope_id AND b.resource = l.resource",
        tenant.as_str(),
        &kinds as &[&str],
        &ids as &[&str],
        &resources as &[&str],
        &amounts,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}
