-- The current definition, as migrations/0035_bookings_by_pool.sql left it. Change it with a new migration
-- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks
-- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.

CREATE FUNCTION compute_booking_pool() RETURNS trigger
    LANGUAGE plpgsql
    AS $fn$
BEGIN
    SELECT n.pool_id INTO NEW.pool_id FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.id = NEW.device_id;
    RETURN NEW;
END
$fn$;
