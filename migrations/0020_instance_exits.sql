-- A workload that ends on its own (docs/instances.md). The node daemon reports it (`exited` in
-- compute-agent.v1); the gateway records the exit on the instance, fenced by the node's
-- session epoch, and the instance moves from `running` to `exited` (a terminal state: the
-- workflow never starts it again by itself).
--
-- Lock order (docs/database-locks.md): node_sessions (FOR SHARE, the session guard), the
-- instance row, the outbox, work_queue last.

ALTER TABLE instances
    ADD COLUMN exit_code   integer CONSTRAINT instances_exit_code CHECK (exit_code BETWEEN 0 AND 255),
    ADD COLUMN exit_signal integer CONSTRAINT instances_exit_signal CHECK (exit_signal BETWEEN 1 AND 64),
    -- When the daemon says the workload ended (the database's time less the age it reported).
    ADD COLUMN exited_at   timestamptz;

ALTER TABLE instances DROP CONSTRAINT instances_state;
ALTER TABLE instances ADD CONSTRAINT instances_state CHECK (state IN
    ('provisioning', 'running', 'stopping', 'stopped', 'failed', 'exited'));
ALTER TABLE instances DROP CONSTRAINT instances_ended;
ALTER TABLE instances ADD CONSTRAINT instances_ended
    CHECK ((state IN ('stopped', 'failed', 'exited')) = (stopped_at IS NOT NULL));
ALTER TABLE instances ADD CONSTRAINT instances_exited CHECK (state <> 'exited' OR exited_at IS NOT NULL);
