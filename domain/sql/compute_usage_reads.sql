-- The current definition, as migrations/0050_usage_check_keyed_by_period.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_usage_reads(p_type text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $fn$
    SELECT starts_with(p_type, 'reservation.')
       AND p_type NOT IN ('reservation.pending', 'reservation.idle', 'reservation.conditions_changed')
$fn$;
