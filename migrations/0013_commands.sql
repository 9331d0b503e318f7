-- Commands to node daemons (docs/commands.md): created by operators (runCommand) and by the
-- control plane (apply_spec for a bumped generation), dispatched under a shard lease of the
-- work queue to the node's current session, acknowledged, run and answered by the daemon
-- through its gateway, every daemon-side write carrying `AND session_epoch = $epoch`.
--
-- Lock order (docs/database-locks.md): node_sessions (FOR SHARE when dispatching or recording a
-- daemon's answer, FOR UPDATE when a session opens) before commands; commands of one node in
-- ascending id.

CREATE TABLE commands (
    id              text        PRIMARY KEY CONSTRAINT commands_id CHECK (id LIKE 'cmd\_%'),
    node_id         text        NOT NULL REFERENCES nodes (id),
    kind            text        NOT NULL CONSTRAINT commands_kind CHECK (kind IN
                        ('apply_spec', 'reset_gpu', 'set_mig_layout', 'drain_workloads', 'run_instance', 'stop_instance', 'noop')),
    args            jsonb       NOT NULL DEFAULT '{}'
                        CONSTRAINT commands_args CHECK (jsonb_typeof(args) = 'object' AND octet_length(args::text) <= 16384),
    -- Not dispatched before the daemon reports this spec generation (observedGeneration).
    min_generation  bigint      NOT NULL DEFAULT 0 CONSTRAINT commands_min_generation CHECK (min_generation >= 0),
    -- Whether running it twice is harmless: a daemon that lost its journal gets it again;
    -- otherwise it fails with JOURNAL_RESET.
    retry_safe      boolean     NOT NULL,
    -- UNIQUE per node: `api:<caller>:<key>` for runCommand, `wf:<workflow>:<step>` for a
    -- workflow's step, `spec:<generation>` for apply_spec.
    idempotency_key text        NOT NULL CONSTRAINT commands_idempotency_key CHECK (length(idempotency_key) BETWEEN 1 AND 600),
    state           text        NOT NULL DEFAULT 'pending' CONSTRAINT commands_state CHECK (state IN
                        ('pending', 'dispatched', 'running', 'succeeded', 'failed', 'cancelled')),
    attempts        integer     NOT NULL DEFAULT 0 CONSTRAINT commands_attempts CHECK (attempts >= 0),
    progress        jsonb,
    result          jsonb,
    error_code      text        CONSTRAINT commands_error_code CHECK (error_code ~ '^[A-Z][A-Z_]{0,63}$'),
    error_message   text        CONSTRAINT commands_error_message CHECK (length(error_message) <= 2000),
    -- The session it was (last) dispatched under: its epoch, the daemon's journal, its gateway.
    session_epoch   bigint,
    journal_id      text,
    gateway         text,
    created_by      text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    updated_at      timestamptz NOT NULL DEFAULT compute_now(),
    dispatched_at   timestamptz,
    started_at      timestamptz,
    finished_at     timestamptz,
    version         bigint      NOT NULL DEFAULT 1,
    CONSTRAINT commands_one_per_key UNIQUE (node_id, idempotency_key),
    -- Dispatched and running commands name the session they are in; pending ones none.
    CONSTRAINT commands_session CHECK (
        CASE state WHEN 'pending' THEN session_epoch IS NULL
                   WHEN 'dispatched' THEN session_epoch IS NOT NULL
                   WHEN 'running' THEN session_epoch IS NOT NULL
                   ELSE true END),
    CONSTRAINT commands_failed CHECK ((state = 'failed') = (error_code IS NOT NULL)),
    CONSTRAINT commands_finished CHECK ((state IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL))
);
-- A node's waiting commands, in order (the dispatcher).
CREATE INDEX commands_pending ON commands (node_id, id) WHERE state = 'pending';
-- What a gateway has to push (its poll).
CREATE INDEX commands_to_push ON commands (gateway, node_id) WHERE state = 'dispatched';
-- A node's commands (ComputeNode.commands), newest first.
CREATE INDEX commands_of_node ON commands (node_id, id DESC);
-- The root list filtered by state.
CREATE INDEX commands_by_state ON commands (state, id DESC);

-- The channel a dispatcher pokes, with the gateway's id as payload, after it dispatched a
-- command to a session that gateway holds. A lost poke only delays: gateways also poll.
-- (pg_notify inside the dispatch transaction, delivered at its commit.)

-- A node whose spec generation moved (a mode or layout change) or that was retired needs its
-- commands looked at: the dispatcher turns a bumped generation into an apply_spec command and
-- fails the commands of a retired node. Deferred to the commit, so the work_queue row is the
-- last lock the changing transaction takes (docs/database-locks.md). 8 is
-- compute_domain::work_queue::SHARDS.
CREATE FUNCTION compute_enqueue_node_commands() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
    BEGIN
        PERFORM compute_enqueue('node_commands', ARRAY[NEW.id], 8, 0);
        RETURN NULL;
    END
    $$;

CREATE CONSTRAINT TRIGGER nodes_commands_due
    AFTER UPDATE OF generation, retired_at ON nodes
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.generation > OLD.generation OR (NEW.retired_at IS NOT NULL AND OLD.retired_at IS NULL))
    EXECUTE FUNCTION compute_enqueue_node_commands();
