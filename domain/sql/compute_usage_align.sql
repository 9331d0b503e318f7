-- The current definition, as migrations/0016_usage_windows.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_usage_align(p_ts timestamptz, p_seconds integer) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT to_timestamp(floor(extract(epoch FROM p_ts) / p_seconds) * p_seconds) $$;
