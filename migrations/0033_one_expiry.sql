-- One expiry. `lifecycle::expire` (one reservation) now calls `compute_expire_reservations`
-- (migration 0032) with a batch of one, so the writes of an expiry and their lock order are
-- written once; the single-reservation function of migrations 0029 and 0031 is dropped.
DROP FUNCTION compute_expire_reservation(text, text[], text, text);
