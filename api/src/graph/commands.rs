//! Commands to node daemons in the graph (operators only): `runCommand`, `cancelCommand`, the
//! `commands` connection and `command(id:)`. The guarantees are in `docs/commands.md`.

use async_graphql::connection::Connection;
use async_graphql::{Context, Enum, ID, InputObject, Json, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::Error;
use compute_domain::ids::{CommandId, NodeId};
use compute_domain::node_commands::{self as cmds, CommandFilter, CommandRequest};

use crate::graph::common::{connection, gql_id, page_request};
use crate::graph::fleet::ComputeNodeObj;
use crate::graph::loaders::*;
use crate::graph::{
    GqlResult, ReplayFlag, db, gql_error, operator_actor, require_operator, require_operator_on,
};
use compute_domain::authz::Target;

/// Where a command is in its life (`docs/commands.md`).
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(remote = "compute_domain::node_commands::State")]
pub enum CommandState {
    /// Waiting for the node's session, and for the daemon to report `minGeneration`.
    Pending,
    /// Sent to the node's current session; not acknowledged yet.
    Dispatched,
    /// Acknowledged by the daemon, which runs it.
    Running,
    /// The daemon reported success.
    Succeeded,
    /// The daemon reported a failure, or the control plane failed it (`errorCode`).
    Failed,
    /// Withdrawn by an operator before it ran.
    Cancelled,
}

/// What a command asks a daemon to do.
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(remote = "compute_domain::node_commands::Kind")]
pub enum CommandKind {
    /// Apply the node's spec at `args.generation`; made by the control plane when a node's
    /// generation moves (not by `runCommand`).
    ApplySpec,
    /// Reset one GPU (`args.device`). Not retry-safe by default.
    ResetGpu,
    /// Repartition a GPU's MIG instances. Not retry-safe by default.
    SetMigLayout,
    /// Stop the node's workloads. Retry-safe.
    DrainWorkloads,
    /// Start an instance's workload. Not retry-safe by default.
    RunInstance,
    /// Stop an instance's workload. Retry-safe.
    StopInstance,
    /// Does nothing: checks the path to a node. Retry-safe.
    Noop,
}

/// Something a node daemon is asked to do.
pub struct CommandObj(pub cmds::Command);

/// Something a node daemon is asked to do.
#[Object(name = "Command")]
impl CommandObj {
    /// The command's id (`cmd_…`).
    pub async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// What it asks.
    async fn kind(&self) -> CommandKind {
        self.0.kind.into()
    }
    /// Its arguments. A `run_instance`'s environment values are shown as `null` beside their
    /// names: they are the tenant's, sent to the daemon only.
    async fn args(&self) -> Json<serde_json::Value> {
        Json(self.0.shown_args())
    }
    /// Where it is in its life.
    async fn state(&self) -> CommandState {
        self.0.state.into()
    }
    /// Not dispatched before the daemon reports this spec generation.
    async fn min_generation(&self) -> i64 {
        self.0.min_generation
    }
    /// Whether running it twice is harmless: a daemon that lost its journal gets it again;
    /// otherwise it fails with `JOURNAL_RESET`.
    async fn retry_safe(&self) -> bool {
        self.0.retry_safe
    }
    /// How many times it was dispatched (more than once after a session ended with it in
    /// flight).
    async fn attempts(&self) -> i32 {
        self.0.attempts
    }
    /// The last progress the daemon reported.
    async fn progress(&self) -> Option<Json<serde_json::Value>> {
        self.0.progress.as_ref().map(|p| Json(p.0.clone()))
    }
    /// What it produced, as the daemon reported it.
    async fn result(&self) -> Option<Json<serde_json::Value>> {
        self.0.result.as_ref().map(|r| Json(r.0.clone()))
    }
    /// Why it failed: `JOURNAL_RESET`, `NODE_RETIRED`, or the daemon's own code.
    async fn error_code(&self) -> Option<&str> {
        self.0.error_code.as_deref()
    }
    /// Why it failed, in words.
    async fn error_message(&self) -> Option<&str> {
        self.0.error_message.as_deref()
    }
    /// The epoch of the node session it was (last) dispatched to.
    async fn session_epoch(&self) -> Option<i64> {
        self.0.session_epoch
    }
    /// The daemon journal of that session.
    async fn journal_id(&self) -> Option<&str> {
        self.0.journal_id.as_deref()
    }
    /// Who asked for it (`control-plane` for `apply_spec`).
    async fn created_by(&self) -> &str {
        &self.0.created_by
    }
    /// Optimistic-concurrency version.
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
    /// When it was (last) dispatched.
    async fn dispatched_at(&self) -> Option<DateTime<Utc>> {
        self.0.dispatched_at
    }
    /// When the daemon acknowledged it.
    async fn started_at(&self) -> Option<DateTime<Utc>> {
        self.0.started_at
    }
    /// When it ended.
    async fn finished_at(&self) -> Option<DateTime<Utc>> {
        self.0.finished_at
    }
    /// The node's id.
    async fn compute_node_id(&self) -> ID {
        gql_id(&self.0.node_id)
    }
    /// The node it runs on.
    async fn compute_node(&self, ctx: &Context<'_>) -> GqlResult<ComputeNodeObj> {
        loaders_of(ctx)?
            .load_one(self.0.node_id.clone())
            .await?
            .map(ComputeNodeObj::new)
            .ok_or_else(|| gql_error(Error::internal("a command without its node")))
    }
}

/// `totalCount` of a commands connection.
pub struct CommandCount(pub CommandFilter);

/// `totalCount` of a commands connection.
#[Object]
impl CommandCount {
    /// How many commands match, across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> GqlResult<i64> {
        Ok(cmds::count_commands(db(ctx)?, &self.0).await?)
    }
}

/// One page of commands matching `filter`, oldest first.
pub async fn page(
    ctx: &Context<'_>,
    filter: CommandFilter,
    request: compute_domain::page::PageRequest,
) -> GqlResult<Connection<String, CommandObj, CommandCount>> {
    // A scoped operator lists one node's commands at a time, a node in its scope.
    match &filter.node_id {
        Some(node) => require_operator_on(ctx, Target::Node(node.clone())).await?,
        None => require_operator(ctx)?,
    }
    let args = request.resolve()?;
    let page = cmds::list_commands(db(ctx)?, &filter, &args).await?;
    Ok(connection(
        page,
        CommandCount(filter),
        |c| c.id.as_str(),
        CommandObj,
    ))
}

/// The commands' queries.
#[derive(Default)]
pub struct CommandQuery;

/// The commands' queries.
#[Object]
impl CommandQuery {
    /// A command (operators only).
    async fn command(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
    ) -> GqlResult<CommandObj> {
        let cid = CommandId::parse("id", id.as_str())?;
        require_operator_on(ctx, Target::Command(cid.clone())).await?;
        loaders_of(ctx)?
            .load_one(cid.clone())
            .await?
            .map(CommandObj)
            .ok_or_else(|| {
                gql_error(Error::NotFound {
                    kind: "command",
                    id: cid.to_string(),
                })
            })
    }

    /// Commands of every node, oldest first (`last:` for the newest), filtered (operators
    /// only).
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn commands(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only this node's.")] compute_node_id: Option<ID>,
        #[graphql(desc = "Only commands in this state.")] state: Option<CommandState>,
        #[graphql(desc = "Only commands of this kind.")] kind: Option<CommandKind>,
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
    ) -> GqlResult<Connection<String, CommandObj, CommandCount>> {
        let filter = CommandFilter {
            node_id: compute_node_id
                .map(|n| NodeId::parse("computeNodeId", n.as_str()))
                .transpose()?,
            state: state.map(Into::into),
            kind: kind.map(Into::into),
        };
        page(ctx, filter, page_request(first, after, last, before)).await
    }
}

/// Input of `runCommand`.
#[derive(InputObject)]
pub struct RunCommandInput {
    /// The node to run it on.
    pub compute_node_id: ID,
    /// What to run (`APPLY_SPEC` is the control plane's).
    pub kind: CommandKind,
    /// Its arguments: a JSON object of at most 16 KiB (`{}` when unset).
    pub args: Option<Json<serde_json::Value>>,
    /// Not dispatched before the daemon reports this spec generation (0, the default: at once).
    /// At most the node's `generation`.
    #[graphql(default)]
    pub min_generation: i64,
    /// Whether running it twice is harmless; the kind's default when unset.
    pub retry_safe: Option<bool>,
    /// Required: a retry with the same key and input gets the same command, never a second
    /// one. 1 to 255 printable characters.
    pub idempotency_key: String,
}

/// A command after a change.
#[derive(SimpleObject)]
pub struct CommandPayload {
    /// The command.
    pub command: CommandObj,
    /// Whether this is the stored answer to an earlier request with the same idempotency key.
    pub idempotent_replay: bool,
}

/// Input of `cancelCommand`.
#[derive(InputObject)]
pub struct CancelCommandInput {
    /// The command.
    pub id: ID,
}

/// The commands' mutations.
#[derive(Default)]
pub struct CommandMutation;

/// The commands' mutations.
#[Object]
impl CommandMutation {
    /// Asks a node's daemon to do something (operators only). The command waits for the node's
    /// session (and `minGeneration`), is dispatched to it under a lease, and ends `SUCCEEDED`
    /// or `FAILED` as the daemon reports; follow it with the `command` subscription.
    async fn run_command(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `runCommand`.")] input: RunCommandInput,
    ) -> GqlResult<CommandPayload> {
        let node = NodeId::parse("computeNodeId", input.compute_node_id.as_str())?;
        require_operator_on(ctx, Target::Node(node.clone())).await?;
        let actor = operator_actor(ctx)?;
        let request = CommandRequest::parse(
            node,
            input.kind.into(),
            input
                .args
                .map(|j| j.0)
                .unwrap_or_else(|| serde_json::json!({})),
            input.min_generation,
            input.retry_safe,
        )?;
        let outcome = cmds::run_command(db(ctx)?, &actor, request, &input.idempotency_key).await?;
        if outcome.replayed {
            ReplayFlag::mark(ctx);
        }
        Ok(CommandPayload {
            command: CommandObj(outcome.value),
            idempotent_replay: outcome.replayed,
        })
    }

    /// Withdraws a command that is `PENDING` or `DISPATCHED` (operators only). Safe to retry:
    /// a cancelled command is returned as it is; one that runs or ran is `CONFLICT`.
    async fn cancel_command(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `cancelCommand`.")] input: CancelCommandInput,
    ) -> GqlResult<CommandPayload> {
        let id = CommandId::parse("id", input.id.as_str())?;
        require_operator_on(ctx, Target::Command(id.clone())).await?;
        let actor = operator_actor(ctx)?;
        let command = cmds::cancel(db(ctx)?, &actor, &id).await?;
        Ok(CommandPayload {
            command: CommandObj(command),
            idempotent_replay: false,
        })
    }
}
