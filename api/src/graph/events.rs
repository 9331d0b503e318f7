//! Live events: the subscriptions, fed by the process's one outbox tailer.
//!
//! Every subscription is a [`Feed`](crate::tailer::Feed) of the outbox after a cursor: the
//! events the caller may see, in `(txid, seq)` order, each once. A client that reconnects with
//! the last cursor it saw (the `after` argument, or `Last-Event-ID` over SSE) gets everything it
//! missed and then live events, without a gap or a duplicate at the seam; without a cursor a
//! subscription starts at the present. A cursor older than the outbox retention window is
//! `CURSOR_EXPIRED`.
//!
//! The transports learn where each item sits in the stream through [`StreamPosition`], and put
//! it in `extensions.cursor` of the `next` message (WebSocket) or the `id:` line (SSE).

use std::sync::{Arc, Mutex};

use async_graphql::{Context, ID, Json, Object, Subscription};
use chrono::{DateTime, Utc};
use compute_domain::ids::{CommandId, InstanceId, NodeId, PoolId, ReservationId, TenantId};
use compute_domain::outbox::{self, Cursor, Event, EventFilter};
use futures_util::Stream;

use crate::graph::common::gql_id;
use crate::graph::{GqlError, GqlResult, actor, db, gql_error, viewer};
use crate::share;
use crate::tailer::{Feed, Tailer};

/// Where the item a subscription yielded last sits in the outbox. A transport puts one in each
/// subscription request's data and reads it after each response.
#[derive(Clone, Default)]
pub struct StreamPosition(Arc<Mutex<Option<Cursor>>>);

impl StreamPosition {
    fn set(&self, cursor: Option<Cursor>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = cursor;
    }

    /// The cursor of the last item, if the subscription yielded one.
    pub fn get(&self) -> Option<Cursor> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What a streaming transport (WebSocket, SSE) attaches to each operation, and reads back from
/// each of its responses.
pub struct Streaming {
    position: StreamPosition,
    replay: crate::graph::ReplayFlag,
    slot: Option<Arc<share::Slot>>,
}

impl Streaming {
    /// Attaches the caller, a [`StreamPosition`], a replay flag and, for a subscription, its
    /// [`share::Slot`] in `frames` to `request`.
    pub fn attach(
        mut request: async_graphql::Request,
        viewer: Option<crate::auth::Viewer>,
        frames: &Arc<share::Frames>,
    ) -> (async_graphql::Request, Streaming) {
        let visibility = viewer.as_ref().map(|v| {
            let tenant = v.tenant.as_ref().map(TenantId::as_str);
            (tenant, v.roles.iter().map(|r| format!("{r:?}")).collect())
        });
        let slot = share::Shape::of(&mut request, visibility)
            .map(|shape| Arc::new(share::Slot::new(shape, frames.clone())));
        if let Some(v) = viewer {
            request = request.data(v);
        }
        if let Some(slot) = &slot {
            request = request.data(slot.clone());
        }
        let s = Streaming {
            position: StreamPosition::default(),
            replay: crate::graph::ReplayFlag::default(),
            slot,
        };
        let request = request.data(s.position.clone()).data(s.replay.clone());
        (request, s)
    }

    /// The JSON text of a decorated, prepared `response`: the payload stored for its event and
    /// shape when another subscription rendered it, else `render()`'s ([`share`]).
    pub fn payload(
        &self,
        response: &async_graphql::Response,
        render: impl FnOnce() -> String,
    ) -> Arc<str> {
        match &self.slot {
            Some(slot) => slot.payload(response, render),
            None => render().into(),
        }
    }

    /// Adds `extensions.cursor` (the item's place in the outbox) and
    /// `extensions.idempotentReplay` to a response; returns the cursor.
    pub fn decorate(&self, response: &mut async_graphql::Response) -> Option<Cursor> {
        let cursor = self.position.get();
        if let Some(c) = cursor {
            response
                .extensions
                .insert("cursor".into(), async_graphql::Value::String(c.encode()));
        }
        if self.replay.is_set() {
            response.extensions.insert(
                "idempotentReplay".into(),
                async_graphql::Value::Boolean(true),
            );
        }
        cursor
    }
}

/// A resume point the transport took from the request (SSE `Last-Event-ID`); it wins over the
/// `after` argument, being later.
#[derive(Clone, Copy, Debug)]
pub struct ResumeAfter(pub Cursor);

/// A change, as the outbox recorded it.
pub struct EventObj(Arc<Event>);

/// An item of the `events` subscription: an event to resolve, or one whose payload another
/// subscription of the same shape rendered ([`share`]), which resolves to nothing.
pub enum EventItem {
    Fresh(EventObj),
    Stored,
}

impl async_graphql::OutputType for EventItem {
    fn type_name() -> std::borrow::Cow<'static, str> {
        <EventObj as async_graphql::OutputType>::type_name()
    }

    fn create_type_info(registry: &mut async_graphql::registry::Registry) -> String {
        <EventObj as async_graphql::OutputType>::create_type_info(registry)
    }

    async fn resolve(
        &self,
        ctx: &async_graphql::ContextSelectionSet<'_>,
        field: &async_graphql::Positioned<async_graphql::parser::types::Field>,
    ) -> async_graphql::ServerResult<async_graphql::Value> {
        match self {
            EventItem::Fresh(e) => async_graphql::OutputType::resolve(e, ctx, field).await,
            // Its payload is stored: the transport sends that ([`share::Slot::payload`]).
            EventItem::Stored => Ok(async_graphql::Value::Null),
        }
    }
}

/// A change, as the outbox recorded it.
#[Object(name = "Event")]
impl EventObj {
    /// The event's id (`evt_…`), stable across redeliveries: deduplicate by it.
    async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// Where this event is in the stream: resume after it with `events(after:)`.
    async fn cursor(&self) -> String {
        self.0.cursor.map(|c| c.encode()).unwrap_or_default()
    }
    /// Dotted type, such as `reservation.active`.
    async fn r#type(&self) -> &str {
        &self.0.event_type
    }
    /// The tenant it belongs to; null for fleet events.
    async fn tenant_id(&self) -> Option<&str> {
        self.0.tenant_id.as_ref().map(TenantId::as_str)
    }
    /// The id of what changed.
    async fn subject(&self) -> &str {
        &self.0.subject
    }
    /// When it happened (`compute_now()` of its transaction).
    async fn time(&self) -> DateTime<Utc> {
        self.0.time
    }
    /// What changed, as it is after the change: the payload as untyped JSON, as webhooks
    /// carry it (`docs/webhooks.md`). `payload` is the same, typed.
    async fn data(&self) -> Json<serde_json::Value> {
        Json(self.0.data.clone())
    }
    /// What changed, typed by the event's family: select the members you need, such as
    /// `... on ReservationEventPayload { reservation { id state } }`. The same fields as
    /// `data`, so code generators give subscribers types. Null for an event type this server
    /// does not know (one written by a newer version during a rolling upgrade); `data` still
    /// has it.
    async fn payload(&self) -> GqlResult<Option<crate::graph::payloads::EventPayload>> {
        crate::graph::payloads::payload(&self.0.event_type, &self.0.data).map_err(|why| {
            gql_error(compute_domain::Error::internal(format!(
                "event {} ({}) does not read as its payload type: {why}",
                self.0.id, self.0.event_type
            )))
        })
    }
}

fn tailer<'a>(ctx: &'a Context<'_>) -> GqlResult<&'a Tailer> {
    ctx.data::<Tailer>().map_err(|_| {
        gql_error(compute_domain::Error::internal(
            "subscriptions need the outbox tailer, and this schema has none",
        ))
    })
}

/// Where a subscription starts: the transport's resume point, else `after`, else the present.
async fn start(ctx: &Context<'_>, after: Option<String>) -> GqlResult<Cursor> {
    let given = match ctx.data_opt::<ResumeAfter>() {
        Some(r) => Some(r.0),
        None => after.map(|c| Cursor::decode("after", &c)).transpose()?,
    };
    // Checked against the front the tailer read with its last poll, so thousands of clients
    // resuming after a restart cost no query each; a feed that must read the database checks
    // the front there again.
    let tailer = tailer(ctx)?;
    match given {
        Some(c) => {
            tailer.present().await;
            tailer.check_not_expired(c)?;
            Ok(c)
        }
        None => Ok(tailer.present().await),
    }
}

/// Maps each event of `feed` through `map` (which may skip it), recording each item's position.
fn follow<T, F, Fut>(
    feed: Feed,
    position: Option<StreamPosition>,
    map: F,
) -> impl Stream<Item = async_graphql::Result<T>> + use<T, F, Fut>
where
    T: Send + 'static,
    F: FnMut(Arc<Event>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = compute_domain::Result<Option<T>>> + Send,
{
    futures_util::stream::unfold((feed, map, false), move |(mut feed, mut map, done)| {
        let position = position.clone();
        async move {
            if done {
                return None;
            }
            loop {
                let event = match feed.next().await {
                    Ok(Some(e)) => e,
                    Ok(None) => return None,
                    Err(e) => return Some((Err(gql_error(e).into()), (feed, map, true))),
                };
                let cursor = event.cursor;
                match map(event).await {
                    Ok(Some(item)) => {
                        if let Some(p) = &position {
                            p.set(cursor);
                        }
                        return Some((Ok(item), (feed, map, false)));
                    }
                    Ok(None) => continue,
                    Err(e) => return Some((Err(gql_error(e).into()), (feed, map, true))),
                }
            }
        }
    })
}

/// The event stream's queries.
#[derive(Default)]
pub struct EventsQuery;

/// The event stream's queries.
#[Object]
impl EventsQuery {
    /// The cursor of the present. Read it in the same request as the objects a page shows, then
    /// subscribe with `after:` it: no change made after the query is missed. (A change that
    /// committed just before it, while an older transaction was still running, may still be
    /// delivered after it: the stream never skips, it may only repeat what the page shows.)
    async fn event_cursor(&self, ctx: &Context<'_>) -> GqlResult<String> {
        viewer(ctx)?;
        Ok(outbox::head(db(ctx)?).await?.encode())
    }
}

/// The root of every subscription.
#[derive(Default)]
pub struct SubscriptionRoot;

/// The root of every subscription.
#[Subscription(name = "Subscription")]
impl SubscriptionRoot {
    /// Events after `after` (a cursor from an earlier event), or from now when it is not given:
    /// the caller's tenant's events; operators see every event, fleet events included.
    async fn events(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Resume after this event's cursor; without it, start at the present.")]
        after: Option<String>,
        #[graphql(desc = "Only these event types (all when null or empty).")] types: Option<
            Vec<String>,
        >,
        #[graphql(desc = "Only events about these ids (all when null or empty).")] subjects: Option<
            Vec<String>,
        >,
    ) -> Result<impl Stream<Item = async_graphql::Result<EventItem>> + use<>, GqlError> {
        let tenant_id = actor(ctx)?
            .visible_tenant()
            .map_err(|_| {
                gql_error(compute_domain::Error::Forbidden(
                    "your token names no tenant".into(),
                ))
            })?
            .cloned();
        let cursor = start(ctx, after).await?;
        let filter = EventFilter::parse(
            tenant_id,
            types.unwrap_or_default(),
            subjects.unwrap_or_default(),
        )?;
        let feed = tailer(ctx)?.feed(cursor, filter);
        let slot = ctx.data_opt::<Arc<share::Slot>>().cloned();
        Ok(follow(
            feed,
            ctx.data_opt::<StreamPosition>().cloned(),
            move |e| {
                let stored = slot.as_ref().is_some_and(|s| s.lookup(e.cursor));
                async move {
                    Ok(Some(if stored {
                        EventItem::Stored
                    } else {
                        EventItem::Fresh(EventObj(e))
                    }))
                }
            },
        ))
    }

    /// A reservation as it is after each change (another tenant's is `NOT_FOUND`).
    async fn reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
        #[graphql(desc = "Resume after this cursor; without it, start at the present.")]
        after: Option<String>,
    ) -> Result<
        impl Stream<Item = async_graphql::Result<crate::graph::reservations::ReservationObj>> + use<>,
        GqlError,
    > {
        let rid = ReservationId::parse("id", id.as_str())?;
        let db = db(ctx)?.clone();
        let found =
            compute_domain::reservations::get_reservations(&db, std::slice::from_ref(&rid)).await?;
        let tenant = match found.first() {
            Some(r) if crate::graph::reservations::visible(ctx, r)? => r.tenant_id.clone(),
            _ => {
                return Err(gql_error(compute_domain::Error::NotFound {
                    kind: "reservation",
                    id: rid.to_string(),
                }));
            }
        };
        let cursor = start(ctx, after).await?;
        follow_object(
            ctx,
            cursor,
            EventFilter::about(Some(tenant), rid.to_string()),
            |_| true,
            move || {
                let (db, rid) = (db.clone(), rid.clone());
                async move {
                    let mut found =
                        compute_domain::reservations::get_reservations(&db, &[rid]).await?;
                    Ok(found.pop().map(crate::graph::reservations::ReservationObj))
                }
            },
        )
    }

    /// A compute node as it is after each change (operators only).
    async fn compute_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
        #[graphql(desc = "Resume after this cursor; without it, start at the present.")]
        after: Option<String>,
    ) -> Result<
        impl Stream<Item = async_graphql::Result<crate::graph::fleet::ComputeNodeObj>> + use<>,
        GqlError,
    > {
        let nid = NodeId::parse("id", id.as_str())?;
        crate::graph::require_operator_on(ctx, compute_domain::authz::Target::Node(nid.clone()))
            .await?;
        let db = db(ctx)?.clone();
        if compute_domain::fleet::get_nodes(&db, std::slice::from_ref(&nid))
            .await?
            .is_empty()
        {
            return Err(gql_error(compute_domain::Error::NotFound {
                kind: "compute node",
                id: nid.to_string(),
            }));
        }
        let cursor = start(ctx, after).await?;
        follow_object(
            ctx,
            cursor,
            EventFilter::about(None, nid.to_string()),
            |_| true,
            move || {
                let (db, nid) = (db.clone(), nid.clone());
                async move {
                    let mut found = compute_domain::fleet::get_nodes(&db, &[nid]).await?;
                    Ok(found.pop().map(crate::graph::fleet::ComputeNodeObj::new))
                }
            },
        )
    }

    /// An instance as it is after each change (another tenant's is `NOT_FOUND`).
    async fn instance(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
        #[graphql(desc = "Resume after this cursor; without it, start at the present.")]
        after: Option<String>,
    ) -> Result<
        impl Stream<Item = async_graphql::Result<crate::graph::instances::InstanceObj>> + use<>,
        GqlError,
    > {
        let iid = InstanceId::parse("id", id.as_str())?;
        let db = db(ctx)?.clone();
        let found =
            compute_domain::instances::get_instances(&db, std::slice::from_ref(&iid)).await?;
        let tenant = match found.first() {
            Some(i) if crate::graph::instances::visible(ctx, i)? => i.tenant_id.clone(),
            _ => {
                return Err(gql_error(compute_domain::Error::NotFound {
                    kind: "instance",
                    id: iid.to_string(),
                }));
            }
        };
        let cursor = start(ctx, after).await?;
        follow_object(
            ctx,
            cursor,
            EventFilter::about(Some(tenant), iid.to_string()),
            |_| true,
            move || {
                let (db, iid) = (db.clone(), iid.clone());
                async move {
                    let mut found = compute_domain::instances::get_instances(&db, &[iid]).await?;
                    Ok(found.pop().map(crate::graph::instances::InstanceObj))
                }
            },
        )
    }

    /// A command as it is after each change: dispatched, running, progress, its outcome
    /// (operators only).
    async fn command(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
        #[graphql(desc = "Resume after this cursor; without it, start at the present.")]
        after: Option<String>,
    ) -> Result<
        impl Stream<Item = async_graphql::Result<crate::graph::commands::CommandObj>> + use<>,
        GqlError,
    > {
        let cid = CommandId::parse("id", id.as_str())?;
        crate::graph::require_operator_on(ctx, compute_domain::authz::Target::Command(cid.clone()))
            .await?;
        let db = db(ctx)?.clone();
        if compute_domain::node_commands::get_commands(&db, std::slice::from_ref(&cid))
            .await?
            .is_empty()
        {
            return Err(gql_error(compute_domain::Error::NotFound {
                kind: "command",
                id: cid.to_string(),
            }));
        }
        let cursor = start(ctx, after).await?;
        follow_object(
            ctx,
            cursor,
            EventFilter::about(None, cid.to_string()),
            |_| true,
            move || {
                let (db, cid) = (db.clone(), cid.clone());
                async move {
                    let mut found =
                        compute_domain::node_commands::get_commands(&db, &[cid]).await?;
                    Ok(found.pop().map(crate::graph::commands::CommandObj))
                }
            },
        )
    }

    /// A pool as it is after each change that can move its capacity: a reservation placed,
    /// started, ended or released on it, a node of it changed, or a device of one of its nodes
    /// changed. Select `capacity` (and `capacity(window:)`) for a dashboard.
    async fn pool_capacity(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
        #[graphql(desc = "Resume after this cursor; without it, start at the present.")]
        after: Option<String>,
    ) -> Result<
        impl Stream<Item = async_graphql::Result<crate::graph::fleet::PoolObj>> + use<>,
        GqlError,
    > {
        viewer(ctx)?;
        let pid = PoolId::parse("id", id.as_str())?;
        let db = db(ctx)?.clone();
        if compute_domain::fleet::get_pools(&db, std::slice::from_ref(&pid))
            .await?
            .is_empty()
        {
            return Err(gql_error(compute_domain::Error::NotFound {
                kind: "pool",
                id: pid.to_string(),
            }));
        }
        // The cursor first, then the pool's nodes: a node that joins in between is seen by its
        // `node.registered` event, after the cursor.
        let cursor = start(ctx, after).await?;
        let nodes = compute_domain::fleet::node_ids_of_pool(&db, &pid).await?;
        let mut relevance = PoolRelevance {
            pool_id: pid.clone(),
            nodes: nodes.into_iter().collect(),
        };
        // Fleet events are not a tenant's, so this follows every event and keeps those about
        // the pool: one stream for the whole dashboard tile, never one per node.
        follow_object(
            ctx,
            cursor,
            EventFilter::default(),
            move |event| relevance.concerns(event),
            move || {
                let (db, pid) = (db.clone(), pid.clone());
                async move {
                    let mut found = compute_domain::fleet::get_pools(&db, &[pid]).await?;
                    Ok(found.pop().map(crate::graph::fleet::PoolObj))
                }
            },
        )
    }
}

/// One object followed through its events, the one shape of the follow-one-object
/// subscriptions: from `cursor`, after each event of `filter` that `wanted` keeps, the object
/// as it is then (`reload`), skipped when it is gone.
fn follow_object<T, W, R, Fut>(
    ctx: &Context<'_>,
    cursor: Cursor,
    filter: EventFilter,
    mut wanted: W,
    reload: R,
) -> Result<impl Stream<Item = async_graphql::Result<T>> + use<T, W, R, Fut>, GqlError>
where
    T: Send + 'static,
    W: FnMut(&Event) -> bool + Send + 'static,
    R: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = compute_domain::Result<Option<T>>> + Send + 'static,
{
    let feed = tailer(ctx)?.feed(cursor, filter);
    Ok(follow(
        feed,
        ctx.data_opt::<StreamPosition>().cloned(),
        move |event| {
            let fetch = wanted(&event).then(&reload);
            async move {
                match fetch {
                    Some(fut) => fut.await,
                    None => Ok(None),
                }
            }
        },
    ))
}

/// What the pool-capacity subscription follows: the pool, and the nodes it learned are in it
/// (a device's event names only its node).
struct PoolRelevance {
    pool_id: PoolId,
    nodes: std::collections::HashSet<NodeId>,
}

impl PoolRelevance {
    fn concerns(&mut self, event: &Event) -> bool {
        let about = compute_domain::outbox::concerns(&event.event_type, &event.data);
        if about.pool.as_ref() == Some(&self.pool_id) {
            if let Some(node) = about.node {
                self.nodes.insert(node);
            }
            return true;
        }
        about.pool.is_none() && about.node.is_some_and(|n| self.nodes.contains(&n))
    }
}
