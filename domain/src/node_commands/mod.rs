//! Commands to node daemons (`docs/commands.md`): what operators and the control plane ask a
//! node to do, and the guarantees that make "at least once" safe.
//!
//! - **One command per key and node.** `UNIQUE (node_id, idempotency_key)`: a retried
//!   `runCommand` (`api:<caller>:<key>`, behind the API's idempotency keys), a workflow step
//!   retried after a crash (`wf:<workflow>:<step>`) or the same spec generation seen twice
//!   (`spec:<generation>`) finds the command already there and makes no second one.
//! - **Dispatch under a lease.** [`dispatch_node`] runs as a work-queue item of kind
//!   `node_commands` (key: the node), in a transaction whose first statement is the fence of
//!   the node's shard lease: a dispatcher whose lease was taken over changes nothing. It locks
//!   the node's session row `FOR SHARE` (a session that opens meanwhile waits for it, or makes it
//!   wait), sends nothing whose `min_generation` the daemon has not reported, and records the
//!   session epoch, journal id and gateway; then pokes the gateway (`NOTIFY`), which also polls.
//! - **Session-fenced answers.** [`ack`], [`progress`] and [`finish`] carry
//!   `AND session_epoch = $epoch` on both the session and the command, in a transaction fenced
//!   by the gateway's lease: a superseded session or a zombie gateway records nothing.
//! - **Journals.** When a session opens ([`on_session_open`]) what was in flight under an older
//!   session goes back to `pending` to be dispatched again, if the daemon kept its journal (it
//!   answers from it what it already ran) or the command is retry-safe; a daemon that lost its
//!   journal fails the others with `JOURNAL_RESET`.
//!
//! Lock order (`docs/database-locks.md`): the lease fence, `node_sessions`, `commands` (of one
//! node, ascending id), the outbox, `work_queue` last.

mod payload;
pub mod state;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::types::Json;
use sqlx::{FromRow, PgConnection, Postgres, QueryBuilder};

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{self, CommandPayload, EventType};
use crate::idempotency::{self, Actor, Claim, Outcome};
use crate::ids::{CommandId, GatewayId, NodeId};
use crate::outbox::{self, NewEvent};
use crate::page::{Page, PageArgs};
use crate::work_queue::{self, WorkKind};
use state::{Action, stored_from};
pub use state::{Kind, State};

/// The channel a dispatcher pokes with the gateway's id after dispatching to one of its
/// sessions.
pub const NOTIFY_CHANNEL: &str = "compute_agent_commands";
/// How many commands of one node one dispatch transaction sends at most.
pub const DISPATCH_BATCH: i64 = 100;
/// The largest `args`, `output` or `progress` object, serialized as PostgreSQL prints `jsonb`
/// (the `commands_args` check measures `args::text`; [`jsonb_text_len`]).
pub const MAX_OBJECT_BYTES: usize = 16 * 1024;

/// The length of `value` as PostgreSQL prints it as `jsonb` text: serde's compact form with a
/// space after each `:` and `,` (`{"a": 1, "b": [1, 2]}`), which is what the database's size
/// checks (`octet_length(x::text)`) measure. Compact JSON is shorter, so checking it let an
/// object the database refuses through as an `INTERNAL` error.
pub fn jsonb_text_len(value: &Value) -> usize {
    match value {
        Value::Array(items) => {
            2 + items.iter().map(jsonb_text_len).sum::<usize>() + 2 * items.len().saturating_sub(1)
        }
        Value::Object(members) => {
            2 + members
                .iter()
                .map(|(k, v)| Value::String(k.clone()).to_string().len() + 2 + jsonb_text_len(v))
                .sum::<usize>()
                + 2 * members.len().saturating_sub(1)
        }
        // A float may print with an exponent (`1e300`, and any integer past u64), which
        // PostgreSQL's numeric prints in full: the longer of the two.
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or_default();
            n.to_string().len().max(format!("{f}").len())
        }
        scalar => scalar.to_string().len(),
    }
}

/// Whether a string anywhere in `value` (a key or a value) holds a NUL character, which
/// PostgreSQL's `jsonb` and `text` cannot hold.
pub fn holds_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(members) => members
            .iter()
            .any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}
/// Who the control plane's own commands are created by.
pub const CONTROL_PLANE: &str = "control-plane";

/// A command.
#[derive(Debug, Clone, FromRow)]
pub struct Command {
    pub id: CommandId,
    pub node_id: NodeId,
    pub kind: Kind,
    pub args: Json<Value>,
    pub min_generation: i64,
    pub retry_safe: bool,
    pub idempotency_key: String,
    pub state: State,
    pub attempts: i32,
    pub progress: Option<Json<Value>>,
    pub result: Option<Json<Value>>,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub session_epoch: Option<i64>,
    pub journal_id: Option<String>,
    pub gateway: Option<GatewayId>,
    pub created_by: String,
    /// The workflow (instance) this command is a step of.
    pub workflow_id: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub dispatched_at: Option<DateTime<Utc>>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub version: i64,
    /// W3C trace context: of the transaction that made it, then of its dispatch (migration
    /// 0033); the daemon continues it.
    pub traceparent: Option<String>,
}

impl Command {
    /// The arguments as people and event consumers see them (`Command.args`, `command.*`
    /// events): a `run_instance`'s environment values are its tenant's, sent to the daemon
    /// only, so they are shown as `null` beside their names (`docs/instances.md`).
    pub fn shown_args(&self) -> Value {
        let mut args = self.args.0.clone();
        if self.kind == Kind::RunInstance
            && let Some(env) = args.get_mut("env").and_then(Value::as_object_mut)
        {
            for value in env.values_mut() {
                *value = Value::Null;
            }
        }
        args
    }
}

/// The columns of [`Command`], of `commands c`, for the listing's dynamic builder; the same
/// columns as [`query_commands!`] (a static test compares them).
const COLS: &str = "c.id, c.node_id, c.kind, c.args, c.min_generation, c.retry_safe, c.idempotency_key, \
     c.state, c.attempts, c.progress, c.result, c.error_code, c.error_message, c.session_epoch, c.journal_id, \
     c.gateway, c.created_by, c.workflow_id, c.created_at, c.updated_at, c.dispatched_at, c.started_at, c.finished_at, c.version, \
     c.traceparent";

/// A checked `query_as!` of [`Command`]s: `$head` + the columns of `commands c` + `$tail`. The
/// `guarded:` form puts the session guard first: `s` is the node's open session at `$2`
/// (`node_id = $1`), locked `FOR SHARE` so it cannot be superseded before the transaction ends;
/// the statement adds `AND EXISTS (SELECT 1 FROM s)`.
macro_rules! query_commands {
    (guarded: $head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        query_commands!(@ "WITH s AS (SELECT 1 FROM node_sessions \
               WHERE node_id = $1 AND session_epoch = $2 AND closed_at IS NULL FOR SHARE) "
            $head, $tail $(, $arg)*)
    };
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        query_commands!(@ "" $head, $tail $(, $arg)*)
    };
    (@ $guard:literal $head:literal, $tail:literal $(, $arg:expr)*) => {
        sqlx::query_as!(
            Command,
            $guard
                + $head
                + r#" c.id AS "id: _", c.node_id AS "node_id: _", c.kind AS "kind: _", c.args AS "args: _",
                     c.min_generation, c.retry_safe, c.idempotency_key, c.state AS "state: _", c.attempts,
                     c.progress AS "progress: _", c.result AS "result: _", c.error_code, c.error_message,
                     c.session_epoch, c.journal_id, c.gateway AS "gateway: _", c.created_by, c.workflow_id,
                     c.created_at, c.updated_at, c.dispatched_at, c.started_at, c.finished_at, c.version,
                     c.traceparent "#
                + $tail
            $(, $arg)*
        )
    };
}

/// What an operator asks for with `runCommand`, checked: only [`CommandRequest::parse`] makes
/// one, so a value that exists is valid.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CommandRequest {
    node_id: NodeId,
    kind: Kind,
    args: Value,
    min_generation: i64,
    retry_safe: Option<bool>,
}

/// Checks a JSON object a caller or a daemon sends (`field` names it): an object of at most
/// [`MAX_OBJECT_BYTES`].
pub fn check_object(field: &str, value: &Value) -> Result<()> {
    if !value.is_object() {
        return Err(Error::bad_input(
            field,
            format!("`{field}` must be a JSON object"),
        ));
    }
    if holds_nul(value) {
        return Err(Error::bad_input(
            field,
            format!("`{field}` holds a NUL character (\\u0000), which no string here may hold"),
        ));
    }
    if jsonb_text_len(value) > MAX_OBJECT_BYTES {
        return Err(Error::bad_input(
            field,
            format!("`{field}` is larger than {MAX_OBJECT_BYTES} bytes"),
        ));
    }
    Ok(())
}

impl CommandRequest {
    /// Parses a request: what can be checked without the database.
    pub fn parse(
        node_id: NodeId,
        kind: Kind,
        args: Value,
        min_generation: i64,
        retry_safe: Option<bool>,
    ) -> Result<CommandRequest> {
        let request = CommandRequest {
            node_id,
            kind,
            args,
            min_generation,
            retry_safe,
        };
        request.check()?;
        Ok(request)
    }

    fn check(&self) -> Result<()> {
        if self.kind == Kind::ApplySpec {
            return Err(Error::bad_input(
                "kind",
                "apply_spec is issued by the control plane when a node's generation moves; change the node's spec instead",
            ));
        }
        check_object("args", &self.args)?;
        if self.min_generation < 0 {
            return Err(Error::bad_input(
                "minGeneration",
                "minGeneration must be 0 or more",
            ));
        }
        Ok(())
    }
}

async fn emit(conn: &mut PgConnection, commands: &[Command], event: EventType) -> Result<()> {
    let data = commands
        .iter()
        .map(|c| events::to_data(&CommandPayload::of(c)))
        .collect::<Result<Vec<_>>>()?;
    let batch: Vec<NewEvent<'_>> = commands
        .iter()
        .zip(data)
        .map(|(c, data)| NewEvent {
            event_type: event,
            tenant_id: None,
            subject: c.id.as_str(),
            data,
        })
        .collect();
    outbox::emit_all(conn, &batch).await
}

/// Wakes the dispatcher of `node` (in the caller's transaction; `work_queue` is its last lock).
async fn enqueue(conn: &mut PgConnection, node: &NodeId) -> Result<()> {
    work_queue::enqueue(
        conn,
        WorkKind::NodeCommands,
        node.as_str(),
        work_queue::SHARDS,
        std::time::Duration::ZERO,
    )
    .await
}

async fn load(conn: &mut PgConnection, id: &CommandId) -> Result<Option<Command>> {
    Ok(
        query_commands!("SELECT", "FROM commands c WHERE c.id = $1", id.as_str())
            .fetch_optional(&mut *conn)
            .await?,
    )
}

/// A command to make (by [`ensure`]).
#[derive(Debug, Clone)]
pub struct NewCommand<'a> {
    pub node: &'a NodeId,
    pub kind: Kind,
    pub args: &'a Value,
    pub min_generation: i64,
    pub retry_safe: bool,
    /// Unique per node: `api:…`, `spec:…`, `wf:<workflow>:<step>`.
    pub key: &'a str,
    pub created_by: &'a str,
    /// The workflow it is a step of.
    pub workflow: Option<&'a str>,
}

/// Inserts a command unless one with its key exists for the node; the command, and whether this
/// call made it (then `command.created` is written and the node's dispatcher woken, its
/// `work_queue` row last in the caller's transaction).
pub async fn ensure(conn: &mut PgConnection, new: NewCommand<'_>) -> Result<(Command, bool)> {
    let node = new.node;
    let (command, made) = insert_or_find(conn, new).await?;
    if made {
        enqueue(conn, node).await?;
    }
    Ok((command, made))
}

/// [`ensure`] without waking the dispatcher: for the dispatch itself, which sends what it made
/// in the same transaction (or runs again at once when its batch is full), so it takes no
/// `work_queue` row before the commands it locks.
async fn insert_or_find(conn: &mut PgConnection, new: NewCommand<'_>) -> Result<(Command, bool)> {
    let NewCommand {
        node,
        kind,
        args,
        min_generation,
        retry_safe,
        key,
        created_by,
        workflow,
    } = new;
    let id = CommandId::generate();
    let inserted = query_commands!(
        "INSERT INTO commands AS c (id, node_id, kind, args, min_generation, retry_safe, idempotency_key, created_by, workflow_id) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (node_id, idempotency_key) DO NOTHING RETURNING",
        "",
        id.as_str(),
        node.as_str(),
        kind.as_str(),
        Json(args) as _,
        min_generation,
        retry_safe,
        key,
        created_by,
        workflow,
    )
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(c) = inserted {
        emit(conn, std::slice::from_ref(&c), EventType::CommandCreated).await?;
        return Ok((c, true));
    }
    let existing = query_commands!(
        "SELECT",
        "FROM commands c WHERE c.node_id = $1 AND c.idempotency_key = $2",
        node.as_str(),
        key,
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok((existing, false))
}

/// `runCommand`: creates a command for an operator, with the exact idempotency semantics of
/// reservations (the same key and arguments get the same command; other arguments
/// `IDEMPOTENCY_KEY_REUSED`). An unknown node is `NOT_FOUND`, a retired one `CONFLICT`, a
/// `minGeneration` past the node's generation `BAD_USER_INPUT` (it would wait forever).
#[tracing::instrument(level = "debug", skip_all, fields(node = %req.node_id, kind = req.kind.as_str(), subject = %actor.subject))]
pub async fn run_command(
    db: &Db,
    actor: &Actor,
    req: CommandRequest,
    key: &str,
) -> Result<Outcome<Command>> {
    if !actor.is_operator() {
        return Err(Error::Forbidden(
            "only operators run commands on nodes".into(),
        ));
    }
    let key = idempotency::parse_key("idempotencyKey", key)?;
    let fingerprint = json!(req);
    db.tx("run_command", TxKind::Write, |conn| {
        let (actor, key, fingerprint, req) =
            (actor.clone(), key.clone(), fingerprint.clone(), req.clone());
        Box::pin(async move {
            match idempotency::claim(conn, &actor, &key, "runCommand", &fingerprint).await? {
                Claim::New => {}
                Claim::Refused(e) => return Ok(Err(e)),
                Claim::Replay(id) => {
                    let id = CommandId::from_trusted(&id).ok_or_else(|| {
                            Error::internal("a stored runCommand response names no command")
                        })?;
                    let value = load(conn, &id).await?.ok_or_else(|| {
                        Error::internal("a stored runCommand response names a missing command")
                    })?;
                    return Ok(Ok(Outcome {
                        value,
                        replayed: true,
                    }));
                }
            }
            let created = async {
                let node = sqlx::query!(
                    r#"SELECT generation, retired_at IS NOT NULL AS "retired!" FROM nodes WHERE id = $1"#,
                    req.node_id.as_str(),
                )
                .fetch_optional(&mut *conn)
                .await?
                .ok_or_else(|| Error::NotFound {
                    kind: "compute node",
                    id: req.node_id.to_string(),
                })?;
                if node.retired {
                    return Err(Error::Conflict {
                        message: format!("node {} is retired", req.node_id),
                        current_version: None,
                    });
                }
                if req.min_generation > node.generation {
                    return Err(Error::bad_input(
                        "minGeneration",
                        format!(
                            "minGeneration {} is past the node's generation ({}): the command would wait forever",
                            req.min_generation, node.generation
                        ),
                    ));
                }
                let stored_key = format!("api:{}:{}", actor.subject, key);
                let (command, made) = ensure(
                    conn,
                    NewCommand {
                        node: &req.node_id,
                        kind: req.kind,
                        args: &req.args,
                        min_generation: req.min_generation,
                        retry_safe: req
                            .retry_safe
                            .unwrap_or_else(|| req.kind.retry_safe_by_default()),
                        key: &stored_key,
                        created_by: &actor.subject,
                        workflow: None,
                    },
                )
                .await?;
                if !made {
                    // Only when the API's key was pruned (after 24 hours) and reused.
                    return Err(Error::Conflict {
                        message: format!(
                            "idempotency key `{key}` already made command {} on this node; use a new key",
                            command.id
                        ),
                        current_version: None,
                    });
                }
                Ok(Outcome {
                    value: command,
                    replayed: false,
                })
            }
            .await;
            idempotency::settle(conn, &actor, Some(&key), created, |o| {
                o.value.id.to_string()
            })
            .await
        })
    })
    .await?
}

/// `cancelCommand`: withdraws a command that is `pending` or `dispatched` and never started (a
/// daemon that acknowledges it afterwards is told it was cancelled, and does not run it).
/// Cancelling a cancelled command returns it as it is; one that runs, ran, or started once (a
/// command the daemon acknowledged and a reconnection put back to `pending`: its daemon may be
/// running it) is `CONFLICT`, and so is a step of an instance's workflow (stop the instance:
/// cancelling its stop left its workload running, cancelling a started run left it untracked).
#[tracing::instrument(level = "debug", skip_all, fields(command = %id, subject = %actor.subject))]
pub async fn cancel(db: &Db, actor: &Actor, id: &CommandId) -> Result<Command> {
    if !actor.is_operator() {
        return Err(Error::Forbidden("only operators cancel commands".into()));
    }
    db.tx("cancel_command", TxKind::Write, |conn| {
        let id = id.clone();
        Box::pin(async move {
            // A workflow's step is the workflow's to withdraw (a command never changes
            // workflow), so this read needs no lock.
            if let Some(c) = load(conn, &id).await?
                && let Some(instance) = &c.workflow_id
                && c.state != State::Cancelled
            {
                return Err(Error::Conflict {
                    message: format!(
                        "command {id} is a step of instance {instance}: stop the instance instead (stopInstance)"
                    ),
                    current_version: Some(c.version),
                });
            }
            if let Some(c) = cancel_in(conn, &id).await? {
                return Ok(c);
            }
            match load(conn, &id).await? {
                None => Err(Error::NotFound {
                    kind: "command",
                    id: id.to_string(),
                }),
                Some(c) if c.state == State::Cancelled => Ok(c),
                Some(c) if c.started_at.is_some() && !c.state.is_terminal() => Err(Error::Conflict {
                    message: format!(
                        "command {id} started on its node (it is {} again after its daemon reconnected, which may still be running it); it can no longer be cancelled",
                        c.state
                    ),
                    current_version: Some(c.version),
                }),
                Some(c) => Err(Error::Conflict {
                    message: format!(
                        "command {id} is {}; only pending or dispatched commands can be cancelled",
                        c.state
                    ),
                    current_version: Some(c.version),
                }),
            }
        })
    })
    .await
}

/// Cancels `id` in the caller's transaction if it is still `pending` or `dispatched` and never
/// started (an operator, or a workflow withdrawing a step it no longer needs), with its event;
/// the cancelled command, or `None` when it was not cancellable. The guard is in the locking
/// statement, where PostgreSQL re-checks it on the row as it is after any wait: an `ack` that
/// committed meanwhile (`started_at`) makes it not cancellable, whatever the caller read.
pub async fn cancel_in(conn: &mut PgConnection, id: &CommandId) -> Result<Option<Command>> {
    let cancelled = query_commands!(
        "UPDATE commands AS c SET state = 'cancelled', finished_at = compute_now(), \
                version = c.version + 1, updated_at = compute_now() \
          WHERE c.id = $1 AND c.state = ANY($2) AND c.started_at IS NULL RETURNING",
        "",
        id.as_str(),
        &stored_from(Action::Cancel)[..] as &[&str],
    )
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(c) = &cancelled {
        emit(conn, std::slice::from_ref(c), EventType::CommandCancelled).await?;
    }
    Ok(cancelled)
}

/// The commands of `workflow`, by their key.
pub async fn of_workflow(
    conn: &mut PgConnection,
    workflow: &str,
) -> Result<std::collections::HashMap<String, Command>> {
    Ok(query_commands!(
        "SELECT",
        "FROM commands c WHERE c.workflow_id = $1",
        workflow
    )
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|c| (c.idempotency_key.clone(), c))
    .collect())
}

/// Commands by id.
pub async fn get_commands(db: &Db, ids: &[CommandId]) -> Result<Vec<Command>> {
    let ids: Vec<&str> = ids.iter().map(CommandId::as_str).collect();
    Ok(query_commands!(
        "SELECT",
        "FROM commands c WHERE c.id = ANY($1)",
        &ids[..] as &[&str]
    )
    .fetch_all(db.pool())
    .await?)
}

/// Filters of the commands connections.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CommandFilter {
    pub node_id: Option<NodeId>,
    pub state: Option<State>,
    pub kind: Option<Kind>,
}

fn select<'a>(cols: &str, f: &CommandFilter) -> QueryBuilder<'a, Postgres> {
    let mut qb = QueryBuilder::new(format!("SELECT {cols} FROM commands c WHERE TRUE"));
    if let Some(n) = &f.node_id {
        qb.push(" AND c.node_id = ").push_bind(n.clone());
    }
    if let Some(s) = f.state {
        qb.push(" AND c.state = ").push_bind(s);
    }
    if let Some(k) = f.kind {
        qb.push(" AND c.kind = ").push_bind(k);
    }
    qb
}

/// A page of commands, oldest first (`last:` for the newest).
pub async fn list_commands(
    db: &Db,
    filter: &CommandFilter,
    page: &PageArgs,
) -> Result<Page<Command>> {
    crate::page::fetch_page(select(COLS, filter), "c.id", page, db).await
}

/// How many commands match.
pub async fn count_commands(db: &Db, filter: &CommandFilter) -> Result<i64> {
    let (n,): (i64,) = select("count(*)", filter)
        .build_query_as()
        .fetch_one(db.pool())
        .await?;
    Ok(n)
}

/// What one dispatch of a node did.
#[derive(Debug, Clone, Default)]
pub struct Dispatched {
    /// The commands sent to the node's session.
    pub commands: Vec<Command>,
    /// Commands failed because the node was retired.
    pub abandoned: usize,
    /// More were waiting than one batch takes: run again at once.
    pub more: bool,
    /// The gateway holding the session the commands went to (poked after the commit).
    pub gateway: Option<String>,
}

/// Dispatches the waiting commands of `node` to its open session, in one transaction of `db`
/// (fenced by the node's shard lease): makes the `apply_spec` of a generation the daemon has
/// not reported, sends every pending command whose `min_generation` the daemon has reported
/// (oldest first, at most [`DISPATCH_BATCH`]), and, after the commit, pokes the session's
/// gateway ([`Db::poke_after_commit`]). A node without
/// an open session gets nothing (its next session wakes this again); a retired node's commands
/// fail with `NODE_RETIRED`.
#[tracing::instrument(level = "debug", skip_all, fields(node = %node))]
pub async fn dispatch_node(db: &Db, node: &NodeId) -> Result<Dispatched> {
    let dispatched = db.tx("dispatch_commands", TxKind::Maintenance, |conn| {
        let node = node.clone();
        Box::pin(async move {
            let Some(spec) = sqlx::query!(
                r#"SELECT generation, observed_generation, retired_at IS NOT NULL AS "retired!" FROM nodes WHERE id = $1"#,
                node.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?
            else {
                return Ok(Dispatched::default());
            };
            if spec.retired {
                let failed = query_commands!(
                    "UPDATE commands AS c SET state = 'failed', error_code = 'NODE_RETIRED', \
                            error_message = 'the node was retired before the command finished', \
                            finished_at = compute_now(), version = c.version + 1, updated_at = compute_now() \
                      WHERE c.node_id = $1 AND c.state = ANY($2) RETURNING",
                    "",
                    node.as_str(),
                    &stored_from(Action::Abandon)[..] as &[&str],
                )
                .fetch_all(&mut *conn)
                .await?;
                emit(conn, &failed, EventType::CommandFailed).await?;
                return Ok(Dispatched {
                    abandoned: failed.len(),
                    ..Dispatched::default()
                });
            }
            // The session first (lock order): a session opening now waits for this dispatch,
            // or this waits for it and then sees the new epoch.
            let Some(session) = sqlx::query!(
                "SELECT session_epoch, journal_id, gateway FROM node_sessions \
                  WHERE node_id = $1 AND closed_at IS NULL FOR SHARE",
                node.as_str(),
            )
            .fetch_optional(&mut *conn)
            .await?
            else {
                return Ok(Dispatched::default());
            };
            if spec.generation > spec.observed_generation {
                // Made and sent in this transaction: no wake-up, so no `work_queue` row is
                // locked before the commands below (docs/database-locks.md, rule 3).
                insert_or_find(
                    conn,
                    NewCommand {
                        node: &node,
                        kind: Kind::ApplySpec,
                        args: &json!({ "generation": spec.generation }),
                        min_generation: 0,
                        retry_safe: true,
                        key: &format!("spec:{}", spec.generation),
                        created_by: CONTROL_PLANE,
                        workflow: None,
                    },
                )
                .await?;
            }
            let sent = query_commands!(
                "UPDATE commands AS c SET state = 'dispatched', session_epoch = $2, journal_id = $3, gateway = $4, \
                        traceparent = coalesce(compute_traceparent(), c.traceparent), attempts = c.attempts + 1, dispatched_at = compute_now(), version = c.version + 1, updated_at = compute_now() \
                  WHERE c.id IN (SELECT p.id FROM commands p \
                                  WHERE p.node_id = $1 AND p.state = 'pending' AND p.min_generation <= $5 \
                                  ORDER BY p.id LIMIT $6 FOR UPDATE) \
                    AND c.state = ANY($7) \
                  RETURNING",
                "",
                node.as_str(),
                session.session_epoch,
                session.journal_id,
                session.gateway,
                spec.observed_generation,
                DISPATCH_BATCH,
                &stored_from(Action::Dispatch)[..] as &[&str],
            )
            .fetch_all(&mut *conn)
            .await?;
            if sent.is_empty() {
                return Ok(Dispatched::default());
            }
            emit(conn, &sent, EventType::CommandDispatched).await?;
            let more = sent.len() as i64 == DISPATCH_BATCH;
            Ok(Dispatched {
                commands: sent,
                abandoned: 0,
                more,
                gateway: Some(session.gateway),
            })
        })
    })
    .await?;
    // The gateway hears of it after the commit, never from inside the writing transaction.
    if let Some(gateway) = &dispatched.gateway {
        db.poke_after_commit(NOTIFY_CHANNEL, gateway);
    }
    Ok(dispatched)
}

/// The commands dispatched to sessions `gateway` holds and not yet acknowledged: what it has
/// to push (it pushes each at most once per session).
pub async fn to_push(db: &Db, gateway: &GatewayId) -> Result<Vec<Command>> {
    Ok(query_commands!(
        "SELECT",
        "FROM commands c WHERE c.gateway = $1 AND c.state = 'dispatched' ORDER BY c.node_id, c.id",
        gateway.as_str(),
    )
    .fetch_all(db.pool())
    .await?)
}

/// What an acknowledgement got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckAnswer {
    /// The command runs: the daemon may proceed.
    Proceed,
    /// The daemon must not run it (cancelled, finished, or no longer this session's): why.
    Refused(String),
}

/// The daemon of `node` (session `epoch`) acknowledges command `id`; `db` is fenced by the
/// gateway's lease. A repeated acknowledgement of a running command proceeds again (the daemon's
/// journal keeps it from running twice).
#[tracing::instrument(level = "debug", skip_all, fields(node = %node, epoch = epoch, command = %id))]
pub async fn ack(db: &Db, node: &NodeId, epoch: i64, id: &CommandId) -> Result<AckAnswer> {
    db.tx("ack_command", TxKind::Write, |conn| {
        let (node, id) = (node.clone(), id.clone());
        Box::pin(async move {
            let started = query_commands!(
                guarded: "UPDATE commands AS c SET state = 'running', started_at = compute_now(), \
                        version = c.version + 1, updated_at = compute_now() \
                  WHERE c.id = $3 AND c.node_id = $1 AND c.session_epoch = $2 AND c.state = ANY($4) \
                    AND EXISTS (SELECT 1 FROM s) RETURNING",
                "",
                node.as_str(),
                epoch,
                id.as_str(),
                &stored_from(Action::Ack)[..] as &[&str],
            )
            .fetch_optional(&mut *conn)
            .await?;
            if let Some(c) = started {
                emit(conn, std::slice::from_ref(&c), EventType::CommandRunning).await?;
                return Ok(AckAnswer::Proceed);
            }
            Ok(match load(conn, &id).await? {
                Some(c) if c.node_id != node => AckAnswer::Refused("not this node's command".into()),
                Some(c) if c.state == State::Running && c.session_epoch == Some(epoch) => {
                    AckAnswer::Proceed
                }
                Some(c) if c.state == State::Cancelled => {
                    AckAnswer::Refused("cancelled by an operator".into())
                }
                Some(c) if c.state.is_terminal() => AckAnswer::Refused(format!("already {}", c.state)),
                Some(_) => AckAnswer::Refused("not dispatched to this session".into()),
                None => AckAnswer::Refused("no such command".into()),
            })
        })
    })
    .await
}

/// Records the progress a daemon reports for a running command; `false` when the command is
/// not running in this session, or already shows this progress (then nothing changes: a daemon
/// repeating itself makes no event).
#[tracing::instrument(level = "debug", skip_all, fields(node = %node, epoch = epoch, command = %id))]
pub async fn progress(
    db: &Db,
    node: &NodeId,
    epoch: i64,
    id: &CommandId,
    progress: &Value,
) -> Result<bool> {
    check_object("progress", progress)?;
    db.tx("command_progress", TxKind::Write, |conn| {
        let (node, id, progress) = (node.clone(), id.clone(), progress.clone());
        Box::pin(async move {
            let moved = query_commands!(
                guarded: "UPDATE commands AS c SET progress = $4, version = c.version + 1, updated_at = compute_now() \
                  WHERE c.id = $3 AND c.node_id = $1 AND c.session_epoch = $2 AND c.state = 'running' \
                    AND c.progress IS DISTINCT FROM $4 AND EXISTS (SELECT 1 FROM s) RETURNING",
                "",
                node.as_str(),
                epoch,
                id.as_str(),
                Json(&progress) as _,
            )
            .fetch_optional(&mut *conn)
            .await?;
            match moved {
                Some(c) => {
                    emit(conn, std::slice::from_ref(&c), EventType::CommandProgress).await?;
                    Ok(true)
                }
                None => Ok(false),
            }
        })
    })
    .await
}

/// A daemon's outcome of a command, checked: only [`Report::parse`] makes one.
#[derive(Debug, Clone)]
pub struct Report {
    succeeded: bool,
    /// What it produced (an object).
    output: Value,
    /// For a failure: an upper-case code of the daemon's (`[A-Z][A-Z_]*`, at most 64) and a
    /// message.
    error_code: Option<String>,
    error_message: Option<String>,
}

impl Report {
    /// Parses a daemon's report.
    pub fn parse(
        succeeded: bool,
        output: Value,
        error_code: Option<String>,
        error_message: Option<String>,
    ) -> Result<Report> {
        let report = Report {
            succeeded,
            output,
            error_code,
            error_message,
        };
        report.check()?;
        Ok(report)
    }

    fn check(&self) -> Result<()> {
        check_object("output", &self.output)?;
        match (&self.error_code, self.succeeded) {
            (Some(_), true) => Err(Error::bad_input(
                "errorCode",
                "a succeeded result carries no errorCode",
            )),
            (None, false) => Err(Error::bad_input(
                "errorCode",
                "a failed result needs an errorCode",
            )),
            (Some(code), false) => {
                let ok = (1..=64).contains(&code.len())
                    && code.starts_with(|c: char| c.is_ascii_uppercase())
                    && code.chars().all(|c| c.is_ascii_uppercase() || c == '_');
                if ok {
                    Ok(())
                } else {
                    Err(Error::bad_input(
                        "errorCode",
                        "errorCode is 1 to 64 of A-Z and _, starting with a letter",
                    ))
                }
            }
            (None, true) => Ok(()),
        }
    }
}

/// Records the outcome the daemon of `node` (session `epoch`) reports for command `id`; `db`
/// is fenced by the gateway's lease. `None` when the command is not dispatched to or running in
/// this session (a superseded session, a zombie gateway, a repeat): nothing changes.
#[tracing::instrument(level = "debug", skip_all, fields(node = %node, epoch = epoch, command = %id))]
pub async fn finish(
    db: &Db,
    node: &NodeId,
    epoch: i64,
    id: &CommandId,
    report: &Report,
) -> Result<Option<Command>> {
    let message = report
        .error_message
        .as_deref()
        .map(|m| {
            // A diagnostic for people (often a runtime's stderr): kept, cut to 2,000
            // characters, a NUL (which PostgreSQL's text cannot hold) shown as U+FFFD.
            m.chars()
                .take(2000)
                .map(|c| if c == '\0' { '\u{FFFD}' } else { c })
                .collect::<String>()
        })
        .or_else(|| report.error_code.as_ref().map(|_| String::new()));
    db.tx("finish_command", TxKind::Write, |conn| {
        let (node, id, report, message) = (node.clone(), id.clone(), report.clone(), message.clone());
        Box::pin(async move {
            let state = if report.succeeded { State::Succeeded } else { State::Failed };
            let done = query_commands!(
                guarded: "UPDATE commands AS c SET state = $4, result = $5, error_code = $6, error_message = $7, \
                        started_at = coalesce(c.started_at, compute_now()), finished_at = compute_now(), \
                        version = c.version + 1, updated_at = compute_now() \
                  WHERE c.id = $3 AND c.node_id = $1 AND c.session_epoch = $2 AND c.state = ANY($8) \
                    AND EXISTS (SELECT 1 FROM s) RETURNING",
                "",
                node.as_str(),
                epoch,
                id.as_str(),
                state.as_str(),
                Json(&report.output) as _,
                report.error_code,
                message,
                &stored_from(Action::Finish)[..] as &[&str],
            )
            .fetch_optional(&mut *conn)
            .await?;
            let Some(c) = done else { return Ok(None) };
            let event = if report.succeeded {
                EventType::CommandSucceeded
            } else {
                EventType::CommandFailed
            };
            emit(conn, std::slice::from_ref(&c), event).await?;
            Ok(Some(c))
        })
    })
    .await
}

/// What a session's opening did to the commands in flight under older sessions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reopened {
    /// Back to `pending`, to be dispatched to the new session.
    pub requeued: usize,
    /// Failed with `JOURNAL_RESET`.
    pub reset: usize,
}

/// In the transaction that opens session `epoch` of `node` (after its `node_sessions` row is
/// written): the commands dispatched to or running in older sessions go back to `pending`,
/// except, when the daemon comes with a journal other than `previous` (it lost its memory), the
/// ones that are not retry-safe: those fail with `JOURNAL_RESET`, and so do the pending ones that
/// were sent to another journal before an earlier reconnection put them back (the command
/// torture found one: sent to journal A, requeued when the daemon came back with A, then
/// dispatched to journal B after a wipe: it could have run twice). Wakes the node's dispatcher.
pub async fn on_session_open(
    conn: &mut PgConnection,
    node: &NodeId,
    epoch: i64,
    previous: Option<&str>,
    journal: &str,
) -> Result<Reopened> {
    let wiped = previous.is_some_and(|p| p != journal);
    let mut out = Reopened::default();
    if wiped {
        let failed = query_commands!(
            "UPDATE commands AS c SET state = 'failed', error_code = 'JOURNAL_RESET', \
                    error_message = 'the daemon came back with a new journal (it lost its memory): this command may or may not have run, and is not safe to run again', \
                    finished_at = compute_now(), version = c.version + 1, updated_at = compute_now() \
              WHERE c.node_id = $1 AND c.state = ANY($2) AND NOT c.retry_safe \
                AND CASE WHEN c.state = 'pending' THEN c.journal_id IS DISTINCT FROM $4 AND c.journal_id IS NOT NULL \
                         ELSE c.session_epoch < $3 END \
              RETURNING",
            "",
            node.as_str(),
            &stored_from(Action::JournalReset)[..] as &[&str],
            epoch,
            journal,
        )
        .fetch_all(&mut *conn)
        .await?;
        emit(conn, &failed, EventType::CommandFailed).await?;
        out.reset = failed.len();
    }
    let requeued = query_commands!(
        "UPDATE commands AS c SET state = 'pending', session_epoch = NULL, version = c.version + 1, updated_at = compute_now() \
          WHERE c.node_id = $1 AND c.state = ANY($2) AND c.session_epoch < $3 \
          RETURNING",
        "",
        node.as_str(),
        &stored_from(Action::Requeue)[..] as &[&str],
        epoch,
    )
    .fetch_all(&mut *conn)
    .await?;
    emit(conn, &requeued, EventType::CommandRequeued).await?;
    out.requeued = requeued.len();
    enqueue(conn, node).await?;
    Ok(out)
}

/// The resync of dispatch, level-triggered: enqueues every node that has a command waiting to
/// be dispatched, so a lost or never-written `node_commands` queue row only costs time (the
/// reconciler runs it every [`crate::work_queue::RESYNC_EVERY`]). One statement over the
/// `commands_pending` partial index, which holds only waiting commands: its cost follows them,
/// not the fleet. Returns how many nodes.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn enqueue_waiting(db: &Db) -> Result<u64> {
    let n = db
        .tx("enqueue_waiting_commands", TxKind::Maintenance, |conn| {
            Box::pin(async move {
                Ok(sqlx::query_scalar!(
                    r#"SELECT compute_enqueue($1, array_agg(DISTINCT c.node_id), $2) AS "n!"
                         FROM commands c WHERE c.state = ANY($3)"#,
                    WorkKind::NodeCommands as _,
                    work_queue::SHARDS,
                    &stored_from(Action::Dispatch)[..] as &[&str],
                )
                .fetch_one(&mut *conn)
                .await?)
            })
        })
        .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Wakes the dispatcher of `node` after its daemon reported a new generation (commands that
/// waited for it may go).
pub async fn generation_observed(conn: &mut PgConnection, node: &NodeId) -> Result<()> {
    enqueue(conn, node).await
}

/// Listens for dispatchers' pokes ([`NOTIFY_CHANNEL`]) and calls `on_poke` with each one's
/// gateway id; returns when the connection fails (the caller reconnects; its polling covers the
/// gap).
pub async fn listen_for_pokes(db: &Db, on_poke: impl Fn(&str)) -> Result<()> {
    let mut listener = db.listener().await?;
    listener.listen(NOTIFY_CHANNEL).await?;
    loop {
        let n = listener.recv().await?;
        on_poke(n.payload());
    }
}
