//! The Relay `Node` interface: every object with a global id.

use async_graphql::{Context, ID, Interface};
use compute_domain::Error;

use crate::graph::fleet::{ComputeNodeObj, DeviceObj, PoolObj, SiteObj};
use crate::graph::gql_error;
use crate::graph::loaders::*;
use crate::graph::reservations::ReservationObj;

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
}

/// Loads an object by global id, as the caller may see it.
pub async fn load_node(
    ctx: &Context<'_>,
    id: &ID,
    operator: bool,
) -> async_graphql::Result<Option<NodeInterface>> {
    let loaders = loaders_of(ctx)?;
    let prefix = compute_domain::ids::prefix_of(id.as_str()).ok_or_else(|| {
        gql_error(Error::bad_input(
            "id",
            format!("`{}` is not an id of this API", id.as_str()),
        ))
    })?;
    let key = id.to_string();
    Ok(match prefix {
        "site" => loaders
            .load_one(SiteId(key))
            .await?
            .map(|s| NodeInterface::Site(SiteObj(s))),
        "pool" => loaders
            .load_one(PoolId(key))
            .await?
            .map(|p| NodeInterface::Pool(PoolObj(p))),
        "node" if operator => loaders
            .load_one(NodeId(key))
            .await?
            .map(|n| NodeInterface::ComputeNode(ComputeNodeObj::new(n))),
        "dev" if operator => loaders
            .load_one(DeviceId(key))
            .await?
            .map(|d| NodeInterface::Device(DeviceObj::new(d))),
        "rsv" => match loaders.load_one(ReservationId(key)).await? {
            Some(r) if crate::graph::reservations::visible(ctx, &r)? => {
                Some(NodeInterface::Reservation(ReservationObj(r)))
            }
            _ => None,
        },
        _ => None,
    })
}
