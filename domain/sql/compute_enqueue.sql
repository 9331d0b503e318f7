-- The current definition, as migrations/0033_trace_context.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_enqueue(p_kind text, p_keys text[], p_shards integer, p_delay_seconds float8 DEFAULT 0)
    RETURNS integer
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_count integer;
BEGIN
    WITH up AS (
        INSERT INTO work_queue AS w (kind, key, shard, not_before)
        SELECT p_kind, k.key, compute_shard(k.key, p_shards), compute_now() + make_interval(secs => p_delay_seconds)
          FROM (SELECT DISTINCT unnest(p_keys) AS key) k
         WHERE k.key IS NOT NULL
         ORDER BY k.key
        ON CONFLICT (kind, key) DO UPDATE
           SET gen = w.gen + 1, not_before = least(w.not_before, EXCLUDED.not_before), updated_at = compute_now(),
               traceparent = coalesce(EXCLUDED.traceparent, w.traceparent)
        RETURNING 1)
    SELECT count(*)::integer INTO v_count FROM up;
    RETURN v_count;
END
$fn$;
