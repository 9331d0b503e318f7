-- createReservation in one round trip (issue 35): one statement in its own implicit transaction
-- instead of `BEGIN`, the call and `COMMIT`, so no backend waits idle in a transaction on the
-- API between them. What the `BEGIN` of a write transaction used to state, the call states
-- itself: READ COMMITTED is checked (it cannot be set once the statement runs), `lock_timeout`
-- and the contention switch (`compute.contention_retry`, migration 0025) are set for the
-- transaction with `set_config(…, true)`. The statement's time is bounded by the connection's
-- `statement_timeout` (the pool's startup parameter, or the role's behind a pooler). It answers
-- the outcome and the reservation as one value, so nothing is read back.
--
-- A request whose client leaves before the answer must not write (a transaction did that by
-- never sending its `COMMIT`): the call names its backend `compute create <reservation id>` in
-- `application_name` for its transaction, and the API cancels a statement it abandons with
-- `pg_cancel_backend` on the backend of that name (`CancelOnDrop` in lifecycle.rs).

CREATE OR REPLACE FUNCTION compute_create_reservation_call(
    p_scope text, p_subject text, p_key text, p_fingerprint jsonb,
    p_tenant text, p_created_by text, p_id text,
    p_pool text, p_starts_at timestamptz, p_ends_at timestamptz, p_grace_seconds integer,
    p_allocations jsonb, p_gpu_charge numeric, p_retry_seconds integer, p_shards integer, p_sample integer,
    p_lock_timeout_ms integer, p_contention_retry boolean)
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
            set_config('application_name', 'compute create ' || p_id, true);
    v_outcome := compute_create_reservation(p_scope, p_subject, p_key, p_fingerprint, p_tenant, p_created_by, p_id,
                                            p_pool, p_starts_at, p_ends_at, p_grace_seconds, p_allocations, p_gpu_charge,
                                            p_retry_seconds, p_shards, p_sample);
    RETURN jsonb_build_object('outcome', v_outcome,
                              'reservation', compute_reservation_json(v_outcome->>'reservationId'));
END
$fn$;
