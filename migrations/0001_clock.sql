-- The one clock of the system. Every time comparison in SQL reads compute_now(), never now().
-- This is the only file allowed to read the wall clock (the wall-clock test exempts it by name).
CREATE EXTENSION IF NOT EXISTS btree_gist;

-- Tests only: compute_use_sim_clock() points compute_now() at this row.
CREATE TABLE compute_sim_clock (
    id integer PRIMARY KEY CHECK (id = 1),
    ts timestamptz NOT NULL
);

CREATE FUNCTION compute_now() RETURNS timestamptz
    LANGUAGE sql STABLE
    AS $$ SELECT now() $$;

COMMENT ON FUNCTION compute_now() IS
    'Business time. The wall clock (transaction start) in production; compute_sim_clock.ts after compute_use_sim_clock().';

-- Switches this database to simulated time starting at p_start. For tests and the simulator;
-- a production database never calls it (/readyz reports the clock mode).
CREATE FUNCTION compute_use_sim_clock(p_start timestamptz) RETURNS timestamptz
    LANGUAGE plpgsql
    AS $fn$
BEGIN
    INSERT INTO compute_sim_clock (id, ts) VALUES (1, p_start)
        ON CONFLICT (id) DO UPDATE SET ts = EXCLUDED.ts;
    EXECUTE $def$
        CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz
            LANGUAGE sql STABLE
            AS 'SELECT ts FROM compute_sim_clock WHERE id = 1'
    $def$;
    RETURN p_start;
END
$fn$;

-- Moves simulated time to p_ts. Refuses when the database is not on simulated time.
CREATE FUNCTION compute_set_sim_clock(p_ts timestamptz) RETURNS timestamptz
    LANGUAGE plpgsql
    AS $fn$
BEGIN
    UPDATE compute_sim_clock SET ts = p_ts WHERE id = 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this database is not on simulated time; call compute_use_sim_clock() first';
    END IF;
    RETURN p_ts;
END
$fn$;

-- Moves simulated time forward by p_by; returns the new time.
CREATE FUNCTION compute_advance_sim_clock(p_by interval) RETURNS timestamptz
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
    RETURN v_ts;
END
$fn$;

-- Whether compute_now() reads the simulated clock.
CREATE FUNCTION compute_clock_is_simulated() RETURNS boolean
    LANGUAGE sql STABLE
    AS $$ SELECT EXISTS (SELECT 1 FROM compute_sim_clock) $$;
