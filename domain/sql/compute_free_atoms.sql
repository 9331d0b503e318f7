-- The current definition, as migrations/0019_hot_path_lookups.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_free_atoms(p_node text, p_alloc allocations, p_from timestamptz, p_to timestamptz)
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
       AND NOT EXISTS (SELECT 1 FROM device_bookings b
                        WHERE b.atom = a.name AND coalesce(upper(b.during), 'infinity'::timestamptz) >= p_from
                          AND b.during && tstzrange(p_from, p_to));
    RETURN v_free;
END
$fn$;
