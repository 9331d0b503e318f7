-- Outbox retention: rows older than the retention window are pruned from the front of the
-- stream, and this one row remembers how far, so a reader can tell an expired cursor
-- (CURSOR_EXPIRED) from one that simply has nothing new.
CREATE TABLE outbox_retention (
    singleton          boolean     PRIMARY KEY DEFAULT true CONSTRAINT outbox_retention_one_row CHECK (singleton),
    -- Every event at or before (pruned_txid, pruned_seq) may be gone.
    pruned_txid        xid8        NOT NULL DEFAULT '0',
    pruned_seq         bigint      NOT NULL DEFAULT 0,
    pruned_at          timestamptz,
    updated_at         timestamptz NOT NULL DEFAULT compute_now()
);
INSERT INTO outbox_retention DEFAULT VALUES;

COMMENT ON TABLE outbox_retention IS 'How far the front of the outbox has been pruned; cursors at or before it are expired.';
