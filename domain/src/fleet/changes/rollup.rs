//! The pool capacity rollup: the pool row lock that orders changes of a pool's atoms against a
//! recompute, the deltas every such change applies, and the recompute itself.

use super::*;

/// Takes the row of the pool of node `node_id` `FOR SHARE`, as the first lock of a transaction
/// that changes that pool's atoms (lock order: pools before nodes and devices). The deltas of
/// [`adjust_rollup`] commute, so such transactions share it; [`recompute_rollup`] takes it
/// `FOR NO KEY UPDATE`, so it counts the atoms only once no transaction that changes them is in
/// flight, and none starts until it commits.
pub(super) async fn share_pool_of_node(conn: &mut PgConnection, node_id: &NodeId) -> Result<()> {
    sqlx::query!(
        "SELECT 1 AS locked FROM pools p WHERE p.id = (SELECT n.pool_id FROM nodes n WHERE n.id = $1) FOR SHARE",
        node_id.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(())
}

/// [`share_pool_of_node`] for the node of device `device_id`.
pub(super) async fn share_pool_of_device(
    conn: &mut PgConnection,
    device_id: &DeviceId,
) -> Result<()> {
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
pub(super) enum Change {
    Add,
    Remove,
}

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
