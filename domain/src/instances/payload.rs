//! The event payloads of this aggregate's rows (the views of `crate::events`, the event
//! contract), built field by field: the contract stays in one file, its conversions live
//! beside the rows they read.

use super::Instance;
use crate::events::{InstancePayload, InstanceView};

impl InstancePayload {
    pub fn of(i: &Instance) -> InstancePayload {
        InstancePayload {
            instance: InstanceView {
                id: i.id.clone(),
                tenant_id: i.tenant_id.clone(),
                reservation_id: i.reservation_id.clone(),
                allocation_id: i.allocation_id.clone(),
                compute_node_id: i.node_id.clone(),
                image: i.image.clone(),
                command: i.command.clone(),
                env_names: i.env.0.keys().cloned().collect(),
                state: i.state,
                stop_requested: i.stop_requested,
                reason: i.reason.clone(),
                created_by: i.created_by.clone(),
                version: i.version,
                created_at: i.created_at,
                updated_at: i.updated_at,
                started_at: i.started_at,
                stopped_at: i.stopped_at,
                exit_code: i.exit_code,
                exit_signal: i.exit_signal,
                exited_at: i.exited_at,
            },
        }
    }
}
