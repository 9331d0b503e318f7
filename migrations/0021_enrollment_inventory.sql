-- A machine joins the fleet by itself (docs/nodes.md, "Enrollment"): an operator makes a one-time
-- join token for a pool; `compute-agent join` sends the token and the machine's inventory over
-- /agent; the node is registered from the inventory in the transaction that uses the token, and
-- the daemon receives a node credential. Secrets are stored only as SHA-256 digests.
--
-- Then every session's inventory is compared with the registration (`InventoryMismatch`), and
-- the daemon's GPU health reports set the devices' health.
--
-- Lock order (docs/database-locks.md): node_join_tokens first (the guarded UPDATE that uses a
-- token), then the fleet's order; node_credentials after nodes.

CREATE TABLE node_join_tokens (
    id            text        PRIMARY KEY CONSTRAINT node_join_tokens_id_format CHECK (id ~ '^njt_[0-9a-f]{32}$'),
    pool_id       text        NOT NULL REFERENCES pools (id),
    secret_sha256 bytea       NOT NULL CONSTRAINT node_join_tokens_secret CHECK (octet_length(secret_sha256) = 32),
    -- The labels the joining node is registered with.
    labels        jsonb       NOT NULL DEFAULT '{}' CONSTRAINT node_join_tokens_labels CHECK (jsonb_typeof(labels) = 'object'),
    expires_at    timestamptz NOT NULL,
    created_by    text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT compute_now(),
    used_at       timestamptz,
    node_id       text        REFERENCES nodes (id),
    revoked_at    timestamptz,
    revoked_by    text,
    CONSTRAINT node_join_tokens_secret_key UNIQUE (secret_sha256),
    CONSTRAINT node_join_tokens_used CHECK ((used_at IS NULL) = (node_id IS NULL)),
    CONSTRAINT node_join_tokens_used_or_revoked CHECK (used_at IS NULL OR revoked_at IS NULL),
    CONSTRAINT node_join_tokens_revoked CHECK ((revoked_at IS NULL) = (revoked_by IS NULL)),
    CONSTRAINT node_join_tokens_expiry CHECK (expires_at > created_at)
);
CREATE INDEX node_join_tokens_pool ON node_join_tokens (pool_id, id);

-- The credential a joined node opens its sessions with (instead of a JWT). One per node;
-- retiring the node revokes it.
CREATE TABLE node_credentials (
    node_id       text        PRIMARY KEY REFERENCES nodes (id),
    secret_sha256 bytea       NOT NULL CONSTRAINT node_credentials_secret CHECK (octet_length(secret_sha256) = 32),
    created_at    timestamptz NOT NULL DEFAULT compute_now(),
    revoked_at    timestamptz,
    CONSTRAINT node_credentials_secret_key UNIQUE (secret_sha256)
);

-- What the node last reported, and when (the registration is never rewritten from it by itself).
ALTER TABLE nodes
    ADD COLUMN inventory    jsonb CONSTRAINT nodes_inventory CHECK (inventory IS NULL OR jsonb_typeof(inventory) = 'object'),
    ADD COLUMN inventory_at timestamptz;

-- The token's node exists only at the end of the transaction that uses it.
ALTER TABLE node_join_tokens DROP CONSTRAINT node_join_tokens_node_id_fkey,
    ADD CONSTRAINT node_join_tokens_node_id_fkey FOREIGN KEY (node_id) REFERENCES nodes (id) DEFERRABLE INITIALLY DEFERRED;

-- A device out of placement for either of two reasons, kept apart: the operator's quarantine, and
-- a difference between the registration and what the node reports. `quarantined` stays the one
-- flag placement reads (compute_device_schedulable), derived from both.
ALTER TABLE devices RENAME COLUMN quarantined TO operator_quarantined;
ALTER TABLE devices
    ADD COLUMN inventory_mismatch text CONSTRAINT devices_inventory_mismatch CHECK (length(inventory_mismatch) BETWEEN 1 AND 1000),
    ADD COLUMN health_since       timestamptz,
    -- Who set the health: an operator (setDeviceHealth) or the node's own report. A node's
    -- passing report clears only what a node's report set.
    ADD COLUMN health_by          text CONSTRAINT devices_health_by CHECK (health_by IN ('operator', 'node')),
    -- Taken out of the registration for good (retireDevice): its atoms are gone; the row stays
    -- for the bookings and usage that name it.
    ADD COLUMN retired_at         timestamptz,
    ADD COLUMN quarantined        boolean NOT NULL GENERATED ALWAYS AS
        (operator_quarantined OR inventory_mismatch IS NOT NULL OR retired_at IS NOT NULL) STORED;
