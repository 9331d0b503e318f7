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
-- the expiry below calls it itself.

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

-- compute_expire_reservation (migration 0029), recording a missed activation first.
CREATE OR REPLACE FUNCTION compute_expire_reservation(p_id text, p_from text[], p_to text, p_event text)
    RETURNS text
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_tenant  text;
    v_charged jsonb;
BEGIN
    SELECT r.tenant_id, r.charged INTO v_tenant, v_charged
      FROM reservations r
     WHERE r.id = p_id AND r.state = ANY(p_from) AND r.ends_at <= compute_now()
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;

    -- Quota back (as quota::refund): the charged rows locked in key order, then decremented.
    WITH back AS (SELECT c->>'scope_kind' AS scope_kind, c->>'scope_id' AS scope_id,
                         c->>'resource' AS resource, (c->>'amount')::float8 AS amount
                    FROM jsonb_array_elements(v_charged) c),
         locked AS (SELECT q.scope_kind, q.scope_id, q.resource FROM quota_usage q
                      JOIN back b USING (scope_kind, scope_id, resource)
                     WHERE q.tenant_id = v_tenant
                     ORDER BY q.scope_kind, q.scope_id, q.resource FOR UPDATE OF q)
    UPDATE quota_usage q SET used = q.used - b.amount::numeric, version = q.version + 1, updated_at = compute_now()
      FROM back b, locked l
     WHERE q.tenant_id = v_tenant AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource
       AND b.scope_kind = l.scope_kind AND b.scope_id = l.scope_id AND b.resource = l.resource;

    -- Bookings: those not begun are gone, those running end now (an expired one ended already).
    WITH mine AS (SELECT id FROM allocations WHERE reservation_id = p_id),
         gone AS (DELETE FROM device_bookings b USING mine
                   WHERE b.allocation_id = mine.id AND lower(b.during) >= compute_now() RETURNING 1)
    UPDATE device_bookings b SET during = tstzrange(lower(b.during), compute_now()) FROM mine
     WHERE b.allocation_id = mine.id AND lower(b.during) < compute_now() AND upper(b.during) > compute_now();

    -- Node scalars back, locked in (node, resource) order as placement locks them.
    WITH back AS (SELECT a.node_id, v.res, sum(v.amount)::bigint AS amount FROM allocations a,
                         LATERAL (VALUES ('vcpu', a.vcpu), ('memory_mib', a.memory_mib), ('disk_gib', a.disk_gib)) v(res, amount)
                   WHERE a.reservation_id = p_id AND a.node_id IS NOT NULL GROUP BY a.node_id, v.res),
         locked AS (SELECT r.node_id, r.resource FROM node_resources r JOIN back b ON b.node_id = r.node_id AND b.res = r.resource
                     ORDER BY r.node_id, r.resource FOR UPDATE OF r)
    UPDATE node_resources r SET allocated = r.allocated - b.amount FROM back b, locked l
     WHERE r.node_id = l.node_id AND r.resource = l.resource AND b.node_id = l.node_id AND b.res = l.resource;

    -- A window that ran without the reconciler activating it was read as active: its activation
    -- is recorded first (compute_record_activation).
    PERFORM compute_record_activation(p_id);
    UPDATE reservations r SET state = p_to, next_attempt_at = NULL, ended_at = r.ends_at,
           version = r.version + 1, updated_at = compute_now()
     WHERE r.id = p_id;
    -- Its event, without `compute_reservation_changed`'s enqueue of its own reconcile: the
    -- caller is that reconcile, and an expired reservation has nothing due again (the instance
    -- teardown is enqueued by the `reservations` trigger of migration 0014).
    RETURN compute_emit(p_event, v_tenant, p_id, compute_reservation_payload(p_id));
END
$fn$;
ALTER FUNCTION compute_expire_reservation(text, text[], text, text) SET enable_seqscan = off;
