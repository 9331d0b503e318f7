-- The state a reader sees and the events a subscriber gets tell one story (issue 37, section 3).
--
-- Reads give a reservation its state as time says (`compute_reservation_state`, migration 0010):
-- a scheduled reservation whose window has started reads `active` before the reconciler moves its
-- stored state and writes `reservation.active`. Released (or failed, or expired) before the
-- reconciler came, it went scheduled -> released in the outbox, while a reader had seen it
-- ACTIVE. Now every transition out of such a reservation first records its activation, in the
-- same transaction and before the transition's own event: the stored state becomes `active` and
-- `reservation.active` is written (its payload saying `active`, whatever time it is now). The
-- reconciler's activation stays the usual path; this catches up only the reservations a
-- transition reaches first. `lifecycle::record_end` calls it for release, cancel and failure;
-- the expiry (`compute_expire_reservations`, migration 0032) calls it itself.

-- Records the activation of reservation `p_id` if its stored state is `scheduled` and its window
-- has started: the stored state `active` and its `reservation.active` event. The event id, or
-- NULL when there was nothing to catch up. The caller holds the reservation's row lock.
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
