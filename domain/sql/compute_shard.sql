-- The current definition, as migrations/0009_work_queue_functions.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_shard(p_key text, p_shards integer) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT abs(hashtextextended(p_key, 0) % greatest(p_shards, 1))::integer $$;
