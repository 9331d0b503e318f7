//! Data loaders: every parent-to-child edge of the graph is loaded in one statement per level,
//! whatever the number of parents. One loader serves the whole process without a cache (it only
//! batches), so a long-lived WebSocket never sees stale rows.

use std::collections::HashMap;

use async_graphql::dataloader::{DataLoader, Loader, NoCache};
use compute_domain::db::Db;
use compute_domain::fleet::model::Window;
use compute_domain::fleet::{
    self, Atom, CapacityRow, CapacityScope, Device, Node, NodeResource, Pool, Site,
};
use compute_domain::page::{Page, PageArgs};

use crate::graph::gql_error;

/// The loader behind every key type below.
pub struct FleetLoader {
    db: Db,
}

/// The process's loader.
pub type Loaders = DataLoader<FleetLoader, NoCache>;

/// The request's loaders; `INTERNAL` only when the schema was built without a database (a bug
/// of ours: `compute-api schema` builds one only to print it).
pub fn loaders_of<'a>(ctx: &'a async_graphql::Context<'_>) -> async_graphql::Result<&'a Loaders> {
    ctx.data::<Loaders>().map_err(|_| {
        crate::graph::gql_error(compute_domain::Error::internal(
            "the schema was built without its data loaders",
        ))
    })
}

/// Builds the loader; needs a Tokio runtime.
pub fn loaders(db: Db) -> Loaders {
    DataLoader::with_cache(FleetLoader { db }, tokio::spawn, NoCache)
}

type LoadResult<K, V> = Result<HashMap<K, V>, async_graphql::Error>;

fn ids<K: Clone, F: Fn(&K) -> String>(keys: &[K], f: F) -> Vec<String> {
    let mut v: Vec<String> = keys.iter().map(f).collect();
    v.sort();
    v.dedup();
    v
}

macro_rules! by_id {
    ($key:ident, $value:ty, $fetch:path) => {
        /// An entity by its id.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $key(pub String);

        impl Loader<$key> for FleetLoader {
            type Value = $value;
            type Error = async_graphql::Error;

            async fn load(&self, keys: &[$key]) -> LoadResult<$key, $value> {
                let rows = $fetch(&self.db, &ids(keys, |k| k.0.clone()))
                    .await
                    .map_err(gql_error)?;
                Ok(rows.into_iter().map(|r| ($key(r.id.clone()), r)).collect())
            }
        }
    };
}

by_id!(SiteId, Site, fleet::get_sites);
by_id!(PoolId, Pool, fleet::get_pools);
by_id!(NodeId, Node, fleet::get_nodes);
by_id!(DeviceId, Device, fleet::get_devices);

macro_rules! children {
    ($key:ident, $value:ty, $fetch:path, $parent:ident) => {
        /// The children of one parent.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $key(pub String);

        impl Loader<$key> for FleetLoader {
            type Value = Vec<$value>;
            type Error = async_graphql::Error;

            async fn load(&self, keys: &[$key]) -> LoadResult<$key, Vec<$value>> {
                let rows = $fetch(&self.db, &ids(keys, |k| k.0.clone()))
                    .await
                    .map_err(gql_error)?;
                let mut out: HashMap<$key, Vec<$value>> =
                    keys.iter().map(|k| (k.clone(), Vec::new())).collect();
                for row in rows {
                    out.entry($key(row.$parent.clone())).or_default().push(row);
                }
                Ok(out)
            }
        }
    };
}

children!(DevicesOfNode, Device, fleet::devices_by_nodes, node_id);
children!(AtomsOfDevice, Atom, fleet::atoms_by_devices, device_id);
children!(
    ResourcesOfNode,
    NodeResource,
    fleet::resources_by_nodes,
    node_id
);

/// Groups keys that share page arguments, so each group is one statement.
fn by_args<K, F: Fn(&K) -> (&String, &PageArgs)>(
    keys: &[K],
    f: F,
) -> HashMap<PageArgs, Vec<String>> {
    let mut groups: HashMap<PageArgs, Vec<String>> = HashMap::new();
    for k in keys {
        let (id, args) = f(k);
        groups.entry(args.clone()).or_default().push(id.clone());
    }
    groups
}

macro_rules! nested_page {
    ($key:ident, $value:ty, $fetch:path) => {
        /// One page of a parent's children.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $key(pub String, pub PageArgs);

        impl Loader<$key> for FleetLoader {
            type Value = Page<$value>;
            type Error = async_graphql::Error;

            async fn load(&self, keys: &[$key]) -> LoadResult<$key, Page<$value>> {
                let mut out = HashMap::new();
                for (args, parents) in by_args(keys, |k| (&k.0, &k.1)) {
                    let pages = $fetch(&self.db, &parents, &args).await.map_err(gql_error)?;
                    for (parent, page) in pages {
                        out.insert($key(parent, args.clone()), page);
                    }
                }
                Ok(out)
            }
        }
    };
}

nested_page!(PoolsOfSite, Pool, fleet::pools_by_sites);
nested_page!(NodesOfPool, Node, fleet::nodes_by_pools);

macro_rules! child_count {
    ($key:ident, $fetch:path) => {
        /// How many children a parent has.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $key(pub String);

        impl Loader<$key> for FleetLoader {
            type Value = i64;
            type Error = async_graphql::Error;

            async fn load(&self, keys: &[$key]) -> LoadResult<$key, i64> {
                let counts = $fetch(&self.db, &ids(keys, |k| k.0.clone()))
                    .await
                    .map_err(gql_error)?;
                Ok(keys
                    .iter()
                    .map(|k| (k.clone(), counts.get(&k.0).copied().unwrap_or(0)))
                    .collect())
            }
        }
    };
}

child_count!(PoolCountOfSite, fleet::count_pools_by_sites);
child_count!(NodeCountOfPool, fleet::count_nodes_by_pools);

/// Capacity of a pool or site over a window (now when `None`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CapacityOf(pub CapacityScope, pub String, pub Option<Window>);

impl Loader<CapacityOf> for FleetLoader {
    type Value = Vec<CapacityRow>;
    type Error = async_graphql::Error;

    async fn load(&self, keys: &[CapacityOf]) -> LoadResult<CapacityOf, Vec<CapacityRow>> {
        let mut groups: HashMap<(CapacityScope, Option<Window>), Vec<String>> = HashMap::new();
        for k in keys {
            groups.entry((k.0, k.2)).or_default().push(k.1.clone());
        }
        let mut out: HashMap<CapacityOf, Vec<CapacityRow>> =
            keys.iter().map(|k| (k.clone(), Vec::new())).collect();
        for ((scope, window), scope_ids) in groups {
            for row in fleet::capacity(&self.db, scope, &scope_ids, window)
                .await
                .map_err(gql_error)?
            {
                out.entry(CapacityOf(scope, row.scope_id.clone(), window))
                    .or_default()
                    .push(row);
            }
        }
        Ok(out)
    }
}

/// A reservation by id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReservationId(pub String);

impl Loader<ReservationId> for FleetLoader {
    type Value = compute_domain::reservations::Reservation;
    type Error = async_graphql::Error;

    async fn load(&self, keys: &[ReservationId]) -> LoadResult<ReservationId, Self::Value> {
        let rows =
            compute_domain::reservations::get_reservations(&self.db, &ids(keys, |k| k.0.clone()))
                .await
                .map_err(gql_error)?;
        Ok(rows
            .into_iter()
            .map(|r| (ReservationId(r.id.clone()), r))
            .collect())
    }
}

children!(
    AllocationsOfReservation,
    compute_domain::reservations::Allocation,
    compute_domain::reservations::allocations_by_reservations,
    reservation_id
);
