//! Quota limits per tenant and scope (a pool or a site). Reservations charge them; here they are
//! set and read.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::FromRow;

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::idempotency::Actor;
use crate::outbox::{self, NewEvent};

/// One limit and its usage.
#[derive(Debug, Clone, Serialize, FromRow)]
pub struct Quota {
    pub tenant_id: String,
    pub scope_kind: String,
    pub scope_id: String,
    pub resource: String,
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

/// A tenant id: 1 to 63 of letters, digits, `_`, `.`, `-`.
pub fn parse_tenant(field: &str, s: &str) -> Result<String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if ok {
        Ok(s.to_owned())
    } else {
        Err(Error::bad_input(field, format!("`{s}` is not a tenant id")))
    }
}

/// Sets limits for `tenant` on a pool (`pool_…`) or a site (`site_…`).
pub async fn set_quota(
    db: &Db,
    actor: &Actor,
    tenant: &str,
    scope_id: &str,
    limits: QuotaLimits,
) -> Result<Vec<Quota>> {
    let tenant = parse_tenant("tenantId", tenant)?;
    let scope_kind = match crate::ids::prefix_of(scope_id) {
        Some("pool") => "pool",
        Some("site") => "site",
        _ => {
            return Err(Error::bad_input(
                "scopeId",
                format!("`{scope_id}` is not a pool or site id"),
            ));
        }
    };
    let mut rows: Vec<(&'static str, f64)> = Vec::new();
    if let Some(g) = limits.gpus {
        if !(0.0..=1_000_000.0).contains(&g) || !g.is_finite() {
            return Err(Error::bad_input(
                "gpus",
                "`gpus` must be between 0 and 1000000",
            ));
        }
        rows.push(("gpu", g));
    }
    if let Some(v) = limits.vcpu {
        if v < 0 {
            return Err(Error::bad_input("vcpu", "`vcpu` must not be negative"));
        }
        rows.push(("vcpu", v as f64));
    }
    if let Some(m) = limits.memory_mib {
        if m < 0 {
            return Err(Error::bad_input(
                "memoryMib",
                "`memoryMib` must not be negative",
            ));
        }
        rows.push(("memory_mib", m as f64));
    }
    if rows.is_empty() {
        return Err(Error::bad_input(
            "gpus",
            "give at least one of `gpus`, `vcpu`, `memoryMib`",
        ));
    }
    let scope_id = scope_id.to_owned();
    let subject = actor.subject.clone();
    db.tx(TxKind::Write, move |conn| {
        let (tenant, scope_id, rows, subject) = (tenant.clone(), scope_id.clone(), rows.clone(), subject.clone());
        Box::pin(async move {
            // Lock order: quota_usage first, then the scope's row (FOR KEY SHARE: it must exist
            // and stay).
            let resources: Vec<&str> = rows.iter().map(|(r, _)| *r).collect();
            let amounts: Vec<f64> = rows.iter().map(|(_, a)| *a).collect();
            let quotas: Vec<Quota> = sqlx::query_as(&format!(
                "INSERT INTO quota_usage AS q (tenant_id, scope_kind, scope_id, resource, max_amount) \
                 SELECT $1, $2, $3, r, a FROM unnest($4::text[], $5::float8[]) AS t(r, a) \
                 ON CONFLICT (tenant_id, scope_kind, scope_id, resource) DO UPDATE \
                   SET max_amount = EXCLUDED.max_amount, version = q.version + 1, updated_at = compute_now() \
                 RETURNING {QUOTA_COLS}"
            ))
            .bind(&tenant)
            .bind(scope_kind)
            .bind(&scope_id)
            .bind(&resources)
            .bind(&amounts)
            .fetch_all(&mut *conn)
            .await?;
            let table = if scope_kind == "pool" { "pools" } else { "sites" };
            let exists: Option<(i32,)> = sqlx::query_as(&format!("SELECT 1 FROM {table} WHERE id = $1 FOR KEY SHARE"))
                .bind(&scope_id)
                .fetch_optional(&mut *conn)
                .await?;
            if exists.is_none() {
                return Err(Error::NotFound { kind: scope_kind, id: scope_id });
            }
            outbox::emit(
                conn,
                NewEvent {
                    event_type: "quota.set",
                    tenant_id: Some(&tenant),
                    subject: &scope_id,
                    data: serde_json::json!({ "tenantId": tenant, "scopeId": scope_id, "quotas": quotas, "setBy": subject }),
                },
            )
            .await?;
            Ok(quotas)
        })
    })
    .await
}

/// The quotas of a tenant.
pub async fn quotas_of(db: &Db, tenant: &str) -> Result<Vec<Quota>> {
    Ok(sqlx::query_as(&format!(
        "SELECT {QUOTA_COLS} FROM quota_usage WHERE tenant_id = $1 ORDER BY scope_kind, scope_id, resource"
    ))
    .bind(tenant)
    .fetch_all(db.pool())
    .await?)
}
