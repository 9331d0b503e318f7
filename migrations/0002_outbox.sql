-- Identifiers: prefix, '_', 12 hex digits of milliseconds since the epoch of compute_now(), then
-- 20 random hex digits. The same shape as the ids Rust makes (a UUIDv7 in simple form).
CREATE FUNCTION compute_new_id(p_prefix text) RETURNS text
    LANGUAGE sql VOLATILE
    AS $$
    SELECT p_prefix || '_'
        || lpad(to_hex((extract(epoch FROM compute_now()) * 1000)::bigint), 12, '0')
        || substr(replace(gen_random_uuid()::text, '-', ''), 13, 20)
$$;

-- The transactional outbox. A row is written in the transaction that made the change it
-- describes, so it exists exactly when that change committed. Readers take rows only below
-- pg_snapshot_xmin(pg_current_snapshot()) in (txid, seq) order, so a row that commits late can
-- never appear behind a reader's cursor.
CREATE SEQUENCE outbox_seq AS bigint;

CREATE TABLE outbox (
    txid      xid8        NOT NULL DEFAULT pg_current_xact_id(),
    seq       bigint      NOT NULL DEFAULT nextval('outbox_seq'),
    id        text        NOT NULL,
    type      text        NOT NULL,
    tenant_id text,
    subject   text        NOT NULL,
    data      jsonb       NOT NULL,
    time      timestamptz NOT NULL DEFAULT compute_now(),
    CONSTRAINT outbox_pkey PRIMARY KEY (txid, seq),
    CONSTRAINT outbox_id_key UNIQUE (id),
    CONSTRAINT outbox_type_format CHECK (type ~ '^[a-z][a-z_]*(\.[a-z][a-z_]*)+$'),
    CONSTRAINT outbox_subject_nonempty CHECK (subject <> '')
);

COMMENT ON TABLE outbox IS 'One row per state change, written in the same transaction; tenant_id NULL means a fleet event.';

CREATE INDEX outbox_tenant_cursor ON outbox (tenant_id, txid, seq);
CREATE INDEX outbox_time ON outbox (time);

-- The one function every state change calls, inside its own transaction. Returns the event id.
CREATE FUNCTION compute_emit(p_type text, p_tenant_id text, p_subject text, p_data jsonb)
    RETURNS text
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_id text := compute_new_id('evt');
BEGIN
    INSERT INTO outbox (id, type, tenant_id, subject, data)
        VALUES (v_id, p_type, p_tenant_id, p_subject, p_data);
    -- A poke for readers; delivered at commit, folded with others of the transaction. Readers
    -- also poll, so a lost poke only delays.
    PERFORM pg_notify('compute_outbox', '');
    RETURN v_id;
END
$fn$;
