//! What every resolver reads from the request's context: the database, the caller, the coded
//! error mapping, the role checks and the side channels to the transports.
//!
//! Architecture invariant: a leaf of `graph`. It imports nothing from the rest of the API but
//! `auth`, so every resolver module can use it without forming a cycle.

use async_graphql::{Context, ErrorExtensions};
use compute_domain::actor::Actor;
use compute_domain::db::Db;
use compute_domain::{Error, ErrorCode};
use tracing::error;

use crate::auth::{Role, Viewer};

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

/// The error of every resolver, always coded. A domain error converts through [`gql_error`]
/// (its stable code); an `async_graphql::Error` converts only as it is when it carries a code
/// (one from `gql_error`, or a loader's), and otherwise becomes a logged `INTERNAL`. Nothing else
/// converts, so a bare `?` on any other error does not compile, and no resolver can produce an
/// uncoded error: an uncoded error in a response is async-graphql's own report of input it could
/// not coerce (`transport::prepare`).
#[derive(Debug, Clone)]
pub struct GqlError(async_graphql::Error);

/// The result of every resolver.
pub type GqlResult<T> = Result<T, GqlError>;

impl From<Error> for GqlError {
    fn from(e: Error) -> Self {
        gql_error(e)
    }
}

impl From<async_graphql::Error> for GqlError {
    fn from(e: async_graphql::Error) -> Self {
        let coded = e
            .extensions
            .as_ref()
            .is_some_and(|x| x.get("code").is_some());
        if coded {
            GqlError(e)
        } else {
            gql_error(Error::internal(format!(
                "an uncoded resolver error: {}",
                e.message
            )))
        }
    }
}

impl From<GqlError> for async_graphql::Error {
    fn from(e: GqlError) -> Self {
        e.0
    }
}

/// Turns a domain error into a GraphQL error with its stable `extensions.code`.
///
/// An internal error is logged here, once, with a fresh error id; the client gets `INTERNAL` and
/// the id, never the text.
pub fn gql_error(err: Error) -> GqlError {
    GqlError(coded(err))
}

fn coded(err: Error) -> async_graphql::Error {
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
    if code == ErrorCode::Unavailable {
        // The cause (a reset connection, a pool timeout) is ours to read, not the caller's.
        tracing::warn!(error = %err, source = ?std::error::Error::source(&err), "the database is unavailable");
    }
    let message = err.to_string();
    async_graphql::Error::new(message).extend_with(|_, e| {
        e.set("code", code.as_str());
        e.set("retryable", code.retryable());
        match &err {
            Error::BadUserInput {
                field: Some(field), ..
            } => e.set("field", field.clone()),
            Error::PolicyViolation { rule, limit, .. } => {
                e.set("rule", rule.clone());
                if let Ok(limit) = async_graphql::Value::from_json(limit.clone()) {
                    e.set("limit", limit);
                }
            }
            _ => {
                if let Some(v) = err.current_version() {
                    e.set("currentVersion", v);
                }
            }
        }
    })
}

/// The caller's identity, or `UNAUTHENTICATED`; `UNAVAILABLE` (retryable) while the grants
/// could not be read lately (`crate::authz`): no decision is made on old grants.
pub fn viewer<'a>(ctx: &'a Context<'_>) -> GqlResult<&'a Viewer> {
    let v = ctx.data_opt::<Viewer>().ok_or_else(|| {
        gql_error(Error::Unauthenticated(
            "this field needs a bearer token (Authorization: Bearer <jwt>)".into(),
        ))
    })?;
    if v.unavailable {
        return Err(gql_error(Error::Unavailable(
            "the grants could not be read from the database lately; retry the request".into(),
        )));
    }
    Ok(v)
}

/// The caller must be an administrator (grants and service accounts).
pub fn require_admin(ctx: &Context<'_>) -> GqlResult<()> {
    if viewer(ctx)?.has_role(Role::Admin) {
        Ok(())
    } else {
        Err(gql_error(Error::Forbidden(
            "this needs the admin role".into(),
        )))
    }
}

/// The caller must be an operator of the whole fleet, or of a site or pool that holds
/// `target`. A scoped operator is refused a target outside its scopes, and one that does not
/// exist (`FORBIDDEN` either way: its scope does not reveal what lies outside it).
pub async fn require_operator_on(
    ctx: &Context<'_>,
    target: compute_domain::authz::Target,
) -> GqlResult<()> {
    use compute_domain::ids::ScopeId;
    let v = viewer(ctx)?;
    if v.has_role(Role::Operator) {
        return Ok(());
    }
    if v.scopes.is_empty() {
        return Err(gql_error(Error::Forbidden(
            "this needs the operator role".into(),
        )));
    }
    let place = compute_domain::authz::place_of(db(ctx)?, &target).await?;
    let covered = place.is_some_and(|(site, pool)| {
        v.scopes.iter().any(|s| match s {
            ScopeId::Site(x) => *x == site,
            ScopeId::Pool(p) => pool.as_ref() == Some(p),
        })
    });
    if covered {
        Ok(())
    } else {
        Err(gql_error(Error::Forbidden(
            "your operator grant covers other sites or pools".into(),
        )))
    }
}

/// The caller as the domain sees it; `FORBIDDEN` for a token with neither the operator nor the
/// member role.
pub fn actor(ctx: &Context<'_>) -> GqlResult<Actor> {
    viewer(ctx)?.actor().ok_or_else(|| {
        gql_error(Error::Forbidden(
            "this needs the member or operator role".into(),
        ))
    })
}

/// The caller as the domain sees an operator's fleet change (its subject recorded, its
/// idempotency keys its own): call it after [`require_operator_on`] or [`require_operator`]
/// passed, so a scoped operator acts only inside its scope.
pub fn operator_actor(ctx: &Context<'_>) -> GqlResult<Actor> {
    let v = viewer(ctx)?;
    if !v.has_role(Role::Operator) && v.scopes.is_empty() {
        return Err(gql_error(Error::Forbidden(
            "this needs the operator role".into(),
        )));
    }
    // The tenant stays: an operator's idempotency scope includes it (`Actor::idempotency_scope`).
    Ok(Actor {
        subject: v.subject.clone(),
        authority: compute_domain::actor::Authority::Operator,
        tenant: v.tenant.clone(),
    })
}

/// The database handle of the schema.
pub fn db<'a>(ctx: &'a Context<'_>) -> GqlResult<&'a Db> {
    ctx.data::<Db>()
        .map_err(|_| gql_error(Error::internal("the schema was built without a database")))
}

/// The caller must hold a role that reads the fleet: a member, an operator (of the fleet or of
/// a site or pool) or an administrator. Whether it is an operator of the whole fleet (members
/// see the inventory's public face). A node daemon's token, and a subject whose grants give it
/// no role (revoked, or without a grant under `--authz grants`), are `FORBIDDEN`: they read
/// nothing on `/graphql` but `viewer` and `serverTime`.
pub fn require_viewer(ctx: &Context<'_>) -> GqlResult<bool> {
    let v = viewer(ctx)?;
    let reads = [Role::Admin, Role::Operator, Role::Member]
        .into_iter()
        .any(|r| v.has_role(r))
        || !v.scopes.is_empty();
    if reads {
        Ok(v.has_role(Role::Operator))
    } else {
        Err(gql_error(Error::Forbidden(
            "this needs the member or operator role: your token or grants give no role that reads the fleet".into(),
        )))
    }
}

/// The caller must be an operator.
pub fn require_operator(ctx: &Context<'_>) -> GqlResult<()> {
    let v = viewer(ctx)?;
    if v.has_role(Role::Operator) {
        Ok(())
    } else {
        Err(gql_error(Error::Forbidden(
            "this needs the operator role".into(),
        )))
    }
}

/// The tenant a listing shows: a member's own, whatever `requested`; for an operator
/// `requested` (checked), or every tenant when `None`. A member token without a tenant is
/// `FORBIDDEN`.
pub fn listing_tenant(
    ctx: &Context<'_>,
    requested: Option<String>,
) -> GqlResult<Option<compute_domain::ids::TenantId>> {
    match actor(ctx)?.visible_tenant() {
        Ok(Some(own)) => Ok(Some(own.clone())),
        Ok(None) => Ok(requested
            .map(|t| compute_domain::ids::TenantId::parse("tenantId", &t))
            .transpose()?),
        Err(_) => Err(gql_error(compute_domain::Error::Forbidden(
            "your token names no tenant".into(),
        ))),
    }
}

/// Whether the caller may see an object of `tenant` (its own tenant's, or any as an operator).
pub fn may_see(ctx: &Context<'_>, tenant: &compute_domain::ids::TenantId) -> GqlResult<bool> {
    Ok(viewer(ctx)?.actor().is_some_and(|a| a.may_access(tenant)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_internal_error_shows_its_id_never_its_text() {
        let GqlError(e) = gql_error(Error::internal("password=hunter2 in pg_hba.conf"));
        assert!(!e.message.contains("hunter2"), "{}", e.message);
        assert!(
            e.message.starts_with("internal error (id err_"),
            "{}",
            e.message
        );
        let ext = e.extensions.expect("extensions");
        assert_eq!(
            ext.get("code"),
            Some(&async_graphql::Value::from("INTERNAL"))
        );
        assert!(ext.get("errorId").is_some());
        // An uncoded async-graphql error (a bug of ours) becomes the same, text hidden.
        let GqlError(e) = GqlError::from(async_graphql::Error::new("raw detail"));
        assert!(!e.message.contains("raw detail"), "{}", e.message);
        // A coded one keeps its code and message.
        let GqlError(e) = gql_error(Error::bad_input("name", "too long"));
        assert!(e.message.contains("too long"));
        let ext = e.extensions.expect("extensions");
        assert_eq!(ext.get("field"), Some(&async_graphql::Value::from("name")));
    }
}
