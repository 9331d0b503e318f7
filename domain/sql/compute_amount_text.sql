-- The current definition, as migrations/0015_reservation_hot_path.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_amount_text(p numeric) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT CASE WHEN p::text LIKE '%.%' THEN rtrim(rtrim(round(p, 6)::text, '0'), '.') ELSE p::text END $$;
