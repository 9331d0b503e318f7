//! Planning capacity in the graph: `availability` (the earliest windows in which a request fits)
//! and `capacityTimeline` (free and booked atoms per step, for a calendar).

use async_graphql::{Context, ID, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::reservations::availability::{
    self as av, Availability, Pick, Step, parse_availability, parse_timeline,
};
use compute_domain::reservations::model::AllocationInput;

use crate::auth::Role;
use crate::graph::common::{AtomKind, ReasonCount, gql_id};
use crate::graph::fleet::ComputeNodeObj;
use crate::graph::loaders::*;
use crate::graph::reservations::{AllocationInputGql, GangInput};
use crate::graph::{GqlResult, actor, db, viewer};

/// The earliest windows in which a request fits, or why none does.
pub struct AvailabilityObj(Availability);

/// The earliest windows in which a request fits, or why none does.
#[Object(name = "Availability")]
impl AvailabilityObj {
    /// The first start searched: `notBefore`, or now when it is unset or past.
    async fn searched_from(&self) -> DateTime<Utc> {
        self.0.searched_from
    }
    /// The last start searched: `notAfter` (14 days after the first when unset), no later than
    /// the pool's `maxLeadSeconds` allows.
    async fn searched_to(&self) -> DateTime<Utc> {
        self.0.searched_to
    }
    /// The windows, earliest first: each is a stretch of starts at which the whole request fits.
    async fn windows(&self) -> Vec<AvailabilityWindow> {
        self.0
            .windows
            .iter()
            .map(|w| AvailabilityWindow {
                starts_at: w.starts_at,
                ends_at: w.ends_at,
                latest_start: w.latest_start,
                placements: w
                    .picks
                    .iter()
                    .enumerate()
                    .map(|(i, p)| AvailabilityPlacement(i, p.clone()))
                    .collect(),
            })
            .collect()
    }
    /// Empty when a window was found; otherwise, node by node, the first reason that rules each
    /// out for the allocation that fits nowhere (`NodeCordoned`, `InsufficientGpus`, …, and
    /// `AllocationsConflict` when each allocation fits alone but never all together), largest
    /// first, as an `Unschedulable` condition counts them.
    async fn unschedulable(&self) -> Vec<ReasonCount> {
        self.0
            .unfit
            .iter()
            .flat_map(|u| u.counts.iter())
            .map(|(reason, count)| ReasonCount::new(reason, *count))
            .collect()
    }
    /// Why nothing fits, in words; null when a window was found.
    async fn message(&self) -> Option<&str> {
        self.0.unfit.as_ref().map(|u| u.message.as_str())
    }
}

/// A stretch of starts at which the whole request fits.
#[derive(SimpleObject)]
pub struct AvailabilityWindow {
    /// The earliest start: `createReservation` with this `startsAt` and `endsAt` fits, unless
    /// someone books first.
    starts_at: DateTime<Utc>,
    /// `startsAt` plus the duration asked.
    ends_at: DateTime<Utc>,
    /// The latest start of the stretch: from `startsAt` to this instant, every start fits.
    latest_start: DateTime<Utc>,
    /// Where each allocation would go at `startsAt`, in the order of the request.
    placements: Vec<AvailabilityPlacement>,
}

/// Where one allocation of the request would go.
pub struct AvailabilityPlacement(usize, Pick);

/// Where one allocation of the request would go.
#[Object]
impl AvailabilityPlacement {
    /// The allocation's position in the request, from 0.
    async fn allocation(&self) -> i32 {
        self.0 as i32
    }
    /// The node's id.
    async fn compute_node_id(&self) -> ID {
        gql_id(&self.1.node)
    }
    /// The node. Operators only (null for tenants, as on an allocation).
    async fn compute_node(&self, ctx: &Context<'_>) -> GqlResult<Option<ComputeNodeObj>> {
        if !viewer(ctx)?.has_role(Role::Operator) {
            return Ok(None);
        }
        Ok(loaders_of(ctx)?
            .load_one(self.1.node.clone())
            .await?
            .map(ComputeNodeObj::new))
    }
    /// How many matching atoms that node has free for the whole window (at least the count
    /// asked).
    async fn free_atoms(&self) -> i32 {
        self.1.free_atoms as i32
    }
}

/// Free and booked atoms of a pool, step by step.
#[derive(SimpleObject)]
pub struct CapacityTimeline {
    /// The length of each step.
    step_seconds: i64,
    /// The steps, from `from`; the last one ends at or after `to`.
    steps: Vec<CapacityStep>,
}

/// One step of a capacity timeline. `total = booked + free + unavailable`.
#[derive(SimpleObject)]
pub struct CapacityStep {
    /// When the step starts.
    starts_at: DateTime<Utc>,
    /// When it ends.
    ends_at: DateTime<Utc>,
    /// Atoms of the kind (and model) on the pool's nodes that are not retired.
    total: i64,
    /// Atoms booked at some instant of the step (whose booking is never said).
    booked: i64,
    /// Atoms free for the whole step, on a schedulable node and device.
    free: i64,
    /// Atoms not booked in the step that cannot be booked now: on a cordoned, unreachable or lost
    /// node, or an unhealthy or quarantined device.
    unavailable: i64,
}

impl From<Step> for CapacityStep {
    fn from(s: Step) -> Self {
        CapacityStep {
            starts_at: s.starts_at,
            ends_at: s.ends_at,
            total: s.total,
            booked: s.booked,
            free: s.free,
            unavailable: s.unavailable,
        }
    }
}

/// Planning queries.
#[derive(Default)]
pub struct AvailabilityQuery;

/// Planning queries.
#[Object]
impl AvailabilityQuery {
    /// The earliest windows (up to `first`, default 5, at most 20) in which the whole request
    /// fits in the pool for `durationSeconds`, starting between `notBefore` and `notAfter`. The
    /// same rules as placement decide: cordons, taints and tolerations, device health,
    /// reachability, selectors, free vCPU, memory and disk; a member's tenant quota and the
    /// pool's rules refuse as `createReservation` would (`QUOTA_EXCEEDED`, `POLICY_VIOLATION`).
    /// When nothing fits, `unschedulable` counts why.
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: the request and the range searched"
    )]
    async fn availability(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The pool to search.")] pool_id: ID,
        #[graphql(desc = "What to reserve, as `createReservation` takes it.")] allocations: Vec<
            AllocationInputGql,
        >,
        #[graphql(desc = "How long the window lasts, in seconds.")] duration_seconds: i64,
        #[graphql(desc = "The earliest start wanted; now when unset or past.")] not_before: Option<
            DateTime<Utc>,
        >,
        #[graphql(
            desc = "The latest start wanted; 14 days after the earliest when unset (at most 366 days after it)."
        )]
        not_after: Option<DateTime<Utc>>,
        #[graphql(desc = "How many windows at most: 1 to 20 (5 when unset).")] first: Option<i32>,
        #[graphql(desc = "The gang's rule, as `createReservation` takes it.")] gang: Option<
            GangInput,
        >,
    ) -> GqlResult<AvailabilityObj> {
        let actor = actor(ctx)?;
        let allocations: Vec<AllocationInput> = allocations
            .iter()
            .map(AllocationInputGql::to_domain)
            .collect();
        let req = parse_availability(
            pool_id.as_str(),
            &allocations,
            duration_seconds,
            not_before,
            not_after,
            first.map(i64::from),
            gang.as_ref().map(GangInput::to_domain).as_ref(),
        )?;
        Ok(AvailabilityObj(
            av::availability(db(ctx)?, &actor, &req).await?,
        ))
    }

    /// Free, booked and unavailable atoms of one kind (and model) in a pool, step by step from
    /// `from` to `to`: at most 1,000 steps of at least 60 seconds. Counts only: nobody's
    /// bookings are named.
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: the pool, the range, the step and the atoms counted"
    )]
    async fn capacity_timeline(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The pool.")] pool_id: ID,
        #[graphql(desc = "The first step's start.")] from: DateTime<Utc>,
        #[graphql(desc = "The end of the range; the last step ends at or after it.")] to: DateTime<
            Utc,
        >,
        #[graphql(desc = "The length of a step, in seconds: 60 to 2,678,400 (31 days).")]
        step_seconds: i64,
        #[graphql(desc = "Only atoms of GPUs of this model.")] model: Option<String>,
        #[graphql(desc = "Whole GPUs (default), MIG instances or slots.")] kind: Option<AtomKind>,
    ) -> GqlResult<CapacityTimeline> {
        actor(ctx)?;
        let req = parse_timeline(
            pool_id.as_str(),
            from,
            to,
            step_seconds,
            kind.map(Into::into),
            model.as_deref(),
        )?;
        let steps = av::capacity_timeline(db(ctx)?, &req).await?;
        Ok(CapacityTimeline {
            step_seconds: req.step.num_seconds(),
            steps: steps.into_iter().map(CapacityStep::from).collect(),
        })
    }
}
