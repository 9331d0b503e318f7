-- The current definition, as migrations/0045_grouped_allocations_share_a_node.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_free_atoms(p_node text, p_alloc allocations, p_from timestamptz, p_to timestamptz,
                                   p_taken text[] DEFAULT '{}', p_grouped boolean DEFAULT true)
    RETURNS text[]
    LANGUAGE plpgsql STABLE
    AS $fn$
DECLARE
    v_free text[];
BEGIN
    IF NOT (p_grouped AND (p_alloc.same_nvlink_domain OR p_alloc.same_numa_node)) THEN
        SELECT array_agg(a.name ORDER BY d.id, a.ordinal) INTO v_free
          FROM devices d JOIN device_atoms a ON a.device_id = d.id
         WHERE d.node_id = p_node AND compute_device_schedulable(d.health, d.quarantined)
           AND a.kind = p_alloc.gpu_kind
           AND (p_alloc.model IS NULL OR d.model = p_alloc.model)
           AND (p_alloc.profile IS NULL OR a.profile = p_alloc.profile)
           AND (p_alloc.slots_per_gpu IS NULL OR (d.layout->>'slots')::int = p_alloc.slots_per_gpu)
           AND a.created_at <= p_from AND a.name <> ALL(p_taken)
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
           AND a.created_at <= p_from AND a.name <> ALL(p_taken)
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
