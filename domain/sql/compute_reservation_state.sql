-- The current definition, as migrations/0010_one_home_sql_facts.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_reservation_state(p_state text, p_starts_at timestamptz, p_ends_at timestamptz)
    RETURNS text
    LANGUAGE sql
    STABLE
    AS $$
        SELECT CASE WHEN p_state IN ('pending', 'scheduled', 'active') AND p_ends_at <= compute_now() THEN 'expired'
                    WHEN p_state = 'scheduled' AND p_starts_at <= compute_now() THEN 'active'
                    ELSE p_state END
    $$;
