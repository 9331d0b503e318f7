-- The current definition, as migrations/0013_commands.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_enqueue_node_commands() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    BEGIN
        PERFORM compute_enqueue('node_commands', ARRAY[NEW.id], 8, 0);
        RETURN NULL;
    END
    $$;
