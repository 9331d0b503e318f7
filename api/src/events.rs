//! Live events: the `events` subscription, read from the outbox through its cursor.
//!
//! Each subscription reads the outbox from its cursor (below the oldest running transaction, in
//! `(txid, seq)` order), so a client that reconnects with the last cursor it saw gets everything
//! it missed, then live events, without a gap or a duplicate. Today each subscription polls the
//! outbox itself every [`POLL`]; the shared tailer that reads the outbox once per process and fans
//! out in memory, the `NOTIFY` wake-up and SSE come with the subscriptions issue.

use std::collections::VecDeque;
use std::time::Duration;

use async_graphql::{Context, ID, Json, Object, Subscription};
use chrono::{DateTime, Utc};
use compute_domain::db::Db;
use compute_domain::outbox::{self, Cursor, Event, EventFilter};
use futures_util::{Stream, StreamExt};
use tracing::warn;

use crate::auth::Role;
use crate::schema::{db, gql_error, viewer};

/// How often a subscription looks for new events.
pub const POLL: Duration = Duration::from_millis(250);

/// A change, as the outbox recorded it.
pub struct EventObj(Event);

#[Object(name = "Event")]
impl EventObj {
    /// The event's id (`evt_…`), stable across redeliveries: deduplicate by it.
    async fn id(&self) -> ID {
        ID(self.0.id.clone())
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
        self.0.tenant_id.as_deref()
    }
    /// The id of what changed.
    async fn subject(&self) -> &str {
        &self.0.subject
    }
    /// When it happened (`compute_now()` of its transaction).
    async fn time(&self) -> DateTime<Utc> {
        self.0.time
    }
    /// What changed, as it is after the change.
    async fn data(&self) -> Json<serde_json::Value> {
        Json(self.0.data.clone())
    }
}

/// The root of every subscription.
#[derive(Default)]
pub struct SubscriptionRoot;

#[Subscription(name = "Subscription")]
impl SubscriptionRoot {
    /// Events after `after` (a cursor from an earlier event), or from now when it is not given:
    /// the caller's tenant's events; operators see every event, fleet events included.
    async fn events(
        &self,
        ctx: &Context<'_>,
        after: Option<String>,
        #[graphql(default)] types: Vec<String>,
        #[graphql(default)] subjects: Vec<String>,
    ) -> async_graphql::Result<impl Stream<Item = EventObj> + use<>> {
        let v = viewer(ctx)?;
        let tenant_id = if v.has_role(Role::Operator) {
            None
        } else {
            Some(v.tenant.clone().ok_or_else(|| {
                gql_error(compute_domain::Error::Forbidden(
                    "your token names no tenant".into(),
                ))
            })?)
        };
        let db = db(ctx)?.clone();
        let cursor = match after {
            Some(c) => Cursor::decode("after", &c).map_err(gql_error)?,
            None => outbox::head(&db).await.map_err(gql_error)?,
        };
        let filter = EventFilter {
            tenant_id,
            types,
            subjects,
        };
        Ok(follow(db, cursor, filter))
    }

    /// A reservation as it is after each change, from now on (another tenant's is `NOT_FOUND`).
    async fn reservation(
        &self,
        ctx: &Context<'_>,
        id: ID,
    ) -> async_graphql::Result<impl Stream<Item = crate::reservations::ReservationObj> + use<>>
    {
        let rid =
            compute_domain::fleet::model::parse_id("id", "rsv", id.as_str()).map_err(gql_error)?;
        let db = db(ctx)?.clone();
        let found = compute_domain::reservations::get_reservations(&db, std::slice::from_ref(&rid))
            .await
            .map_err(gql_error)?;
        match found.first() {
            Some(r) if crate::reservations::visible(ctx, r)? => {}
            _ => {
                return Err(gql_error(compute_domain::Error::NotFound {
                    kind: "reservation",
                    id: rid,
                }));
            }
        }
        let cursor = outbox::head(&db).await.map_err(gql_error)?;
        let filter = EventFilter {
            tenant_id: None,
            types: vec![],
            subjects: vec![rid.clone()],
        };
        Ok(follow(db.clone(), cursor, filter).filter_map(move |_| {
            let (db, rid) = (db.clone(), rid.clone());
            async move {
                compute_domain::reservations::get_reservations(&db, &[rid])
                    .await
                    .ok()
                    .and_then(|mut v| v.pop())
                    .map(crate::reservations::ReservationObj)
            }
        }))
    }

    /// A compute node as it is after each change, from now on (operators only).
    async fn compute_node(
        &self,
        ctx: &Context<'_>,
        id: ID,
    ) -> async_graphql::Result<impl Stream<Item = crate::fleet::ComputeNodeObj> + use<>> {
        crate::fleet::require_operator(ctx)?;
        let nid =
            compute_domain::fleet::model::parse_id("id", "node", id.as_str()).map_err(gql_error)?;
        let db = db(ctx)?.clone();
        let cursor = outbox::head(&db).await.map_err(gql_error)?;
        let filter = EventFilter {
            tenant_id: None,
            types: vec![],
            subjects: vec![nid.clone()],
        };
        Ok(follow(db.clone(), cursor, filter).filter_map(move |_| {
            let (db, nid) = (db.clone(), nid.clone());
            async move {
                compute_domain::fleet::get_nodes(&db, &[nid])
                    .await
                    .ok()
                    .and_then(|mut v| v.pop())
                    .map(crate::fleet::ComputeNodeObj::new)
            }
        }))
    }
}

struct Follow {
    db: Db,
    cursor: Cursor,
    filter: EventFilter,
    buffered: VecDeque<Event>,
}

/// The stream of events after `cursor`; it ends if the database fails.
fn follow(db: Db, cursor: Cursor, filter: EventFilter) -> impl Stream<Item = EventObj> {
    let state = Follow {
        db,
        cursor,
        filter,
        buffered: VecDeque::new(),
    };
    futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.buffered.pop_front() {
                if let Some(c) = event.cursor {
                    s.cursor = c;
                }
                return Some((EventObj(event), s));
            }
            match outbox::read_after(&s.db, s.cursor, &s.filter, 100).await {
                Ok(events) if events.is_empty() => tokio::time::sleep(POLL).await,
                Ok(events) => s.buffered.extend(events),
                Err(e) => {
                    warn!(error = %e, "event subscription ended: reading the outbox failed");
                    return None;
                }
            }
        }
    })
}
