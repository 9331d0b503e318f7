//! The graph's shared vocabulary: the enums and inputs more than one area
//! uses, conditions, id and page arguments.
//!
//! Architecture invariant: a leaf of `graph` (it imports only `context`).

use async_graphql::{ID, InputObject, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::fleet::model::Window;
use compute_domain::ids::EntityId;
use compute_domain::page::PageRequest;

use crate::graph::context::GqlResult;

/// What a taint does to placement.
#[derive(async_graphql::Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(
    name = "TaintEffect",
    remote = "compute_domain::fleet::model::TaintEffect"
)]
pub enum TaintEffect {
    /// Only tolerating allocations are placed here.
    NoSchedule,
    /// Placement avoids the node when it can.
    PreferNoSchedule,
    /// Like NoSchedule, and running work without a toleration should leave.
    NoExecute,
}
/// The kind of a bookable atom.
#[derive(async_graphql::Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(name = "AtomKind", remote = "compute_domain::fleet::model::AtomKind")]
pub enum AtomKind {
    /// A whole GPU.
    Gpu,
    /// A MIG instance.
    Mig,
    /// A time-slice or MPS slot.
    Slot,
}

/// A page as a Relay connection with `extra` fields (its `totalCount`): the one place the
/// pagination glue lives. `key` is the row's keyset key, which becomes its edge's cursor.
pub fn connection<R, T, E>(
    page: compute_domain::page::Page<R>,
    extra: E,
    key: impl Fn(&R) -> &str,
    wrap: impl Fn(R) -> T,
) -> async_graphql::connection::Connection<String, T, E>
where
    T: async_graphql::OutputType,
    E: async_graphql::ObjectType,
{
    let mut c = async_graphql::connection::Connection::with_additional_fields(
        page.has_previous,
        page.has_next,
        extra,
    );
    c.edges.extend(page.items.into_iter().map(|r| {
        async_graphql::connection::Edge::new(compute_domain::page::encode_cursor(key(&r)), wrap(r))
    }));
    c
}

/// Page arguments of a Relay connection.
pub fn page_request(
    first: Option<i32>,
    after: Option<String>,
    last: Option<i32>,
    before: Option<String>,
) -> PageRequest {
    PageRequest {
        first: first.map(i64::from),
        after,
        last: last.map(i64::from),
        before,
    }
}

/// Parses an id argument of entity type `I`; `field` names the argument in errors.
pub fn parse_id<I: EntityId>(field: &str, id: &ID) -> GqlResult<I> {
    Ok(I::parse(field, id.as_str())?)
}

/// [`parse_id`] of an optional argument.
pub fn opt_id<I: EntityId>(field: &str, id: Option<&ID>) -> GqlResult<Option<I>> {
    id.map(|id| parse_id(field, id)).transpose()
}

/// The GraphQL `ID` of an entity.
pub fn gql_id(id: &impl EntityId) -> ID {
    ID(id.as_str().to_owned())
}

/// A time window.
#[derive(InputObject, Clone, Copy)]
pub struct WindowInput {
    /// Start, inclusive.
    pub start: DateTime<Utc>,
    /// End, exclusive.
    pub end: DateTime<Utc>,
}

/// A window input, checked.
pub fn window(w: Option<WindowInput>) -> GqlResult<Option<Window>> {
    Ok(w.map(|w| Window::new("window", w.start, w.end))
        .transpose()?)
}

/// A condition of a node or reservation, such as `NodeUnreachable` or `Unschedulable`.
#[derive(SimpleObject)]
pub struct Condition {
    /// The condition's type.
    r#type: String,
    /// `True`, `False` or `Unknown`.
    status: String,
    /// A machine-readable reason.
    reason: Option<String>,
    /// A message for people.
    message: Option<String>,
    /// Since when it holds.
    since: Option<DateTime<Utc>>,
    /// What the reason is made of, counted: for `Unschedulable`, how many nodes of the pool
    /// each reason ruled out (`NodeCordoned`, `NodeUnreachable`, `TaintNotTolerated`,
    /// `InsufficientGpus`, …; `docs/reservations.md`), largest first. Empty for other
    /// conditions.
    counts: Vec<ReasonCount>,
}

/// How many of something one reason accounts for, such as 12 nodes `NodeCordoned`.
#[derive(SimpleObject)]
pub struct ReasonCount {
    /// A stable, machine-readable reason.
    reason: String,
    /// How many.
    count: i64,
}

impl ReasonCount {
    pub fn new(reason: &str, count: i64) -> ReasonCount {
        ReasonCount {
            reason: reason.to_owned(),
            count,
        }
    }
}

/// Conditions as an event carried them (`Event.payload`), as the graph shows them.
pub fn conditions_of_views(views: &[compute_domain::events::ConditionView]) -> Vec<Condition> {
    views
        .iter()
        .map(|c| Condition {
            r#type: c.kind.clone(),
            status: c.status.as_str().to_owned(),
            reason: c.reason.clone(),
            message: c.message.clone(),
            since: c.since,
            counts: c
                .counts
                .iter()
                .map(|r| ReasonCount {
                    reason: r.reason.clone(),
                    count: r.count,
                })
                .collect(),
        })
        .collect()
}

/// Conditions as the graph shows them (through the events' view of a condition, so the two
/// cannot drift).
pub fn conditions_of(stored: &[compute_domain::condition::Condition]) -> Vec<Condition> {
    let views: Vec<_> = stored
        .iter()
        .map(compute_domain::events::ConditionView::from)
        .collect();
    conditions_of_views(&views)
}
