-- The current definition, as migrations/0002_outbox.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_new_id(p_prefix text) RETURNS text
    LANGUAGE sql VOLATILE
    AS $$
    SELECT p_prefix || '_'
        || lpad(to_hex((extract(epoch FROM compute_now()) * 1000)::bigint), 12, '0')
        || substr(replace(gen_random_uuid()::text, '-', ''), 13, 20)
$$;
