-- Two costs a create paid in PostgreSQL that nothing needed (issue 15; measured with
-- pg_stat_statements and pg_stat_user_functions, one client, docs/performance.md).
--
-- 1. Keyed lookups stay index lookups.
--
-- compute_reservation_json (migration 0018) and compute_reservation_changed (0015) are called
-- by the API's own statements, so they ran under its connections' settings, not under a caller's
-- `enable_seqscan = off` as the functions of migration 0017 do. Their plan of `reservations WHERE
-- id = $1` was made once per connection: made while the table was small (a new deployment, a
-- test, a benchmark's emptied tables), it was a sequential scan, kept until the next ANALYZE, and
-- each create then read every reservation: 0.27 ms of a create over a run of 3,000 from empty
-- (0.03 ms as an index lookup), growing with the table.
ALTER FUNCTION compute_reservation_json(text) SET enable_seqscan = off;
ALTER FUNCTION compute_reservation_changed(text, text, integer) SET enable_seqscan = off;

-- 2. Placement probes an atom's bookings through a B-tree.
--
-- Whether an atom is free over a window was asked of the exclusion constraint's GiST index on
-- (atom, during). A GiST search tests every entry of each page it visits (btree_gist's text
-- keys, decompressed one by one), where a B-tree descends by binary search: for the 8 atoms of a
-- node it took 0.15 ms, and a create asks it of 2 nodes or more. This index answers the same
-- question in a third of the time (every node of the benchmark's fleet: 190 ms through the GiST
-- index, 55 ms through this one). Its second column bounds the probe to the atom's bookings
-- that end at or after the window's start, so the bookings an atom keeps from the past (usage
-- and billing read them) do not lengthen it. The exclusion constraint stays the last word: a
-- booking is still refused by it, whatever a search saw.
CREATE INDEX device_bookings_atom_until ON device_bookings (atom, coalesce(upper(during), 'infinity'::timestamptz));

-- compute_free_atoms (migration 0015) with the probe's bound: implied by the overlap (a booking
-- that overlaps [p_from, p_to) ends at or after p_from), so the answer is the same.
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
