//! Webhook sinks in the graph: a tenant's (or, for operators, the fleet's) event sinks, their
//! delivery state, and the mutations that manage them.

use crate::graph::common::{connection, gql_id};
use async_graphql::connection::Connection;
use async_graphql::{Context, Enum, ID, InputObject, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::Error;
use compute_domain::ids::{SinkId, TenantId};
use compute_domain::page::PageRequest;
use compute_domain::sinks::{self, Scope, Sink, SinkChange};

use crate::auth::Role;
use crate::graph::{GqlResult, db, gql_error, viewer};

/// Whose sinks the caller manages: a member its tenant's; an operator the fleet's (which
/// receive every event) and, to look at, every tenant's.
fn scope(ctx: &Context<'_>) -> GqlResult<(Scope, String)> {
    let v = viewer(ctx)?;
    let tenant_id = if v.has_role(Role::Operator) {
        None
    } else if v.has_role(Role::Member) {
        Some(
            v.tenant
                .clone()
                .ok_or_else(|| gql_error(Error::Forbidden("your token names no tenant".into())))?,
        )
    } else {
        return Err(gql_error(Error::Forbidden(
            "event sinks are for members and operators".into(),
        )));
    };
    Ok((Scope { tenant_id }, v.subject.clone()))
}

fn sink_id(field: &str, id: &ID) -> GqlResult<SinkId> {
    Ok(SinkId::parse(field, id.as_str())?)
}

/// How a sink's delivery is going.
#[derive(Enum, Clone, Copy, PartialEq, Eq)]
pub enum EventSinkState {
    /// Delivering, or nothing to deliver.
    Healthy,
    /// Its last deliveries failed; it is retried with backoff.
    Failing,
    /// Events it had not received were pruned past the outbox's hard maximum age.
    Behind,
}

/// Where events are POSTed, signed, at least once, in order.
pub struct EventSinkObj(Sink);

/// Where events are POSTed, signed, at least once, in order.
#[Object(name = "EventSink")]
impl EventSinkObj {
    /// The sink's id (`snk_…`).
    async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// The tenant whose events it receives; null for an operator's sink of every event.
    async fn tenant_id(&self) -> Option<&str> {
        self.0.tenant_id.as_ref().map(TenantId::as_str)
    }
    /// Where each event is POSTed.
    async fn url(&self) -> &str {
        &self.0.url
    }
    /// The event types it receives; every type when empty.
    async fn types(&self) -> &[String] {
        &self.0.types
    }
    /// Events per POST: 1 sends each event alone; more sends them in batches of up to this many
    /// (`docs/webhooks.md`).
    async fn batch_size(&self) -> i32 {
        self.0.batch_size
    }
    /// Whether it is delivered.
    async fn active(&self) -> bool {
        self.0.active
    }
    /// How delivery is going.
    async fn state(&self) -> EventSinkState {
        match self.0.state.as_str() {
            "failing" => EventSinkState::Failing,
            "behind" => EventSinkState::Behind,
            _ => EventSinkState::Healthy,
        }
    }
    /// After the last event delivered (an event cursor, as subscriptions use).
    async fn cursor(&self) -> String {
        self.0.cursor().encode()
    }
    /// Seconds since the oldest event it has not received yet was committed; 0 when it has
    /// everything.
    async fn lag_seconds(&self) -> f64 {
        self.0.lag_seconds
    }
    /// Events delivered so far.
    async fn delivered(&self) -> i64 {
        self.0.delivered
    }
    /// Failures in a row.
    async fn failures(&self) -> i32 {
        self.0.failures
    }
    /// When it is tried again, while it backs off.
    async fn next_attempt_at(&self) -> Option<DateTime<Utc>> {
        self.0.next_attempt_at
    }
    /// The last time a batch was delivered.
    async fn last_success_at(&self) -> Option<DateTime<Utc>> {
        self.0.last_success_at
    }
    /// The last failure, as the worker saw it.
    async fn last_error(&self) -> Option<&str> {
        self.0.last_error.as_deref()
    }
    /// When the last failure happened.
    async fn last_error_at(&self) -> Option<DateTime<Utc>> {
        self.0.last_error_at
    }
    /// For optimistic concurrency on `updateEventSink`.
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
}

/// `totalCount` of the sinks connection.
pub struct SinkCount(Scope);

/// `totalCount` of the sinks connection.
#[Object]
impl SinkCount {
    /// How many sinks there are, across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> GqlResult<i64> {
        Ok(sinks::count(db(ctx)?, &self.0).await?)
    }
}

/// The sink queries.
#[derive(Default)]
pub struct SinkQuery;

/// The sink queries.
#[Object]
impl SinkQuery {
    /// The caller's event sinks (an operator sees every sink), by id.
    async fn event_sinks(
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
    ) -> GqlResult<Connection<String, EventSinkObj, SinkCount>> {
        let (scope, _) = scope(ctx)?;
        let args = PageRequest {
            first: first.map(i64::from),
            after,
            last: last.map(i64::from),
            before,
        }
        .resolve()?;
        let page = sinks::list(db(ctx)?, &scope, &args).await?;
        Ok(connection(
            page,
            SinkCount(scope),
            |s| s.id.as_str(),
            EventSinkObj,
        ))
    }

    /// One event sink (another tenant's is `NOT_FOUND`).
    async fn event_sink(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The sink's id.")] id: ID,
    ) -> GqlResult<EventSinkObj> {
        let (scope, _) = scope(ctx)?;
        let id = sink_id("id", &id)?;
        Ok(EventSinkObj(sinks::get(db(ctx)?, &scope, &id).await?))
    }
}

/// A new sink.
#[derive(InputObject)]
pub struct CreateEventSinkInput {
    /// Where to POST each event (`http://` or `https://`).
    url: String,
    /// Only these event types (such as `reservation.active`); every type when empty.
    #[graphql(default)]
    types: Vec<String>,
    /// Events per POST, 1 to 100: 1 (the default) sends each event alone; more sends up to
    /// this many in one POST, in order (`docs/webhooks.md`), for a receiver that answers slowly.
    #[graphql(default = 1)]
    batch_size: i32,
}

/// A sink and its signing secret, shown this once.
#[derive(SimpleObject)]
pub struct CreateEventSinkPayload {
    /// The sink created.
    event_sink: EventSinkObj,
    /// The HMAC-SHA256 key of the `Compute-Signature` header. Store it now: it is never shown
    /// again.
    secret: String,
}

/// A change to a sink; omitted fields stay as they are.
#[derive(InputObject)]
pub struct UpdateEventSinkInput {
    /// The sink to change.
    id: ID,
    /// The new endpoint, an `http://` or `https://` URL.
    url: Option<String>,
    /// The event types to deliver from now on (all when empty).
    types: Option<Vec<String>>,
    /// `false` pauses delivery; `true` resumes it at once, clearing the failure count.
    active: Option<bool>,
    /// Events per POST from now on, 1 to 100.
    batch_size: Option<i32>,
    /// `true` replaces the signing secret; the new one is in the payload, shown that once.
    /// Resuming a sink whose creator no longer has a grant covering it needs this and `url` in
    /// the same change (the sink then becomes yours); without them it is `FORBIDDEN`.
    #[graphql(default)]
    rotate_secret: bool,
    /// Fails with `CONFLICT` when the sink is at another version.
    expected_version: Option<i64>,
}

/// The sink after the change.
#[derive(SimpleObject)]
pub struct UpdateEventSinkPayload {
    /// The sink as changed.
    event_sink: EventSinkObj,
    /// The new HMAC-SHA256 key of the `Compute-Signature` header when the change rotated it
    /// (`rotateSecret: true`), else null. Store it now: it is never shown again.
    secret: Option<String>,
}

/// The sink to delete.
#[derive(InputObject)]
pub struct DeleteEventSinkInput {
    /// The sink to delete.
    id: ID,
}

/// What was deleted.
#[derive(SimpleObject)]
pub struct DeleteEventSinkPayload {
    /// The id of the sink that no longer exists.
    deleted_event_sink_id: ID,
}

/// The sink mutations.
#[derive(Default)]
pub struct SinkMutation;

/// The sink mutations.
#[Object]
impl SinkMutation {
    /// Creates a sink that receives events from now on, and returns its signing secret once.
    async fn create_event_sink(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `createEventSink`.")] input: CreateEventSinkInput,
    ) -> GqlResult<CreateEventSinkPayload> {
        let (scope, by) = scope(ctx)?;
        let (sink, secret) = sinks::create(
            db(ctx)?,
            &scope,
            &by,
            &input.url,
            input.types,
            input.batch_size,
        )
        .await?;
        Ok(CreateEventSinkPayload {
            event_sink: EventSinkObj(sink),
            secret,
        })
    }

    /// Changes a sink's URL, types, batch size, activity or signing secret.
    async fn update_event_sink(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `updateEventSink`.")] input: UpdateEventSinkInput,
    ) -> GqlResult<UpdateEventSinkPayload> {
        let (scope, by) = scope(ctx)?;
        let id = sink_id("id", &input.id)?;
        let (sink, secret) = sinks::update(
            db(ctx)?,
            &scope,
            &by,
            &id,
            SinkChange {
                url: input.url,
                types: input.types,
                active: input.active,
                batch_size: input.batch_size,
                rotate_secret: input.rotate_secret,
                expected_version: input.expected_version,
            },
        )
        .await?;
        Ok(UpdateEventSinkPayload {
            event_sink: EventSinkObj(sink),
            secret,
        })
    }

    /// Deletes a sink; its delivery stops.
    async fn delete_event_sink(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `deleteEventSink`.")] input: DeleteEventSinkInput,
    ) -> GqlResult<DeleteEventSinkPayload> {
        let (scope, _) = scope(ctx)?;
        let id = sink_id("id", &input.id)?;
        let sink = sinks::delete(db(ctx)?, &scope, &id).await?;
        Ok(DeleteEventSinkPayload {
            deleted_event_sink_id: gql_id(&sink.id),
        })
    }
}
