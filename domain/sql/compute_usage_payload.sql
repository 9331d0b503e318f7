-- The current definition, as migrations/0016_usage_windows.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

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
