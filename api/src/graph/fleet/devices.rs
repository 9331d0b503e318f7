//! GPUs and their atoms in the graph.

use super::*;

/// A GPU, with its atoms when they were loaded ahead.
pub struct DeviceObj(pub fleet::Device, pub Option<Arc<[AtomObj]>>);

impl DeviceObj {
    /// A device whose atoms come through the loaders.
    pub fn new(device: fleet::Device) -> Self {
        DeviceObj(device, None)
    }
}

/// A GPU of a compute node: its model, memory, mode, health and bookable atoms.
// Its fields are resolved one after the other (`serial`): a page has hundreds of GPUs, and a set
// of concurrent futures per GPU cost more than its fields (`bench-fleet`). Only `computeNode`
// and `atoms` read anything, and each still batches with its sibling GPUs' (the list resolves
// GPUs concurrently); asked together of GPUs without a prefetch, they are two levels, not one.
#[Object(name = "Device", serial)]
impl DeviceObj {
    /// The device's id (`dev_…`).
    pub async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// The hardware UUID; also the name of its atom in exclusive mode.
    async fn uuid(&self) -> &str {
        &self.0.uuid
    }
    /// Vendor, such as `nvidia`.
    async fn vendor(&self) -> &str {
        &self.0.vendor
    }
    /// Model, such as `H100-SXM5-80GB`.
    async fn model(&self) -> &str {
        &self.0.model
    }
    /// Memory in MiB.
    async fn memory_mib(&self) -> i64 {
        self.0.memory_mib
    }
    /// How it is shared.
    async fn mode(&self) -> DeviceMode {
        self.0.mode.into()
    }
    /// The MIG profiles of its instances, in order (MIG mode).
    async fn mig_profiles(&self) -> Option<Vec<String>> {
        self.0.layout.as_ref()?.profiles.clone()
    }
    /// Its slot count (time-slice and MPS modes).
    async fn slots(&self) -> Option<i64> {
        self.0.layout.as_ref()?.slots.map(i64::from)
    }
    /// Its PCI bus id (`00000000:17:00.0`), as registered or as the node daemon reports it.
    async fn pci_bus_id(&self) -> Option<&str> {
        self.0.pci_bus_id.as_deref()
    }
    /// The NUMA node it is attached to; null when unknown (`sameNumaNode` then counts it as a
    /// NUMA node of its own).
    async fn numa_node(&self) -> Option<i32> {
        self.0.numa_node
    }
    /// Its NVLink domain: GPUs joined by NVLink share it; null when it has no NVLink or it is
    /// unknown (`sameNvlinkDomain` then counts it as a domain of its own).
    async fn nvlink_domain(&self) -> Option<&str> {
        self.0.nvlink_domain.as_deref()
    }
    /// Its health: placement skips unhealthy GPUs.
    async fn health(&self) -> DeviceHealth {
        self.0.health.into()
    }
    /// Why the health was set (an operator's words, or the node's report: "XID 79: …").
    async fn health_reason(&self) -> Option<&str> {
        self.0.health_reason.as_deref()
    }
    /// Since when it has its health (null: healthy since it was registered).
    async fn health_since(&self) -> Option<DateTime<Utc>> {
        self.0.health_since
    }
    /// Whether it is kept out of placement: an operator's quarantine, or an inventory mismatch.
    async fn quarantined(&self) -> bool {
        self.0.quarantined
    }
    /// Why an operator quarantined it (`quarantineDevice`), while they do.
    async fn quarantine_reason(&self) -> Option<&str> {
        self.0.quarantine_reason.as_deref()
    }
    /// How what its node reports differs from this registration (a GPU missing, another MIG
    /// layout, less memory), while it does: the device is out of placement until the node
    /// reports it as registered or an operator accepts the report (`acceptNodeInventory`).
    async fn inventory_mismatch(&self) -> Option<&str> {
        self.0.inventory_mismatch.as_deref()
    }
    /// When an operator took it out of the registration (`retireDevice`): it has no atoms since.
    async fn retired_at(&self) -> Option<DateTime<Utc>> {
        self.0.retired_at
    }
    /// Optimistic-concurrency version: pass it to `changeDeviceMode`.
    async fn version(&self) -> i64 {
        self.0.version
    }
    /// When it was registered.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
    }
    /// When it last changed.
    async fn updated_at(&self) -> DateTime<Utc> {
        self.0.updated_at
    }
    /// The node it is in.
    async fn compute_node(&self, ctx: &Context<'_>) -> GqlResult<ComputeNodeObj> {
        loaders_of(ctx)?
            .load_one(self.0.node_id.clone())
            .await?
            .map(ComputeNodeObj::new)
            .ok_or_else(|| gql_error(Error::internal("a device without its node")))
    }
    /// Its bookable atoms, by the atom rule: the GPU itself in exclusive mode, else only its MIG
    /// instances or slots.
    // Priced by its entry in `graph::cost::RULES`.
    async fn atoms(&self, ctx: &Context<'_>) -> GqlResult<Arc<[AtomObj]>> {
        if let Some(atoms) = &self.1 {
            return Ok(atoms.clone());
        }
        Ok(loaders_of(ctx)?
            .load_one(AtomsOfDevice(self.0.id.clone()))
            .await?
            .unwrap_or_default()
            .into_iter()
            .map(AtomObj)
            .collect())
    }
}

/// A bookable unit of a GPU: `<uuid>`, `<uuid>/mig/<k>` or `<uuid>/s<k>`.
pub struct AtomObj(pub fleet::Atom);

/// A bookable unit of a GPU: `<uuid>`, `<uuid>/mig/<k>` or `<uuid>/s<k>`.
// Serial, as `Device`: only `device` reads anything.
#[Object(name = "Atom", serial)]
impl AtomObj {
    /// The atom's name.
    async fn name(&self) -> &str {
        self.0.name.as_str()
    }
    /// Whole GPU, MIG instance or slot.
    async fn kind(&self) -> AtomKind {
        self.0.kind.into()
    }
    /// Position on its GPU.
    async fn ordinal(&self) -> i32 {
        self.0.ordinal
    }
    /// The MIG profile, for MIG instances.
    async fn profile(&self) -> Option<&str> {
        self.0.profile.as_deref()
    }
    /// Its share of the whole GPU, as the fraction `shareNumerator / shareDenominator`.
    async fn gpu_share(&self) -> f64 {
        f64::from(self.0.share_num) / f64::from(self.0.share_den)
    }
    /// Numerator of its share of the GPU.
    async fn share_numerator(&self) -> i32 {
        self.0.share_num
    }
    /// Denominator of its share of the GPU.
    async fn share_denominator(&self) -> i32 {
        self.0.share_den
    }
    /// Its GPU.
    async fn device(&self, ctx: &Context<'_>) -> GqlResult<DeviceObj> {
        loaders_of(ctx)?
            .load_one(self.0.device_id.clone())
            .await?
            .map(DeviceObj::new)
            .ok_or_else(|| gql_error(Error::internal("an atom without its device")))
    }
}
