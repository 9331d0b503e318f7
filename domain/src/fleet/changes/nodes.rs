//! Compute nodes: registration with their GPUs and atoms, and the operator actions of the node
//! state table (update, cordon, taint, drain, retire).

use super::*;
use crate::fleet::model::{GpuUuid, Reason};

/// A GPU to register with its node.
#[derive(Debug, Clone)]
pub struct NewDevice {
    pub uuid: GpuUuid,
    pub vendor: String,
    pub model: String,
    pub memory_mib: i64,
    pub layout: Layout,
    /// Where it sits: from the registration or the daemon's inventory.
    pub topology: crate::fleet::model::Topology,
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

/// Registers a node with its resources and GPUs, and their atoms.
#[tracing::instrument(level = "debug", skip_all, fields(pool = %input.pool_id, hostname = %input.hostname))]
pub async fn register_node(db: &Db, input: NewNode) -> Result<Registered> {
    input.check()?;
    let node_id = NodeId::generate();
    db.tx("register_node", TxKind::Write, |conn| {
        let (input, node_id) = (input.clone(), node_id.clone());
        Box::pin(async move { register_in(conn, &input, &node_id).await })
    })
    .await
}

impl NewNode {
    /// What a registration checks before it writes: the GPU count, no UUID twice, and one taint
    /// per key and effect.
    pub(crate) fn check(&self) -> Result<()> {
        let input = self;
        if input.devices.len() > crate::fleet::model::MAX_GPUS_PER_NODE {
            return Err(Error::bad_input(
                "devices",
                format!(
                    "at most {} GPUs per node",
                    crate::fleet::model::MAX_GPUS_PER_NODE
                ),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for d in &input.devices {
            if !seen.insert(d.uuid.as_str()) {
                return Err(Error::bad_input(
                    "devices",
                    format!("GPU {} is listed twice", d.uuid),
                ));
            }
        }
        // One taint per key and effect, as `taintNode` keeps them (a second replaces the first).
        let mut seen = std::collections::HashSet::new();
        for t in &input.taints {
            if !seen.insert((t.key.as_str(), t.effect)) {
                return Err(Error::bad_input(
                    "taints",
                    format!(
                        "two taints with key `{}` and effect {}: a node has one per key and effect",
                        t.key, t.effect
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Registers `input` as node `node_id` in `conn` (checked by [`NewNode::check`]): the pool
/// `FOR NO KEY UPDATE`, the node, its GPUs and atoms, its resources, the rollup,
/// `node.registered`.
pub(crate) async fn register_in(
    conn: &mut PgConnection,
    input: &NewNode,
    node_id: &NodeId,
) -> Result<Registered> {
    // The pool's row FOR NO KEY UPDATE: its ratios are copied into the node's resources, so a
    // concurrent ratio change waits for this registration (or this one for it); and the
    // node's atoms join the pool's rollup, which no other change of the pool's atoms, nor a
    // recompute, changes meanwhile (`rollup::lock_pool_of_node`).
    let ratios = sqlx::query!(
                r#"SELECT vcpu_ratio::float8 AS "vcpu!", memory_ratio::float8 AS "memory!", disk_ratio::float8 AS "disk!"
                     FROM pools WHERE id = $1 FOR NO KEY UPDATE"#,
                input.pool_id.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?
            .map(|r| (r.vcpu, r.memory, r.disk));
    let Some((vcpu_ratio, memory_ratio, disk_ratio)) = ratios else {
        return Err(Error::NotFound {
            kind: "pool",
            id: input.pool_id.to_string(),
        });
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

    let devices = insert_devices(conn, node_id, &input.devices).await?;
    let device_ids: Vec<DeviceId> = devices.iter().map(|d| d.id.clone()).collect();
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
        wake_rollup_check(conn, &device_ids).await?;
    }
    emit(
        conn,
        EventType::NodeRegistered,
        &node.id,
        &NodePayload {
            devices: Some(devices.iter().map(DeviceView::from).collect()),
            ..NodePayload::of(&node)
        },
    )
    .await?;
    Ok(Registered { node, devices })
}

/// A guarded update of one node: `set` is the SET list (empty: only the version and
/// `updated_at`, which every update sets); `extra` more WHERE conditions.
pub(super) async fn update_node_row(
    conn: &mut PgConnection,
    id: &NodeId,
    version: Option<i64>,
    action: NodeAction,
    set: &str,
    extra: &str,
    binds: Vec<Value>,
) -> Result<Node> {
    let set = if set.is_empty() {
        String::new()
    } else {
        format!("{set}, ")
    };
    let sql = format!(
        "UPDATE nodes AS n SET {set}version = n.version + 1, updated_at = compute_now() \
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
#[tracing::instrument(level = "debug", skip_all, fields(node = %id))]
pub async fn update_node(db: &Db, id: &NodeId, version: i64, labels: Labels) -> Result<Node> {
    db.tx("update_node", TxKind::Write, |conn| {
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

/// Cordons a node: it keeps its work and takes no new work.
#[tracing::instrument(level = "debug", skip_all, fields(node = %id))]
pub async fn cordon_node(
    db: &Db,
    id: &NodeId,
    version: Option<i64>,
    reason: Option<Reason>,
) -> Result<Node> {
    let reason = reason.map(|r| r.as_str().to_owned());
    cordon_row(
        db,
        "cordon_node",
        id,
        version,
        NodeAction::Cordon,
        EventType::NodeCordoned,
        true,
        reason,
    )
    .await
}

/// Uncordons a node: it takes new work again.
#[tracing::instrument(level = "debug", skip_all, fields(node = %id))]
pub async fn uncordon_node(db: &Db, id: &NodeId, version: Option<i64>) -> Result<Node> {
    cordon_row(
        db,
        "uncordon_node",
        id,
        version,
        NodeAction::Uncordon,
        EventType::NodeUncordoned,
        false,
        None,
    )
    .await
}

#[expect(
    clippy::too_many_arguments,
    reason = "cordon and uncordon share it: the transaction's name, the node and its version, the action, its event, the flag and the reason"
)]
async fn cordon_row(
    db: &Db,
    name: &'static str,
    id: &NodeId,
    version: Option<i64>,
    action: NodeAction,
    event: EventType,
    cordoned: bool,
    reason: Option<String>,
) -> Result<Node> {
    db.tx(name, TxKind::Write, |conn| {
        let (id, reason) = (id.clone(), reason.clone());
        Box::pin(async move {
            let node = update_node_row(
                conn,
                &id,
                version,
                action,
                "cordoned = ($4::jsonb)::text::boolean, cordon_reason = $5 #>> '{}'",
                "",
                vec![json!(cordoned), json!(reason)],
            )
            .await?;
            emit(conn, event, &node.id, &NodePayload::of(&node)).await?;
            Ok(node)
        })
    })
    .await
}

/// Adds a taint, replacing one with the same key and effect.
#[tracing::instrument(level = "debug", skip_all, fields(node = %id))]
pub async fn taint_node(db: &Db, id: &NodeId, version: Option<i64>, taint: Taint) -> Result<Node> {
    db.tx("taint_node", TxKind::Write, |conn| {
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
#[tracing::instrument(level = "debug", skip_all, fields(node = %id))]
pub async fn untaint_node(
    db: &Db,
    id: &NodeId,
    version: Option<i64>,
    key: &str,
    effect: Option<TaintEffect>,
) -> Result<Node> {
    db.tx("untaint_node", TxKind::Write, |conn| {
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
                Err(Error::PreconditionFailed { .. }) => {
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
    pub reason: crate::fleet::model::BookingReason,
    pub atoms: Vec<AtomName>,
    pub until: Option<chrono::DateTime<chrono::Utc>>,
}

/// Bookings on a node's GPUs that end after now, grouped by allocation.
async fn holders(conn: &mut PgConnection, node_id: &NodeId) -> Result<Vec<Holder>> {
    Ok(sqlx::query_as!(
        Holder,
        r#"SELECT b.allocation_id AS "allocation_id: _", b.reason AS "reason: _", array_agg(b.atom ORDER BY b.atom) AS "atoms!: _",
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
#[tracing::instrument(level = "debug", skip_all, fields(node = %id))]
pub async fn drain_node(db: &Db, id: &NodeId, version: Option<i64>) -> Result<(Node, Vec<Holder>)> {
    db.tx("drain_node", TxKind::Write, |conn| {
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
#[tracing::instrument(level = "debug", skip_all, fields(node = %id))]
pub async fn retire_node(db: &Db, id: &NodeId, version: Option<i64>) -> Result<Node> {
    db.tx("retire_node", TxKind::Write, |conn| {
        let id = id.clone();
        Box::pin(async move {
            // The pool first (lock order; its atoms leave the rollup), then the node's row, in a
            // statement of its own, so the check below reads every booking committed by
            // placements that held the row FOR SHARE.
            lock_pool_of_node(conn, &id).await?;
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
            // A node that joined by itself: its credential opens no session from now on.
            if crate::fleet::enrollment::revoke_credential(conn, &id).await? {
                emit(conn, EventType::NodeCredentialRevoked, &node.id, &NodePayload::of(&node)).await?;
            }
            // The work-queue row last (docs/database-locks.md, rule 3).
            if !device_ids.is_empty() {
                wake_rollup_check(conn, &device_ids).await?;
            }
            Ok(node)
        })
    })
    .await
}

/// Inserts node `node_id`'s GPUs `new` with their atoms (in registration, and when an operator
/// accepts a report that names more GPUs).
pub(super) async fn insert_devices(
    conn: &mut PgConnection,
    node_id: &NodeId,
    new: &[NewDevice],
) -> Result<Vec<Device>> {
    let device_ids: Vec<DeviceId> = new.iter().map(|_| DeviceId::generate()).collect();
    let devices: Vec<Device> = if new.is_empty() {
        Vec::new()
    } else {
        let uuids: Vec<&str> = new.iter().map(|d| d.uuid.as_str()).collect();
        let vendors: Vec<&str> = new.iter().map(|d| d.vendor.as_str()).collect();
        let models: Vec<&str> = new.iter().map(|d| d.model.as_str()).collect();
        let memory: Vec<i64> = new.iter().map(|d| d.memory_mib).collect();
        let modes: Vec<&str> = new.iter().map(|d| d.layout.mode().as_str()).collect();
        let layouts: Vec<Option<serde_json::Value>> = new
            .iter()
            .map(|d| d.layout.stored().map(|l| json!(l)))
            .collect();
        let ids: Vec<&str> = device_ids.iter().map(DeviceId::as_str).collect();
        let buses: Vec<Option<&str>> = new
            .iter()
            .map(|d| d.topology.pci_bus_id.as_deref())
            .collect();
        let numas: Vec<Option<i32>> = new.iter().map(|d| d.topology.numa_node).collect();
        let domains: Vec<Option<&str>> = new
            .iter()
            .map(|d| d.topology.nvlink_domain.as_deref())
            .collect();
        query_devices!(
                    "INSERT INTO devices AS d (id, node_id, uuid, vendor, model, memory_mib, mode, layout, pci_bus_id, numa_node, nvlink_domain)
                     SELECT i, $2, u, v, m, mem, mo, l, pci, numa, nvl
                       FROM unnest($1::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::text[], $8::jsonb[],
                                   $9::text[], $10::int[], $11::text[])
                         AS t(i, u, v, m, mem, mo, l, pci, numa, nvl)
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
                    &buses as &[Option<&str>],
                    &numas as &[Option<i32>],
                    &domains as &[Option<&str>],
                )
                .fetch_all(&mut *conn)
                .await
                .map_err(|e| on_constraint(e, &[("devices_uuid_key", &|| conflict("a GPU with one of these UUIDs is already registered", None))]))?
    };
    let atoms: Vec<(DeviceId, AtomSpec)> = new
        .iter()
        .zip(&device_ids)
        .flat_map(|(d, id)| {
            d.layout
                .atoms(d.uuid.as_str())
                .into_iter()
                .map(move |a| (id.clone(), a))
        })
        .collect();
    if !atoms.is_empty() {
        insert_atoms(conn, &atoms).await?;
    }
    Ok(devices)
}
