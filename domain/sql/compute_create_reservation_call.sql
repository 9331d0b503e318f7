-- The current definition, as migrations/0036_topology_and_gangs.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_create_reservation_call(
    p_scope text, p_subject text, p_key text, p_fingerprint jsonb,
    p_tenant text, p_created_by text, p_id text,
    p_pool text, p_starts_at timestamptz, p_ends_at timestamptz, p_grace_seconds integer,
    p_allocations jsonb, p_gpu_charge numeric, p_retry_seconds integer, p_shards integer, p_sample integer,
    p_lock_timeout_ms integer, p_contention_retry boolean, p_traceparent text, p_gang jsonb)
    RETURNS jsonb
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_outcome jsonb;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION USING ERRCODE = '25000',
            MESSAGE = format('compute_create_reservation_call runs at READ COMMITTED, not %s: set the role''s or the database''s default_transaction_isolation back',
                             current_setting('transaction_isolation'));
    END IF;
    PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true),
            set_config('compute.contention_retry', CASE WHEN p_contention_retry THEN 'on' ELSE 'off' END, true),
            set_config('compute.traceparent', coalesce(p_traceparent, ''), true),
            set_config('application_name', 'compute create ' || p_id, true);
    v_outcome := compute_create_reservation(p_scope, p_subject, p_key, p_fingerprint, p_tenant, p_created_by, p_id,
                                            p_pool, p_starts_at, p_ends_at, p_grace_seconds, p_allocations, p_gpu_charge,
                                            p_retry_seconds, p_shards, p_sample, p_gang);
    RETURN jsonb_build_object('outcome', v_outcome,
                              'reservation', compute_reservation_json(v_outcome->>'reservationId'));
END
$fn$;
