-- A usage window keeps the length it began with. `compute_usage_close_batch` computed each
-- batch's window end from the meter's current length, and any worker sets that length when it
-- starts: a change between two batches of one window (more than 500 allocations) measured the
-- rest of the window with the new length (records cut short or stretched; shrunk, the next
-- window's period overlapped this one's and the meter failed at every pass after). A window
-- with a period row takes its end from it; docs/usage.md said so already. A meter the old
-- definition wedged inside a closed period goes on from that period's end.

CREATE OR REPLACE FUNCTION compute_usage_close_batch(p_limit integer, p_grace_seconds integer)
    RETURNS TABLE (window_start timestamptz, window_end timestamptz, written integer, closed boolean, more boolean)
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    m usage_meter%ROWTYPE;
    v_now timestamptz := compute_now();
    v_grace interval := make_interval(secs => p_grace_seconds);
    v_start timestamptz;
    v_end timestamptz;
    v_seen integer;
    v_written integer;
    v_last text;
    v_head_txid xid8;
    v_head_seq bigint;
    v_cover timestamptz;
BEGIN
    SELECT * INTO m FROM usage_meter WHERE id FOR UPDATE;
    IF m.closed_through IS NULL THEN
        -- The first run starts at the window of the oldest booking (or of now), and checks
        -- reservation changes from the present of the outbox on.
        SELECT compute_usage_align(coalesce(min(lower(b.during)), v_now), m.window_seconds) INTO v_start
          FROM device_bookings b WHERE b.allocation_id IS NOT NULL;
        SELECT o.txid, o.seq INTO v_head_txid, v_head_seq FROM outbox o
         WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot()) ORDER BY o.txid DESC, o.seq DESC LIMIT 1;
        UPDATE usage_meter SET closed_through = v_start, checked_txid = coalesce(v_head_txid, '0'::xid8),
               checked_seq = coalesce(v_head_seq, 0), updated_at = v_now WHERE id;
        m.closed_through := v_start;
    END IF;
    v_start := m.closed_through;
    -- A meter the earlier definition left inside a closed period (its window shortened part
    -- way, every pass since refused by the periods' exclusion constraint) goes on from that
    -- period's end. What the shortened window did not bill is not recovered here.
    SELECT p.window_end INTO v_cover FROM usage_periods p
     WHERE p.window_start < v_start AND p.window_end > v_start;
    IF v_cover IS NOT NULL THEN
        UPDATE usage_meter SET closed_through = v_cover, batch_after = '', updated_at = v_now WHERE id;
        v_start := v_cover;
    END IF;
    -- A window some batches of which are written keeps the end they were written with: the
    -- length (`usage_meter.window_seconds`) may have changed since (a worker started with
    -- another `--usage-window-seconds`), and the rest of the window was measured with the new
    -- length (shrunk: records cut short, and the next window overlapped this one's period,
    -- which the exclusion constraint refused at every pass from then on).
    SELECT p.window_end INTO v_end FROM usage_periods p WHERE p.window_start = v_start;
    v_end := coalesce(v_end, v_start + make_interval(secs => m.window_seconds));
    IF v_end + v_grace > v_now THEN
        RETURN QUERY SELECT v_start, v_end, 0, false, false;
        RETURN;
    END IF;
    INSERT INTO usage_periods (window_start, window_end) VALUES (v_start, v_end)
        ON CONFLICT ON CONSTRAINT usage_periods_pkey DO NOTHING;
    -- The batch: the next allocations in id order whose bookings overlap the window.
    WITH chosen AS (
        SELECT array_agg(c.allocation_id ORDER BY c.allocation_id) AS ids, count(*) AS n, max(c.allocation_id) AS last
          FROM (SELECT DISTINCT b.allocation_id FROM device_bookings b
                 WHERE b.allocation_id IS NOT NULL AND upper(b.during) > v_start AND lower(b.during) < v_end
                   AND b.allocation_id > m.batch_after
                 ORDER BY b.allocation_id LIMIT p_limit) c
    ), measured AS (
        SELECT x.* FROM chosen,
               compute_usage_measure(chosen.ids, array_fill(v_start, ARRAY[chosen.n::integer]),
                                     array_fill(v_end, ARRAY[chosen.n::integer])) x
    ), written AS (
        INSERT INTO usage_records AS u (key, kind, seq, allocation_id, reservation_id, tenant_id, pool_id,
                                        window_start, window_end, model, gpu_kind, profile, atoms, booked_seconds,
                                        gpu_seconds, vcpu_seconds, memory_mib_seconds, disk_gib_seconds)
        SELECT 'cmp:' || x.allocation_id || ':' || compute_json_time(v_start), 'window', 0, x.allocation_id,
               x.reservation_id, x.tenant_id, x.pool_id, v_start, v_end, x.model, x.gpu_kind, x.profile, x.atoms,
               x.booked_seconds, x.gpu_seconds, x.vcpu_seconds, x.memory_mib_seconds, x.disk_gib_seconds
          FROM measured x
        -- Belt and braces: a window's record is written once, whoever runs the batch again.
        ON CONFLICT (key) DO NOTHING
        RETURNING u.*
    ), emitted AS (
        SELECT compute_emit('usage.window_closed', w.tenant_id, w.allocation_id, compute_usage_payload(w)) AS id
          FROM written w
    )
    SELECT (SELECT n FROM chosen), (SELECT count(*) FROM emitted), (SELECT last FROM chosen)
      INTO v_seen, v_written, v_last;
    IF v_seen < p_limit THEN
        UPDATE usage_periods p SET closed = true, closed_at = v_now,
               allocations = (SELECT count(*) FROM usage_records r WHERE r.window_start = v_start AND r.seq = 0)
         WHERE p.window_start = v_start;
        UPDATE usage_meter SET closed_through = v_end, batch_after = '', updated_at = v_now WHERE id;
        RETURN QUERY SELECT v_start, v_end, v_written, true,
                            v_end + make_interval(secs => m.window_seconds) + v_grace <= v_now;
    ELSE
        UPDATE usage_meter SET batch_after = v_last, updated_at = v_now WHERE id;
        RETURN QUERY SELECT v_start, v_end, v_written, false, true;
    END IF;
END
$fn$;
