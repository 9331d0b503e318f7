-- The current definition, as migrations/0014_instances.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_enqueue_workflow_of_command() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    BEGIN
        PERFORM compute_enqueue('instance', ARRAY[NEW.workflow_id], 8, 0);
        RETURN NULL;
    END
    $$;
