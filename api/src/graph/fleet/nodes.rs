//! Compute nodes in the graph: labels, taints, resources, sessions, why a node takes no work,
//! and the prefetched subtree of a page of nodes.

use super::*;

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
pub(super) async fn node_connection(
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
pub struct NodeSession(compute_domain::node_sessions::Session);

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
