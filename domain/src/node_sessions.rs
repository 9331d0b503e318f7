//! Node daemons' sessions and liveness: what a gateway writes for the nodes whose daemons it
//! holds, and the liveness reconciler's transitions (`docs/nodes.md`).
//!
//! - **Sessions with epochs.** One `node_sessions` row per node. Opening a session increments
//!   `session_epoch` and supersedes any older one; every later write for the node carries
//!   `AND session_epoch = $epoch`, and every gateway transaction starts with the gateway's lease
//!   fence ([`Db::fenced`]), so a gateway that lost the session or its lease changes nothing.
//! - **Ages, not timestamps.** [`flush`] takes "last seen `age` seconds ago" for all of a
//!   gateway's sessions in one statement; the database computes `compute_now() - age`, and a
//!   negative age counts as 0: a gateway with a wrong clock cannot move `last_seen_at` into the
//!   future.
//! - **Disconnected is not dead.** [`liveness_pass`] moves `CONNECTED` → `DISCONNECTED` when a
//!   gateway's lease is gone, `DISCONNECTED` → `UNREACHABLE` at `unreachable_at` (40 s plus the
//!   grace of why it disconnected, `compute_unreachable_at`), and `UNREACHABLE` → `LOST` after the
//!   pool's `lost_after` for provider and VPS pools only. Nothing is released here.
//!
//! Lock order (`docs/database-locks.md`): the lease fence, `liveness_passes`, then per node
//! `node_sessions` before `nodes`, nodes in ascending id.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{self, EventType, NodePayload};
use crate::fleet::{Node, query_nodes};
use crate::ids::{GatewayId, NodeId};
use crate::outbox::{self, NewEvent};
use crate::text_enum::text_enum;

/// How long a node may be without a session before it is `UNREACHABLE` (before any grace).
pub const UNREACHABLE_AFTER: Duration = Duration::from_secs(40);
/// The grace after a gateway loss, on top of [`UNREACHABLE_AFTER`].
pub const GATEWAY_LOSS_GRACE: Duration = Duration::from_secs(120);
/// The grace after an outage of the database or of every controller, on top of
/// [`UNREACHABLE_AFTER`], counted from the pass that noticed it.
pub const OUTAGE_GRACE: Duration = Duration::from_secs(300);
/// A liveness pass that finds the previous one older than this knows there was an outage
/// (passes run every few seconds under a 15 s lease).
pub const OUTAGE_THRESHOLD: Duration = Duration::from_secs(30);
/// A session whose `last_seen_at` (the gateways' ages) is older than this is ended by the
/// liveness pass (`silent`): its gateway keeps its lease but stopped hearing from the daemon, or
/// stopped flushing for it, without closing it (a gateway closes a daemon silent for 15 s
/// itself, and flushes every 2 s). Not in the pass that notices an outage, nor until this long
/// after one (no gateway could flush meanwhile).
pub const STALE_AFTER: Duration = Duration::from_secs(60);
/// A gateway's lease lives this long without renewal (other leases live 15 s).
pub const GATEWAY_TTL: Duration = Duration::from_secs(20);

/// The lease a gateway holds: `gateway:<id>` ([`crate::leases::name::gateway`]).
pub fn gateway_lease(gateway: &GatewayId) -> String {
    crate::leases::name::gateway(gateway)
}

text_enum!(
    /// Why a session ended (`node_sessions.close_reason`).
    CloseReason {
        DaemonClosed = "daemon_closed",
        Silent = "silent",
        Superseded = "superseded",
        GatewayLost = "gateway_lost",
        GatewayStopped = "gateway_stopped",
        NodeRetired = "node_retired",
        ProtocolError = "protocol_error",
    }
);

/// A node's session, open or the last one closed.
#[derive(Debug, Clone)]
pub struct Session {
    pub node_id: NodeId,
    pub session_epoch: i64,
    pub gateway: GatewayId,
    pub daemon_version: String,
    pub journal_id: String,
    pub opened_at: DateTime<Utc>,
    pub last_seen_at: DateTime<Utc>,
    pub closed_at: Option<DateTime<Utc>>,
    pub close_reason: Option<CloseReason>,
    /// `compute_now() - last_seen_at`, in seconds, when read.
    pub seconds_since_seen: f64,
}

/// What a daemon says when it opens its session.
#[derive(Debug, Clone)]
pub struct Hello {
    pub daemon_version: Label,
    pub journal_id: Label,
    pub observed_generation: i64,
}

/// A daemon-supplied label (its version, its journal's id): 1 to 100 printable characters.
/// Only [`Label::parse`] makes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label(String);

impl Label {
    /// Parses a label; `field` names it in the error.
    pub fn parse(field: &str, value: &str) -> Result<Label> {
        if value.is_empty() || value.chars().count() > 100 || value.chars().any(char::is_control) {
            return Err(Error::bad_input(
                field,
                format!("`{field}` must be 1 to 100 printable characters"),
            ));
        }
        Ok(Label(value.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A daemon's `observedGeneration` lies between 0 and the node's `generation`.
fn check_generation(observed: i64, generation: i64) -> Result<()> {
    if !(0..=generation).contains(&observed) {
        return Err(Error::bad_input(
            "observedGeneration",
            format!(
                "observedGeneration must be between 0 and the node's generation ({generation})"
            ),
        ));
    }
    Ok(())
}

async fn emit_node(conn: &mut PgConnection, event: EventType, node: &Node) -> Result<()> {
    outbox::emit(
        conn,
        NewEvent {
            event_type: event,
            tenant_id: None,
            subject: node.id.as_str(),
            data: events::to_data(&NodePayload::of(node))?,
        },
    )
    .await?;
    Ok(())
}

/// Opens `node`'s session on `gateway` (whose lease has `gateway_epoch`); `db` must be fenced by
/// the gateway's lease. Supersedes any session the node had; the node becomes `CONNECTED`
/// (leaving `UNREACHABLE` if it was) and `node.connected` is written. Returns the new epoch.
/// An unknown node is `NOT_FOUND`; a retired one `CONFLICT`; a generation the node was never
/// given `BAD_USER_INPUT`.
#[tracing::instrument(level = "debug", skip_all, fields(node = %node, gateway = %gateway, gateway_epoch = gateway_epoch))]
pub async fn open(
    db: &Db,
    node: &NodeId,
    gateway: &GatewayId,
    gateway_epoch: i64,
    hello: &Hello,
) -> Result<i64> {
    db.tx("open_node_session", TxKind::Write, |conn| {
        let (node, gateway, hello) = (node.clone(), gateway.clone(), hello.clone());
        Box::pin(async move {
            let Some(row) = sqlx::query!(
                "SELECT retired_at IS NOT NULL AS \"retired!\", generation FROM nodes WHERE id = $1",
                node.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?
            else {
                return Err(Error::NotFound {
                    kind: "node",
                    id: node.to_string(),
                });
            };
            if row.retired {
                return Err(Error::Conflict {
                    message: format!("node {node} is retired"),
                    current_version: None,
                });
            }
            check_generation(hello.observed_generation, row.generation)?;
            // The journal the node's last session had: a different one now means the daemon
            // lost its memory (node_commands::on_session_open).
            let previous = sqlx::query_scalar!(
                "SELECT journal_id FROM node_sessions WHERE node_id = $1 FOR UPDATE",
                node.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?;
            let epoch = sqlx::query_scalar!(
                "INSERT INTO node_sessions AS s (node_id, session_epoch, gateway, gateway_epoch, daemon_version, journal_id, opened_at, last_seen_at) \
                 VALUES ($1, 1, $2, $3, $4, $5, compute_now(), compute_now()) \
                 ON CONFLICT (node_id) DO UPDATE SET session_epoch = s.session_epoch + 1, gateway = EXCLUDED.gateway, \
                        gateway_epoch = EXCLUDED.gateway_epoch, daemon_version = EXCLUDED.daemon_version, \
                        journal_id = EXCLUDED.journal_id, opened_at = EXCLUDED.opened_at, last_seen_at = EXCLUDED.last_seen_at, \
                        closed_at = NULL, close_reason = NULL \
                 RETURNING session_epoch",
                node.as_str(),
                gateway.as_str(),
                gateway_epoch,
                hello.daemon_version.as_str(),
                hello.journal_id.as_str(),
            )
            .fetch_one(&mut *conn)
            .await?;
            let updated = query_nodes!(
                "UPDATE nodes AS n SET reachability = 'connected', \
                        reachability_since = CASE WHEN n.reachability = 'connected' THEN n.reachability_since ELSE compute_now() END, \
                        unreachable_at = NULL, \
                        conditions = compute_conditions_without(compute_conditions_without(n.conditions, 'NodeUnreachable'), 'NodeLost'), \
                        observed_generation = greatest(n.observed_generation, $2), \
                        version = n.version + 1, updated_at = compute_now() \
                  WHERE n.id = $1 RETURNING",
                "",
                node.as_str(),
                hello.observed_generation,
            )
            .fetch_one(&mut *conn)
            .await?;
            emit_node(conn, EventType::NodeConnected, &updated).await?;
            let reopened = crate::node_commands::on_session_open(
                conn,
                &node,
                epoch,
                previous.as_deref(),
                hello.journal_id.as_str(),
            )
            .await?;
            if reopened != crate::node_commands::Reopened::default() {
                tracing::info!(node = %node, epoch, requeued = reopened.requeued, journal_reset = reopened.reset,
                    "a new session took back the commands of the old one");
            }
            Ok(epoch)
        })
    })
    .await
}

/// Closes `node`'s session at `epoch` for `reason`; the node becomes `DISCONNECTED` (nothing is
/// released) with `unreachable_at` set, and `node.disconnected` is written. `false` when the
/// session at that epoch was already closed or superseded (then nothing changes).
#[tracing::instrument(level = "debug", skip_all, fields(node = %node, epoch = epoch))]
pub async fn close(db: &Db, node: &NodeId, epoch: i64, reason: CloseReason) -> Result<bool> {
    db.tx("close_node_session", TxKind::Write, |conn| {
        let node = node.clone();
        Box::pin(async move { close_in(conn, &node, epoch, reason).await })
    })
    .await
}

async fn close_in(
    conn: &mut PgConnection,
    node: &NodeId,
    epoch: i64,
    reason: CloseReason,
) -> Result<bool> {
    let closed = sqlx::query_scalar!(
        "UPDATE node_sessions SET closed_at = compute_now(), close_reason = $3 \
          WHERE node_id = $1 AND session_epoch = $2 AND closed_at IS NULL RETURNING session_epoch",
        node.as_str(),
        epoch,
        reason.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?;
    if closed.is_none() {
        return Ok(false);
    }
    if let Some(updated) = query_nodes!(
        "UPDATE nodes AS n SET reachability = 'disconnected', reachability_since = compute_now(), \
                unreachable_at = compute_unreachable_at($2), version = n.version + 1, updated_at = compute_now() \
          WHERE n.id = $1 AND n.reachability = 'connected' RETURNING",
        "",
        node.as_str(),
        reason.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?
    {
        emit_node(conn, EventType::NodeDisconnected, &updated).await?;
    }
    Ok(true)
}

/// One session's "last seen" as a gateway reports it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub node: NodeId,
    pub epoch: i64,
    /// Seconds since the gateway last heard from the daemon (negative counts as 0).
    pub age_seconds: f64,
}

/// Writes "last seen" for all of `gateway`'s sessions in one statement (`db` fenced by the
/// gateway's lease): `last_seen_at = compute_now() - age`, never later than now and never
/// earlier than it was. Returns the nodes whose session is still this gateway's at that epoch;
/// the gateway closes the connections of the others (superseded, or ended by the reconciler).
#[tracing::instrument(level = "debug", skip_all, fields(gateway = %gateway, sessions = seen.len()))]
pub async fn flush(db: &Db, gateway: &GatewayId, seen: &[Seen]) -> Result<Vec<NodeId>> {
    let nodes: Vec<String> = seen.iter().map(|s| s.node.to_string()).collect();
    let epochs: Vec<i64> = seen.iter().map(|s| s.epoch).collect();
    let ages: Vec<f64> = seen
        .iter()
        .map(|s| {
            if s.age_seconds.is_finite() {
                s.age_seconds.max(0.0)
            } else {
                0.0
            }
        })
        .collect();
    db.tx("flush_node_sessions", TxKind::Write, |conn| {
        let (gateway, nodes, epochs, ages) = (gateway.clone(), nodes.clone(), epochs.clone(), ages.clone());
        Box::pin(async move {
            Ok(sqlx::query_scalar!(
                r#"UPDATE node_sessions s
                      SET last_seen_at = greatest(s.last_seen_at, compute_now() - make_interval(secs => v.age))
                     FROM unnest($2::text[], $3::int8[], $4::float8[]) AS v(node, epoch, age)
                    WHERE s.node_id = v.node AND s.session_epoch = v.epoch AND s.gateway = $1 AND s.closed_at IS NULL
                RETURNING s.node_id AS "node_id: NodeId""#,
                gateway.as_str(),
                &nodes,
                &epochs,
                &ages,
            )
            .fetch_all(&mut *conn)
            .await?)
        })
    })
    .await
}

/// Records the generation the daemon of `node` (session `epoch`) has applied; writes
/// `node.updated` when it moved. `false` when the session is no longer current. A generation
/// past the node's is `BAD_USER_INPUT`.
#[tracing::instrument(level = "debug", skip_all, fields(node = %node, epoch = epoch, generation = generation))]
pub async fn observe_generation(
    db: &Db,
    node: &NodeId,
    epoch: i64,
    generation: i64,
) -> Result<bool> {
    db.tx("observe_generation", TxKind::Write, |conn| {
        let node = node.clone();
        Box::pin(async move {
            let current = sqlx::query_scalar!(
                "SELECT session_epoch FROM node_sessions WHERE node_id = $1 AND session_epoch = $2 AND closed_at IS NULL FOR SHARE",
                node.as_str(),
                epoch,
            )
            .fetch_optional(&mut *conn)
            .await?;
            if current.is_none() {
                return Ok(false);
            }
            let limit = sqlx::query_scalar!("SELECT generation FROM nodes WHERE id = $1", node.as_str())
                .fetch_one(&mut *conn)
                .await?;
            check_generation(generation, limit)?;
            if let Some(updated) = query_nodes!(
                "UPDATE nodes AS n SET observed_generation = $2, version = n.version + 1, updated_at = compute_now() \
                  WHERE n.id = $1 AND n.observed_generation < $2 RETURNING",
                "",
                node.as_str(),
                generation,
            )
            .fetch_optional(&mut *conn)
            .await?
            {
                emit_node(conn, EventType::NodeUpdated, &updated).await?;
                // Commands that waited for this generation may go now.
                crate::node_commands::generation_observed(conn, &node).await?;
            }
            Ok(true)
        })
    })
    .await
}

/// The sessions of `nodes` (open, or the last one closed), for the graph's loader.
pub async fn sessions_of(db: &Db, nodes: &[NodeId]) -> Result<Vec<Session>> {
    let ids: Vec<String> = nodes.iter().map(ToString::to_string).collect();
    Ok(sqlx::query_as!(
        Session,
        r#"SELECT s.node_id AS "node_id: _", s.session_epoch, s.gateway AS "gateway: _", s.daemon_version,
                  s.journal_id, s.opened_at, s.last_seen_at, s.closed_at, s.close_reason AS "close_reason: _",
                  extract(epoch FROM compute_now() - s.last_seen_at)::float8 AS "seconds_since_seen!"
             FROM node_sessions s WHERE s.node_id = ANY($1)"#,
        &ids[..] as &[String],
    )
    .fetch_all(db.pool())
    .await?)
}

/// What one liveness pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LivenessPass {
    /// The gap, in seconds, when this pass noticed an outage.
    pub outage_seconds: Option<f64>,
    pub disconnected: u64,
    pub unreachable: u64,
    pub lost: u64,
}

/// One pass of the liveness reconciler (`db` fenced by its lease): notes an outage, ends the
/// sessions of lost gateways, of retired nodes and those not seen for [`STALE_AFTER`] (the ages
/// the gateways report are what decides), and moves nodes to `UNREACHABLE` and `LOST` when
/// due. One transaction per node for the transitions; at most 500 of each per pass.
pub async fn liveness_pass(db: &Db) -> Result<LivenessPass> {
    let outage_seconds = note_pass(db).await?;
    extend_after_outage(db).await?;
    let mut pass = LivenessPass {
        outage_seconds,
        ..LivenessPass::default()
    };
    // Stale sessions only when no outage is recent: after one, no gateway could flush.
    let stale_from = outage_seconds
        .is_none()
        .then_some(STALE_AFTER.as_secs_f64());
    let ended = sqlx::query!(
        r#"SELECT s.node_id AS "node_id: NodeId", s.session_epoch,
                  (n.retired_at IS NOT NULL) AS "retired!",
                  (l.name IS NULL OR l.expires_at <= compute_now() OR l.epoch <> s.gateway_epoch) AS "gateway_lost!"
             FROM node_sessions s JOIN nodes n ON n.id = s.node_id
             LEFT JOIN leases l ON l.name = 'gateway:' || s.gateway
             LEFT JOIN liveness_passes p ON p.id = 1
            WHERE s.closed_at IS NULL
              AND (n.retired_at IS NOT NULL OR l.name IS NULL OR l.expires_at <= compute_now() OR l.epoch <> s.gateway_epoch
                   OR (s.last_seen_at < compute_now() - make_interval(secs => $1::float8)
                       AND coalesce(p.last_outage_at < compute_now() - make_interval(secs => $1::float8), true)))
            ORDER BY s.node_id LIMIT 500"#,
        stale_from,
    )
    .fetch_all(db.pool())
    .await?;
    for s in ended {
        let reason = if s.retired {
            CloseReason::NodeRetired
        } else if s.gateway_lost {
            CloseReason::GatewayLost
        } else {
            CloseReason::Silent
        };
        if close(db, &s.node_id, s.session_epoch, reason).await? {
            pass.disconnected += 1;
        }
    }
    let due = sqlx::query_scalar!(
        r#"SELECT n.id AS "id: NodeId" FROM nodes n
            WHERE n.reachability = 'disconnected' AND n.retired_at IS NULL
              AND coalesce(n.unreachable_at, n.joined_at + interval '40 seconds') <= compute_now()
            ORDER BY n.id LIMIT 500"#,
    )
    .fetch_all(db.pool())
    .await?;
    for id in due {
        if transition(db, &id, Transition::Unreachable).await? {
            pass.unreachable += 1;
        }
    }
    let due = sqlx::query_scalar!(
        r#"SELECT n.id AS "id: NodeId" FROM nodes n JOIN pools p ON p.id = n.pool_id
            WHERE n.reachability = 'unreachable' AND p.kind IN ('provider', 'vps_host') AND p.lost_after IS NOT NULL
              AND coalesce(n.reachability_since, n.joined_at) + p.lost_after <= compute_now()
            ORDER BY n.id LIMIT 500"#,
    )
    .fetch_all(db.pool())
    .await?;
    for id in due {
        if transition(db, &id, Transition::Lost).await? {
            pass.lost += 1;
        }
    }
    Ok(pass)
}

/// Records this pass; when the previous one is older than [`OUTAGE_THRESHOLD`], records the
/// outage ([`extend_after_outage`] then gives the disconnected nodes their grace). Returns the
/// gap when it was an outage.
async fn note_pass(db: &Db) -> Result<Option<f64>> {
    db.tx("liveness_note_pass", TxKind::Maintenance, |conn| {
        Box::pin(async move {
            let gap = sqlx::query_scalar!(
                r#"INSERT INTO liveness_passes AS p (id, last_pass_at) VALUES (1, compute_now())
                   ON CONFLICT (id) DO UPDATE SET last_pass_at = compute_now(),
                          last_outage_at = CASE WHEN compute_now() - p.last_pass_at > make_interval(secs => $1)
                                                THEN compute_now() ELSE p.last_outage_at END,
                          last_outage_seconds = CASE WHEN compute_now() - p.last_pass_at > make_interval(secs => $1)
                                                     THEN extract(epoch FROM compute_now() - p.last_pass_at)::float8
                                                     ELSE p.last_outage_seconds END
                   RETURNING CASE WHEN last_outage_at = compute_now() THEN last_outage_seconds END AS gap"#,
                OUTAGE_THRESHOLD.as_secs_f64(),
            )
            .fetch_one(&mut *conn)
            .await?;
            Ok(gap)
        })
    })
    .await
}

/// Within 5 min 40 s of the last outage, moves every disconnected node's `unreachable_at` to
/// the end of that grace. Every pass runs it (level-triggered: a pass that died after recording
/// the outage loses nothing). It never waits on a node row: rows another transaction holds
/// (a placement's `FOR SHARE`) are skipped and taken at the next pass, and until the grace
/// ends no node becomes unreachable anyway ([`transition`] checks it). Until session 28 this
/// was one `UPDATE` of every disconnected node inside the outage's transaction, which waited on
/// the rows a placement of several allocations held while that placement waited on the rows
/// it held: a deadlock (the torture test's, once in three runs).
async fn extend_after_outage(db: &Db) -> Result<u64> {
    db.tx("liveness_outage_grace", TxKind::Maintenance, |conn| {
        Box::pin(async move {
            Ok(sqlx::query!(
                "WITH t AS (SELECT last_outage_at + interval '340 seconds' AS target FROM liveness_passes \
                             WHERE id = 1 AND last_outage_at + interval '340 seconds' > compute_now()), \
                      due AS (SELECT n.id FROM nodes n, t \
                               WHERE n.reachability = 'disconnected' AND n.retired_at IS NULL \
                                 AND coalesce(n.unreachable_at, n.joined_at + interval '40 seconds') < t.target \
                               ORDER BY n.id FOR NO KEY UPDATE OF n SKIP LOCKED) \
                 UPDATE nodes n SET unreachable_at = t.target FROM due, t WHERE n.id = due.id",
            )
            .execute(&mut *conn)
            .await?
            .rows_affected())
        })
    })
    .await
}

#[derive(Debug, Clone, Copy)]
enum Transition {
    Unreachable,
    Lost,
}

/// Moves one node to `UNREACHABLE` or `LOST` if it is still due, raising its condition and
/// writing its event; `false` when it no longer was (it reconnected, or someone moved it).
async fn transition(db: &Db, id: &NodeId, to: Transition) -> Result<bool> {
    let (name, event) = match to {
        Transition::Unreachable => ("node_unreachable", EventType::NodeUnreachable),
        Transition::Lost => ("node_lost", EventType::NodeLost),
    };
    db.tx(name, TxKind::Maintenance, |conn| {
        let id = id.clone();
        Box::pin(async move {
            let moved = match to {
                Transition::Unreachable => query_nodes!(
                    "UPDATE nodes AS n SET reachability = 'unreachable', reachability_since = compute_now(), \
                            conditions = compute_conditions_without(n.conditions, 'NodeUnreachable') || jsonb_build_array(jsonb_build_object( \
                                'type', 'NodeUnreachable', 'status', 'True', 'reason', 'NoSession', \
                                'message', 'no session with the node''s daemon for 40 s and its grace: it takes no new work and keeps what it has', \
                                'since', compute_now())), \
                            version = n.version + 1, updated_at = compute_now() \
                      WHERE n.id = $1 AND n.reachability = 'disconnected' AND n.retired_at IS NULL \
                        AND coalesce(n.unreachable_at, n.joined_at + interval '40 seconds') <= compute_now() \
                        AND NOT EXISTS (SELECT 1 FROM node_sessions s WHERE s.node_id = n.id AND s.closed_at IS NULL) \
                        AND NOT EXISTS (SELECT 1 FROM liveness_passes p \
                                         WHERE p.id = 1 AND p.last_outage_at + interval '340 seconds' > compute_now()) \
                      RETURNING",
                    "",
                    id.as_str(),
                )
                .fetch_optional(&mut *conn)
                .await?,
                Transition::Lost => query_nodes!(
                    "UPDATE nodes AS n SET reachability = 'lost', reachability_since = compute_now(), \
                            conditions = compute_conditions_without(n.conditions, 'NodeLost') || jsonb_build_array(jsonb_build_object( \
                                'type', 'NodeLost', 'status', 'True', 'reason', 'LostAfter', \
                                'message', 'unreachable for longer than the pool''s lostAfterSeconds; its reservations fail', \
                                'since', compute_now())), \
                            version = n.version + 1, updated_at = compute_now() \
                       FROM pools p \
                      WHERE n.id = $1 AND p.id = n.pool_id AND n.reachability = 'unreachable' \
                        AND p.kind IN ('provider', 'vps_host') AND p.lost_after IS NOT NULL \
                        AND coalesce(n.reachability_since, n.joined_at) + p.lost_after <= compute_now() \
                      RETURNING",
                    "",
                    id.as_str(),
                )
                .fetch_optional(&mut *conn)
                .await?,
            };
            match moved {
                Some(node) => {
                    emit_node(conn, event, &node).await?;
                    Ok(true)
                }
                None => Ok(false),
            }
        })
    })
    .await
}
