//! Sites and pools in the graph: their fields, their nodes and their capacity.

use super::*;

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

/// A pool's rules against hoarding; a rule that is null does not apply. A request a rule
/// refuses gets `POLICY_VIOLATION` with the rule's name (`extensions.rule`, one of these field
/// names) and its limit (`extensions.limit`).
#[derive(SimpleObject)]
#[graphql(name = "PoolRules")]
pub struct PoolRulesObj {
    /// The longest a reservation may last, in seconds.
    pub max_duration_seconds: Option<i64>,
    /// How far ahead of now a reservation may start, in seconds.
    pub max_lead_seconds: Option<i64>,
    /// The most GPU-hours one tenant may hold booked on the pool from now on: the sum over its
    /// pending, scheduled and active reservations of their GPUs times what is left of their
    /// windows (whole GPUs count 1, a MIG instance k/7, a time-slice slot its share).
    pub max_future_gpu_hours: Option<f64>,
    /// Whether a reservation may be extended once its window has started.
    pub extend_after_start: bool,
    /// How long an active reservation may go without a live instance (provisioning, running
    /// or stopping) before it is idle: it gets the `Idle` condition and a `reservation.idle`
    /// event. Null: never idle.
    pub idle_grace_seconds: Option<i64>,
    /// Whether an idle reservation is released (its `Idle` condition, reason `ReleasedIdle`,
    /// saying why) rather than only reported.
    pub release_idle: bool,
}

impl From<&fleet::PoolRules> for PoolRulesObj {
    fn from(r: &fleet::PoolRules) -> Self {
        PoolRulesObj {
            max_duration_seconds: r.max_duration_seconds,
            max_lead_seconds: r.max_lead_seconds,
            max_future_gpu_hours: r.max_future_gpu_hours,
            extend_after_start: r.extend_after_start != Some(false),
            idle_grace_seconds: r.idle_grace_seconds,
            release_idle: r.release_idle == Some(true),
        }
    }
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
    /// Its rules against hoarding, checked when a reservation is created or extended. A
    /// change applies to requests from then on: existing reservations keep the rules that
    /// admitted them (`Reservation.admittedUnder`).
    async fn rules(&self) -> PoolRulesObj {
        (&self.0.rules.0).into()
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
