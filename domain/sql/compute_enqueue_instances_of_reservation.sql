-- The current definition, as migrations/0017_hot_path_plans.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_enqueue_instances_of_reservation() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    DECLARE
        v_ids text[];
    BEGIN
        v_ids := ARRAY(SELECT i.id FROM instances i
                        WHERE i.reservation_id = NEW.id AND i.state IN ('provisioning', 'running', 'stopping'));
        IF cardinality(v_ids) > 0 THEN
            PERFORM compute_enqueue('instance', v_ids, 8, 0);
        END IF;
        RETURN NULL;
    END
    $$;
