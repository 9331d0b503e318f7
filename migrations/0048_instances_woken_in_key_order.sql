-- A transaction that moves several reservations (their state, start or end) wakes their live
-- instances at commit in key order, as every other path takes `work_queue` rows
-- (docs/database-locks.md, rule 3), the way migration 0042 made commands wake their workflows.
-- The deferred per-row trigger `reservations_instances_due` (migration 0014) enqueued each
-- reservation's instances in the order the transaction had updated the reservations: a batch
-- expiry or activation moving reservation B then A, against an instance batch's finish holding
-- A's instance row and reaching for B's, waited on each other until PostgreSQL's deadlock
-- detector rolled one back.
--
-- As in 0042: an immediate row trigger gathers the reservations as they move
-- (`compute.due_reservations`, set with `set_config(…, true)`: gone at commit or rollback,
-- rolled back with a savepoint), and the first firing of the deferred trigger at commit
-- enqueues the live instances of all of them in one call (`compute_enqueue` takes its keys in
-- key order) and empties the list; the later firings find it empty. The gathering trigger's
-- name sorts before `reservations_instances_due`, so in immediate mode a row is gathered
-- before it is enqueued.

CREATE FUNCTION compute_note_reservation_of_instances() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    BEGIN
        PERFORM set_config('compute.due_reservations',
            concat_ws(',', nullif(current_setting('compute.due_reservations', true), ''), NEW.id), true);
        RETURN NULL;
    END
    $$;

CREATE TRIGGER reservations_instances_collected
    AFTER UPDATE OF state, starts_at, ends_at ON reservations
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.starts_at IS DISTINCT FROM NEW.starts_at
          OR OLD.ends_at IS DISTINCT FROM NEW.ends_at)
    EXECUTE FUNCTION compute_note_reservation_of_instances();

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
