//! Pools: create (idempotent) and update, with the overcommit ratios their nodes copy.

use super::*;

/// Input of `create_pool`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NewPool {
    pub site_id: SiteId,
    pub name: String,
    pub kind: PoolKind,
    pub lost_after_seconds: Option<i64>,
    pub vcpu_ratio: f64,
    pub memory_ratio: f64,
    pub disk_ratio: f64,
}

fn check_lost_after(kind: PoolKind, lost_after: Option<i64>) -> Result<()> {
    match lost_after {
        Some(_) if kind == PoolKind::BareMetal => Err(Error::bad_input(
            "lostAfterSeconds",
            "bare-metal pools are never marked lost automatically: leave `lostAfterSeconds` unset",
        )),
        Some(s) => crate::fleet::model::parse_lost_after("lostAfterSeconds", s).map(|_| ()),
        None => Ok(()),
    }
}

/// Creates a pool in a site; with an idempotency key, a retry returns the same pool.
#[tracing::instrument(level = "debug", skip_all, fields(site = %input.site_id, name = %input.name))]
pub async fn create_pool(
    db: &Db,
    actor: &Actor,
    input: NewPool,
    idempotency_key: Option<String>,
) -> Result<Outcome<Pool>> {
    check_lost_after(input.kind, input.lost_after_seconds)?;
    let idempotency_key = idempotency_key
        .map(|k| idempotency::parse_key("idempotencyKey", &k))
        .transpose()?;
    let id = PoolId::generate();
    let request = serde_json::to_value(&input).map_err(Error::internal)?;
    db.tx("create_pool", TxKind::Write, |conn| {
        let (id, input, request, key, actor) =
            (id.clone(), input.clone(), request.clone(), idempotency_key.clone(), actor.clone());
        Box::pin(async move {
            if let Some(key) = &key {
                match idempotency::claim(conn, &actor, key, "createPool", &request).await? {
                    Claim::New => {}
                    Claim::Refused(e) => return Ok(Err(e)),
                    Claim::Replay(id) => {
                        let value = query_pools!("SELECT", "FROM pools p WHERE p.id = $1", id)
                            .fetch_one(&mut *conn)
                            .await?;
                        return Ok(Ok(Outcome { value, replayed: true }));
                    }
                }
            }
            let created = async {
            // The foreign key takes the site row FOR KEY SHARE.
            let pool = query_pools!(
                "INSERT INTO pools AS p (id, site_id, name, kind, lost_after, vcpu_ratio, memory_ratio, disk_ratio)
                 VALUES ($1, $2, $3, $4, make_interval(secs => $5::float8), $6::float8, $7::float8, $8::float8) RETURNING",
                "",
                id.as_str(),
                input.site_id.as_str(),
                input.name,
                input.kind.as_str(),
                input.lost_after_seconds.map(|s| s as f64),
                input.vcpu_ratio,
                input.memory_ratio,
                input.disk_ratio,
            )
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| {
                on_constraint(
                    e,
                    &[
                        ("pools_site_id_fkey", &|| Error::NotFound { kind: "site", id: input.site_id.to_string() }),
                        ("pools_site_name_key", &|| conflict(format!("site {} already has a pool named `{}`", input.site_id, input.name), None)),
                    ],
                )
            })?;
            emit(conn, EventType::PoolCreated, &pool.id, &PoolPayload { pool: (&pool).into() }).await?;
            Ok(Outcome { value: pool, replayed: false })
            }
            .await;
            idempotency::settle(conn, &actor, key.as_deref(), created, |o| o.value.id.to_string()).await
        })
    })
    .await?
}

/// Changes to a pool; `None` leaves a field as it is.
#[derive(Debug, Clone, Default)]
pub struct PoolChanges {
    pub name: Option<String>,
    /// `Some(None)` clears it.
    pub lost_after_seconds: Option<Option<i64>>,
    pub vcpu_ratio: Option<f64>,
    pub memory_ratio: Option<f64>,
    pub disk_ratio: Option<f64>,
    /// Replaces every rule ([`PoolRules::parse`]); existing reservations keep the rules that
    /// admitted them.
    pub rules: Option<PoolRules>,
}

/// Changes a pool. New overcommit ratios apply to its nodes' resources in the same transaction;
/// a ratio that would leave a node over-allocated is refused.
#[tracing::instrument(level = "debug", skip_all, fields(pool = %id))]
pub async fn update_pool(db: &Db, id: &PoolId, version: i64, changes: PoolChanges) -> Result<Pool> {
    let rules = changes
        .rules
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(Error::internal)?;
    db.tx("update_pool", TxKind::Write, |conn| {
        let (id, changes, rules) = (id.clone(), changes.clone(), rules.clone());
        Box::pin(async move {
            let pool = query_pools!(
                "UPDATE pools AS p SET name = coalesce($3, p.name),
                   lost_after = CASE WHEN $4 THEN make_interval(secs => $5::float8) ELSE p.lost_after END,
                   vcpu_ratio = coalesce($6::float8, p.vcpu_ratio), memory_ratio = coalesce($7::float8, p.memory_ratio),
                   disk_ratio = coalesce($8::float8, p.disk_ratio), rules = coalesce($9::jsonb, p.rules),
                   version = p.version + 1, updated_at = compute_now()
                 WHERE p.id = $1 AND p.version = $2 RETURNING",
                "",
                id.as_str(),
                version,
                changes.name,
                changes.lost_after_seconds.is_some(),
                changes.lost_after_seconds.flatten().map(|s| s as f64),
                changes.vcpu_ratio,
                changes.memory_ratio,
                changes.disk_ratio,
                rules,
            )
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| {
                on_constraint(
                    e,
                    &[
                        ("pools_site_name_key", &|| conflict("the site already has a pool with that name", None)),
                        ("pools_lost_after", &|| Error::bad_input("lostAfterSeconds", "bare-metal pools are never marked lost automatically")),
                    ],
                )
            })?;
            let Some(pool) = pool else {
                return Err(explain_miss(conn, "pools", "pool", id.as_str(), Some(version)).await);
            };
            if changes.vcpu_ratio.is_some() || changes.memory_ratio.is_some() || changes.disk_ratio.is_some() {
                // Lock order: pools (held), then node_resources in key order first (an UPDATE
                // of many rows locks them in its plan's order, and placements and expiry batches
                // lock several nodes' rows in key order).
                sqlx::query(
                    "SELECT 1 FROM node_resources r JOIN nodes n ON n.id = r.node_id \
                      WHERE n.pool_id = $1 ORDER BY r.node_id, r.resource FOR UPDATE OF r",
                )
                .bind(id.as_str())
                .execute(&mut *conn)
                .await?;
                sqlx::query!(
                    "UPDATE node_resources r SET ratio = CASE r.resource WHEN 'vcpu' THEN p.vcpu_ratio \
                       WHEN 'memory_mib' THEN p.memory_ratio ELSE p.disk_ratio END \
                     FROM nodes n, pools p WHERE n.id = r.node_id AND p.id = n.pool_id AND n.pool_id = $1",
                    id.as_str(),
                )
                .execute(&mut *conn)
                .await
                .map_err(|e| {
                    on_constraint(
                        e,
                        &[("node_resources_within_limit", &|| {
                            conflict("the lower ratio would leave a node of the pool allocated beyond its limit", Some(version))
                        })],
                    )
                })?;
            }
            emit(conn, EventType::PoolUpdated, &pool.id, &PoolPayload { pool: (&pool).into() }).await?;
            Ok(pool)
        })
    })
    .await
}
