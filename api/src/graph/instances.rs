//! Instances in the graph: a tenant's workload on one allocation, run as a workflow of commands
//! (`docs/instances.md`). Another tenant's instance is `NOT_FOUND`.

use async_graphql::connection::Connection;
use async_graphql::{Context, Enum, ID, InputObject, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::Error;
use compute_domain::ids::{AllocationId, InstanceId, ReservationId};
use compute_domain::instances::{self as ins, InstanceFilter, InstanceRequest};

use crate::graph::common::{connection, gql_id, page_request};
use crate::graph::loaders::*;
use crate::graph::reservations::ReservationObj;
use crate::graph::{GqlResult, ReplayFlag, actor, db, gql_error};

/// Where an instance is in its life (`docs/instances.md`).
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
#[graphql(remote = "compute_domain::instances::State")]
pub enum InstanceState {
    /// Its workload is being started on the node (or waits for its reservation's start).
    Provisioning,
    /// The node's daemon started its workload.
    Running,
    /// Its reservation ended or it was asked to stop: the workload is being stopped.
    Stopping,
    /// Its workload stopped (or never started).
    Stopped,
    /// Its workload could not be started or stopped; `reason` says why.
    Failed,
    /// Its workload ended on its own (`exitCode` or `exitSignal`, `exitedAt`); it is not
    /// started again.
    Exited,
}

/// A tenant's workload on one allocation of its reservation.
pub struct InstanceObj(pub ins::Instance);

/// A tenant's workload on one allocation of its reservation.
#[Object(name = "Instance")]
impl InstanceObj {
    /// The instance's id (`ins_…`).
    pub async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// The tenant it belongs to.
    async fn tenant_id(&self) -> &str {
        self.0.tenant_id.as_str()
    }
    /// Where it is in its life.
    async fn state(&self) -> InstanceState {
        self.0.state.into()
    }
    /// The image it runs.
    async fn image(&self) -> &str {
        &self.0.image
    }
    /// The command it runs, as arguments.
    async fn command(&self) -> &[String] {
        &self.0.command
    }
    /// Its environment variables' names (their values are not shown again).
    async fn env_names(&self) -> Vec<&str> {
        self.0.env.0.keys().map(String::as_str).collect()
    }
    /// Whether `stopInstance` asked it to stop.
    async fn stop_requested(&self) -> bool {
        self.0.stop_requested
    }
    /// Why it is stopping, stopped or failed, in words.
    async fn reason(&self) -> Option<&str> {
        self.0.reason.as_deref()
    }
    /// The id of the allocation it runs on.
    async fn allocation_id(&self) -> ID {
        gql_id(&self.0.allocation_id)
    }
    /// The id of the node it runs on.
    async fn compute_node_id(&self) -> ID {
        gql_id(&self.0.node_id)
    }
    /// Its reservation.
    async fn reservation(&self, ctx: &Context<'_>) -> GqlResult<ReservationObj> {
        loaders_of(ctx)?
            .load_one(self.0.reservation_id.clone())
            .await?
            .map(ReservationObj)
            .ok_or_else(|| gql_error(Error::internal("an instance without its reservation")))
    }
    /// Who created it.
    async fn created_by(&self) -> &str {
        &self.0.created_by
    }
    /// When it was created.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
    }
    /// When it last changed.
    async fn updated_at(&self) -> DateTime<Utc> {
        self.0.updated_at
    }
    /// When its workload started.
    async fn started_at(&self) -> Option<DateTime<Utc>> {
        self.0.started_at
    }
    /// When it stopped or failed.
    async fn stopped_at(&self) -> Option<DateTime<Utc>> {
        self.0.stopped_at
    }
    /// The exit code of its workload, when it exited on its own (0 to 255).
    async fn exit_code(&self) -> Option<i32> {
        self.0.exit_code
    }
    /// The signal that ended its workload, when one did without being asked to.
    async fn exit_signal(&self) -> Option<i32> {
        self.0.exit_signal
    }
    /// When its workload ended on its own, as its node's daemon reported.
    async fn exited_at(&self) -> Option<DateTime<Utc>> {
        self.0.exited_at
    }
    /// Optimistic-concurrency version.
    async fn version(&self) -> i64 {
        self.0.version
    }
}

/// Whether the caller may see `i`.
pub fn visible(ctx: &Context<'_>, i: &ins::Instance) -> GqlResult<bool> {
    crate::graph::context::may_see(ctx, &i.tenant_id)
}

/// `totalCount` of the instances connection.
pub struct InstanceCount(InstanceFilter);

/// `totalCount` of the instances connection.
#[Object]
impl InstanceCount {
    /// How many instances match, across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> GqlResult<i64> {
        Ok(ins::count_instances(db(ctx)?, &self.0).await?)
    }
}

/// The instances' queries.
#[derive(Default)]
pub struct InstanceQuery;

/// The instances' queries.
#[Object]
impl InstanceQuery {
    /// An instance; another tenant's is `NOT_FOUND`.
    async fn instance(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The global id of the object.")] id: ID,
    ) -> GqlResult<InstanceObj> {
        let iid = InstanceId::parse("id", id.as_str())?;
        match loaders_of(ctx)?.load_one(iid.clone()).await? {
            Some(i) if visible(ctx, &i)? => Ok(InstanceObj(i)),
            _ => Err(gql_error(Error::NotFound {
                kind: "instance",
                id: iid.to_string(),
            })),
        }
    }

    /// Instances: a member's own tenant's; an operator's of every tenant, or of `tenantId`.
    #[expect(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn instances(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only the instances of this reservation.")] reservation_id: Option<ID>,
        #[graphql(desc = "Only instances in this state.")] state: Option<InstanceState>,
        #[graphql(desc = "Operators: only this tenant's.")] tenant_id: Option<String>,
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
    ) -> GqlResult<Connection<String, InstanceObj, InstanceCount>> {
        let tenant = crate::graph::context::listing_tenant(ctx, tenant_id)?;
        let filter = InstanceFilter {
            tenant_id: tenant,
            reservation_id: reservation_id
                .map(|r| ReservationId::parse("reservationId", r.as_str()))
                .transpose()?,
            state: state.map(Into::into),
        };
        let args = page_request(first, after, last, before).resolve()?;
        let page = ins::list_instances(db(ctx)?, &filter, &args).await?;
        Ok(connection(
            page,
            InstanceCount(filter),
            |i| i.id.as_str(),
            InstanceObj,
        ))
    }
}

/// One environment variable.
#[derive(InputObject)]
pub struct EnvVarInput {
    /// Its name: `[A-Za-z_][A-Za-z0-9_]*`, at most 128.
    pub name: String,
    /// Its value: at most 4096 characters.
    pub value: String,
}

/// Input of `createInstance`.
#[derive(InputObject)]
pub struct CreateInstanceInput {
    /// The allocation to run on (one of your reservation's, placed).
    pub allocation_id: ID,
    /// The image to run (1 to 500 characters).
    pub image: String,
    /// The command, as arguments (at most 64).
    #[graphql(default)]
    pub command: Vec<String>,
    /// Environment variables (at most 64).
    #[graphql(default)]
    pub env: Vec<EnvVarInput>,
    /// Required: a retry with the same key and input gets the same instance, never a second
    /// one. 1 to 255 printable characters.
    pub idempotency_key: String,
}

/// An instance after a change.
#[derive(SimpleObject)]
pub struct InstancePayload {
    /// The instance.
    pub instance: InstanceObj,
    /// Whether this is the stored answer to an earlier request with the same idempotency key.
    pub idempotent_replay: bool,
}

/// Input of `stopInstance`.
#[derive(InputObject)]
pub struct StopInstanceInput {
    /// The instance.
    pub id: ID,
}

/// The instances' mutations.
#[derive(Default)]
pub struct InstanceMutation;

/// The instances' mutations.
#[Object]
impl InstanceMutation {
    /// Runs a workload on one allocation of the caller's reservation. It is `PROVISIONING`
    /// until the node's daemon started it (from the reservation's start on), `RUNNING` then,
    /// and stops when the reservation ends. One live instance per allocation.
    async fn create_instance(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `createInstance`.")] input: CreateInstanceInput,
    ) -> GqlResult<InstancePayload> {
        let actor = actor(ctx)?;
        let mut env = std::collections::BTreeMap::new();
        for v in input.env {
            if env.insert(v.name.clone(), v.value).is_some() {
                return Err(gql_error(Error::bad_input(
                    "env",
                    format!("`{}` is given twice", v.name),
                )));
            }
        }
        let request = InstanceRequest::parse(
            AllocationId::parse("allocationId", input.allocation_id.as_str())?,
            input.image,
            input.command,
            env,
        )?;
        let outcome =
            ins::create_instance(db(ctx)?, &actor, request, &input.idempotency_key).await?;
        if outcome.replayed {
            ReplayFlag::mark(ctx);
        }
        Ok(InstancePayload {
            instance: InstanceObj(outcome.value),
            idempotent_replay: outcome.replayed,
        })
    }

    /// Asks an instance to stop before its reservation ends (it is `STOPPING`, then
    /// `STOPPED`). Safe to repeat.
    async fn stop_instance(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `stopInstance`.")] input: StopInstanceInput,
    ) -> GqlResult<InstancePayload> {
        let actor = actor(ctx)?;
        let id = InstanceId::parse("id", input.id.as_str())?;
        let instance = ins::stop_instance(db(ctx)?, &actor, &id).await?;
        Ok(InstancePayload {
            instance: InstanceObj(instance),
            idempotent_replay: false,
        })
    }
}
