-- Trace context across the asynchronous hops (issue 37, section 1). A transaction that runs in a
-- traced span names it in `compute.traceparent` (a W3C `traceparent`, set with `SET LOCAL` by
-- the statement that opens the transaction, or by `compute_create_reservation_call` for the one
-- statement that creates a reservation); every outbox event, work-queue item and command it
-- writes takes it as its column default. The worker that reconciles an item, dispatches a
-- command or delivers an event continues that trace (docs/operations.md, "Traces"). Without
-- tracing the setting is empty and the columns are NULL: nothing else changes.

-- The traceparent of the current transaction, or NULL.
CREATE FUNCTION compute_traceparent()
    RETURNS text
    LANGUAGE sql
    STABLE
    AS $$ SELECT nullif(current_setting('compute.traceparent', true), '') $$;

-- A stable default is evaluated once for the rows already there (NULL) and stored in the
-- catalogue: no table is rewritten.
ALTER TABLE outbox ADD COLUMN traceparent text DEFAULT compute_traceparent()
    CONSTRAINT outbox_traceparent CHECK (length(traceparent) = 55);
ALTER TABLE work_queue ADD COLUMN traceparent text DEFAULT compute_traceparent()
    CONSTRAINT work_queue_traceparent CHECK (length(traceparent) = 55);
ALTER TABLE commands ADD COLUMN traceparent text DEFAULT compute_traceparent()
    CONSTRAINT commands_traceparent CHECK (length(traceparent) = 55);

-- An item enqueued again keeps running once; it continues the trace of its latest enqueue (an
-- enqueue from an untraced transaction keeps the one it had).
CREATE OR REPLACE FUNCTION compute_enqueue(p_kind text, p_keys text[], p_shards integer, p_delay_seconds float8 DEFAULT 0)
    RETURNS integer
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_count integer;
BEGIN
    WITH up AS (
        INSERT INTO work_queue AS w (kind, key, shard, not_before)
        SELECT p_kind, k.key, compute_shard(k.key, p_shards), compute_now() + make_interval(secs => p_delay_seconds)
          FROM (SELECT DISTINCT unnest(p_keys) AS key) k
         WHERE k.key IS NOT NULL
         ORDER BY k.key
        ON CONFLICT (kind, key) DO UPDATE
           SET gen = w.gen + 1, not_before = least(w.not_before, EXCLUDED.not_before), updated_at = compute_now(),
               traceparent = coalesce(EXCLUDED.traceparent, w.traceparent)
        RETURNING 1)
    SELECT count(*)::integer INTO v_count FROM up;
    RETURN v_count;
END
$fn$;

-- The reservation's one statement takes the caller's trace context as its last argument.
DROP FUNCTION compute_create_reservation_call(text, text, text, jsonb, text, text, text, text, timestamptz,
                                              timestamptz, integer, jsonb, numeric, integer, integer, integer,
                                              integer, boolean);

CREATE FUNCTION compute_create_reservation_call(
    p_scope text, p_subject text, p_key text, p_fingerprint jsonb,
    p_tenant text, p_created_by text, p_id text,
    p_pool text, p_starts_at timestamptz, p_ends_at timestamptz, p_grace_seconds integer,
    p_allocations jsonb, p_gpu_charge numeric, p_retry_seconds integer, p_shards integer, p_sample integer,
    p_lock_timeout_ms integer, p_contention_retry boolean, p_traceparent text)
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
                                            p_retry_seconds, p_shards, p_sample);
    RETURN jsonb_build_object('outcome', v_outcome,
                              'reservation', compute_reservation_json(v_outcome->>'reservationId'));
END
$fn$;
