-- An atom can be booked only from the moment it exists. A mode change makes new atoms at its
-- `compute_now()` after proving that nothing on the GPU is booked from then on; a placement whose
-- transaction began earlier (its `compute_now()`, like `now()`, is its start) must not book the
-- new atoms from before that moment, or a child's booking would overlap the parent's last one
-- (the atom rule). Placement reads `created_at` (docs/database-locks.md, "Mode changes").
-- Atoms that exist already have always existed.
ALTER TABLE device_atoms ADD COLUMN created_at timestamptz NOT NULL DEFAULT '-infinity';
ALTER TABLE device_atoms ALTER COLUMN created_at SET DEFAULT compute_now();
COMMENT ON COLUMN device_atoms.created_at IS 'When the atom came to exist (its mode change or registration); no booking of it starts earlier.';
