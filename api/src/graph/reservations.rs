//! Reservations in the graph: queries, objects and the tenant's mutations.

use async_graphql::connection::Connection;
use async_graphql::{Context, Enum, ID, InputObject, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::Error;
use compute_domain::fleet::model::Window;
use compute_domain::ids::{PoolId, ReservationId};
use compute_domain::page::PageRequest;
use compute_domain::reservations::model::{AllocationInput, parse_request};
use compute_domain::reservations::{self as rsv, ReservationFilter, lifecycle};

use crate::auth::Role;
use crate::graph::common::{
    AtomKind, Condition, TaintEffect, WindowInput, conditions_of, connection, gql_id,
};
use crate::graph::fleet::{ComputeNodeObj, PoolObj, PoolRulesObj};
use crate::graph::loaders::*;
use crate::graph::{GqlResult, ReplayFlag, actor, db, gql_error, viewer};

/// Where a reservation is in its life.
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(remote = "compute_domain::reservations::state::State")]
pub enum ReservationState {
    /// Holds its quota, not placed yet; retried every 30 seconds.
    Pending,
    /// Booked; its window has not started.
    Scheduled,
    /// Booked; its window is running (from its start on, whether or not a worker has moved it).
    Active,
    /// Ended early.
    Released,
    /// Its window ended (from its end on; quota comes back when a worker expires it).
    Expired,
    /// Withdrawn before it started.
    Cancelled,
    /// Could not be honoured.
    Failed,
}

/// A tenant's claim on GPUs with vCPU, memory and disk, for a window.
pub struct ReservationObj(pub rsv::Reservation);

/// A tenant's claim on GPUs with vCPU, memory and disk, for a window.
#[Object(name = "Reservation")]
impl ReservationObj {
    /// The reservation's id (`rsv_…`).
    pub async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// The tenant it belongs to.
    async fn tenant_id(&self) -> &str {
        self.0.tenant_id.as_str()
    }
    /// Who created it.
    async fn created_by(&self) -> &str {
        &self.0.created_by
    }
    /// Its state, as time says: active from its start, expired from its end.
    async fn state(&self) -> ReservationState {
        self.0.state.into()
    }
    /// When its window starts: when it holds its devices from. A pending reservation placed
    /// after the start it asked for starts at its placement.
    async fn starts_at(&self) -> DateTime<Utc> {
        self.0.starts_at
    }
    /// When its window ends.
    async fn ends_at(&self) -> DateTime<Utc> {
        self.0.ends_at
    }
    /// When it ended (released, cancelled).
    async fn ended_at(&self) -> Option<DateTime<Utc>> {
        self.0.ended_at
    }
    /// The pool's rules that admitted it, as they were at its creation or its latest
    /// extension; null for one admitted before rules were recorded.
    async fn admitted_under(&self, ctx: &Context<'_>) -> GqlResult<Option<PoolRulesObj>> {
        Ok(loaders_of(ctx)?
            .load_one(AdmittedUnder(self.0.id.clone()))
            .await?
            .flatten()
            .map(|r| (&r).into()))
    }
    /// Conditions, such as `Unschedulable` with the reason in words.
    async fn conditions(&self) -> Vec<Condition> {
        conditions_of(&self.0.conditions)
    }
    /// The GPUs it charges against quota: the exact sum of its allocations' shares (k/7 per MIG
    /// instance, 1/n per slot), rounded once to six decimals.
    async fn gpu_charge(&self) -> f64 {
        self.0.charge_gpu
    }
    /// The vCPU it charges.
    async fn vcpu_charge(&self) -> i64 {
        self.0.charge_vcpu
    }
    /// The memory it charges, in MiB.
    async fn memory_mib_charge(&self) -> i64 {
        self.0.charge_memory_mib
    }
    /// When placement is tried again (pending only).
    async fn next_attempt_at(&self) -> Option<DateTime<Utc>> {
        self.0.next_attempt_at
    }
    /// The gang's rule its allocations were placed under (null: each allocation on its own).
    async fn gang(&self) -> Option<Gang> {
        self.0.gang().map(|g| Gang {
            colocate: g.colocate.map(Into::into),
            label: g.label,
            spread: g.spread,
        })
    }
    /// Optimistic-concurrency version.
    async fn version(&self) -> i64 {
        self.0.version
    }
    /// When it was created.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
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
            .ok_or_else(|| gql_error(Error::internal("a reservation without its pool")))
    }
    /// Its allocations, in order.
    // Priced by its entry in `graph::cost::RULES`.
    async fn allocations(&self, ctx: &Context<'_>) -> GqlResult<Vec<AllocationObj>> {
        Ok(loaders_of(ctx)?
            .load_one(AllocationsOfReservation(self.0.id.clone()))
            .await?
            .unwrap_or_default()
            .into_iter()
            .map(AllocationObj)
            .collect())
    }
}

/// One allocation of a reservation: what it asked for, on one node, and where it went.
pub struct AllocationObj(pub rsv::Allocation);

/// One allocation of a reservation: what it asked for, on one node, and where it went.
#[Object(name = "Allocation")]
impl AllocationObj {
    /// The allocation's id (`alc_…`).
    pub async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// Whole GPUs, MIG instances or slots.
    async fn gpu_kind(&self) -> AtomKind {
        self.0.gpu_kind.into()
    }
    /// How many.
    async fn gpu_count(&self) -> i32 {
        self.0.gpu_count
    }
    /// The GPU model asked for.
    async fn model(&self) -> Option<&str> {
        self.0.model.as_deref()
    }
    /// The MIG profile asked for.
    async fn profile(&self) -> Option<&str> {
        self.0.profile.as_deref()
    }
    /// For slots: of a GPU divided in this many.
    async fn slots_per_gpu(&self) -> Option<i32> {
        self.0.slots_per_gpu
    }
    /// The vCPU it holds on its node.
    async fn vcpu(&self) -> i64 {
        self.0.vcpu
    }
    /// Memory in MiB.
    async fn memory_mib(&self) -> i64 {
        self.0.memory_mib
    }
    /// Disk in GiB.
    async fn disk_gib(&self) -> i64 {
        self.0.disk_gib
    }
    /// Whether its GPUs were asked for on one NVLink domain.
    async fn same_nvlink_domain(&self) -> bool {
        self.0.same_nvlink_domain
    }
    /// Whether its GPUs were asked for on one NUMA node.
    async fn same_numa_node(&self) -> bool {
        self.0.same_numa_node
    }
    /// The atoms it holds (empty while pending).
    async fn atoms(&self) -> Vec<&str> {
        self.0.atoms.iter().map(|a| a.as_str()).collect()
    }
    /// The node it was placed on (null while pending). Operators only.
    async fn compute_node(&self, ctx: &Context<'_>) -> GqlResult<Option<ComputeNodeObj>> {
        let Some(node_id) = &self.0.node_id else {
            return Ok(None);
        };
        if !viewer(ctx)?.has_role(Role::Operator) {
            return Ok(None);
        }
        Ok(loaders_of(ctx)?
            .load_one(node_id.clone())
            .await?
            .map(ComputeNodeObj::new))
    }
    /// The id of the node it was placed on (null while pending).
    async fn compute_node_id(&self) -> Option<ID> {
        self.0.node_id.as_ref().map(gql_id)
    }
}

/// Whether the caller may see `r`.
pub fn visible(ctx: &Context<'_>, r: &rsv::Reservation) -> GqlResult<bool> {
    crate::graph::context::may_see(ctx, &r.tenant_id)
}

/// `totalCount` of the reservations connection.
pub struct ReservationCount(ReservationFilter);

/// `totalCount` of the reservations connection.
#[Object]
impl ReservationCount {
    /// How many reservations match, across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> GqlResult<i64> {
        Ok(rsv::count_reservations(db(ctx)?, &self.0).await?)
    }
}

/// The reservations' queries.
#[derive(Default)]
pub struct ReservationQuery;

/// The reservations' queries.
#[Object]
impl ReservationQuery {
    /// A reservation; another tenant's is `NOT_FOUND`.
    async fn reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
    ) -> GqlResult<ReservationObj> {
        let rid = ReservationId::parse("id", id.as_str())?;
        let found = loaders_of(ctx)?.load_one(rid.clone()).await?;
        match found {
            Some(r) if visible(ctx, &r)? => Ok(ReservationObj(r)),
            _ => Err(gql_error(Error::NotFound {
                kind: "reservation",
                id: rid.to_string(),
            })),
        }
    }

    /// Reservations: a member's own tenant's; an operator's of every tenant, or of `tenantId`.
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn reservations(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only reservations in this state, as time says.")] state: Option<
            ReservationState,
        >,
        #[graphql(desc = "Only those of this pool.")] pool_id: Option<ID>,
        #[graphql(desc = "Only reservations whose window overlaps this one.")] window: Option<
            WindowInput,
        >,
        #[graphql(desc = "Operators: only this tenant's.")] tenant_id: Option<String>,
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
    ) -> GqlResult<Connection<String, ReservationObj, ReservationCount>> {
        let tenant = crate::graph::context::listing_tenant(ctx, tenant_id)?;
        let filter = ReservationFilter {
            tenant_id: tenant,
            state: state.map(Into::into),
            pool_id: pool_id
                .map(|p| PoolId::parse("poolId", p.as_str()))
                .transpose()?,
            window: window
                .map(|w| Window::new("window", w.start, w.end))
                .transpose()?,
        };
        let args = PageRequest {
            first: first.map(i64::from),
            after,
            last: last.map(i64::from),
            before,
        }
        .resolve()?;
        let page = rsv::list_reservations(db(ctx)?, &filter, &args).await?;
        Ok(connection(
            page,
            ReservationCount(filter),
            |r| r.id.as_str(),
            ReservationObj,
        ))
    }
}

/// A taint toleration.
#[derive(InputObject)]
pub struct TolerationInput {
    /// The taint's key.
    pub key: String,
    /// Its value; any value when unset.
    pub value: Option<String>,
    /// Its effect; any effect when unset.
    pub effect: Option<TaintEffect>,
}

/// A label a node must have.
#[derive(InputObject)]
pub struct SelectorInput {
    /// The label key the node must have.
    pub key: String,
    /// The value that label must have.
    pub value: String,
}

/// One allocation: GPUs of one kind with vCPU, memory and disk, on one node.
#[derive(InputObject)]
#[graphql(name = "AllocationInput")]
pub struct AllocationInputGql {
    /// Whole GPUs (default), MIG instances or slots.
    pub gpu_kind: Option<AtomKind>,
    /// How many (1 to 64).
    pub gpu_count: i64,
    /// A GPU model, such as `H100-SXM5-80GB`.
    pub model: Option<String>,
    /// MIG instances: the profile, such as `1g.10gb`.
    pub profile: Option<String>,
    /// Slots: of a GPU divided in this many.
    pub slots_per_gpu: Option<i64>,
    /// The vCPU to hold on the node (default 0).
    #[graphql(default)]
    pub vcpu: i64,
    /// Memory in MiB.
    #[graphql(default)]
    pub memory_mib: i64,
    /// Disk in GiB.
    #[graphql(default)]
    pub disk_gib: i64,
    /// Labels the node must have.
    #[graphql(default)]
    pub node_selector: Vec<SelectorInput>,
    /// Taints the allocation tolerates.
    #[graphql(default)]
    pub tolerations: Vec<TolerationInput>,
    /// All its GPUs on one NVLink domain (GPUs joined by NVLink, `Device.nvlinkDomain`); a GPU
    /// whose domain is unknown is a domain of its own.
    #[graphql(default)]
    pub same_nvlink_domain: bool,
    /// All its GPUs on one NUMA node (`Device.numaNode`); a GPU whose NUMA node is unknown is a
    /// NUMA node of its own.
    #[graphql(default)]
    pub same_numa_node: bool,
}

/// Where a gang's allocations go together.
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(remote = "compute_domain::reservations::model::Colocate")]
pub enum GangColocate {
    /// All on one node.
    Node,
    /// All on nodes that share one value of `label` (one rack, one fabric).
    Label,
}

/// A gang: the rule the allocations of one reservation are placed under, all of them in one
/// transaction or none.
#[derive(InputObject)]
pub struct GangInput {
    /// Colocate the allocations: on one node, or on nodes sharing one value of `label`.
    pub colocate: Option<GangColocate>,
    /// With `colocate: LABEL`: the label key whose value the nodes share, such as `rack`.
    pub label: Option<String>,
    /// Each allocation on a node of its own (with `colocate: LABEL`: distinct nodes of one rack).
    pub spread: Option<bool>,
}

impl GangInput {
    /// The raw domain input, parsed by `parse_gang` where it is used.
    pub fn to_domain(&self) -> compute_domain::reservations::model::GangInput {
        compute_domain::reservations::model::GangInput {
            colocate: self.colocate.map(Into::into),
            label: self.label.clone(),
            spread: self.spread,
        }
    }
}

/// The gang's rule of a reservation.
#[derive(SimpleObject)]
pub struct Gang {
    /// Where the allocations go together (null: not colocated).
    pub colocate: Option<GangColocate>,
    /// The label whose value they share, with `colocate: LABEL`.
    pub label: Option<String>,
    /// Whether each allocation is on a node of its own.
    pub spread: bool,
}

impl AllocationInputGql {
    /// The raw domain input, parsed by `parse_allocation` where it is used.
    pub fn to_domain(&self) -> AllocationInput {
        AllocationInput {
            gpu_kind: self.gpu_kind.map(Into::into),
            gpu_count: self.gpu_count,
            model: self.model.clone(),
            profile: self.profile.clone(),
            slots_per_gpu: self.slots_per_gpu,
            vcpu: self.vcpu,
            memory_mib: self.memory_mib,
            disk_gib: self.disk_gib,
            node_selector: self
                .node_selector
                .iter()
                .map(|s| (s.key.clone(), s.value.clone()))
                .collect(),
            tolerations: self
                .tolerations
                .iter()
                .map(|t| (t.key.clone(), t.value.clone(), t.effect.map(Into::into)))
                .collect(),
            same_nvlink_domain: self.same_nvlink_domain,
            same_numa_node: self.same_numa_node,
        }
    }
}

/// Input of `createReservation`.
#[derive(InputObject)]
pub struct CreateReservationInput {
    /// The pool to reserve in.
    pub pool_id: ID,
    /// When the window starts; now when unset.
    pub starts_at: Option<DateTime<Utc>>,
    /// When it ends.
    pub ends_at: DateTime<Utc>,
    /// What to reserve.
    pub allocations: Vec<AllocationInputGql>,
    /// Places the allocations as a gang, under a rule: together on one node or one rack,
    /// or spread over distinct nodes; all of them or none.
    pub gang: Option<GangInput>,
    /// Required: a retry with the same key and input gets the same answer, never a second
    /// reservation. 1 to 255 printable characters.
    pub idempotency_key: String,
}

/// A reservation after a change.
#[derive(SimpleObject)]
pub struct ReservationPayload {
    /// The reservation.
    pub reservation: ReservationObj,
    /// Whether this is the stored answer to an earlier request with the same idempotency key.
    pub idempotent_replay: bool,
    /// How many placement attempts lost a race to a concurrent change and were replanned.
    pub placement_retries: i32,
}

/// Input of `extendReservation`.
#[derive(InputObject)]
pub struct ExtendReservationInput {
    /// The reservation.
    pub id: ID,
    /// The new end, later than the current one.
    pub ends_at: DateTime<Utc>,
    /// Required, as for `createReservation`.
    pub idempotency_key: String,
}

/// Input of `releaseReservation` and `cancelReservation`.
#[derive(InputObject)]
pub struct ReservationActionInput {
    /// The reservation.
    pub id: ID,
    /// The version you read; when given, a newer reservation is `CONFLICT`.
    pub version: Option<i64>,
}

fn payload(
    ctx: &Context<'_>,
    outcome: compute_domain::idempotency::Outcome<rsv::Reservation>,
    placement_retries: usize,
) -> ReservationPayload {
    if outcome.replayed {
        ReplayFlag::mark(ctx);
    }
    ReservationPayload {
        reservation: ReservationObj(outcome.value),
        idempotent_replay: outcome.replayed,
        placement_retries: placement_retries as i32,
    }
}

/// The reservations' mutations.
#[derive(Default)]
pub struct ReservationMutation;

/// The reservations' mutations.
#[Object]
impl ReservationMutation {
    /// Reserves GPUs for the caller's tenant. The reply says which node and atoms each
    /// allocation got; without capacity it is `PENDING` with an `Unschedulable` condition, and
    /// holds its quota. Over quota is `QUOTA_EXCEEDED`.
    async fn create_reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `createReservation`.")] input: CreateReservationInput,
    ) -> GqlResult<ReservationPayload> {
        let actor = actor(ctx)?;
        let allocations: Vec<AllocationInput> = input
            .allocations
            .iter()
            .map(AllocationInputGql::to_domain)
            .collect();
        let request = parse_request(
            input.pool_id.as_str(),
            input.starts_at,
            input.ends_at,
            &allocations,
            input.gang.as_ref().map(GangInput::to_domain).as_ref(),
        )?;
        let (outcome, stats) =
            lifecycle::create_reservation(db(ctx)?, &actor, request, &input.idempotency_key)
                .await?;
        Ok(payload(ctx, outcome, stats.replans))
    }

    /// Moves the end of a scheduled or active reservation later: all its bookings grow, or none
    /// (`CONFLICT` names each GPU that blocks and from when: your own allocation by its id,
    /// another tenant's only as another tenant's reservation).
    async fn extend_reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `extendReservation`.")] input: ExtendReservationInput,
    ) -> GqlResult<ReservationPayload> {
        let actor = actor(ctx)?;
        let id = ReservationId::parse("id", input.id.as_str())?;
        let outcome = lifecycle::extend_reservation(
            db(ctx)?,
            &actor,
            &id,
            input.ends_at,
            &input.idempotency_key,
        )
        .await?;
        Ok(payload(ctx, outcome, 0))
    }

    /// Ends a scheduled or active reservation now; quota and capacity come back.
    async fn release_reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `releaseReservation`.")] input: ReservationActionInput,
    ) -> GqlResult<ReservationPayload> {
        let actor = actor(ctx)?;
        let id = ReservationId::parse("id", input.id.as_str())?;
        let r = lifecycle::release_reservation(db(ctx)?, &actor, &id, input.version).await?;
        Ok(ReservationPayload {
            reservation: ReservationObj(r),
            idempotent_replay: false,
            placement_retries: 0,
        })
    }

    /// Withdraws a pending or not yet started reservation, leaving no booking. One whose window
    /// has started is active: `CONFLICT`, release it instead.
    async fn cancel_reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `cancelReservation`.")] input: ReservationActionInput,
    ) -> GqlResult<ReservationPayload> {
        let actor = actor(ctx)?;
        let id = ReservationId::parse("id", input.id.as_str())?;
        let r = lifecycle::cancel_reservation(db(ctx)?, &actor, &id, input.version).await?;
        Ok(ReservationPayload {
            reservation: ReservationObj(r),
            idempotent_replay: false,
            placement_retries: 0,
        })
    }
}
