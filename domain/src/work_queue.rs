//! The work queue: reconcilers are woken by rows enqueued in the transaction that changed the
//! state, claimed with `FOR UPDATE SKIP LOCKED` by the holder of the row's shard lease, deleted on
//! success only if `gen` is still the claimed one, and retried with exponential backoff on
//! failure. Reconcilers are level-triggered and resync, so a lost row only costs time.

use std::time::Duration;

use sqlx::PgConnection;

use crate::error::Result;
use crate::text_enum::text_enum;

/// A claimed item.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Item {
    pub kind: WorkKind,
    pub key: String,
    /// The generation claimed (`work_queue.gen`).
    #[sqlx(rename = "gen")]
    pub generation: i64,
    pub attempts: i32,
    /// The trace context of the transaction that last enqueued it (migration 0033), which its
    /// run continues.
    pub traceparent: Option<String>,
}

/// How many shards each kind of work is split into; a worker holds the lease
/// `shard:<kind>:<n>` of each shard it works on.
pub const SHARDS: i32 = 8;

text_enum!(
    /// What a work-queue row asks for; its key names the subject.
    WorkKind {
        /// Reconcile one reservation (key: its id): start, expire or retry it when due.
        Reservation = "reservation",
        /// Recompute one pool's capacity rollup (key: the pool's id).
        PoolCapacity = "pool_capacity",
        /// Dispatch one node's waiting commands (key: the node's id; `node_commands`).
        NodeCommands = "node_commands",
        /// Run one instance's workflow (key: the instance's id).
        Instance = "instance",
        /// Work that does nothing, for the benchmark of the queue itself.
        Noop = "noop",
    }
);

/// The longest backoff after failures.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Enqueues `key` of `kind` (or bumps its `gen` if present), due after `delay`, in the caller's
/// transaction. The shard is a hash of the key over `shards` (`compute_shard`, migration 0009,
/// the one definition; `compute_enqueue` is the one upsert).
pub async fn enqueue(
    conn: &mut PgConnection,
    kind: WorkKind,
    key: &str,
    shards: i32,
    delay: Duration,
) -> Result<()> {
    sqlx::query!(
        "SELECT compute_enqueue($1, ARRAY[$2], $3, $4)",
        kind as _,
        key,
        shards.max(1),
        delay.as_secs_f64(),
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(())
}

/// Which of `held` (kind and shard pairs) have an item due and unclaimed now, in one read
/// without locks: a worker that holds many shards claims only in those, instead of a fenced
/// transaction per shard each pass (eight empty claims, four round trips each, were most of the
/// time from a poke to the claim of a new command). A shard this misses (an item committed just
/// after it) is claimed at the next pass; the claim itself stays fenced.
pub async fn due_shards(
    db: &crate::db::Db,
    held: &[(WorkKind, i32)],
) -> Result<Vec<(WorkKind, i32)>> {
    let kinds: Vec<String> = held.iter().map(|(k, _)| k.as_str().to_owned()).collect();
    let shards: Vec<i32> = held.iter().map(|(_, n)| *n).collect();
    let due = sqlx::query!(
        r#"SELECT h.kind AS "kind!", h.shard AS "shard!" FROM unnest($1::text[], $2::int[]) AS h(kind, shard)
            WHERE EXISTS (SELECT 1 FROM work_queue w
                           WHERE w.kind = h.kind AND w.shard = h.shard AND w.not_before <= compute_now()
                             AND (w.claimed_until IS NULL OR w.claimed_until < compute_now()))"#,
        &kinds,
        &shards,
    )
    .fetch_all(db.pool())
    .await?;
    Ok(due
        .into_iter()
        .filter_map(|r| Some((WorkKind::parse(&r.kind)?, r.shard)))
        .collect())
}

/// Claims up to `limit` due items of `kind` in `shards`, for `claim_for`. Run it in a transaction
/// fenced by the shard leases; other claimers skip the rows this one locks.
pub async fn claim(
    conn: &mut PgConnection,
    kind: WorkKind,
    shards: &[i32],
    limit: i64,
    claim_for: Duration,
) -> Result<Vec<Item>> {
    Ok(sqlx::query_as!(
        Item,
        r#"UPDATE work_queue w SET claimed_until = compute_now() + make_interval(secs => $4::float8), claimed_gen = w.gen,
                updated_at = compute_now()
           FROM (SELECT kind, key FROM work_queue
                  WHERE kind = $1 AND shard = ANY($2) AND not_before <= compute_now()
                    AND (claimed_until IS NULL OR claimed_until < compute_now())
                  ORDER BY not_before, key LIMIT $3 FOR UPDATE SKIP LOCKED) due
          WHERE w.kind = due.kind AND w.key = due.key
         RETURNING w.kind AS "kind: _", w.key, w.gen AS generation, w.attempts, w.traceparent"#,
        kind as _,
        shards,
        limit,
        claim_for.as_secs_f64(),
    )
    .fetch_all(&mut *conn)
    .await?)
}

/// How often the reconciler resyncs the kinds of work that are woken by changes (pool rollups,
/// command dispatch, instance workflows): a queue row lost or never written costs at most this
/// long. Reservations have their own, faster resync (their times come due by themselves).
pub const RESYNC_EVERY: std::time::Duration = std::time::Duration::from_secs(300);

/// Enqueues every pool for the capacity-rollup reconciler (the resync: a lost queue row only
/// costs time). Returns how many pools.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn enqueue_all_pools(db: &crate::db::Db) -> Result<u64> {
    // A transaction (not a bare statement), so a fenced handle checks its lease first.
    let n = db
        .tx(
            "enqueue_all_pools",
            crate::db::TxKind::Maintenance,
            |conn| {
                Box::pin(async move {
                    Ok(sqlx::query_scalar!(
                        r#"SELECT compute_enqueue($1, array_agg(p.id), $2) AS "n!" FROM pools p"#,
                        WorkKind::PoolCapacity as _,
                        SHARDS,
                    )
                    .fetch_one(&mut *conn)
                    .await?)
                })
            },
        )
        .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Finishes a claimed item whose run succeeded. If nobody enqueued it again meanwhile, it is
/// deleted, or, when `next` is given, kept and due again at `next` (a reconciler's next
/// wake-up); if it was enqueued again, it stays, unclaimed, and runs again. Returns whether the
/// claimed generation was the last one.
///
/// An enqueue may be bumping `gen` while this runs, holding the row. The claim is cleared by
/// one `UPDATE` whose condition does not name `gen`: it waits for that enqueue, and PostgreSQL
/// evaluates its `SET` on the row as the enqueue left it. (A condition `gen <> claimed` is
/// checked against the statement's snapshot, where the bump is not yet visible: such a row is
/// skipped, and the item stayed claimed until its claim expired, a minute for an instance.)
pub async fn finish(
    conn: &mut PgConnection,
    item: &Item,
    next: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<bool> {
    if next.is_none() {
        // Waits for an enqueue holding the row, then deletes only if `gen` is still the one
        // claimed (the recheck on the newest row).
        let deleted = sqlx::query!(
            "DELETE FROM work_queue WHERE kind = $1 AND key = $2 AND gen = $3",
            item.kind as _,
            item.key,
            item.generation,
        )
        .execute(&mut *conn)
        .await?;
        if deleted.rows_affected() == 1 {
            return Ok(true);
        }
    }
    let current = sqlx::query_scalar!(
        r#"UPDATE work_queue SET claimed_until = NULL, claimed_gen = NULL,
                  not_before = CASE WHEN gen = $3 AND $4::timestamptz IS NOT NULL THEN $4 ELSE not_before END,
                  attempts = CASE WHEN gen = $3 THEN 0 ELSE attempts END,
                  last_error = CASE WHEN gen = $3 THEN NULL ELSE last_error END,
                  updated_at = compute_now()
            WHERE kind = $1 AND key = $2
        RETURNING gen = $3 AS "current!""#,
        item.kind as _,
        item.key,
        item.generation,
        next,
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(current.unwrap_or(false))
}

/// Marks a claimed item done: deleted only if nobody enqueued it again meanwhile; otherwise it
/// stays, unclaimed, and runs again. Returns whether it was deleted.
pub async fn complete(conn: &mut PgConnection, item: &Item) -> Result<bool> {
    finish(conn, item, None).await
}

/// Records a failure: the error is kept for operators and the item is due again after an
/// exponential backoff (1 s, 2 s, 4 s, … up to [`MAX_BACKOFF`]). An item enqueued again while
/// it ran is due at once and its attempts are not counted up: the new generation has not failed.
///
/// The exponent is capped (`power(2, 1024)` is out of `float8`'s range: an item that had failed
/// that often, three and a half days at the cap, made this statement fail, and with it every
/// finish of its shard's batch).
pub async fn fail(conn: &mut PgConnection, item: &Item, error: &str) -> Result<()> {
    sqlx::query!(
        "UPDATE work_queue SET attempts = CASE WHEN gen = $5 THEN attempts + 1 ELSE attempts END, \
                last_error = $3, claimed_until = NULL, claimed_gen = NULL, \
                not_before = CASE WHEN gen = $5 \
                                  THEN compute_now() + make_interval(secs => least(power(2, least(attempts, 30))::float8, $4::float8)) \
                                  ELSE least(not_before, compute_now()) END, \
                updated_at = compute_now() \
          WHERE kind = $1 AND key = $2",
        item.kind as _,
        item.key,
        error,
        MAX_BACKOFF.as_secs_f64(),
        item.generation,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}
