-- The current definition, as migrations/0037_events_show_topology_and_gangs.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE OR REPLACE FUNCTION compute_reservation_payload(p_id text) RETURNS jsonb
    LANGUAGE plpgsql STABLE
    AS $fn$
DECLARE
    v jsonb;
BEGIN
    -- PL/pgSQL, not SQL: a session keeps its plan (a SQL function's statement is planned again
    -- at every call from another statement, which cost a create 1 ms).
    SELECT jsonb_build_object(
        'reservation', jsonb_build_object(
            'id', r.id, 'tenantId', r.tenant_id, 'createdBy', r.created_by, 'poolId', r.pool_id,
            'state', compute_reservation_state(r.state, r.starts_at, r.ends_at),
            'startsAt', compute_json_time(r.starts_at), 'endsAt', compute_json_time(r.ends_at),
            'endedAt', compute_json_time(r.ended_at),
            'conditions', (SELECT coalesce(jsonb_agg(
                               jsonb_build_object('type', c->'type', 'status', c->'status',
                                                  'reason', coalesce(c->'reason', 'null'), 'message', coalesce(c->'message', 'null'),
                                                  'since', coalesce(c->'since', 'null'))
                               || CASE WHEN jsonb_array_length(coalesce(c->'counts', '[]')) > 0
                                       THEN jsonb_build_object('counts', c->'counts') ELSE '{}' END
                               ORDER BY o), '[]')
                             FROM jsonb_array_elements(r.conditions) WITH ORDINALITY AS x(c, o)),
            'gpuCharge', r.charge_gpu::float8, 'vcpuCharge', r.charge_vcpu, 'memoryMibCharge', r.charge_memory_mib,
            'nextAttemptAt', compute_json_time(r.next_attempt_at),
            'gang', CASE WHEN r.gang_colocate IS NOT NULL OR r.gang_spread
                         THEN jsonb_build_object('colocate', r.gang_colocate, 'label', r.gang_label,
                                                 'spread', r.gang_spread) END,
            'version', r.version,
            'createdAt', compute_json_time(r.created_at), 'updatedAt', compute_json_time(r.updated_at)),
        'allocations', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                               'id', a.id, 'ordinal', a.ordinal, 'gpuKind', a.gpu_kind, 'gpuCount', a.gpu_count,
                               'model', a.model, 'profile', a.profile, 'slotsPerGpu', a.slots_per_gpu,
                               'vcpu', a.vcpu, 'memoryMib', a.memory_mib, 'diskGib', a.disk_gib,
                               'nodeSelector', a.node_selector,
                               'tolerations', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                                      'key', t->'key', 'value', coalesce(t->'value', 'null'),
                                                      'effect', coalesce(t->'effect', 'null')) ORDER BY o), '[]')
                                                 FROM jsonb_array_elements(a.tolerations) WITH ORDINALITY AS y(t, o)),
                               'sameNvlinkDomain', a.same_nvlink_domain, 'sameNumaNode', a.same_numa_node,
                               'computeNodeId', a.node_id, 'atoms', to_jsonb(a.atoms)) ORDER BY a.ordinal), '[]')
                          FROM allocations a WHERE a.reservation_id = r.id))
      INTO v FROM reservations r WHERE r.id = p_id;
    RETURN v;
END
$fn$;
