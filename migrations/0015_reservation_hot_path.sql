-- The reservation hot path in one round trip (issue 15). Before this, creating a reservation sent
-- 22 statements from the API, each a round trip, holding its row locks across all of them, and
-- the candidate search read every booking of the fleet that overlapped the window. Now:
--
-- * compute_create_reservation() is the whole create: the idempotency claim, the quota charge,
--   the rows, placement, the outbox event, the work queue and the key's response, in the lock
--   order of docs/database-locks.md, called once by the API inside its transaction;
-- * compute_place() places a reservation's allocations (every one or none): a search that looks
--   at the pool's nodes from a random point and stops after a few that fit, probing each atom
--   through the exclusion constraint's index, so its cost follows the pool and the request, not
--   the fleet's bookings; when nothing fits it counts why, node by node, for the Unschedulable
--   condition;
-- * compute_reservation_changed() writes a reservation's event (its payload built here, the one
--   definition) and wakes its reconciler, for every path that changes a reservation;
-- * compute_emit() no longer calls pg_notify: a notifying transaction takes a cluster-wide lock at
--   commit, which serialized every write. Processes poke the outbox readers after they commit
--   (debounced), and the readers also poll (docs/performance.md).
--
-- Errors raised for the API carry SQLSTATEs of class CP (compute_domain::error maps them):
-- CP400 bad input (DETAIL names the field), CP404 not found, CPQE0 quota exceeded,
-- CPKR0 idempotency key reused, CPIP0 idempotency key in progress. CPLR0 is placement's own
-- "lost race", caught inside compute_place().

-- Outbox pokes: readers are woken by the writers' processes after commit (see above).
CREATE OR REPLACE FUNCTION compute_emit(p_type text, p_tenant_id text, p_subject text, p_data jsonb)
    RETURNS text
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_id text := compute_new_id('evt');
BEGIN
    INSERT INTO outbox (id, type, tenant_id, subject, data)
        VALUES (v_id, p_type, p_tenant_id, p_subject, p_data);
    RETURN v_id;
END
$fn$;

-- A timestamp as the Rust side writes it in JSON (chrono's RFC 3339: UTC, 'Z', and 0, 3 or 6
-- fractional digits), so a payload built here reads the same as one built in Rust.
CREATE FUNCTION compute_json_time(p_ts timestamptz) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
    SELECT to_char(p_ts AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
        || CASE WHEN (extract(microseconds FROM p_ts)::bigint % 1000000) = 0 THEN ''
                WHEN (extract(microseconds FROM p_ts)::bigint % 1000) = 0 THEN to_char(p_ts AT TIME ZONE 'UTC', '.MS')
                ELSE to_char(p_ts AT TIME ZONE 'UTC', '.US') END
        || 'Z'
    $$;

-- The reservation.* event payload (compute_domain::events::ReservationPayload, docs/webhooks.md):
-- the one definition.
CREATE FUNCTION compute_reservation_payload(p_id text) RETURNS jsonb
    LANGUAGE plpgsql STABLE
    AS $fn$
DECLARE
    v jsonb;
BEGIN
    -- PL/pgSQL, not SQL: a session keeps its plan (a SQL function's statement is planned again
    -- at every call from another statement, which cost a create 1 ms).
    SELECT jsonb_build_object(
        'reservation', jsonb_build_object(
            'id', r.id, 'tenantId', r.tenant_id, 'createdBy', r.created_by, 'poolId', r.pool_id,
            'state', compute_reservation_state(r.state, r.starts_at, r.ends_at),
            'startsAt', compute_json_time(r.starts_at), 'endsAt', compute_json_time(r.ends_at),
            'endedAt', compute_json_time(r.ended_at),
            'conditions', (SELECT coalesce(jsonb_agg(
                               jsonb_build_object('type', c->'type', 'status', c->'status',
                                                  'reason', coalesce(c->'reason', 'null'), 'message', coalesce(c->'message', 'null'),
                                                  'since', coalesce(c->'since', 'null'))
                               || CASE WHEN jsonb_array_length(coalesce(c->'counts', '[]')) > 0
                                       THEN jsonb_build_object('counts', c->'counts') ELSE '{}' END
                               ORDER BY o), '[]')
                             FROM jsonb_array_elements(r.conditions) WITH ORDINALITY AS x(c, o)),
            'gpuCharge', r.charge_gpu::float8, 'vcpuCharge', r.charge_vcpu, 'memoryMibCharge', r.charge_memory_mib,
            'nextAttemptAt', compute_json_time(r.next_attempt_at), 'version', r.version,
            'createdAt', compute_json_time(r.created_at), 'updatedAt', compute_json_time(r.updated_at)),
        'allocations', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                               'id', a.id, 'ordinal', a.ordinal, 'gpuKind', a.gpu_kind, 'gpuCount', a.gpu_count,
                               'model', a.model, 'profile', a.profile, 'slotsPerGpu', a.slots_per_gpu,
                               'vcpu', a.vcpu, 'memoryMib', a.memory_mib, 'diskGib', a.disk_gib,
                               'nodeSelector', a.node_selector,
                               'tolerations', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                                      'key', t->'key', 'value', coalesce(t->'value', 'null'),
                                                      'effect', coalesce(t->'effect', 'null')) ORDER BY o), '[]')
                                                 FROM jsonb_array_elements(a.tolerations) WITH ORDINALITY AS y(t, o)),
                               'computeNodeId', a.node_id, 'atoms', to_jsonb(a.atoms)) ORDER BY a.ordinal), '[]')
                          FROM allocations a WHERE a.reservation_id = r.id))
      INTO v FROM reservations r WHERE r.id = p_id;
    RETURN v;
END
$fn$;

-- compute_enqueue (migration 0009) as PL/pgSQL, for the same reason: its plan is kept.
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
           SET gen = w.gen + 1, not_before = least(w.not_before, EXCLUDED.not_before), updated_at = compute_now()
        RETURNING 1)
    SELECT count(*)::integer INTO v_count FROM up;
    RETURN v_count;
END
$fn$;

-- A reservation changed: its event (p_type, such as 'reservation.active') with the payload above,
-- and its reconciler looks at it again, in the caller's transaction. Returns the event id.
CREATE FUNCTION compute_reservation_changed(p_id text, p_type text, p_shards integer) RETURNS text
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_event text;
BEGIN
    SELECT compute_emit(p_type, r.tenant_id, r.id, compute_reservation_payload(r.id)) INTO v_event
      FROM reservations r WHERE r.id = p_id;
    PERFORM compute_enqueue('reservation', ARRAY[p_id], p_shards);
    RETURN v_event;
END
$fn$;

-- Where a node sits in placement's walk of its pool: a hash of its id in [0, 1024), so a search
-- that starts at a random point of the walk starts at a random node, whatever the ids look like
-- (they begin with their creation time).
ALTER TABLE nodes ADD COLUMN spread integer NOT NULL GENERATED ALWAYS AS (compute_shard(id, 1024)) STORED;
CREATE INDEX nodes_pool_spread ON nodes (pool_id, spread);

-- The fleet-wide index of booking windows served the old search only.
DROP INDEX device_bookings_during;

-- An amount as people write it: at most six decimals, no trailing zeros (as quota.rs writes it).
CREATE FUNCTION compute_amount_text(p numeric) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT CASE WHEN p::text LIKE '%.%' THEN rtrim(rtrim(round(p, 6)::text, '0'), '.') ELSE p::text END $$;

-- The atoms of node p_node that allocation p_alloc could book over [p_from, p_to): of a
-- schedulable device, of the kind, model, profile and slot count asked for, existing at p_from,
-- and booked by nobody over the window (probed through the exclusion constraint's index on
-- (atom, during)); ordered by GPU, then ordinal; NULL when none. The one definition placement's
-- search and its count of reasons both read. PL/pgSQL so a session keeps its plan (generic:
-- its caller, compute_place, sets plan_cache_mode for the call).
CREATE FUNCTION compute_free_atoms(p_node text, p_alloc allocations, p_from timestamptz, p_to timestamptz)
    RETURNS text[]
    LANGUAGE plpgsql STABLE
    AS $fn$
DECLARE
    v_free text[];
BEGIN
    SELECT array_agg(a.name ORDER BY d.id, a.ordinal) INTO v_free
      FROM devices d JOIN device_atoms a ON a.device_id = d.id
     WHERE d.node_id = p_node AND compute_device_schedulable(d.health, d.quarantined)
       AND a.kind = p_alloc.gpu_kind
       AND (p_alloc.model IS NULL OR d.model = p_alloc.model)
       AND (p_alloc.profile IS NULL OR a.profile = p_alloc.profile)
       AND (p_alloc.slots_per_gpu IS NULL OR (d.layout->>'slots')::int = p_alloc.slots_per_gpu)
       AND a.created_at <= p_from
       AND NOT EXISTS (SELECT 1 FROM device_bookings b WHERE b.atom = a.name AND b.during && tstzrange(p_from, p_to));
    RETURN v_free;
END
$fn$;

-- Places every allocation of reservation p_id over [p_from, p_to), or none.
--
-- For each allocation (in ordinal order), the search walks the pool's nodes from a random point
-- (nodes.spread), keeps the eligible ones (schedulable, labels, hard taints tolerated, not already
-- tried) on which enough matching atoms are free over the window (each atom probed through the
-- exclusion constraint's index on (atom, during)) and whose vCPU, memory and disk fit, and stops
-- after p_sample of them; of those it takes the tightest (fewest free matching atoms), preferring
-- nodes without untolerated PreferNoSchedule taints. The attempt then locks the node and the
-- atoms FOR SHARE (re-checking them), books the atoms (the exclusion constraint is the last
-- word: ON CONFLICT DO NOTHING, and fewer rows than atoms is a lost race), and charges the node's
-- scalars with a guarded update, locking only the rows the request needs. An attempt runs in a
-- block of its own (a savepoint): a lost race, a lock timeout or a deadlock inside it undoes it
-- and the search runs again without that node, at most 3 attempts per allocation.
--
-- When no node fits, one more pass over the pool counts why, node by node (the first reason
-- that rules each node out), and nothing is booked. Returns
--   {"placed": true, "replans": n}
-- or
--   {"placed": false, "replans": n, "condition": {"type": "Unschedulable", …, "counts": [{reason, count}]}}
-- p_describe holds each allocation's request in words (AllocationRequest::describe), by ordinal.
CREATE FUNCTION compute_place(p_id text, p_from timestamptz, p_to timestamptz, p_sample integer, p_describe text[])
    RETURNS jsonb
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_pool       pools%ROWTYPE;
    v_alloc      allocations%ROWTYPE;
    v_window     tstzrange := tstzrange(p_from, p_to);
    v_excluded   text[];
    v_lost       text[];
    v_node       text;
    v_free       text[];
    v_atoms      text[];
    v_n          integer;
    v_need       integer;
    v_replans    integer := 0;
    v_start      integer;
    v_reason     text;
    v_counts     jsonb;
    v_message    text;
    v_total      integer;
    v_what       text;
    v_cand       record;
    v_cand_free  text[];
    v_found      integer;
    v_rank       record;
    v_best       record;
BEGIN
    SELECT p.* INTO v_pool FROM pools p JOIN reservations r ON r.pool_id = p.id WHERE r.id = p_id;
    BEGIN
        FOR v_alloc IN SELECT * FROM allocations WHERE reservation_id = p_id ORDER BY ordinal LOOP
            v_excluded := '{}';
            v_lost := '{}';
            LOOP
                v_start := abs(hashtextextended(v_alloc.id || ':' || cardinality(v_lost), 0) % 1024)::integer;
                v_node := NULL;
                v_found := 0;
                -- A loop over a query is a cursor, planned to return its first rows fast: the
                -- walk reads nodes_pool_spread in order and stops early.
                FOR v_cand IN
                    (SELECT n.id, n.taints FROM nodes n
                      WHERE n.pool_id = v_pool.id AND n.spread >= v_start
                        AND compute_node_schedulable(n.lifecycle, n.reachability) AND n.labels @> v_alloc.node_selector
                        AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, v_alloc.tolerations))
                      ORDER BY n.spread)
                    UNION ALL
                    (SELECT n.id, n.taints FROM nodes n
                      WHERE n.pool_id = v_pool.id AND n.spread < v_start
                        AND compute_node_schedulable(n.lifecycle, n.reachability) AND n.labels @> v_alloc.node_selector
                        AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, v_alloc.tolerations))
                      ORDER BY n.spread)
                LOOP
                    CONTINUE WHEN v_cand.id = ANY(v_excluded);
                    v_cand_free := compute_free_atoms(v_cand.id, v_alloc, p_from, p_to);
                    CONTINUE WHEN coalesce(cardinality(v_cand_free), 0) < v_alloc.gpu_count;
                    CONTINUE WHEN EXISTS (SELECT 1 FROM node_resources r
                                   JOIN (VALUES ('vcpu', v_alloc.vcpu), ('memory_mib', v_alloc.memory_mib), ('disk_gib', v_alloc.disk_gib)) v(res, need)
                                     ON v.res = r.resource AND v.need > 0
                                  WHERE r.node_id = v_cand.id AND r.allocated + v.need > floor(r.allocatable * r.ratio));
                    -- The tightest of those that fit; untolerated PreferNoSchedule taints last;
                    -- ties by a hash of node and allocation.
                    v_rank := ROW(v_cand.taints <> '[]'::jsonb
                                    AND EXISTS (SELECT 1 FROM jsonb_array_elements(v_cand.taints) t WHERE t->>'effect' = 'PreferNoSchedule'
                                                  AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(v_alloc.tolerations) o WHERE o->>'key' = t->>'key')),
                                  cardinality(v_cand_free), md5(v_cand.id || v_alloc.id));
                    IF v_node IS NULL OR v_rank < v_best THEN
                        v_node := v_cand.id;
                        v_free := v_cand_free;
                        v_best := v_rank;
                    END IF;
                    v_found := v_found + 1;
                    EXIT WHEN v_found >= greatest(p_sample, 1);
                END LOOP;
                IF v_node IS NULL THEN
                    v_reason := 'none';
                    EXIT;
                END IF;
                -- Which atoms: MIG instances and slots from the front (partly used GPUs fill
                -- first); whole GPUs from an offset derived from the allocation, so concurrent
                -- placements on one node rarely reach for the same ones.
                v_n := cardinality(v_free);
                v_need := v_alloc.gpu_count;
                IF v_alloc.gpu_kind = 'gpu' AND v_n > v_need THEN
                    v_start := abs(hashtextextended(v_alloc.id, 0) % (v_n - v_need + 1))::integer;
                    v_atoms := v_free[v_start + 1 : v_start + v_need];
                ELSE
                    v_atoms := v_free[1 : v_need];
                END IF;
                BEGIN
                    PERFORM 1 FROM nodes n
                      WHERE n.id = v_node AND compute_node_schedulable(n.lifecycle, n.reachability)
                        AND n.labels @> v_alloc.node_selector
                        AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, v_alloc.tolerations))
                      FOR SHARE;
                    IF NOT FOUND THEN
                        RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'the node changed';
                    END IF;
                    -- An atom made after the window's start (by a mode change that committed
                    -- meanwhile) is not bookable from that start.
                    PERFORM 1 FROM (SELECT a.name FROM device_atoms a JOIN devices d ON d.id = a.device_id
                                     WHERE a.name = ANY(v_atoms) AND d.node_id = v_node
                                       AND compute_device_schedulable(d.health, d.quarantined) AND a.created_at <= p_from
                                     ORDER BY a.name FOR SHARE OF a, d) x;
                    GET DIAGNOSTICS v_n = ROW_COUNT;
                    IF v_n <> v_need THEN
                        RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'a GPU changed';
                    END IF;
                    INSERT INTO device_bookings (atom, device_id, allocation_id, during)
                        SELECT a.name, a.device_id, v_alloc.id, v_window FROM device_atoms a WHERE a.name = ANY(v_atoms)
                        ON CONFLICT DO NOTHING;
                    GET DIAGNOSTICS v_n = ROW_COUNT;
                    IF v_n <> v_need THEN
                        RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'an atom was booked meanwhile';
                    END IF;
                    -- Rows locked in resource order first (an UPDATE locks in its plan's order;
                    -- two orders on one node deadlock); only the resources asked for.
                    WITH want AS (SELECT * FROM (VALUES ('disk_gib', v_alloc.disk_gib), ('memory_mib', v_alloc.memory_mib), ('vcpu', v_alloc.vcpu)) v(res, need)
                                   WHERE v.need > 0),
                         locked AS (SELECT r.node_id, r.resource FROM node_resources r JOIN want w ON w.res = r.resource
                                     WHERE r.node_id = v_node ORDER BY r.resource FOR UPDATE OF r)
                    UPDATE node_resources r SET allocated = r.allocated + w.need
                      FROM locked l, want w
                     WHERE r.node_id = l.node_id AND r.resource = l.resource AND w.res = l.resource
                       AND r.allocated + w.need <= floor(r.allocatable * r.ratio);
                    GET DIAGNOSTICS v_n = ROW_COUNT;
                    IF v_n <> (v_alloc.vcpu > 0)::int + (v_alloc.memory_mib > 0)::int + (v_alloc.disk_gib > 0)::int THEN
                        RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'the node''s vCPU, memory or disk filled up';
                    END IF;
                    UPDATE allocations SET node_id = v_node, atoms = v_atoms WHERE id = v_alloc.id;
                    v_reason := NULL;
                EXCEPTION
                    WHEN SQLSTATE 'CPLR0' THEN
                        GET STACKED DIAGNOSTICS v_reason = MESSAGE_TEXT;
                    WHEN lock_not_available OR deadlock_detected THEN
                        v_reason := 'a lock wait timed out';
                END;
                EXIT WHEN v_reason IS NULL;
                v_replans := v_replans + 1;
                v_lost := v_lost || v_reason;
                v_excluded := v_excluded || v_node;
                IF cardinality(v_lost) >= 3 THEN
                    v_reason := 'lost';
                    EXIT;
                END IF;
            END LOOP;
            IF v_reason IS NOT NULL THEN
                -- Nothing of this reservation stays booked: leave the block (its savepoint).
                RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'unschedulable';
            END IF;
        END LOOP;
    EXCEPTION WHEN SQLSTATE 'CPLR0' THEN
        NULL;
    END;
    IF v_reason IS NULL THEN
        RETURN jsonb_build_object('placed', true, 'replans', v_replans);
    END IF;

    v_what := coalesce(p_describe[v_alloc.ordinal + 1], v_alloc.gpu_count || ' ' || v_alloc.gpu_kind);
    IF v_reason = 'lost' THEN
        v_message := format('%s for %s in pool %s: 3 placement attempts lost races to concurrent changes (%s)',
                            CASE WHEN v_alloc.ordinal > 0 OR EXISTS (SELECT 1 FROM allocations WHERE reservation_id = p_id AND ordinal > 0)
                                 THEN 'allocation ' || v_alloc.ordinal ELSE 'placement' END,
                            v_what, v_pool.name, array_to_string(v_lost, '; '));
        v_counts := jsonb_build_array(jsonb_build_object('reason', 'LostRace', 'count', cardinality(v_lost)));
        RETURN jsonb_build_object('placed', false, 'replans', v_replans,
            'condition', jsonb_build_object('type', 'Unschedulable', 'status', 'True', 'reason', 'LostRace',
                                            'message', v_message, 'since', compute_json_time(compute_now()), 'counts', v_counts));
    END IF;

    -- Why no node of the pool fits, node by node: the first reason that rules each one out.
    SELECT coalesce(jsonb_agg(jsonb_build_object('reason', reason, 'count', n) ORDER BY n DESC, reason), '[]'),
           coalesce(sum(n), 0)
      INTO v_counts, v_total
      FROM (SELECT reason, count(*)::integer AS n FROM (
              SELECT CASE
                WHEN n.id = ANY(v_excluded) THEN 'LostRace'
                WHEN n.lifecycle = 'retired' THEN 'NodeRetired'
                WHEN n.lifecycle = 'cordoned' THEN 'NodeCordoned'
                WHEN n.reachability = 'unreachable' THEN 'NodeUnreachable'
                WHEN n.reachability = 'lost' THEN 'NodeLost'
                WHEN NOT n.labels @> v_alloc.node_selector THEN 'NodeSelectorMismatch'
                WHEN NOT (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, v_alloc.tolerations)) THEN 'TaintNotTolerated'
                WHEN coalesce(cardinality(compute_free_atoms(n.id, v_alloc, p_from, p_to)), 0)
                      < v_alloc.gpu_count THEN 'InsufficientGpus'
                WHEN EXISTS (SELECT 1 FROM node_resources r WHERE r.node_id = n.id AND r.resource = 'vcpu'
                                AND v_alloc.vcpu > 0 AND r.allocated + v_alloc.vcpu > floor(r.allocatable * r.ratio)) THEN 'InsufficientVcpu'
                WHEN EXISTS (SELECT 1 FROM node_resources r WHERE r.node_id = n.id AND r.resource = 'memory_mib'
                                AND v_alloc.memory_mib > 0 AND r.allocated + v_alloc.memory_mib > floor(r.allocatable * r.ratio)) THEN 'InsufficientMemory'
                WHEN EXISTS (SELECT 1 FROM node_resources r WHERE r.node_id = n.id AND r.resource = 'disk_gib'
                                AND v_alloc.disk_gib > 0 AND r.allocated + v_alloc.disk_gib > floor(r.allocatable * r.ratio)) THEN 'InsufficientDisk'
                ELSE 'FreedDuringSearch' END AS reason
                FROM nodes n WHERE n.pool_id = v_pool.id) x
            GROUP BY reason) y;

    SELECT string_agg(CASE c->>'reason'
                WHEN 'LostRace' THEN (c->>'count') || ' lost to concurrent changes'
                WHEN 'NodeRetired' THEN (c->>'count') || ' retired'
                WHEN 'NodeCordoned' THEN (c->>'count') || ' cordoned'
                WHEN 'NodeUnreachable' THEN (c->>'count') || ' unreachable'
                WHEN 'NodeLost' THEN (c->>'count') || ' lost'
                WHEN 'NodeSelectorMismatch' THEN (c->>'count') || ' without the labels asked for'
                WHEN 'TaintNotTolerated' THEN (c->>'count') || ' with an untolerated taint'
                WHEN 'InsufficientGpus' THEN (c->>'count') || ' without ' || v_what || ' free over the window'
                WHEN 'InsufficientVcpu' THEN (c->>'count') || ' short of vCPU'
                WHEN 'InsufficientMemory' THEN (c->>'count') || ' short of memory'
                WHEN 'InsufficientDisk' THEN (c->>'count') || ' short of disk'
                ELSE (c->>'count') || ' freed during the search' END, ', ' ORDER BY o)
      INTO v_message
      FROM jsonb_array_elements(v_counts) WITH ORDINALITY AS x(c, o);

    v_message := format('no schedulable node in pool %s has %s free with %s vCPU, %s MiB of memory and %s GiB of disk%s%s from %s to %s: 0/%s nodes fit%s%s',
        v_pool.name, v_what, v_alloc.vcpu, v_alloc.memory_mib, v_alloc.disk_gib,
        CASE WHEN v_alloc.node_selector = '{}'::jsonb THEN ''
             ELSE ', labels ' || (SELECT string_agg(k || '=' || v, ',' ORDER BY k) FROM jsonb_each_text(v_alloc.node_selector) e(k, v)) END,
        CASE WHEN v_alloc.tolerations = '[]'::jsonb THEN ', without tolerating taints' ELSE '' END,
        compute_json_time(p_from), compute_json_time(p_to), v_total,
        CASE WHEN v_message IS NULL THEN '' ELSE ' (' || v_message || ')' END,
        CASE WHEN cardinality(v_lost) > 0
             THEN format(' after %s lost race%s: %s', cardinality(v_lost), CASE WHEN cardinality(v_lost) = 1 THEN '' ELSE 's' END,
                         array_to_string(v_lost, '; '))
             ELSE '' END);
    IF EXISTS (SELECT 1 FROM allocations WHERE reservation_id = p_id AND ordinal > 0) THEN
        v_message := 'allocation ' || v_alloc.ordinal || ': ' || v_message;
    END IF;
    RETURN jsonb_build_object('placed', false, 'replans', v_replans,
        'condition', jsonb_build_object('type', 'Unschedulable', 'status', 'True', 'reason', 'NoCapacity',
                                        'message', v_message, 'since', compute_json_time(compute_now()), 'counts', v_counts));
END
$fn$;

-- Creates a reservation: the whole of createReservation after its input was checked, in one call.
--
--   p_scope, p_subject, p_key, p_fingerprint: the idempotency key's scope and the request's
--     fingerprint (compute_domain::idempotency);
--   p_tenant, p_created_by, p_id: who it is for, who asked, its id;
--   p_pool, p_starts_at (NULL: now), p_ends_at, p_grace_seconds: where and when;
--   p_allocations: [{id, gpu_kind, gpu_count, model, profile, slots_per_gpu, vcpu, memory_mib,
--     disk_gib, node_selector, tolerations, describe}] in order;
--   p_gpu_charge: the GPUs it charges (model::gpu_charge); p_retry_seconds, p_shards, p_sample.
--
-- Returns {"outcome": "created", "reservationId", "replans"}, {"outcome": "replay",
-- "reservationId"}, or {"outcome": "refused", "error": {code, message}} for a final error, which
-- is then also the key's stored answer (and the transaction holds only the key). Bad input, a
-- key reused or in progress raise (CP400, CPKR0, CPIP0) and the caller rolls back.
--
-- Lock order (docs/database-locks.md): the idempotency key, quota_usage (key order), pools (key
-- share, by the foreign key), nodes FOR SHARE, devices and atoms FOR SHARE, device_bookings,
-- node_resources, work_queue.
CREATE FUNCTION compute_create_reservation(
    p_scope text, p_subject text, p_key text, p_fingerprint jsonb,
    p_tenant text, p_created_by text, p_id text,
    p_pool text, p_starts_at timestamptz, p_ends_at timestamptz, p_grace_seconds integer,
    p_allocations jsonb, p_gpu_charge numeric, p_retry_seconds integer, p_shards integer, p_sample integer)
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
BEGIN
    BEGIN
        INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint)
            VALUES (p_scope, p_subject, p_key, 'createReservation', p_fingerprint)
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
        RETURN jsonb_build_object('outcome', 'replay', 'reservationId', v_stored.response->'reservationId');
    END IF;

    -- The effect, in a block of its own: a final error (not found, over quota) undoes it and is
    -- stored as the key's answer.
    BEGIN
        SELECT compute_now(), p.site_id INTO v_now, v_site FROM pools p WHERE p.id = p_pool;
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
        SELECT coalesce(sum((a->>'vcpu')::bigint), 0), coalesce(sum((a->>'memory_mib')::bigint), 0)
          INTO v_vcpu, v_memory FROM jsonb_array_elements(p_allocations) a;

        -- Quota: every row of the tenant on the pool and its site, locked in key order, charged
        -- all or none by a guarded update (each row re-read at its latest version); a missing row
        -- means no limit there. Fewer charged than locked: over quota.
        v_charged := '[]';
        FOR v_row IN
            WITH want AS (SELECT * FROM (VALUES ('pool', p_pool, 'gpu', p_gpu_charge), ('pool', p_pool, 'vcpu', v_vcpu::numeric),
                                                ('pool', p_pool, 'memory_mib', v_memory::numeric), ('site', v_site, 'gpu', p_gpu_charge),
                                                ('site', v_site, 'vcpu', v_vcpu::numeric), ('site', v_site, 'memory_mib', v_memory::numeric))
                                        w(scope_kind, scope_id, resource, amount)),
                 locked AS (SELECT q.scope_kind, q.scope_id, q.resource FROM quota_usage q
                              JOIN want w USING (scope_kind, scope_id, resource)
                             WHERE q.tenant_id = p_tenant ORDER BY q.scope_kind, q.scope_id, q.resource FOR UPDATE OF q),
                 charged AS (UPDATE quota_usage q SET used = q.used + w.amount, version = q.version + 1, updated_at = compute_now()
                               FROM want w, locked l
                              WHERE q.tenant_id = p_tenant AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource
                                AND w.scope_kind = l.scope_kind AND w.scope_id = l.scope_id AND w.resource = l.resource
                                AND q.used + w.amount <= q.max_amount
                          RETURNING q.scope_kind, q.scope_id, q.resource)
            SELECT l.scope_kind, l.scope_id, l.resource, w.amount, q.used, q.max_amount, c.resource IS NOT NULL AS ok
              FROM locked l
              JOIN want w USING (scope_kind, scope_id, resource)
              JOIN quota_usage q ON q.tenant_id = p_tenant AND q.scope_kind = l.scope_kind AND q.scope_id = l.scope_id AND q.resource = l.resource
              LEFT JOIN charged c ON c.scope_kind = l.scope_kind AND c.scope_id = l.scope_id AND c.resource = l.resource
             ORDER BY l.scope_kind, l.scope_id, l.resource
        LOOP
            IF NOT v_row.ok THEN
                RAISE EXCEPTION USING ERRCODE = 'CPQE0', MESSAGE = format(
                    'quota exceeded: tenant %s would hold %s of its %s %s on %s %s (holds %s, asks %s)',
                    p_tenant, compute_amount_text(v_row.used + v_row.amount), compute_amount_text(v_row.max_amount),
                    CASE v_row.resource WHEN 'gpu' THEN 'GPUs' WHEN 'vcpu' THEN 'vCPU' ELSE 'MiB of memory' END,
                    v_row.scope_kind, v_row.scope_id, compute_amount_text(v_row.used), compute_amount_text(v_row.amount));
            END IF;
            IF v_row.amount > 0 THEN
                v_charged := v_charged || jsonb_build_object('scope_kind', v_row.scope_kind, 'scope_id', v_row.scope_id,
                                                             'resource', v_row.resource, 'amount', v_row.amount::float8);
            END IF;
        END LOOP;

        INSERT INTO reservations (id, tenant_id, created_by, pool_id, state, starts_at, ends_at,
                                  charge_gpu, charge_vcpu, charge_memory_mib, charged)
            VALUES (p_id, p_tenant, p_created_by, p_pool, 'pending', v_start, p_ends_at,
                    p_gpu_charge, v_vcpu, v_memory, v_charged);
        INSERT INTO allocations (id, reservation_id, ordinal, gpu_kind, gpu_count, model, profile, slots_per_gpu,
                                 vcpu, memory_mib, disk_gib, node_selector, tolerations)
            SELECT j->>'id', p_id, (o - 1)::integer, j->>'gpu_kind', (j->>'gpu_count')::integer, j->>'model', j->>'profile',
                   (j->>'slots_per_gpu')::integer, (j->>'vcpu')::bigint, (j->>'memory_mib')::bigint, (j->>'disk_gib')::bigint,
                   j->'node_selector', j->'tolerations'
              FROM jsonb_array_elements(p_allocations) WITH ORDINALITY AS x(j, o);

        v_place := compute_place(p_id, v_start, p_ends_at, p_sample,
                                 ARRAY(SELECT a->>'describe' FROM jsonb_array_elements(p_allocations) WITH ORDINALITY x(a, o) ORDER BY o));
        v_state := CASE WHEN NOT (v_place->>'placed')::boolean THEN 'pending'
                        WHEN v_start <= v_now THEN 'active' ELSE 'scheduled' END;
        UPDATE reservations r
           SET state = v_state,
               conditions = CASE WHEN v_place ? 'condition' THEN jsonb_build_array(v_place->'condition') ELSE '[]' END,
               next_attempt_at = CASE WHEN v_state = 'pending' THEN compute_now() + make_interval(secs => p_retry_seconds) END
         WHERE r.id = p_id;
        PERFORM compute_reservation_changed(p_id, 'reservation.' || v_state, p_shards);
        UPDATE idempotency_keys SET response = jsonb_build_object('reservationId', p_id, 'state', v_state)
         WHERE tenant_id = p_scope AND subject = p_subject AND key = p_key;
        RETURN jsonb_build_object('outcome', 'created', 'reservationId', p_id, 'replans', v_place->'replans');
    EXCEPTION WHEN SQLSTATE 'CP404' OR SQLSTATE 'CPQE0' THEN
        GET STACKED DIAGNOSTICS v_sqlstate = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT;
        v_error := jsonb_build_object('code', CASE v_sqlstate WHEN 'CP404' THEN 'NOT_FOUND' ELSE 'QUOTA_EXCEEDED' END,
                                      'message', v_message);
        UPDATE idempotency_keys SET response = jsonb_build_object('error', v_error)
         WHERE tenant_id = p_scope AND subject = p_subject AND key = p_key;
        RETURN jsonb_build_object('outcome', 'refused', 'error', v_error);
    END;
END
$fn$;

-- The statements of the two hot functions take parameters, and PostgreSQL plans such a statement
-- again at every call while it estimates a custom plan cheaper than the generic one: planning the
-- node walk alone cost 1.9 ms a call, more than running it. Their generic plans are the ones
-- wanted (index scans driven by the parameters), so they are kept (measured: a create went from
-- 8.9 ms to 5.9 ms of server time).
ALTER FUNCTION compute_place(text, timestamptz, timestamptz, integer, text[]) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION compute_create_reservation(text, text, text, jsonb, text, text, text, text, timestamptz, timestamptz, integer,
                                          jsonb, numeric, integer, integer, integer) SET plan_cache_mode = force_generic_plan;
