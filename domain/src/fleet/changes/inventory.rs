//! What a node reports of itself, against what is registered: the inventory check of every
//! session (`InventoryMismatch`), the operator's acceptance of a report, and GPU health reports
//! (`docs/nodes.md`, "Inventory and health").
//!
//! The registration is never rewritten by a report: a difference takes the GPUs it concerns out
//! of placement (`devices.inventory_mismatch`, read through the derived `quarantined`) and raises
//! the node's `InventoryMismatch` condition; bookings are never touched. It ends when a later
//! report agrees, or when an operator accepts the report ([`accept_node_inventory`]).

use std::collections::{BTreeMap, BTreeSet};

use compute_protocol::{GpuHealth, Inventory};

use super::*;
use crate::fleet::model::{self as m, DeviceMode, Health};
use crate::ids::DeviceId;

/// The condition type a difference raises.
pub const INVENTORY_MISMATCH: &str = "InventoryMismatch";

/// A registered GPU, as the check compares it.
#[derive(Debug, Clone, sqlx::FromRow)]
struct RegisteredGpu {
    id: DeviceId,
    uuid: String,
    model: String,
    memory_mib: i64,
    mode: DeviceMode,
    layout: Option<Json<super::super::model::StoredLayout>>,
}

/// The differences between a registration and a report: those of the node as a whole (which
/// concern every GPU when the machine has less than registered), and those of each GPU.
#[derive(Debug, Default, PartialEq)]
struct Differences {
    /// Less vCPU, memory or disk than registered: every GPU's placement would overcommit.
    shortfalls: Vec<String>,
    /// GPUs the machine has that are not registered (nothing to take out of placement).
    unregistered: Vec<String>,
    /// Per registered GPU (by id): what differs.
    gpus: BTreeMap<DeviceId, Vec<String>>,
}

impl Differences {
    fn all(&self) -> Vec<String> {
        let mut v = self.shortfalls.clone();
        v.extend(self.gpus.values().flatten().cloned());
        v.extend(self.unregistered.iter().cloned());
        v
    }

    /// What `inventory_mismatch` says for GPU `id` (`None`: it agrees).
    fn of(&self, id: &DeviceId) -> Option<String> {
        let mut v = self.shortfalls.clone();
        v.extend(self.gpus.get(id).into_iter().flatten().cloned());
        (!v.is_empty()).then(|| crate::error::bounded(&v.join("; ")))
    }
}

fn compare(
    registered: &[RegisteredGpu],
    scalars: &BTreeMap<String, i64>,
    inv: &Inventory,
) -> Differences {
    let mut d = Differences::default();
    for (resource, reported, unit) in [
        ("vcpu", inv.vcpu, "vCPU"),
        ("memory_mib", inv.memory_mib, "MiB of memory"),
        ("disk_gib", inv.disk_gib, "GiB of disk"),
    ] {
        if let Some(&have) = scalars.get(resource)
            && reported < have
        {
            d.shortfalls.push(format!(
                "the machine has {reported} {unit}, {have} registered"
            ));
        }
    }
    let reported: BTreeMap<&str, &compute_protocol::GpuInventory> =
        inv.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
    for r in registered {
        let mut v = Vec::new();
        match reported.get(r.uuid.as_str()) {
            None => v.push(format!(
                "GPU {} ({}) is missing from the machine",
                r.uuid, r.model
            )),
            Some(g) => {
                if g.model != r.model {
                    v.push(format!(
                        "GPU {}: the machine reports model {}, {} registered",
                        r.uuid, g.model, r.model
                    ));
                }
                if g.memory_mib < r.memory_mib {
                    v.push(format!(
                        "GPU {}: the machine reports {} MiB, {} MiB registered",
                        r.uuid, g.memory_mib, r.memory_mib
                    ));
                }
                // In order: the daemon maps atom `<uuid>/mig/<k>` to the k-th instance.
                let have: Vec<&str> = g.mig.iter().map(|m| m.profile.as_str()).collect();
                let on = g.mig_enabled && !have.is_empty();
                match r.mode {
                    DeviceMode::Mig => {
                        let want: Vec<&str> = r
                            .layout
                            .as_ref()
                            .and_then(|l| l.profiles.as_ref())
                            .map(|p| p.iter().map(String::as_str).collect())
                            .unwrap_or_default();
                        if !on {
                            v.push(format!(
                                "GPU {}: MIG is off on the machine, registered as MIG ({})",
                                r.uuid,
                                want.join(", ")
                            ));
                        } else if have != want {
                            v.push(format!(
                                "GPU {}: the machine's MIG instances are {}, registered {} (in this order)",
                                r.uuid,
                                have.join(", "),
                                want.join(", ")
                            ));
                        }
                    }
                    mode if on => v.push(format!(
                        "GPU {}: MIG is on on the machine ({}), registered {}",
                        r.uuid,
                        have.join(", "),
                        mode.as_str()
                    )),
                    _ => {}
                }
            }
        }
        if !v.is_empty() {
            d.gpus.insert(r.id.clone(), v);
        }
    }
    let known: BTreeSet<&str> = registered.iter().map(|r| r.uuid.as_str()).collect();
    for g in &inv.gpus {
        if !known.contains(g.uuid.as_str()) {
            d.unregistered.push(format!(
                "the machine has GPU {} ({}, {} MiB) that is not registered",
                g.uuid, g.model, g.memory_mib
            ));
        }
    }
    d
}

/// Reads node `id`'s registered GPUs and resources in `conn`.
async fn registration(
    conn: &mut PgConnection,
    id: &NodeId,
) -> Result<(Vec<RegisteredGpu>, BTreeMap<String, i64>)> {
    let gpus: Vec<RegisteredGpu> = sqlx::query_as(
        "SELECT id, uuid, model, memory_mib, mode, layout FROM devices \
          WHERE node_id = $1 AND retired_at IS NULL ORDER BY id",
    )
    .bind(id.as_str())
    .fetch_all(&mut *conn)
    .await?;
    let scalars: Vec<(String, i64)> =
        sqlx::query_as("SELECT resource, allocatable FROM node_resources WHERE node_id = $1")
            .bind(id.as_str())
            .fetch_all(&mut *conn)
            .await?;
    Ok((gpus, scalars.into_iter().collect()))
}

/// Writes what the check found: each GPU's `inventory_mismatch` where it changed (in id
/// order), the node's condition, and `node.inventory_mismatch` / `node.inventory_matched` when
/// the differences changed. `node` is locked `FOR UPDATE` by the caller.
async fn apply(
    conn: &mut PgConnection,
    node: &NodeId,
    gpus: &[RegisteredGpu],
    d: &Differences,
) -> Result<()> {
    let ids: Vec<&str> = gpus.iter().map(|g| g.id.as_str()).collect();
    let mismatch: Vec<Option<String>> = gpus.iter().map(|g| d.of(&g.id)).collect();
    let changed: Vec<Device> = query_devices!(
        "UPDATE devices AS d SET inventory_mismatch = x.m, version = d.version + 1, updated_at = compute_now() \
           FROM unnest($1::text[], $2::text[]) AS x(id, m) \
          WHERE d.id = x.id AND d.inventory_mismatch IS DISTINCT FROM x.m RETURNING",
        "",
        &ids[..] as &[&str],
        &mismatch[..] as &[Option<String>],
    )
    .fetch_all(&mut *conn)
    .await?;
    let all = d.all();
    let message = (!all.is_empty()).then(|| crate::error::bounded(&all.join("; ")));
    // The condition changes only when its message does, so a report that says the same again
    // writes no event.
    let updated: Option<Node> = query_nodes!(
        "UPDATE nodes AS n SET conditions = compute_conditions_without(n.conditions, $2) || CASE WHEN $3::text IS NULL THEN '[]'::jsonb \
              ELSE jsonb_build_array(jsonb_build_object('type', $2, 'status', 'True', 'reason', 'ReportDiffers', \
                                                         'message', $3::text, 'since', compute_now())) END, \
                version = n.version + 1, updated_at = compute_now() \
          WHERE n.id = $1 AND (SELECT c->>'message' FROM jsonb_array_elements(n.conditions) c WHERE c->>'type' = $2 LIMIT 1) \
                IS DISTINCT FROM $3::text \
          RETURNING",
        "",
        node.as_str(),
        INVENTORY_MISMATCH,
        message,
    )
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(n) = updated {
        let event = if message.is_some() {
            EventType::NodeInventoryMismatch
        } else {
            EventType::NodeInventoryMatched
        };
        let payload = NodePayload {
            devices: (!changed.is_empty()).then(|| changed.iter().map(DeviceView::from).collect()),
            differences: Some(all),
            ..NodePayload::of(&n)
        };
        emit(conn, event, &n.id, &payload).await?;
    }
    Ok(())
}

/// Compares node `node`'s last report (if any) with its registration again, after the
/// registration changed (`retire_device`); the node row is locked by the caller.
pub(super) async fn recheck(conn: &mut PgConnection, node: &NodeId) -> Result<()> {
    let stored: Option<Json<Inventory>> =
        sqlx::query_scalar("SELECT inventory FROM nodes WHERE id = $1")
            .bind(node.as_str())
            .fetch_one(&mut *conn)
            .await?;
    if let Some(Json(inventory)) = stored {
        let (gpus, scalars) = registration(conn, node).await?;
        let d = compare(&gpus, &scalars, &inventory);
        apply(conn, node, &gpus, &d).await?;
    }
    Ok(())
}

/// The longest string a reported inventory may carry (a hostname's 253, a model's 100 and a
/// UUID's 80 fit): a report is stored as it came, shown, and compared at each report.
pub const MAX_REPORTED_TEXT: usize = 256;

/// Bounds what a daemon's report may hold before it is stored: at most
/// [`MAX_GPUS_PER_NODE`](m::MAX_GPUS_PER_NODE) GPUs and as many MIG instances of each, strings of
/// at most [`MAX_REPORTED_TEXT`] characters. Within them, a report that cannot be a registration
/// (an empty model, a malformed UUID) is stored, and shows as a mismatch.
fn check_report_size(inventory: &Inventory) -> Result<()> {
    if inventory.gpus.len() > m::MAX_GPUS_PER_NODE {
        return Err(Error::bad_input(
            "inventory.gpus",
            format!("an inventory lists at most {} GPUs", m::MAX_GPUS_PER_NODE),
        ));
    }
    let long = |field: String, value: &str| {
        if value.chars().count() > MAX_REPORTED_TEXT {
            Err(Error::bad_input(
                &field,
                format!("`{field}` is longer than {MAX_REPORTED_TEXT} characters"),
            ))
        } else {
            Ok(())
        }
    };
    long("inventory.hostname".into(), &inventory.hostname)?;
    for (i, g) in inventory.gpus.iter().enumerate() {
        let f = |name: &str| format!("inventory.gpus[{i}].{name}");
        if g.mig.len() > m::MAX_GPUS_PER_NODE {
            return Err(Error::bad_input(
                f("mig"),
                format!("a GPU lists at most {} MIG instances", m::MAX_GPUS_PER_NODE),
            ));
        }
        long(f("uuid"), &g.uuid)?;
        long(f("vendor"), &g.vendor)?;
        long(f("model"), &g.model)?;
        long(f("pciBusId"), g.pci_bus_id.as_deref().unwrap_or_default())?;
        long(
            f("nvlinkDomain"),
            g.nvlink_domain.as_deref().unwrap_or_default(),
        )?;
        for (k, x) in g.mig.iter().enumerate() {
            long(f(&format!("mig[{k}].uuid")), &x.uuid)?;
            long(f(&format!("mig[{k}].profile")), &x.profile)?;
        }
    }
    Ok(())
}

/// Records node `node`'s inventory, reported in session `epoch`, and compares it with the
/// registration; the differences (empty when it agrees), or `None` when the session is no
/// longer current (nothing written).
#[tracing::instrument(level = "debug", skip_all, fields(node = %node))]
pub async fn report_inventory(
    db: &Db,
    node: &NodeId,
    epoch: i64,
    inventory: &Inventory,
) -> Result<Option<Vec<String>>> {
    check_report_size(inventory)?;
    let stored = serde_json::to_value(inventory).map_err(Error::internal)?;
    // PostgreSQL's `jsonb` and `text` hold no NUL character: refused here, with the session
    // kept, where the write failed as an INTERNAL error and closed the session.
    if crate::node_commands::holds_nul(&stored) {
        return Err(Error::bad_input(
            "inventory",
            "the inventory holds a NUL character (\\u0000), which no name, model or label may hold",
        ));
    }
    db.tx("report_inventory", TxKind::Write, |conn| {
        let (node, stored, inventory) = (node.clone(), stored.clone(), inventory.clone());
        Box::pin(async move {
            // The session guard, then the node's row (lock order: node_sessions, nodes,
            // devices): reports and acceptances of one node take turns.
            let locked: Option<i32> = sqlx::query_scalar(
                "SELECT 1 FROM nodes n WHERE n.id = $1 AND EXISTS (SELECT 1 FROM node_sessions s \
                  WHERE s.node_id = $1 AND s.session_epoch = $2 AND s.closed_at IS NULL FOR SHARE) FOR UPDATE OF n",
            )
            .bind(node.as_str())
            .bind(epoch)
            .fetch_optional(&mut *conn)
            .await?;
            if locked.is_none() {
                return Ok(None);
            }
            // Another inventory than the last makes the node newer: an operator's
            // `acceptNodeInventory(version:)` read before it is `CONFLICT`, so nobody accepts
            // figures they never saw. The same report again changes no version.
            sqlx::query(
                "UPDATE nodes SET inventory = $2, inventory_at = compute_now(), \
                        version = version + CASE WHEN inventory IS DISTINCT FROM $2 THEN 1 ELSE 0 END, \
                        updated_at = CASE WHEN inventory IS DISTINCT FROM $2 THEN compute_now() ELSE updated_at END \
                  WHERE id = $1",
            )
                .bind(node.as_str())
                .bind(&stored)
                .execute(&mut *conn)
                .await?;
            record_topology(conn, &node, &inventory).await?;
            let (gpus, scalars) = registration(conn, &node).await?;
            let d = compare(&gpus, &scalars, &inventory);
            apply(conn, &node, &gpus, &d).await?;
            Ok(Some(d.all()))
        })
    })
    .await
}

/// The topology a report gives its GPUs (PCI bus id, NUMA node, NVLink domain), written on the
/// registered GPUs of the node with those UUIDs: where a GPU sits is a fact of the machine that
/// the operator cannot know better, unlike what it is (its model, memory and layout, which a
/// report never rewrites). A part the report leaves out keeps what was registered; an unusable
/// value (a NUMA node out of range) is left out with a warning rather than refusing the report.
async fn record_topology(
    conn: &mut PgConnection,
    node: &NodeId,
    inventory: &Inventory,
) -> Result<()> {
    let mut uuids = Vec::new();
    let mut buses = Vec::new();
    let mut numas = Vec::new();
    let mut domains = Vec::new();
    for (i, g) in inventory.gpus.iter().enumerate() {
        // Each part on its own: a bad one is left out, the others kept.
        fn kept<T>(node: &NodeId, gpu: usize, part: Result<T>) -> Option<T> {
            part.map_err(|e| tracing::warn!(node = %node, gpu, error = %e, "a reported topology value is left out"))
                .ok()
        }
        let bus = (g.pci_bus_id.as_deref())
            .and_then(|b| kept(node, i, m::parse_pci_bus_id("pciBusId", b)));
        let numa = g
            .numa_node
            .and_then(|n| kept(node, i, m::parse_numa_node("numaNode", i64::from(n))));
        let domain = (g.nvlink_domain.as_deref())
            .and_then(|d| kept(node, i, m::parse_nvlink_domain("nvlinkDomain", d)));
        if bus.is_none() && numa.is_none() && domain.is_none() {
            continue;
        }
        uuids.push(g.uuid.clone());
        buses.push(bus);
        numas.push(numa);
        domains.push(domain);
    }
    if uuids.is_empty() {
        return Ok(());
    }
    // The node's row is locked (lock order: nodes, then devices); only rows that change.
    sqlx::query(
        "UPDATE devices d SET pci_bus_id = coalesce(t.pci, d.pci_bus_id), numa_node = coalesce(t.numa, d.numa_node),
                nvlink_domain = coalesce(t.nvl, d.nvlink_domain), version = d.version + 1, updated_at = compute_now()
           FROM unnest($2::text[], $3::text[], $4::int[], $5::text[]) AS t(uuid, pci, numa, nvl)
          WHERE d.node_id = $1 AND d.uuid = t.uuid
            AND (d.pci_bus_id, d.numa_node, d.nvlink_domain) IS DISTINCT FROM
                (coalesce(t.pci, d.pci_bus_id), coalesce(t.numa, d.numa_node), coalesce(t.nvl, d.nvlink_domain))",
    )
    .bind(node.as_str())
    .bind(&uuids)
    .bind(&buses)
    .bind(&numas)
    .bind(&domains)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Makes node `id`'s registration what it last reported: its vCPU, memory and disk, its GPUs'
/// models and memory, and the GPUs it has that are not registered (with their atoms). A
/// difference that acceptance cannot settle is `CONFLICT` naming it, with nothing written: a GPU
/// missing from the machine (it may hold bookings: reinstall it, or drain and retire the node),
/// another MIG layout (`changeDeviceMode`), resources below what is allocated.
#[tracing::instrument(level = "debug", skip_all, fields(node = %id))]
pub async fn accept_node_inventory(db: &Db, id: &NodeId, version: Option<i64>) -> Result<Node> {
    db.tx("accept_node_inventory", TxKind::Write, |conn| {
        let id = id.clone();
        Box::pin(async move {
            // Lock order: the pool FOR NO KEY UPDATE (new GPUs join its rollup), the node, its devices,
            // its resources, the rollup, the pool's rollup check.
            lock_pool_of_node(conn, &id).await?;
            let row: Option<(i64, Option<Json<Inventory>>, Option<String>)> = sqlx::query_as(
                "SELECT version, inventory, retired_at::text FROM nodes WHERE id = $1 FOR UPDATE",
            )
            .bind(id.as_str())
            .fetch_optional(&mut *conn)
            .await?;
            let Some((current, inventory, retired)) = row else {
                return Err(Error::NotFound { kind: "compute node", id: id.to_string() });
            };
            if let Some(v) = version
                && v != current
            {
                return Err(Error::StaleVersion { kind: "compute node", id: id.to_string(), expected: v, current });
            }
            if retired.is_some() {
                return Err(conflict(format!("compute node {id} is retired"), Some(current)));
            }
            let Some(Json(inventory)) = inventory else {
                return Err(conflict(
                    format!("compute node {id} has not reported an inventory yet: its daemon reports one on connecting"),
                    Some(current),
                ));
            };
            // The node's devices, in id order, before its resources (rule 3): the mismatch
            // written below updates them, and a health change holding one while it waits for a
            // reservation whose release waits for these resources closed a cycle when they came
            // after.
            sqlx::query("SELECT 1 FROM devices WHERE node_id = $1 AND retired_at IS NULL ORDER BY id FOR UPDATE")
                .bind(id.as_str())
                .execute(&mut *conn)
                .await?;
            let (gpus, _) = registration(conn, &id).await?;
            let reported: BTreeMap<&str, &compute_protocol::GpuInventory> =
                inventory.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
            // What acceptance cannot settle.
            let mut unsettled = Vec::new();
            for r in &gpus {
                let Some(g) = reported.get(r.uuid.as_str()) else {
                    unsettled.push(format!("GPU {} is missing from the machine: reinstall it, or retire the device (retireDevice) once nothing is booked on it", r.uuid));
                    continue;
                };
                // What the daemon reported, checked before it is written (a model of 1 to 100
                // printable characters, some memory), as a registration checks it.
                if g.memory_mib < 1 || m::parse_name("model", &g.model).is_err() || g.model.chars().count() > 100 {
                    unsettled.push(format!(
                        "GPU {}: the machine reports the model `{}` with {} MiB of memory, which a device cannot hold (a model of 1 to 100 printable characters, some memory): fix the daemon's inventory",
                        r.uuid,
                        g.model.chars().take(64).filter(|c| !c.is_control()).collect::<String>(),
                        g.memory_mib
                    ));
                    continue;
                }
                let only = [r.clone()];
                let one = compare(&only, &BTreeMap::new(), &Inventory { gpus: vec![(*g).clone()], ..Inventory::default() });
                if one.gpus.values().flatten().any(|m| m.contains("MIG")) {
                    unsettled.push(format!("GPU {}: another MIG layout: change the device's mode with changeDeviceMode", r.uuid));
                }
            }
            if !unsettled.is_empty() {
                return Err(conflict(unsettled.join("; "), Some(current)));
            }
            // The GPUs not registered yet, with their atoms, in the pool's rollup.
            let known: BTreeSet<&str> = gpus.iter().map(|r| r.uuid.as_str()).collect();
            let pool: PoolId = sqlx::query_scalar("SELECT pool_id FROM nodes WHERE id = $1")
                .bind(id.as_str())
                .fetch_one(&mut *conn)
                .await?;
            let fresh = crate::fleet::enrollment::new_node(pool, Labels::new(), &Inventory {
                gpus: inventory.gpus.iter().filter(|g| !known.contains(g.uuid.as_str())).cloned().collect(),
                ..inventory.clone()
            })?;
            // The node's counters before the rollup and work-queue rows the new devices touch
            // (docs/database-locks.md), in key order, as placements and releases take them.
            sqlx::query("SELECT 1 FROM node_resources WHERE node_id = $1 ORDER BY resource FOR UPDATE")
                .bind(id.as_str())
                .execute(&mut *conn)
                .await?;
            // The GPUs' models and memory. The rollup counts atoms per model: a GPU whose model
            // changes leaves its old model's counts and joins its new one's (they stayed under
            // the old model, and a later retirement took them from the new one's, or failed on
            // its `CHECK` when that row had fewer).
            let mut touched: Vec<DeviceId> = Vec::new();
            for r in &gpus {
                let g = reported[r.uuid.as_str()];
                if g.model != r.model || g.memory_mib != r.memory_mib {
                    let renamed = g.model != r.model;
                    let one = [r.id.clone()];
                    if renamed {
                        adjust_rollup(conn, &one, Change::Remove).await?;
                    }
                    sqlx::query("UPDATE devices SET model = $2, memory_mib = $3, version = version + 1, updated_at = compute_now() WHERE id = $1")
                        .bind(r.id.as_str())
                        .bind(&g.model)
                        .bind(g.memory_mib)
                        .execute(&mut *conn)
                        .await?;
                    if renamed {
                        adjust_rollup(conn, &one, Change::Add).await?;
                        touched.push(r.id.clone());
                    }
                }
            }
            if !fresh.devices.is_empty() {
                let added = insert_devices(conn, &id, &fresh.devices).await?;
                let ids: Vec<DeviceId> = added.iter().map(|d| d.id.clone()).collect();
                adjust_rollup(conn, &ids, Change::Add).await?;
                touched.extend(ids);
            }
            if !touched.is_empty() {
                wake_rollup_check(conn, &touched).await?;
            }
            // The scalars: the CHECK refuses less than is allocated.
            sqlx::query(
                "UPDATE node_resources r SET allocatable = x.a FROM unnest(ARRAY['vcpu', 'memory_mib', 'disk_gib'], $2::bigint[]) AS x(res, a) \
                  WHERE r.node_id = $1 AND r.resource = x.res AND r.allocatable <> x.a",
            )
            .bind(id.as_str())
            .bind(vec![inventory.vcpu, inventory.memory_mib, inventory.disk_gib])
            .execute(&mut *conn)
            .await
            .map_err(|e| on_constraint(e, &[("node_resources_within_limit", &|| conflict(
                format!("compute node {id} has more allocated than the machine reports: release or wait for those reservations first"),
                Some(current),
            ))]))?;
            let (gpus, scalars) = registration(conn, &id).await?;
            let d = compare(&gpus, &scalars, &inventory);
            apply(conn, &id, &gpus, &d).await?;
            let node = update_node_row(conn, &id, None, NodeAction::Update, "", "", vec![]).await?;
            let devices = gpus_of(conn, &id).await?;
            emit(conn, EventType::NodeUpdated, &node.id, &NodePayload {
                devices: Some(devices.iter().map(DeviceView::from).collect()),
                ..NodePayload::of(&node)
            })
            .await?;
            Ok(node)
        })
    })
    .await
}

async fn gpus_of(conn: &mut PgConnection, id: &NodeId) -> Result<Vec<Device>> {
    Ok(query_devices!(
        "SELECT",
        "FROM devices d WHERE d.node_id = $1 ORDER BY d.id",
        id.as_str()
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// Records GPU `uuid`'s health as node `node` reports it in session `epoch`: `Some(true)` when
/// the GPU is this node's (its health set, with the event, when it changed), `Some(false)` when
/// it is not, `None` when the session is no longer current. A passing report clears only the
/// health a report set: an operator's `setDeviceHealth` stays until an operator changes it. A
/// retired GPU's health is not recorded (it is out of service; its row stays for its history).
#[tracing::instrument(level = "debug", skip_all, fields(node = %node, uuid))]
pub async fn report_health(
    db: &Db,
    node: &NodeId,
    epoch: i64,
    uuid: &str,
    health: GpuHealth,
    reason: Option<&str>,
) -> Result<Option<bool>> {
    // Checked where it enters: a daemon's `uuid` is bound into the statements below, and one
    // PostgreSQL's text cannot hold (a NUL) would be an error of ours, not the daemon's.
    let uuid = m::GpuUuid::parse("uuid", uuid)?;
    let (health, reason) = match health {
        GpuHealth::Healthy => (Health::Healthy, None),
        GpuHealth::Unhealthy => (
            Health::Unhealthy,
            Some(crate::error::bounded(
                reason.unwrap_or("reported unhealthy by its node"),
            )),
        ),
    };
    db.tx("report_health", TxKind::Write, |conn| {
        let (node, uuid, reason) = (node.clone(), uuid.as_str().to_owned(), reason.clone());
        Box::pin(async move {
            let current: Option<i32> = sqlx::query_scalar(
                "SELECT 1 FROM node_sessions WHERE node_id = $1 AND session_epoch = $2 AND closed_at IS NULL FOR SHARE",
            )
            .bind(node.as_str())
            .bind(epoch)
            .fetch_optional(&mut *conn)
            .await?;
            if current.is_none() {
                return Ok(None);
            }
            // An operator's UNHEALTHY or DEGRADED mark is the operator's to lift: no report of the
            // node rewrites it (a report of a new reason once took the mark over, and the next
            // passing report cleared it). A GPU the operator called healthy is the node's again
            // when it fails.
            let changed: Option<Device> = query_devices!(
                "UPDATE devices AS d SET health = $3, health_reason = $4, health_by = 'node', \
                        health_since = compute_now(), version = d.version + 1, updated_at = compute_now() \
                  WHERE d.node_id = $1 AND d.uuid = $2 AND (d.health, d.health_reason) IS DISTINCT FROM ($3, $4) \
                    AND (d.health_by IS DISTINCT FROM 'operator' OR (d.health = 'healthy' AND $3 = 'unhealthy')) \
                    AND d.retired_at IS NULL \
                  RETURNING",
                "",
                node.as_str(),
                uuid,
                health.as_str(),
                reason,
            )
            .fetch_optional(&mut *conn)
            .await?;
            if let Some(device) = changed {
                emit(conn, EventType::DeviceHealthChanged, &device.id, &DevicePayload { device: (&device).into() }).await?;
                tell_holders(conn, &device.id).await?;
                return Ok(Some(true));
            }
            let ours: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM devices WHERE node_id = $1 AND uuid = $2)")
                .bind(node.as_str())
                .bind(&uuid)
                .fetch_one(&mut *conn)
                .await?;
            Ok(Some(ours))
        })
    })
    .await
}

/// The condition a reservation holding an unhealthy GPU shows its tenant.
pub const DEVICE_UNHEALTHY: &str = "DeviceUnhealthy";

/// After GPU `device`'s health changed (in this transaction, after its row): the reservations
/// booked on it now or later get the condition `DeviceUnhealthy` naming every unhealthy GPU they
/// hold, or lose it when none is. They keep their bookings: the tenant sees, the operator acts.
/// A reservation whose conditions this changes (other than the condition's `since`) gets a new
/// `version` and a `reservation.conditions_changed` event, in id order after the rows.
pub(super) async fn tell_holders(conn: &mut PgConnection, device: &DeviceId) -> Result<()> {
    let mut changed: Vec<String> = sqlx::query_scalar(
        "WITH affected AS (
              SELECT r.id, r.conditions FROM reservations r WHERE r.state IN ('active', 'scheduled') AND r.id IN (
                SELECT a.reservation_id FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id
                 WHERE b.device_id = $1 AND upper(b.during) > compute_now())
               ORDER BY r.id FOR UPDATE),
          sick AS (
              SELECT af.id, string_agg(DISTINCT d.uuid || ': ' || coalesce(d.health_reason, 'unhealthy'), '; ') AS message
                FROM affected af JOIN allocations a ON a.reservation_id = af.id
                JOIN device_bookings b ON b.allocation_id = a.id AND upper(b.during) > compute_now()
                JOIN devices d ON d.id = b.device_id AND d.health = 'unhealthy'
               GROUP BY af.id),
          next AS (
              SELECT af.id, af.conditions AS old, compute_conditions_without(af.conditions, $2) ||
                     CASE WHEN s.message IS NULL THEN '[]'::jsonb ELSE jsonb_build_array(jsonb_build_object(
                         'type', $2, 'status', 'True', 'reason', 'GpuUnhealthy',
                         'message', 'a GPU this reservation holds is unhealthy (it keeps it; the operator is told): ' || s.message,
                         'since', compute_now())) END AS conditions
                FROM affected af LEFT JOIN sick s ON s.id = af.id)
          UPDATE reservations r SET conditions = n.conditions, version = r.version + 1, updated_at = compute_now()
            FROM next n
           WHERE r.id = n.id AND r.state IN ('active', 'scheduled')
             AND (SELECT jsonb_agg(c - 'since' ORDER BY (c - 'since')::text) FROM jsonb_array_elements(n.conditions) c)
                 IS DISTINCT FROM
                 (SELECT jsonb_agg(c - 'since' ORDER BY (c - 'since')::text) FROM jsonb_array_elements(n.old) c)
          RETURNING r.id",
    )
    .bind(device.as_str())
    .bind(DEVICE_UNHEALTHY)
    .fetch_all(&mut *conn)
    .await?;
    changed.sort();
    // Each one's event and work-queue row (`compute_reservation_changed`, as every reservation
    // change writes them), in id order.
    for id in changed {
        sqlx::query("SELECT compute_reservation_changed($1, $2, $3)")
            .bind(&id)
            .bind(crate::events::EventType::ReservationConditionsChanged.as_str())
            .bind(crate::work_queue::SHARDS)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use compute_protocol::{GpuInventory, MigInstance};

    fn gpu(uuid: &str, mig: &[&str]) -> GpuInventory {
        GpuInventory {
            uuid: uuid.into(),
            vendor: "nvidia".into(),
            model: "H100".into(),
            memory_mib: 81_559,
            pci_bus_id: None,
            numa_node: None,
            nvlink_domain: None,
            mig_enabled: !mig.is_empty(),
            mig: mig
                .iter()
                .enumerate()
                .map(|(i, p)| MigInstance {
                    uuid: format!("MIG-{uuid}-{i}"),
                    profile: (*p).into(),
                })
                .collect(),
        }
    }

    fn registered(uuid: &str, mig: &[&str]) -> RegisteredGpu {
        RegisteredGpu {
            id: DeviceId::generate(),
            uuid: uuid.into(),
            model: "H100".into(),
            memory_mib: 81_559,
            mode: if mig.is_empty() {
                DeviceMode::Exclusive
            } else {
                DeviceMode::Mig
            },
            layout: (!mig.is_empty()).then(|| {
                Json(super::super::super::model::StoredLayout {
                    profiles: Some(mig.iter().map(|p| (*p).to_owned()).collect()),
                    slots: None,
                })
            }),
        }
    }

    #[test]
    fn a_report_that_agrees_has_no_difference_and_each_kind_is_named() {
        let regs = vec![
            registered("GPU-a", &[]),
            registered("GPU-b", &["3g.40gb", "4g.40gb"]),
        ];
        let scalars: BTreeMap<String, i64> = [
            ("vcpu".into(), 64),
            ("memory_mib".into(), 1024),
            ("disk_gib".into(), 10),
        ]
        .into();
        let mut inv = Inventory {
            hostname: "h".into(),
            vcpu: 64,
            memory_mib: 2048,
            disk_gib: 10,
            gpus: vec![gpu("GPU-a", &[]), gpu("GPU-b", &["3g.40gb", "4g.40gb"])],
        };
        assert_eq!(compare(&regs, &scalars, &inv), Differences::default());

        inv.vcpu = 32;
        inv.gpus[0].uuid = "GPU-c".into();
        inv.gpus[1].mig.pop();
        let d = compare(&regs, &scalars, &inv);
        assert_eq!(d.shortfalls, vec!["the machine has 32 vCPU, 64 registered"]);
        assert_eq!(
            d.gpus[&regs[0].id],
            vec!["GPU GPU-a (H100) is missing from the machine"]
        );
        assert_eq!(
            d.gpus[&regs[1].id],
            vec![
                "GPU GPU-b: the machine's MIG instances are 3g.40gb, registered 3g.40gb, 4g.40gb (in this order)"
            ]
        );
        assert_eq!(d.unregistered.len(), 1);
        assert!(d.unregistered[0].contains("GPU-c"), "{:?}", d.unregistered);
        // A shortfall concerns every GPU.
        assert!(
            d.of(&regs[1].id)
                .is_some_and(|m| m.starts_with("the machine has 32 vCPU"))
        );
    }
}
