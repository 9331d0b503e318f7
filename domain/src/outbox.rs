//! The transactional outbox: every state change writes one event row in its own transaction.
//!
//! Writers call [`emit`] (the SQL function `compute_emit`) inside the transaction that made the
//! change, so the event exists exactly when the change committed. The row's `txid` is the writing
//! transaction's id and `seq` comes from a sequence; readers (subscriptions, SSE, webhooks) take
//! rows only below the oldest running transaction, so nothing appears behind their cursor.
//! After a process commits a change, its `db::poke::Poker` sends a `NOTIFY compute_outbox` poke, at
//! most one per [`POKE_INTERVAL`] however many transactions committed, from a transaction of its
//! own: it only wakes readers early, they poll anyway. (Until migration 0015 `compute_emit`
//! notified inside every writing transaction, and PostgreSQL takes one cluster-wide lock at the
//! commit of a notifying transaction: every event-writing commit waited in one line.)

use crate::events::{EventType, Family};
use crate::ids::{EventId, NodeId, PoolId, TenantId};
use serde_json::Value;
use sqlx::PgConnection;

use crate::error::Result;

pub use crate::db::poke::{NOTIFY_CHANNEL, POKE_INTERVAL};

/// Checks event-type names: at most 100, each dotted lowercase (`reservation.active`).
pub(crate) fn check_types(types: &[String]) -> Result<()> {
    if types.len() > MAX_FILTER_ITEMS {
        return Err(crate::Error::bad_input(
            "types",
            format!("at most {MAX_FILTER_ITEMS} types"),
        ));
    }
    for t in types {
        let ok = t.split('.').count() >= 2
            && t.split('.').all(|p| {
                !p.is_empty()
                    && p.starts_with(|c: char| c.is_ascii_lowercase())
                    && p.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            });
        if !ok {
            return Err(crate::Error::bad_input(
                "types",
                format!(
                    "`{t}` is not an event type (dotted lowercase names, such as reservation.active)"
                ),
            ));
        }
    }
    Ok(())
}

/// What an event is about, for readers that follow a pool or a node (the tailer's subscribers),
/// read from its typed payload instead of probing JSON keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Concerns {
    pub pool: Option<PoolId>,
    pub node: Option<NodeId>,
}

/// [`Concerns`] of an event of type `event_type` with payload `data`. An event of a type this
/// process does not know (written by a newer version) concerns nothing it follows.
pub fn concerns(event_type: &str, data: &serde_json::Value) -> Concerns {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct PoolRef {
        id: PoolId,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct NodeRef {
        id: NodeId,
        pool_id: PoolId,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct DeviceRef {
        compute_node_id: NodeId,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ReservationRef {
        pool_id: PoolId,
    }
    #[derive(serde::Deserialize)]
    struct Of<T> {
        #[serde(
            alias = "pool",
            alias = "node",
            alias = "device",
            alias = "reservation"
        )]
        inner: T,
    }
    fn read<T: for<'de> serde::Deserialize<'de>>(data: &serde_json::Value) -> Option<T> {
        serde_json::from_value::<Of<T>>(data.clone())
            .ok()
            .map(|o| o.inner)
    }
    let Some(t) = EventType::parse(event_type) else {
        return Concerns::default();
    };
    match t.family() {
        Family::Pool => Concerns {
            pool: read::<PoolRef>(data).map(|p| p.id),
            node: None,
        },
        Family::Node => read::<NodeRef>(data)
            .map(|n| Concerns {
                pool: Some(n.pool_id),
                node: Some(n.id),
            })
            .unwrap_or_default(),
        Family::Device => Concerns {
            pool: None,
            node: read::<DeviceRef>(data).map(|d| d.compute_node_id),
        },
        Family::Reservation => Concerns {
            pool: read::<ReservationRef>(data).map(|r| r.pool_id),
            node: None,
        },
        Family::JoinToken => Concerns {
            pool: data
                .pointer("/joinToken/poolId")
                .and_then(|p| p.as_str())
                .and_then(PoolId::from_trusted),
            node: None,
        },
        Family::Site
        | Family::Quota
        | Family::EventSink
        | Family::Command
        | Family::Instance
        | Family::Usage
        | Family::Authz => Concerns::default(),
    }
}

/// An event to write.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    pub event_type: EventType,
    /// The tenant the event belongs to; `None` for fleet events only operators see.
    pub tenant_id: Option<&'a TenantId>,
    /// The id of the entity that changed.
    pub subject: &'a str,
    /// The payload of the event's family (`events`), as JSON.
    pub data: Value,
}

/// Writes `event` in the caller's transaction; returns the event id (`evt_…`).
pub async fn emit(conn: &mut PgConnection, event: NewEvent<'_>) -> Result<EventId> {
    Ok(sqlx::query_scalar!(
        r#"SELECT compute_emit($1, $2, $3, $4) AS "id!: EventId""#,
        event.event_type.as_str(),
        event.tenant_id.map(TenantId::as_str),
        event.subject,
        event.data,
    )
    .fetch_one(conn)
    .await?)
}

/// Writes `events` in the caller's transaction, in order, in one statement (a reconciler's batch).
pub async fn emit_all(conn: &mut PgConnection, events: &[NewEvent<'_>]) -> Result<()> {
    if events.is_empty() {
        return Ok(());
    }
    let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    let tenants: Vec<Option<&str>> = events
        .iter()
        .map(|e| e.tenant_id.map(TenantId::as_str))
        .collect();
    let subjects: Vec<&str> = events.iter().map(|e| e.subject).collect();
    let data: Vec<Value> = events.iter().map(|e| e.data.clone()).collect();
    sqlx::query!(
        "SELECT compute_emit(t, te, s, d) FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[]) \
           WITH ORDINALITY AS e(t, te, s, d, n) ORDER BY n",
        &types as &[&str],
        &tenants as &[Option<&str>],
        &subjects as &[&str],
        &data,
    )
    .fetch_all(conn)
    .await?;
    Ok(())
}

/// A position in the outbox: the `(txid, seq)` of the last event seen. Clients see it as an
/// opaque string ([`Cursor::encode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cursor {
    pub txid: i64,
    pub seq: i64,
}

const CURSOR_PREFIX: &str = "o1";

impl Cursor {
    /// The cursor before every event.
    pub const START: Cursor = Cursor { txid: 0, seq: 0 };

    /// The opaque form clients see.
    pub fn encode(&self) -> String {
        format!("{CURSOR_PREFIX}.{:x}.{:x}", self.txid, self.seq)
    }

    /// Parses [`Cursor::encode`]'s form; anything else is `BAD_USER_INPUT` on `field`.
    pub fn decode(field: &str, s: &str) -> crate::Result<Cursor> {
        let bad = || crate::Error::bad_input(field, format!("`{s}` is not an event cursor"));
        let mut parts = s.split('.');
        if parts.next() != Some(CURSOR_PREFIX) {
            return Err(bad());
        }
        let mut num = || {
            parts
                .next()
                .and_then(|p| i64::from_str_radix(p, 16).ok())
                .filter(|n| *n >= 0)
                .ok_or_else(bad)
        };
        let cursor = Cursor {
            txid: num()?,
            seq: num()?,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(cursor)
    }
}

/// An event as readers see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub id: EventId,
    pub cursor: Option<Cursor>,
    /// Dotted type. A string, not an [`EventType`]: a reader must pass on types a newer version
    /// of the system writes.
    pub event_type: String,
    pub tenant_id: Option<TenantId>,
    /// The id of what changed (of the kind the type's family names).
    pub subject: String,
    pub data: Value,
    pub time: chrono::DateTime<chrono::Utc>,
    /// The W3C trace context of the transaction that wrote it (migration 0033), which a
    /// webhook delivery continues. Read by [`read_after`] (what deliveries read); the tailer's
    /// [`read_all_after`] leaves it out (subscriptions do not use it).
    pub traceparent: Option<String>,
}

/// What a reader may see.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// `Some(t)`: only tenant `t`'s events. `None`: every event (operators).
    pub tenant_id: Option<TenantId>,
    /// Only these types, when not empty.
    pub types: Vec<String>,
    /// Only these subjects, when not empty.
    pub subjects: Vec<String>,
}

/// The most types or subjects one filter may name.
pub const MAX_FILTER_ITEMS: usize = 100;

impl EventFilter {
    /// The events of one subject (an object's id), of `tenant`'s only when given: what a
    /// follow-one-object subscription reads.
    pub fn about(tenant_id: Option<TenantId>, subject: String) -> EventFilter {
        EventFilter {
            tenant_id,
            types: vec![],
            subjects: vec![subject],
        }
    }

    /// A filter from a client's `types` and `subjects`, checked at the door: at most
    /// [`MAX_FILTER_ITEMS`] of each, types dotted lowercase names, subjects ids of this API.
    pub fn parse(
        tenant_id: Option<TenantId>,
        types: Vec<String>,
        subjects: Vec<String>,
    ) -> Result<EventFilter> {
        check_types(&types)?;
        if subjects.len() > MAX_FILTER_ITEMS {
            return Err(crate::Error::bad_input(
                "subjects",
                format!("at most {MAX_FILTER_ITEMS} subjects"),
            ));
        }
        if let Some(bad) = subjects.iter().find(|s| crate::ids::prefix_of(s).is_none()) {
            let shown: String = bad.chars().take(80).collect();
            return Err(crate::Error::bad_input(
                "subjects",
                format!("`{shown}` is not an id of this API"),
            ));
        }
        Ok(EventFilter {
            tenant_id,
            types,
            subjects,
        })
    }

    /// Whether `event` passes the filter: the same test [`read_after`] makes in SQL.
    pub fn matches(&self, event: &Event) -> bool {
        self.tenant_id
            .as_ref()
            .is_none_or(|t| event.tenant_id.as_ref() == Some(t))
            && (self.types.is_empty() || self.types.contains(&event.event_type))
            && (self.subjects.is_empty() || self.subjects.contains(&event.subject))
    }
}

/// Reads up to `limit` events after `after`, in `(txid, seq)` order, taking only rows of
/// transactions older than every transaction still running: a transaction that took a lower
/// `seq` but commits later can never appear behind the cursor.
pub async fn read_after(
    db: &crate::db::Db,
    after: Cursor,
    filter: &EventFilter,
    limit: i64,
) -> crate::Result<Vec<Event>> {
    let rows = sqlx::query!(
        r#"SELECT o.id AS "id: EventId", o.type AS event_type, o.tenant_id AS "tenant_id: TenantId", o.subject,
                  o.data, o.time, o.txid::text::bigint AS "txid!", o.seq, o.traceparent
           FROM outbox o
          WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot())
            AND (o.txid, o.seq) > ($1::text::xid8, $2)
            AND ($3::text IS NULL OR o.tenant_id = $3)
            AND (cardinality($4::text[]) = 0 OR o.type = ANY($4))
            AND (cardinality($5::text[]) = 0 OR o.subject = ANY($5))
          ORDER BY o.txid, o.seq LIMIT $6"#,
        after.txid.to_string(),
        after.seq,
        filter.tenant_id.as_ref().map(TenantId::as_str),
        &filter.types,
        &filter.subjects,
        limit,
    )
    .fetch_all(db.pool())
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Event {
            id: r.id,
            cursor: Some(Cursor {
                txid: r.txid,
                seq: r.seq,
            }),
            event_type: r.event_type,
            tenant_id: r.tenant_id,
            subject: r.subject,
            data: r.data,
            time: r.time,
            traceparent: r.traceparent,
        })
        .collect())
}

/// Whether events that pass `filter` lie after `after`. A reader that found nothing with
/// [`read_after`] asks this to know whether to look again soon or to idle: such events were held
/// back, committed by a transaction not older than every one still running (of any database of
/// the cluster: xids are the cluster's), and no commit pokes the reader when the transaction
/// that held them back ends without writing. It does not ask whether they are still held back:
/// that transaction may have ended between the two statements, and then the events are readable
/// now, which is a reason to look again too, not to idle.
pub async fn held_back(
    db: &crate::db::Db,
    after: Cursor,
    filter: &EventFilter,
) -> crate::Result<bool> {
    let held = sqlx::query_scalar!(
        r#"SELECT EXISTS (
                SELECT 1 FROM outbox o
                 WHERE (o.txid, o.seq) > ($1::text::xid8, $2)
                   AND ($3::text IS NULL OR o.tenant_id = $3)
                   AND (cardinality($4::text[]) = 0 OR o.type = ANY($4))
                   AND (cardinality($5::text[]) = 0 OR o.subject = ANY($5))) AS "held!""#,
        after.txid.to_string(),
        after.seq,
        filter.tenant_id.as_ref().map(TenantId::as_str),
        &filter.types,
        &filter.subjects,
    )
    .fetch_one(db.pool())
    .await?;
    Ok(held)
}

/// [`read_after`] without a filter, and the pruned front ([`pruned_through`]) in the same
/// statement: what a tailer needs each poll, in one round trip.
pub async fn read_all_after(
    db: &crate::db::Db,
    after: Cursor,
    limit: i64,
) -> crate::Result<(Vec<Event>, Cursor)> {
    let rows = sqlx::query!(
        r#"SELECT r.pruned_txid::text::bigint AS "front_txid!", r.pruned_seq AS front_seq,
                o.id AS "id?: EventId", o.type AS "event_type?", o.tenant_id AS "tenant_id?: TenantId",
                o.subject AS "subject?", o.data AS "data?", o.time AS "time?", o.txid AS "txid?", o.seq AS "seq?"
           FROM outbox_retention r
           LEFT JOIN LATERAL (
                SELECT o.id, o.type, o.tenant_id, o.subject, o.data, o.time,
                       o.txid::text::bigint AS txid, o.seq
                  FROM outbox o
                 WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot())
                   AND (o.txid, o.seq) > ($1::text::xid8, $2)
                 ORDER BY o.txid, o.seq LIMIT $3) o ON true
          WHERE r.singleton
          ORDER BY o.txid, o.seq"#,
        after.txid.to_string(),
        after.seq,
        limit,
    )
    .fetch_all(db.pool())
    .await?;
    let front = rows
        .first()
        .map(|r| Cursor {
            txid: r.front_txid,
            seq: r.front_seq,
        })
        .unwrap_or(Cursor::START);
    let events = rows
        .into_iter()
        .filter_map(|r| {
            let (txid, seq) = (r.txid?, r.seq?);
            Some(Event {
                id: r.id?,
                cursor: Some(Cursor { txid, seq }),
                event_type: r.event_type?,
                tenant_id: r.tenant_id,
                subject: r.subject?,
                data: r.data?,
                time: r.time?,
                traceparent: None,
            })
        })
        .collect();
    Ok((events, front))
}

/// The cursor of the present: after the last event a reader may take now. A subscription without
/// `after` starts here.
pub async fn head(db: &crate::db::Db) -> crate::Result<Cursor> {
    let mut conn = db.pool().acquire().await?;
    head_in(&mut conn).await
}

/// [`head`] on `conn` (inside a transaction, say).
pub async fn head_in(conn: &mut PgConnection) -> crate::Result<Cursor> {
    let row = sqlx::query!(
        r#"SELECT o.txid::text::bigint AS "txid!", o.seq FROM outbox o WHERE o.txid < pg_snapshot_xmin(pg_current_snapshot())
          ORDER BY o.txid DESC, o.seq DESC LIMIT 1"#,
    )
    .fetch_optional(conn)
    .await?;
    Ok(row
        .map(|r| Cursor {
            txid: r.txid,
            seq: r.seq,
        })
        .unwrap_or(Cursor::START))
}

/// The default retention window of the outbox: events older than this are pruned, and a cursor
/// at or before the pruned front is `CURSOR_EXPIRED`.
pub const RETENTION: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// The front of the stream that pruning removed: every event at or before it may be gone.
pub async fn pruned_through(db: &crate::db::Db) -> crate::Result<Cursor> {
    let r = sqlx::query!(
        r#"SELECT pruned_txid::text::bigint AS "txid!", pruned_seq FROM outbox_retention WHERE singleton"#,
    )
    .fetch_one(db.pool())
    .await?;
    Ok(Cursor {
        txid: r.txid,
        seq: r.pruned_seq,
    })
}

/// Fails with `CURSOR_EXPIRED` when events after `after` may have been pruned.
pub async fn check_not_expired(db: &crate::db::Db, after: Cursor) -> crate::Result<()> {
    check_against(pruned_through(db).await?, after)
}

/// `BAD_USER_INPUT` when `after` is past every event the outbox can hold: its transaction id is
/// at or past the database's next one (every event's `txid` is an id already assigned, or the
/// subject's latest event's). Such a cursor was never one of this database's (forged, or saved
/// from a deployment whose database was made again), and a feed after it would wait for events
/// that never come. One query: callers ask only for a cursor ahead of what they have seen.
pub async fn check_not_ahead(db: &crate::db::Db, after: Cursor) -> crate::Result<()> {
    let next: i64 =
        sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
            .fetch_one(db.pool())
            .await?;
    if after.txid >= next {
        return Err(crate::Error::bad_input(
            "after",
            format!(
                "the cursor {} is ahead of every event of this stream (made by hand, or kept from before the database was restored or replaced); resubscribe without `after`",
                after.encode()
            ),
        ));
    }
    Ok(())
}

/// `CURSOR_EXPIRED` when `after` is before `front`, the pruned front of the outbox.
pub fn check_against(front: Cursor, after: Cursor) -> crate::Result<()> {
    if after < front {
        return Err(crate::Error::CursorExpired(format!(
            "the cursor {} is older than the outbox retention window; resubscribe without `after`",
            after.encode()
        )));
    }
    Ok(())
}

/// Prunes up to `batch` of the oldest events whose time is before `compute_now() - retention`,
/// from the front of the stream, and records the new front. Never goes past `limit` when one is
/// given (the slowest reader that must not lose events). Returns how many rows it deleted.
pub async fn prune(
    db: &crate::db::Db,
    retention: std::time::Duration,
    limit: Option<Cursor>,
    batch: i64,
) -> crate::Result<u64> {
    let limit = limit.unwrap_or(Cursor {
        txid: i64::MAX,
        seq: i64::MAX,
    });
    let deleted = sqlx::query_scalar!(
        r#"WITH head AS (
             SELECT o.txid, o.seq FROM outbox o
              WHERE o.time < compute_now() - make_interval(secs => $1::float8)
                AND o.txid < pg_snapshot_xmin(pg_current_snapshot())
                AND (o.txid, o.seq) <= ($2::text::xid8, $3)
              ORDER BY o.txid, o.seq LIMIT $4),
           front AS (SELECT txid, seq FROM head ORDER BY txid DESC, seq DESC LIMIT 1),
           gone AS (DELETE FROM outbox o USING front f WHERE (o.txid, o.seq) <= (f.txid, f.seq) RETURNING 1),
           moved AS (UPDATE outbox_retention r SET pruned_txid = f.txid, pruned_seq = f.seq,
                            pruned_at = compute_now(), updated_at = compute_now()
                       FROM front f WHERE r.singleton AND (f.txid, f.seq) > (r.pruned_txid, r.pruned_seq)
                     RETURNING 1)
         SELECT (SELECT count(*) FROM gone) + 0 * (SELECT count(*) FROM moved) AS "deleted!""#,
        retention.as_secs_f64(),
        limit.txid.to_string(),
        limit.seq,
        batch,
    )
    .fetch_one(db.pool())
    .await?;
    Ok(deleted as u64)
}

/// Listens for the outbox pokes (`db::poke::Poker`) and calls `on_poke` for each, until the listening
/// connection fails (the error is returned; call again to reconnect).
pub async fn listen_for_pokes(db: &crate::db::Db, on_poke: impl Fn()) -> crate::Result<()> {
    db.listen(NOTIFY_CHANNEL, on_poke).await
}
