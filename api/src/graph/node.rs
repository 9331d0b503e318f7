//! The Relay `Node` interface (every object with a global id) and its roots, `node(id:)` and
//! `nodes(ids:)`: the one module that knows every object type, so no object's module needs it.

use async_graphql::{Context, ID, Interface, Object};
use compute_domain::Error;
use compute_domain::ids::{CommandId, DeviceId, InstanceId, NodeId, PoolId, ReservationId, SiteId};

use crate::graph::commands::CommandObj;
use crate::graph::fleet::{ComputeNodeObj, DeviceObj, PoolObj, SiteObj};
use crate::graph::instances::InstanceObj;
use crate::graph::loaders::*;
use crate::graph::reservations::ReservationObj;
use crate::graph::{GqlResult, gql_error, require_viewer};

/// Any object with a global id (Relay).
#[derive(Interface)]
#[graphql(
    name = "Node",
    field(
        name = "id",
        ty = "ID",
        desc = "The object's global id: a type prefix and a time-ordered body."
    )
)]
pub enum NodeInterface {
    Site(SiteObj),
    Pool(PoolObj),
    ComputeNode(ComputeNodeObj),
    Device(DeviceObj),
    Reservation(ReservationObj),
    Command(CommandObj),
    Instance(InstanceObj),
}

/// Loads an object by global id, as the caller may see it.
pub async fn load_node(
    ctx: &Context<'_>,
    id: &ID,
    operator: bool,
) -> GqlResult<Option<NodeInterface>> {
    let loaders = loaders_of(ctx)?;
    let prefix = compute_domain::ids::prefix_of(id.as_str()).ok_or_else(|| {
        gql_error(Error::bad_input(
            "id",
            format!("`{}` is not an id of this API", id.as_str()),
        ))
    })?;
    let key = id.as_str();
    Ok(match prefix {
        SiteId::PREFIX => loaders
            .load_one(SiteId::parse("id", key)?)
            .await?
            .map(|s| NodeInterface::Site(SiteObj(s))),
        PoolId::PREFIX => loaders
            .load_one(PoolId::parse("id", key)?)
            .await?
            .map(|p| NodeInterface::Pool(PoolObj(p))),
        NodeId::PREFIX if operator => loaders
            .load_one(NodeId::parse("id", key)?)
            .await?
            .map(|n| NodeInterface::ComputeNode(ComputeNodeObj::new(n))),
        DeviceId::PREFIX if operator => loaders
            .load_one(DeviceId::parse("id", key)?)
            .await?
            .map(|d| NodeInterface::Device(DeviceObj::new(d))),
        CommandId::PREFIX if operator => loaders
            .load_one(CommandId::parse("id", key)?)
            .await?
            .map(|c| NodeInterface::Command(CommandObj(c))),
        InstanceId::PREFIX => match loaders.load_one(InstanceId::parse("id", key)?).await? {
            Some(i) if crate::graph::instances::visible(ctx, &i)? => {
                Some(NodeInterface::Instance(InstanceObj(i)))
            }
            _ => None,
        },
        ReservationId::PREFIX => match loaders.load_one(ReservationId::parse("id", key)?).await? {
            Some(r) if crate::graph::reservations::visible(ctx, &r)? => {
                Some(NodeInterface::Reservation(ReservationObj(r)))
            }
            _ => None,
        },
        _ => None,
    })
}

/// The Relay roots.
#[derive(Default)]
pub struct NodeQuery;

/// The Relay roots.
#[Object]
impl NodeQuery {
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
}
