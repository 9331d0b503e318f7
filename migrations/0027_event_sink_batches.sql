-- Webhook batches (issue 36): a sink may take up to `batch_size` events in one POST, in order,
-- so a receiver that answers slowly still keeps up. 1 (the default) is one event per POST, as
-- before; a batch's body and headers are in docs/webhooks.md.
ALTER TABLE event_sinks
    ADD COLUMN batch_size integer NOT NULL DEFAULT 1
        CONSTRAINT event_sinks_batch_size CHECK (batch_size BETWEEN 1 AND 100);
