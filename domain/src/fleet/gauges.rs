//! The figures of the fleet's gauges (`compute-workers`' `gauges`), read in one statement.

use crate::db::Db;
use crate::error::Result;

/// One reading: (metric family, label value, value) rows.
pub async fn read(db: &Db) -> Result<Vec<(String, String, f64)>> {
    Ok(sqlx::query_as(READ).fetch_all(db.pool()).await?)
}

/// The one statement of a reading. A family's absent label values read as absent (a state with
/// no reservation has no series), except the states and reachabilities, which read as 0 so a
/// dashboard's line drops to zero instead of vanishing.
const READ: &str = "
WITH states(s) AS (VALUES ('pending'), ('scheduled'), ('active')),
     reach(r) AS (VALUES ('connected'), ('disconnected'), ('unreachable'), ('lost')),
     sink_states(s) AS (VALUES ('healthy'), ('failing'), ('behind')),
     recent AS (SELECT extract(epoch FROM c.finished_at - c.created_at)::float8 AS seconds
                  FROM (SELECT finished_at, created_at FROM commands
                         WHERE state IN ('succeeded', 'failed') ORDER BY id DESC LIMIT 1000) c
                 WHERE c.finished_at > compute_now() - interval '5 minutes')
SELECT 'compute_reservations', s.s, (SELECT count(*) FROM reservations r WHERE r.state = s.s)::float8 FROM states s
UNION ALL
SELECT 'compute_nodes', x.r, (SELECT count(*) FROM nodes n WHERE n.reachability = x.r)::float8 FROM reach x
UNION ALL
SELECT 'compute_work_queue_due_items', w.kind, count(*)::float8 FROM work_queue w
 WHERE w.not_before <= compute_now() AND (w.claimed_until IS NULL OR w.claimed_until < compute_now())
 GROUP BY w.kind
UNION ALL
SELECT 'compute_work_queue_oldest_due_seconds', w.kind, extract(epoch FROM compute_now() - min(w.not_before))::float8
  FROM work_queue w
 WHERE w.not_before <= compute_now() AND (w.claimed_until IS NULL OR w.claimed_until < compute_now())
 GROUP BY w.kind
UNION ALL
SELECT 'compute_webhook_sink_lag_seconds', s.id,
       coalesce(extract(epoch FROM compute_now() - (
          SELECT o.time FROM outbox o
           WHERE (o.txid, o.seq) > (c.txid, c.seq) AND o.txid < pg_snapshot_xmin(pg_current_snapshot())
             AND (s.tenant_id IS NULL OR o.tenant_id = s.tenant_id)
             AND (cardinality(s.types) = 0 OR o.type = ANY(s.types))
           ORDER BY o.txid, o.seq LIMIT 1)), 0)::float8
  FROM event_sinks s JOIN outbox_cursors c ON c.sink_id = s.id
 WHERE s.active
UNION ALL
SELECT 'compute_webhook_sinks', x.s, (SELECT count(*) FROM event_sinks e WHERE e.state = x.s)::float8 FROM sink_states x
UNION ALL
SELECT 'compute_commands_recent_latency_seconds', q.q::text,
       (SELECT percentile_cont(q.q) WITHIN GROUP (ORDER BY seconds) FROM recent)
  FROM (VALUES (0.5::float8), (0.99::float8)) q(q)
 WHERE EXISTS (SELECT 1 FROM recent)
";
