-- The current definition, as migrations/0048_instances_woken_in_key_order.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_enqueue_instances_of_reservation() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    DECLARE
        v_due text := nullif(current_setting('compute.due_reservations', true), '');
        v_ids text[];
    BEGIN
        IF v_due IS NOT NULL THEN
            PERFORM set_config('compute.due_reservations', '', true);
            v_ids := ARRAY(SELECT i.id FROM instances i
                            WHERE i.reservation_id = ANY(string_to_array(v_due, ','))
                              AND i.state IN ('provisioning', 'running', 'stopping'));
            IF cardinality(v_ids) > 0 THEN
                PERFORM compute_enqueue('instance', v_ids, 8, 0);
            END IF;
        END IF;
        RETURN NULL;
    END
    $$;
