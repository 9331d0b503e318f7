-- Instances: a tenant's workload on one allocation of its reservation, run as a small workflow
-- of commands (docs/instances.md). The workflow is level-triggered on the work queue (kind
-- `instance`, key: the instance's id); each step's command is keyed `wf:<instance>:<step>` under
-- UNIQUE (node_id, idempotency_key), so a step retried after a crash never sends its command
-- twice.
--
-- Lock order (docs/database-locks.md): the instance row, then commands, then the outbox and the
-- work queue. The triggers below enqueue at commit (deferred), so the work-queue row stays the
-- last lock of the transaction that fires them. 8 is compute_domain::work_queue::SHARDS.

-- The workflow a command is a step of (an instance's id), if any.
ALTER TABLE commands ADD COLUMN workflow_id text;
CREATE INDEX commands_of_workflow ON commands (workflow_id) WHERE workflow_id IS NOT NULL;

CREATE TABLE instances (
    id             text        PRIMARY KEY CONSTRAINT instances_id CHECK (id LIKE 'ins\_%'),
    tenant_id      text        NOT NULL,
    reservation_id text        NOT NULL REFERENCES reservations (id),
    allocation_id  text        NOT NULL REFERENCES allocations (id),
    node_id        text        NOT NULL REFERENCES nodes (id),
    image          text        NOT NULL CONSTRAINT instances_image CHECK (length(image) BETWEEN 1 AND 500),
    command        text[]      NOT NULL DEFAULT '{}' CONSTRAINT instances_command CHECK (cardinality(command) <= 64),
    env            jsonb       NOT NULL DEFAULT '{}'
                       CONSTRAINT instances_env CHECK (jsonb_typeof(env) = 'object' AND octet_length(env::text) <= 16384),
    state          text        NOT NULL DEFAULT 'provisioning' CONSTRAINT instances_state CHECK (state IN
                       ('provisioning', 'running', 'stopping', 'stopped', 'failed')),
    -- stopInstance asked for it to stop (the workflow stops it at its next step).
    stop_requested boolean     NOT NULL DEFAULT false,
    -- Why it stopped or failed, in words.
    reason         text        CONSTRAINT instances_reason CHECK (length(reason) <= 2000),
    created_by     text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT compute_now(),
    updated_at     timestamptz NOT NULL DEFAULT compute_now(),
    started_at     timestamptz,
    stopped_at     timestamptz,
    version        bigint      NOT NULL DEFAULT 1,
    CONSTRAINT instances_ended CHECK ((state IN ('stopped', 'failed')) = (stopped_at IS NOT NULL))
);
-- One live instance per allocation: two would share its GPUs.
CREATE UNIQUE INDEX instances_one_live_per_allocation ON instances (allocation_id)
    WHERE state IN ('provisioning', 'running', 'stopping');
CREATE INDEX instances_of_reservation ON instances (reservation_id);
CREATE INDEX instances_of_tenant ON instances (tenant_id, id);

-- A reservation whose state or window changed wakes its live instances' workflows.
CREATE FUNCTION compute_enqueue_instances_of_reservation() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    BEGIN
        PERFORM compute_enqueue('instance',
            ARRAY(SELECT i.id FROM instances i
                   WHERE i.reservation_id = NEW.id AND i.state IN ('provisioning', 'running', 'stopping')),
            8, 0);
        RETURN NULL;
    END
    $$;

CREATE CONSTRAINT TRIGGER reservations_instances_due
    AFTER UPDATE OF state, starts_at, ends_at ON reservations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.starts_at IS DISTINCT FROM NEW.starts_at
          OR OLD.ends_at IS DISTINCT FROM NEW.ends_at)
    EXECUTE FUNCTION compute_enqueue_instances_of_reservation();

-- A step's command that moved wakes its workflow.
CREATE FUNCTION compute_enqueue_workflow_of_command() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    BEGIN
        PERFORM compute_enqueue('instance', ARRAY[NEW.workflow_id], 8, 0);
        RETURN NULL;
    END
    $$;

CREATE CONSTRAINT TRIGGER commands_workflow_due
    AFTER UPDATE OF state ON commands
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION compute_enqueue_workflow_of_command();
