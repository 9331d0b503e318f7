-- The current definition, as migrations/0008_sim_clock_per_transaction.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_set_sim_clock(p_ts timestamptz) RETURNS timestamptz
    LANGUAGE plpgsql
    AS $fn$
BEGIN
    UPDATE compute_sim_clock SET ts = p_ts WHERE id = 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this database is not on simulated time; call compute_use_sim_clock() first';
    END IF;
    PERFORM set_config('compute.sim_now', p_ts::text, true);
    RETURN p_ts;
END
$fn$;
