-- The current definition, as migrations/0034_pool_rules.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_future_gpu_hours(p_tenant text, p_pool text, p_except text, p_now timestamptz)
    RETURNS numeric
    LANGUAGE sql STABLE
    AS $fn$
    SELECT coalesce(sum(r.charge_gpu * extract(epoch FROM r.ends_at - greatest(r.starts_at, p_now)) / 3600), 0)
      FROM reservations r
     WHERE r.tenant_id = p_tenant AND r.pool_id = p_pool AND r.state IN ('pending', 'scheduled', 'active')
       AND r.ends_at > p_now AND r.id IS DISTINCT FROM p_except
$fn$;
