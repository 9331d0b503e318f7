-- A create answers with the reservation it wrote or replays, in the same statement as the call,
-- so the API reads nothing back: a round trip less of the four a create took (`BEGIN` with its
-- settings, the call, the read-back, `COMMIT`; issue 15).
--
-- The reservation as JSON under the names of the domain's `Reservation` (the columns of
-- `query_reservations!`): the row's own columns, `state` as time says
-- (`compute_reservation_state`, as the macro reads it) and `charge_gpu` as a float.
--
-- PL/pgSQL, VOLATILE: its statement's plan is cached per connection (a SQL function's is made
-- again on every call), and a volatile function takes a new snapshot for its statement, after
-- the calling statement's own earlier writes, so called after `compute_create_reservation` in
-- one statement it sees the reservation that call wrote (a STABLE one would read the calling
-- statement's first snapshot, from before the call, and find nothing).
CREATE FUNCTION compute_reservation_json(p_id text) RETURNS jsonb
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
  RETURN (SELECT to_jsonb(r) || jsonb_build_object(
                   'state', compute_reservation_state(r.state, r.starts_at, r.ends_at),
                   'charge_gpu', r.charge_gpu::float8)
            FROM reservations r
           WHERE r.id = p_id);
END
$$;
