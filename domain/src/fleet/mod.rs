//! The fleet: sites, pools, nodes (machines), their GPUs and the bookable atoms of each GPU.
//!
//! Durable state only; nothing is cached in memory. Reads here are single statements on the pool
//! (autocommit, bounded by the connection's `statement_timeout`); every change goes through
//! `Db::tx` in [`changes`]. Batch readers (`*_by_*`, `get_*`) take many parent ids at once, so the
//! API's data loaders issue one statement per level of a tree, whatever its size.

pub mod changes;
pub mod demo;
pub mod enrollment;
pub mod gauges;
pub mod model;
mod payload;
pub mod state;

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{FromRow, Postgres, QueryBuilder};

use crate::condition::Conditions;
use crate::db::Db;
use crate::error::Result;
use crate::fleet::model::{
    AtomKind, DeviceMode, Health, Labels, PoolKind, Reachability, Resource, StoredLayout, Taint,
    Window,
};
use crate::fleet::state::NodeLifecycle;
use crate::ids::{AtomName, DeviceId, NodeId, PoolId, ScopeId, SiteId};
use crate::page::{Page, PageArgs};
pub use model::PoolRules;

/// A site: a place that holds pools.
#[derive(Debug, Clone, FromRow)]
pub struct Site {
    pub id: SiteId,
    pub name: String,
    pub region: Option<String>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A pool of nodes in a site, with its overcommit ratios.
#[derive(Debug, Clone, FromRow)]
pub struct Pool {
    pub id: PoolId,
    pub site_id: SiteId,
    pub name: String,
    pub kind: PoolKind,
    pub lost_after_seconds: Option<f64>,
    pub vcpu_ratio: f64,
    pub memory_ratio: f64,
    pub disk_ratio: f64,
    /// Its rules against hoarding (migration 0034).
    pub rules: Json<PoolRules>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A machine (`ComputeNode` in GraphQL).
#[derive(Debug, Clone, FromRow)]
pub struct Node {
    pub id: NodeId,
    pub pool_id: PoolId,
    pub hostname: String,
    pub labels: Json<Labels>,
    pub taints: Json<Vec<Taint>>,
    pub cordoned: bool,
    pub cordon_reason: Option<String>,
    pub reachability: Reachability,
    pub conditions: Conditions,
    pub generation: i64,
    pub observed_generation: i64,
    pub joined_at: DateTime<Utc>,
    pub retired_at: Option<DateTime<Utc>>,
    pub lifecycle: NodeLifecycle,
    pub version: i64,
    pub updated_at: DateTime<Utc>,
    /// When `reachability` last changed (`None`: never since the node joined).
    pub reachability_since: Option<DateTime<Utc>>,
    /// While `DISCONNECTED`: when the liveness reconciler makes it `UNREACHABLE`.
    pub unreachable_at: Option<DateTime<Utc>>,
    /// What its daemon last reported of the machine (`compute_protocol::Inventory`), and when.
    pub inventory: Option<Json<compute_protocol::Inventory>>,
    pub inventory_at: Option<DateTime<Utc>>,
}

/// One scalar resource of a node.
#[derive(Debug, Clone, FromRow)]
pub struct NodeResource {
    pub node_id: NodeId,
    pub resource: Resource,
    pub allocatable: i64,
    pub ratio: f64,
    pub allocated: i64,
}

/// A GPU.
#[derive(Debug, Clone, FromRow)]
pub struct Device {
    pub id: DeviceId,
    pub node_id: NodeId,
    pub uuid: String,
    pub vendor: String,
    pub model: String,
    pub memory_mib: i64,
    pub mode: DeviceMode,
    pub layout: Option<Json<StoredLayout>>,
    pub health: Health,
    pub health_reason: Option<String>,
    /// Since when the health is what it is (`None`: healthy since it was registered).
    pub health_since: Option<DateTime<Utc>>,
    /// Out of placement: the operator's quarantine or an inventory mismatch.
    pub quarantined: bool,
    /// Whether the operator quarantined it (`quarantineDevice`).
    pub operator_quarantined: bool,
    pub quarantine_reason: Option<String>,
    /// How what the node reports differs from this registration (`None`: it agrees, or no
    /// report yet).
    pub inventory_mismatch: Option<String>,
    /// When an operator took it out of the registration (`retireDevice`).
    pub retired_at: Option<DateTime<Utc>>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Its PCI bus id (`00000000:17:00.0`), NUMA node and NVLink domain (migration 0036).
    pub pci_bus_id: Option<String>,
    pub numa_node: Option<i32>,
    pub nvlink_domain: Option<String>,
}

/// A bookable unit of a GPU.
#[derive(Debug, Clone, FromRow)]
pub struct Atom {
    pub name: AtomName,
    pub device_id: DeviceId,
    pub kind: AtomKind,
    pub ordinal: i32,
    pub profile: Option<String>,
    pub share_num: i32,
    pub share_den: i32,
}

/// Capacity of one (model, kind, profile) in a pool or site.
#[derive(Debug, Clone, FromRow)]
pub struct CapacityRow {
    pub scope_id: ScopeId,
    pub model: String,
    pub kind: AtomKind,
    pub profile: String,
    /// Atoms on nodes that are not retired.
    pub total: i64,
    /// Atoms with a booking that overlaps the window.
    pub booked: i64,
    /// Atoms that placement could take over the whole window: not booked, on an active reachable
    /// node, on a GPU that is not unhealthy or quarantined.
    pub free: i64,
}

// The column lists of the fleet's rows: each `query_*!` macro is the one home of its row's
// columns for static statements (`SELECT … FROM sites s …`, `… RETURNING …`), checked against
// the migrations at compile time; the `*_COLS` constants are the same lists for the listings,
// whose filters are built at run time (`Select`).

/// A checked `query_as!` of [`Site`]s: `$head` + the columns of `sites s` + `$tail`.
macro_rules! query_sites {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $crate::fleet::Site,
            $head + r#" s.id AS "id: _", s.name, s.region, s.version, s.created_at, s.updated_at "# + $tail
            $(, $arg)*
        )
    };
}
pub(crate) use query_sites;

/// A checked `query_as!` of [`Pool`]s: `$head` + the columns of `pools p` + `$tail`.
macro_rules! query_pools {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $crate::fleet::Pool,
            $head
                + r#" p.id AS "id: _", p.site_id AS "site_id: _", p.name, p.kind AS "kind: _",
                     extract(epoch FROM p.lost_after)::float8 AS lost_after_seconds, p.vcpu_ratio::float8 AS "vcpu_ratio!",
                     p.memory_ratio::float8 AS "memory_ratio!", p.disk_ratio::float8 AS "disk_ratio!",
                     p.rules AS "rules: _", p.version, p.created_at, p.updated_at "#
                + $tail
            $(, $arg)*
        )
    };
}
pub(crate) use query_pools;

/// A checked `query_as!` of [`Node`]s: `$head` + the columns of `nodes n` + `$tail`.
macro_rules! query_nodes {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $crate::fleet::Node,
            $head
                + r#" n.id AS "id: _", n.pool_id AS "pool_id: _", n.hostname, n.labels AS "labels: _",
                     n.taints AS "taints: _", n.cordoned, n.cordon_reason, n.reachability AS "reachability: _",
                     n.conditions AS "conditions: _", n.generation, n.observed_generation, n.joined_at, n.retired_at,
                     n.lifecycle AS "lifecycle: _", n.version, n.updated_at, n.reachability_since,
                     n.unreachable_at, n.inventory AS "inventory: _", n.inventory_at "#
                + $tail
            $(, $arg)*
        )
    };
}
pub(crate) use query_nodes;

/// A checked `query_as!` of [`Device`]s: `$head` + the columns of `devices d` + `$tail`.
macro_rules! query_devices {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $crate::fleet::Device,
            $head
                + r#" d.id AS "id: _", d.node_id AS "node_id: _", d.uuid, d.vendor, d.model, d.memory_mib,
                     d.mode AS "mode: _", d.layout AS "layout: _", d.health AS "health: _", d.health_reason,
                     d.health_since, d.quarantined AS "quarantined!", d.operator_quarantined, d.quarantine_reason,
                     d.inventory_mismatch, d.retired_at, d.version, d.created_at, d.updated_at,
                     d.pci_bus_id, d.numa_node, d.nvlink_domain "#
                + $tail
            $(, $arg)*
        )
    };
}
pub(crate) use query_devices;

const SITE_COLS: &str = "s.id, s.name, s.region, s.version, s.created_at, s.updated_at";
const POOL_COLS: &str = "p.id, p.site_id, p.name, p.kind, \
     extract(epoch FROM p.lost_after)::float8 AS lost_after_seconds, p.vcpu_ratio::float8 AS vcpu_ratio, \
     p.memory_ratio::float8 AS memory_ratio, p.disk_ratio::float8 AS disk_ratio, p.rules, p.version, p.created_at, p.updated_at";
pub(crate) const NODE_COLS: &str = "n.id, n.pool_id, n.hostname, n.labels, n.taints, n.cordoned, n.cordon_reason, \
     n.reachability, n.conditions, n.generation, n.observed_generation, n.joined_at, n.retired_at, n.lifecycle, \
     n.version, n.updated_at, n.reachability_since, n.unreachable_at, n.inventory, n.inventory_at";
const DEVICE_COLS: &str = "d.id, d.node_id, d.uuid, d.vendor, d.model, d.memory_mib, d.mode, d.layout, \
     d.health, d.health_reason, d.health_since, d.quarantined, d.operator_quarantined, d.quarantine_reason, \
     d.inventory_mismatch, d.retired_at, d.version, d.created_at, d.updated_at, \
     d.pci_bus_id, d.numa_node, d.nvlink_domain";
const ATOM_COLS: &str =
    "a.name, a.device_id, a.kind, a.ordinal, a.profile, a.share_num, a.share_den";

/// A SELECT being built, with its WHERE conditions.
pub(crate) struct Select<'a> {
    qb: QueryBuilder<'a, Postgres>,
    has_where: bool,
}

impl<'a> Select<'a> {
    pub(crate) fn new(sql: impl Into<String>) -> Self {
        Select {
            qb: QueryBuilder::new(sql.into()),
            has_where: false,
        }
    }

    /// Starts one more condition.
    pub(crate) fn and(&mut self) -> &mut QueryBuilder<'a, Postgres> {
        self.qb
            .push(if self.has_where { " AND " } else { " WHERE " });
        self.has_where = true;
        &mut self.qb
    }

    /// Runs the query as one page ordered by `key`.
    pub(crate) async fn fetch_page<T>(self, db: &Db, key: &str, page: &PageArgs) -> Result<Page<T>>
    where
        T: for<'r> FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        let rows = self
            .page(key, page)
            .build_query_as()
            .fetch_all(db.pool())
            .await?;
        Ok(Page::from_rows(rows, page))
    }

    /// Runs a `SELECT count(*) …` query.
    async fn fetch_count(mut self, db: &Db) -> Result<i64> {
        let (n,): (i64,) = self.qb.build_query_as().fetch_one(db.pool()).await?;
        Ok(n)
    }

    /// Adds the keyset conditions, the order and the limit of a page.
    fn page(mut self, key: &str, page: &PageArgs) -> QueryBuilder<'a, Postgres> {
        if let Some(after) = &page.after {
            self.and().push(key).push(" > ").push_bind(after.clone());
        }
        if let Some(before) = &page.before {
            self.and().push(key).push(" < ").push_bind(before.clone());
        }
        self.qb
            .push(" ORDER BY ")
            .push(key)
            .push(if page.backward { " DESC" } else { " ASC" })
            .push(" LIMIT ")
            .push_bind(page.limit + 1);
        self.qb
    }
}

/// An id that parents a nested connection: bound as an array, decoded from a row, a map key.
trait ParentId:
    Clone
    + Eq
    + std::hash::Hash
    + Send
    + Sync
    + Unpin
    + sqlx::Type<Postgres>
    + sqlx::postgres::PgHasArrayType
    + for<'q> sqlx::Encode<'q, Postgres>
    + for<'r> sqlx::Decode<'r, Postgres>
    + 'static
{
}
impl ParentId for SiteId {}
impl ParentId for PoolId {}

/// Where the children of a nested connection live.
struct Nested<'a> {
    /// The columns to select.
    cols: &'a str,
    /// The table, with its alias.
    from: &'a str,
    /// The column holding the parent's id.
    parent_col: &'a str,
    /// The key the page is ordered by.
    key: &'a str,
}

/// Children of many parents, one page each, in one statement.
async fn nested_pages<K, T>(
    db: &Db,
    spec: Nested<'_>,
    parents: &[K],
    page: &PageArgs,
    parent_of: impl Fn(&T) -> &K,
) -> Result<HashMap<K, Page<T>>>
where
    K: ParentId,
    T: for<'r> FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
{
    let Nested {
        cols,
        from,
        parent_col,
        key,
    } = spec;
    let dir = if page.backward { "DESC" } else { "ASC" };
    let mut qb: QueryBuilder<'_, Postgres> = QueryBuilder::new(format!(
        "SELECT * FROM (SELECT {cols}, row_number() OVER (PARTITION BY {parent_col} ORDER BY {key} {dir}) AS page_rn \
         FROM {from} WHERE {parent_col} = ANY("
    ));
    qb.push_bind(parents.to_vec()).push(")");
    if let Some(after) = &page.after {
        qb.push(format!(" AND {key} > ")).push_bind(after.clone());
    }
    if let Some(before) = &page.before {
        qb.push(format!(" AND {key} < ")).push_bind(before.clone());
    }
    qb.push(") paged WHERE page_rn <= ")
        .push_bind(page.limit + 1)
        .push(" ORDER BY page_rn");
    let rows: Vec<T> = qb.build_query_as().fetch_all(db.pool()).await?;
    let mut grouped: HashMap<K, Vec<T>> = HashMap::new();
    for row in rows {
        grouped
            .entry(parent_of(&row).clone())
            .or_default()
            .push(row);
    }
    Ok(parents
        .iter()
        .map(|p| {
            let rows = grouped.remove(p).unwrap_or_default();
            (p.clone(), Page::from_rows(rows, page))
        })
        .collect())
}

/// Counts children per parent in one statement.
async fn count_by<K: ParentId>(
    db: &Db,
    table: &str,
    parent_col: &str,
    parents: &[K],
) -> Result<HashMap<K, i64>> {
    let rows: Vec<(K, i64)> = sqlx::query_as(&format!(
        "SELECT {parent_col}, count(*) FROM {table} WHERE {parent_col} = ANY($1) GROUP BY {parent_col}"
    ))
    .bind(parents)
    .fetch_all(db.pool())
    .await?;
    Ok(rows.into_iter().collect())
}

/// Sites by id.
pub async fn get_sites(db: &Db, ids: &[SiteId]) -> Result<Vec<Site>> {
    let ids: Vec<&str> = ids.iter().map(SiteId::as_str).collect();
    Ok(query_sites!(
        "SELECT",
        "FROM sites s WHERE s.id = ANY($1)",
        &ids as &[&str]
    )
    .fetch_all(db.pool())
    .await?)
}

/// Pools by id.
pub async fn get_pools(db: &Db, ids: &[PoolId]) -> Result<Vec<Pool>> {
    let ids: Vec<&str> = ids.iter().map(PoolId::as_str).collect();
    Ok(query_pools!(
        "SELECT",
        "FROM pools p WHERE p.id = ANY($1)",
        &ids as &[&str]
    )
    .fetch_all(db.pool())
    .await?)
}

/// The ids of a pool's nodes, retired ones included.
pub async fn node_ids_of_pool(db: &Db, pool_id: &PoolId) -> Result<Vec<NodeId>> {
    Ok(sqlx::query_scalar!(
        r#"SELECT n.id AS "id: NodeId" FROM nodes n WHERE n.pool_id = $1"#,
        pool_id.as_str(),
    )
    .fetch_all(db.pool())
    .await?)
}

/// Nodes by id.
pub async fn get_nodes(db: &Db, ids: &[NodeId]) -> Result<Vec<Node>> {
    let ids: Vec<&str> = ids.iter().map(NodeId::as_str).collect();
    Ok(query_nodes!(
        "SELECT",
        "FROM nodes n WHERE n.id = ANY($1)",
        &ids as &[&str]
    )
    .fetch_all(db.pool())
    .await?)
}

/// Devices by id.
pub async fn get_devices(db: &Db, ids: &[DeviceId]) -> Result<Vec<Device>> {
    let ids: Vec<&str> = ids.iter().map(DeviceId::as_str).collect();
    Ok(query_devices!(
        "SELECT",
        "FROM devices d WHERE d.id = ANY($1)",
        &ids as &[&str]
    )
    .fetch_all(db.pool())
    .await?)
}

/// A page of sites.
pub async fn list_sites(db: &Db, page: &PageArgs) -> Result<Page<Site>> {
    Select::new(format!("SELECT {SITE_COLS} FROM sites s"))
        .fetch_page(db, "s.id", page)
        .await
}

/// How many sites there are.
pub async fn count_sites(db: &Db) -> Result<i64> {
    Ok(sqlx::query_scalar!(r#"SELECT count(*) AS "n!" FROM sites"#)
        .fetch_one(db.pool())
        .await?)
}

/// Filters of the pools connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct PoolFilter {
    pub site_id: Option<SiteId>,
    pub kind: Option<model::PoolKind>,
}

fn pool_select<'a>(cols: &str, f: &PoolFilter) -> Select<'a> {
    let mut q = Select::new(format!("SELECT {cols} FROM pools p"));
    if let Some(site) = &f.site_id {
        q.and().push("p.site_id = ").push_bind(site.clone());
    }
    if let Some(kind) = f.kind {
        q.and().push("p.kind = ").push_bind(kind);
    }
    q
}

/// A page of pools.
pub async fn list_pools(db: &Db, filter: &PoolFilter, page: &PageArgs) -> Result<Page<Pool>> {
    pool_select(POOL_COLS, filter)
        .fetch_page(db, "p.id", page)
        .await
}

/// How many pools match.
pub async fn count_pools(db: &Db, filter: &PoolFilter) -> Result<i64> {
    pool_select("count(*)", filter).fetch_count(db).await
}

/// A page of pools for each site.
pub async fn pools_by_sites(
    db: &Db,
    site_ids: &[SiteId],
    page: &PageArgs,
) -> Result<HashMap<SiteId, Page<Pool>>> {
    let spec = Nested {
        cols: POOL_COLS,
        from: "pools p",
        parent_col: "p.site_id",
        key: "p.id",
    };
    nested_pages(db, spec, site_ids, page, |p: &Pool| &p.site_id).await
}

/// How many pools each site has.
pub async fn count_pools_by_sites(db: &Db, site_ids: &[SiteId]) -> Result<HashMap<SiteId, i64>> {
    count_by(db, "pools", "site_id", site_ids).await
}

/// Filters of the compute-nodes connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct NodeFilter {
    pub site_id: Option<SiteId>,
    pub pool_id: Option<PoolId>,
    pub reachability: Option<model::Reachability>,
    pub cordoned: Option<bool>,
    pub has_free_capacity: Option<bool>,
    pub include_retired: bool,
}

fn node_select<'a>(cols: &str, f: &NodeFilter) -> Select<'a> {
    let mut q = Select::new(format!("SELECT {cols} FROM nodes n"));
    if let Some(site) = &f.site_id {
        q.and()
            .push("n.pool_id IN (SELECT id FROM pools WHERE site_id = ")
            .push_bind(site.clone())
            .push(")");
    }
    if let Some(pool) = &f.pool_id {
        q.and().push("n.pool_id = ").push_bind(pool.clone());
    }
    if let Some(r) = f.reachability {
        q.and().push("n.reachability = ").push_bind(r);
    }
    if let Some(c) = f.cordoned {
        q.and().push("n.cordoned = ").push_bind(c);
    }
    if !f.include_retired {
        q.and().push("n.retired_at IS NULL");
    }
    if let Some(free) = f.has_free_capacity {
        q.and().push(if free { "" } else { "NOT " }).push(
            "(compute_node_schedulable(n.lifecycle, n.reachability) AND EXISTS (SELECT 1 FROM devices d JOIN device_atoms a ON a.device_id = d.id \
             WHERE d.node_id = n.id AND compute_device_schedulable(d.health, d.quarantined) AND NOT EXISTS (SELECT 1 FROM device_bookings b \
             WHERE b.atom = a.name AND b.during @> compute_now())))",
        );
    }
    q
}

/// A page of nodes.
pub async fn list_nodes(db: &Db, filter: &NodeFilter, page: &PageArgs) -> Result<Page<Node>> {
    node_select(NODE_COLS, filter)
        .fetch_page(db, "n.id", page)
        .await
}

/// How many nodes match.
pub async fn count_nodes(db: &Db, filter: &NodeFilter) -> Result<i64> {
    node_select("count(*)", filter).fetch_count(db).await
}

/// A page of nodes for each pool, retired ones included.
pub async fn nodes_by_pools(
    db: &Db,
    pool_ids: &[PoolId],
    page: &PageArgs,
) -> Result<HashMap<PoolId, Page<Node>>> {
    let spec = Nested {
        cols: NODE_COLS,
        from: "nodes n",
        parent_col: "n.pool_id",
        key: "n.id",
    };
    nested_pages(db, spec, pool_ids, page, |n: &Node| &n.pool_id).await
}

/// How many nodes each pool has, retired ones included.
pub async fn count_nodes_by_pools(db: &Db, pool_ids: &[PoolId]) -> Result<HashMap<PoolId, i64>> {
    count_by(db, "nodes", "pool_id", pool_ids).await
}

/// The scalar resources of each node.
pub async fn resources_by_nodes(db: &Db, node_ids: &[NodeId]) -> Result<Vec<NodeResource>> {
    let ids: Vec<&str> = node_ids.iter().map(NodeId::as_str).collect();
    Ok(sqlx::query_as!(
        NodeResource,
        r#"SELECT r.node_id AS "node_id: _", r.resource AS "resource: _", r.allocatable, r.ratio::float8 AS "ratio!",
                  r.allocated
             FROM unnest($1::text[]) AS k(id)
            CROSS JOIN LATERAL (SELECT * FROM node_resources x WHERE x.node_id = k.id OFFSET 0) r
            ORDER BY r.node_id, r.resource"#,
        &ids as &[&str],
    )
    .fetch_all(db.pool())
    .await?)
}

/// Filters of the devices connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DeviceFilter {
    pub site_id: Option<SiteId>,
    pub pool_id: Option<PoolId>,
    pub node_id: Option<NodeId>,
    pub model: Option<String>,
    pub mode: Option<model::DeviceMode>,
    pub health: Option<model::Health>,
}

fn device_select<'a>(cols: &str, f: &DeviceFilter) -> Select<'a> {
    let mut q = Select::new(format!(
        "SELECT {cols} FROM devices d JOIN nodes n ON n.id = d.node_id"
    ));
    if let Some(site) = &f.site_id {
        q.and()
            .push("n.pool_id IN (SELECT id FROM pools WHERE site_id = ")
            .push_bind(site.clone())
            .push(")");
    }
    if let Some(pool) = &f.pool_id {
        q.and().push("n.pool_id = ").push_bind(pool.clone());
    }
    if let Some(node) = &f.node_id {
        q.and().push("d.node_id = ").push_bind(node.clone());
    }
    if let Some(model) = &f.model {
        q.and().push("d.model = ").push_bind(model.clone());
    }
    if let Some(mode) = f.mode {
        q.and().push("d.mode = ").push_bind(mode);
    }
    if let Some(h) = f.health {
        q.and().push("d.health = ").push_bind(h);
    }
    q
}

/// A page of devices.
pub async fn list_devices(db: &Db, filter: &DeviceFilter, page: &PageArgs) -> Result<Page<Device>> {
    device_select(DEVICE_COLS, filter)
        .fetch_page(db, "d.id", page)
        .await
}

/// How many devices match.
pub async fn count_devices(db: &Db, filter: &DeviceFilter) -> Result<i64> {
    device_select("count(*)", filter).fetch_count(db).await
}

/// The devices of each node (a small, bounded list per node).
pub async fn devices_by_nodes(db: &Db, node_ids: &[NodeId]) -> Result<Vec<Device>> {
    let ids: Vec<&str> = node_ids.iter().map(NodeId::as_str).collect();
    Ok(query_devices!(
        "SELECT",
        // One index probe per id (a lateral subquery the planner cannot flatten: `OFFSET 0`).
        // With `= ANY($1)` or a plain join, a plan made for the ids at hand scans every device
        // of the fleet: 8 ms instead of 2.5 for 100 nodes of 2,250 (`bench-fleet`).
        "FROM unnest($1::text[]) AS k(id)
         CROSS JOIN LATERAL (SELECT * FROM devices x WHERE x.node_id = k.id OFFSET 0) d
         ORDER BY d.node_id, d.id",
        &ids as &[&str],
    )
    .fetch_all(db.pool())
    .await?)
}

/// The atoms of each device, in ordinal order.
pub async fn atoms_by_devices(db: &Db, device_ids: &[DeviceId]) -> Result<Vec<Atom>> {
    let ids: Vec<&str> = device_ids.iter().map(DeviceId::as_str).collect();
    Ok(sqlx::query_as!(
        Atom,
        r#"SELECT a.name AS "name: _", a.device_id AS "device_id: _", a.kind AS "kind: _", a.ordinal, a.profile,
                  a.share_num, a.share_den
             FROM unnest($1::text[]) AS k(id)
            CROSS JOIN LATERAL (SELECT * FROM device_atoms x WHERE x.device_id = k.id OFFSET 0) a
            ORDER BY a.device_id, a.ordinal"#,
        &ids as &[&str],
    )
    .fetch_all(db.pool())
    .await?)
}

/// The atoms of each node's devices, by device then ordinal, each with its node: a page of nodes
/// reads its atoms beside its devices, in parallel, instead of after them.
pub async fn atoms_by_nodes(db: &Db, node_ids: &[NodeId]) -> Result<Vec<(NodeId, Atom)>> {
    let ids: Vec<&str> = node_ids.iter().map(NodeId::as_str).collect();
    let rows = sqlx::query!(
        r#"SELECT d.node_id AS "node_id!: NodeId", a.name AS "name!: AtomName", a.device_id AS "device_id!: DeviceId",
                  a.kind AS "kind!: AtomKind", a.ordinal AS "ordinal!", a.profile, a.share_num AS "share_num!",
                  a.share_den AS "share_den!"
             FROM unnest($1::text[]) AS k(id)
            CROSS JOIN LATERAL (SELECT x.id, x.node_id FROM devices x WHERE x.node_id = k.id OFFSET 0) d
            CROSS JOIN LATERAL (SELECT * FROM device_atoms y WHERE y.device_id = d.id OFFSET 0) a
            ORDER BY a.device_id, a.ordinal"#,
        &ids as &[&str],
    )
    .fetch_all(db.pool())
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let atom = Atom {
                name: r.name,
                device_id: r.device_id,
                kind: r.kind,
                ordinal: r.ordinal,
                profile: r.profile,
                share_num: r.share_num,
                share_den: r.share_den,
            };
            (r.node_id, atom)
        })
        .collect())
}

/// Filters of the atoms connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct AtomFilter {
    pub pool_id: Option<PoolId>,
    pub device_id: Option<DeviceId>,
    pub model: Option<String>,
    pub kind: Option<model::AtomKind>,
    pub profile: Option<String>,
    /// Only atoms placement could take now (`true`), or only the others (`false`).
    pub free_now: Option<bool>,
}

fn atom_select<'a>(cols: &str, f: &AtomFilter) -> Select<'a> {
    let mut q = Select::new(format!(
        "SELECT {cols} FROM device_atoms a JOIN devices d ON d.id = a.device_id JOIN nodes n ON n.id = d.node_id"
    ));
    if let Some(pool) = &f.pool_id {
        q.and().push("n.pool_id = ").push_bind(pool.clone());
    }
    if let Some(dev) = &f.device_id {
        q.and().push("a.device_id = ").push_bind(dev.clone());
    }
    if let Some(model) = &f.model {
        q.and().push("d.model = ").push_bind(model.clone());
    }
    if let Some(kind) = f.kind {
        q.and().push("a.kind = ").push_bind(kind);
    }
    if let Some(profile) = &f.profile {
        q.and().push("a.profile = ").push_bind(profile.clone());
    }
    if let Some(free) = f.free_now {
        q.and().push(if free { "" } else { "NOT " }).push(
            "(compute_node_schedulable(n.lifecycle, n.reachability) AND compute_device_schedulable(d.health, d.quarantined) AND NOT EXISTS (SELECT 1 FROM device_bookings b \
             WHERE b.atom = a.name AND b.during @> compute_now()))",
        );
    }
    q
}

/// A page of atoms.
pub async fn list_atoms(db: &Db, filter: &AtomFilter, page: &PageArgs) -> Result<Page<Atom>> {
    atom_select(ATOM_COLS, filter)
        .fetch_page(db, "a.name", page)
        .await
}

/// How many atoms match.
pub async fn count_atoms(db: &Db, filter: &AtomFilter) -> Result<i64> {
    atom_select("count(*)", filter).fetch_count(db).await
}

/// Capacity of many pools over a window (now when `None`), one statement.
pub async fn pool_capacity(
    db: &Db,
    ids: &[PoolId],
    window: Option<Window>,
) -> Result<Vec<CapacityRow>> {
    capacity(db, "p.id", ids, window).await
}

/// Capacity of many sites (all their pools) over a window (now when `None`), one statement.
pub async fn site_capacity(
    db: &Db,
    ids: &[SiteId],
    window: Option<Window>,
) -> Result<Vec<CapacityRow>> {
    capacity(db, "p.site_id", ids, window).await
}

async fn capacity<K: ParentId>(
    db: &Db,
    scope_col: &str,
    ids: &[K],
    window: Option<Window>,
) -> Result<Vec<CapacityRow>> {
    let sql = format!(
        "WITH w AS (SELECT CASE WHEN $2::timestamptz IS NULL THEN tstzrange(compute_now(), compute_now(), '[]') \
                                ELSE tstzrange($2, $3, '[)') END AS range), \
         atoms AS ( \
           SELECT {scope_col} AS scope_id, d.model, a.kind, coalesce(a.profile, '') AS profile, \
                  (compute_node_schedulable(n.lifecycle, n.reachability) AND compute_device_schedulable(d.health, d.quarantined)) AS schedulable, \
                  EXISTS (SELECT 1 FROM device_bookings b, w WHERE b.atom = a.name AND b.during && w.range) AS booked \
             FROM device_atoms a JOIN devices d ON d.id = a.device_id JOIN nodes n ON n.id = d.node_id \
             JOIN pools p ON p.id = n.pool_id \
            WHERE {scope_col} = ANY($1) AND n.retired_at IS NULL) \
         SELECT scope_id, model, kind, profile, count(*) AS total, \
                count(*) FILTER (WHERE booked) AS booked, \
                count(*) FILTER (WHERE schedulable AND NOT booked) AS free \
           FROM atoms GROUP BY scope_id, model, kind, profile ORDER BY scope_id, model, kind, profile"
    );
    Ok(sqlx::query_as(&sql)
        .bind(ids)
        .bind(window.map(|w| w.start))
        .bind(window.map(|w| w.end))
        .fetch_all(db.pool())
        .await?)
}
