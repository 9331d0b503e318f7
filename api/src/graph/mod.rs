//! The GraphQL schema: its roots, built from one module per area. Types map from domain types;
//! errors map to stable `extensions.code` (`context::gql_error`).
//!
//! Rooms: `context` (what a resolver reads from the request) and `common` (the shared
//! vocabulary) are leaves; `node` is the Relay interface; `loaders` batch every edge; `fleet`,
//! `reservations`, `commands`, `instances`, `events` and `sinks` are the areas. Areas may refer to each other's object
//! types (a pool lists its reservations, a reservation names its pool): the graph is a graph.
//! Nothing here imports a transport, the server state or the ops endpoints.

use async_graphql::{Context, Enum, MergedObject, Object, Schema, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::db::Db;

use crate::auth::Role;

pub mod admission;
pub mod availability;
pub mod commands;
pub mod common;
pub mod context;
pub mod cost;
pub mod events;
pub mod fleet;
pub mod grants;
pub mod instances;
pub mod loaders;
pub mod node;
pub mod parse_cache;
pub mod payloads;
pub mod reservations;
pub mod sinks;
pub mod usage;

pub use context::{
    GqlError, GqlResult, ReplayFlag, actor, db, gql_error, operator_actor, require_admin,
    require_operator, require_operator_on, require_viewer, viewer,
};

/// The schema type served by the API.
pub type ApiSchema = Schema<Query, Mutation, events::SubscriptionRoot>;

/// The root of every query.
#[derive(MergedObject, Default)]
pub struct Query(
    CoreQuery,
    node::NodeQuery,
    fleet::FleetQuery,
    fleet::enrollment::EnrollmentQuery,
    reservations::ReservationQuery,
    availability::AvailabilityQuery,
    events::EventsQuery,
    sinks::SinkQuery,
    commands::CommandQuery,
    instances::InstanceQuery,
    usage::UsageQuery,
    grants::GrantQuery,
);

/// The root of every mutation.
#[derive(MergedObject, Default)]
pub struct Mutation(
    fleet::mutations::FleetMutation,
    fleet::enrollment::EnrollmentMutation,
    reservations::ReservationMutation,
    sinks::SinkMutation,
    commands::CommandMutation,
    instances::InstanceMutation,
    grants::GrantMutation,
);

/// Gives `request` data loaders of its own over `db`: batches never cross requests, so one
/// request's keys (a bad cursor, an odd window) can never fail or change another's statement.
pub fn with_loaders(request: async_graphql::Request, db: &Db) -> async_graphql::Request {
    request.data(loaders::loaders(db.clone()))
}

/// Builds the schema with the shared services every resolver reads. Without a database (for
/// printing the SDL) no resolver can run.
pub fn build(services: Option<(Db, crate::tailer::Tailer, crate::auth::TokenIssuer)>) -> ApiSchema {
    let mut builder = Schema::build(
        Query::default(),
        Mutation::default(),
        events::SubscriptionRoot,
    )
    .register_output_type::<node::NodeInterface>()
    .override_output_type_description::<chrono::DateTime<chrono::Utc>>(
        "A point in time: an RFC 3339 string in UTC, such as `2026-12-01T08:00:00Z`. Inputs may carry \
         any offset; outputs are in UTC. Every time the API compares against is `compute_now()` \
         (see `serverTime`).",
    )
    // No extension: with one, async-graphql resolves every field through its extension chain
    // (a registry lookup and a boxed future per field, two formatted type names per list
    // item). The door (`door`) bounds and prices documents in the transports instead, and
    // each request has one span (`transport::request_span`), not one per field.
    .limit_depth(32);
    builder = describe_connections(builder);
    if let Some((db, tailer, issuer)) = services {
        // The data loaders are not here: each request gets its own (`with_loaders`), so a batch
        // never mixes two requests' keys and no input of one request can fail another's.
        builder = builder.data(db).data(tailer).data(issuer);
    }
    builder.finish()
}

/// async-graphql's `Connection` type has no description of its own; each of ours gets one
/// here, so every type of the schema describes itself (a test reads them all by introspection).
fn describe_connections(
    builder: async_graphql::SchemaBuilder<Query, Mutation, events::SubscriptionRoot>,
) -> async_graphql::SchemaBuilder<Query, Mutation, events::SubscriptionRoot> {
    use async_graphql::connection::Connection;
    use fleet::{AtomObj, ComputeNodeObj, Conn, DeviceObj, PoolObj, SiteObj};
    macro_rules! describe {
        ($builder:ident, $($ty:ty => $what:literal),* $(,)?) => {
            $builder$(.override_output_type_description::<$ty>(concat!(
                "A page of ", $what, ". Page forward with `first` and `after` (an edge's `cursor`, \
                 or `pageInfo.endCursor`), and backward with `last` and `before` where the field \
                 takes them; `totalCount` counts every item the filters match, not only this page's."
            )))*
        };
    }
    describe!(builder,
        Conn<SiteObj> => "sites",
        Conn<PoolObj> => "pools",
        Conn<ComputeNodeObj> => "compute nodes",
        Conn<DeviceObj> => "devices (GPUs)",
        Conn<AtomObj> => "atoms, the bookable units of a device (a whole GPU, a MIG instance or a time-slice slot)",
        Connection<String, commands::CommandObj, commands::CommandCount> => "commands sent to node daemons",
        Connection<String, reservations::ReservationObj, reservations::ReservationCount> => "reservations",
        Connection<String, sinks::EventSinkObj, sinks::SinkCount> => "event sinks (webhooks)",
        Connection<String, grants::GrantObj, grants::GrantCount> => "role grants",
        Connection<String, grants::ServiceAccountObj, grants::ServiceAccountCount> => "service accounts",
        Connection<String, instances::InstanceObj, instances::InstanceCount> => "workload instances",
        Connection<String, fleet::enrollment::NodeJoinTokenObj, fleet::enrollment::JoinTokenCount> => "node join tokens",
    )
    .override_output_type_description::<Connection<String, usage::UsageGroup>>(
        "A page of usage groups, each the billed time of one key of the report's grouping. Page \
         forward with `first` and `after` (an edge's `cursor`, or `pageInfo.endCursor`).",
    )
}

/// The SDL of the schema, as `compute-api schema` prints it and `schema.graphql` holds it.
pub fn sdl() -> String {
    build(None).sdl()
}

/// The core queries: who is calling, and what time it is.
#[derive(Default)]
pub struct CoreQuery;

/// The core queries: who is calling, and what time it is.
#[Object]
impl CoreQuery {
    /// The caller, as the API sees them: the identity of the bearer token, and the tenant,
    /// roles and scopes its grants give (its token's claims when it has none,
    /// `docs/security.md#grants`).
    async fn viewer(&self, ctx: &Context<'_>) -> GqlResult<ViewerInfo> {
        let v = viewer(ctx)?;
        Ok(ViewerInfo {
            subject: v.subject.clone(),
            issuer: v.issuer.clone(),
            tenant_id: v.tenant.as_ref().map(ToString::to_string),
            roles: v.roles.iter().map(|r| GqlRole::from(*r)).collect(),
            operator_scope_ids: v.scopes.iter().map(ToString::to_string).collect(),
            expires_at: DateTime::from_timestamp(v.expires_at, 0).unwrap_or_default(),
        })
    }

    /// Business time: `compute_now()`, the one clock every time comparison reads.
    async fn server_time(&self, ctx: &Context<'_>) -> GqlResult<DateTime<Utc>> {
        Ok(db(ctx)?.compute_now().await?)
    }
}

/// The caller of a request.
#[derive(SimpleObject)]
struct ViewerInfo {
    /// The identity (`sub`) of the bearer token, or the service account's id.
    subject: String,
    /// Who vouches for it: the token's issuer, or `compute:service-account`.
    issuer: String,
    /// The tenant the caller acts for; operators may have none.
    tenant_id: Option<String>,
    /// The caller's roles that this API knows. `OPERATOR` is an operator of the whole fleet;
    /// an operator of some sites or pools has `operatorScopeIds` instead.
    roles: Vec<GqlRole>,
    /// The sites and pools a scoped operator grant covers; empty otherwise.
    operator_scope_ids: Vec<String>,
    /// When the bearer token expires.
    expires_at: DateTime<Utc>,
}

/// What a caller may do.
#[derive(Enum, Clone, Copy, PartialEq, Eq)]
#[graphql(name = "Role")]
enum GqlRole {
    /// Manages grants and service accounts, and the whole fleet.
    Admin,
    /// Manages the fleet: sites, pools, nodes and devices.
    Operator,
    /// Reserves capacity; sees only its tenant's objects.
    Member,
    /// A node daemon.
    Node,
}

impl From<Role> for GqlRole {
    fn from(r: Role) -> Self {
        match r {
            Role::Admin => GqlRole::Admin,
            Role::Operator => GqlRole::Operator,
            Role::Member => GqlRole::Member,
            Role::Node => GqlRole::Node,
        }
    }
}
