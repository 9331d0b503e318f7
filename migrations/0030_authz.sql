-- Authorization from the database (issue 40): who may do what is rows, changed live by
-- administrators; a token only says who someone is. docs/security.md#grants explains the rules,
-- docs/database-locks.md the locks.
--
-- A principal is an identity the grants govern: a token's issuer and `sub`, or a service
-- account (issuer `compute:service-account`, subject its id). A principal with a row here is
-- *managed*: only its grants count, its token's `roles` and `tenant` claims no longer do. A
-- subject without a row keeps its claims (unless the API runs with `--authz grants`), so a
-- deployment that never grants anything works as before.
CREATE TABLE authz_principals (
    issuer     text        NOT NULL CONSTRAINT authz_principals_issuer CHECK (length(issuer) BETWEEN 1 AND 255),
    subject    text        NOT NULL CONSTRAINT authz_principals_subject CHECK (length(subject) BETWEEN 1 AND 255 AND subject !~ '[[:cntrl:]]'),
    managed_by text        NOT NULL,
    managed_at timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (issuer, subject)
);

-- One role of a principal, over the whole fleet or a scope.
--   admin:    grants, service accounts, and everything an operator of the whole fleet may do.
--   operator: the fleet, or only the site or pool of its scope.
--   member:   reserves in its tenant and sees only its tenant's objects (one tenant at a time).
CREATE TABLE authz_grants (
    id         text        PRIMARY KEY CONSTRAINT authz_grants_id_format CHECK (id ~ '^grt_[0-9a-f]{32}$'),
    issuer     text        NOT NULL,
    subject    text        NOT NULL,
    role       text        NOT NULL CONSTRAINT authz_grants_role CHECK (role IN ('admin', 'operator', 'member')),
    tenant_id  text        CONSTRAINT authz_grants_tenant CHECK (tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    scope_kind text        CONSTRAINT authz_grants_scope_kind CHECK (scope_kind IN ('site', 'pool')),
    scope_id   text,
    granted_by text        NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT compute_now(),
    CONSTRAINT authz_grants_scope_pair CHECK ((scope_kind IS NULL) = (scope_id IS NULL)),
    CONSTRAINT authz_grants_member_tenant CHECK ((role = 'member') = (tenant_id IS NOT NULL)),
    CONSTRAINT authz_grants_only_operators_scoped CHECK (role = 'operator' OR scope_kind IS NULL),
    FOREIGN KEY (issuer, subject) REFERENCES authz_principals (issuer, subject)
);
-- The same grant twice is one grant.
CREATE UNIQUE INDEX authz_grants_once ON authz_grants
    (issuer, subject, role, coalesce(tenant_id, ''), coalesce(scope_kind, ''), coalesce(scope_id, ''));
-- A member belongs to one tenant at a time: moving it is a revoke and a grant.
CREATE UNIQUE INDEX authz_grants_one_tenant ON authz_grants (issuer, subject) WHERE role = 'member';
CREATE INDEX authz_grants_admins ON authz_grants (id) WHERE role = 'admin';

-- Service accounts: identities for programs (CI systems, billing exporters). The token is shown
-- once; only its SHA-256 is kept.
CREATE TABLE service_accounts (
    id         text        PRIMARY KEY CONSTRAINT service_accounts_id_format CHECK (id ~ '^sa_[0-9a-f]{32}$'),
    name       text        NOT NULL CONSTRAINT service_accounts_name CHECK (length(name) BETWEEN 1 AND 100 AND name !~ '[[:cntrl:]]'),
    token_hash bytea       NOT NULL UNIQUE CONSTRAINT service_accounts_token_hash CHECK (length(token_hash) = 32),
    expires_at timestamptz NOT NULL,
    created_by text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT compute_now(),
    revoked_at timestamptz,
    revoked_by text,
    CONSTRAINT service_accounts_revoked_pair CHECK ((revoked_at IS NULL) = (revoked_by IS NULL))
);

-- The feed every API process tails to keep its projection of the tables above: one row per
-- principal a transaction changed, read with the outbox's xmin-safe cursor (docs/consistency.md).
-- A reader re-reads the principal's rows when its row arrives, so a row carries no state.
CREATE TABLE authz_changes (
    txid    xid8        NOT NULL DEFAULT pg_current_xact_id(),
    seq     bigint      GENERATED ALWAYS AS IDENTITY,
    issuer  text        NOT NULL,
    subject text        NOT NULL,
    at      timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (txid, seq)
);
