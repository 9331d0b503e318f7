//! Instances: a tenant's workload on one allocation of its reservation, run as a small workflow
//! of commands (`docs/instances.md`).
//!
//! The workflow is [`reconcile`], one work-queue item of kind `instance` (key: the instance's
//! id), level-triggered: every run reads the instance, its reservation and its steps' commands,
//! and takes the next step. Each step's command is keyed `wf:<instance>:<step>` under
//! `UNIQUE (node_id, idempotency_key)` ([`node_commands::ensure`]), so a step that runs again
//! (after a crash between its commit and the queue's finish, or a second pass) finds its
//! command instead of sending another. It is woken when it is created, when one of its
//! commands moves and when its reservation's state or window changes (deferred triggers,
//! migration 0014), and at its reservation's start and end (the work queue's next wake-up).
//!
//! Lock order (`docs/database-locks.md`): the idempotency key and the reservation row
//! (`FOR SHARE`, creation only), the instance row, its commands, the outbox, `work_queue` last.

mod payload;
pub mod state;

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection, Postgres, QueryBuilder};

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{self, EventType, InstancePayload};
use crate::idempotency::{self, Actor, Claim, Outcome};
use crate::ids::{AllocationId, InstanceId, NodeId, ReservationId, TenantId};
use crate::node_commands::{self as cmds, Kind, NewCommand};
use crate::outbox::{self, NewEvent};
use crate::page::{Page, PageArgs};
use crate::work_queue::{self, WorkKind};
pub use state::State;
use state::{Action, allowed};

/// An instance.
#[derive(Debug, Clone, FromRow)]
pub struct Instance {
    pub id: InstanceId,
    pub tenant_id: TenantId,
    pub reservation_id: ReservationId,
    pub allocation_id: AllocationId,
    pub node_id: NodeId,
    pub image: String,
    pub command: Vec<String>,
    pub env: Json<BTreeMap<String, String>>,
    pub state: State,
    pub stop_requested: bool,
    pub reason: Option<String>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub stopped_at: Option<DateTime<Utc>>,
    pub version: i64,
    /// How its workload ended on its own, as the daemon reported it.
    pub exit_code: Option<i32>,
    pub exit_signal: Option<i32>,
    pub exited_at: Option<DateTime<Utc>>,
}

const COLS: &str = "i.id, i.tenant_id, i.reservation_id, i.allocation_id, i.node_id, i.image, i.command, i.env, \
     i.state, i.stop_requested, i.reason, i.created_by, i.created_at, i.updated_at, i.started_at, i.stopped_at, i.version, \
     i.exit_code, i.exit_signal, i.exited_at";

/// A checked `query_as!` of [`Instance`]s: `$head` + the columns of `instances i` + `$tail`
/// (the same columns as [`COLS`], which the listing's dynamic builder uses).
macro_rules! query_instances {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            Instance,
            $head
                + r#" i.id AS "id: _", i.tenant_id AS "tenant_id: _", i.reservation_id AS "reservation_id: _",
                     i.allocation_id AS "allocation_id: _", i.node_id AS "node_id: _", i.image, i.command,
                     i.env AS "env: _", i.state AS "state: _", i.stop_requested, i.reason, i.created_by,
                     i.created_at, i.updated_at, i.started_at, i.stopped_at, i.version,
                     i.exit_code, i.exit_signal, i.exited_at "#
                + $tail
            $(, $arg)*
        )
    };
}

/// What a tenant asks for with `createInstance`, checked: only [`InstanceRequest::parse`] makes
/// one, so a value that exists is valid.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceRequest {
    allocation_id: AllocationId,
    image: String,
    command: Vec<String>,
    env: BTreeMap<String, String>,
}

/// The step keys of an instance's workflow.
pub fn step_key(instance: &InstanceId, step: &str) -> String {
    format!("wf:{instance}:{step}")
}

impl InstanceRequest {
    /// Parses a request: what can be checked without the database.
    pub fn parse(
        allocation_id: AllocationId,
        image: String,
        command: Vec<String>,
        env: BTreeMap<String, String>,
    ) -> Result<InstanceRequest> {
        let request = InstanceRequest {
            allocation_id,
            image,
            command,
            env,
        };
        request.check()?;
        Ok(request)
    }

    fn check(&self) -> Result<()> {
        if let Err(why) = compute_protocol::check_image_reference(&self.image) {
            return Err(Error::bad_input(
                "image",
                format!(
                    "image is a container image reference, such as registry.example/team/train:1 ({why})"
                ),
            ));
        }
        if self.command.len() > 64
            || self
                .command
                .iter()
                .any(|a| a.chars().count() > 4096 || a.contains('\0'))
        {
            return Err(Error::bad_input(
                "command",
                "command is at most 64 arguments of at most 4096 characters, without NUL",
            ));
        }
        let name_ok = compute_protocol::is_env_name;
        if self.env.len() > 64
            || self
                .env
                .iter()
                .any(|(k, v)| !name_ok(k) || v.chars().count() > 4096 || v.contains('\0'))
        {
            return Err(Error::bad_input(
                "env",
                "env is at most 64 variables named [A-Za-z_][A-Za-z0-9_]* (at most 128), values of at most 4096 characters without NUL",
            ));
        }
        if cmds::jsonb_text_len(&json!(self.env)) > cmds::MAX_OBJECT_BYTES {
            return Err(Error::bad_input("env", "env is larger than 16384 bytes"));
        }
        Ok(())
    }
}

async fn emit(conn: &mut PgConnection, instance: &Instance) -> Result<()> {
    let event = match instance.state {
        State::Provisioning => EventType::InstanceProvisioning,
        State::Running => EventType::InstanceRunning,
        State::Stopping => EventType::InstanceStopping,
        State::Stopped => EventType::InstanceStopped,
        State::Failed => EventType::InstanceFailed,
        State::Exited => EventType::InstanceExited,
    };
    outbox::emit(
        conn,
        NewEvent {
            event_type: event,
            tenant_id: Some(&instance.tenant_id),
            subject: instance.id.as_str(),
            data: events::to_data(&InstancePayload::of(instance))?,
        },
    )
    .await?;
    Ok(())
}

/// The resync of instance workflows, level-triggered: enqueues every instance with a step to
/// take (provisioning; stopping; running while asked to stop or after its reservation stopped
/// being active), so a lost or never-written `instance` queue row only costs time (the
/// reconciler runs it every [`crate::work_queue::RESYNC_EVERY`]). Instances that run as they
/// should are left alone: at 10,000 nodes the statement reads the instances table once (a
/// sequential scan of tens of thousands of rows, milliseconds) and enqueues only those.
/// Returns how many instances.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn enqueue_unsettled(db: &Db) -> Result<u64> {
    let moving = [State::Provisioning.as_str(), State::Stopping.as_str()];
    let n = db
        .tx("enqueue_unsettled_instances", TxKind::Maintenance, |conn| {
            Box::pin(async move {
                Ok(sqlx::query_scalar!(
                    r#"SELECT compute_enqueue($1, array_agg(i.id), $2) AS "n!"
                         FROM instances i JOIN reservations r ON r.id = i.reservation_id
                        WHERE i.state = ANY($3)
                           OR (i.state = $4 AND (i.stop_requested
                               OR compute_reservation_state(r.state, r.starts_at, r.ends_at) <> $5))"#,
                    WorkKind::Instance as _,
                    work_queue::SHARDS,
                    &moving[..] as &[&str],
                    State::Running.as_str(),
                    crate::reservations::state::State::Active.as_str(),
                )
                .fetch_one(&mut *conn)
                .await?)
            })
        })
        .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

async fn wake(conn: &mut PgConnection, id: &InstanceId) -> Result<()> {
    work_queue::enqueue(
        conn,
        WorkKind::Instance,
        id.as_str(),
        work_queue::SHARDS,
        std::time::Duration::ZERO,
    )
    .await
}

async fn load(conn: &mut PgConnection, id: &InstanceId) -> Result<Option<Instance>> {
    Ok(
        query_instances!("SELECT", "FROM instances i WHERE i.id = $1", id.as_str())
            .fetch_optional(&mut *conn)
            .await?,
    )
}

/// `createInstance`: starts a workload on one allocation of the caller's reservation, with the
/// exact idempotency semantics of reservations. Another tenant's allocation is `NOT_FOUND`; a
/// reservation that ended, an allocation not placed yet, or one that already has a live
/// instance is `CONFLICT`.
#[tracing::instrument(level = "debug", skip_all, fields(allocation = %req.allocation_id, subject = %actor.subject))]
pub async fn create_instance(
    db: &Db,
    actor: &Actor,
    req: InstanceRequest,
    key: &str,
) -> Result<Outcome<Instance>> {
    let key = idempotency::parse_key("idempotencyKey", key)?;
    let fingerprint = json!(req);
    db.tx("create_instance", TxKind::Write, |conn| {
        let (actor, key, fingerprint, req) =
            (actor.clone(), key.clone(), fingerprint.clone(), req.clone());
        Box::pin(async move {
            match idempotency::claim(conn, &actor, &key, "createInstance", &fingerprint).await? {
                Claim::New => {}
                Claim::Refused(e) => return Ok(Err(e)),
                Claim::Replay(id) => {
                    let id = InstanceId::from_trusted(&id).ok_or_else(|| {
                        Error::internal("a stored createInstance response names no instance")
                    })?;
                    let value = load(conn, &id).await?.ok_or_else(|| {
                        Error::internal("a stored createInstance response names a missing instance")
                    })?;
                    return Ok(Ok(Outcome {
                        value,
                        replayed: true,
                    }));
                }
            }
            let created = create_effect(conn, &actor, &req).await;
            idempotency::settle(conn, &actor, Some(&key), created, |o| {
                o.value.id.to_string()
            })
            .await
        })
    })
    .await?
}

/// The `run_instance` command's arguments: one place, for the worker that makes the command
/// and for the creation that checks it fits.
fn run_args(
    id: &InstanceId,
    image: &str,
    command: &[String],
    env: &BTreeMap<String, String>,
    atoms: &[String],
) -> serde_json::Value {
    json!({ "instanceId": id, "image": image, "command": command, "env": env, "devices": atoms })
}

async fn create_effect(
    conn: &mut PgConnection,
    actor: &Actor,
    req: &InstanceRequest,
) -> Result<Outcome<Instance>> {
    let not_found = || Error::NotFound {
        kind: "allocation",
        id: req.allocation_id.to_string(),
    };
    // The reservation row first (lock order); a release waits for this creation, and then
    // wakes the instance through its trigger. Only a row the caller may see is locked: another
    // tenant's busy reservation neither waits for it nor answers otherwise than NOT_FOUND.
    let Ok(tenant) = actor.visible_tenant() else {
        return Err(not_found());
    };
    let found = sqlx::query!(
        r#"SELECT a.node_id AS "node_id: NodeId", a.reservation_id AS "reservation_id: ReservationId",
                  r.tenant_id AS "tenant_id: TenantId", a.atoms,
                  compute_reservation_state(r.state, r.starts_at, r.ends_at) AS "state!: crate::reservations::state::State"
             FROM allocations a JOIN reservations r ON r.id = a.reservation_id
            WHERE a.id = $1 AND ($2::text IS NULL OR r.tenant_id = $2) FOR SHARE OF r"#,
        req.allocation_id.as_str(),
        tenant.map(TenantId::as_str),
    )
    .fetch_optional(&mut *conn)
    .await?
    .ok_or_else(not_found)?;
    if !actor.may_access(&found.tenant_id) {
        return Err(not_found());
    }
    if found.state.is_terminal() {
        return Err(Error::Conflict {
            message: format!(
                "reservation {} is {}: its allocations take no new instance",
                found.reservation_id, found.state
            ),
            current_version: None,
        });
    }
    let Some(node) = found.node_id else {
        return Err(Error::Conflict {
            message: format!(
                "allocation {} is not placed yet (its reservation is pending)",
                req.allocation_id
            ),
            current_version: None,
        });
    };
    let id = InstanceId::generate();
    // The run command carries the image, command and env together, with the id and the GPUs'
    // atoms, in one `args` object the database holds to MAX_OBJECT_BYTES: checked here, or the
    // instance would be created and its run command refused by the worker without end.
    let run = run_args(&id, &req.image, &req.command, &req.env, &found.atoms);
    if cmds::jsonb_text_len(&run) > cmds::MAX_OBJECT_BYTES {
        return Err(Error::bad_input(
            "command",
            format!(
                "image, command and env take too much room together: the run command's arguments, with this allocation's GPUs, are at most {} bytes as JSON",
                cmds::MAX_OBJECT_BYTES
            ),
        ));
    }
    let inserted = query_instances!(
        "INSERT INTO instances AS i (id, tenant_id, reservation_id, allocation_id, node_id, image, command, env, created_by) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
         ON CONFLICT (allocation_id) WHERE state IN ('provisioning', 'running', 'stopping') DO NOTHING \
         RETURNING",
        "",
        id.as_str(),
        found.tenant_id.as_str(),
        found.reservation_id.as_str(),
        req.allocation_id.as_str(),
        node.as_str(),
        req.image,
        &req.command[..],
        Json(&req.env) as _,
        actor.subject,
    )
    .fetch_optional(&mut *conn)
    .await?;
    let Some(instance) = inserted else {
        return Err(Error::Conflict {
            message: format!(
                "allocation {} already has a live instance; stop it first",
                req.allocation_id
            ),
            current_version: None,
        });
    };
    emit(conn, &instance).await?;
    wake(conn, &instance.id).await?;
    Ok(Outcome {
        value: instance,
        replayed: false,
    })
}

/// `stopInstance`: asks the workflow to stop the instance (it stops its workload, then is
/// `STOPPED`). Safe to repeat; an ended instance is returned as it is. Another tenant's is
/// `NOT_FOUND`.
#[tracing::instrument(level = "debug", skip_all, fields(instance = %id, subject = %actor.subject))]
pub async fn stop_instance(db: &Db, actor: &Actor, id: &InstanceId) -> Result<Instance> {
    db.tx("stop_instance", TxKind::Write, |conn| {
        let (actor, id) = (actor.clone(), id.clone());
        Box::pin(async move {
            let found = load(conn, &id).await?;
            let Some(instance) = found.filter(|i| actor.may_access(&i.tenant_id)) else {
                return Err(Error::NotFound {
                    kind: "instance",
                    id: id.to_string(),
                });
            };
            if instance.state.is_terminal() || instance.stop_requested {
                return Ok(instance);
            }
            // Guarded on the row as it is when locked: an exit recorded since the read above
            // (which ended it) or another request leaves it as it is. The workflow it wakes
            // moves it to `stopping`, whose event the subscription sees.
            let asked = query_instances!(
                "UPDATE instances AS i SET stop_requested = true, version = i.version + 1, updated_at = compute_now() \
                  WHERE i.id = $1 AND NOT i.stop_requested AND i.state IN ('provisioning', 'running', 'stopping') RETURNING",
                "",
                id.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?;
            let Some(asked) = asked else {
                return load(conn, &id)
                    .await?
                    .ok_or_else(|| Error::internal("an instance vanished"));
            };
            wake(conn, &id).await?;
            Ok(asked)
        })
    })
    .await
}

/// Instances by id.
pub async fn get_instances(db: &Db, ids: &[InstanceId]) -> Result<Vec<Instance>> {
    let ids: Vec<&str> = ids.iter().map(InstanceId::as_str).collect();
    Ok(query_instances!(
        "SELECT",
        "FROM instances i WHERE i.id = ANY($1)",
        &ids[..] as &[&str],
    )
    .fetch_all(db.pool())
    .await?)
}

/// Filters of the instances connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct InstanceFilter {
    /// Only this tenant's (always set for members).
    pub tenant_id: Option<TenantId>,
    pub reservation_id: Option<ReservationId>,
    pub state: Option<State>,
}

fn select<'a>(cols: &str, f: &InstanceFilter) -> QueryBuilder<'a, Postgres> {
    let mut qb = QueryBuilder::new(format!("SELECT {cols} FROM instances i WHERE TRUE"));
    if let Some(t) = &f.tenant_id {
        qb.push(" AND i.tenant_id = ").push_bind(t.clone());
    }
    if let Some(r) = &f.reservation_id {
        qb.push(" AND i.reservation_id = ").push_bind(r.clone());
    }
    if let Some(s) = f.state {
        qb.push(" AND i.state = ").push_bind(s);
    }
    qb
}

/// A page of instances, oldest first.
pub async fn list_instances(
    db: &Db,
    filter: &InstanceFilter,
    page: &PageArgs,
) -> Result<Page<Instance>> {
    crate::page::fetch_page(select(COLS, filter), "i.id", page, db).await
}

/// How many instances match.
pub async fn count_instances(db: &Db, filter: &InstanceFilter) -> Result<i64> {
    let (n,): (i64,) = select("count(*)", filter)
        .build_query_as()
        .fetch_one(db.pool())
        .await?;
    Ok(n)
}

/// What one run of an instance's workflow did.
#[derive(Debug, Clone, Default)]
pub struct Step {
    /// The states it moved through.
    pub moved: Vec<State>,
    /// When it is due again (its reservation's start or end), if ever.
    pub next: Option<DateTime<Utc>>,
}

async fn transition(
    conn: &mut PgConnection,
    instance: &Instance,
    action: Action,
    to: State,
    reason: Option<String>,
) -> Result<Instance> {
    if !allowed(action, instance.state, to) {
        return Err(Error::internal(format!(
            "instance workflow: {:?} from {} to {to} is not a transition",
            action, instance.state
        )));
    }
    let moved = query_instances!(
        "UPDATE instances AS i SET state = $2, reason = coalesce($3, i.reason), \
                started_at = CASE WHEN $2 = 'running' THEN compute_now() ELSE i.started_at END, \
                stopped_at = CASE WHEN $2 IN ('stopped', 'failed', 'exited') THEN compute_now() ELSE i.stopped_at END, \
                version = i.version + 1, updated_at = compute_now() \
          WHERE i.id = $1 AND i.state = $4 RETURNING",
        "",
        instance.id.as_str(),
        to.as_str(),
        reason.as_deref(),
        instance.state.as_str(),
    )
    .fetch_one(&mut *conn)
    .await?;
    emit(conn, &moved).await?;
    if moved.state.is_terminal() {
        // Instances waiting for these GPUs (the run step waits while another live instance
        // holds any of them), woken in id order, the work-queue rows last.
        let waiting = sqlx::query_scalar!(
            r#"SELECT wi.id AS "id!: InstanceId" FROM instances wi
                 JOIN allocations wa ON wa.id = wi.allocation_id
                 JOIN allocations ma ON ma.id = $2
                WHERE wi.node_id = $1 AND wi.id <> $3 AND wi.state = 'provisioning'
                  AND wa.atoms && ma.atoms
                ORDER BY wi.id"#,
            moved.node_id.as_str(),
            moved.allocation_id.as_str(),
            moved.id.as_str(),
        )
        .fetch_all(&mut *conn)
        .await?;
        for id in &waiting {
            wake(conn, id).await?;
        }
    }
    Ok(moved)
}

/// Moves a running instance whose exit was reported to `exited`, with why in words.
async fn exit(conn: &mut PgConnection, instance: &Instance) -> Result<Instance> {
    let why = match (instance.exit_code, instance.exit_signal) {
        (Some(code), _) => format!("its workload exited with code {code}"),
        (None, Some(signal)) => format!("its workload was killed by signal {signal}"),
        (None, None) => {
            "its workload ended while the node's daemon was away (no exit code)".to_owned()
        }
    };
    transition(conn, instance, Action::Exit, State::Exited, Some(why)).await
}

/// How a workload ended, as its daemon reports it (`exited` in `docs/agent-protocol.md`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReportedExit {
    /// 0 to 255.
    code: Option<i32>,
    /// 1 to 64.
    signal: Option<i32>,
    /// How long ago it ended, 0 to 30 days: the database computes the time.
    seconds_ago: f64,
}

impl ReportedExit {
    /// Parses a daemon's report of an exit: only this makes one.
    pub fn parse(code: Option<i32>, signal: Option<i32>, seconds_ago: f64) -> Result<ReportedExit> {
        let exit = ReportedExit {
            code,
            signal,
            seconds_ago,
        };
        exit.check()?;
        Ok(exit)
    }

    fn check(&self) -> Result<()> {
        if self.code.is_some_and(|c| !(0..=255).contains(&c)) {
            return Err(Error::bad_input("exitCode", "exitCode is 0 to 255"));
        }
        if self.signal.is_some_and(|s| !(1..=64).contains(&s)) {
            return Err(Error::bad_input("signal", "signal is 1 to 64"));
        }
        if !(self.seconds_ago.is_finite() && (0.0..=30.0 * 86_400.0).contains(&self.seconds_ago)) {
            return Err(Error::bad_input(
                "exitedSecondsAgo",
                "exitedSecondsAgo is 0 to 2592000",
            ));
        }
        Ok(())
    }
}

/// What [`record_exit`] did with a daemon's report of an exit.
#[derive(Debug)]
pub enum ExitRecord {
    /// Recorded, on this instance (as it is now).
    Recorded(Box<Instance>),
    /// Nothing to record: another node's or an ended instance, or an exit already held. The
    /// daemon may forget it.
    Nothing,
    /// The session the report came on is no longer current (closed by the liveness pass, or
    /// superseded): nothing was recorded, and the daemon must report it again on its next
    /// session, so the gateway ends this one instead of answering.
    SessionNotCurrent,
}

/// The daemon of `node` (session `epoch`; `db` fenced by the gateway's lease) reports that the
/// workload of `instance` ended on its own. Recorded once, on a live instance of this node
/// whose exit is not known yet: a running one becomes `exited` now (with its event), any other
/// keeps the exit for its workflow, which it wakes.
#[tracing::instrument(level = "debug", skip_all, fields(node = %node, epoch = epoch, instance = %instance))]
pub async fn record_exit(
    db: &Db,
    node: &NodeId,
    epoch: i64,
    instance: &InstanceId,
    exit: ReportedExit,
) -> Result<ExitRecord> {
    db.tx("record_instance_exit", TxKind::Write, |conn| {
        let (node, instance) = (node.clone(), instance.clone());
        Box::pin(async move {
            let held = query_instances!(
                "WITH s AS (SELECT 1 FROM node_sessions \
                     WHERE node_id = $1 AND session_epoch = $2 AND closed_at IS NULL FOR SHARE) \
                 UPDATE instances AS i SET exit_code = $4, exit_signal = $5, \
                        exited_at = compute_now() - make_interval(secs => $6), \
                        version = i.version + 1, updated_at = compute_now() \
                  WHERE i.id = $3 AND i.node_id = $1 AND i.exited_at IS NULL \
                    AND i.state IN ('provisioning', 'running', 'stopping') AND EXISTS (SELECT 1 FROM s) \
              RETURNING",
                "",
                node.as_str(),
                epoch,
                instance.as_str(),
                exit.code,
                exit.signal,
                exit.seconds_ago,
            )
            .fetch_optional(&mut *conn)
            .await?;
            let Some(held) = held else {
                // Which of the two: the session (read again, as the guard read it).
                let current = sqlx::query_scalar!(
                    r#"SELECT EXISTS (SELECT 1 FROM node_sessions
                        WHERE node_id = $1 AND session_epoch = $2 AND closed_at IS NULL) AS "current!""#,
                    node.as_str(),
                    epoch,
                )
                .fetch_one(&mut *conn)
                .await?;
                return Ok(if current {
                    ExitRecord::Nothing
                } else {
                    ExitRecord::SessionNotCurrent
                });
            };
            if held.state == State::Running {
                return Ok(ExitRecord::Recorded(Box::new(self::exit(conn, &held).await?)));
            }
            wake(conn, &held.id).await?;
            Ok(ExitRecord::Recorded(Box::new(held)))
        })
    })
    .await
}

/// The reason an instance shows when its command failed: the step, the command's state, code and
/// message, cut to the column's 2,000 characters (a command's message alone may hold 2,000, a
/// runtime's whole stderr: uncut, the instance's update failed at every retry).
fn failure(step: &str, c: &cmds::Command) -> String {
    let reason = format!(
        "{step} {}: {} {}",
        c.state,
        c.error_code.as_deref().unwrap_or(""),
        c.error_message.as_deref().unwrap_or("")
    );
    let reason = reason.trim_end();
    if reason.chars().count() <= MAX_REASON_CHARS {
        return reason.to_owned();
    }
    let mut cut: String = reason.chars().take(MAX_REASON_CHARS - 1).collect();
    cut.push('…');
    cut
}

/// `instances.reason` holds at most this many characters (`CHECK` in migration 0014).
const MAX_REASON_CHARS: usize = 2000;

/// One run of `id`'s workflow, in one transaction of `db` (fenced by the shard's lease): takes
/// every step that is due now and says when it is due again.
#[tracing::instrument(level = "debug", skip_all, fields(instance = %id))]
pub async fn reconcile(db: &Db, id: &InstanceId) -> Result<Step> {
    db.tx("reconcile_instance", TxKind::Maintenance, |conn| {
        let id = id.clone();
        Box::pin(async move { reconcile_in(conn, &id).await })
    })
    .await
}

async fn reconcile_in(conn: &mut PgConnection, id: &InstanceId) -> Result<Step> {
    let Some(mut instance) = query_instances!(
        "SELECT",
        "FROM instances i WHERE i.id = $1 FOR UPDATE",
        id.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(Step::default());
    };
    let r = sqlx::query!(
        r#"SELECT compute_reservation_state(r.state, r.starts_at, r.ends_at) AS "state!: crate::reservations::state::State",
                  r.starts_at, r.ends_at, compute_now() AS "now!"
             FROM reservations r WHERE r.id = $1"#,
        instance.reservation_id.as_str(),
    )
    .fetch_one(&mut *conn)
    .await?;
    let steps = cmds::of_workflow(conn, id.as_str()).await?;
    let run_key = step_key(id, "run");
    let stop_key = step_key(id, "stop");
    let ended = r.state.is_terminal() || r.now >= r.ends_at;
    let mut step = Step::default();
    loop {
        match instance.state {
            State::Running if instance.exited_at.is_some() => {
                instance = exit(conn, &instance).await?;
            }
            State::Provisioning | State::Running if ended || instance.stop_requested => {
                let why = if ended {
                    format!("its reservation ended ({})", r.state)
                } else {
                    "stopped on request".to_owned()
                };
                instance =
                    transition(conn, &instance, Action::Stop, State::Stopping, Some(why)).await?;
            }
            State::Provisioning => {
                use crate::reservations::state::State as R;
                if matches!(r.state, R::Pending | R::Scheduled) {
                    step.next = Some(r.starts_at);
                    break;
                }
                match steps.get(&run_key) {
                    None => {
                        let atoms: Vec<String> = sqlx::query_scalar!(
                            "SELECT atoms FROM allocations WHERE id = $1",
                            instance.allocation_id.as_str(),
                        )
                        .fetch_one(&mut *conn)
                        .await?;
                        // The previous holder of these GPUs may still be leaving them (a
                        // reservation that ended just before this one started: its stop sent,
                        // its workload in its grace, or its node away with both commands
                        // waiting). Sent now, the run could reach the daemon first, which would
                        // refuse it (`DEVICE_OVERLAP`) and fail this tenant's reservation. It is
                        // sent once no other live instance holds them; the last one to end wakes
                        // this (`transition`).
                        // Only an earlier holder: two live reservations holding one atom have
                        // disjoint windows, so the one that starts first is the previous holder,
                        // and the waits form a chain in time, never a cycle. (A later
                        // reservation's instance, made early, waits in `provisioning` for its
                        // own start and must not hold this one back.) A start equal to this
                        // one's is a reservation that ended at its start (released at once):
                        // its instance is leaving, never waiting on this one.
                        let before = sqlx::query_scalar!(
                            r#"SELECT oi.id AS "id!" FROM instances oi
                                 JOIN allocations oa ON oa.id = oi.allocation_id
                                 JOIN reservations orv ON orv.id = oi.reservation_id
                                WHERE oi.node_id = $1 AND oi.id <> $2
                                  AND oi.state IN ('provisioning', 'running', 'stopping')
                                  AND oa.atoms && $3::text[]
                                  AND orv.starts_at <= $4
                                ORDER BY oi.id LIMIT 1"#,
                            instance.node_id.as_str(),
                            instance.id.as_str(),
                            &atoms,
                            r.starts_at,
                        )
                        .fetch_optional(&mut *conn)
                        .await?;
                        if let Some(other) = before {
                            tracing::info!(instance = %instance.id, before = %other, "waiting for another instance to leave the GPUs");
                            step.next = Some(r.ends_at);
                            break;
                        }
                        let args = run_args(
                            &instance.id,
                            &instance.image,
                            &instance.command,
                            &instance.env.0,
                            &atoms,
                        );
                        cmds::ensure(
                            conn,
                            NewCommand {
                                node: &instance.node_id,
                                kind: Kind::RunInstance,
                                args: &args,
                                min_generation: 0,
                                retry_safe: false,
                                key: &run_key,
                                created_by: cmds::CONTROL_PLANE,
                                workflow: Some(id.as_str()),
                            },
                        )
                        .await?;
                        step.next = Some(r.ends_at);
                        break;
                    }
                    Some(c) if c.state == cmds::State::Succeeded => {
                        instance = transition(conn, &instance, Action::Start, State::Running, None)
                            .await?;
                    }
                    Some(c) if c.state.is_terminal() => {
                        let why = failure("run_instance", c);
                        instance =
                            transition(conn, &instance, Action::Fail, State::Failed, Some(why))
                                .await?;
                    }
                    Some(_) => {
                        step.next = Some(r.ends_at);
                        break;
                    }
                }
            }
            State::Running => {
                step.next = Some(r.ends_at);
                break;
            }
            State::Stopping => {
                let run = steps.get(&run_key);
                let started = match run.map(|c| (c.state, c.started_at.is_some())) {
                    // Acknowledged once, then put back to pending by the daemon's new session:
                    // its workload may be running (the daemon journals before it acknowledges
                    // and answers from the journal when the command comes again). Its outcome
                    // decides, as for a running one; withdrawing it left the workload on the
                    // GPUs with the instance stopped.
                    Some((cmds::State::Pending | cmds::State::Dispatched, true)) => break,
                    Some((cmds::State::Pending | cmds::State::Dispatched, false)) => {
                        // Not started: withdraw it. If the daemon acknowledged it meanwhile, it
                        // runs; the trigger wakes this again when it ends.
                        let c = run
                            .map(|c| c.id.clone())
                            .ok_or_else(|| Error::internal("no run step"))?;
                        if cmds::cancel_in(conn, &c).await?.is_none() {
                            break;
                        }
                        false
                    }
                    Some((cmds::State::Running, _)) => break,
                    Some((cmds::State::Succeeded, _)) => true,
                    _ => false,
                };
                if !started {
                    instance =
                        transition(conn, &instance, Action::Finish, State::Stopped, None).await?;
                    step.moved.push(instance.state);
                    continue;
                }
                match steps.get(&stop_key) {
                    None => {
                        let args = json!({ "instanceId": instance.id });
                        cmds::ensure(
                            conn,
                            NewCommand {
                                node: &instance.node_id,
                                kind: Kind::StopInstance,
                                args: &args,
                                min_generation: 0,
                                retry_safe: true,
                                key: &stop_key,
                                created_by: cmds::CONTROL_PLANE,
                                workflow: Some(id.as_str()),
                            },
                        )
                        .await?;
                        break;
                    }
                    Some(c) if c.state == cmds::State::Succeeded => {
                        instance =
                            transition(conn, &instance, Action::Finish, State::Stopped, None)
                                .await?;
                    }
                    Some(c) if c.state.is_terminal() => {
                        let why = failure("stop_instance", c);
                        instance =
                            transition(conn, &instance, Action::Fail, State::Failed, Some(why))
                                .await?;
                    }
                    Some(_) => break,
                }
            }
            State::Stopped | State::Failed | State::Exited => break,
        }
        step.moved.push(instance.state);
    }
    Ok(step)
}
