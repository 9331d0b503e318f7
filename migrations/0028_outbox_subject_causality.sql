-- Events of one subject in causal order (docs/consistency.md, "The outbox").
--
-- The outbox is read in (txid, seq) order, and a transaction's xid is taken at its first write
-- or row lock, not at its commit. A transaction that took its xid early and then, in a later
-- statement, acted on a row another transaction had just committed (a dispatcher that fenced
-- first and then dispatched a command created a moment ago) wrote its event under the smaller
-- xid: `command.dispatched` sorted before the `command.created` it followed, for every reader.
--
-- An event's `txid` is now the ordering key: the writer's xid, or the key of the latest event of
-- the same subject its statement can see, whichever is greater. Whatever a transaction read of
-- another's committed work, it can see that work's events too, so a subject's events sort after
-- the events they followed; ties keep the `seq` order, which is taken later by the later event.
-- The key is never below the writer's own xid, so the readers' rule (rows below the snapshot's
-- xmin only) still sees no gap and no reordering, and pruning never reaches a running writer.
CREATE INDEX outbox_subject_key ON outbox (subject, txid);

CREATE OR REPLACE FUNCTION compute_emit(p_type text, p_tenant_id text, p_subject text, p_data jsonb)
    RETURNS text
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_id text := compute_new_id('evt');
BEGIN
    INSERT INTO outbox (txid, id, type, tenant_id, subject, data)
        VALUES (GREATEST(pg_current_xact_id(),
                         (SELECT max(o.txid) FROM outbox o WHERE o.subject = p_subject)),
                v_id, p_type, p_tenant_id, p_subject, p_data);
    RETURN v_id;
END
$fn$;
