//! Quota limits per tenant and scope (a pool or a site). Reservations charge them; here they are
//! set and read.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgConnection};

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{self, EventType, QuotaPayload, QuotaView};
use crate::idempotency::Actor;
use crate::ids::{PoolId, ScopeId, SiteId, TenantId};
use crate::outbox::{self, NewEvent};
use crate::text_enum::text_enum;

text_enum!(
    /// What a quota limits.
    QuotaResource {
        /// GPUs, in whole-GPU equivalents (a MIG instance or a slot is a fraction).
        Gpu = "gpu",
        Vcpu = "vcpu",
        MemoryMib = "memory_mib",
    }
);

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

const QUOTA_COLS: &str = "tenant_id, scope_kind, scope_id, resource, max_amount::float8 AS max_amount, used::float8 AS used, version, updated_at";

/// Limits to set; `None` leaves a resource as it is.
#[derive(Debug, Clone, Default)]
pub struct QuotaLimits {
    pub gpus: Option<f64>,
    pub vcpu: Option<i64>,
    pub memory_mib: Option<i64>,
}

/// Sets limits for `tenant` on a pool (`pool_…`) or a site (`site_…`).
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
        if v < 0 {
            return Err(Error::bad_input("vcpu", "`vcpu` must not be negative"));
        }
        rows.push((QuotaResource::Vcpu, v as f64));
    }
    if let Some(m) = limits.memory_mib {
        if m < 0 {
            return Err(Error::bad_input(
                "memoryMib",
                "`memoryMib` must not be negative",
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
    let subject = actor.subject.clone();
    db.tx(TxKind::Write, move |conn| {
        let (tenant, scope, rows, subject) = (tenant.clone(), scope.clone(), rows.clone(), subject.clone());
        Box::pin(async move {
            // Lock order: quota_usage first, then the scope's row (FOR KEY SHARE: it must exist
            // and stay).
            let resources: Vec<QuotaResource> = rows.iter().map(|(r, _)| *r).collect();
            let amounts: Vec<f64> = rows.iter().map(|(_, a)| *a).collect();
            let quotas: Vec<Quota> = sqlx::query_as(&format!(
                "INSERT INTO quota_usage AS q (tenant_id, scope_kind, scope_id, resource, max_amount) \
                 SELECT $1, $2, $3, r, a FROM unnest($4::text[], $5::float8[]) AS t(r, a) \
                 ON CONFLICT (tenant_id, scope_kind, scope_id, resource) DO UPDATE \
                   SET max_amount = EXCLUDED.max_amount, version = q.version + 1, updated_at = compute_now() \
                 RETURNING {QUOTA_COLS}"
            ))
            .bind(&tenant)
            .bind(scope.kind())
            .bind(&scope)
            .bind(&resources)
            .bind(&amounts)
            .fetch_all(&mut *conn)
            .await?;
            let table = match scope {
                ScopeId::Pool(_) => "pools",
                ScopeId::Site(_) => "sites",
            };
            let exists: Option<(i32,)> = sqlx::query_as(&format!("SELECT 1 FROM {table} WHERE id = $1 FOR KEY SHARE"))
                .bind(&scope)
                .fetch_optional(&mut *conn)
                .await?;
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
    Ok(sqlx::query_as(&format!(
        "SELECT {QUOTA_COLS} FROM quota_usage WHERE tenant_id = $1 ORDER BY scope_kind, scope_id, resource"
    ))
    .bind(tenant)
    .fetch_all(db.pool())
    .await?)
}

/// Charges every quota row of the tenant on the pool and its site, all or nothing; returns the
/// rows charged. Rows are locked in key order first (lock order: quota_usage before anything
/// of the fleet). A missing row means no limit on that scope and resource.
pub(crate) async fn charge(
    conn: &mut PgConnection,
    tenant: &TenantId,
    pool_id: &PoolId,
    site_id: &SiteId,
    gpu: f64,
    vcpu: i64,
    memory: i64,
) -> Result<Vec<Charge>> {
    let (pool, site) = (
        ScopeId::Pool(pool_id.clone()),
        ScopeId::Site(site_id.clone()),
    );
    let want = [
        (&pool, QuotaResource::Gpu, gpu),
        (&pool, QuotaResource::Vcpu, vcpu as f64),
        (&pool, QuotaResource::MemoryMib, memory as f64),
        (&site, QuotaResource::Gpu, gpu),
        (&site, QuotaResource::Vcpu, vcpu as f64),
        (&site, QuotaResource::MemoryMib, memory as f64),
    ];
    let kinds: Vec<&str> = want.iter().map(|w| w.0.kind()).collect();
    let ids: Vec<&str> = want.iter().map(|w| w.0.as_str()).collect();
    let resources: Vec<QuotaResource> = want.iter().map(|w| w.1).collect();
    let amounts: Vec<f64> = want.iter().map(|w| w.2).collect();
    // `locked` takes the rows FOR UPDATE in key order; the UPDATE then charges those whose limit
    // allows it (re-reading each row's latest version). Fewer charged than locked: over quota.
    let rows: Vec<(String, ScopeId, QuotaResource, f64, bool, f64, f64)> = sqlx::query_as(
        "WITH want AS (SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::float8[]) AS w(scope_kind, scope_id, resource, amount)), \
         locked AS (SELECT q.scope_kind, q.scope_id, q.resource FROM quota_usage q \
                      JOIN want w USING (scope_kind, scope_id, resource) \
                     WHERE q.tenant_id = $1 ORDER BY q.scope_kind, q.scope_id, q.resource FOR UPDATE OF q), \
         charged AS (UPDATE quota_usage q SET used = q.used + w.amount::numeric, version = q.version + 1, updated_at = compute_now() \
                       FROM want w, locked l \
                      WHERE q.tenant_id = $1 AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource \
                        AND w.scope_kind = l.scope_kind AND w.scope_id = l.scope_id AND w.resource = l.resource \
                        AND q.used + w.amount::numeric <= q.max_amount \
                  RETURNING q.scope_kind, q.scope_id, q.resource) \
         SELECT l.scope_kind, l.scope_id, l.resource, w.amount, c.resource IS NOT NULL, q.used::float8, q.max_amount::float8 \
           FROM locked l \
           JOIN want w ON w.scope_kind = l.scope_kind AND w.scope_id = l.scope_id AND w.resource = l.resource \
           JOIN quota_usage q ON q.tenant_id = $1 AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource \
           LEFT JOIN charged c ON c.scope_kind = l.scope_kind AND c.scope_id = l.scope_id AND c.resource = l.resource",
    )
    .bind(tenant)
    .bind(&kinds)
    .bind(&ids)
    .bind(&resources)
    .bind(&amounts)
    .fetch_all(&mut *conn)
    .await?;
    if let Some((kind, id, resource, amount, _, used, max)) = rows.iter().find(|r| !r.4) {
        let unit = match resource {
            QuotaResource::Gpu => "GPUs",
            QuotaResource::Vcpu => "vCPU",
            QuotaResource::MemoryMib => "MiB of memory",
        };
        return Err(Error::QuotaExceeded(format!(
            "quota exceeded: tenant {tenant} would hold {} of its {} {unit} on {kind} {id} (holds {}, asks {})",
            amount_text(used + amount),
            amount_text(*max),
            amount_text(*used),
            amount_text(*amount),
        )));
    }
    Ok(rows
        .into_iter()
        .filter(|r| r.3 > 0.0)
        .map(|(_, scope_id, resource, amount, _, _, _)| Charge {
            scope_kind: scope_id.kind().to_owned(),
            scope_id,
            resource,
            amount,
        })
        .collect())
}

/// An amount as people write it: at most six decimals, no trailing zeros.
fn amount_text(x: f64) -> String {
    let s = format!("{x:.6}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
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
    let resources: Vec<QuotaResource> = charges.iter().map(|c| c.resource).collect();
    let amounts: Vec<f64> = charges.iter().map(|c| c.amount).collect();
    sqlx::query(
        "WITH back AS (SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::float8[]) AS w(scope_kind, scope_id, resource, amount)), \
         locked AS (SELECT q.scope_kind, q.scope_id, q.resource FROM quota_usage q JOIN back b USING (scope_kind, scope_id, resource) \
                     WHERE q.tenant_id = $1 ORDER BY q.scope_kind, q.scope_id, q.resource FOR UPDATE OF q) \
         UPDATE quota_usage q SET used = q.used - b.amount::numeric, version = q.version + 1, updated_at = compute_now() \
           FROM back b, locked l \
          WHERE q.tenant_id = $1 AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource \
            AND b.scope_kind = l.scope_kind AND b.scope_id = l.scope_id AND b.resource = l.resource",
    )
    .bind(tenant)
    .bind(&kinds)
    .bind(&ids)
    .bind(&resources)
    .bind(&amounts)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
