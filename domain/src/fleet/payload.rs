//! The event payloads of this aggregate's rows (the views of `crate::events`, the event
//! contract), built field by field: the contract stays in one file, its conversions live
//! beside the rows they read.

use super::changes::Holder;
use super::{Device, Node, Pool, Site};
use crate::events::{
    ConditionView, DeviceView, HolderView, NodePayload, NodeView, Overcommit, PoolView, SiteView,
    TaintView,
};

impl From<&Site> for SiteView {
    fn from(s: &Site) -> Self {
        SiteView {
            id: s.id.clone(),
            name: s.name.clone(),
            region: s.region.clone(),
            version: s.version,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
}

impl From<&Pool> for PoolView {
    fn from(p: &Pool) -> Self {
        PoolView {
            id: p.id.clone(),
            site_id: p.site_id.clone(),
            name: p.name.clone(),
            kind: p.kind,
            lost_after_seconds: p.lost_after_seconds.map(|s| s as i64),
            overcommit: Overcommit {
                vcpu: p.vcpu_ratio,
                memory: p.memory_ratio,
                disk: p.disk_ratio,
            },
            rules: p.rules.0.clone(),
            version: p.version,
            created_at: p.created_at,
            updated_at: p.updated_at,
        }
    }
}

impl From<&Node> for NodeView {
    fn from(n: &Node) -> Self {
        NodeView {
            id: n.id.clone(),
            pool_id: n.pool_id.clone(),
            hostname: n.hostname.clone(),
            labels: n.labels.0.clone(),
            taints: n.taints.iter().map(TaintView::from).collect(),
            cordoned: n.cordoned,
            cordon_reason: n.cordon_reason.clone(),
            lifecycle: n.lifecycle,
            reachability: n.reachability,
            conditions: n.conditions.iter().map(ConditionView::from).collect(),
            generation: n.generation,
            observed_generation: n.observed_generation,
            joined_at: n.joined_at,
            retired_at: n.retired_at,
            version: n.version,
            updated_at: n.updated_at,
        }
    }
}

impl NodePayload {
    pub fn of(node: &Node) -> NodePayload {
        NodePayload {
            node: node.into(),
            devices: None,
            remaining: None,
            differences: None,
        }
    }
}

impl From<&Holder> for HolderView {
    fn from(h: &Holder) -> Self {
        HolderView {
            allocation_id: h.allocation_id.clone(),
            reason: h.reason,
            atoms: h.atoms.clone(),
            until: h.until,
        }
    }
}

impl From<&Device> for DeviceView {
    fn from(d: &Device) -> Self {
        let layout = d.layout.as_ref().map(|l| &l.0);
        DeviceView {
            id: d.id.clone(),
            compute_node_id: d.node_id.clone(),
            uuid: d.uuid.clone(),
            vendor: d.vendor.clone(),
            model: d.model.clone(),
            memory_mib: d.memory_mib,
            mode: d.mode,
            mig_profiles: layout.and_then(|l| l.profiles.clone()),
            slots: layout.and_then(|l| l.slots),
            health: d.health,
            health_reason: d.health_reason.clone(),
            health_since: d.health_since,
            quarantined: d.quarantined,
            quarantine_reason: d.quarantine_reason.clone(),
            inventory_mismatch: d.inventory_mismatch.clone(),
            retired_at: d.retired_at,
            pci_bus_id: d.pci_bus_id.clone(),
            numa_node: d.numa_node,
            nvlink_domain: d.nvlink_domain.clone(),
            version: d.version,
            created_at: d.created_at,
            updated_at: d.updated_at,
        }
    }
}
