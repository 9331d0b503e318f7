-- Expiry in batches (issue 36, goal 4: 1,000 reservation reconciles a second on one worker).
-- `compute_expire_reservation` (migrations 0029, 0031) expires one reservation per transaction:
-- every expiry of a tenant locked the same quota rows in turn, and paid its own transaction.
-- A worker that claims a batch of reservation keys now expires every due one among them in one
-- call: the same writes, summed per row over the batch, in the same lock order
-- (docs/database-locks.md): the reservation rows in id order, the quota rows in key order
-- (tenant, scope kind, scope id, resource), the bookings, the `node_resources` rows in (node,
-- resource) order, then each reservation's missed activation (compute_record_activation), its
-- state and its event, in id order. The ids it expired are returned; the others of the batch
-- (not due, or ended otherwise meanwhile) are left to the one-by-one reconcile. A single
-- expiry (`lifecycle::expire`) is a batch of one, so the single-reservation function of
-- migration 0029 is dropped: an expiry's writes and their lock order are written once.
DROP FUNCTION compute_expire_reservation(text, text[], text, text);

CREATE FUNCTION compute_expire_reservations(p_ids text[], p_from text[], p_to text, p_event text)
    RETURNS text[]
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_ids text[];
    v_id  text;
BEGIN
    SELECT array_agg(due.id ORDER BY due.id) INTO v_ids
      FROM (SELECT r.id FROM reservations r
             WHERE r.id = ANY(p_ids) AND r.state = ANY(p_from) AND r.ends_at <= compute_now()
             ORDER BY r.id
               FOR UPDATE) due;
    IF v_ids IS NULL THEN
        RETURN '{}';
    END IF;

    -- Quota back: each row's refunds summed over the batch (each amount read as the one-by-one
    -- expiry reads it, so the sum is exact), the rows locked in key order, then decremented.
    WITH back AS (SELECT r.tenant_id, c->>'scope_kind' AS scope_kind, c->>'scope_id' AS scope_id,
                         c->>'resource' AS resource, sum((c->>'amount')::float8::numeric) AS amount
                    FROM reservations r, jsonb_array_elements(r.charged) c
                   WHERE r.id = ANY(v_ids)
                   GROUP BY 1, 2, 3, 4),
         locked AS (SELECT q.tenant_id, q.scope_kind, q.scope_id, q.resource FROM quota_usage q
                      JOIN back b USING (tenant_id, scope_kind, scope_id, resource)
                     ORDER BY q.tenant_id, q.scope_kind, q.scope_id, q.resource FOR UPDATE OF q)
    UPDATE quota_usage q SET used = q.used - b.amount, version = q.version + 1, updated_at = compute_now()
      FROM back b, locked l
     WHERE q.tenant_id = l.tenant_id AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource
       AND b.tenant_id = l.tenant_id AND b.scope_kind = l.scope_kind AND b.scope_id = l.scope_id AND b.resource = l.resource;

    -- Bookings: those not begun are gone, those running end now.
    WITH mine AS (SELECT id FROM allocations WHERE reservation_id = ANY(v_ids)),
         gone AS (DELETE FROM device_bookings b USING mine
                   WHERE b.allocation_id = mine.id AND lower(b.during) >= compute_now() RETURNING 1)
    UPDATE device_bookings b SET during = tstzrange(lower(b.during), compute_now()) FROM mine
     WHERE b.allocation_id = mine.id AND lower(b.during) < compute_now() AND upper(b.during) > compute_now();

    -- Node scalars back, summed per (node, resource) over the batch, locked in that order.
    WITH back AS (SELECT a.node_id, v.res, sum(v.amount)::bigint AS amount FROM allocations a,
                         LATERAL (VALUES ('vcpu', a.vcpu), ('memory_mib', a.memory_mib), ('disk_gib', a.disk_gib)) v(res, amount)
                   WHERE a.reservation_id = ANY(v_ids) AND a.node_id IS NOT NULL GROUP BY a.node_id, v.res),
         locked AS (SELECT r.node_id, r.resource FROM node_resources r JOIN back b ON b.node_id = r.node_id AND b.res = r.resource
                     ORDER BY r.node_id, r.resource FOR UPDATE OF r)
    UPDATE node_resources r SET allocated = r.allocated - b.amount FROM back b, locked l
     WHERE r.node_id = l.node_id AND r.resource = l.resource AND b.node_id = l.node_id AND b.res = l.resource;

    -- A window no reconciler activated was read as active: its activation first (migration 0031).
    FOR v_id IN SELECT r.id FROM reservations r
                 WHERE r.id = ANY(v_ids) AND r.state = 'scheduled' AND r.starts_at <= compute_now()
                 ORDER BY r.id LOOP
        PERFORM compute_record_activation(v_id);
    END LOOP;

    UPDATE reservations r SET state = p_to, next_attempt_at = NULL, ended_at = r.ends_at,
           version = r.version + 1, updated_at = compute_now()
     WHERE r.id = ANY(v_ids);
    -- Their events, in id order (as compute_expire_reservation, no enqueue of their reconcile).
    PERFORM compute_emit(p_event, r.tenant_id, r.id, compute_reservation_payload(r.id))
       FROM reservations r WHERE r.id = ANY(v_ids) ORDER BY r.id;
    RETURN v_ids;
END
$fn$;
ALTER FUNCTION compute_expire_reservations(text[], text[], text, text) SET enable_seqscan = off;
