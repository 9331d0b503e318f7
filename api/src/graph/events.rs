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
use futures_util::{Stream, StreamExt};

use crate::graph::common::gql_id;
use crate::graph::{GqlError, GqlResult, actor, db, gql_error, require_viewer};
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
    /// Where the `events` resolver hands its feed to a transport that serves stored payloads
    /// itself ([`Direct`]); `None` unless the transport asked for it.
    handover: Option<tokio::sync::oneshot::Receiver<Direct>>,
}

/// An `events` subscription's feed, handed to the transport that runs it: the transport reads
/// each event, sends the payload another subscription of the same shape stored for it as it
/// is, and hands only the others to the resolver's stream (`render`) to be resolved and
/// serialized by async-graphql, in order, one at a time. An event of a shape that a thousand
/// subscribers share is then rendered once and costs the others a lookup and a write, not an
/// execution of their operation each.
pub struct Direct {
    /// The subscription's events, filtered as the resolver's arguments say.
    pub feed: Feed,
    slot: Arc<share::Slot>,
    render: Sender,
}

/// The transport's end of a [`Mailbox`].
struct Sender(Arc<Mailbox>);

impl Drop for Sender {
    fn drop(&mut self) {
        // The feed is gone: the stream ends once it has rendered what it was handed.
        self.0
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.0.ready.notify_one();
    }
}

/// One event at a time from a transport to the resolver's stream: a slot and a wake-up, a
/// hundred bytes for every open subscription where a channel would hold a block of them.
#[derive(Default)]
struct Mailbox {
    item: Mutex<Option<Rendered>>,
    ready: tokio::sync::Notify,
    closed: std::sync::atomic::AtomicBool,
}

impl Mailbox {
    /// The next item, or `None` once the transport dropped its [`Direct`] and nothing is left.
    async fn recv(&self) -> Option<Rendered> {
        loop {
            // Created before the checks: a `notify_one` between them is kept as a permit.
            let ready = self.ready.notified();
            if let Some(item) = self.item.lock().unwrap_or_else(|p| p.into_inner()).take() {
                return Some(item);
            }
            if self.closed.load(std::sync::atomic::Ordering::Acquire) {
                return None;
            }
            ready.await;
        }
    }
}

impl Direct {
    /// The payload stored for the event at `cursor` in this subscription's shape, if another
    /// subscription rendered it ([`share`]).
    pub fn stored(&self, cursor: Option<Cursor>) -> Option<Arc<str>> {
        self.slot.stored(cursor?)
    }

    /// Hands `event` (or the feed's error, which ends the subscription with it) to the
    /// resolver's stream, whose next response is its rendering. `false` when the operation's
    /// stream is gone, or still has the last event handed to it (a transport hands one at a
    /// time, and waits for its response).
    pub fn render(&self, event: compute_domain::Result<Arc<Event>>) -> bool {
        // The stream holds the mailbox while it runs: alone, the transport's is the last.
        let mailbox = &self.render.0;
        if Arc::strong_count(mailbox) < 2 {
            return false;
        }
        let mut item = mailbox.item.lock().unwrap_or_else(|p| p.into_inner());
        if item.is_some() {
            return false;
        }
        *item = Some(event.map_err(Box::new));
        drop(item);
        mailbox.ready.notify_one();
        true
    }
}

/// What a transport hands back to be rendered: a pointer's size, since the channel holds a
/// block of them for every open subscription.
type Rendered = Result<Arc<Event>, Box<compute_domain::Error>>;

/// The sending half of a [`Streaming`]'s handover, in the request's data.
struct Handover(Mutex<Option<tokio::sync::oneshot::Sender<Direct>>>);

impl Streaming {
    /// Attaches the caller, a [`StreamPosition`], a replay flag and, for a subscription, its
    /// [`share::Slot`] in `frames` to `request`.
    ///
    /// With `direct`, an `events` subscription of a shape hands its feed to the transport
    /// ([`Streaming::handover`]).
    pub fn attach(
        mut request: async_graphql::Request,
        viewer: Option<crate::auth::Viewer>,
        frames: &Arc<share::Frames>,
        direct: bool,
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
        let mut handover = None;
        if direct && slot.is_some() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            request = request.data(Arc::new(Handover(Mutex::new(Some(tx)))));
            handover = Some(rx);
        }
        let s = Streaming {
            position: StreamPosition::default(),
            replay: crate::graph::ReplayFlag::default(),
            slot,
            handover,
        };
        let request = request.data(s.position.clone()).data(s.replay.clone());
        (request, s)
    }

    /// Where the `events` resolver will hand its feed, once: a receiver that gets the
    /// [`Direct`] when the subscription has started (and is closed for any other operation).
    pub fn handover(&mut self) -> Option<tokio::sync::oneshot::Receiver<Direct>> {
        self.handover.take()
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
            let present = tailer.present().await;
            tailer.check_not_expired(c)?;
            // Ahead of what this process has seen: another process's newer event, or a cursor
            // no event has (which would wait forever): the database tells them apart.
            if c > present {
                compute_domain::outbox::check_not_ahead(tailer.db(), c).await?;
            }
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

/// The items of an `events` subscription whose feed a transport runs ([`Direct`]): the events
/// it hands back, each mapped by `item` at its position; an error ends the stream with it.
fn rendered<F>(
    rx: Arc<Mailbox>,
    position: Option<StreamPosition>,
    item: F,
) -> impl Stream<Item = async_graphql::Result<EventItem>> + use<F>
where
    F: FnMut(Arc<Event>) -> EventItem + Send + 'static,
{
    futures_util::stream::unfold((rx, item, false), move |(rx, mut item, done)| {
        let position = position.clone();
        async move {
            if done {
                return None;
            }
            match rx.recv().await? {
                Ok(event) => {
                    if let Some(p) = &position {
                        p.set(event.cursor);
                    }
                    let next = item(event);
                    Some((Ok(next), (rx, item, false)))
                }
                Err(e) => Some((Err(gql_error(*e).into()), (rx, item, true))),
            }
        }
    })
}

/// An `events` item for an event: [`EventItem::Stored`] when `slot` has its payload.
fn item_of(slot: Option<Arc<share::Slot>>) -> impl FnMut(Arc<Event>) -> EventItem + Send + 'static {
    move |e| {
        if slot.as_ref().is_some_and(|s| s.lookup(e.cursor)) {
            EventItem::Stored
        } else {
            EventItem::Fresh(EventObj(e))
        }
    }
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
        require_viewer(ctx)?;
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
        let position = ctx.data_opt::<StreamPosition>().cloned();
        // A transport that serves stored payloads itself takes the feed, and this stream
        // renders what it hands back.
        let handover = ctx
            .data_opt::<Arc<Handover>>()
            .and_then(|h| h.0.lock().unwrap_or_else(|p| p.into_inner()).take());
        let feed = match (handover, &slot) {
            (Some(tx), Some(shared)) => {
                let rx = Arc::new(Mailbox::default());
                let direct = Direct {
                    feed,
                    slot: shared.clone(),
                    render: Sender(rx.clone()),
                };
                match tx.send(direct) {
                    Ok(()) => return Ok(rendered(rx, position, item_of(slot)).right_stream()),
                    // The transport's operation is gone: serve it here (it ends soon).
                    Err(direct) => direct.feed,
                }
            }
            _ => feed,
        };
        let mut item = item_of(slot);
        Ok(follow(feed, position, move |e| {
            let item = item(e);
            async move { Ok(Some(item)) }
        })
        .left_stream())
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
    /// changed. Select `capacity` (and `capacity(window:)`) for a dashboard. An operator of the
    /// pool gets an item for each change; anyone else at most one a second, the pool after every
    /// change of that second, so a member cannot watch other tenants' reservations one by one.
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
        require_viewer(ctx)?;
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
        // An operator of the pool sees every change; anyone else at most one item per
        // `pool_capacity_pace`, the pool after all the changes of that interval, so a member
        // learns no more of other tenants' activity than polling `pool` would show.
        let every_change = crate::graph::require_operator_on(
            ctx,
            compute_domain::authz::Target::Pool(pid.clone()),
        )
        .await
        .is_ok();
        let pace = tailer(ctx)?.config().pool_capacity_pace;
        let cursor = start(ctx, after).await?;
        let nodes = compute_domain::fleet::node_ids_of_pool(&db, &pid).await?;
        let mut relevance = PoolRelevance {
            pool_id: pid.clone(),
            nodes: nodes.into_iter().collect(),
        };
        let reload = move || {
            let (db, pid) = (db.clone(), pid.clone());
            async move {
                let mut found = compute_domain::fleet::get_pools(&db, &[pid]).await?;
                Ok(found.pop().map(crate::graph::fleet::PoolObj))
            }
        };
        // Fleet events are not a tenant's, so this follows every event and keeps those about
        // the pool: one stream for the whole dashboard tile, never one per node.
        let feed = tailer(ctx)?.feed(cursor, EventFilter::default());
        let position = ctx.data_opt::<StreamPosition>().cloned();
        Ok(if every_change {
            follow(feed, position, move |event| {
                let fetch = relevance.concerns(&event).then(&reload);
                async move {
                    match fetch {
                        Some(fut) => fut.await,
                        None => Ok(None),
                    }
                }
            })
            .left_stream()
        } else {
            follow_paced(
                feed,
                position,
                move |event| relevance.concerns(event),
                reload,
                pace,
            )
            .right_stream()
        })
    }
}

/// The items of a follow-one-object subscription at most once per `pace`: the first event
/// `wanted` keeps opens an interval, every event until it closes is read (and given to
/// `wanted`), then one item, the object as it is then (`reload`), at the position of the last
/// event kept. Events that arrive together (a catch-up, a busy second) make one item.
fn follow_paced<T, W, R, Fut>(
    feed: Feed,
    position: Option<StreamPosition>,
    wanted: W,
    reload: R,
    pace: std::time::Duration,
) -> impl Stream<Item = async_graphql::Result<T>> + use<T, W, R, Fut>
where
    T: Send + 'static,
    W: FnMut(&Event) -> bool + Send + 'static,
    R: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = compute_domain::Result<Option<T>>> + Send + 'static,
{
    type Step<T> = Option<async_graphql::Result<T>>;
    futures_util::stream::unfold(
        (feed, wanted, reload, false),
        move |(mut feed, mut wanted, reload, done)| {
            let position = position.clone();
            async move {
                if done {
                    return None;
                }
                // `Feed::next` is cancel-safe (its cursor moves only with an event handed
                // out), so the interval's timer may interrupt it.
                let outcome: Step<T> = 'item: loop {
                    let mut last = loop {
                        match feed.next().await {
                            Ok(Some(e)) if wanted(&e) => break e.cursor,
                            Ok(Some(_)) => continue,
                            Ok(None) => break 'item None,
                            Err(e) => break 'item Some(Err(gql_error(e).into())),
                        }
                    };
                    let closes = tokio::time::Instant::now() + pace;
                    loop {
                        tokio::select! {
                            _ = tokio::time::sleep_until(closes) => break,
                            next = feed.next() => match next {
                                Ok(Some(e)) => {
                                    if wanted(&e) {
                                        last = e.cursor;
                                    }
                                }
                                Ok(None) => break 'item None,
                                Err(e) => break 'item Some(Err(gql_error(e).into())),
                            },
                        }
                    }
                    match reload().await {
                        Ok(Some(item)) => {
                            if let Some(p) = &position {
                                p.set(last);
                            }
                            break 'item Some(Ok(item));
                        }
                        Ok(None) => continue,
                        Err(e) => break 'item Some(Err(gql_error(e).into())),
                    }
                };
                let done = !matches!(outcome, Some(Ok(_)));
                outcome.map(|item| (item, (feed, wanted, reload, done)))
            }
        },
    )
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
