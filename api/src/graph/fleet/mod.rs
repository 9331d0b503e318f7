//! The fleet in the graph: sites, pools, compute nodes, devices, atoms, capacity and quotas, with
//! Relay connections; every edge goes through the data loaders.

use std::collections::HashMap;
use std::sync::Arc;

use async_graphql::connection::Connection;
use async_graphql::{ComplexObject, Context, Enum, ID, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::Error;
use compute_domain::fleet::model::{self as m};
use compute_domain::fleet::{self, AtomFilter, DeviceFilter, NodeFilter, PoolFilter};
use compute_domain::ids::{DeviceId, NodeId, PoolId, ScopeId, SiteId, TenantId};
use compute_domain::page::Page;

use crate::auth::Role;
use crate::graph::common::*;
use crate::graph::loaders::*;
use crate::graph::node::{NodeInterface, load_node};
use crate::graph::{GqlResult, actor, db, gql_error, require_operator, viewer};

pub mod enrollment;
pub mod mutations;

/// What kind of machines a pool holds.
#[derive(async_graphql::Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(name = "PoolKind", remote = "compute_domain::fleet::model::PoolKind")]
pub enum PoolKind {
    /// Machines the operator owns.
    BareMetal,
    /// Machines rented from a provider.
    Provider,
    /// Virtual machines on hosts.
    VpsHost,
}
/// Whether the node's daemon talks to the control plane.
#[derive(async_graphql::Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(
    name = "Reachability",
    remote = "compute_domain::fleet::model::Reachability"
)]
pub enum Reachability {
    /// A daemon session is open.
    Connected,
    /// No session; nothing is released.
    Disconnected,
    /// No session for too long: the node leaves placement, keeps its work.
    Unreachable,
    /// Given up for good (provider and VPS pools with `lostAfterSeconds`).
    Lost,
}
/// How a GPU is shared.
#[derive(async_graphql::Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(
    name = "DeviceMode",
    remote = "compute_domain::fleet::model::DeviceMode"
)]
pub enum DeviceMode {
    /// The whole GPU is one atom.
    Exclusive,
    /// Only its MIG instances are bookable.
    Mig,
    /// Only its time-slice slots are bookable.
    TimeSlice,
    /// Only its MPS slots are bookable.
    Mps,
}
/// A GPU's health.
#[derive(async_graphql::Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(name = "DeviceHealth", remote = "compute_domain::fleet::model::Health")]
pub enum DeviceHealth {
    /// No problem is known.
    Healthy,
    /// Usable, with a problem worth watching.
    Degraded,
    /// Not usable: placement skips it.
    Unhealthy,
}
/// A scalar resource of a node.
#[derive(async_graphql::Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(
    name = "ResourceKind",
    remote = "compute_domain::fleet::model::Resource"
)]
pub enum ResourceKind {
    /// Virtual CPUs.
    Vcpu,
    /// Memory, in MiB.
    MemoryMib,
    /// Disk, in GiB.
    DiskGib,
}

/// Where a node is in its life.
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(remote = "compute_domain::fleet::state::NodeLifecycle")]
pub enum NodeLifecycle {
    /// Takes new work.
    Active,
    /// Keeps its work, takes no new work.
    Cordoned,
    /// Out of the fleet; kept for history.
    Retired,
}

/// `totalCount` of a connection, counted only when asked for.
pub struct TotalCount(CountOf);

enum CountOf {
    Sites,
    Pools(PoolFilter),
    Nodes(NodeFilter),
    Devices(DeviceFilter),
    Atoms(AtomFilter),
    PoolsOfSite(SiteId),
    NodesOfPool(PoolId),
}

/// `totalCount` of a connection, counted only when asked for.
#[Object]
impl TotalCount {
    /// How many items the connection has across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> GqlResult<i64> {
        let db = db(ctx)?;
        let loaders = loaders_of(ctx)?;
        let n = match &self.0 {
            CountOf::Sites => fleet::count_sites(db).await,
            CountOf::Pools(f) => fleet::count_pools(db, f).await,
            CountOf::Nodes(f) => fleet::count_nodes(db, f).await,
            CountOf::Devices(f) => fleet::count_devices(db, f).await,
            CountOf::Atoms(f) => fleet::count_atoms(db, f).await,
            CountOf::PoolsOfSite(id) => {
                return Ok(loaders
                    .load_one(PoolCountOfSite(id.clone()))
                    .await?
                    .unwrap_or(0));
            }
            CountOf::NodesOfPool(id) => {
                return Ok(loaders
                    .load_one(NodeCountOfPool(id.clone()))
                    .await?
                    .unwrap_or(0));
            }
        };
        Ok(n?)
    }
}

/// A Relay connection of `T` with `totalCount`.
pub type Conn<T> = Connection<String, T, TotalCount>;

fn connection<R, T>(
    page: Page<R>,
    count: CountOf,
    key: impl Fn(&R) -> &str,
    wrap: impl Fn(R) -> T,
) -> Conn<T>
where
    T: async_graphql::OutputType,
{
    crate::graph::common::connection(page, TotalCount(count), key, wrap)
}

/// The caller must be authenticated (any role); members see the inventory's public face.
fn require_viewer(ctx: &Context<'_>) -> GqlResult<bool> {
    Ok(viewer(ctx)?.has_role(Role::Operator))
}

/// Free and booked atoms of one (model, kind, profile).
#[derive(SimpleObject)]
pub struct Capacity {
    /// The GPU model.
    model: String,
    /// Whole GPUs, MIG instances or slots.
    kind: AtomKind,
    /// The MIG profile, for MIG instances.
    profile: Option<String>,
    /// Atoms on nodes that are not retired.
    total: i64,
    /// Atoms with a booking that overlaps the window.
    booked: i64,
    /// Atoms placement could take for the whole window: not booked, on an active reachable node,
    /// on a GPU that is neither unhealthy nor quarantined.
    free: i64,
}

async fn capacity(
    ctx: &Context<'_>,
    scope: ScopeId,
    w: Option<WindowInput>,
) -> GqlResult<Vec<Capacity>> {
    let rows = loaders_of(ctx)?
        .load_one(CapacityOf(scope, window(w)?))
        .await?
        .unwrap_or_default();
    rows.into_iter()
        .map(|r| {
            Ok(Capacity {
                model: r.model,
                kind: r.kind.into(),
                profile: (!r.profile.is_empty()).then_some(r.profile),
                total: r.total,
                booked: r.booked,
                free: r.free,
            })
        })
        .collect()
}

/// A place that holds pools.
pub struct SiteObj(pub fleet::Site);

/// A place that holds pools.
#[Object(name = "Site")]
impl SiteObj {
    /// The site's id (`site_…`).
    pub async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// Unique name.
    async fn name(&self) -> &str {
        &self.0.name
    }
    /// Free-form region, such as `eu-west`.
    async fn region(&self) -> Option<&str> {
        self.0.region.as_deref()
    }
    /// Optimistic-concurrency version: pass it to `updateSite`.
    async fn version(&self) -> i64 {
        self.0.version
    }
    /// When the site was created.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
    }
    /// When the site last changed.
    async fn updated_at(&self) -> DateTime<Utc> {
        self.0.updated_at
    }
    /// The site's pools.
    async fn pools(
        &self,
        ctx: &Context<'_>,
        #[graphql(
            desc = "At most this many items from the start, or after `after`: 0 to 100 (50 when neither `first` nor `last` is given)."
        )]
        first: Option<i32>,
        #[graphql(desc = "Only items after this cursor (an edge's `cursor`).")] after: Option<
            String,
        >,
        #[graphql(desc = "At most this many items from the end, or before `before`: 0 to 100.")]
        last: Option<i32>,
        #[graphql(desc = "Only items before this cursor (an edge's `cursor`).")] before: Option<
            String,
        >,
    ) -> GqlResult<Conn<PoolObj>> {
        let args = page_request(first, after, last, before).resolve()?;
        let page = loaders_of(ctx)?
            .load_one(PoolsOfSite(self.0.id.clone(), args))
            .await?
            .unwrap_or(Page {
                items: vec![],
                has_next: false,
                has_previous: false,
            });
        Ok(connection(
            page,
            CountOf::PoolsOfSite(self.0.id.clone()),
            |p| p.id.as_str(),
            PoolObj,
        ))
    }
    /// GPUs, MIG instances and slots of the site's pools: total, booked and free, now or over a
    /// window.
    async fn capacity(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The window to count bookings over; the present instant when unset.")]
        window: Option<WindowInput>,
    ) -> GqlResult<Vec<Capacity>> {
        capacity(ctx, ScopeId::Site(self.0.id.clone()), window).await
    }
}

/// Overcommit ratios of a pool: a node offers `floor(allocatable * ratio)` of each scalar.
#[derive(SimpleObject)]
pub struct Overcommit {
    /// vCPU ratio.
    vcpu: f64,
    /// Memory ratio.
    memory: f64,
    /// Disk ratio.
    disk: f64,
}

/// A pool of compute nodes in a site.
pub struct PoolObj(pub fleet::Pool);

/// A pool of compute nodes in a site.
#[Object(name = "Pool")]
impl PoolObj {
    /// The pool's id (`pool_…`).
    pub async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// Name, unique in its site.
    async fn name(&self) -> &str {
        &self.0.name
    }
    /// What kind of machines it holds.
    async fn kind(&self) -> PoolKind {
        self.0.kind.into()
    }
    /// After how long unreachable a node counts as lost (provider and VPS pools only).
    async fn lost_after_seconds(&self) -> Option<i64> {
        self.0.lost_after_seconds.map(|s| s as i64)
    }
    /// Overcommit ratios.
    async fn overcommit(&self) -> Overcommit {
        Overcommit {
            vcpu: self.0.vcpu_ratio,
            memory: self.0.memory_ratio,
            disk: self.0.disk_ratio,
        }
    }
    /// Optimistic-concurrency version: pass it to `updatePool`.
    async fn version(&self) -> i64 {
        self.0.version
    }
    /// When the pool was created.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
    }
    /// When the pool last changed.
    async fn updated_at(&self) -> DateTime<Utc> {
        self.0.updated_at
    }
    /// The site it belongs to.
    async fn site(&self, ctx: &Context<'_>) -> GqlResult<SiteObj> {
        loaders_of(ctx)?
            .load_one(self.0.site_id.clone())
            .await?
            .map(SiteObj)
            .ok_or_else(|| gql_error(Error::internal("a pool without its site")))
    }
    /// The pool's compute nodes, retired ones included (operators only).
    async fn compute_nodes(
        &self,
        ctx: &Context<'_>,
        #[graphql(
            desc = "At most this many items from the start, or after `after`: 0 to 100 (50 when neither `first` nor `last` is given)."
        )]
        first: Option<i32>,
        #[graphql(desc = "Only items after this cursor (an edge's `cursor`).")] after: Option<
            String,
        >,
        #[graphql(desc = "At most this many items from the end, or before `before`: 0 to 100.")]
        last: Option<i32>,
        #[graphql(desc = "Only items before this cursor (an edge's `cursor`).")] before: Option<
            String,
        >,
    ) -> GqlResult<Conn<ComputeNodeObj>> {
        require_operator(ctx)?;
        let args = page_request(first, after, last, before).resolve()?;
        let page = loaders_of(ctx)?
            .load_one(NodesOfPool(self.0.id.clone(), args))
            .await?
            .unwrap_or(Page {
                items: vec![],
                has_next: false,
                has_previous: false,
            });
        node_connection(ctx, page, CountOf::NodesOfPool(self.0.id.clone())).await
    }
    /// GPUs, MIG instances and slots: total, booked and free, now or over a window.
    async fn capacity(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The window to count bookings over; the present instant when unset.")]
        window: Option<WindowInput>,
    ) -> GqlResult<Vec<Capacity>> {
        capacity(ctx, ScopeId::Pool(self.0.id.clone()), window).await
    }
}

/// A node label.
#[derive(SimpleObject)]
pub struct Label {
    /// The label key.
    key: String,
    /// The label value.
    value: String,
}

/// A taint: `key=value:effect`.
#[derive(SimpleObject)]
pub struct Taint {
    /// The taint key.
    key: String,
    /// Value (may be empty).
    value: String,
    /// What it does to placement.
    effect: TaintEffect,
}

/// One scalar resource of a node.
// Its fields are resolved one after the other (`serial`): none reads anything, and a set of
// concurrent futures per object cost more than the fields.
#[derive(SimpleObject)]
#[graphql(serial)]
pub struct NodeResource {
    /// Which resource.
    resource: ResourceKind,
    /// What the machine has.
    allocatable: i64,
    /// The pool's overcommit ratio for it.
    ratio: f64,
    /// What placement may hand out: `floor(allocatable * ratio)`.
    limit: i64,
    /// What allocations hold.
    allocated: i64,
    /// `limit - allocated`.
    free: i64,
}

impl From<fleet::NodeResource> for NodeResource {
    fn from(r: fleet::NodeResource) -> Self {
        let limit = (r.allocatable as f64 * r.ratio).floor() as i64;
        NodeResource {
            resource: r.resource.into(),
            allocatable: r.allocatable,
            ratio: r.ratio,
            limit,
            allocated: r.allocated,
            free: limit - r.allocated,
        }
    }
}

/// A machine in a pool (`nodes` in SQL), with its subtree when the connection that returned it
/// loaded it ahead (see [`prefetch_nodes`]).
pub struct ComputeNodeObj(pub fleet::Node, pub Option<Arc<NodeSubtree>>);

impl ComputeNodeObj {
    /// A node without a prefetched subtree: children come through the loaders.
    pub fn new(node: fleet::Node) -> Self {
        ComputeNodeObj(node, None)
    }
}

/// The devices, atoms and resources of a page of nodes, loaded for the whole page at once: one
/// statement each, all three keyed by node and run in parallel. Each node's children are built
/// once, as the graph's objects, and shared with its fields (`Arc<[…]>`): a page of 800 GPUs is
/// not copied again to be resolved.
#[derive(Default)]
pub struct NodeSubtree {
    devices: HashMap<NodeId, Arc<[DeviceObj]>>,
    resources: Option<HashMap<NodeId, Arc<[NodeResource]>>>,
}

/// Loads, for a page of nodes, the children the query selects below them, keyed by node through
/// the loaders (so sibling pages batch together too). Resolving each node's children
/// separately would leave the batching to timing: lists longer than 32 are polled in slices, and
/// a slice that comes late misses the batch.
async fn prefetch_nodes(
    ctx: &Context<'_>,
    nodes: &[fleet::Node],
) -> GqlResult<Option<Arc<NodeSubtree>>> {
    let look = ctx.look_ahead();
    let selections = [look.field("edges").field("node"), look.field("nodes")];
    let wants = |path: &[&str]| {
        selections.iter().any(|s| {
            let mut f = s.field(path[0]);
            for p in &path[1..] {
                f = f.field(p);
            }
            f.exists()
        })
    };
    let (want_devices, want_atoms, want_resources) = (
        wants(&["devices"]),
        wants(&["devices", "atoms"]),
        wants(&["resources"]),
    );
    if nodes.is_empty() || !(want_devices || want_resources) {
        return Ok(None);
    }
    let loaders = loaders_of(ctx)?;
    let node_ids = || nodes.iter().map(|n| n.id.clone());
    let devices = async {
        if want_devices {
            loaders.load_many(node_ids().map(DevicesOfNode)).await
        } else {
            Ok(HashMap::new())
        }
    };
    let resources = async {
        if want_resources {
            loaders
                .load_many(node_ids().map(ResourcesOfNode))
                .await
                .map(Some)
        } else {
            Ok(None)
        }
    };
    // A node's atoms are read by node, beside its devices, not after them: the three statements
    // run at once on three connections.
    let atoms = async {
        if want_atoms {
            loaders
                .load_many(node_ids().map(AtomsOfNode))
                .await
                .map(Some)
        } else {
            Ok(None)
        }
    };
    let (devices, resources, atoms) =
        futures_util::future::try_join3(devices, resources, atoms).await?;
    let mut atoms = atoms.map(|by_node| {
        let mut by_device: HashMap<DeviceId, Vec<AtomObj>> = HashMap::new();
        for atom in by_node.into_values().flatten() {
            by_device
                .entry(atom.device_id.clone())
                .or_default()
                .push(AtomObj(atom));
        }
        by_device
    });
    let devices = devices
        .into_iter()
        .map(|(node, devices)| {
            let objects = devices.into_iter().map(|d| {
                let own = atoms
                    .as_mut()
                    .map(|a| a.remove(&d.id).unwrap_or_default().into());
                DeviceObj(d, own)
            });
            (node.0, objects.collect())
        })
        .collect();
    Ok(Some(Arc::new(NodeSubtree {
        devices,
        resources: resources.map(|r| {
            r.into_iter()
                .map(|(k, v)| (k.0, v.into_iter().map(NodeResource::from).collect()))
                .collect()
        }),
    })))
}

/// A page of nodes as a connection, with their subtree loaded ahead.
async fn node_connection(
    ctx: &Context<'_>,
    page: Page<fleet::Node>,
    count: CountOf,
) -> GqlResult<Conn<ComputeNodeObj>> {
    let subtree = prefetch_nodes(ctx, &page.items).await?;
    Ok(connection(
        page,
        count,
        |n| n.id.as_str(),
        |n| ComputeNodeObj(n, subtree.clone()),
    ))
}

/// A taint as the graph shows it.
pub(crate) fn taint(key: String, value: String, effect: TaintEffect) -> Taint {
    Taint { key, value, effect }
}

pub(crate) fn labels_of(labels: &m::Labels) -> Vec<Label> {
    labels
        .iter()
        .map(|(k, v)| Label {
            key: k.clone(),
            value: v.clone(),
        })
        .collect()
}

/// A machine in a pool: its resources, GPUs, labels, taints, state and conditions.
#[Object(name = "ComputeNode")]
impl ComputeNodeObj {
    /// The node's id (`node_…`).
    pub async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// Host name, unique in the fleet.
    async fn hostname(&self) -> &str {
        &self.0.hostname
    }
    /// Labels, sorted by key.
    async fn labels(&self) -> Vec<Label> {
        labels_of(&self.0.labels)
    }
    /// Its taints: placement avoids them unless tolerated.
    async fn taints(&self) -> Vec<Taint> {
        self.0
            .taints
            .iter()
            .map(|t| Taint {
                key: t.key.clone(),
                value: t.value.clone(),
                effect: t.effect.into(),
            })
            .collect()
    }
    /// Whether the node takes no new work.
    async fn cordoned(&self) -> bool {
        self.0.cordoned
    }
    /// Why it was cordoned.
    async fn cordon_reason(&self) -> Option<&str> {
        self.0.cordon_reason.as_deref()
    }
    /// Where the node is in its life.
    async fn lifecycle(&self) -> NodeLifecycle {
        self.0.lifecycle.into()
    }
    /// Whether its daemon talks to the control plane.
    async fn reachability(&self) -> Reachability {
        self.0.reachability.into()
    }
    /// Its conditions, such as `NodeUnreachable`.
    async fn conditions(&self) -> Vec<Condition> {
        conditions_of(&self.0.conditions)
    }
    /// Why placement skips this node, if it does: empty when it takes new work. `DISCONNECTED`
    /// nodes still take work (disconnected is not dead); `UNREACHABLE` and `LOST` ones do not.
    async fn no_schedule_reasons(&self) -> Vec<NoScheduleReason> {
        let mut reasons = Vec::new();
        match self.0.lifecycle {
            fleet::state::NodeLifecycle::Retired => reasons.push(NoScheduleReason::Retired),
            fleet::state::NodeLifecycle::Cordoned => reasons.push(NoScheduleReason::Cordoned),
            fleet::state::NodeLifecycle::Active => {}
        }
        match self.0.reachability {
            fleet::model::Reachability::Unreachable => reasons.push(NoScheduleReason::Unreachable),
            fleet::model::Reachability::Lost => reasons.push(NoScheduleReason::Lost),
            _ => {}
        }
        reasons
    }
    /// While `DISCONNECTED`: when the liveness reconciler makes it `UNREACHABLE` (40 s without
    /// a session plus the grace of why it disconnected; docs/nodes.md). Operators only.
    async fn unreachable_at(&self, ctx: &Context<'_>) -> GqlResult<Option<DateTime<Utc>>> {
        crate::graph::context::require_operator(ctx)?;
        Ok(match self.0.reachability {
            fleet::model::Reachability::Disconnected => Some(
                self.0
                    .unreachable_at
                    .unwrap_or(self.0.joined_at + chrono::Duration::seconds(40)),
            ),
            _ => None,
        })
    }
    /// What its daemon last reported of the machine (hostname, vCPU, memory, disk, GPUs with
    /// their PCI bus ids and MIG instances), as `compute-agent inventory` prints it; null until a
    /// daemon reported. Operators only. The `InventoryMismatch` condition says how it differs
    /// from the registration.
    async fn inventory(
        &self,
        ctx: &Context<'_>,
    ) -> GqlResult<Option<async_graphql::Json<compute_protocol::Inventory>>> {
        crate::graph::context::require_operator(ctx)?;
        Ok(self
            .0
            .inventory
            .as_ref()
            .map(|i| async_graphql::Json(i.0.clone())))
    }
    /// When its daemon last reported its inventory. Operators only.
    async fn inventory_reported_at(&self, ctx: &Context<'_>) -> GqlResult<Option<DateTime<Utc>>> {
        crate::graph::context::require_operator(ctx)?;
        Ok(self.0.inventory_at)
    }
    /// Since when its reachability is what it is (its join when it never changed).
    async fn reachability_since(&self) -> DateTime<Utc> {
        self.0.reachability_since.unwrap_or(self.0.joined_at)
    }
    /// The daemon's session: open, or the last one closed; none if it never connected.
    /// Operators only.
    async fn session(&self, ctx: &Context<'_>) -> GqlResult<Option<NodeSession>> {
        crate::graph::context::require_operator(ctx)?;
        Ok(loaders_of(ctx)?
            .load_one(crate::graph::loaders::SessionOfNode(self.0.id.clone()))
            .await?
            .and_then(|mut v| v.pop())
            .map(NodeSession))
    }
    /// Commands to this node's daemon, oldest first (`last:` for the newest). Operators only.
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn commands(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only commands in this state.")] state: Option<
            crate::graph::commands::CommandState,
        >,
        #[graphql(desc = "Only commands of this kind.")] kind: Option<
            crate::graph::commands::CommandKind,
        >,
        #[graphql(
            desc = "At most this many items from the start, or after `after`: 0 to 100 (50 when neither `first` nor `last` is given)."
        )]
        first: Option<i32>,
        #[graphql(desc = "Only items after this cursor (an edge's `cursor`).")] after: Option<
            String,
        >,
        #[graphql(desc = "At most this many items from the end, or before `before`: 0 to 100.")]
        last: Option<i32>,
        #[graphql(desc = "Only items before this cursor (an edge's `cursor`).")] before: Option<
            String,
        >,
    ) -> GqlResult<
        async_graphql::connection::Connection<
            String,
            crate::graph::commands::CommandObj,
            crate::graph::commands::CommandCount,
        >,
    > {
        let filter = compute_domain::node_commands::CommandFilter {
            node_id: Some(self.0.id.clone()),
            state: state.map(Into::into),
            kind: kind.map(Into::into),
        };
        crate::graph::commands::page(
            ctx,
            filter,
            crate::graph::common::page_request(first, after, last, before),
        )
        .await
    }
    /// The generation of the node's spec; moves with every spec change.
    async fn generation(&self) -> i64 {
        self.0.generation
    }
    /// The generation the node's daemon last applied.
    async fn observed_generation(&self) -> i64 {
        self.0.observed_generation
    }
    /// When it joined.
    async fn joined_at(&self) -> DateTime<Utc> {
        self.0.joined_at
    }
    /// When it was retired.
    async fn retired_at(&self) -> Option<DateTime<Utc>> {
        self.0.retired_at
    }
    /// Optimistic-concurrency version.
    async fn version(&self) -> i64 {
        self.0.version
    }
    /// When it last changed.
    async fn updated_at(&self) -> DateTime<Utc> {
        self.0.updated_at
    }
    /// Its pool.
    async fn pool(&self, ctx: &Context<'_>) -> GqlResult<PoolObj> {
        loaders_of(ctx)?
            .load_one(self.0.pool_id.clone())
            .await?
            .map(PoolObj)
            .ok_or_else(|| gql_error(Error::internal("a node without its pool")))
    }
    /// vCPU, memory and disk.
    async fn resources(&self, ctx: &Context<'_>) -> GqlResult<Arc<[NodeResource]>> {
        if let Some(prefetched) = self.1.as_ref().and_then(|t| t.resources.as_ref()) {
            return Ok(prefetched
                .get(&self.0.id)
                .cloned()
                .unwrap_or_else(|| Arc::new([])));
        }
        Ok(loaders_of(ctx)?
            .load_one(ResourcesOfNode(self.0.id.clone()))
            .await?
            .unwrap_or_default()
            .into_iter()
            .map(NodeResource::from)
            .collect())
    }
    /// Its GPUs.
    // Priced by its entry in `graph::cost::RULES`.
    async fn devices(&self, ctx: &Context<'_>) -> GqlResult<Arc<[DeviceObj]>> {
        if let Some(tree) = &self.1
            && let Some(devices) = tree.devices.get(&self.0.id)
        {
            return Ok(devices.clone());
        }
        Ok(loaders_of(ctx)?
            .load_one(DevicesOfNode(self.0.id.clone()))
            .await?
            .unwrap_or_default()
            .into_iter()
            .map(DeviceObj::new)
            .collect())
    }
}

/// Why placement skips a node.
#[derive(Enum, Copy, Clone, Debug, PartialEq, Eq)]
pub enum NoScheduleReason {
    /// An operator cordoned it.
    Cordoned,
    /// It was retired.
    Retired,
    /// Its daemon has had no session for 40 s and the grace (docs/nodes.md).
    Unreachable,
    /// Unreachable past its pool's `lostAfterSeconds`; its reservations failed.
    Lost,
}

/// A node daemon's session with a gateway (`docs/agent-protocol.md`).
pub struct NodeSession(compute_domain::sessions::Session);

/// A node daemon's session with a gateway: open, or the last one closed
/// (`docs/agent-protocol.md`).
#[Object]
impl NodeSession {
    /// The session's epoch: it grows with every session the node opens.
    async fn epoch(&self) -> i64 {
        self.0.session_epoch
    }
    /// The gateway holding it (its lease is `gateway:<id>`).
    async fn gateway_id(&self) -> &str {
        self.0.gateway.as_str()
    }
    /// Whether it is open.
    async fn open(&self) -> bool {
        self.0.closed_at.is_none()
    }
    /// When it opened.
    async fn connected_since(&self) -> DateTime<Utc> {
        self.0.opened_at
    }
    /// When it closed.
    async fn closed_at(&self) -> Option<DateTime<Utc>> {
        self.0.closed_at
    }
    /// Why it closed: `daemon_closed`, `silent`, `superseded`, `gateway_lost`,
    /// `gateway_stopped`, `node_retired` or `protocol_error`.
    async fn close_reason(&self) -> Option<&str> {
        self.0.close_reason.map(|r| r.as_str())
    }
    /// The daemon's version.
    async fn daemon_version(&self) -> &str {
        &self.0.daemon_version
    }
    /// The daemon's journal id: a new one means the daemon lost its memory.
    async fn journal_id(&self) -> &str {
        &self.0.journal_id
    }
    /// When the daemon was last heard from, as its gateway reported (ages, not timestamps).
    async fn last_seen_at(&self) -> DateTime<Utc> {
        self.0.last_seen_at
    }
    /// Seconds since the daemon was last heard from, when this was read.
    async fn seconds_since_last_seen(&self) -> f64 {
        self.0.seconds_since_seen
    }
}

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

/// A quota limit of a tenant on a pool or site, with what is used of it.
#[derive(SimpleObject)]
#[graphql(complex)]
pub struct Quota {
    /// The tenant.
    tenant_id: String,
    /// The pool or site id it applies to.
    scope_id: ID,
    /// `GPUS` (whole GPUs; MIG instances and slots count as fractions), `VCPU` or `MEMORY_MIB`.
    resource: QuotaResource,
    /// The limit.
    max: f64,
    /// What reservations hold.
    used: f64,
    /// Optimistic-concurrency version.
    version: i64,
    #[graphql(skip)]
    scope_kind: String,
}

#[ComplexObject]
impl Quota {
    /// Whether the scope is a `POOL` or a `SITE`.
    async fn scope_kind(&self) -> &str {
        &self.scope_kind
    }
}

/// A resource a quota limits.
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum QuotaResource {
    /// GPUs, fractions for MIG instances and slots.
    Gpus,
    /// Virtual CPUs.
    Vcpu,
    /// Memory in MiB.
    MemoryMib,
}

pub fn quota_obj(q: compute_domain::quota::Quota) -> Quota {
    Quota {
        tenant_id: q.tenant_id.to_string(),
        scope_id: ID(q.scope.to_string()),
        resource: match q.resource {
            compute_domain::quota::QuotaResource::Gpu => QuotaResource::Gpus,
            compute_domain::quota::QuotaResource::Vcpu => QuotaResource::Vcpu,
            compute_domain::quota::QuotaResource::MemoryMib => QuotaResource::MemoryMib,
        },
        max: q.max_amount,
        used: q.used,
        version: q.version,
        scope_kind: q.scope.kind().to_uppercase(),
    }
}

/// The fleet's queries.
#[derive(Default)]
pub struct FleetQuery;

/// The fleet's queries.
#[Object]
impl FleetQuery {
    /// Any object by its global id. Members see sites and pools; another tenant's object, or an
    /// object a member may not see, is `NOT_FOUND`.
    async fn node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
    ) -> GqlResult<Option<NodeInterface>> {
        let operator = require_viewer(ctx)?;
        let found = load_node(ctx, &id, operator).await?;
        match found {
            Some(n) => Ok(Some(n)),
            None => Err(gql_error(Error::NotFound {
                kind: "object",
                id: id.to_string(),
            })),
        }
    }

    /// Many objects by their global ids, in order; `null` for each id that does not exist or is
    /// not visible to the caller.
    // Priced by its entry in `graph::cost::RULES`.
    async fn nodes(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Global ids, at most 100; the answer keeps their order.")] ids: Vec<ID>,
    ) -> GqlResult<Vec<Option<NodeInterface>>> {
        let operator = require_viewer(ctx)?;
        if ids.len() > 100 {
            return Err(gql_error(Error::bad_input(
                "ids",
                "at most 100 ids at once",
            )));
        }
        let mut out = Vec::with_capacity(ids.len());
        let futures = ids.iter().map(|id| load_node(ctx, id, operator));
        for r in futures_util::future::join_all(futures).await {
            out.push(r.ok().flatten());
        }
        Ok(out)
    }

    /// All sites.
    async fn sites(
        &self,
        ctx: &Context<'_>,
        #[graphql(
            desc = "At most this many items from the start, or after `after`: 0 to 100 (50 when neither `first` nor `last` is given)."
        )]
        first: Option<i32>,
        #[graphql(desc = "Only items after this cursor (an edge's `cursor`).")] after: Option<
            String,
        >,
        #[graphql(desc = "At most this many items from the end, or before `before`: 0 to 100.")]
        last: Option<i32>,
        #[graphql(desc = "Only items before this cursor (an edge's `cursor`).")] before: Option<
            String,
        >,
    ) -> GqlResult<Conn<SiteObj>> {
        require_viewer(ctx)?;
        let args = page_request(first, after, last, before).resolve()?;
        let page = fleet::list_sites(db(ctx)?, &args).await?;
        Ok(connection(page, CountOf::Sites, |s| s.id.as_str(), SiteObj))
    }

    /// Pools, optionally of one site or kind.
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn pools(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only those of this site.")] site_id: Option<ID>,
        #[graphql(desc = "Only pools of this kind.")] kind: Option<PoolKind>,
        #[graphql(
            desc = "At most this many items from the start, or after `after`: 0 to 100 (50 when neither `first` nor `last` is given)."
        )]
        first: Option<i32>,
        #[graphql(desc = "Only items after this cursor (an edge's `cursor`).")] after: Option<
            String,
        >,
        #[graphql(desc = "At most this many items from the end, or before `before`: 0 to 100.")]
        last: Option<i32>,
        #[graphql(desc = "Only items before this cursor (an edge's `cursor`).")] before: Option<
            String,
        >,
    ) -> GqlResult<Conn<PoolObj>> {
        require_viewer(ctx)?;
        let filter = PoolFilter {
            site_id: opt_id::<SiteId>("siteId", site_id.as_ref())?,
            kind: kind.map(Into::into),
        };
        let args = page_request(first, after, last, before).resolve()?;
        let page = fleet::list_pools(db(ctx)?, &filter, &args).await?;
        Ok(connection(
            page,
            CountOf::Pools(filter),
            |p| p.id.as_str(),
            PoolObj,
        ))
    }

    /// Compute nodes (operators only). Retired nodes are left out unless `includeRetired`.
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn compute_nodes(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only those of this site.")] site_id: Option<ID>,
        #[graphql(desc = "Only those of this pool.")] pool_id: Option<ID>,
        #[graphql(desc = "Only nodes with this reachability.")] reachability: Option<Reachability>,
        #[graphql(desc = "Only cordoned (`true`) or schedulable (`false`) nodes.")]
        cordoned: Option<bool>,
        #[graphql(
            desc = "Only nodes with (true) or without (false) an atom placement could take now."
        )]
        has_free_capacity: Option<bool>,
        #[graphql(default = false, desc = "Retired nodes too.")] include_retired: bool,
        #[graphql(
            desc = "At most this many items from the start, or after `after`: 0 to 100 (50 when neither `first` nor `last` is given)."
        )]
        first: Option<i32>,
        #[graphql(desc = "Only items after this cursor (an edge's `cursor`).")] after: Option<
            String,
        >,
        #[graphql(desc = "At most this many items from the end, or before `before`: 0 to 100.")]
        last: Option<i32>,
        #[graphql(desc = "Only items before this cursor (an edge's `cursor`).")] before: Option<
            String,
        >,
    ) -> GqlResult<Conn<ComputeNodeObj>> {
        require_operator(ctx)?;
        let filter = NodeFilter {
            site_id: opt_id::<SiteId>("siteId", site_id.as_ref())?,
            pool_id: opt_id::<PoolId>("poolId", pool_id.as_ref())?,
            reachability: reachability.map(Into::into),
            cordoned,
            has_free_capacity,
            include_retired,
        };
        let args = page_request(first, after, last, before).resolve()?;
        let page = fleet::list_nodes(db(ctx)?, &filter, &args).await?;
        node_connection(ctx, page, CountOf::Nodes(filter)).await
    }

    /// GPUs (operators only).
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn devices(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only those of this site.")] site_id: Option<ID>,
        #[graphql(desc = "Only those of this pool.")] pool_id: Option<ID>,
        #[graphql(desc = "Only those of this compute node.")] compute_node_id: Option<ID>,
        #[graphql(desc = "Only GPUs of this model.")] model: Option<String>,
        #[graphql(desc = "Only GPUs in this mode.")] mode: Option<DeviceMode>,
        #[graphql(desc = "Only GPUs with this health.")] health: Option<DeviceHealth>,
        #[graphql(
            desc = "At most this many items from the start, or after `after`: 0 to 100 (50 when neither `first` nor `last` is given)."
        )]
        first: Option<i32>,
        #[graphql(desc = "Only items after this cursor (an edge's `cursor`).")] after: Option<
            String,
        >,
        #[graphql(desc = "At most this many items from the end, or before `before`: 0 to 100.")]
        last: Option<i32>,
        #[graphql(desc = "Only items before this cursor (an edge's `cursor`).")] before: Option<
            String,
        >,
    ) -> GqlResult<Conn<DeviceObj>> {
        require_operator(ctx)?;
        let filter = DeviceFilter {
            site_id: opt_id::<SiteId>("siteId", site_id.as_ref())?,
            pool_id: opt_id::<PoolId>("poolId", pool_id.as_ref())?,
            node_id: opt_id::<NodeId>("computeNodeId", compute_node_id.as_ref())?,
            model: model
                .as_deref()
                .map(|m| m::parse_name("model", m))
                .transpose()?,
            mode: mode.map(Into::into),
            health: health.map(Into::into),
        };
        let args = page_request(first, after, last, before).resolve()?;
        let page = fleet::list_devices(db(ctx)?, &filter, &args).await?;
        Ok(connection(
            page,
            CountOf::Devices(filter),
            |d| d.id.as_str(),
            DeviceObj::new,
        ))
    }

    /// Bookable atoms (operators only).
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn atoms(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only those of this pool.")] pool_id: Option<ID>,
        #[graphql(desc = "Only those of this GPU.")] device_id: Option<ID>,
        #[graphql(desc = "Only GPUs of this model.")] model: Option<String>,
        #[graphql(desc = "Only atoms of this kind.")] kind: Option<AtomKind>,
        #[graphql(desc = "Only MIG instances of this profile.")] profile: Option<String>,
        #[graphql(
            desc = "Only atoms placement could take now (true), or only the others (false)."
        )]
        free: Option<bool>,
        #[graphql(
            desc = "At most this many items from the start, or after `after`: 0 to 100 (50 when neither `first` nor `last` is given)."
        )]
        first: Option<i32>,
        #[graphql(desc = "Only items after this cursor (an edge's `cursor`).")] after: Option<
            String,
        >,
        #[graphql(desc = "At most this many items from the end, or before `before`: 0 to 100.")]
        last: Option<i32>,
        #[graphql(desc = "Only items before this cursor (an edge's `cursor`).")] before: Option<
            String,
        >,
    ) -> GqlResult<Conn<AtomObj>> {
        require_operator(ctx)?;
        let filter = AtomFilter {
            pool_id: opt_id::<PoolId>("poolId", pool_id.as_ref())?,
            device_id: opt_id::<DeviceId>("deviceId", device_id.as_ref())?,
            model: model
                .as_deref()
                .map(|m| m::parse_name("model", m))
                .transpose()?,
            kind: kind.map(Into::into),
            profile: profile
                .as_deref()
                .map(|p| m::parse_name("profile", p))
                .transpose()?,
            free_now: free,
        };
        let args = page_request(first, after, last, before).resolve()?;
        let page = fleet::list_atoms(db(ctx)?, &filter, &args).await?;
        Ok(connection(
            page,
            CountOf::Atoms(filter),
            |a| a.name.as_str(),
            AtomObj,
        ))
    }

    /// Quotas of a tenant. Members see only their own tenant's; operators any tenant's.
    async fn quotas(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The tenant whose quotas to list; members may name only their own.")]
        tenant_id: Option<String>,
    ) -> GqlResult<Vec<Quota>> {
        let actor = actor(ctx)?;
        let tenant = match tenant_id {
            Some(t) => TenantId::parse("tenantId", &t)?,
            None => actor.tenant.clone().ok_or_else(|| {
                gql_error(Error::bad_input(
                    "tenantId",
                    "give `tenantId`: your token has no tenant",
                ))
            })?,
        };
        if !actor.may_access(&tenant) {
            return Ok(Vec::new());
        }
        let rows = compute_domain::quota::quotas_of(db(ctx)?, &tenant).await?;
        Ok(rows.into_iter().map(quota_obj).collect())
    }
}
