//! The event payloads of this aggregate's rows (the views of `crate::events`, the event
//! contract), built field by field: the contract stays in one file, its conversions live
//! beside the rows they read.

use super::{Allocation, Reservation};
use crate::events::{
    AllocationView, ConditionView, GangView, ReservationPayload, ReservationView, TolerationView,
};

impl ReservationPayload {
    pub fn of(r: &Reservation, allocations: &[Allocation]) -> ReservationPayload {
        ReservationPayload {
            reservation: ReservationView {
                id: r.id.clone(),
                tenant_id: r.tenant_id.clone(),
                created_by: r.created_by.clone(),
                pool_id: r.pool_id.clone(),
                state: r.state,
                starts_at: r.starts_at,
                ends_at: r.ends_at,
                ended_at: r.ended_at,
                conditions: r.conditions.iter().map(ConditionView::from).collect(),
                gpu_charge: r.charge_gpu,
                vcpu_charge: r.charge_vcpu,
                memory_mib_charge: r.charge_memory_mib,
                next_attempt_at: r.next_attempt_at,
                gang: r.gang().map(|g| GangView {
                    colocate: g.colocate,
                    label: g.label,
                    spread: g.spread,
                }),
                version: r.version,
                created_at: r.created_at,
                updated_at: r.updated_at,
            },
            allocations: allocations
                .iter()
                .map(|a| AllocationView {
                    id: a.id.clone(),
                    ordinal: a.ordinal,
                    gpu_kind: a.gpu_kind,
                    gpu_count: a.gpu_count,
                    model: a.model.clone(),
                    profile: a.profile.clone(),
                    slots_per_gpu: a.slots_per_gpu,
                    vcpu: a.vcpu,
                    memory_mib: a.memory_mib,
                    disk_gib: a.disk_gib,
                    node_selector: a.node_selector.0.clone(),
                    tolerations: a.tolerations.iter().map(TolerationView::from).collect(),
                    same_nvlink_domain: a.same_nvlink_domain,
                    same_numa_node: a.same_numa_node,
                    compute_node_id: a.node_id.clone(),
                    atoms: a.atoms.clone(),
                })
                .collect(),
        }
    }
}
