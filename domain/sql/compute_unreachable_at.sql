-- The current definition, as migrations/0012_node_sessions.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_unreachable_at(reason text) RETURNS timestamptz
    LANGUAGE sql STABLE
    AS $$
    SELECT greatest(
        compute_now() + interval '40 seconds'
            + CASE WHEN reason = 'gateway_lost' THEN interval '120 seconds' ELSE interval '0' END,
        (SELECT last_outage_at + interval '340 seconds' FROM liveness_passes WHERE id = 1))
    $$;
