//! Enrollment in the graph: one-time join tokens (`createNodeJoinToken`, `nodeJoinTokens`,
//! `revokeNodeJoinToken`) and the operator's answer to an inventory mismatch
//! (`acceptNodeInventory`). Operators only. The join itself is `join` on `/agent`.

use async_graphql::connection::Connection;
use async_graphql::{Context, Enum, ID, InputObject, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::fleet::changes as cmd;
use compute_domain::fleet::enrollment::{self, JoinToken, JoinTokenFilter, NewJoinToken};
use compute_domain::ids::{JoinTokenId, NodeId, PoolId};

use super::mutations::{LabelInput, labels};
use super::{ComputeNodeObj, Label, labels_of};
use crate::graph::common::*;
use crate::graph::{GqlResult, db, operator_actor, require_operator, require_operator_on};
use compute_domain::authz::Target;

/// Where a join token is in its life.
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum NodeJoinTokenState {
    /// It can still be used, once.
    Active,
    /// A machine joined with it.
    Used,
    /// An operator revoked it.
    Revoked,
    /// Its time ran out unused.
    Expired,
}

/// A one-time token a machine joins a pool with (`compute-agent join --token …`). Its secret is
/// shown once, by `createNodeJoinToken`, and stored only as a digest.
pub struct NodeJoinTokenObj(pub JoinToken);

/// A one-time token a machine joins a pool with.
#[Object(name = "NodeJoinToken")]
impl NodeJoinTokenObj {
    /// The token's id (`njt_…`), not its secret.
    async fn id(&self) -> ID {
        ID(self.0.id.to_string())
    }
    /// The pool a machine joining with it is registered in.
    async fn pool_id(&self) -> ID {
        ID(self.0.pool_id.to_string())
    }
    /// The labels the joining node is registered with.
    async fn labels(&self) -> Vec<Label> {
        labels_of(&self.0.labels.0)
    }
    /// Active, used, revoked or expired, now.
    async fn state(&self) -> NodeJoinTokenState {
        match self.0.state.as_str() {
            "used" => NodeJoinTokenState::Used,
            "revoked" => NodeJoinTokenState::Revoked,
            "expired" => NodeJoinTokenState::Expired,
            _ => NodeJoinTokenState::Active,
        }
    }
    /// Until when it can be used.
    async fn expires_at(&self) -> DateTime<Utc> {
        self.0.expires_at
    }
    /// Who made it (the token subject).
    async fn created_by(&self) -> &str {
        &self.0.created_by
    }
    /// When it was made.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
    }
    /// When a machine joined with it.
    async fn used_at(&self) -> Option<DateTime<Utc>> {
        self.0.used_at
    }
    /// The node that joined with it.
    async fn compute_node_id(&self) -> Option<ID> {
        self.0.node_id.as_ref().map(|n| ID(n.to_string()))
    }
    /// When it was revoked.
    async fn revoked_at(&self) -> Option<DateTime<Utc>> {
        self.0.revoked_at
    }
    /// Who revoked it.
    async fn revoked_by(&self) -> Option<&str> {
        self.0.revoked_by.as_deref()
    }
}

/// `totalCount` of the join tokens connection.
pub struct JoinTokenCount(JoinTokenFilter);

/// `totalCount` of the join tokens connection.
#[Object]
impl JoinTokenCount {
    /// How many join tokens match, across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> GqlResult<i64> {
        require_operator(ctx)?;
        Ok(enrollment::count_join_tokens(db(ctx)?, &self.0).await?)
    }
}

/// The enrollment queries.
#[derive(Default)]
pub struct EnrollmentQuery;

/// The enrollment queries.
#[Object]
impl EnrollmentQuery {
    /// Join tokens, oldest first, without their secrets. Operators only.
    async fn node_join_tokens(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only this pool's tokens.")] pool_id: Option<ID>,
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
    ) -> GqlResult<Connection<String, NodeJoinTokenObj, JoinTokenCount>> {
        require_operator(ctx)?;
        let filter = JoinTokenFilter {
            pool_id: opt_id::<PoolId>("poolId", pool_id.as_ref())?,
        };
        let args = page_request(first, after, last, before).resolve()?;
        let page = enrollment::list_join_tokens(db(ctx)?, &filter, &args).await?;
        Ok(connection(
            page,
            JoinTokenCount(filter),
            |t| t.id.as_str(),
            NodeJoinTokenObj,
        ))
    }
}

/// Input of `createNodeJoinToken`.
#[derive(InputObject)]
pub struct CreateNodeJoinTokenInput {
    /// The pool the joining machine is registered in.
    pub pool_id: ID,
    /// How long it can be used: 60 seconds to 30 days.
    #[graphql(default = 3600)]
    pub expires_in_seconds: i64,
    /// The labels the node is registered with.
    #[graphql(default)]
    pub labels: Vec<LabelInput>,
    /// Makes the call safe to retry: the same key and input give the same token (without its
    /// secret, which is shown only once).
    pub idempotency_key: Option<String>,
}

/// Result of `createNodeJoinToken`.
#[derive(SimpleObject)]
pub struct CreateNodeJoinTokenPayload {
    /// The token.
    pub node_join_token: NodeJoinTokenObj,
    /// The secret to give `compute-agent join --token`: shown this once (null when the call
    /// was a replay; revoke the token and make another if it was lost).
    pub secret: Option<String>,
    /// Whether this response replays an earlier call with the same idempotency key.
    pub idempotent_replay: bool,
}

/// Input of `revokeNodeJoinToken`.
#[derive(InputObject)]
pub struct RevokeNodeJoinTokenInput {
    /// The token (`njt_…`).
    pub id: ID,
}

/// Result of `revokeNodeJoinToken`.
#[derive(SimpleObject)]
pub struct NodeJoinTokenPayload {
    /// The token after the change.
    pub node_join_token: NodeJoinTokenObj,
}

/// Input of `acceptNodeInventory`.
#[derive(InputObject)]
pub struct AcceptNodeInventoryInput {
    /// The node.
    pub id: ID,
    /// The version you read; when given, a newer node is `CONFLICT`. A report of another
    /// inventory makes the node newer, so the version covers the report you accept.
    pub version: Option<i64>,
}

/// Result of `acceptNodeInventory`.
#[derive(SimpleObject)]
pub struct AcceptNodeInventoryPayload {
    /// The node after the change.
    pub compute_node: ComputeNodeObj,
}

/// The enrollment mutations.
#[derive(Default)]
pub struct EnrollmentMutation;

/// The enrollment mutations.
#[Object]
impl EnrollmentMutation {
    /// Makes a one-time token a machine joins `poolId` with (`compute-agent join`).
    async fn create_node_join_token(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `createNodeJoinToken`.")]
        input: CreateNodeJoinTokenInput,
    ) -> GqlResult<CreateNodeJoinTokenPayload> {
        let pool_id = parse_id::<PoolId>("poolId", &input.pool_id)?;
        require_operator_on(ctx, Target::Pool(pool_id.clone())).await?;
        let new = NewJoinToken {
            pool_id,
            expires_in_seconds: input.expires_in_seconds,
            labels: labels("labels", &input.labels)?,
        };
        let outcome = enrollment::create_join_token(
            db(ctx)?,
            &operator_actor(ctx)?,
            new,
            input.idempotency_key,
        )
        .await?;
        if outcome.replayed {
            crate::graph::ReplayFlag::mark(ctx);
        }
        Ok(CreateNodeJoinTokenPayload {
            node_join_token: NodeJoinTokenObj(outcome.value.token),
            secret: outcome.value.secret,
            idempotent_replay: outcome.replayed,
        })
    }

    /// Revokes a join token that was not used (a used one: retire its node instead).
    async fn revoke_node_join_token(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `revokeNodeJoinToken`.")]
        input: RevokeNodeJoinTokenInput,
    ) -> GqlResult<NodeJoinTokenPayload> {
        let id = parse_id::<JoinTokenId>("id", &input.id)?;
        require_operator_on(ctx, Target::JoinToken(id.clone())).await?;
        let token = enrollment::revoke_join_token(db(ctx)?, &operator_actor(ctx)?, &id).await?;
        Ok(NodeJoinTokenPayload {
            node_join_token: NodeJoinTokenObj(token),
        })
    }

    /// Makes a node's registration what its daemon last reported (vCPU, memory, disk, GPU
    /// models and memory, GPUs not registered yet), ending its `InventoryMismatch`. A GPU
    /// missing from the machine or another MIG layout is `CONFLICT` naming what to do instead.
    async fn accept_node_inventory(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `acceptNodeInventory`.")]
        input: AcceptNodeInventoryInput,
    ) -> GqlResult<AcceptNodeInventoryPayload> {
        let id = parse_id::<NodeId>("id", &input.id)?;
        require_operator_on(ctx, Target::Node(id.clone())).await?;
        let node = cmd::accept_node_inventory(db(ctx)?, &id, input.version).await?;
        Ok(AcceptNodeInventoryPayload {
            compute_node: ComputeNodeObj::new(node),
        })
    }
}
