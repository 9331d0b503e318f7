//! The GraphQL schema: types map from domain types, errors map to stable `extensions.code`.

use async_graphql::{Context, Enum, ErrorExtensions, MergedObject, Object, Schema, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::db::Db;
use compute_domain::{Error, ErrorCode};
use tracing::error;

use crate::auth::{Role, Viewer};

/// The schema type served by the API.
pub type ApiSchema = Schema<Query, Mutation, crate::events::SubscriptionRoot>;

/// The root of every query.
#[derive(MergedObject, Default)]
pub struct Query(
    CoreQuery,
    crate::fleet::FleetQuery,
    crate::reservations::ReservationQuery,
    crate::events::EventsQuery,
    crate::sinks::SinkQuery,
);

/// The root of every mutation.
#[derive(MergedObject, Default)]
pub struct Mutation(
    crate::fleet_mutations::FleetMutation,
    crate::reservations::ReservationMutation,
    crate::sinks::SinkMutation,
);

/// Set by a resolver that returns a stored idempotent response; the transport then adds
/// `extensions.idempotentReplay: true` to the response.
#[derive(Clone, Default)]
pub struct ReplayFlag(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl ReplayFlag {
    /// Marks the current request as a replay.
    pub fn mark(ctx: &Context<'_>) {
        if let Some(flag) = ctx.data_opt::<ReplayFlag>() {
            flag.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Whether a resolver marked it.
    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Builds the schema with the shared services every resolver reads. Without a database (for
/// printing the SDL) no resolver can run.
pub fn build(services: Option<(Db, crate::tailer::Tailer)>) -> ApiSchema {
    let mut builder = Schema::build(
        Query::default(),
        Mutation::default(),
        crate::events::SubscriptionRoot,
    )
    .register_output_type::<crate::fleet::NodeInterface>()
    .limit_depth(32)
    .limit_complexity(100_000);
    if let Some((db, tailer)) = services {
        builder = builder
            .data(crate::loaders::loaders(db.clone()))
            .data(db)
            .data(tailer);
    }
    builder.finish()
}

/// The SDL of the schema, as `compute-api schema` prints it and `schema.graphql` holds it.
pub fn sdl() -> String {
    build(None).sdl()
}

/// Turns a domain error into a GraphQL error with its stable `extensions.code`.
///
/// An internal error is logged here, once, with a fresh error id; the client gets `INTERNAL` and
/// the id, never the text.
pub fn gql_error(err: Error) -> async_graphql::Error {
    let code = err.code();
    if code == ErrorCode::Internal {
        let error_id = compute_domain::ids::new_id("err");
        error!(error.id = %error_id, error = %err, source = ?std::error::Error::source(&err), "internal error");
        return async_graphql::Error::new(format!("internal error (id {error_id})")).extend_with(
            |_, e| {
                e.set("code", code.as_str());
                e.set("errorId", error_id.clone());
            },
        );
    }
    let message = err.to_string();
    async_graphql::Error::new(message).extend_with(|_, e| {
        e.set("code", code.as_str());
        e.set("retryable", code.retryable());
        match &err {
            Error::BadUserInput {
                field: Some(field), ..
            } => e.set("field", field.clone()),
            Error::Conflict {
                current_version: Some(v),
                ..
            } => e.set("currentVersion", *v),
            _ => {}
        }
    })
}

/// The caller's identity, or `UNAUTHENTICATED`.
pub fn viewer<'a>(ctx: &'a Context<'_>) -> async_graphql::Result<&'a Viewer> {
    ctx.data_opt::<Viewer>().ok_or_else(|| {
        gql_error(Error::Unauthenticated(
            "this field needs a bearer token (Authorization: Bearer <jwt>)".into(),
        ))
    })
}

/// The database handle of the schema.
pub fn db<'a>(ctx: &'a Context<'_>) -> async_graphql::Result<&'a Db> {
    ctx.data::<Db>()
        .map_err(|_| gql_error(Error::internal("the schema was built without a database")))
}

/// The core queries: who is calling, and what time it is.
#[derive(Default)]
pub struct CoreQuery;

#[Object]
impl CoreQuery {
    /// The caller, as the API sees them: identity, tenant and roles from the bearer token.
    async fn viewer(&self, ctx: &Context<'_>) -> async_graphql::Result<ViewerInfo> {
        let v = viewer(ctx)?;
        Ok(ViewerInfo {
            subject: v.subject.clone(),
            tenant_id: v.tenant.clone(),
            roles: v.roles.iter().map(|r| GqlRole::from(*r)).collect(),
            expires_at: DateTime::from_timestamp(v.expires_at, 0).unwrap_or_default(),
        })
    }

    /// Business time: `compute_now()`, the one clock every time comparison reads.
    async fn server_time(&self, ctx: &Context<'_>) -> async_graphql::Result<DateTime<Utc>> {
        db(ctx)?.compute_now().await.map_err(gql_error)
    }
}

/// The caller of a request.
#[derive(SimpleObject)]
struct ViewerInfo {
    /// The identity (`sub`) of the bearer token.
    subject: String,
    /// The tenant the caller acts for; operators may have none.
    tenant_id: Option<String>,
    /// The roles of the token that this API knows.
    roles: Vec<GqlRole>,
    /// When the bearer token expires.
    expires_at: DateTime<Utc>,
}

/// What a caller may do.
#[derive(Enum, Clone, Copy, PartialEq, Eq)]
#[graphql(name = "Role")]
enum GqlRole {
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
            Role::Operator => GqlRole::Operator,
            Role::Member => GqlRole::Member,
            Role::Node => GqlRole::Node,
        }
    }
}
