-- The current definition, as migrations/0008_sim_clock_per_transaction.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_advance_sim_clock(p_by interval) RETURNS timestamptz
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_ts timestamptz;
BEGIN
    IF p_by < interval '0' THEN
        RAISE EXCEPTION 'simulated time only moves forward (asked to move by %)', p_by;
    END IF;
    UPDATE compute_sim_clock SET ts = ts + p_by WHERE id = 1 RETURNING ts INTO v_ts;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this database is not on simulated time; call compute_use_sim_clock() first';
    END IF;
    PERFORM set_config('compute.sim_now', v_ts::text, true);
    RETURN v_ts;
END
$fn$;
