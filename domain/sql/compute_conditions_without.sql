-- The current definition, as migrations/0012_node_sessions.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_conditions_without(conditions jsonb, kind text) RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT coalesce(jsonb_agg(c), '[]'::jsonb) FROM jsonb_array_elements(conditions) c WHERE c->>'type' <> kind
    $$;
