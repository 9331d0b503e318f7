-- The current definition, as migrations/0042_workflows_woken_in_key_order.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_enqueue_workflow_of_command() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    DECLARE
        v_due text := nullif(current_setting('compute.due_workflows', true), '');
    BEGIN
        IF v_due IS NOT NULL THEN
            PERFORM set_config('compute.due_workflows', '', true);
            PERFORM compute_enqueue('instance', string_to_array(v_due, ','), 8, 0);
        END IF;
        RETURN NULL;
    END
    $$;
