-- Webhook sinks and their positions in the outbox. A sink is delivered by the worker holding the
-- lease `singleton:outbox-dispatch:<sink id>`, which saves the sink's position in
-- outbox_cursors after every batch, so a new holder resumes where the last one stopped.
CREATE TABLE event_sinks (
    id              text        PRIMARY KEY CONSTRAINT event_sinks_id_format CHECK (id ~ '^snk_[0-9a-f]{32}$'),
    -- NULL: an operator's sink, which receives every event, fleet events included.
    tenant_id       text        CONSTRAINT event_sinks_tenant CHECK (tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    url             text        NOT NULL CONSTRAINT event_sinks_url CHECK (url ~ '^https?://[^/?#[:space:]]+' AND length(url) <= 2000),
    -- Only these event types; all when empty.
    types           text[]      NOT NULL DEFAULT '{}',
    -- The HMAC-SHA256 signing key, shown to its creator once.
    secret          text        NOT NULL CONSTRAINT event_sinks_secret CHECK (length(secret) >= 32),
    active          boolean     NOT NULL DEFAULT true,
    state           text        NOT NULL DEFAULT 'healthy' CONSTRAINT event_sinks_state CHECK (state IN ('healthy', 'failing', 'behind')),
    failures        integer     NOT NULL DEFAULT 0 CONSTRAINT event_sinks_failures CHECK (failures >= 0),
    next_attempt_at timestamptz,
    last_success_at timestamptz,
    last_error      text,
    last_error_at   timestamptz,
    created_by      text        NOT NULL,
    version         bigint      NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    updated_at      timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX event_sinks_tenant ON event_sinks (tenant_id, id);

CREATE TABLE outbox_cursors (
    sink_id    text        PRIMARY KEY REFERENCES event_sinks (id) ON DELETE CASCADE,
    txid       xid8        NOT NULL,
    seq        bigint      NOT NULL,
    delivered  bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT compute_now()
);

COMMENT ON TABLE outbox_cursors IS 'Each sink''s position in the outbox: after the last event delivered.';
