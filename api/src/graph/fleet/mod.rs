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

use crate::graph::common::*;
use crate::graph::loaders::*;
use crate::graph::{GqlResult, actor, db, gql_error, require_operator, require_viewer};

mod devices;
pub mod enrollment;
pub mod mutations;
mod nodes;
mod quotas;
mod sites;

pub use devices::{AtomObj, DeviceObj};
pub use nodes::*;
pub use quotas::*;
pub use sites::*;

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

/// The fleet's queries.
#[derive(Default)]
pub struct FleetQuery;

/// The fleet's queries.
#[Object]
impl FleetQuery {
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
