//! Data loaders: every parent-to-child edge of the graph is loaded in one statement per level,
//! whatever the number of parents. Each request (each subscription) has loaders of its own
//! (`graph::with_loaders`): a batch never mixes two requests' keys, so one request's input can
//! neither fail nor change another's statement. They only batch, without a cache, so a
//! long-lived subscription never sees stale rows.

use std::collections::HashMap;

use async_graphql::dataloader::{DataLoader, Loader, NoCache};
use compute_domain::db::Db;
use compute_domain::fleet::model::Window;
use compute_domain::fleet::{self, Atom, CapacityRow, Device, Node, NodeResource, Pool, Site};
use compute_domain::ids::{
    CommandId, DeviceId, InstanceId, NodeId, PoolId, ReservationId, ScopeId, SiteId,
};
use compute_domain::page::{Page, PageArgs};
use compute_domain::task::AbortOnDrop;

use crate::graph::{GqlResult, gql_error};

/// The loader behind every key type below.
#[derive(Clone)]
pub struct FleetLoader {
    db: Db,
}

/// A request's loaders.
pub type Loaders = DataLoader<FleetLoader, NoCache>;

/// The request's loaders as `ctx`'s field uses them ([`Batch`]); `INTERNAL` only when a transport
/// ran a request without them (a bug of ours: every transport calls `graph::with_loaders`).
pub fn loaders_of<'a>(ctx: &'a async_graphql::Context<'_>) -> GqlResult<Batch<'a>> {
    let loaders = ctx.data::<RequestLoaders>().map_err(|_| {
        crate::graph::gql_error(compute_domain::Error::internal(
            "the request was run without its data loaders",
        ))
    })?;
    Ok(Batch {
        loaders: loaders.get(),
        once: resolved_once(ctx),
    })
}

/// Whether `ctx`'s field is resolved once in the response: no list above it (`node(id:)`, a
/// connection of the pool it returns, the page's node subtree). Such a field has no siblings
/// to batch with, so it need not wait the loader's batching delay (1 ms, once per level: a
/// tenth of a fleet page's time).
fn resolved_once(ctx: &async_graphql::Context<'_>) -> bool {
    let mut node = ctx.path_node.as_ref();
    while let Some(n) = node {
        if matches!(n.segment, async_graphql::QueryPathSegment::Index(_)) {
            return false;
        }
        node = n.parent;
    }
    true
}

/// The request's loaders for one field: a field under a list loads through the data loader,
/// batched with its siblings' keys (one statement per level, whatever the number of parents);
/// a field resolved once runs the same statement at once, with its own keys. The rows and the
/// answers are the same either way; only the wait differs. (Two aliased root fields load with a
/// statement each: bounded by the document, which the door bounds.) Either way the statement
/// runs on a task of its own, as the data loader's batches always did: the rows of a page's
/// devices, atoms and resources are decoded on both cores at once, not one after the other on
/// the request's task. A request that is dropped (its deadline passed, its client went away)
/// aborts the statements it started.
pub struct Batch<'a> {
    loaders: &'a Loaders,
    once: bool,
}

impl Batch<'_> {
    /// The value of `key`, if there is one.
    pub async fn load_one<K>(
        &self,
        key: K,
    ) -> Result<Option<<FleetLoader as Loader<K>>::Value>, async_graphql::Error>
    where
        K: Send + Sync + std::hash::Hash + Eq + Clone + 'static,
        FleetLoader: Loader<K, Error = async_graphql::Error>,
    {
        if self.once {
            let mut found = self.spawned(vec![key.clone()]).await?;
            Ok(found.remove(&key))
        } else {
            self.loaders.load_one(key).await
        }
    }

    /// The values of `keys` that have one.
    pub async fn load_many<K>(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<HashMap<K, <FleetLoader as Loader<K>>::Value>, async_graphql::Error>
    where
        K: Send + Sync + std::hash::Hash + Eq + Clone + 'static,
        FleetLoader: Loader<K, Error = async_graphql::Error>,
    {
        if self.once {
            let mut keys: Vec<K> = keys.into_iter().collect();
            let mut seen = std::collections::HashSet::new();
            keys.retain(|k| seen.insert(k.clone()));
            if keys.is_empty() {
                return Ok(HashMap::new());
            }
            self.spawned(keys).await
        } else {
            self.loaders.load_many(keys).await
        }
    }

    /// The statement for `keys`, run on a task of its own (aborted if this future is dropped).
    async fn spawned<K>(
        &self,
        keys: Vec<K>,
    ) -> Result<HashMap<K, <FleetLoader as Loader<K>>::Value>, async_graphql::Error>
    where
        K: Send + Sync + std::hash::Hash + Eq + Clone + 'static,
        FleetLoader: Loader<K, Error = async_graphql::Error>,
    {
        let loader = self.loaders.loader().clone();
        let task = AbortOnDrop::spawn(async move { loader.load(&keys).await });
        match task.join().await {
            Ok(found) => found,
            Err(e) => Err(gql_error(compute_domain::Error::internal(format!(
                "a loader's statement did not finish: {e}"
            )))
            .into()),
        }
    }
}

/// A request's loaders, made when a field first asks for them: a request that loads nothing
/// through them (`{ __typename }`, say) does not build and drop a data loader.
pub struct RequestLoaders {
    db: Db,
    loaders: std::sync::OnceLock<Loaders>,
}

impl RequestLoaders {
    /// The loaders; the first call builds them (it needs a Tokio runtime: batches are spawned).
    fn get(&self) -> &Loaders {
        self.loaders.get_or_init(|| {
            DataLoader::with_cache(
                FleetLoader {
                    db: self.db.clone(),
                },
                tokio::spawn,
                NoCache,
            )
        })
    }
}

/// A request's loaders over `db`, built on first use.
pub fn loaders(db: Db) -> RequestLoaders {
    RequestLoaders {
        db,
        loaders: std::sync::OnceLock::new(),
    }
}

type LoadResult<K, V> = Result<HashMap<K, V>, async_graphql::Error>;

/// The distinct ids of a batch, sorted (one statement binds them as an array).
fn ids<K, I: Clone + Ord, F: Fn(&K) -> &I>(keys: &[K], f: F) -> Vec<I> {
    let mut v: Vec<I> = keys.iter().map(|k| f(k).clone()).collect();
    v.sort();
    v.dedup();
    v
}

macro_rules! by_id {
    ($key:ty, $value:ty, $fetch:path) => {
        impl Loader<$key> for FleetLoader {
            type Value = $value;
            type Error = async_graphql::Error;

            async fn load(&self, keys: &[$key]) -> LoadResult<$key, $value> {
                let rows = $fetch(&self.db, &ids(keys, |k| k)).await?;
                Ok(rows.into_iter().map(|r| (r.id.clone(), r)).collect())
            }
        }
    };
}

by_id!(SiteId, Site, fleet::get_sites);
by_id!(PoolId, Pool, fleet::get_pools);
by_id!(NodeId, Node, fleet::get_nodes);
by_id!(DeviceId, Device, fleet::get_devices);
by_id!(
    InstanceId,
    compute_domain::instances::Instance,
    compute_domain::instances::get_instances
);
by_id!(
    CommandId,
    compute_domain::node_commands::Command,
    compute_domain::node_commands::get_commands
);
by_id!(
    ReservationId,
    compute_domain::reservations::Reservation,
    compute_domain::reservations::get_reservations
);

macro_rules! children {
    ($key:ident($parent_id:ty), $value:ty, $fetch:path, $parent:ident) => {
        /// The children of one parent.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $key(pub $parent_id);

        impl Loader<$key> for FleetLoader {
            type Value = Vec<$value>;
            type Error = async_graphql::Error;

            async fn load(&self, keys: &[$key]) -> LoadResult<$key, Vec<$value>> {
                let rows = $fetch(&self.db, &ids(keys, |k| &k.0)).await?;
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

children!(
    DevicesOfNode(NodeId),
    Device,
    fleet::devices_by_nodes,
    node_id
);
children!(
    AtomsOfDevice(DeviceId),
    Atom,
    fleet::atoms_by_devices,
    device_id
);
/// The atoms of one node's devices, in device then ordinal order: read beside the node's devices
/// rather than after them (one round trip less for a page of nodes).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AtomsOfNode(pub NodeId);

impl Loader<AtomsOfNode> for FleetLoader {
    type Value = Vec<Atom>;
    type Error = async_graphql::Error;

    async fn load(&self, keys: &[AtomsOfNode]) -> LoadResult<AtomsOfNode, Vec<Atom>> {
        let rows = fleet::atoms_by_nodes(&self.db, &ids(keys, |k| &k.0)).await?;
        let mut out: HashMap<AtomsOfNode, Vec<Atom>> =
            keys.iter().map(|k| (k.clone(), Vec::new())).collect();
        for (node, atom) in rows {
            out.entry(AtomsOfNode(node)).or_default().push(atom);
        }
        Ok(out)
    }
}
children!(
    ResourcesOfNode(NodeId),
    NodeResource,
    fleet::resources_by_nodes,
    node_id
);
children!(
    SessionOfNode(NodeId),
    compute_domain::node_sessions::Session,
    compute_domain::node_sessions::sessions_of,
    node_id
);
children!(
    AllocationsOfReservation(ReservationId),
    compute_domain::reservations::Allocation,
    compute_domain::reservations::allocations_by_reservations,
    reservation_id
);

/// The pool rules that admitted a reservation (`Reservation.admittedUnder`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AdmittedUnder(pub ReservationId);

impl Loader<AdmittedUnder> for FleetLoader {
    type Value = Option<compute_domain::fleet::PoolRules>;
    type Error = async_graphql::Error;

    async fn load(
        &self,
        keys: &[AdmittedUnder],
    ) -> LoadResult<AdmittedUnder, Option<compute_domain::fleet::PoolRules>> {
        let rows =
            compute_domain::reservations::admitted_under(&self.db, &ids(keys, |k| &k.0)).await?;
        Ok(rows
            .into_iter()
            .map(|(id, rules)| (AdmittedUnder(id), rules))
            .collect())
    }
}

/// Groups keys that share page arguments, so each group is one statement.
fn by_args<K, I: Clone, F: Fn(&K) -> (&I, &PageArgs)>(
    keys: &[K],
    f: F,
) -> HashMap<PageArgs, Vec<I>> {
    let mut groups: HashMap<PageArgs, Vec<I>> = HashMap::new();
    for k in keys {
        let (id, args) = f(k);
        groups.entry(args.clone()).or_default().push(id.clone());
    }
    groups
}

macro_rules! nested_page {
    ($key:ident($parent_id:ty), $value:ty, $fetch:path) => {
        /// One page of a parent's children.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $key(pub $parent_id, pub PageArgs);

        impl Loader<$key> for FleetLoader {
            type Value = Page<$value>;
            type Error = async_graphql::Error;

            async fn load(&self, keys: &[$key]) -> LoadResult<$key, Page<$value>> {
                let mut out = HashMap::new();
                for (args, parents) in by_args(keys, |k| (&k.0, &k.1)) {
                    let pages = $fetch(&self.db, &parents, &args).await?;
                    for (parent, page) in pages {
                        out.insert($key(parent, args.clone()), page);
                    }
                }
                Ok(out)
            }
        }
    };
}

nested_page!(PoolsOfSite(SiteId), Pool, fleet::pools_by_sites);
nested_page!(NodesOfPool(PoolId), Node, fleet::nodes_by_pools);

macro_rules! child_count {
    ($key:ident($parent_id:ty), $fetch:path) => {
        /// How many children a parent has.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $key(pub $parent_id);

        impl Loader<$key> for FleetLoader {
            type Value = i64;
            type Error = async_graphql::Error;

            async fn load(&self, keys: &[$key]) -> LoadResult<$key, i64> {
                let counts = $fetch(&self.db, &ids(keys, |k| &k.0)).await?;
                Ok(keys
                    .iter()
                    .map(|k| (k.clone(), counts.get(&k.0).copied().unwrap_or(0)))
                    .collect())
            }
        }
    };
}

child_count!(PoolCountOfSite(SiteId), fleet::count_pools_by_sites);
child_count!(NodeCountOfPool(PoolId), fleet::count_nodes_by_pools);

/// Capacity of a pool or a site over a window (now when `None`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CapacityOf(pub ScopeId, pub Option<Window>);

impl Loader<CapacityOf> for FleetLoader {
    type Value = Vec<CapacityRow>;
    type Error = async_graphql::Error;

    async fn load(&self, keys: &[CapacityOf]) -> LoadResult<CapacityOf, Vec<CapacityRow>> {
        let mut pools: HashMap<Option<Window>, Vec<PoolId>> = HashMap::new();
        let mut sites: HashMap<Option<Window>, Vec<SiteId>> = HashMap::new();
        for CapacityOf(scope, window) in keys {
            match scope {
                ScopeId::Pool(p) => pools.entry(*window).or_default().push(p.clone()),
                ScopeId::Site(s) => sites.entry(*window).or_default().push(s.clone()),
            }
        }
        let mut out: HashMap<CapacityOf, Vec<CapacityRow>> =
            keys.iter().map(|k| (k.clone(), Vec::new())).collect();
        for (window, ids) in pools {
            for row in fleet::pool_capacity(&self.db, &ids, window).await? {
                out.entry(CapacityOf(row.scope_id.clone(), window))
                    .or_default()
                    .push(row);
            }
        }
        for (window, ids) in sites {
            for row in fleet::site_capacity(&self.db, &ids, window).await? {
                out.entry(CapacityOf(row.scope_id.clone(), window))
                    .or_default()
                    .push(row);
            }
        }
        Ok(out)
    }
}
