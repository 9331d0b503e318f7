-- Lease names: only the families the code takes (issue 39). `pool:<id>` and `site:<id>` were
-- allowed by the CHECK but no process ever took one: per-pool work runs on the work queue's
-- shards (`shard:<kind>:<n>`, the key a pool's or a node's id), which spread a large pool over
-- the processes and already give fenced claims and a resync, and nothing is a per-site singleton
-- (docs/database-locks.md, "Lease names"). A name outside these families is refused.
ALTER TABLE leases DROP CONSTRAINT leases_name_format;
ALTER TABLE leases ADD CONSTRAINT leases_name_format
    CHECK (name ~ '^(shard:[a-z_]+:[0-9]+|singleton:[a-z_:0-9a-z_-]+|gateway:[A-Za-z0-9_.-]+)$');
