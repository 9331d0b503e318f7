-- The current definition, as migrations/0015_reservation_hot_path.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_json_time(p_ts timestamptz) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
    SELECT to_char(p_ts AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
        || CASE WHEN (extract(microseconds FROM p_ts)::bigint % 1000000) = 0 THEN ''
                WHEN (extract(microseconds FROM p_ts)::bigint % 1000) = 0 THEN to_char(p_ts AT TIME ZONE 'UTC', '.MS')
                ELSE to_char(p_ts AT TIME ZONE 'UTC', '.US') END
        || 'Z'
    $$;
