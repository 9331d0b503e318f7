-- Leases and the work queue: the coordination of worker processes, in rows, not advisory locks
-- (session advisory locks break under transaction pooling, and a row gives a TTL and an epoch).

-- A lease is held by `owner` until `expires_at` (compute_now()); a takeover increments `epoch`.
-- Every fenced transaction starts with SELECT … FOR SHARE on its lease row at the holder's epoch,
-- so a takeover waits for the old holder's transaction, and a zombie either still holds its
-- lease or aborts.
CREATE TABLE leases (
    name       text        PRIMARY KEY
        CONSTRAINT leases_name_format CHECK (name ~ '^(shard:[a-z_]+:[0-9]+|pool:pool_[0-9a-f]{32}|site:site_[0-9a-f]{32}|singleton:[a-z_:0-9a-z_-]+|gateway:[A-Za-z0-9_.-]+)$'),
    owner      text        NOT NULL,
    epoch      bigint      NOT NULL CONSTRAINT leases_epoch CHECK (epoch >= 1),
    expires_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT compute_now()
);

-- Reconcilers are woken through the work queue, enqueued in the transaction that changed the
-- state; a key enqueued again while it runs gets a new `gen` and runs again.
CREATE TABLE work_queue (
    kind          text        NOT NULL CONSTRAINT work_queue_kind CHECK (kind ~ '^[a-z][a-z_]*$'),
    key           text        NOT NULL,
    shard         integer     NOT NULL CONSTRAINT work_queue_shard CHECK (shard >= 0),
    gen           bigint      NOT NULL DEFAULT 1,
    not_before    timestamptz NOT NULL DEFAULT compute_now(),
    claimed_until timestamptz,
    claimed_gen   bigint,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    created_at    timestamptz NOT NULL DEFAULT compute_now(),
    updated_at    timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (kind, key)
);
CREATE INDEX work_queue_due ON work_queue (kind, shard, not_before);
