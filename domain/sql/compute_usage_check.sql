-- The current definition, as migrations/0050_usage_check_keyed_by_period.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_usage_check(p_limit integer)
    RETURNS TABLE (written integer, more boolean)
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    m usage_meter%ROWTYPE;
    v_changes integer;
    v_written integer;
    v_last_txid xid8;
    v_last_seq bigint;
BEGIN
    SELECT * INTO m FROM usage_meter WHERE id FOR UPDATE;
    IF m.closed_through IS NULL THEN
        RETURN QUERY SELECT 0, false;
        RETURN;
    END IF;
    WITH changes AS MATERIALIZED (
        SELECT o.txid, o.seq, o.subject AS reservation_id FROM outbox o
         WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot())
           AND (o.txid, o.seq) > (m.checked_txid, m.checked_seq)
           AND compute_usage_reads(o.type)
         ORDER BY o.txid, o.seq LIMIT p_limit
    ), changed AS (
        SELECT a.id AS allocation_id FROM allocations a
         WHERE a.reservation_id IN (SELECT c.reservation_id FROM changes c)
    ), pairs AS (
        SELECT b.allocation_id, p.window_start, p.window_end
          FROM changed c
          JOIN device_bookings b ON b.allocation_id = c.allocation_id
          JOIN usage_periods p ON p.closed AND tstzrange(p.window_start, p.window_end) && b.during
        UNION
        SELECT r.allocation_id, r.window_start, p.window_end
          FROM usage_records r JOIN changed c ON c.allocation_id = r.allocation_id
          JOIN usage_periods p ON p.window_start = r.window_start
    ), measured AS (
        SELECT x.* FROM (SELECT array_agg(allocation_id) AS a, array_agg(window_start) AS f, array_agg(window_end) AS t
                           FROM pairs) q,
               compute_usage_measure(q.a, q.f, q.t) x
    ), recorded AS (
        SELECT r.allocation_id, r.window_start, max(r.seq) AS last_seq, min(r.model) AS model,
               min(r.gpu_kind) AS gpu_kind, min(r.profile) AS profile, max(r.atoms) AS atoms,
               sum(r.booked_seconds) AS booked_seconds, sum(r.gpu_seconds) AS gpu_seconds,
               sum(r.vcpu_seconds) AS vcpu_seconds, sum(r.memory_mib_seconds) AS memory_mib_seconds,
               sum(r.disk_gib_seconds) AS disk_gib_seconds
          FROM usage_records r JOIN pairs p ON p.allocation_id = r.allocation_id AND p.window_start = r.window_start
         GROUP BY r.allocation_id, r.window_start
    ), compared AS (
        SELECT p.allocation_id, p.window_start, p.window_end,
               coalesce(rec.last_seq + 1, 0) AS seq,
               a.reservation_id, rv.tenant_id, rv.pool_id,
               coalesce(x.model, rec.model) AS model, coalesce(x.gpu_kind, rec.gpu_kind) AS gpu_kind,
               coalesce(x.profile, rec.profile) AS profile, coalesce(x.atoms, rec.atoms) AS atoms,
               coalesce(x.booked_seconds, 0) - coalesce(rec.booked_seconds, 0) AS booked_seconds,
               coalesce(x.gpu_seconds, 0) - coalesce(rec.gpu_seconds, 0) AS gpu_seconds,
               coalesce(x.vcpu_seconds, 0) - coalesce(rec.vcpu_seconds, 0) AS vcpu_seconds,
               coalesce(x.memory_mib_seconds, 0) - coalesce(rec.memory_mib_seconds, 0) AS memory_mib_seconds,
               coalesce(x.disk_gib_seconds, 0) - coalesce(rec.disk_gib_seconds, 0) AS disk_gib_seconds
          FROM pairs p
          JOIN allocations a ON a.id = p.allocation_id
          JOIN reservations rv ON rv.id = a.reservation_id
          LEFT JOIN recorded rec ON rec.allocation_id = p.allocation_id AND rec.window_start = p.window_start
          LEFT JOIN measured x ON x.allocation_id = p.allocation_id AND x.window_start = p.window_start
                              AND x.window_end = p.window_end
    ), written AS (
        INSERT INTO usage_records AS u (key, kind, seq, allocation_id, reservation_id, tenant_id, pool_id,
                                        window_start, window_end, model, gpu_kind, profile, atoms, booked_seconds,
                                        gpu_seconds, vcpu_seconds, memory_mib_seconds, disk_gib_seconds)
        SELECT 'cmp:' || c.allocation_id || ':' || compute_json_time(c.window_start)
                   || CASE WHEN c.seq = 0 THEN '' ELSE ':adj:' || c.seq END,
               CASE WHEN c.seq = 0 THEN 'window' ELSE 'adjustment' END, c.seq, c.allocation_id,
               c.reservation_id, c.tenant_id, c.pool_id, c.window_start, c.window_end, c.model, c.gpu_kind,
               c.profile, c.atoms, c.booked_seconds, c.gpu_seconds, c.vcpu_seconds, c.memory_mib_seconds,
               c.disk_gib_seconds
          FROM compared c
         WHERE c.model IS NOT NULL
           AND (c.booked_seconds, c.gpu_seconds, c.vcpu_seconds, c.memory_mib_seconds, c.disk_gib_seconds)
               IS DISTINCT FROM (0::numeric, 0::numeric, 0::numeric, 0::numeric, 0::numeric)
        RETURNING u.*
    ), emitted AS (
        SELECT compute_emit(CASE WHEN w.seq = 0 THEN 'usage.window_closed' ELSE 'usage.window_adjusted' END,
                            w.tenant_id, w.allocation_id, compute_usage_payload(w)) AS id
          FROM written w
    )
    SELECT (SELECT count(*) FROM changes), (SELECT count(*) FROM emitted),
           (SELECT c.txid FROM changes c ORDER BY c.txid DESC, c.seq DESC LIMIT 1),
           (SELECT c.seq FROM changes c ORDER BY c.txid DESC, c.seq DESC LIMIT 1)
      INTO v_changes, v_written, v_last_txid, v_last_seq;
    IF v_changes > 0 THEN
        UPDATE usage_meter SET checked_txid = v_last_txid, checked_seq = v_last_seq, updated_at = compute_now()
         WHERE id;
    END IF;
    RETURN QUERY SELECT v_written, v_changes = p_limit;
END
$fn$;
