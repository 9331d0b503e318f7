-- A new limit counts what the tenant already holds. `setQuota` inserted a new quota row with
-- `used` 0, and the reservations made before it were charged nothing on it: a tenant holding 8
-- GPUs on a site given a limit of 4 could take 4 more. Now `setQuota` counts the tenant's live
-- reservations of the scope into the new row and records the charge on each (`charged`, so its
-- end refunds it), under the tenant's quota lock taken exclusive; every create takes it shared
-- before it charges, so no create is in flight while the holdings are counted.
--
-- The rows made before this migration are repaired the same way: every live reservation of a
-- row's scope that the row was not charged for is charged to it now. The live reservations are
-- locked first, in id order, and read at their latest version, so one that a refund ends
-- meanwhile is left out (its refund did not give back what it was never charged). Run it while
-- no API of an older release serves `setQuota` (a row that one makes after the repair starts
-- at 0, as before).

WITH live AS (
    SELECT r.id, r.tenant_id, r.pool_id, r.charged, r.charge_gpu, r.charge_vcpu, r.charge_memory_mib
      FROM reservations r WHERE r.state IN ('pending', 'scheduled', 'active')
     ORDER BY r.id FOR UPDATE),
     missing AS (
    SELECT r.id, q.tenant_id, q.scope_kind, q.scope_id, q.resource,
           CASE q.resource WHEN 'gpu' THEN r.charge_gpu WHEN 'vcpu' THEN r.charge_vcpu::numeric
                           ELSE r.charge_memory_mib::numeric END AS amount
      FROM quota_usage q
      JOIN live r ON r.tenant_id = q.tenant_id
      JOIN pools p ON p.id = r.pool_id
     WHERE CASE q.scope_kind WHEN 'pool' THEN r.pool_id = q.scope_id ELSE p.site_id = q.scope_id END
       AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(r.charged) c
                        WHERE c->>'scope_kind' = q.scope_kind AND c->>'scope_id' = q.scope_id
                          AND c->>'resource' = q.resource)),
     noted AS (
    UPDATE reservations r SET charged = r.charged || m.entries
      FROM (SELECT id, jsonb_agg(jsonb_build_object('scope_kind', scope_kind, 'scope_id', scope_id, 'resource', resource,
                                                    'amount', amount::float8)
                                 ORDER BY scope_kind, scope_id, resource) AS entries
              FROM missing WHERE amount > 0 GROUP BY id) m
     WHERE r.id = m.id)
UPDATE quota_usage q SET used = q.used + s.amount, version = q.version + 1, updated_at = compute_now()
  FROM (SELECT tenant_id, scope_kind, scope_id, resource, sum(amount) AS amount
          FROM missing WHERE amount > 0 GROUP BY tenant_id, scope_kind, scope_id, resource) s
 WHERE q.tenant_id = s.tenant_id AND q.scope_kind = s.scope_kind AND q.scope_id = s.scope_id AND q.resource = s.resource;

CREATE OR REPLACE FUNCTION compute_create_reservation(
    p_scope text, p_subject text, p_key text, p_fingerprint jsonb,
    p_tenant text, p_created_by text, p_id text,
    p_pool text, p_starts_at timestamptz, p_ends_at timestamptz, p_grace_seconds integer,
    p_allocations jsonb, p_gpu_charge numeric, p_retry_seconds integer, p_shards integer, p_sample integer,
    p_gang jsonb)
    RETURNS jsonb
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_claimed  boolean;
    v_stored   record;
    v_now      timestamptz;
    v_site     text;
    v_start    timestamptz;
    v_vcpu     bigint;
    v_memory   bigint;
    v_row      record;
    v_charged  jsonb;
    v_place    jsonb;
    v_state    text;
    v_error    jsonb;
    v_sqlstate text;
    v_message  text;
    v_detail   text;
    v_hint     text;
    v_rules    jsonb;
    v_limit    numeric;
    v_held     numeric;
    v_asked    numeric;
BEGIN
    -- The key goes in with a success's answer: no other transaction sees the row before this
    -- one ends, and a final error below overwrites it with the error.
    BEGIN
        INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint, response)
            VALUES (p_scope, p_subject, p_key, 'createReservation', p_fingerprint, jsonb_build_object('id', p_id))
            ON CONFLICT DO NOTHING RETURNING true INTO v_claimed;
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION USING ERRCODE = 'CPIP0',
            MESSAGE = format('a request with idempotency key `%s` is still running; retry shortly with the same key', p_key);
    END;
    IF v_claimed IS NULL THEN
        SELECT operation = 'createReservation' AND fingerprint = p_fingerprint AS same, response INTO v_stored
          FROM idempotency_keys WHERE tenant_id = p_scope AND subject = p_subject AND key = p_key;
        IF NOT v_stored.same THEN
            RAISE EXCEPTION USING ERRCODE = 'CPKR0',
                MESSAGE = format('idempotency key `%s` was already used with different arguments; use a new key for a new request', p_key);
        ELSIF v_stored.response IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'CPIP0',
                MESSAGE = format('a request with idempotency key `%s` is still running; retry shortly with the same key', p_key);
        ELSIF v_stored.response ? 'error' THEN
            RETURN jsonb_build_object('outcome', 'refused', 'error', v_stored.response->'error');
        END IF;
        -- `reservationId`: an answer the previous binary stored (read until a later migration
        -- drops it; this one converts the rows it finds).
        RETURN jsonb_build_object('outcome', 'replay', 'reservationId',
                                  coalesce(v_stored.response->'id', v_stored.response->'reservationId'));
    END IF;

    -- The effect, in a block of its own: a final error (not found, over quota) undoes it and is
    -- stored as the key's answer.
    BEGIN
        SELECT compute_now(), p.site_id, p.rules INTO v_now, v_site, v_rules FROM pools p WHERE p.id = p_pool;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'CP404', MESSAGE = format('pool %s not found', p_pool);
        END IF;
        v_start := coalesce(p_starts_at, v_now);
        IF v_start < v_now - make_interval(secs => p_grace_seconds) THEN
            RAISE EXCEPTION USING ERRCODE = 'CP400', MESSAGE = '`startsAt` is in the past', DETAIL = 'startsAt';
        END IF;
        IF p_ends_at <= v_start THEN
            RAISE EXCEPTION USING ERRCODE = 'CP400', MESSAGE = '`endsAt` must be after the start', DETAIL = 'endsAt';
        END IF;
        -- The longest window (`reservations::model::MAX_DAYS`), measured from the start the
        -- reservation gets: the API checks it when `startsAt` is given; without it, only here.
        IF p_ends_at - v_start > interval '366 days' THEN
            RAISE EXCEPTION USING ERRCODE = 'CP400', MESSAGE = 'a reservation lasts at most 366 days', DETAIL = 'endsAt';
        END IF;
        -- The furthest start (availability offers none later): a reservation held its quota
        -- and its node's scalars from the create to its end, and kept its GPUs from being
        -- retired or changed, whatever year it named.
        IF v_start - v_now > interval '366 days' THEN
            RAISE EXCEPTION USING ERRCODE = 'CP400', MESSAGE = '`startsAt` is at most 366 days ahead', DETAIL = 'startsAt';
        END IF;

        -- The pool's rules (migration 0034), each only where the pool sets it. A refusal names
        -- the rule (DETAIL) and its limit (HINT, as JSON) and is stored as the key's answer.
        v_limit := (v_rules->>'maxDurationSeconds')::numeric;
        IF v_limit IS NOT NULL AND extract(epoch FROM p_ends_at - v_start) > v_limit THEN
            RAISE EXCEPTION USING ERRCODE = 'CPPV0', DETAIL = 'maxDurationSeconds', HINT = v_limit::text,
                MESSAGE = format('pool %s allows reservations of at most %s seconds; this one would last %s seconds',
                                 p_pool, v_limit, extract(epoch FROM p_ends_at - v_start)::bigint);
        END IF;
        v_limit := (v_rules->>'maxLeadSeconds')::numeric;
        IF v_limit IS NOT NULL AND extract(epoch FROM v_start - v_now) > v_limit THEN
            RAISE EXCEPTION USING ERRCODE = 'CPPV0', DETAIL = 'maxLeadSeconds', HINT = v_limit::text,
                MESSAGE = format('pool %s allows a reservation to start at most %s seconds ahead; this one starts %s seconds ahead',
                                 p_pool, v_limit, extract(epoch FROM v_start - v_now)::bigint);
        END IF;
        v_limit := (v_rules->>'maxFutureGpuHours')::numeric;
        IF v_limit IS NOT NULL THEN
            -- One admission at a time per tenant and pool, so two creates cannot both fit under
            -- the limit with room for one (docs/database-locks.md: the `gpuhours` advisory lock).
            PERFORM pg_advisory_xact_lock(hashtextextended('gpuhours:' || p_tenant || '/' || p_pool, 0));
            v_held := compute_future_gpu_hours(p_tenant, p_pool, NULL, v_now);
            v_asked := p_gpu_charge * extract(epoch FROM p_ends_at - greatest(v_start, v_now)) / 3600;
            IF v_held + v_asked > v_limit THEN
                RAISE EXCEPTION USING ERRCODE = 'CPPV0', DETAIL = 'maxFutureGpuHours', HINT = v_limit::text,
                    MESSAGE = format('pool %s allows a tenant at most %s GPU-hours booked ahead; tenant %s holds %s and asks %s',
                                     p_pool, compute_amount_text(v_limit), p_tenant,
                                     compute_amount_text(round(v_held, 3)), compute_amount_text(round(v_asked, 3)));
            END IF;
        END IF;
        SELECT coalesce(sum((a->>'vcpu')::bigint), 0), coalesce(sum((a->>'memory_mib')::bigint), 0)
          INTO v_vcpu, v_memory FROM jsonb_array_elements(p_allocations) a;

        -- The tenant's quota lock, shared: creates do not wait for each other on it, and a
        -- `setQuota` that makes a new limit (exclusive) counts what the tenant holds with no
        -- create in flight (docs/database-locks.md).
        PERFORM pg_advisory_xact_lock_shared(hashtextextended('quota:' || p_tenant, 0));
        -- Quota: every row of the tenant on the pool and its site that the request asks some of,
        -- locked in key order, charged all or none by a guarded update (each row re-read at its
        -- latest version); a missing row means no limit there. Fewer charged than locked: over
        -- quota. A resource asked none of is not looked at: a limit lowered below what is held
        -- refuses more of that resource, not a request for none of it.
        WITH want AS (SELECT * FROM (VALUES ('pool', p_pool, 'gpu', p_gpu_charge), ('pool', p_pool, 'vcpu', v_vcpu::numeric),
                                            ('pool', p_pool, 'memory_mib', v_memory::numeric), ('site', v_site, 'gpu', p_gpu_charge),
                                            ('site', v_site, 'vcpu', v_vcpu::numeric), ('site', v_site, 'memory_mib', v_memory::numeric))
                                    w(scope_kind, scope_id, resource, amount)
                           WHERE w.amount > 0),
             locked AS (SELECT q.scope_kind, q.scope_id, q.resource FROM quota_usage q
                          JOIN want w USING (scope_kind, scope_id, resource)
                         WHERE q.tenant_id = p_tenant ORDER BY q.scope_kind, q.scope_id, q.resource FOR UPDATE OF q),
             charged AS (UPDATE quota_usage q SET used = q.used + w.amount, version = q.version + 1, updated_at = compute_now()
                           FROM want w, locked l
                          WHERE q.tenant_id = p_tenant AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource
                            AND w.scope_kind = l.scope_kind AND w.scope_id = l.scope_id AND w.resource = l.resource
                            AND q.used + w.amount <= q.max_amount
                      RETURNING q.scope_kind, q.scope_id, q.resource)
        SELECT coalesce(jsonb_agg(jsonb_build_object('scope_kind', l.scope_kind, 'scope_id', l.scope_id,
                                                     'resource', l.resource, 'amount', w.amount::float8)
                                  ORDER BY l.scope_kind, l.scope_id, l.resource) FILTER (WHERE w.amount > 0), '[]') AS charged,
               (array_agg(ROW(l.scope_kind, l.scope_id, l.resource, w.amount, q.used, q.max_amount)::compute_quota_shortfall
                          ORDER BY l.scope_kind, l.scope_id, l.resource) FILTER (WHERE c.resource IS NULL))[1] AS short
          INTO v_row
          FROM locked l
          JOIN want w USING (scope_kind, scope_id, resource)
          JOIN quota_usage q ON q.tenant_id = p_tenant AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource
          LEFT JOIN charged c ON c.scope_kind = l.scope_kind AND c.scope_id = l.scope_id AND c.resource = l.resource;
        IF (v_row.short).resource IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'CPQE0', MESSAGE = format(
                'quota exceeded: tenant %s would hold %s of its %s %s on %s %s (holds %s, asks %s)',
                p_tenant, compute_amount_text((v_row.short).used + (v_row.short).amount), compute_amount_text((v_row.short).max_amount),
                CASE (v_row.short).resource WHEN 'gpu' THEN 'GPUs' WHEN 'vcpu' THEN 'vCPU' ELSE 'MiB of memory' END,
                (v_row.short).scope_kind, (v_row.short).scope_id, compute_amount_text((v_row.short).used),
                compute_amount_text((v_row.short).amount));
        END IF;
        v_charged := v_row.charged;

        -- Written in the state it has once placed (what most creates come to), so a placed create
        -- writes its row once; one left pending is updated after placement.
        v_state := CASE WHEN v_start <= v_now THEN 'active' ELSE 'scheduled' END;
        INSERT INTO reservations (id, tenant_id, created_by, pool_id, state, starts_at, ends_at,
                                  charge_gpu, charge_vcpu, charge_memory_mib, charged, admitted_under,
                                  gang_colocate, gang_label, gang_spread)
            VALUES (p_id, p_tenant, p_created_by, p_pool, v_state, v_start, p_ends_at,
                    p_gpu_charge, v_vcpu, v_memory, v_charged, v_rules,
                    p_gang->>'colocate', p_gang->>'label', coalesce((p_gang->>'spread')::boolean, false));
        INSERT INTO allocations (id, reservation_id, ordinal, gpu_kind, gpu_count, model, profile, slots_per_gpu,
                                 vcpu, memory_mib, disk_gib, node_selector, tolerations, same_nvlink_domain, same_numa_node)
            SELECT j->>'id', p_id, (o - 1)::integer, j->>'gpu_kind', (j->>'gpu_count')::integer, j->>'model', j->>'profile',
                   (j->>'slots_per_gpu')::integer, (j->>'vcpu')::bigint, (j->>'memory_mib')::bigint, (j->>'disk_gib')::bigint,
                   j->'node_selector', j->'tolerations',
                   coalesce((j->>'same_nvlink_domain')::boolean, false), coalesce((j->>'same_numa_node')::boolean, false)
              FROM jsonb_array_elements(p_allocations) WITH ORDINALITY AS x(j, o);

        v_place := compute_place(p_id, v_start, p_ends_at, p_sample,
                                 ARRAY(SELECT a->>'describe' FROM jsonb_array_elements(p_allocations) WITH ORDINALITY x(a, o) ORDER BY o));
        IF NOT (v_place->>'placed')::boolean THEN
            v_state := 'pending';
            UPDATE reservations r
               SET state = v_state, conditions = jsonb_build_array(v_place->'condition'),
                   next_attempt_at = compute_now() + make_interval(secs => p_retry_seconds)
             WHERE r.id = p_id;
        END IF;
        PERFORM compute_emit('reservation.' || v_state, p_tenant, p_id, compute_reservation_payload(p_id)),
                compute_enqueue('reservation', ARRAY[p_id], p_shards);
        RETURN jsonb_build_object('outcome', 'created', 'reservationId', p_id, 'replans', v_place->'replans');
    EXCEPTION WHEN SQLSTATE 'CP404' OR SQLSTATE 'CPQE0' OR SQLSTATE 'CPPV0' THEN
        GET STACKED DIAGNOSTICS v_sqlstate = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT,
                                v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT;
        v_error := jsonb_build_object('code', CASE v_sqlstate WHEN 'CP404' THEN 'NOT_FOUND'
                                                              WHEN 'CPQE0' THEN 'QUOTA_EXCEEDED'
                                                              ELSE 'POLICY_VIOLATION' END,
                                      'message', v_message);
        IF v_sqlstate = 'CPPV0' THEN
            v_error := v_error || jsonb_build_object('rule', v_detail, 'limit', v_hint::numeric);
        END IF;
        UPDATE idempotency_keys SET response = jsonb_build_object('error', v_error)
         WHERE tenant_id = p_scope AND subject = p_subject AND key = p_key;
        RETURN jsonb_build_object('outcome', 'refused', 'error', v_error);
    END;
END
$fn$;
ALTER FUNCTION compute_create_reservation(text, text, text, jsonb, text, text, text, text, timestamptz, timestamptz, integer,
                                          jsonb, numeric, integer, integer, integer, jsonb) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION compute_create_reservation(text, text, text, jsonb, text, text, text, text, timestamptz, timestamptz, integer,
                                          jsonb, numeric, integer, integer, integer, jsonb) SET enable_seqscan = off;
