-- Topology and gangs (issue 38, section 2).
--
-- Devices carry their topology: the PCI bus id, the NUMA node and the NVLink domain (the GPUs
-- joined by NVLink, named by the daemon's inventory or by the operator). An allocation may ask
-- for its GPUs on one NVLink domain or one NUMA node (`same_nvlink_domain`, `same_numa_node`):
-- `compute_free_atoms` then answers the free atoms of one group of GPUs, the group with the
-- fewest that still has enough (else the largest, whose count says why not). A GPU whose
-- topology is unknown is a group of its own: it never joins another on a guess.
--
-- A reservation of several allocations may be a gang with a rule: colocated on one node
-- (`gang_colocate = 'node'`), on nodes sharing one value of a label (`'label'`, `gang_label`,
-- such as one rack), and/or spread over distinct nodes (`gang_spread`). `compute_place` tries the
-- groups in order, all allocations in a group or none (the block's savepoint), so the exclusion
-- constraint stays the last word and the quota charged by the create covers the whole gang.

ALTER TABLE devices
    ADD COLUMN pci_bus_id text CONSTRAINT devices_pci_bus_id_length CHECK (length(pci_bus_id) BETWEEN 1 AND 64),
    ADD COLUMN numa_node integer CONSTRAINT devices_numa_node_range CHECK (numa_node BETWEEN 0 AND 1023),
    ADD COLUMN nvlink_domain text CONSTRAINT devices_nvlink_domain_length CHECK (length(nvlink_domain) BETWEEN 1 AND 128);

ALTER TABLE allocations
    ADD COLUMN same_nvlink_domain boolean NOT NULL DEFAULT false,
    ADD COLUMN same_numa_node boolean NOT NULL DEFAULT false;

ALTER TABLE reservations
    ADD COLUMN gang_colocate text CONSTRAINT reservations_gang_colocate CHECK (gang_colocate IN ('node', 'label')),
    ADD COLUMN gang_label text CONSTRAINT reservations_gang_label_length CHECK (length(gang_label) BETWEEN 1 AND 63),
    ADD COLUMN gang_spread boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT reservations_gang_label CHECK ((gang_colocate IS NOT DISTINCT FROM 'label') = (gang_label IS NOT NULL)),
    ADD CONSTRAINT reservations_gang_node_not_spread CHECK (NOT (gang_colocate IS NOT DISTINCT FROM 'node' AND gang_spread));

CREATE OR REPLACE FUNCTION compute_free_atoms(p_node text, p_alloc allocations, p_from timestamptz, p_to timestamptz)
    RETURNS text[]
    LANGUAGE plpgsql STABLE
    AS $fn$
DECLARE
    v_free text[];
BEGIN
    IF NOT (p_alloc.same_nvlink_domain OR p_alloc.same_numa_node) THEN
        SELECT array_agg(a.name ORDER BY d.id, a.ordinal) INTO v_free
          FROM devices d JOIN device_atoms a ON a.device_id = d.id
         WHERE d.node_id = p_node AND compute_device_schedulable(d.health, d.quarantined)
           AND a.kind = p_alloc.gpu_kind
           AND (p_alloc.model IS NULL OR d.model = p_alloc.model)
           AND (p_alloc.profile IS NULL OR a.profile = p_alloc.profile)
           AND (p_alloc.slots_per_gpu IS NULL OR (d.layout->>'slots')::int = p_alloc.slots_per_gpu)
           AND a.created_at <= p_from
           AND NOT EXISTS (SELECT 1 FROM device_bookings b
                            WHERE b.atom = a.name AND coalesce(upper(b.during), 'infinity'::timestamptz) >= p_from
                              AND b.during && tstzrange(p_from, p_to));
        RETURN v_free;
    END IF;
    -- Kept together: the free atoms of one group (an NVLink domain, a NUMA node, or both).
    WITH free AS (
        SELECT a.name, d.id AS dev, a.ordinal,
               concat_ws('/', CASE WHEN p_alloc.same_nvlink_domain THEN coalesce('nvl:' || d.nvlink_domain, 'gpu:' || d.id) END,
                              CASE WHEN p_alloc.same_numa_node THEN coalesce('numa:' || d.numa_node, 'gpu:' || d.id) END) AS grp
          FROM devices d JOIN device_atoms a ON a.device_id = d.id
         WHERE d.node_id = p_node AND compute_device_schedulable(d.health, d.quarantined)
           AND a.kind = p_alloc.gpu_kind
           AND (p_alloc.model IS NULL OR d.model = p_alloc.model)
           AND (p_alloc.profile IS NULL OR a.profile = p_alloc.profile)
           AND (p_alloc.slots_per_gpu IS NULL OR (d.layout->>'slots')::int = p_alloc.slots_per_gpu)
           AND a.created_at <= p_from
           AND NOT EXISTS (SELECT 1 FROM device_bookings b
                            WHERE b.atom = a.name AND coalesce(upper(b.during), 'infinity'::timestamptz) >= p_from
                              AND b.during && tstzrange(p_from, p_to))),
    -- The best group by an ordered aggregate, not ORDER BY: compute_place runs with
    -- enable_sort off, and a Sort node's penalty would push the plan's cost past
    -- jit_above_cost (half a second of JIT compilation per call).
    best AS (
        SELECT (array_agg(g.grp ORDER BY g.n < p_alloc.gpu_count,
                                         CASE WHEN g.n >= p_alloc.gpu_count THEN g.n ELSE -g.n END, g.first))[1] AS grp
          FROM (SELECT grp, count(*) AS n, min(dev) AS first FROM free GROUP BY grp) g)
    SELECT array_agg(f.name ORDER BY f.dev, f.ordinal) INTO v_free FROM free f JOIN best b ON b.grp = f.grp;
    RETURN v_free;
END
$fn$;

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
BEGIN
    SELECT p.id, p.name, r.gang_colocate, r.gang_label, r.gang_spread
      INTO v_pool_id, v_pool_name, v_colocate, v_label, v_spread
      FROM pools p JOIN reservations r ON r.pool_id = p.id WHERE r.id = p_id;
    -- A gang colocated on one node or on one value of a label is tried group by group, all its
    -- allocations in a group or none; any other reservation is one group without a restriction.
    -- The groups tried are those a read without locks finds room in (an attempt takes row locks
    -- and may wait on concurrent placements): for a node, every allocation's selector,
    -- tolerations and free GPUs alone, the gang's GPUs and scalars together, in spread order;
    -- for a label, the values with a node that takes each allocation alone, in order. At most
    -- 16 are tried: a gang that lost that many attempts waits for its retry.
    IF v_colocate = 'node' THEN
        v_groups := ARRAY(SELECT n.id FROM nodes n
                           WHERE n.pool_id = v_pool_id AND compute_node_schedulable(n.lifecycle, n.reachability)
                             AND NOT EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = p_id
                                               AND NOT (n.labels @> a.node_selector
                                                        AND (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, a.tolerations))
                                                        AND coalesce(cardinality(compute_free_atoms(n.id, a, p_from, p_to)), 0) >= a.gpu_count))
                             AND (SELECT count(DISTINCT x.atom) FROM allocations a, unnest(compute_free_atoms(n.id, a, p_from, p_to)) AS x(atom)
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
    v_reason := 'none';
    FOREACH v_group IN ARRAY v_groups LOOP
    v_only := CASE WHEN v_colocate = 'node' THEN v_group END;
    v_gang_sel := CASE WHEN v_colocate = 'label' THEN jsonb_build_object(v_label, v_group) ELSE '{}'::jsonb END;
    v_gang_nodes := '{}';
    BEGIN
        FOR v_alloc IN SELECT * FROM allocations WHERE reservation_id = p_id ORDER BY ordinal LOOP
            v_sel := v_alloc.node_selector || v_gang_sel;
            v_excluded := '{}';
            v_lost := '{}';
            LOOP
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
                        AND n.labels @> v_sel
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
                    INSERT INTO device_bookings (atom, device_id, pool_id, allocation_id, during)
                        SELECT a.name, a.device_id, v_pool_id, v_alloc.id, v_window FROM device_atoms a WHERE a.name = ANY(v_atoms)
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
                    v_gang_nodes := v_gang_nodes || v_node;
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

-- The create takes the gang (a new last argument): the old signatures go.
DROP FUNCTION compute_create_reservation_call(text, text, text, jsonb, text, text, text, text, timestamptz, timestamptz, integer,
                                              jsonb, numeric, integer, integer, integer, integer, boolean, text);
DROP FUNCTION compute_create_reservation(text, text, text, jsonb, text, text, text, text, timestamptz, timestamptz, integer,
                                         jsonb, numeric, integer, integer, integer);

CREATE FUNCTION compute_create_reservation(
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
        PERFORM compute_reservation_changed(p_id, 'reservation.' || v_state, p_shards);
        UPDATE idempotency_keys SET response = jsonb_build_object('id', p_id)
         WHERE tenant_id = p_scope AND subject = p_subject AND key = p_key;
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
