-- Node daemons' sessions and liveness (docs/nodes.md, docs/agent-protocol.md).
--
-- One row per node in node_sessions: opening a session increments session_epoch; every write a
-- gateway makes for a node carries `AND session_epoch = $epoch` (and the gateway's lease fence
-- is the first statement of its transaction), so a gateway that lost the session or its lease
-- changes nothing. Lock order (docs/database-locks.md): node_sessions before nodes, and across
-- nodes in ascending id.

ALTER TABLE nodes
    -- When reachability last changed; NULL until the first change (then joined_at stands in).
    ADD COLUMN reachability_since timestamptz,
    -- While disconnected: when the node becomes unreachable (40 s plus the grace of why it
    -- disconnected, compute_unreachable_at). NULL for a node that never had a session: it counts
    -- from joined_at.
    ADD COLUMN unreachable_at timestamptz;

CREATE TABLE node_sessions (
    node_id        text        PRIMARY KEY REFERENCES nodes (id),
    session_epoch  bigint      NOT NULL CONSTRAINT node_sessions_epoch CHECK (session_epoch > 0),
    -- The gateway that holds the session (its lease is `gateway:<gateway>`), and the lease's epoch
    -- when the session opened: a takeover of the lease ends the session.
    gateway        text        NOT NULL CONSTRAINT node_sessions_gateway CHECK (length(gateway) BETWEEN 1 AND 200),
    gateway_epoch  bigint      NOT NULL,
    daemon_version text        NOT NULL CONSTRAINT node_sessions_daemon_version CHECK (length(daemon_version) BETWEEN 1 AND 100),
    journal_id     text        NOT NULL CONSTRAINT node_sessions_journal_id CHECK (length(journal_id) BETWEEN 1 AND 100),
    opened_at      timestamptz NOT NULL,
    -- compute_now() minus the age the gateway reported: never in the future.
    last_seen_at   timestamptz NOT NULL,
    closed_at      timestamptz,
    close_reason   text        CONSTRAINT node_sessions_close_reason CHECK (close_reason IN
                       ('daemon_closed', 'silent', 'superseded', 'gateway_lost', 'gateway_stopped', 'node_retired', 'protocol_error')),
    CONSTRAINT node_sessions_closed CHECK ((closed_at IS NULL) = (close_reason IS NULL))
);
-- A gateway's open sessions (its flush, and the reconciler's gateway-loss check).
CREATE INDEX node_sessions_open ON node_sessions (gateway, node_id) WHERE closed_at IS NULL;

-- The liveness reconciler's own pulse: a pass that finds the previous one older than the outage
-- threshold knows the controllers (or the database) were away, and gives disconnected nodes the
-- outage grace from then on.
CREATE TABLE liveness_passes (
    id                  int         PRIMARY KEY CONSTRAINT liveness_passes_one CHECK (id = 1),
    last_pass_at        timestamptz NOT NULL,
    last_outage_at      timestamptz,
    last_outage_seconds float8
);

-- When a node that disconnects now for `reason` becomes unreachable: 40 s without a session, plus
-- 120 s after a gateway loss, and never before 40 s + 5 min after the last outage the liveness
-- reconciler saw (docs/nodes.md).
CREATE FUNCTION compute_unreachable_at(reason text) RETURNS timestamptz
    LANGUAGE sql STABLE
    AS $$
    SELECT greatest(
        compute_now() + interval '40 seconds'
            + CASE WHEN reason = 'gateway_lost' THEN interval '120 seconds' ELSE interval '0' END,
        (SELECT last_outage_at + interval '340 seconds' FROM liveness_passes WHERE id = 1))
    $$;

-- A node's conditions without those of type `kind`.
CREATE FUNCTION compute_conditions_without(conditions jsonb, kind text) RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT coalesce(jsonb_agg(c), '[]'::jsonb) FROM jsonb_array_elements(conditions) c WHERE c->>'type' <> kind
    $$;
