//! Operator changes to the fleet. Each runs in one `Db::tx`, writes its outbox event in the same
//! transaction, and takes its locks in the order of `docs/database-locks.md`:
//! quota_usage, pools, nodes, devices, node_resources, pool_capacity_rollup (bookings after
//! devices). Updates are guarded (`WHERE version = $v`, `lifecycle = ANY(…)`); zero rows is
//! explained as `NOT_FOUND` or `CONFLICT` by a read that follows.

use serde_json::{Value, json};
use sqlx::PgConnection;
use sqlx::types::Json;

use super::model::{AtomSpec, Labels, Layout, PoolKind, Taint, TaintEffect};
use super::state::{NodeAction, NodeLifecycle, allowed_from};
use super::{
    DEVICE_COLS, Device, NODE_COLS, Node, Pool, Site, query_devices, query_nodes, query_pools,
    query_sites,
};
use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{
    self, DevicePayload, DeviceView, EventType, HolderView, NodePayload, PoolPayload, SitePayload,
};
use crate::idempotency::{self, Actor, Claim, Outcome};
use crate::ids::{AllocationId, AtomName, DeviceId, NodeId, PoolId, SiteId};
use crate::outbox::{self, NewEvent};

/// Maps a violated constraint, by name, to a domain error; anything else passes through.
fn on_constraint(err: sqlx::Error, map: &[(&str, &dyn Fn() -> Error)]) -> Error {
    if let Some(name) = err.as_database_error().and_then(|e| e.constraint())
        && let Some((_, make)) = map.iter().find(|(c, _)| *c == name)
    {
        return make();
    }
    Error::from(err)
}

fn conflict(message: impl Into<String>, current_version: Option<i64>) -> Error {
    Error::Conflict {
        message: message.into(),
        current_version,
    }
}

/// Writes a fleet event (operators only: no tenant) with its family's payload.
async fn emit(
    conn: &mut PgConnection,
    event_type: EventType,
    subject: &impl AsRef<str>,
    payload: &impl serde::Serialize,
) -> Result<()> {
    outbox::emit(
        conn,
        NewEvent {
            event_type,
            tenant_id: None,
            subject: subject.as_ref(),
            data: events::to_data(payload)?,
        },
    )
    .await?;
    Ok(())
}

/// Explains why a guarded update of `table` matched no row.
async fn explain_miss(
    conn: &mut PgConnection,
    table: &'static str,
    kind: &'static str,
    id: &str,
    expected_version: Option<i64>,
) -> Error {
    // Dynamic over the table (sites, pools, devices), so not a checked statement.
    let found: std::result::Result<Option<i64>, sqlx::Error> =
        sqlx::query_scalar(&format!("SELECT version FROM {table} WHERE id = $1"))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await;
    match found {
        Err(e) => e.into(),
        Ok(None) => Error::NotFound {
            kind,
            id: id.to_owned(),
        },
        Ok(Some(current)) if expected_version.is_some_and(|v| v != current) => conflict(
            format!(
                "{kind} {id} has version {current}, not {}: it changed since you read it",
                expected_version.unwrap_or_default()
            ),
            Some(current),
        ),
        Ok(Some(current)) => conflict(format!("{kind} {id} cannot change now"), Some(current)),
    }
}

/// Explains why a guarded update of a node matched no row, naming an illegal transition.
async fn explain_node_miss(
    conn: &mut PgConnection,
    id: &str,
    expected_version: Option<i64>,
    action: NodeAction,
) -> Error {
    let found = sqlx::query!(
        r#"SELECT version, lifecycle AS "lifecycle: NodeLifecycle" FROM nodes WHERE id = $1"#,
        id,
    )
    .fetch_optional(&mut *conn)
    .await
    .map(|r| r.map(|r| (r.version, r.lifecycle)));
    match found {
        Ok(Some((current, lifecycle))) if !allowed_from(action).contains(&lifecycle) => conflict(
            format!("compute node {id} is {lifecycle}: {action:?} is not allowed from that state"),
            Some(current),
        ),
        _ => explain_miss(conn, "nodes", "compute node", id, expected_version).await,
    }
}

/// Input of `create_site`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NewSite {
    pub name: String,
    pub region: Option<String>,
}

/// Creates a site; with an idempotency key, a retry returns the same site.
pub async fn create_site(
    db: &Db,
    actor: &Actor,
    input: NewSite,
    idempotency_key: Option<String>,
) -> Result<Outcome<Site>> {
    let idempotency_key = idempotency_key
        .map(|k| idempotency::parse_key("idempotencyKey", &k))
        .transpose()?;
    let id = SiteId::generate();
    let request = serde_json::to_value(&input).map_err(Error::internal)?;
    db.tx(TxKind::Write, |conn| {
        let (id, input, request, key, actor) = (
            id.clone(),
            input.clone(),
            request.clone(),
            idempotency_key.clone(),
            actor.clone(),
        );
        Box::pin(async move {
            if let Some(key) = &key {
                match idempotency::claim(conn, &actor, key, "createSite", &request).await? {
                    Claim::New => {}
                    Claim::Refused(e) => return Ok(Err(e)),
                    Claim::Replay(response) => {
                        let id = response["id"].as_str().unwrap_or_default();
                        let value = query_sites!("SELECT", "FROM sites s WHERE s.id = $1", id)
                            .fetch_one(&mut *conn)
                            .await?;
                        return Ok(Ok(Outcome {
                            value,
                            replayed: true,
                        }));
                    }
                }
            }
            let created = async {
                let site = query_sites!(
                    "INSERT INTO sites AS s (id, name, region) VALUES ($1, $2, $3) RETURNING",
                    "",
                    id.as_str(),
                    input.name,
                    input.region,
                )
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| {
                    on_constraint(
                        e,
                        &[("sites_name_key", &|| {
                            conflict(
                                format!("a site named `{}` already exists", input.name),
                                None,
                            )
                        })],
                    )
                })?;
                emit(
                    conn,
                    EventType::SiteCreated,
                    &site.id,
                    &SitePayload {
                        site: (&site).into(),
                    },
                )
                .await?;
                Ok(Outcome {
                    value: site,
                    replayed: false,
                })
            }
            .await;
            idempotency::settle(
                conn,
                &actor,
                key.as_deref(),
                created,
                |o| json!({ "id": o.value.id }),
            )
            .await
        })
    })
    .await?
}

/// Changes a site's name or region.
pub async fn update_site(
    db: &Db,
    id: &SiteId,
    version: i64,
    name: Option<String>,
    region: Option<String>,
) -> Result<Site> {
    db.tx(TxKind::Write, |conn| {
        let (id, name, region) = (id.clone(), name.clone(), region.clone());
        Box::pin(async move {
            let site = query_sites!(
                "UPDATE sites AS s SET name = coalesce($3, s.name), region = coalesce($4, s.region),
                 version = s.version + 1, updated_at = compute_now()
                 WHERE s.id = $1 AND s.version = $2 RETURNING",
                "",
                id.as_str(),
                version,
                name,
                region,
            )
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| {
                on_constraint(
                    e,
                    &[("sites_name_key", &|| {
                        conflict(
                            format!(
                                "a site named `{}` already exists",
                                name.clone().unwrap_or_default()
                            ),
                            None,
                        )
                    })],
                )
            })?;
            let Some(site) = site else {
                return Err(explain_miss(conn, "sites", "site", id.as_str(), Some(version)).await);
            };
            emit(
                conn,
                EventType::SiteUpdated,
                &site.id,
                &SitePayload {
                    site: (&site).into(),
                },
            )
            .await?;
            Ok(site)
        })
    })
    .await
}

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
        Some(s) if s <= 0 => Err(Error::bad_input(
            "lostAfterSeconds",
            "`lostAfterSeconds` must be positive",
        )),
        _ => Ok(()),
    }
}

/// Creates a pool in a site; with an idempotency key, a retry returns the same pool.
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
    db.tx(TxKind::Write, |conn| {
        let (id, input, request, key, actor) =
            (id.clone(), input.clone(), request.clone(), idempotency_key.clone(), actor.clone());
        Box::pin(async move {
            if let Some(key) = &key {
                match idempotency::claim(conn, &actor, key, "createPool", &request).await? {
                    Claim::New => {}
                    Claim::Refused(e) => return Ok(Err(e)),
                    Claim::Replay(response) => {
                        let id = response["id"].as_str().unwrap_or_default();
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
            idempotency::settle(conn, &actor, key.as_deref(), created, |o| json!({ "id": o.value.id })).await
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
}

/// Changes a pool. New overcommit ratios apply to its nodes' resources in the same transaction;
/// a ratio that would leave a node over-allocated is refused.
pub async fn update_pool(db: &Db, id: &PoolId, version: i64, changes: PoolChanges) -> Result<Pool> {
    db.tx(TxKind::Write, |conn| {
        let (id, changes) = (id.clone(), changes.clone());
        Box::pin(async move {
            let pool = query_pools!(
                "UPDATE pools AS p SET name = coalesce($3, p.name),
                   lost_after = CASE WHEN $4 THEN make_interval(secs => $5::float8) ELSE p.lost_after END,
                   vcpu_ratio = coalesce($6::float8, p.vcpu_ratio), memory_ratio = coalesce($7::float8, p.memory_ratio),
                   disk_ratio = coalesce($8::float8, p.disk_ratio), version = p.version + 1, updated_at = compute_now()
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
                // Lock order: pools (held), then node_resources.
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

/// A GPU to register with its node.
#[derive(Debug, Clone)]
pub struct NewDevice {
    pub uuid: String,
    pub vendor: String,
    pub model: String,
    pub memory_mib: i64,
    pub layout: Layout,
}

/// Input of `register_node`.
#[derive(Debug, Clone)]
pub struct NewNode {
    pub pool_id: PoolId,
    pub hostname: String,
    pub labels: Labels,
    pub taints: Vec<Taint>,
    pub vcpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub devices: Vec<NewDevice>,
}

/// What a registration created.
#[derive(Debug, Clone)]
pub struct Registered {
    pub node: Node,
    pub devices: Vec<Device>,
}

/// Inserts atoms for devices, in one statement.
async fn insert_atoms(conn: &mut PgConnection, atoms: &[(DeviceId, AtomSpec)]) -> Result<()> {
    let names: Vec<&str> = atoms.iter().map(|(_, a)| a.name.as_str()).collect();
    let devices: Vec<&str> = atoms.iter().map(|(d, _)| d.as_str()).collect();
    let kinds: Vec<&str> = atoms.iter().map(|(_, a)| a.kind.as_str()).collect();
    let ordinals: Vec<i32> = atoms.iter().map(|(_, a)| a.ordinal).collect();
    let profiles: Vec<Option<&str>> = atoms.iter().map(|(_, a)| a.profile.as_deref()).collect();
    let nums: Vec<i32> = atoms.iter().map(|(_, a)| a.share_num).collect();
    let dens: Vec<i32> = atoms.iter().map(|(_, a)| a.share_den).collect();
    sqlx::query!(
        "INSERT INTO device_atoms (name, device_id, kind, ordinal, profile, share_num, share_den) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::text[], $6::int[], $7::int[])",
        &names as &[&str],
        &devices as &[&str],
        &kinds as &[&str],
        &ordinals,
        &profiles as &[Option<&str>],
        &nums,
        &dens,
    )
    .execute(&mut *conn)
    .await
    .map_err(|e| on_constraint(e, &[("device_atoms_pkey", &|| conflict("an atom with that name already exists", None))]))?;
    Ok(())
}

/// Takes the row of the pool of node `node_id` `FOR SHARE`, as the first lock of a transaction
/// that changes that pool's atoms (lock order: pools before nodes and devices). The deltas of
/// [`adjust_rollup`] commute, so such transactions share it; [`recompute_rollup`] takes it
/// `FOR NO KEY UPDATE`, so it counts the atoms only once no transaction that changes them is in
/// flight, and none starts until it commits.
async fn share_pool_of_node(conn: &mut PgConnection, node_id: &NodeId) -> Result<()> {
    sqlx::query!(
        "SELECT 1 AS locked FROM pools p WHERE p.id = (SELECT n.pool_id FROM nodes n WHERE n.id = $1) FOR SHARE",
        node_id.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(())
}

/// [`share_pool_of_node`] for the node of device `device_id`.
async fn share_pool_of_device(conn: &mut PgConnection, device_id: &DeviceId) -> Result<()> {
    sqlx::query!(
        "SELECT 1 AS locked FROM pools p WHERE p.id = \
           (SELECT n.pool_id FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.id = $1) FOR SHARE",
        device_id.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(())
}

/// Adds (`Change::Add`) or removes (`Change::Remove`) the atoms of the given devices to or from
/// the rollup of their pools, per (model, kind, profile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Add,
    Remove,
}

async fn adjust_rollup(
    conn: &mut PgConnection,
    device_ids: &[DeviceId],
    change: Change,
) -> Result<()> {
    /// `$head` + the atoms of the devices `$1` per pool, model, kind and profile + `$tail`.
    macro_rules! with_counts {
        ($head:literal, $tail:literal, $ids:expr) => {
            sqlx::query!(
                $head
                    + " SELECT n.pool_id, d.model, a.kind, coalesce(a.profile, '') AS profile, count(*)::int AS atoms
                         FROM device_atoms a JOIN devices d ON d.id = a.device_id JOIN nodes n ON n.id = d.node_id
                        WHERE a.device_id = ANY($1) GROUP BY 1, 2, 3, 4 "
                    + $tail,
                $ids
            )
        };
    }
    let ids: Vec<&str> = device_ids.iter().map(DeviceId::as_str).collect();
    // An upsert checks its proposed row before resolving the conflict, so a removal is an UPDATE.
    match change {
        Change::Add => {
            with_counts!(
                "INSERT INTO pool_capacity_rollup AS r (pool_id, model, kind, profile, atoms)",
                "ORDER BY 1, 2, 3, 4 ON CONFLICT (pool_id, model, kind, profile) DO UPDATE
                   SET atoms = r.atoms + EXCLUDED.atoms, version = r.version + 1",
                &ids as &[&str]
            )
            .execute(&mut *conn)
            .await?
        }
        Change::Remove => {
            with_counts!(
                "UPDATE pool_capacity_rollup AS r SET atoms = r.atoms - c.atoms, version = r.version + 1 FROM (",
                ") c WHERE r.pool_id = c.pool_id AND r.model = c.model AND r.kind = c.kind AND r.profile = c.profile",
                &ids as &[&str]
            )
            .execute(&mut *conn)
            .await?
        }
    };
    // The rollup reconciler checks the pools against the atoms, in this transaction (the
    // work-queue rows come last in the lock order).
    sqlx::query!(
        "SELECT compute_enqueue($2, array_agg(n.pool_id), $3) \
           FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.id = ANY($1)",
        &ids as &[&str],
        crate::work_queue::WorkKind::PoolCapacity.as_str(),
        crate::work_queue::SHARDS,
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(())
}

/// The pool capacity reconciler's work for one pool (a work-queue key): makes the pool's rollup
/// rows equal the atoms of its nodes that are not retired, counted again from the atoms. Returns
/// how many rows it had to correct (0 when the rollup was true).
///
/// The pool's row `FOR NO KEY UPDATE` comes first, in a statement of its own: it waits for every
/// transaction that changes the pool's atoms (they hold it `FOR SHARE`, [`share_pool_of_node`]) and
/// keeps new ones out, so the count, read by the next statement's snapshot, and the rollup rows
/// it overwrites are of the same moment. (Without it, a count read before a concurrent
/// registration committed would overwrite that registration's increment: a lost update.)
/// Reservations only take the pool `FOR KEY SHARE` and are not held up.
pub async fn recompute_rollup(db: &Db, pool_id: &PoolId) -> Result<u64> {
    db.tx(TxKind::Maintenance, |conn| {
        let pool_id = pool_id.clone();
        Box::pin(async move {
            let pool = sqlx::query_scalar!("SELECT 1 AS locked FROM pools WHERE id = $1 FOR NO KEY UPDATE", pool_id.as_str())
                .fetch_optional(&mut *conn)
                .await?;
            if pool.is_none() {
                return Ok(0);
            }
            let fixed = sqlx::query_scalar!(
                r#"WITH truth AS (
                     SELECT d.model, a.kind, coalesce(a.profile, '') AS profile, count(*)::int AS atoms
                       FROM device_atoms a JOIN devices d ON d.id = a.device_id JOIN nodes n ON n.id = d.node_id
                      WHERE n.pool_id = $1 AND n.retired_at IS NULL GROUP BY 1, 2, 3),
                   upserted AS (
                     INSERT INTO pool_capacity_rollup AS r (pool_id, model, kind, profile, atoms)
                     SELECT $1, t.model, t.kind, t.profile, t.atoms FROM truth t ORDER BY 2, 3, 4
                     ON CONFLICT (pool_id, model, kind, profile) DO UPDATE
                        SET atoms = EXCLUDED.atoms, version = r.version + 1 WHERE r.atoms <> EXCLUDED.atoms
                     RETURNING 1),
                   zeroed AS (
                     UPDATE pool_capacity_rollup r SET atoms = 0, version = r.version + 1
                      WHERE r.pool_id = $1 AND r.atoms <> 0
                        AND NOT EXISTS (SELECT 1 FROM truth t WHERE t.model = r.model AND t.kind = r.kind AND t.profile = r.profile)
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM upserted) + (SELECT count(*) FROM zeroed) AS "fixed!""#,
                pool_id.as_str(),
            )
            .fetch_one(&mut *conn)
            .await?;
            Ok(fixed as u64)
        })
    })
    .await
}

/// Registers a node with its resources and GPUs, and their atoms.
pub async fn register_node(db: &Db, input: NewNode) -> Result<Registered> {
    let mut seen = std::collections::HashSet::new();
    for d in &input.devices {
        if !seen.insert(d.uuid.as_str()) {
            return Err(Error::bad_input(
                "devices",
                format!("GPU {} is listed twice", d.uuid),
            ));
        }
    }
    let node_id = NodeId::generate();
    let device_ids: Vec<DeviceId> = input.devices.iter().map(|_| DeviceId::generate()).collect();
    db.tx(TxKind::Write, |conn| {
        let (input, node_id, device_ids) = (input.clone(), node_id.clone(), device_ids.clone());
        Box::pin(async move {
            // The pool's row FOR SHARE: its ratios are copied into the node's resources, so a
            // concurrent ratio change waits for this registration (or this one for it); and
            // the node's atoms join the pool's rollup, which a recompute must not overwrite
            // meanwhile (`recompute_rollup` takes the row FOR NO KEY UPDATE).
            let ratios = sqlx::query!(
                r#"SELECT vcpu_ratio::float8 AS "vcpu!", memory_ratio::float8 AS "memory!", disk_ratio::float8 AS "disk!"
                     FROM pools WHERE id = $1 FOR SHARE"#,
                input.pool_id.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?
            .map(|r| (r.vcpu, r.memory, r.disk));
            let Some((vcpu_ratio, memory_ratio, disk_ratio)) = ratios else {
                return Err(Error::NotFound { kind: "pool", id: input.pool_id.to_string() });
            };
            let node = query_nodes!(
                "INSERT INTO nodes AS n (id, pool_id, hostname, labels, taints) VALUES ($1, $2, $3, $4, $5) RETURNING",
                "",
                node_id.as_str(),
                input.pool_id.as_str(),
                input.hostname,
                Json(&input.labels) as _,
                Json(&input.taints) as _,
            )
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| on_constraint(e, &[("nodes_hostname_key", &|| conflict(format!("a node named `{}` is already registered", input.hostname), None))]))?;

            let devices: Vec<Device> = if input.devices.is_empty() {
                Vec::new()
            } else {
                let uuids: Vec<&str> = input.devices.iter().map(|d| d.uuid.as_str()).collect();
                let vendors: Vec<&str> = input.devices.iter().map(|d| d.vendor.as_str()).collect();
                let models: Vec<&str> = input.devices.iter().map(|d| d.model.as_str()).collect();
                let memory: Vec<i64> = input.devices.iter().map(|d| d.memory_mib).collect();
                let modes: Vec<&str> = input.devices.iter().map(|d| d.layout.mode().as_str()).collect();
                let layouts: Vec<Option<serde_json::Value>> =
                    input.devices.iter().map(|d| d.layout.stored().map(|l| json!(l))).collect();
                let ids: Vec<&str> = device_ids.iter().map(DeviceId::as_str).collect();
                query_devices!(
                    "INSERT INTO devices AS d (id, node_id, uuid, vendor, model, memory_mib, mode, layout)
                     SELECT i, $2, u, v, m, mem, mo, l
                       FROM unnest($1::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::text[], $8::jsonb[])
                         AS t(i, u, v, m, mem, mo, l)
                     RETURNING",
                    "",
                    &ids as &[&str],
                    node_id.as_str(),
                    &uuids as &[&str],
                    &vendors as &[&str],
                    &models as &[&str],
                    &memory,
                    &modes as &[&str],
                    &layouts as &[Option<serde_json::Value>],
                )
                .fetch_all(&mut *conn)
                .await
                .map_err(|e| on_constraint(e, &[("devices_uuid_key", &|| conflict("a GPU with one of these UUIDs is already registered", None))]))?
            };
            let atoms: Vec<(DeviceId, AtomSpec)> = input
                .devices
                .iter()
                .zip(&device_ids)
                .flat_map(|(d, id)| d.layout.atoms(&d.uuid).into_iter().map(move |a| (id.clone(), a)))
                .collect();
            if !atoms.is_empty() {
                insert_atoms(conn, &atoms).await?;
            }
            sqlx::query!(
                "INSERT INTO node_resources (node_id, resource, allocatable, ratio) \
                 VALUES ($1, 'vcpu', $2, $5::float8), ($1, 'memory_mib', $3, $6::float8), ($1, 'disk_gib', $4, $7::float8)",
                node_id.as_str(),
                input.vcpu,
                input.memory_mib,
                input.disk_gib,
                vcpu_ratio,
                memory_ratio,
                disk_ratio,
            )
            .execute(&mut *conn)
            .await?;
            if !devices.is_empty() {
                adjust_rollup(conn, &device_ids, Change::Add).await?;
            }
            emit(conn, EventType::NodeRegistered, &node.id, &NodePayload { devices: Some(devices.iter().map(DeviceView::from).collect()), ..NodePayload::of(&node) }).await?;
            Ok(Registered { node, devices })
        })
    })
    .await
}

/// A guarded update of one node: `set` is the SET list; `extra` more WHERE conditions.
async fn update_node_row(
    conn: &mut PgConnection,
    id: &NodeId,
    version: Option<i64>,
    action: NodeAction,
    set: &str,
    extra: &str,
    binds: Vec<Value>,
) -> Result<Node> {
    let sql = format!(
        "UPDATE nodes AS n SET {set}, version = n.version + 1, updated_at = compute_now() \
         WHERE n.id = $1 AND ($2::bigint IS NULL OR n.version = $2) AND n.lifecycle = ANY($3) {extra} \
         RETURNING {NODE_COLS}"
    );
    let mut q = sqlx::query_as::<_, Node>(&sql)
        .bind(id)
        .bind(version)
        .bind(allowed_from(action));
    for b in binds {
        q = q.bind(b);
    }
    match q.fetch_optional(&mut *conn).await? {
        Some(node) => Ok(node),
        None => Err(explain_node_miss(conn, id.as_str(), version, action).await),
    }
}

/// Changes a node's labels (a spec change: the generation moves).
pub async fn update_node(db: &Db, id: &NodeId, version: i64, labels: Labels) -> Result<Node> {
    db.tx(TxKind::Write, |conn| {
        let (id, labels) = (id.clone(), labels.clone());
        Box::pin(async move {
            let node = update_node_row(
                conn,
                &id,
                Some(version),
                NodeAction::Update,
                "labels = $4, generation = n.generation + 1",
                "",
                vec![json!(labels)],
            )
            .await?;
            emit(
                conn,
                EventType::NodeUpdated,
                &node.id,
                &NodePayload::of(&node),
            )
            .await?;
            Ok(node)
        })
    })
    .await
}

/// Cordons (`true`) or uncordons (`false`) a node.
pub async fn set_cordoned(
    db: &Db,
    id: &NodeId,
    version: Option<i64>,
    cordoned: bool,
    reason: Option<String>,
) -> Result<Node> {
    db.tx(TxKind::Write, |conn| {
        let (id, reason) = (id.clone(), reason.clone());
        Box::pin(async move {
            let (action, event) = if cordoned {
                (NodeAction::Cordon, EventType::NodeCordoned)
            } else {
                (NodeAction::Uncordon, EventType::NodeUncordoned)
            };
            let node = update_node_row(
                conn,
                &id,
                version,
                action,
                "cordoned = ($4::jsonb)::text::boolean, cordon_reason = $5 #>> '{}'",
                "",
                vec![json!(cordoned), json!(if cordoned { reason } else { None })],
            )
            .await?;
            emit(conn, event, &node.id, &NodePayload::of(&node)).await?;
            Ok(node)
        })
    })
    .await
}

/// Adds a taint, replacing one with the same key and effect.
pub async fn taint_node(db: &Db, id: &NodeId, version: Option<i64>, taint: Taint) -> Result<Node> {
    db.tx(TxKind::Write, |conn| {
        let (id, taint) = (id.clone(), taint.clone());
        Box::pin(async move {
            let node = update_node_row(
                conn,
                &id,
                version,
                NodeAction::Taint,
                "taints = (SELECT coalesce(jsonb_agg(t), '[]'::jsonb) FROM jsonb_array_elements(n.taints) t \
                    WHERE NOT (t->>'key' = $4->>'key' AND t->>'effect' = $4->>'effect')) || jsonb_build_array($4), \
                 generation = n.generation + 1",
                "",
                vec![json!(taint)],
            )
            .await?;
            emit(conn, EventType::NodeTainted, &node.id, &NodePayload::of(&node)).await?;
            Ok(node)
        })
    })
    .await
}

/// Removes the taints with `key` (and `effect`, when given). `NOT_FOUND` when there is none.
pub async fn untaint_node(
    db: &Db,
    id: &NodeId,
    version: Option<i64>,
    key: &str,
    effect: Option<TaintEffect>,
) -> Result<Node> {
    db.tx(TxKind::Write, |conn| {
        let (id, key) = (id.clone(), key.to_owned());
        Box::pin(async move {
            let pattern = json!({ "key": key, "effect": effect.map(|e| e.as_str()) });
            let matches = "(t->>'key' = $4->>'key' AND ($4->>'effect' IS NULL OR t->>'effect' = $4->>'effect'))";
            let result = update_node_row(
                conn,
                &id,
                version,
                NodeAction::Untaint,
                &format!(
                    "taints = (SELECT coalesce(jsonb_agg(t), '[]'::jsonb) FROM jsonb_array_elements(n.taints) t WHERE NOT {matches}), \
                     generation = n.generation + 1"
                ),
                &format!("AND EXISTS (SELECT 1 FROM jsonb_array_elements(n.taints) t WHERE {matches})"),
                vec![pattern],
            )
            .await;
            let node = match result {
                Ok(node) => node,
                // The node is there and may change, so what is missing is the taint.
                Err(Error::Conflict { message, .. }) if message.ends_with("cannot change now") => {
                    return Err(Error::NotFound { kind: "taint", id: format!("{key} on {id}") });
                }
                Err(e) => return Err(e),
            };
            emit(conn, EventType::NodeUntainted, &node.id, &NodePayload::of(&node)).await?;
            Ok(node)
        })
    })
    .await
}

/// A booking that still holds atoms of a node.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Holder {
    /// The allocation, or `None` for a maintenance hold (a mode change).
    pub allocation_id: Option<AllocationId>,
    pub reason: String,
    pub atoms: Vec<AtomName>,
    pub until: Option<chrono::DateTime<chrono::Utc>>,
}

/// Bookings on a node's GPUs that end after now, grouped by allocation.
async fn holders(conn: &mut PgConnection, node_id: &NodeId) -> Result<Vec<Holder>> {
    Ok(sqlx::query_as!(
        Holder,
        r#"SELECT b.allocation_id AS "allocation_id: _", b.reason, array_agg(b.atom ORDER BY b.atom) AS "atoms!: _",
                max(upper(b.during)) FILTER (WHERE NOT upper_inf(b.during)) AS until
           FROM device_bookings b JOIN devices d ON d.id = b.device_id
          WHERE d.node_id = $1 AND upper(b.during) > compute_now()
          GROUP BY b.allocation_id, b.reason ORDER BY b.allocation_id NULLS LAST"#,
        node_id.as_str(),
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// Cordons a node and reports what still holds its GPUs.
pub async fn drain_node(db: &Db, id: &NodeId, version: Option<i64>) -> Result<(Node, Vec<Holder>)> {
    db.tx(TxKind::Write, |conn| {
        let id = id.clone();
        Box::pin(async move {
            let node = update_node_row(
                conn,
                &id,
                version,
                NodeAction::Drain,
                "cordoned = true, cordon_reason = coalesce(n.cordon_reason, 'draining')",
                "",
                vec![],
            )
            .await?;
            let remaining = holders(conn, &id).await?;
            emit(
                conn,
                EventType::NodeDrained,
                &node.id,
                &NodePayload {
                    remaining: Some(remaining.iter().map(HolderView::from).collect()),
                    ..NodePayload::of(&node)
                },
            )
            .await?;
            Ok((node, remaining))
        })
    })
    .await
}

/// Retires a node for good. Refused while any booking on its GPUs ends after now.
pub async fn retire_node(db: &Db, id: &NodeId, version: Option<i64>) -> Result<Node> {
    db.tx(TxKind::Write, |conn| {
        let id = id.clone();
        Box::pin(async move {
            // The pool first (lock order; its atoms leave the rollup), then the node's row, in a
            // statement of its own, so the check below reads every booking committed by
            // placements that held the row FOR SHARE.
            share_pool_of_node(conn, &id).await?;
            let locked = sqlx::query_scalar!("SELECT version FROM nodes WHERE id = $1 FOR UPDATE", id.as_str())
                .fetch_optional(&mut *conn)
                .await?;
            if locked.is_none() {
                return Err(Error::NotFound { kind: "compute node", id: id.to_string() });
            }
            let remaining = holders(conn, &id).await?;
            if !remaining.is_empty() {
                let list: Vec<String> = remaining
                    .iter()
                    .map(|h| {
                        let atoms: Vec<&str> = h.atoms.iter().map(AtomName::as_str).collect();
                        let by = h.allocation_id.as_ref().map_or("mode change", AllocationId::as_str);
                        format!("{by} ({})", atoms.join(", "))
                    })
                    .collect();
                return Err(conflict(
                    format!("compute node {id} still holds bookings: {}; drain it and wait for them to end", list.join("; ")),
                    locked,
                ));
            }
            let node = update_node_row(
                conn,
                &id,
                version,
                NodeAction::Retire,
                "retired_at = compute_now(), cordoned = true, cordon_reason = coalesce(n.cordon_reason, 'retired')",
                "",
                vec![],
            )
            .await?;
            let device_ids = sqlx::query_scalar!(
                r#"SELECT id AS "id: DeviceId" FROM devices WHERE node_id = $1 ORDER BY id"#,
                id.as_str(),
            )
            .fetch_all(&mut *conn)
            .await?;
            if !device_ids.is_empty() {
                adjust_rollup(conn, &device_ids, Change::Remove).await?;
            }
            emit(conn, EventType::NodeRetired, &node.id, &NodePayload::of(&node)).await?;
            Ok(node)
        })
    })
    .await
}

/// A guarded update of one device.
async fn update_device_row(
    conn: &mut PgConnection,
    id: &DeviceId,
    version: Option<i64>,
    set: &str,
    binds: Vec<Value>,
) -> Result<Device> {
    let sql = format!(
        "UPDATE devices AS d SET {set}, version = d.version + 1, updated_at = compute_now() \
         WHERE d.id = $1 AND ($2::bigint IS NULL OR d.version = $2) RETURNING {DEVICE_COLS}"
    );
    let mut q = sqlx::query_as::<_, Device>(&sql).bind(id).bind(version);
    for b in binds {
        q = q.bind(b);
    }
    match q.fetch_optional(&mut *conn).await? {
        Some(d) => Ok(d),
        None => Err(explain_miss(conn, "devices", "device", id.as_str(), version).await),
    }
}

/// Sets a GPU's health.
pub async fn set_device_health(
    db: &Db,
    id: &DeviceId,
    version: Option<i64>,
    health: super::model::Health,
    reason: Option<String>,
) -> Result<Device> {
    db.tx(TxKind::Write, |conn| {
        let (id, reason) = (id.clone(), reason.clone());
        Box::pin(async move {
            let device = update_device_row(
                conn,
                &id,
                version,
                "health = $3 #>> '{}', health_reason = $4 #>> '{}'",
                vec![json!(health), json!(reason)],
            )
            .await?;
            emit(
                conn,
                EventType::DeviceHealthChanged,
                &device.id,
                &DevicePayload {
                    device: (&device).into(),
                },
            )
            .await?;
            Ok(device)
        })
    })
    .await
}

/// Quarantines (`Some(reason)`) or releases (`None`) a GPU.
pub async fn set_quarantine(
    db: &Db,
    id: &DeviceId,
    version: Option<i64>,
    reason: Option<String>,
) -> Result<Device> {
    db.tx(TxKind::Write, |conn| {
        let (id, reason) = (id.clone(), reason.clone());
        Box::pin(async move {
            let quarantined = reason.is_some();
            let device = update_device_row(
                conn,
                &id,
                version,
                "quarantined = ($3::jsonb)::text::boolean, quarantine_reason = $4 #>> '{}'",
                vec![json!(quarantined), json!(reason)],
            )
            .await?;
            let event = if quarantined {
                EventType::DeviceQuarantined
            } else {
                EventType::DeviceUnquarantined
            };
            emit(
                conn,
                event,
                &device.id,
                &DevicePayload {
                    device: (&device).into(),
                },
            )
            .await?;
            Ok(device)
        })
    })
    .await
}

/// The layout requested for a GPU, parsed once its memory is known.
#[derive(Debug, Clone)]
pub struct LayoutRequest {
    pub mode: super::model::DeviceMode,
    pub mig_profiles: Option<Vec<String>>,
    pub slots: Option<i64>,
}

/// A booking that keeps a GPU from changing mode.
#[derive(Debug, sqlx::FromRow)]
struct Blocker {
    atom: AtomName,
    allocation_id: Option<AllocationId>,
    reason: String,
    until: Option<chrono::DateTime<chrono::Utc>>,
}

/// The longest hold a mode change may place, in seconds.
pub const MAX_CHANGE_WINDOW_SECONDS: i64 = 86_400;

/// Changes a GPU's mode and layout. Books every atom of the GPU, the parent included, from now
/// on; commits only when nothing on the GPU is booked, and otherwise fails with `CONFLICT` naming
/// what blocks it. The new atoms (and the parent) are then held for `window_seconds`, while the
/// node applies the change.
pub async fn change_device_mode(
    db: &Db,
    id: &DeviceId,
    version: i64,
    layout: LayoutRequest,
    window_seconds: i64,
) -> Result<Device> {
    if !(0..=MAX_CHANGE_WINDOW_SECONDS).contains(&window_seconds) {
        return Err(Error::bad_input(
            "changeWindowSeconds",
            format!("`changeWindowSeconds` must be between 0 and {MAX_CHANGE_WINDOW_SECONDS}"),
        ));
    }
    db.tx(TxKind::Write, |conn| {
        let (id, layout) = (id.clone(), layout.clone());
        Box::pin(async move {
            // 0. The pool's row FOR SHARE: the GPU's atoms change in its rollup.
            share_pool_of_device(conn, &id).await?;
            // 1. The node row (lock order: nodes before devices): a spec change moves its
            //    generation; a retired node refuses.
            let from: Vec<&str> = allowed_from(NodeAction::ChangeDevice).into_iter().map(NodeLifecycle::as_str).collect();
            let node = sqlx::query_scalar!(
                "UPDATE nodes AS n SET generation = n.generation + 1, version = n.version + 1, updated_at = compute_now() \
                   FROM devices d WHERE d.id = $1 AND n.id = d.node_id AND n.lifecycle = ANY($2) RETURNING n.id",
                id.as_str(),
                &from as &[&str],
            )
            .fetch_optional(&mut *conn)
            .await?;
            if node.is_none() {
                let exists = sqlx::query_scalar!(r#"SELECT node_id AS "node_id: NodeId" FROM devices WHERE id = $1"#, id.as_str())
                    .fetch_optional(&mut *conn)
                    .await?;
                return Err(match exists {
                    None => Error::NotFound { kind: "device", id: id.to_string() },
                    Some(node_id) => conflict(format!("device {id} is on retired compute node {node_id}"), None),
                });
            }
            // 2. The device row, at the expected version.
            let device = query_devices!(
                "SELECT",
                "FROM devices d WHERE d.id = $1 AND d.version = $2 FOR UPDATE",
                id.as_str(),
                version,
            )
            .fetch_optional(&mut *conn)
            .await?;
            let Some(device) = device else {
                return Err(explain_miss(conn, "devices", "device", id.as_str(), Some(version)).await);
            };
            let new_layout = Layout::parse(
                "layout",
                layout.mode,
                layout.mig_profiles.as_deref(),
                layout.slots,
                device.memory_mib,
            )?;
            // 3. The current atoms, locked against placements that hold them FOR SHARE.
            let mut every = sqlx::query_scalar!(
                "SELECT name FROM device_atoms WHERE device_id = $1 ORDER BY name FOR UPDATE",
                id.as_str(),
            )
            .fetch_all(&mut *conn)
            .await?;
            if !every.contains(&device.uuid) {
                every.push(device.uuid.clone());
            }
            // 4. Book every atom, the parent included, from now on. The exclusion constraint
            //    refuses any overlap, so this commits only when nothing on the GPU is booked.
            let probes = sqlx::query_scalar!(
                "INSERT INTO device_bookings (atom, device_id, reason, during) \
                 SELECT a, $2, 'mode_change', tstzrange(compute_now(), 'infinity') FROM unnest($1::text[]) a \
                 ON CONFLICT DO NOTHING RETURNING id",
                &every,
                id.as_str(),
            )
            .fetch_all(&mut *conn)
            .await?;
            if probes.len() < every.len() {
                let blockers = sqlx::query_as!(
                    Blocker,
                    r#"SELECT atom AS "atom: _", allocation_id AS "allocation_id: _", reason, upper(during) AS until FROM device_bookings
                      WHERE atom = ANY($1) AND NOT (id = ANY($2)) AND during && tstzrange(compute_now(), 'infinity')
                      ORDER BY atom"#,
                    &every,
                    &probes,
                )
                .fetch_all(&mut *conn)
                .await?;
                let list: Vec<String> = blockers
                    .iter()
                    .map(|b| {
                        let by = b.allocation_id.as_ref().map_or_else(|| format!("a {} hold", b.reason), ToString::to_string);
                        match b.until {
                            Some(t) => format!("{} is booked by {by} until {}", b.atom, t.to_rfc3339()),
                            None => format!("{} is booked by {by}", b.atom),
                        }
                    })
                    .collect();
                return Err(conflict(
                    format!("device {id} cannot change mode while its atoms are booked: {}", list.join("; ")),
                    Some(device.version),
                ));
            }
            sqlx::query!("DELETE FROM device_bookings WHERE id = ANY($1)", &probes)
                .execute(&mut *conn)
                .await?;
            // 5. Replace the atoms and the layout.
            adjust_rollup(conn, std::slice::from_ref(&id), Change::Remove).await?;
            sqlx::query!("DELETE FROM device_atoms WHERE device_id = $1", id.as_str())
                .execute(&mut *conn)
                .await?;
            let atoms: Vec<(DeviceId, AtomSpec)> =
                new_layout.atoms(&device.uuid).into_iter().map(|a| (id.clone(), a)).collect();
            insert_atoms(conn, &atoms).await?;
            let device = update_device_row(
                conn,
                &id,
                Some(version),
                "mode = $3 #>> '{}', layout = CASE WHEN $4 = 'null'::jsonb THEN NULL ELSE $4 END",
                vec![json!(new_layout.mode()), json!(new_layout.stored())],
            )
            .await?;
            // 6. Hold the GPU while the node applies the change.
            if window_seconds > 0 {
                let mut held: Vec<String> = atoms.iter().map(|(_, a)| a.name.clone()).collect();
                if !held.contains(&device.uuid) {
                    held.push(device.uuid.clone());
                }
                sqlx::query!(
                    "INSERT INTO device_bookings (atom, device_id, reason, during) \
                     SELECT a, $2, 'mode_change', tstzrange(compute_now(), compute_now() + make_interval(secs => $3::float8)) \
                       FROM unnest($1::text[]) a",
                    &held,
                    id.as_str(),
                    window_seconds as f64,
                )
                .execute(&mut *conn)
                .await?;
            }
            adjust_rollup(conn, std::slice::from_ref(&id), Change::Add).await?;
            emit(conn, EventType::DeviceModeChanged, &device.id, &DevicePayload { device: (&device).into() }).await?;
            Ok(device)
        })
    })
    .await
}
