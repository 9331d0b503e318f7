-- The current definition, as migrations/0031_activation_before_any_end.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_record_activation(p_id text)
    RETURNS text
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_tenant text;
BEGIN
    UPDATE reservations r SET state = 'active', version = r.version + 1, updated_at = compute_now()
     WHERE r.id = p_id AND r.state = 'scheduled' AND r.starts_at <= compute_now()
    RETURNING r.tenant_id INTO v_tenant;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN compute_emit('reservation.active', v_tenant, p_id,
                        jsonb_set(compute_reservation_payload(p_id), '{reservation,state}', '"active"'));
END
$fn$;
ALTER FUNCTION compute_record_activation(text) SET enable_seqscan = off;
