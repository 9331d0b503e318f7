-- A transaction that moves the commands of several workflows wakes the workflows at commit in key
-- order, as every other path takes `work_queue` rows (docs/database-locks.md, rule 3). The
-- deferred per-row trigger `commands_workflow_due` (migration 0014) enqueued each command's
-- workflow in the order the transaction had updated the rows: a dispatch moving the commands of
-- workflows B then A, against an instance batch's finish holding A's row and reaching for B's,
-- waited on each other until PostgreSQL's deadlock detector rolled one back.
--
-- A constraint trigger cannot be statement-level, so the rows are gathered as they move: an
-- immediate row trigger adds the workflow to the transaction's list (`compute.due_workflows`,
-- set with `set_config(…, true)`: gone at commit or rollback, rolled back with a savepoint), and
-- the first firing of the deferred trigger at commit enqueues the whole list in one call
-- (`compute_enqueue` takes its keys in key order) and empties it; the later firings find it
-- empty. A row moved after that firing (`SET CONSTRAINTS … IMMEDIATE`) is gathered again: the
-- gathering trigger's name sorts before `commands_workflow_due`, and PostgreSQL fires a row's
-- triggers in name order, so in immediate mode a row is gathered before it is enqueued.

CREATE FUNCTION compute_note_workflow_of_command() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    BEGIN
        PERFORM set_config('compute.due_workflows',
            concat_ws(',', nullif(current_setting('compute.due_workflows', true), ''), NEW.workflow_id), true);
        RETURN NULL;
    END
    $$;

CREATE TRIGGER commands_workflow_collected
    AFTER UPDATE OF state ON commands
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION compute_note_workflow_of_command();

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
