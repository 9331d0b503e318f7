//! Placement: where a reservation's allocations go. Every allocation or none, each on one node,
//! tightest fit first; the candidate search reads the bookings that overlap the window, and an
//! attempt locks the node and atoms `FOR SHARE`, books the atoms (the exclusion constraint is the
//! backstop) and counts the scalars under guarded updates. A lost race rolls back to a savepoint
//! and replans without that node, at most [`MAX_ATTEMPTS`] times.

use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::PgConnection;
use sqlx::types::Json;

use super::model::AllocationRequest;
use crate::condition::{Condition, ConditionStatus};
use crate::error::{Error, Result};
use crate::ids::{AllocationId, AtomName, NodeId, PoolId};

/// How many placement attempts an allocation gets before the reservation goes pending.
pub const MAX_ATTEMPTS: usize = 3;

/// Where an allocation went.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    allocation_id: AllocationId,
    node_id: NodeId,
    atoms: Vec<AtomName>,
}

/// A node and atoms that fit an allocation now.
#[derive(Debug, sqlx::FromRow)]
struct Candidate {
    node_id: NodeId,
    atoms: Vec<AtomName>,
}

/// Picks `count` of a node's free atoms (ordered by GPU, then ordinal). MIG instances and slots
/// are taken from the front, filling partly used GPUs first so whole GPUs stay free; whole GPUs
/// start at an offset derived from the allocation, so concurrent placements on the same node
/// rarely reach for the same atoms.
fn choose_atoms(
    kind: crate::fleet::model::AtomKind,
    allocation_id: &AllocationId,
    free: Vec<AtomName>,
    count: usize,
) -> Vec<AtomName> {
    if kind != crate::fleet::model::AtomKind::Gpu || free.len() <= count {
        return free.into_iter().take(count).collect();
    }
    let spread = free.len() - count + 1;
    let hash = allocation_id
        .as_str()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
    let start = (hash % spread as u64) as usize;
    free.into_iter().skip(start).take(count).collect()
}

/// The tightest node that fits `a` over the window, skipping `excluded`: the one with the fewest
/// matching free atoms, so whole GPUs and whole nodes stay free; nodes whose `PreferNoSchedule`
/// taints are not tolerated come last. Equally tight nodes are ordered by a hash of the node and
/// the allocation, so concurrent placements spread over them instead of racing for one.
async fn candidate(
    conn: &mut PgConnection,
    allocation_id: &AllocationId,
    pool_id: &PoolId,
    a: &AllocationRequest,
    window: (DateTime<Utc>, DateTime<Utc>),
    excluded: &[NodeId],
) -> Result<Option<Candidate>> {
    // `busy` is one index scan (device_bookings_during) for the bookings that overlap the window;
    // the atoms are then filtered with a hashed lookup instead of a probe per atom. A node without
    // taints skips `compute_taints_tolerated`, which PostgreSQL cannot inline (it has a
    // sub-select) and would call once per node.
    let excluded: Vec<&str> = excluded.iter().map(NodeId::as_str).collect();
    Ok(sqlx::query_as!(
        Candidate,
        r#"WITH busy AS MATERIALIZED (SELECT b.atom FROM device_bookings b WHERE b.during && tstzrange($9, $10)),
         cand AS (
           SELECT n.id AS node_id, n.taints, array_agg(a.name ORDER BY d.id, a.ordinal) AS free_atoms
             FROM nodes n JOIN devices d ON d.node_id = n.id JOIN device_atoms a ON a.device_id = d.id
            WHERE n.pool_id = $1 AND NOT (n.id = ANY($2))
              AND compute_node_schedulable(n.lifecycle, n.reachability) AND n.labels @> $3
              AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, $4))
              AND compute_device_schedulable(d.health, d.quarantined)
              AND a.kind = $5 AND ($6::text IS NULL OR d.model = $6) AND ($7::text IS NULL OR a.profile = $7)
              AND ($8::int IS NULL OR (d.layout->>'slots')::int = $8)
              AND a.created_at <= $9 AND a.name NOT IN (SELECT atom FROM busy)
            GROUP BY n.id HAVING count(*) >= $11)
         SELECT c.node_id AS "node_id!: _", c.free_atoms AS "atoms!: _" FROM cand c
          WHERE NOT EXISTS (SELECT 1 FROM node_resources r
                  JOIN (VALUES ('vcpu', $12::bigint), ('memory_mib', $13::bigint), ('disk_gib', $14::bigint)) v(res, need) ON v.res = r.resource
                 WHERE r.node_id = c.node_id AND r.allocated + v.need > floor(r.allocatable * r.ratio))
          ORDER BY EXISTS (SELECT 1 FROM jsonb_array_elements(c.taints) t WHERE t->>'effect' = 'PreferNoSchedule'
                     AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements($4::jsonb) o WHERE o->>'key' = t->>'key')),
                   cardinality(c.free_atoms), md5(c.node_id || $15)
          LIMIT 1"#,
        pool_id.as_str(),
        &excluded as &[&str],
        Json(&a.node_selector) as _,
        Json(&a.tolerations) as _,
        a.gpu_kind.as_str(),
        a.model.as_deref(),
        a.profile.as_deref(),
        a.slots_per_gpu,
        window.0,
        window.1,
        i64::from(a.gpu_count),
        a.vcpu,
        a.memory_mib,
        a.disk_gib,
        allocation_id.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?)
}

/// What one placement attempt found.
enum Attempt {
    Placed,
    /// Another transaction got there first; replan without this node.
    Lost(&'static str),
}

/// Locks the node and atoms `FOR SHARE` (re-checking eligibility against their latest versions),
/// books the atoms and counts the scalars. Any shortfall is a lost race.
async fn attempt(
    conn: &mut PgConnection,
    a: &AllocationRequest,
    allocation_id: &AllocationId,
    c: &Candidate,
    window: (DateTime<Utc>, DateTime<Utc>),
) -> Result<Attempt> {
    let node = sqlx::query_scalar!(
        "SELECT 1 AS eligible FROM nodes n WHERE n.id = $1 AND compute_node_schedulable(n.lifecycle, n.reachability) \
            AND n.labels @> $2 AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, $3)) FOR SHARE",
        c.node_id.as_str(),
        Json(&a.node_selector) as _,
        Json(&a.tolerations) as _,
    )
    .fetch_optional(&mut *conn)
    .await?;
    if node.is_none() {
        return Ok(Attempt::Lost("the node changed"));
    }
    let names: Vec<&str> = c.atoms.iter().map(AtomName::as_str).collect();
    // An atom made after the window's start (by a mode change that committed while this
    // transaction ran) is not bookable from that start: a lost race.
    let atoms = sqlx::query_scalar!(
        "SELECT a.name FROM device_atoms a JOIN devices d ON d.id = a.device_id \
          WHERE a.name = ANY($1) AND d.node_id = $2 AND compute_device_schedulable(d.health, d.quarantined) \
            AND a.created_at <= $3 \
          ORDER BY a.name FOR SHARE OF a, d",
        &names as &[&str],
        c.node_id.as_str(),
        window.0,
    )
    .fetch_all(&mut *conn)
    .await?;
    if atoms.len() != c.atoms.len() {
        return Ok(Attempt::Lost("a GPU changed"));
    }
    let booked = sqlx::query_scalar!(
        "INSERT INTO device_bookings (atom, device_id, allocation_id, during) \
         SELECT a.name, a.device_id, $2, tstzrange($3, $4) FROM device_atoms a WHERE a.name = ANY($1) \
         ON CONFLICT DO NOTHING RETURNING atom",
        &names as &[&str],
        allocation_id.as_str(),
        window.0,
        window.1,
    )
    .fetch_all(&mut *conn)
    .await?;
    if booked.len() != c.atoms.len() {
        return Ok(Attempt::Lost("an atom was booked meanwhile"));
    }
    // The rows are locked in resource order first: an UPDATE locks in the order its plan visits
    // rows, and two orders on one node deadlock.
    let counted = sqlx::query_scalar!(
        "WITH locked AS (SELECT node_id, resource FROM node_resources WHERE node_id = $1 ORDER BY resource FOR UPDATE) \
         UPDATE node_resources r SET allocated = r.allocated + v.need \
           FROM locked l, (VALUES ('vcpu', $2::bigint), ('memory_mib', $3::bigint), ('disk_gib', $4::bigint)) v(res, need) \
          WHERE r.node_id = l.node_id AND r.resource = l.resource AND r.resource = v.res \
            AND r.allocated + v.need <= floor(r.allocatable * r.ratio) \
          RETURNING r.resource",
        c.node_id.as_str(),
        a.vcpu,
        a.memory_mib,
        a.disk_gib,
    )
    .fetch_all(&mut *conn)
    .await?;
    if counted.len() != 3 {
        return Ok(Attempt::Lost("the node's vCPU, memory or disk filled up"));
    }
    Ok(Attempt::Placed)
}

/// Writes where each allocation went.
pub(crate) async fn record_placements(conn: &mut PgConnection, placed: &[Placed]) -> Result<()> {
    let ids: Vec<&str> = placed.iter().map(|p| p.allocation_id.as_str()).collect();
    let nodes: Vec<&str> = placed.iter().map(|p| p.node_id.as_str()).collect();
    let atoms: Vec<serde_json::Value> = placed.iter().map(|p| json!(p.atoms)).collect();
    sqlx::query!(
        "UPDATE allocations a SET node_id = p.node_id, atoms = ARRAY(SELECT jsonb_array_elements_text(p.atoms)) \
           FROM unnest($1::text[], $2::text[], $3::jsonb[]) AS p(id, node_id, atoms) WHERE a.id = p.id",
        &ids as &[&str],
        &nodes as &[&str],
        &atoms,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The `Unschedulable` condition of a pending reservation, the one definition: `why` in words,
/// since `now`.
pub(crate) fn unschedulable(why: String, now: DateTime<Utc>) -> Condition {
    Condition {
        kind: "Unschedulable".into(),
        status: ConditionStatus::True,
        reason: Some("NoCapacity".into()),
        message: Some(why),
        since: Some(now),
    }
}

/// What placing a whole reservation came to.
pub(crate) enum Placement {
    Placed(Vec<Placed>),
    /// Why not, in words a user understands; nothing is booked.
    Unschedulable(String),
}

/// Places every allocation or none.
pub(crate) async fn place(
    conn: &mut PgConnection,
    pool: (&PoolId, &str),
    allocations: &[(AllocationId, AllocationRequest)],
    window: (DateTime<Utc>, DateTime<Utc>),
) -> Result<(Placement, usize)> {
    sqlx::query("SAVEPOINT placement")
        .execute(&mut *conn)
        .await?;
    let mut placed = Vec::new();
    let mut replans = 0;
    for (i, (allocation_id, a)) in allocations.iter().enumerate() {
        let mut excluded: Vec<NodeId> = Vec::new();
        let mut lost: Vec<&'static str> = Vec::new();
        loop {
            let Some(mut c) = candidate(conn, allocation_id, pool.0, a, window, &excluded).await?
            else {
                sqlx::query("ROLLBACK TO SAVEPOINT placement")
                    .execute(&mut *conn)
                    .await?;
                let mut why = format!(
                    "no schedulable node in pool {} has {} free with {} vCPU, {} MiB of memory and {} GiB of disk{}{} from {} to {}",
                    pool.1,
                    a.describe(),
                    a.vcpu,
                    a.memory_mib,
                    a.disk_gib,
                    if a.node_selector.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ", labels {}",
                            a.node_selector
                                .iter()
                                .map(|(k, v)| format!("{k}={v}"))
                                .collect::<Vec<_>>()
                                .join(",")
                        )
                    },
                    if a.tolerations.is_empty() {
                        ", without tolerating taints"
                    } else {
                        ""
                    },
                    window.0.to_rfc3339(),
                    window.1.to_rfc3339(),
                );
                if allocations.len() > 1 {
                    why = format!("allocation {i}: {why}");
                }
                if !lost.is_empty() {
                    why.push_str(&format!(
                        " (after {} lost race{}: {})",
                        lost.len(),
                        if lost.len() == 1 { "" } else { "s" },
                        lost.join("; ")
                    ));
                }
                return Ok((Placement::Unschedulable(why), replans));
            };
            c.atoms = choose_atoms(
                a.gpu_kind,
                allocation_id,
                std::mem::take(&mut c.atoms),
                a.gpu_count as usize,
            );
            sqlx::query("SAVEPOINT attempt").execute(&mut *conn).await?;
            let outcome = match attempt(conn, a, allocation_id, &c, window).await {
                Ok(o) => o,
                // A lock wait or a deadlock inside the attempt is a lost race too: the savepoint
                // undoes the attempt and the transaction goes on.
                Err(Error::LockTimeout) | Err(Error::Contention { .. }) => {
                    Attempt::Lost("a lock wait timed out")
                }
                Err(e) => return Err(e),
            };
            match outcome {
                Attempt::Placed => {
                    sqlx::query("RELEASE SAVEPOINT attempt")
                        .execute(&mut *conn)
                        .await?;
                    placed.push(Placed {
                        allocation_id: allocation_id.clone(),
                        node_id: c.node_id,
                        atoms: c.atoms,
                    });
                    break;
                }
                Attempt::Lost(why) => {
                    sqlx::query("ROLLBACK TO SAVEPOINT attempt")
                        .execute(&mut *conn)
                        .await?;
                    replans += 1;
                    lost.push(why);
                    excluded.push(c.node_id);
                    if lost.len() >= MAX_ATTEMPTS {
                        sqlx::query("ROLLBACK TO SAVEPOINT placement")
                            .execute(&mut *conn)
                            .await?;
                        let why = format!(
                            "{} for {} in pool {}: {} placement attempts lost races to concurrent changes ({})",
                            if allocations.len() > 1 {
                                format!("allocation {i}")
                            } else {
                                "placement".into()
                            },
                            a.describe(),
                            pool.1,
                            MAX_ATTEMPTS,
                            lost.join("; ")
                        );
                        return Ok((Placement::Unschedulable(why), replans));
                    }
                }
            }
        }
    }
    sqlx::query("RELEASE SAVEPOINT placement")
        .execute(&mut *conn)
        .await?;
    Ok((Placement::Placed(placed), replans))
}
