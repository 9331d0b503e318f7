-- Usage windows for billing (docs/usage.md). The meter closes fixed windows of time in order;
-- for each window it writes one record per allocation that held devices during it, keyed
-- `cmp:<allocationId>:<windowStart>`, with what the allocation's bookings held inside the window,
-- prorated to the microsecond: GPU-seconds weighted as quotas weigh GPUs, and vCPU-, memory- and
-- disk-seconds. A closed record is never rewritten: a change that lands inside a window already
-- closed is an adjustment record (`cmp:<allocationId>:<windowStart>:adj:<n>`) holding the
-- difference. Each record writes one outbox event in the same transaction.

-- The meter's one row: the window length, how far it has closed, and where it stands in the open
-- window and in the stream of reservation changes it checks closed windows against.
CREATE TABLE usage_meter (
    id             boolean     PRIMARY KEY DEFAULT true CONSTRAINT usage_meter_one_row CHECK (id),
    -- The length of the windows opened from now on (a change applies from the next window).
    window_seconds integer     NOT NULL DEFAULT 3600
        CONSTRAINT usage_meter_window_seconds CHECK (window_seconds BETWEEN 60 AND 86400),
    -- The end of the last closed window: every window before it is closed. NULL until the meter
    -- first runs.
    closed_through timestamptz,
    -- In the open window, the last allocation whose record is written (its batches commit one at
    -- a time, in allocation-id order); '' before the first batch.
    batch_after    text        NOT NULL DEFAULT '',
    -- The outbox position up to which reservation changes were checked against closed windows.
    checked_txid   xid8,
    checked_seq    bigint,
    updated_at     timestamptz NOT NULL DEFAULT compute_now()
);
INSERT INTO usage_meter DEFAULT VALUES;

-- Every window the meter opened, contiguous and never overlapping; `closed` once its last batch
-- is written.
CREATE TABLE usage_periods (
    window_start timestamptz NOT NULL PRIMARY KEY,
    window_end   timestamptz NOT NULL,
    closed       boolean     NOT NULL DEFAULT false,
    -- Allocations billed in the window (its window records), once closed.
    allocations  integer     NOT NULL DEFAULT 0,
    opened_at    timestamptz NOT NULL DEFAULT compute_now(),
    closed_at    timestamptz,
    CONSTRAINT usage_periods_nonempty CHECK (window_end > window_start),
    CONSTRAINT usage_periods_no_overlap EXCLUDE USING gist (tstzrange(window_start, window_end) WITH &&)
);

CREATE TABLE usage_records (
    -- cmp:<allocationId>:<windowStart> for a window's record; …:adj:<n> for its n-th adjustment.
    key                text           PRIMARY KEY,
    kind               text           NOT NULL CONSTRAINT usage_records_kind CHECK (kind IN ('window', 'adjustment')),
    -- 0 for the window's record, n for its n-th adjustment.
    seq                integer        NOT NULL CONSTRAINT usage_records_seq CHECK (seq >= 0),
    -- No foreign keys to allocations and reservations: checking one would take a KEY SHARE lock
    -- on the reservation's row and queue the meter behind every change to it (reservations and
    -- allocations are never deleted).
    allocation_id      text           NOT NULL,
    reservation_id     text           NOT NULL,
    tenant_id          text           NOT NULL,
    pool_id            text           NOT NULL,
    window_start       timestamptz    NOT NULL REFERENCES usage_periods (window_start),
    window_end         timestamptz    NOT NULL,
    -- The GPUs' model ('A100+H100' when an allocation holds GPUs of several models), the kind of
    -- atom, the MIG profile (NULL for other kinds), and how many atoms.
    model              text           NOT NULL,
    gpu_kind           text           NOT NULL CONSTRAINT usage_records_gpu_kind CHECK (gpu_kind IN ('gpu', 'mig', 'slot')),
    profile            text,
    atoms              integer        NOT NULL,
    -- Seconds the allocation held devices inside the window (for an adjustment, the difference).
    booked_seconds     numeric(18, 6) NOT NULL,
    -- GPU-seconds weighted as quotas weigh GPUs: 1 per whole GPU, slices / 7 per MIG instance,
    -- 1 / slots per slot.
    gpu_seconds        numeric(24, 6) NOT NULL,
    vcpu_seconds       numeric(24, 6) NOT NULL,
    memory_mib_seconds numeric(30, 6) NOT NULL,
    disk_gib_seconds   numeric(26, 6) NOT NULL,
    created_at         timestamptz    NOT NULL DEFAULT compute_now(),
    CONSTRAINT usage_records_one_per_seq UNIQUE (allocation_id, window_start, seq),
    CONSTRAINT usage_records_kind_seq CHECK ((kind = 'window') = (seq = 0)),
    -- The key is built one way (compute_json_time() is STABLE, not IMMUTABLE, only because
    -- to_char is; it formats in UTC whatever the session's zone, and a key never changes).
    CONSTRAINT usage_records_key_shape CHECK (
        key = 'cmp:' || allocation_id || ':' || compute_json_time(window_start)
              || CASE WHEN seq = 0 THEN '' ELSE ':adj:' || seq END)
);
CREATE INDEX usage_records_window ON usage_records (window_start, key);
CREATE INDEX usage_records_tenant_window ON usage_records (tenant_id, window_start, key);

-- The meter finds a window's allocations by the bookings that end after the window starts: this
-- index holds the bookings of allocations only (mode-change holds are never billed).
CREATE INDEX device_bookings_billing ON device_bookings (upper(during), allocation_id)
    WHERE allocation_id IS NOT NULL;

-- The start of the window of length p_seconds that holds p_ts, windows aligned on the epoch.
CREATE FUNCTION compute_usage_align(p_ts timestamptz, p_seconds integer) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT to_timestamp(floor(extract(epoch FROM p_ts) / p_seconds) * p_seconds) $$;

-- What each allocation's bookings held inside its window, for pairs of (allocation, window
-- start, window end) given as three arrays: one row per pair whose allocation held something in
-- the window. The one definition of what a window bills, for closing windows and for checking
-- them again; it reads each allocation's bookings through their allocation index. Seconds are
-- exact (timestamps are microseconds; extract() returns numeric); GPU-seconds are the atoms'
-- seconds times their share (as quotas weigh GPUs: 1, compute slices / 7, 1 / slots), rounded
-- once to six decimals.
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

-- The usage.* event payload (compute_domain::events::UsagePayload, docs/webhooks.md): the one
-- definition. Amounts are decimal strings, so no billing system reads them as floats.
CREATE FUNCTION compute_usage_payload(u usage_records) RETURNS jsonb
    LANGUAGE sql STABLE
    AS $$
    SELECT jsonb_build_object('usage', jsonb_build_object(
        'key', u.key, 'kind', u.kind, 'allocationId', u.allocation_id, 'reservationId', u.reservation_id,
        'tenantId', u.tenant_id, 'poolId', u.pool_id,
        'windowStart', compute_json_time(u.window_start), 'windowEnd', compute_json_time(u.window_end),
        'model', u.model, 'gpuKind', u.gpu_kind, 'profile', u.profile, 'atoms', u.atoms,
        'bookedSeconds', compute_amount_text(u.booked_seconds), 'gpuSeconds', compute_amount_text(u.gpu_seconds),
        'vcpuSeconds', compute_amount_text(u.vcpu_seconds), 'memoryMibSeconds', compute_amount_text(u.memory_mib_seconds),
        'diskGibSeconds', compute_amount_text(u.disk_gib_seconds), 'createdAt', compute_json_time(u.created_at)))
    $$;

-- One batch of the meter, in the caller's (fenced) transaction: the open window's next p_limit
-- allocations are measured and their records and events written; the batch that finds fewer
-- closes the window and moves the meter on. A window is due once its end is p_grace in the past
-- (a change made by a transaction that began before the end has committed by then, in all but
-- the longest transactions; the check below catches those). Returns the window worked on, the
-- records written, whether the window closed, and whether more work is due now.
CREATE FUNCTION compute_usage_close_batch(p_limit integer, p_grace_seconds integer)
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
    v_end := v_start + make_interval(secs => m.window_seconds);
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

-- Checks the windows that already have records, or are closed, against the reservation changes
-- committed since the last check (the outbox's reservation.* events, read in commit-safe order,
-- at most p_limit of them): for each changed reservation's allocations, every such window its
-- bookings or records touch is measured again, and where the measure differs from the sum of
-- its records an adjustment record holds the difference (or, for a closed window that had no
-- record of the allocation, its first record). One statement, so the changes read are exactly
-- the ones the meter's position moves past. Returns the records written and whether more
-- changes wait.
CREATE FUNCTION compute_usage_check(p_limit integer)
    RETURNS TABLE (written integer, more boolean)
    LANGUAGE plpgsql
    AS $fn$
DECLARE
    m usage_meter%ROWTYPE;
    v_changes integer;
    v_written integer;
    v_last_txid xid8;
    v_last_seq bigint;
BEGIN
    SELECT * INTO m FROM usage_meter WHERE id FOR UPDATE;
    IF m.closed_through IS NULL THEN
        RETURN QUERY SELECT 0, false;
        RETURN;
    END IF;
    WITH changes AS MATERIALIZED (
        SELECT o.txid, o.seq, o.subject AS reservation_id FROM outbox o
         WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot())
           AND (o.txid, o.seq) > (m.checked_txid, m.checked_seq)
           AND starts_with(o.type, 'reservation.')
         ORDER BY o.txid, o.seq LIMIT p_limit
    ), changed AS (
        SELECT a.id AS allocation_id FROM allocations a
         WHERE a.reservation_id IN (SELECT c.reservation_id FROM changes c)
    ), pairs AS (
        SELECT b.allocation_id, p.window_start, p.window_end
          FROM changed c
          JOIN device_bookings b ON b.allocation_id = c.allocation_id
          JOIN usage_periods p ON p.closed AND tstzrange(p.window_start, p.window_end) && b.during
        UNION
        SELECT r.allocation_id, r.window_start, r.window_end
          FROM usage_records r JOIN changed c ON c.allocation_id = r.allocation_id
    ), measured AS (
        SELECT x.* FROM (SELECT array_agg(allocation_id) AS a, array_agg(window_start) AS f, array_agg(window_end) AS t
                           FROM pairs) q,
               compute_usage_measure(q.a, q.f, q.t) x
    ), recorded AS (
        SELECT r.allocation_id, r.window_start, max(r.seq) AS last_seq, min(r.model) AS model,
               min(r.gpu_kind) AS gpu_kind, min(r.profile) AS profile, max(r.atoms) AS atoms,
               sum(r.booked_seconds) AS booked_seconds, sum(r.gpu_seconds) AS gpu_seconds,
               sum(r.vcpu_seconds) AS vcpu_seconds, sum(r.memory_mib_seconds) AS memory_mib_seconds,
               sum(r.disk_gib_seconds) AS disk_gib_seconds
          FROM usage_records r JOIN pairs p ON p.allocation_id = r.allocation_id AND p.window_start = r.window_start
         GROUP BY r.allocation_id, r.window_start
    ), compared AS (
        SELECT p.allocation_id, p.window_start, p.window_end,
               coalesce(rec.last_seq + 1, 0) AS seq,
               a.reservation_id, rv.tenant_id, rv.pool_id,
               coalesce(x.model, rec.model) AS model, coalesce(x.gpu_kind, rec.gpu_kind) AS gpu_kind,
               coalesce(x.profile, rec.profile) AS profile, coalesce(x.atoms, rec.atoms) AS atoms,
               coalesce(x.booked_seconds, 0) - coalesce(rec.booked_seconds, 0) AS booked_seconds,
               coalesce(x.gpu_seconds, 0) - coalesce(rec.gpu_seconds, 0) AS gpu_seconds,
               coalesce(x.vcpu_seconds, 0) - coalesce(rec.vcpu_seconds, 0) AS vcpu_seconds,
               coalesce(x.memory_mib_seconds, 0) - coalesce(rec.memory_mib_seconds, 0) AS memory_mib_seconds,
               coalesce(x.disk_gib_seconds, 0) - coalesce(rec.disk_gib_seconds, 0) AS disk_gib_seconds
          FROM pairs p
          JOIN allocations a ON a.id = p.allocation_id
          JOIN reservations rv ON rv.id = a.reservation_id
          LEFT JOIN recorded rec ON rec.allocation_id = p.allocation_id AND rec.window_start = p.window_start
          LEFT JOIN measured x ON x.allocation_id = p.allocation_id AND x.window_start = p.window_start
    ), written AS (
        INSERT INTO usage_records AS u (key, kind, seq, allocation_id, reservation_id, tenant_id, pool_id,
                                        window_start, window_end, model, gpu_kind, profile, atoms, booked_seconds,
                                        gpu_seconds, vcpu_seconds, memory_mib_seconds, disk_gib_seconds)
        SELECT 'cmp:' || c.allocation_id || ':' || compute_json_time(c.window_start)
                   || CASE WHEN c.seq = 0 THEN '' ELSE ':adj:' || c.seq END,
               CASE WHEN c.seq = 0 THEN 'window' ELSE 'adjustment' END, c.seq, c.allocation_id,
               c.reservation_id, c.tenant_id, c.pool_id, c.window_start, c.window_end, c.model, c.gpu_kind,
               c.profile, c.atoms, c.booked_seconds, c.gpu_seconds, c.vcpu_seconds, c.memory_mib_seconds,
               c.disk_gib_seconds
          FROM compared c
         WHERE c.model IS NOT NULL
           AND (c.booked_seconds, c.gpu_seconds, c.vcpu_seconds, c.memory_mib_seconds, c.disk_gib_seconds)
               IS DISTINCT FROM (0::numeric, 0::numeric, 0::numeric, 0::numeric, 0::numeric)
        RETURNING u.*
    ), emitted AS (
        SELECT compute_emit(CASE WHEN w.seq = 0 THEN 'usage.window_closed' ELSE 'usage.window_adjusted' END,
                            w.tenant_id, w.allocation_id, compute_usage_payload(w)) AS id
          FROM written w
    )
    SELECT (SELECT count(*) FROM changes), (SELECT count(*) FROM emitted),
           (SELECT c.txid FROM changes c ORDER BY c.txid DESC, c.seq DESC LIMIT 1),
           (SELECT c.seq FROM changes c ORDER BY c.txid DESC, c.seq DESC LIMIT 1)
      INTO v_changes, v_written, v_last_txid, v_last_seq;
    IF v_changes > 0 THEN
        UPDATE usage_meter SET checked_txid = v_last_txid, checked_seq = v_last_seq, updated_at = compute_now()
         WHERE id;
    END IF;
    RETURN QUERY SELECT v_written, v_changes = p_limit;
END
$fn$;
