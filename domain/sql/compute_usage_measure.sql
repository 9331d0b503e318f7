-- The current definition, as migrations/0016_usage_windows.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_usage_measure(p_allocations text[], p_from timestamptz[], p_to timestamptz[])
    RETURNS TABLE (allocation_id text, window_start timestamptz, window_end timestamptz, reservation_id text,
                   tenant_id text, pool_id text, model text, gpu_kind text, profile text, atoms integer,
                   booked_seconds numeric, gpu_seconds numeric, vcpu_seconds numeric,
                   memory_mib_seconds numeric, disk_gib_seconds numeric)
    LANGUAGE sql STABLE
    AS $$
    WITH pairs AS (
        SELECT * FROM unnest(p_allocations, p_from, p_to) AS q(allocation_id, f, t)
    ), inside AS (
        SELECT q.allocation_id, q.f, q.t, b.atom, b.device_id, b.during * tstzrange(q.f, q.t) AS held
          FROM pairs q
          JOIN device_bookings b ON b.allocation_id = q.allocation_id AND b.during && tstzrange(q.f, q.t)
    ), per AS (
        SELECT i.allocation_id, i.f, i.t,
               string_agg(DISTINCT d.model, '+' ORDER BY d.model) AS model,
               count(DISTINCT i.atom)::integer AS atoms,
               sum(extract(epoch FROM upper(i.held) - lower(i.held))) AS atom_seconds,
               range_agg(i.held) AS held
          FROM inside i JOIN devices d ON d.id = i.device_id
         GROUP BY i.allocation_id, i.f, i.t
    )
    SELECT p.allocation_id, p.f, p.t, a.reservation_id, r.tenant_id, r.pool_id, p.model, a.gpu_kind, a.profile,
           p.atoms, s.secs,
           round(CASE a.gpu_kind
                     WHEN 'gpu' THEN p.atom_seconds
                     WHEN 'mig' THEN p.atom_seconds * coalesce(substring(a.profile FROM '^([0-9]+)g')::integer, 7) / 7
                     ELSE p.atom_seconds / greatest(coalesce(a.slots_per_gpu, 1), 1) END, 6),
           a.vcpu * s.secs, a.memory_mib * s.secs, a.disk_gib * s.secs
      FROM per p
      JOIN allocations a ON a.id = p.allocation_id
      JOIN reservations r ON r.id = a.reservation_id
      CROSS JOIN LATERAL (SELECT coalesce(sum(extract(epoch FROM upper(h) - lower(h))), 0) AS secs
                            FROM unnest(p.held) AS h) s
    $$;
