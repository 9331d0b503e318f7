-- The current definition, as migrations/0015_reservation_hot_path.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_reservation_changed(p_id text, p_type text, p_shards integer) RETURNS text
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_event text;
BEGIN
    SELECT compute_emit(p_type, r.tenant_id, r.id, compute_reservation_payload(r.id)) INTO v_event
      FROM reservations r WHERE r.id = p_id;
    PERFORM compute_enqueue('reservation', ARRAY[p_id], p_shards);
    RETURN v_event;
END
$fn$;
ALTER FUNCTION compute_reservation_changed(text, text, integer) SET enable_seqscan = off;
