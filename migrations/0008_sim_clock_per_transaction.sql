-- Simulated time stands still within a transaction, as the wall clock's compute_now() (the
-- transaction's start time) does in production. Before this, compute_now() on simulated time read
-- compute_sim_clock at every statement, so a transaction running while a test moved the clock
-- saw two different times: a cancel checked "not started yet" at one time and ended the bookings
-- at a later one, leaving a booking behind that production could never leave.
--
-- The first read in a transaction caches the clock in the transaction-local setting
-- compute.sim_now (set_config(…, true): gone at commit or rollback, safe behind a
-- transaction-pooling proxy); later reads in the transaction return it. Moving the clock updates
-- it too, so the transaction that moves time sees the new time. Production (never on simulated
-- time) is untouched: its compute_now() keeps the body 0001_clock.sql gave it.

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

-- A database already on simulated time gets the new body now.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM compute_sim_clock) THEN
        PERFORM compute_use_sim_clock((SELECT ts FROM compute_sim_clock WHERE id = 1));
    END IF;
END
$$;
