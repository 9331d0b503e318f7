-- A reservation's state as time says (docs/reservations.md, "States follow time"): a scheduled
-- reservation whose window has started is 'active', and a live one whose window has ended is
-- 'expired', whether or not the reconciler has moved the stored state yet. The one definition;
-- every read a client can observe, and every check of the state table on a tenant's action,
-- reads it. A single-expression SQL function: the planner inlines it.
CREATE FUNCTION compute_reservation_state(p_state text, p_starts_at timestamptz, p_ends_at timestamptz)
    RETURNS text
    LANGUAGE sql
    STABLE
    AS $$
        SELECT CASE WHEN p_state IN ('pending', 'scheduled', 'active') AND p_ends_at <= compute_now() THEN 'expired'
                    WHEN p_state = 'scheduled' AND p_starts_at <= compute_now() THEN 'active'
                    ELSE p_state END
    $$;

-- Who placement may use, the one definition each (fleet listings, capacity and placement read
-- them): a node that is active and reachable (disconnected is not dead), and a device that is
-- neither unhealthy nor quarantined.
CREATE FUNCTION compute_node_schedulable(p_lifecycle text, p_reachability text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT p_lifecycle = 'active' AND p_reachability IN ('connected', 'disconnected') $$;

CREATE FUNCTION compute_device_schedulable(p_health text, p_quarantined boolean) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT p_health <> 'unhealthy' AND NOT p_quarantined $$;

-- Whether p_tolerations ([{key, value?, effect?}]) tolerate every hard taint (NoSchedule,
-- NoExecute) of p_taints ([{key, value, effect}]).
CREATE FUNCTION compute_taints_tolerated(p_taints jsonb, p_tolerations jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT NOT EXISTS (
            SELECT 1 FROM jsonb_array_elements(p_taints) t
             WHERE t->>'effect' IN ('NoSchedule', 'NoExecute')
               AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_tolerations) o
                                WHERE o->>'key' = t->>'key' AND (o->>'value' IS NULL OR o->>'value' = t->>'value')
                                  AND (o->>'effect' IS NULL OR o->>'effect' = t->>'effect')))
    $$;
