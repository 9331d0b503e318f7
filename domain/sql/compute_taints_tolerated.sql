-- The current definition, as migrations/0010_one_home_sql_facts.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_taints_tolerated(p_taints jsonb, p_tolerations jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT NOT EXISTS (
            SELECT 1 FROM jsonb_array_elements(p_taints) t
             WHERE t->>'effect' IN ('NoSchedule', 'NoExecute')
               AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_tolerations) o
                                WHERE o->>'key' = t->>'key' AND (o->>'value' IS NULL OR o->>'value' = t->>'value')
                                  AND (o->>'effect' IS NULL OR o->>'effect' = t->>'effect')))
    $$;
