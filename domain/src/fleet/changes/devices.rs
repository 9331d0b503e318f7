//! GPUs: the atom rule's atoms, health, quarantine and mode changes.

use super::*;
use crate::fleet::model::Reason;

/// Inserts atoms for devices, in one statement.
pub(super) async fn insert_atoms(
    conn: &mut PgConnection,
    atoms: &[(DeviceId, AtomSpec)],
) -> Result<()> {
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

/// A guarded update of one device that is in service: a retired GPU, or one of a retired node,
/// accepts no change (`CONFLICT`).
async fn update_device_row(
    conn: &mut PgConnection,
    id: &DeviceId,
    version: Option<i64>,
    set: &str,
    binds: Vec<Value>,
) -> Result<Device> {
    let sql = format!(
        "UPDATE devices AS d SET {set}, version = d.version + 1, updated_at = compute_now() \
         WHERE d.id = $1 AND ($2::bigint IS NULL OR d.version = $2) AND d.retired_at IS NULL \
           AND NOT EXISTS (SELECT 1 FROM nodes n WHERE n.id = d.node_id AND n.lifecycle = 'retired') \
         RETURNING {DEVICE_COLS}"
    );
    let mut q = sqlx::query_as::<_, Device>(&sql).bind(id).bind(version);
    for b in binds {
        q = q.bind(b);
    }
    match q.fetch_optional(&mut *conn).await? {
        Some(d) => Ok(d),
        None => Err(out_of_service(conn, id)
            .await?
            .unwrap_or(explain_miss(conn, "devices", "device", id.as_str(), version).await)),
    }
}

/// Why a device accepts no change, if it is out of service: retired itself, or on a retired
/// node.
async fn out_of_service(conn: &mut PgConnection, id: &DeviceId) -> Result<Option<Error>> {
    let row: Option<(i64, bool, NodeId, bool)> = sqlx::query_as(
        "SELECT d.version, d.retired_at IS NOT NULL, n.id, n.lifecycle = 'retired' \
           FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.id = $1",
    )
    .bind(id.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    Ok(match row {
        Some((current, true, _, _)) => {
            Some(conflict(format!("device {id} is retired"), Some(current)))
        }
        Some((current, false, node, true)) => Some(conflict(
            format!("device {id} is on retired compute node {node}"),
            Some(current),
        )),
        _ => None,
    })
}

/// Sets a GPU's health.
#[tracing::instrument(level = "debug", skip_all, fields(device = %id))]
pub async fn set_device_health(
    db: &Db,
    id: &DeviceId,
    version: Option<i64>,
    health: crate::fleet::model::Health,
    reason: Option<Reason>,
) -> Result<Device> {
    let reason = reason.map(|r| r.as_str().to_owned());
    db.tx("set_device_health", TxKind::Write, |conn| {
        let (id, reason) = (id.clone(), reason.clone());
        Box::pin(async move {
            let device = update_device_row(
                conn,
                &id,
                version,
                "health = $3 #>> '{}', health_reason = $4 #>> '{}', \
                 health_by = 'operator', \
                 health_since = CASE WHEN d.health = $3 #>> '{}' THEN d.health_since ELSE compute_now() END",
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
            super::inventory::tell_holders(conn, &device.id).await?;
            Ok(device)
        })
    })
    .await
}

/// Quarantines a GPU: placement skips it until it is released.
#[tracing::instrument(level = "debug", skip_all, fields(device = %id))]
pub async fn quarantine_device(
    db: &Db,
    id: &DeviceId,
    version: Option<i64>,
    reason: Reason,
) -> Result<Device> {
    quarantine_row(
        db,
        "quarantine_device",
        id,
        version,
        Some(reason.as_str().to_owned()),
    )
    .await
}

/// Releases a GPU from quarantine.
#[tracing::instrument(level = "debug", skip_all, fields(device = %id))]
pub async fn release_quarantine(db: &Db, id: &DeviceId, version: Option<i64>) -> Result<Device> {
    quarantine_row(db, "release_quarantine", id, version, None).await
}

async fn quarantine_row(
    db: &Db,
    name: &'static str,
    id: &DeviceId,
    version: Option<i64>,
    reason: Option<String>,
) -> Result<Device> {
    db.tx(name, TxKind::Write, |conn| {
        let (id, reason) = (id.clone(), reason.clone());
        Box::pin(async move {
            let quarantined = reason.is_some();
            let device = update_device_row(
                conn,
                &id,
                version,
                "operator_quarantined = ($3::jsonb)::text::boolean, quarantine_reason = $4 #>> '{}'",
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

/// Takes a GPU out of its node's registration for good: refused (`CONFLICT`, naming what holds
/// it) while a booking on it ends after now. Its atoms leave the pool's capacity and are
/// deleted, so placement can never find it; the row stays (with `retired_at`) for the bookings
/// and usage that name it. The node's inventory check is made again without it.
#[tracing::instrument(level = "debug", skip_all, fields(device = %id))]
pub async fn retire_device(db: &Db, id: &DeviceId, version: Option<i64>) -> Result<Device> {
    db.tx("retire_device", TxKind::Write, |conn| {
        let id = id.clone();
        Box::pin(async move {
            // Lock order: the pool FOR NO KEY UPDATE (the rollup), the node (its check), the device
            // FOR UPDATE in a statement of its own, so the bookings read next include those
            // of every placement that held it FOR SHARE.
            lock_pool_of_device(conn, &id).await?;
            let row: Option<(NodeId, i64, bool, bool)> = sqlx::query_as(
                "SELECT n.id, d.version, d.retired_at IS NOT NULL, n.lifecycle = 'retired' FROM devices d JOIN nodes n ON n.id = d.node_id \
                  WHERE d.id = $1 FOR UPDATE OF n, d",
            )
            .bind(id.as_str())
            .fetch_optional(&mut *conn)
            .await?;
            let Some((node, current, retired, node_retired)) = row else {
                return Err(Error::NotFound { kind: "device", id: id.to_string() });
            };
            // A retired node's GPUs left the pool's capacity with it: counting them out again
            // broke the rollup (`INTERNAL` on its check, or a capacity short by them).
            if node_retired {
                return Err(conflict(format!("device {id} is on retired compute node {node}"), Some(current)));
            }
            if let Some(v) = version
                && v != current
            {
                return Err(Error::StaleVersion { kind: "device", id: id.to_string(), expected: v, current });
            }
            if retired {
                return Err(conflict(format!("device {id} is retired already"), Some(current)));
            }
            let held: Vec<(Option<String>, String)> = sqlx::query_as(
                "SELECT allocation_id, string_agg(atom, ', ' ORDER BY atom) FROM device_bookings \
                  WHERE device_id = $1 AND upper(during) > compute_now() GROUP BY allocation_id ORDER BY allocation_id",
            )
            .bind(id.as_str())
            .fetch_all(&mut *conn)
            .await?;
            if !held.is_empty() {
                let list: Vec<String> = held
                    .iter()
                    .map(|(a, atoms)| format!("{} ({atoms})", a.as_deref().unwrap_or("mode change")))
                    .collect();
                return Err(conflict(
                    format!("device {id} still holds bookings: {}; release them or wait for them to end", list.join("; ")),
                    Some(current),
                ));
            }
            adjust_rollup(conn, std::slice::from_ref(&id), Change::Remove).await?;
            sqlx::query("DELETE FROM device_atoms WHERE device_id = $1")
                .bind(id.as_str())
                .execute(&mut *conn)
                .await?;
            let device = update_device_row(
                conn,
                &id,
                None,
                "retired_at = compute_now(), inventory_mismatch = NULL",
                vec![],
            )
            .await?;
            emit(conn, EventType::DeviceRetired, &device.id, &DevicePayload { device: (&device).into() }).await?;
            super::inventory::recheck(conn, &node).await?;
            // The work-queue row last (docs/database-locks.md, rule 3).
            wake_rollup_check(conn, std::slice::from_ref(&id)).await?;
            Ok(device)
        })
    })
    .await
}

/// The layout requested for a GPU, parsed once its memory is known.
#[derive(Debug, Clone)]
pub struct LayoutRequest {
    pub mode: crate::fleet::model::DeviceMode,
    pub mig_profiles: Option<Vec<String>>,
    pub slots: Option<i64>,
}

/// A booking that keeps a GPU from changing mode.
#[derive(Debug, sqlx::FromRow)]
struct Blocker {
    atom: AtomName,
    allocation_id: Option<AllocationId>,
    reason: crate::fleet::model::BookingReason,
    until: Option<chrono::DateTime<chrono::Utc>>,
}

/// The longest hold a mode change may place, in seconds.
pub const MAX_CHANGE_WINDOW_SECONDS: i64 = 86_400;

/// Changes a GPU's mode and layout. Books every atom of the GPU, the parent included, from now
/// on; commits only when nothing on the GPU is booked, and otherwise fails with `CONFLICT` naming
/// what blocks it. The new atoms (and the parent) are then held for `window_seconds`, while the
/// node applies the change.
#[tracing::instrument(level = "debug", skip_all, fields(device = %id))]
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
    db.tx("change_device_mode", TxKind::Write, |conn| {
        let (id, layout) = (id.clone(), layout.clone());
        Box::pin(async move {
            // 0. The pool's row FOR NO KEY UPDATE: the GPU's atoms change in its rollup.
            lock_pool_of_device(conn, &id).await?;
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
            // A retired GPU has no atoms and takes none: a layout would count it in capacity again.
            if device.retired_at.is_some() {
                return Err(conflict(format!("device {id} is retired"), Some(device.version)));
            }
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
                    r#"SELECT atom AS "atom: _", allocation_id AS "allocation_id: _", reason AS "reason: _", upper(during) AS until FROM device_bookings
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
            // Once, after both changes of the rollup (the work-queue row comes last).
            wake_rollup_check(conn, std::slice::from_ref(&id)).await?;
            emit(conn, EventType::DeviceModeChanged, &device.id, &DevicePayload { device: (&device).into() }).await?;
            Ok(device)
        })
    })
    .await
}
