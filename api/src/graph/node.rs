//! The Relay `Node` interface: every object with a global id.

use async_graphql::{Context, ID, Interface};
use compute_domain::Error;
use compute_domain::ids::{CommandId, DeviceId, InstanceId, NodeId, PoolId, ReservationId, SiteId};

use crate::graph::commands::CommandObj;
use crate::graph::fleet::{ComputeNodeObj, DeviceObj, PoolObj, SiteObj};
use crate::graph::instances::InstanceObj;
use crate::graph::loaders::*;
use crate::graph::reservations::ReservationObj;
use crate::graph::{GqlResult, gql_error};

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
