-- The current definition, as migrations/0034_pool_rules.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_reservation_idle(r reservations)
    RETURNS boolean
    LANGUAGE sql STABLE
    AS $fn$
    SELECT r.state IN ('scheduled', 'active') AND r.starts_at <= compute_now() AND r.ends_at > compute_now()
       AND r.admitted_under ? 'idleGraceSeconds'
       AND NOT r.conditions @> '[{"type": "Idle"}]'
       AND NOT EXISTS (SELECT 1 FROM instances i WHERE i.reservation_id = r.id
                        AND i.state IN ('provisioning', 'running', 'stopping'))
       AND greatest(r.starts_at, (SELECT max(i.stopped_at) FROM instances i WHERE i.reservation_id = r.id))
           + make_interval(secs => (r.admitted_under->>'idleGraceSeconds')::float8) <= compute_now()
$fn$;
