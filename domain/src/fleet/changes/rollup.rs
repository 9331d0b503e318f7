//! The pool capacity rollup: the pool row lock that orders changes of a pool's atoms against a
//! recompute, the deltas every such change applies, and the recompute itself.

use super::*;

/// Takes the row of the pool of node `node_id` `FOR NO KEY UPDATE`, as the first lock of a
/// transaction that changes that pool's atoms (lock order: pools before nodes and devices): the
/// changes of one pool's atoms, and so of its rollup rows, run one at a time, and so does
/// [`recompute_rollup`], which takes it the same way and so counts the atoms only once no change
/// is in flight. (They shared it `FOR SHARE` before, the rollup deltas commuting; but two mode
/// changes in opposite directions then locked rollup rows in opposite orders, and a change
/// whose second delta met a row inserted meanwhile could wait on a third: deadlocks, which the
/// torture test counted.) Reservations take the pool only `FOR KEY SHARE` (the foreign key),
/// which this does not block.
pub(super) async fn lock_pool_of_node(conn: &mut PgConnection, node_id: &NodeId) -> Result<()> {
    sqlx::query!(
        "SELECT 1 AS locked FROM pools p WHERE p.id = (SELECT n.pool_id FROM nodes n WHERE n.id = $1) FOR NO KEY UPDATE",
        node_id.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(())
}

/// [`lock_pool_of_node`] for the node of device `device_id`.
pub(super) async fn lock_pool_of_device(
    conn: &mut PgConnection,
    device_id: &DeviceId,
) -> Result<()> {
    sqlx::query!(
        "SELECT 1 AS locked FROM pools p WHERE p.id = \
           (SELECT n.pool_id FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.id = $1) FOR NO KEY UPDATE",
        device_id.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(())
}

/// Adds (`Change::Add`) or removes (`Change::Remove`) the atoms of the given devices to or from
/// the rollup of their pools, per (model, kind, profile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    Add,
    Remove,
}

/// Applies the change to the rollup rows of the devices' pools, in a transaction that holds
/// their pool's row ([`lock_pool_of_node`], [`lock_pool_of_device`], or registration's own), so
/// no other change of the pool's rollup is in flight. The work-queue row comes after all of it:
/// the caller calls [`wake_rollup_check`] once, last.
pub(super) async fn adjust_rollup(
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
    Ok(())
}

/// Enqueues the pools of the devices for the rollup reconciler's check, in the transaction that
/// changed their rollup, after every [`adjust_rollup`] of it: the work-queue rows come last in
/// the lock order (a mode change that enqueued between its removal and its addition held the
/// queue row while waiting for a rollup row another mode change held while waiting for that
/// queue row: a deadlock).
pub(super) async fn wake_rollup_check(
    conn: &mut PgConnection,
    device_ids: &[DeviceId],
) -> Result<()> {
    let ids: Vec<&str> = device_ids.iter().map(DeviceId::as_str).collect();
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
/// transaction that changes the pool's atoms (they hold it too, [`lock_pool_of_node`]) and
/// keeps new ones out, so the count, read by the next statement's snapshot, and the rollup rows
/// it overwrites are of the same moment. (Without it, a count read before a concurrent
/// registration committed would overwrite that registration's increment: a lost update.)
/// Reservations only take the pool `FOR KEY SHARE` and are not held up.
#[tracing::instrument(level = "debug", skip_all, fields(pool = %pool_id))]
pub async fn recompute_rollup(db: &Db, pool_id: &PoolId) -> Result<u64> {
    db.tx("recompute_rollup", TxKind::Maintenance, |conn| {
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
