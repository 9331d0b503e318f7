-- One home for two facts that SQL and Rust both need: which shard a work-queue key belongs to,
-- and how a key is enqueued. Before this, the shard formula and the upsert were written out in
-- four statements each.

-- The shard of a work-queue key among p_shards: a hash of the key. The one definition; the
-- holder of the lease shard:<kind>:<n> claims the rows of shard n. (abs of the remainder, not
-- of the hash: the same value for every hash, and no overflow for the smallest bigint.)
CREATE FUNCTION compute_shard(p_key text, p_shards integer) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT abs(hashtextextended(p_key, 0) % greatest(p_shards, 1))::integer $$;

-- Enqueues each of p_keys of p_kind (or bumps its gen, so a run in progress runs again), due
-- after p_delay_seconds, in the caller's transaction. Rows are written in key order, the order in
-- which every multi-key enqueue takes work_queue row locks (docs/database-locks.md). Returns how
-- many keys.
CREATE FUNCTION compute_enqueue(p_kind text, p_keys text[], p_shards integer, p_delay_seconds float8 DEFAULT 0)
    RETURNS integer
    LANGUAGE sql
    AS $$
    WITH up AS (
        INSERT INTO work_queue AS w (kind, key, shard, not_before)
        SELECT p_kind, k.key, compute_shard(k.key, p_shards), compute_now() + make_interval(secs => p_delay_seconds)
          FROM (SELECT DISTINCT unnest(p_keys) AS key) k
         WHERE k.key IS NOT NULL
         ORDER BY k.key
        ON CONFLICT (kind, key) DO UPDATE
           SET gen = w.gen + 1, not_before = least(w.not_before, EXCLUDED.not_before), updated_at = compute_now()
        RETURNING 1)
    SELECT count(*)::integer FROM up
    $$;
