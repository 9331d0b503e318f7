-- The current definition, as migrations/0008_sim_clock_per_transaction.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_use_sim_clock(p_start timestamptz) RETURNS timestamptz
    LANGUAGE plpgsql
    AS $fn$
BEGIN
    INSERT INTO compute_sim_clock (id, ts) VALUES (1, p_start)
        ON CONFLICT (id) DO UPDATE SET ts = EXCLUDED.ts;
    PERFORM set_config('compute.sim_now', p_start::text, true);
    EXECUTE $def$
        CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz
            LANGUAGE sql STABLE
            AS 'SELECT coalesce(nullif(current_setting(''compute.sim_now'', true), '''')::timestamptz,
                                set_config(''compute.sim_now'', (SELECT ts FROM compute_sim_clock WHERE id = 1)::text, true)::timestamptz)'
    $def$;
    RETURN p_start;
END
$fn$;
