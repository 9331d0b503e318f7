-- The current definition, as migrations/0018_create_answers_with_its_reservation.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_reservation_json(p_id text) RETURNS jsonb
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
  RETURN (SELECT to_jsonb(r) || jsonb_build_object(
                   'state', compute_reservation_state(r.state, r.starts_at, r.ends_at),
                   'charge_gpu', r.charge_gpu::float8)
            FROM reservations r
           WHERE r.id = p_id);
END
$$;
ALTER FUNCTION compute_reservation_json(text) SET enable_seqscan = off;
