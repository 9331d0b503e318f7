-- The fleet: sites, pools, nodes (machines), their scalar resources, their GPUs and the bookable
-- atoms of each GPU; device bookings with their exclusion constraint; capacity rollups; quotas;
-- idempotency keys. Every aggregate carries a version for optimistic concurrency.
--
-- Lock order for transactions that touch several of these tables (docs/database-locks.md):
-- quota_usage, pools, nodes, devices, node_resources, pool_capacity_rollup.

CREATE TABLE sites (
    id         text        PRIMARY KEY CONSTRAINT sites_id_format CHECK (id ~ '^site_[0-9a-f]{32}$'),
    name       text        NOT NULL CONSTRAINT sites_name_length CHECK (length(name) BETWEEN 1 AND 100),
    region     text        CONSTRAINT sites_region_length CHECK (length(region) BETWEEN 1 AND 100),
    version    bigint      NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT compute_now(),
    updated_at timestamptz NOT NULL DEFAULT compute_now(),
    CONSTRAINT sites_name_key UNIQUE (name)
);

CREATE TABLE pools (
    id               text          PRIMARY KEY CONSTRAINT pools_id_format CHECK (id ~ '^pool_[0-9a-f]{32}$'),
    site_id          text          NOT NULL REFERENCES sites (id),
    name             text          NOT NULL CONSTRAINT pools_name_length CHECK (length(name) BETWEEN 1 AND 100),
    kind             text          NOT NULL CONSTRAINT pools_kind CHECK (kind IN ('bare_metal', 'provider', 'vps_host')),
    lost_after       interval,
    vcpu_ratio       numeric(6, 3) NOT NULL DEFAULT 1 CONSTRAINT pools_vcpu_ratio CHECK (vcpu_ratio BETWEEN 1 AND 100),
    memory_ratio     numeric(6, 3) NOT NULL DEFAULT 1 CONSTRAINT pools_memory_ratio CHECK (memory_ratio BETWEEN 1 AND 100),
    disk_ratio       numeric(6, 3) NOT NULL DEFAULT 1 CONSTRAINT pools_disk_ratio CHECK (disk_ratio BETWEEN 1 AND 100),
    version          bigint        NOT NULL DEFAULT 1,
    created_at       timestamptz   NOT NULL DEFAULT compute_now(),
    updated_at       timestamptz   NOT NULL DEFAULT compute_now(),
    CONSTRAINT pools_site_name_key UNIQUE (site_id, name),
    -- Bare metal is never lost automatically: an operator decides.
    CONSTRAINT pools_lost_after CHECK (lost_after IS NULL OR (kind <> 'bare_metal' AND lost_after > interval '0'))
);
CREATE INDEX pools_site ON pools (site_id, id);

CREATE TABLE nodes (
    id                  text        PRIMARY KEY CONSTRAINT nodes_id_format CHECK (id ~ '^node_[0-9a-f]{32}$'),
    pool_id             text        NOT NULL REFERENCES pools (id),
    hostname            text        NOT NULL CONSTRAINT nodes_hostname_format CHECK (hostname ~ '^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$'),
    labels              jsonb       NOT NULL DEFAULT '{}' CONSTRAINT nodes_labels_object CHECK (jsonb_typeof(labels) = 'object'),
    -- [{"key": …, "value": …, "effect": "NoSchedule" | "PreferNoSchedule" | "NoExecute"}]
    taints              jsonb       NOT NULL DEFAULT '[]' CONSTRAINT nodes_taints_array CHECK (jsonb_typeof(taints) = 'array'),
    cordoned            boolean     NOT NULL DEFAULT false,
    cordon_reason       text,
    reachability        text        NOT NULL DEFAULT 'disconnected'
        CONSTRAINT nodes_reachability CHECK (reachability IN ('connected', 'disconnected', 'unreachable', 'lost')),
    -- [{"type": …, "status": …, "reason": …, "message": …, "since": …}]
    conditions          jsonb       NOT NULL DEFAULT '[]' CONSTRAINT nodes_conditions_array CHECK (jsonb_typeof(conditions) = 'array'),
    generation          bigint      NOT NULL DEFAULT 1,
    observed_generation bigint      NOT NULL DEFAULT 0,
    joined_at           timestamptz NOT NULL DEFAULT compute_now(),
    retired_at          timestamptz,
    -- The node's place in its lifecycle, derived: the state table in compute_domain::fleet::state
    -- lists which actions may start from which value, and guarded updates test it.
    lifecycle           text        NOT NULL GENERATED ALWAYS AS (
        CASE WHEN retired_at IS NOT NULL THEN 'retired' WHEN cordoned THEN 'cordoned' ELSE 'active' END
    ) STORED,
    version             bigint      NOT NULL DEFAULT 1,
    updated_at          timestamptz NOT NULL DEFAULT compute_now(),
    CONSTRAINT nodes_hostname_key UNIQUE (hostname),
    CONSTRAINT nodes_observed_generation CHECK (observed_generation <= generation),
    CONSTRAINT nodes_retired_cordoned CHECK (retired_at IS NULL OR cordoned)
);
CREATE INDEX nodes_pool ON nodes (pool_id, id);

-- Scalars: changed only by guarded updates under the node's row lock; the CHECK is the backstop.
CREATE TABLE node_resources (
    node_id     text          NOT NULL REFERENCES nodes (id),
    resource    text          NOT NULL CONSTRAINT node_resources_resource CHECK (resource IN ('vcpu', 'memory_mib', 'disk_gib')),
    allocatable bigint        NOT NULL CONSTRAINT node_resources_allocatable CHECK (allocatable >= 0),
    -- The pool's overcommit ratio for this resource, copied so the CHECK can see it.
    ratio       numeric(6, 3) NOT NULL CONSTRAINT node_resources_ratio CHECK (ratio >= 1),
    allocated   bigint        NOT NULL DEFAULT 0 CONSTRAINT node_resources_allocated_nonnegative CHECK (allocated >= 0),
    PRIMARY KEY (node_id, resource),
    CONSTRAINT node_resources_within_limit CHECK (allocated <= floor(allocatable * ratio))
);

CREATE TABLE devices (
    id                text        PRIMARY KEY CONSTRAINT devices_id_format CHECK (id ~ '^dev_[0-9a-f]{32}$'),
    node_id           text        NOT NULL REFERENCES nodes (id),
    uuid              text        NOT NULL CONSTRAINT devices_uuid_format CHECK (uuid ~ '^[A-Za-z0-9][A-Za-z0-9-]{3,79}$'),
    vendor            text        NOT NULL CONSTRAINT devices_vendor_length CHECK (length(vendor) BETWEEN 1 AND 50),
    model             text        NOT NULL CONSTRAINT devices_model_length CHECK (length(model) BETWEEN 1 AND 100),
    memory_mib        bigint      NOT NULL CONSTRAINT devices_memory CHECK (memory_mib > 0),
    mode              text        NOT NULL CONSTRAINT devices_mode CHECK (mode IN ('exclusive', 'mig', 'time_slice', 'mps')),
    -- exclusive: null; mig: {"profiles": ["3g.40gb", …]}; time_slice and mps: {"slots": n}
    layout            jsonb,
    health            text        NOT NULL DEFAULT 'healthy' CONSTRAINT devices_health CHECK (health IN ('healthy', 'degraded', 'unhealthy')),
    health_reason     text,
    quarantined       boolean     NOT NULL DEFAULT false,
    quarantine_reason text,
    version           bigint      NOT NULL DEFAULT 1,
    created_at        timestamptz NOT NULL DEFAULT compute_now(),
    updated_at        timestamptz NOT NULL DEFAULT compute_now(),
    CONSTRAINT devices_uuid_key UNIQUE (uuid),
    CONSTRAINT devices_layout_matches_mode CHECK (
        (mode = 'exclusive' AND layout IS NULL)
        OR (mode = 'mig' AND jsonb_typeof(layout -> 'profiles') = 'array')
        OR (mode IN ('time_slice', 'mps') AND jsonb_typeof(layout -> 'slots') = 'number')
    )
);
CREATE INDEX devices_node ON devices (node_id, id);
CREATE INDEX devices_model ON devices (model, id);

-- The bookable atoms of each GPU, by the atom rule: an exclusive GPU is one atom (its UUID); a MIG
-- GPU only its instances (<uuid>/mig/<k>); a time-slice or MPS GPU only its slots (<uuid>/s<k>).
-- The parent of a MIG or slotted GPU is never an atom, so a parent and its children are never
-- both bookable. Rows are replaced, in one transaction, when the mode or layout changes.
CREATE TABLE device_atoms (
    name        text    PRIMARY KEY,
    device_id   text    NOT NULL REFERENCES devices (id),
    kind        text    NOT NULL CONSTRAINT device_atoms_kind CHECK (kind IN ('gpu', 'mig', 'slot')),
    ordinal     integer NOT NULL CONSTRAINT device_atoms_ordinal CHECK (ordinal >= 0),
    profile     text,
    -- The share of a whole GPU, as a fraction: 1/1, 3/7 for a 3g MIG instance, 1/n for a slot.
    share_num   integer NOT NULL CONSTRAINT device_atoms_share_num CHECK (share_num > 0),
    share_den   integer NOT NULL CONSTRAINT device_atoms_share_den CHECK (share_den >= share_num),
    CONSTRAINT device_atoms_device_ordinal_key UNIQUE (device_id, ordinal),
    CONSTRAINT device_atoms_profile CHECK ((kind = 'mig') = (profile IS NOT NULL))
);

-- Every claim on an atom over time. The exclusion constraint allows one live booking per atom per
-- instant, whatever the caller does. Writers use INSERT … ON CONFLICT DO NOTHING, which honours it.
CREATE TABLE device_bookings (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    atom          text        NOT NULL,
    device_id     text        NOT NULL REFERENCES devices (id),
    -- The allocation holding the atom; NULL for a maintenance hold such as a mode change.
    allocation_id text,
    reason        text        NOT NULL DEFAULT 'allocation'
        CONSTRAINT device_bookings_reason CHECK (reason IN ('allocation', 'mode_change')),
    during        tstzrange   NOT NULL CONSTRAINT device_bookings_nonempty CHECK (NOT isempty(during)),
    created_at    timestamptz NOT NULL DEFAULT compute_now(),
    CONSTRAINT device_bookings_allocation CHECK ((reason = 'allocation') = (allocation_id IS NOT NULL)),
    CONSTRAINT device_bookings_no_overlap EXCLUDE USING gist (atom WITH =, during WITH &&)
);
CREATE INDEX device_bookings_device ON device_bookings USING gist (device_id, during);
CREATE INDEX device_bookings_allocation ON device_bookings (allocation_id) WHERE allocation_id IS NOT NULL;

-- Atoms per pool and (model, kind, profile), kept in the transactions that add or remove atoms.
CREATE TABLE pool_capacity_rollup (
    pool_id   text    NOT NULL REFERENCES pools (id),
    model     text    NOT NULL,
    kind      text    NOT NULL CONSTRAINT pool_capacity_rollup_kind CHECK (kind IN ('gpu', 'mig', 'slot')),
    profile   text    NOT NULL DEFAULT '',
    atoms     integer NOT NULL CONSTRAINT pool_capacity_rollup_atoms CHECK (atoms >= 0),
    version   bigint  NOT NULL DEFAULT 1,
    PRIMARY KEY (pool_id, model, kind, profile)
);

-- Quotas per tenant and scope (a pool or a site). Reservations charge `used` with a guarded
-- update (used + n <= max_amount) in their own transaction; a limit may be lowered below what is
-- already used, which refuses new charges without touching existing ones.
CREATE TABLE quota_usage (
    tenant_id  text           NOT NULL CONSTRAINT quota_usage_tenant CHECK (tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    scope_kind text           NOT NULL CONSTRAINT quota_usage_scope_kind CHECK (scope_kind IN ('pool', 'site')),
    scope_id   text           NOT NULL,
    resource   text           NOT NULL CONSTRAINT quota_usage_resource CHECK (resource IN ('gpu', 'vcpu', 'memory_mib')),
    max_amount numeric(18, 6) NOT NULL CONSTRAINT quota_usage_max CHECK (max_amount >= 0),
    used       numeric(18, 6) NOT NULL DEFAULT 0 CONSTRAINT quota_usage_used CHECK (used >= 0),
    version    bigint         NOT NULL DEFAULT 1,
    updated_at timestamptz    NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (tenant_id, scope_kind, scope_id, resource)
);

-- Idempotency keys, scoped to (tenant, identity, key). The row is inserted first in the
-- transaction of the effect it protects (so a repeat waits on its unique index until the first
-- commits) and its response written last in the same transaction; a final error is recorded in a
-- transaction of its own, with no effect. Kept at least 24 hours (docs/idempotency.md).
CREATE TABLE idempotency_keys (
    tenant_id   text        NOT NULL,
    subject     text        NOT NULL,
    key         text        NOT NULL CONSTRAINT idempotency_keys_key CHECK (length(key) BETWEEN 1 AND 255),
    operation   text        NOT NULL,
    fingerprint jsonb       NOT NULL,
    response    jsonb,
    created_at  timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (tenant_id, subject, key)
);
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);
