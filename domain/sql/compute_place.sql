-- The current definition, as migrations/0047_placement_rechecks_what_was_asked.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_place(p_id text, p_from timestamptz, p_to timestamptz, p_sample integer, p_describe text[])
    RETURNS jsonb
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    v_pool_id    text;
    v_pool_name  text;
    v_colocate   text;
    v_label      text;
    v_spread     boolean;
    v_groups     text[];
    v_group      text;
    v_only       text;
    v_gang_sel   jsonb;
    v_sel        jsonb;
    v_gang_nodes text[];
    v_n_alloc    integer;
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
    v_plan       jsonb;
    v_taken      text[];
    v_planned    text[];
    v_fits       boolean;
    v_grouped    boolean;
BEGIN
    SELECT p.id, p.name, r.gang_colocate, r.gang_label, r.gang_spread
      INTO v_pool_id, v_pool_name, v_colocate, v_label, v_spread
      FROM pools p JOIN reservations r ON r.pool_id = p.id WHERE r.id = p_id;
    -- A gang colocated on one node or on one value of a label is tried group by group, all its
    -- allocations in a group or none; any other reservation is one group without a restriction.
    -- The groups tried are those a read without locks finds room in (an attempt takes row locks
    -- and may wait on concurrent placements): for a node, every allocation's selector,
    -- tolerations and free GPUs alone, the gang's GPUs (each allocation's free atoms, groups
    -- aside: an upper bound, the plan decides) and scalars together, in spread order;
    -- for a label, the values with a node that takes each allocation alone, in order. At most
    -- 16 are tried: a gang that lost that many attempts waits for its retry.
    IF v_colocate = 'node' THEN
        v_groups := ARRAY(SELECT n.id FROM nodes n
                           WHERE n.pool_id = v_pool_id AND compute_node_schedulable(n.lifecycle, n.reachability)
                             AND NOT EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = p_id
                                               AND NOT (n.labels @> a.node_selector
                                                        AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, a.tolerations))
                                                        AND coalesce(cardinality(compute_free_atoms(n.id, a, p_from, p_to)), 0) >= a.gpu_count))
                             AND (SELECT count(DISTINCT x.atom) FROM allocations a, unnest(compute_free_atoms(n.id, a, p_from, p_to, '{}', false)) AS x(atom)
                                   WHERE a.reservation_id = p_id)
                                 >= (SELECT sum(a.gpu_count) FROM allocations a WHERE a.reservation_id = p_id)
                             AND NOT EXISTS (SELECT 1 FROM node_resources r
                                               JOIN (SELECT v.res, sum(v.need) AS need FROM allocations a,
                                                            LATERAL (VALUES ('vcpu', a.vcpu), ('memory_mib', a.memory_mib), ('disk_gib', a.disk_gib)) v(res, need)
                                                      WHERE a.reservation_id = p_id GROUP BY v.res) w ON w.res = r.resource AND w.need > 0
                                              WHERE r.node_id = n.id AND r.allocated + w.need > floor(r.allocatable * r.ratio))
                           ORDER BY n.spread
                           LIMIT 16);
    ELSIF v_colocate = 'label' THEN
        -- Ordered by an aggregate, not ORDER BY (enable_sort is off here: a Sort's penalty
        -- would cost a JIT compilation).
        v_groups := (SELECT (array_agg(DISTINCT v.value ORDER BY v.value))[1:16]
                       FROM (SELECT n.labels->>v_label AS value FROM nodes n
                              WHERE n.pool_id = v_pool_id AND n.labels ? v_label
                                AND compute_node_schedulable(n.lifecycle, n.reachability)) v
                           WHERE NOT EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = p_id
                                               AND NOT EXISTS (SELECT 1 FROM nodes n
                                                                WHERE n.pool_id = v_pool_id AND n.labels->>v_label = v.value
                                                                  AND compute_node_schedulable(n.lifecycle, n.reachability)
                                                                  AND n.labels @> a.node_selector
                                                                  AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, a.tolerations))
                                                                  AND coalesce(cardinality(compute_free_atoms(n.id, a, p_from, p_to)), 0) >= a.gpu_count)));
        v_groups := coalesce(v_groups, '{}');
    ELSE
        v_groups := ARRAY[NULL::text];
    END IF;
    -- Each group is tried in two steps, so that an attempt takes its locks in key order
    -- (docs/database-locks.md) however many allocations and nodes it has: first a plan, without
    -- locks: each allocation in turn gets a node and atoms, the atoms and scalars the plan
    -- already took counted as used; then one attempt for the whole plan, in a block of its own:
    -- the nodes `FOR SHARE` in id order, the atoms and devices in atom order, the bookings, the
    -- `node_resources` rows in (node, resource) order. An attempt that loses (a node, GPU or
    -- counter changed, an atom was booked meanwhile, a lock wait timed out) is rolled back to
    -- its block and planned again without its nodes, at most three times.
    v_reason := 'none';
    FOREACH v_group IN ARRAY v_groups LOOP
    v_only := CASE WHEN v_colocate = 'node' THEN v_group END;
    v_gang_sel := CASE WHEN v_colocate = 'label' THEN jsonb_build_object(v_label, v_group) ELSE '{}'::jsonb END;
    v_excluded := '{}';
    v_lost := '{}';
    LOOP
        v_plan := '[]';
        v_grouped := false;
        v_taken := '{}';
        v_gang_nodes := '{}';
        v_reason := NULL;
        FOR v_alloc IN SELECT * FROM allocations WHERE reservation_id = p_id ORDER BY ordinal LOOP
            v_sel := v_alloc.node_selector || v_gang_sel;
            v_start := abs(hashtextextended(v_alloc.id || ':' || cardinality(v_lost), 0) % 1024)::integer;
            v_node := NULL;
            v_found := 0;
            -- A loop over a query is a cursor, planned to return its first rows fast: the
            -- walk reads nodes_pool_spread in order and stops early.
            -- A gang on one node reads that node alone (the third branch; the first two are
            -- then left out by their one-time filter).
            FOR v_cand IN
                (SELECT n.id, n.taints FROM nodes n
                  WHERE v_only IS NULL AND n.pool_id = v_pool_id AND n.spread >= v_start
                    AND compute_node_schedulable(n.lifecycle, n.reachability) AND n.labels @> v_sel
                    AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, v_alloc.tolerations))
                  ORDER BY n.spread)
                UNION ALL
                (SELECT n.id, n.taints FROM nodes n
                  WHERE v_only IS NULL AND n.pool_id = v_pool_id AND n.spread < v_start
                    AND compute_node_schedulable(n.lifecycle, n.reachability) AND n.labels @> v_sel
                    AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, v_alloc.tolerations))
                  ORDER BY n.spread)
                UNION ALL
                (SELECT n.id, n.taints FROM nodes n
                  WHERE n.id = v_only AND n.pool_id = v_pool_id
                    AND compute_node_schedulable(n.lifecycle, n.reachability) AND n.labels @> v_sel
                    AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, v_alloc.tolerations)))
            LOOP
                CONTINUE WHEN v_cand.id = ANY(v_excluded);
                -- A spread gang: each allocation on a node none of the others took.
                CONTINUE WHEN v_spread AND v_cand.id = ANY(v_gang_nodes);
                -- Not the atoms the plan already gave another allocation, left out before an
                -- allocation keeping its GPUs together picks its group (after, two such
                -- allocations picked the same group of a node with two, and never fit there).
                v_cand_free := compute_free_atoms(v_cand.id, v_alloc, p_from, p_to, v_taken);
                CONTINUE WHEN coalesce(cardinality(v_cand_free), 0) < v_alloc.gpu_count;
                -- The scalars, with what the plan already put on this node.
                CONTINUE WHEN EXISTS (SELECT 1 FROM node_resources r
                               JOIN (VALUES ('vcpu', v_alloc.vcpu), ('memory_mib', v_alloc.memory_mib), ('disk_gib', v_alloc.disk_gib)) v(res, need)
                                 ON v.res = r.resource AND v.need > 0
                              WHERE r.node_id = v_cand.id
                                AND r.allocated + v.need
                                    + (SELECT coalesce(sum((p->>v.res)::bigint), 0) FROM jsonb_array_elements(v_plan) p
                                        WHERE p->>'node' = v_cand.id)
                                    > floor(r.allocatable * r.ratio));
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
            v_plan := v_plan || jsonb_build_object('alloc', v_alloc.id, 'node', v_node, 'atoms', to_jsonb(v_atoms),
                                                   'sel', v_sel, 'tolerations', v_alloc.tolerations,
                                                   'vcpu', v_alloc.vcpu, 'memory_mib', v_alloc.memory_mib, 'disk_gib', v_alloc.disk_gib,
                                                   'kind', v_alloc.gpu_kind, 'model', v_alloc.model, 'profile', v_alloc.profile,
                                                   'slots', v_alloc.slots_per_gpu,
                                                   'nvl', v_alloc.same_nvlink_domain, 'numa', v_alloc.same_numa_node);
            v_taken := v_taken || v_atoms;
            v_grouped := v_grouped OR v_alloc.same_nvlink_domain OR v_alloc.same_numa_node;
            v_gang_nodes := v_gang_nodes || v_node;
        END LOOP;
        -- No node for an allocation: this group cannot take the reservation.
        EXIT WHEN v_reason IS NOT NULL;
        v_planned := ARRAY(SELECT DISTINCT p->>'node' FROM jsonb_array_elements(v_plan) p);
        BEGIN
            PERFORM 1 FROM nodes n WHERE n.id = ANY(v_planned) ORDER BY n.id FOR SHARE;
            IF EXISTS (SELECT 1 FROM jsonb_array_elements(v_plan) p JOIN nodes n ON n.id = p->>'node'
                        WHERE NOT (compute_node_schedulable(n.lifecycle, n.reachability) AND n.labels @> (p->'sel')
                                   AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, p->'tolerations')))) THEN
                RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'the node changed';
            END IF;
            -- An atom made after the window's start (by a mode change that committed
            -- meanwhile) is not bookable from that start; a GPU whose model, kind, profile or
            -- layout changed (an accepted inventory) no longer matches what was asked for.
            PERFORM 1 FROM (SELECT a.name FROM device_atoms a JOIN devices d ON d.id = a.device_id
                              JOIN (SELECT p->>'node' AS node, p->>'kind' AS kind, p->>'model' AS model,
                                           p->>'profile' AS profile, (p->>'slots')::integer AS slots, x.atom
                                      FROM jsonb_array_elements(v_plan) p,
                                           jsonb_array_elements_text(p->'atoms') x(atom)) m ON m.atom = a.name AND m.node = d.node_id
                             WHERE a.name = ANY(v_taken)
                               AND compute_device_schedulable(d.health, d.quarantined) AND a.created_at <= p_from
                               AND a.kind = m.kind AND (m.model IS NULL OR d.model = m.model)
                               AND (m.profile IS NULL OR a.profile = m.profile)
                               AND (m.slots IS NULL OR (d.layout->>'slots')::integer = m.slots)
                             ORDER BY a.name FOR SHARE OF a, d) x;
            GET DIAGNOSTICS v_n = ROW_COUNT;
            IF v_n <> cardinality(v_taken) THEN
                RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'a GPU changed';
            END IF;
            -- An allocation that keeps its GPUs together still has them in one NVLink domain or
            -- NUMA node, as the locked rows now say (grouped as `compute_free_atoms` groups).
            -- Only a plan with such an allocation runs the statement (the others, most
            -- creates, pay for a variable's test).
            IF v_grouped THEN
                IF EXISTS (SELECT 1 FROM jsonb_array_elements(v_plan) p
                            WHERE ((p->>'nvl')::boolean OR (p->>'numa')::boolean)
                              AND (SELECT min(g.grp) IS DISTINCT FROM max(g.grp)
                                     FROM (SELECT concat_ws('/', CASE WHEN (p->>'nvl')::boolean THEN coalesce('nvl:' || d.nvlink_domain, 'gpu:' || d.id) END,
                                                                 CASE WHEN (p->>'numa')::boolean THEN coalesce('numa:' || d.numa_node, 'gpu:' || d.id) END) AS grp
                                             FROM jsonb_array_elements_text(p->'atoms') x(atom)
                                             JOIN device_atoms a ON a.name = x.atom JOIN devices d ON d.id = a.device_id) g)) THEN
                    RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'a GPU''s NVLink domain or NUMA node changed';
                END IF;
            END IF;
            -- In atom order, as the atoms were locked: two placements that chose some of the
            -- same atoms wait for each other at the first (the join's order was the plan's,
            -- allocation by allocation, and two orders could deadlock on the exclusion
            -- constraint's waits).
            INSERT INTO device_bookings (atom, device_id, pool_id, allocation_id, during)
                SELECT a.name, a.device_id, v_pool_id, m.alloc, v_window
                  FROM device_atoms a
                  JOIN (SELECT p->>'alloc' AS alloc, x.atom FROM jsonb_array_elements(v_plan) p,
                               jsonb_array_elements_text(p->'atoms') x(atom)) m ON m.atom = a.name
                 WHERE a.name = ANY(v_taken)
                 ORDER BY a.name
                ON CONFLICT DO NOTHING;
            GET DIAGNOSTICS v_n = ROW_COUNT;
            IF v_n <> cardinality(v_taken) THEN
                RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'an atom was booked meanwhile';
            END IF;
            -- Rows locked in (node, resource) order first (an UPDATE locks in its plan's
            -- order; two orders deadlock); only the resources asked for. Every row wanted must
            -- be updated under its guard.
            WITH want AS (SELECT p->>'node' AS node_id, v.res, sum(v.need) AS need
                            FROM jsonb_array_elements(v_plan) p,
                                 LATERAL (VALUES ('disk_gib', (p->>'disk_gib')::bigint), ('memory_mib', (p->>'memory_mib')::bigint),
                                                 ('vcpu', (p->>'vcpu')::bigint)) v(res, need)
                           WHERE v.need > 0
                           GROUP BY p->>'node', v.res),
                 -- Read by the key (`node_id = ANY`), not joined: a join's generic plan reads
                 -- every node's rows.
                 locked AS (SELECT r.node_id, r.resource FROM node_resources r
                             WHERE r.node_id = ANY(v_planned) AND (r.node_id, r.resource) IN (SELECT w.node_id, w.res FROM want w)
                             ORDER BY r.node_id, r.resource FOR UPDATE OF r),
                 updated AS (UPDATE node_resources r SET allocated = r.allocated + w.need
                               FROM locked l, want w
                              WHERE r.node_id = ANY(v_planned)
                                AND r.node_id = l.node_id AND r.resource = l.resource AND w.node_id = l.node_id AND w.res = l.resource
                                AND r.allocated + w.need <= floor(r.allocatable * r.ratio)
                             RETURNING 1)
            SELECT (SELECT count(*) FROM updated) = (SELECT count(*) FROM want) INTO v_fits;
            IF NOT v_fits THEN
                RAISE EXCEPTION USING ERRCODE = 'CPLR0', MESSAGE = 'the node''s vCPU, memory or disk filled up';
            END IF;
            UPDATE allocations a SET node_id = p->>'node', atoms = ARRAY(SELECT jsonb_array_elements_text(p->'atoms'))
              FROM jsonb_array_elements(v_plan) p
             WHERE a.reservation_id = p_id AND a.id = p->>'alloc';
        EXCEPTION
            WHEN SQLSTATE 'CPLR0' THEN
                GET STACKED DIAGNOSTICS v_reason = MESSAGE_TEXT;
            WHEN lock_not_available OR deadlock_detected THEN
                -- The lock-order tests (`Db::without_contention_retry`) say so: a deadlock
                -- fails the call, so an inversion of the order cannot be replanned away.
                IF SQLSTATE = '40P01' AND current_setting('compute.contention_retry', true) = 'off' THEN
                    RAISE;
                END IF;
                v_reason := 'a lock wait timed out';
        END;
        EXIT WHEN v_reason IS NULL;
        v_replans := v_replans + 1;
        v_lost := v_lost || v_reason;
        v_excluded := v_excluded || v_planned;
        IF cardinality(v_lost) >= 3 THEN
            v_reason := 'lost';
            EXIT;
        END IF;
    END LOOP;
    EXIT WHEN v_reason IS NULL OR v_reason = 'lost';
    END LOOP;
    IF v_reason IS NULL THEN
        RETURN jsonb_build_object('placed', true, 'replans', v_replans);
    END IF;

    v_what := coalesce(p_describe[v_alloc.ordinal + 1], v_alloc.gpu_count || ' ' || v_alloc.gpu_kind);
    IF v_reason = 'lost' THEN
        v_message := format('%s for %s in pool %s: 3 placement attempts lost races to concurrent changes (%s)',
                            CASE WHEN v_alloc.ordinal > 0 OR EXISTS (SELECT 1 FROM allocations WHERE reservation_id = p_id AND ordinal > 0)
                                 THEN 'allocation ' || v_alloc.ordinal ELSE 'placement' END,
                            v_what, v_pool_name, array_to_string(v_lost, '; '));
        v_counts := jsonb_build_array(jsonb_build_object('reason', 'LostRace', 'count', cardinality(v_lost)));
        RETURN jsonb_build_object('placed', false, 'replans', v_replans,
            'condition', jsonb_build_object('type', 'Unschedulable', 'status', 'True', 'reason', 'LostRace',
                                            'message', v_message, 'since', compute_json_time(compute_now()), 'counts', v_counts));
    END IF;

    -- Why no node of the pool fits, node by node: the first reason that rules each one out. With
    -- several allocations, for the first that no node takes even alone; when each fits somewhere
    -- alone, they conflict (with each other, or with the gang's rule).
    SELECT count(*) INTO v_n_alloc FROM allocations WHERE reservation_id = p_id;
    FOR v_alloc IN SELECT * FROM allocations a WHERE a.reservation_id = p_id
                     AND (v_n_alloc > 1 OR a.id = v_alloc.id OR v_alloc.id IS NULL) ORDER BY a.ordinal LOOP
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
                FROM nodes n WHERE n.pool_id = v_pool_id) x
            GROUP BY reason) y;
    EXIT WHEN v_n_alloc = 1 OR NOT v_counts @> '[{"reason": "FreedDuringSearch"}]';
    END LOOP;
    v_what := coalesce(p_describe[v_alloc.ordinal + 1], v_alloc.gpu_count || ' ' || v_alloc.gpu_kind);
    IF v_n_alloc > 1 AND v_counts @> '[{"reason": "FreedDuringSearch"}]' THEN
        v_message := format('the %s allocations each fit on some node of pool %s from %s to %s, but never all together%s%s',
            v_n_alloc, v_pool_name, compute_json_time(p_from), compute_json_time(p_to),
            CASE v_colocate WHEN 'node' THEN ' on one node' WHEN 'label' THEN format(' on nodes of one %s', v_label) ELSE '' END,
            CASE WHEN v_spread THEN ', each on a node of its own' ELSE '' END);
        RETURN jsonb_build_object('placed', false, 'replans', v_replans,
            'condition', jsonb_build_object('type', 'Unschedulable', 'status', 'True', 'reason', 'NoCapacity',
                                            'message', v_message, 'since', compute_json_time(compute_now()),
                                            'counts', jsonb_build_array(jsonb_build_object('reason', 'AllocationsConflict', 'count', v_total))));
    END IF;

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
        v_pool_name, v_what, v_alloc.vcpu, v_alloc.memory_mib, v_alloc.disk_gib,
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
ALTER FUNCTION compute_place(text, timestamptz, timestamptz, integer, text[]) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION compute_place(text, timestamptz, timestamptz, integer, text[]) SET enable_seqscan = off;
ALTER FUNCTION compute_place(text, timestamptz, timestamptz, integer, text[]) SET enable_sort = off;
ALTER FUNCTION compute_place(text, timestamptz, timestamptz, integer, text[]) SET enable_bitmapscan = off;
ALTER FUNCTION compute_place(text, timestamptz, timestamptz, integer, text[]) SET jit = off;
