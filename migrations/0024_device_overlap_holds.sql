-- A daemon refuses a `run_instance` whose devices a workload it runs already holds
-- (`DEVICE_OVERLAP`, the defence in depth of the atom rule). Then something the control plane does
-- not know is running on those GPUs: the reservation fails (the reconciler's step, like a lost
-- node's), but its atoms on that node are not given back to placement. They stay booked, as
-- `overlap_hold` bookings with no allocation (never billed: the meter reads allocations'
-- bookings), until the end of the window the reservation held them for, so no other tenant is
-- placed onto a GPU its daemon says is busy; an operator looks at the node meanwhile.

ALTER TABLE device_bookings DROP CONSTRAINT device_bookings_reason;
ALTER TABLE device_bookings ADD CONSTRAINT device_bookings_reason
    CHECK (reason IN ('allocation', 'mode_change', 'overlap_hold'));

-- The reconciler finds the refused runs by this index (an overlap is rare; the index stays small).
CREATE INDEX commands_device_overlap ON commands (workflow_id) WHERE error_code = 'DEVICE_OVERLAP';
