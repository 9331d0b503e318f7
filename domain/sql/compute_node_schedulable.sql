-- The current definition, as migrations/0010_one_home_sql_facts.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_node_schedulable(p_lifecycle text, p_reachability text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT p_lifecycle = 'active' AND p_reachability IN ('connected', 'disconnected') $$;
