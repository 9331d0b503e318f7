-- The current definition, as migrations/0028_outbox_subject_causality.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

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
