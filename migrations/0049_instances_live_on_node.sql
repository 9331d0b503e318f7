-- An instance's run step waits while another live instance of its node holds any of its GPUs
-- (the previous reservation's workload still leaving them), and an instance that ends wakes the
-- ones waiting for its GPUs (domain/src/instances/mod.rs, docs/instances.md). Both look up the
-- live instances of one node.
CREATE INDEX instances_live_on_node ON instances (node_id)
    WHERE state IN ('provisioning', 'running', 'stopping');
