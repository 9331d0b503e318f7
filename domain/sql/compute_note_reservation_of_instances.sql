-- The current definition, as migrations/0048_instances_woken_in_key_order.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_note_reservation_of_instances() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    BEGIN
        PERFORM set_config('compute.due_reservations',
            concat_ws(',', nullif(current_setting('compute.due_reservations', true), ''), NEW.id), true);
        RETURN NULL;
    END
    $$;
