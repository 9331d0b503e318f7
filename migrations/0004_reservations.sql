-- Reservations: a tenant's claim on GPUs with vCPU, memory and disk, in one pool, for a window.
-- Each allocation is placed on one node; its atoms are booked in device_bookings (whose exclusion
-- constraint makes double-booking impossible) and its scalars counted in node_resources.
-- The quota rows a reservation charged are recorded on it (`charged`), so its refund is exact.

CREATE TABLE reservations (
    id              text           PRIMARY KEY CONSTRAINT reservations_id_format CHECK (id ~ '^rsv_[0-9a-f]{32}$'),
    tenant_id       text           NOT NULL,
    created_by      text           NOT NULL,
    pool_id         text           NOT NULL REFERENCES pools (id),
    state           text           NOT NULL CONSTRAINT reservations_state
        CHECK (state IN ('pending', 'scheduled', 'active', 'released', 'expired', 'cancelled', 'failed')),
    starts_at       timestamptz    NOT NULL,
    ends_at         timestamptz    NOT NULL,
    -- [{"type": "Unschedulable", "status": "True", "reason": …, "message": …, "since": …}]
    conditions      jsonb          NOT NULL DEFAULT '[]',
    charge_gpu      numeric(18, 6) NOT NULL CONSTRAINT reservations_charge_gpu CHECK (charge_gpu >= 0),
    charge_vcpu     bigint         NOT NULL CONSTRAINT reservations_charge_vcpu CHECK (charge_vcpu >= 0),
    charge_memory_mib bigint       NOT NULL CONSTRAINT reservations_charge_memory CHECK (charge_memory_mib >= 0),
    -- The quota rows charged: [{"scope_kind", "scope_id", "resource", "amount"}].
    charged         jsonb          NOT NULL DEFAULT '[]',
    -- Pending: when placement is tried again (the reconciler of the workers issue reads it).
    next_attempt_at timestamptz,
    version         bigint         NOT NULL DEFAULT 1,
    created_at      timestamptz    NOT NULL DEFAULT compute_now(),
    updated_at      timestamptz    NOT NULL DEFAULT compute_now(),
    ended_at        timestamptz,
    CONSTRAINT reservations_window CHECK (ends_at > starts_at)
);
CREATE INDEX reservations_tenant ON reservations (tenant_id, id);
CREATE INDEX reservations_pool ON reservations (pool_id, id);
CREATE INDEX reservations_pending ON reservations (next_attempt_at) WHERE state = 'pending';

CREATE TABLE allocations (
    id             text    PRIMARY KEY CONSTRAINT allocations_id_format CHECK (id ~ '^alc_[0-9a-f]{32}$'),
    reservation_id text    NOT NULL REFERENCES reservations (id),
    ordinal        integer NOT NULL,
    gpu_kind       text    NOT NULL CONSTRAINT allocations_gpu_kind CHECK (gpu_kind IN ('gpu', 'mig', 'slot')),
    gpu_count      integer NOT NULL CONSTRAINT allocations_gpu_count CHECK (gpu_count BETWEEN 1 AND 64),
    model          text,
    profile        text,
    slots_per_gpu  integer,
    vcpu           bigint  NOT NULL CONSTRAINT allocations_vcpu CHECK (vcpu >= 0),
    memory_mib     bigint  NOT NULL CONSTRAINT allocations_memory CHECK (memory_mib >= 0),
    disk_gib       bigint  NOT NULL CONSTRAINT allocations_disk CHECK (disk_gib >= 0),
    node_selector  jsonb   NOT NULL DEFAULT '{}',
    tolerations    jsonb   NOT NULL DEFAULT '[]',
    -- Where it was placed; NULL while the reservation is pending.
    node_id        text    REFERENCES nodes (id),
    atoms          text[]  NOT NULL DEFAULT '{}',
    CONSTRAINT allocations_reservation_ordinal_key UNIQUE (reservation_id, ordinal),
    CONSTRAINT allocations_profile CHECK ((gpu_kind = 'mig') = (profile IS NOT NULL)),
    CONSTRAINT allocations_slots CHECK ((gpu_kind = 'slot') = (slots_per_gpu IS NOT NULL))
);
CREATE INDEX allocations_node ON allocations (node_id) WHERE node_id IS NOT NULL;

-- Placement asks "which atoms are booked during this window": one scan of this index returns the
-- bookings that overlap it, however long the history of ended bookings grows.
CREATE INDEX device_bookings_during ON device_bookings USING gist (during);
