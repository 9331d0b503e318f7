//! Grants and service accounts in the graph (administrators only): `grantRole`, `revokeRole`,
//! `grants`, `createServiceAccount`, `revokeServiceAccount`, `serviceAccounts`
//! (docs/security.md#grants).

use async_graphql::connection::Connection;
use async_graphql::{Context, Enum, ID, InputObject, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::authz::{
    self, Grant, GrantFilter, GrantRole, GrantSpec, Principal, ServiceAccount,
};
use compute_domain::ids::{ScopeId, ServiceAccountId, TenantId};

use crate::auth::TokenIssuer;
use crate::graph::common::{connection, gql_id, page_request};
use crate::graph::{GqlResult, ReplayFlag, db, operator_actor, require_admin};

/// A role a grant gives.
#[derive(Enum, Clone, Copy, PartialEq, Eq)]
#[graphql(name = "GrantRole", remote = "compute_domain::authz::GrantRole")]
pub enum GqlGrantRole {
    /// Grants and service accounts, and everything an operator of the whole fleet may do.
    Admin,
    /// Manages the fleet, or only the site or pool of its scope.
    Operator,
    /// Reserves in its tenant and sees only its tenant's objects.
    Member,
}

/// A role given to a principal: a token's subject, or a service account.
pub struct GrantObj(Grant);

/// A role given to a principal: a token's subject, or a service account.
#[Object(name = "Grant")]
impl GrantObj {
    /// The grant's id (`grt_…`).
    async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// The principal's subject: a token's `sub`, or a service account's id.
    async fn subject(&self) -> &str {
        &self.0.subject
    }
    /// Who vouches for the subject: the token issuer, or `compute:service-account`.
    async fn issuer(&self) -> &str {
        &self.0.issuer
    }
    /// The role.
    async fn role(&self) -> GqlGrantRole {
        self.0.role.into()
    }
    /// The tenant of a member grant.
    async fn tenant_id(&self) -> Option<&str> {
        self.0.tenant_id.as_ref().map(TenantId::as_str)
    }
    /// The site or pool an operator grant is limited to; null for the whole fleet.
    async fn scope_id(&self) -> Option<&str> {
        self.0.scope_id.as_ref().map(ScopeId::as_str)
    }
    /// Who granted it.
    async fn granted_by(&self) -> &str {
        &self.0.granted_by
    }
    /// When it was granted.
    async fn granted_at(&self) -> DateTime<Utc> {
        self.0.granted_at
    }
}

/// An identity for a program, with a token of its own.
pub struct ServiceAccountObj(ServiceAccount);

/// An identity for a program (a CI system, a billing exporter), with a token of its own.
#[Object(name = "ServiceAccount")]
impl ServiceAccountObj {
    /// Its id (`sa_…`): the subject its grants name.
    async fn id(&self) -> ID {
        gql_id(&self.0.id)
    }
    /// What it is for.
    async fn name(&self) -> &str {
        &self.0.name
    }
    /// When its token stops working.
    async fn expires_at(&self) -> DateTime<Utc> {
        self.0.expires_at
    }
    /// Who made it.
    async fn created_by(&self) -> &str {
        &self.0.created_by
    }
    /// When it was made.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
    }
    /// When its token was revoked, if it was.
    async fn revoked_at(&self) -> Option<DateTime<Utc>> {
        self.0.revoked_at
    }
    /// Who revoked it.
    async fn revoked_by(&self) -> Option<&str> {
        self.0.revoked_by.as_deref()
    }
}

/// `totalCount` of the grants connection.
pub struct GrantCount(GrantFilter);

/// `totalCount` of the grants connection.
#[Object]
impl GrantCount {
    /// How many grants match, across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> GqlResult<i64> {
        Ok(authz::count(db(ctx)?, &self.0).await?)
    }
}

/// `totalCount` of the service accounts connection.
#[derive(Default)]
pub struct ServiceAccountCount;

/// `totalCount` of the service accounts connection.
#[Object]
impl ServiceAccountCount {
    /// How many service accounts there are, revoked ones included.
    async fn total_count(&self, ctx: &Context<'_>) -> GqlResult<i64> {
        Ok(authz::count_service_accounts(db(ctx)?).await?)
    }
}

/// The principal a grant input names: a service account by its id, or a token's subject of
/// `issuer` (this server's token issuer by default).
fn principal(ctx: &Context<'_>, subject: &str, issuer: Option<&str>) -> GqlResult<Principal> {
    let issuer = match issuer {
        Some(i) => i.to_owned(),
        None if ServiceAccountId::parse("subject", subject).is_ok() => {
            authz::SERVICE_ACCOUNT_ISSUER.to_owned()
        }
        None => ctx
            .data_opt::<TokenIssuer>()
            .map(|i| i.0.clone())
            .unwrap_or_default(),
    };
    Ok(Principal::parse("subject", &issuer, subject)?)
}

fn spec(
    ctx: &Context<'_>,
    subject: &str,
    issuer: Option<&str>,
    role: GqlGrantRole,
    tenant_id: Option<&str>,
    scope_id: Option<&str>,
) -> GqlResult<GrantSpec> {
    Ok(GrantSpec::new(
        principal(ctx, subject, issuer)?,
        role.into(),
        tenant_id
            .map(|t| TenantId::parse("tenantId", t))
            .transpose()?,
        scope_id.map(|s| ScopeId::parse("scopeId", s)).transpose()?,
    )?)
}

/// The grant queries (administrators only).
#[derive(Default)]
pub struct GrantQuery;

/// The grant queries (administrators only).
#[Object]
impl GrantQuery {
    /// Grants, by id; administrators only.
    #[allow(
        clippy::too_many_arguments,
        reason = "a GraphQL field's arguments: its filters and the four Relay page arguments"
    )]
    async fn grants(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only this subject's (a token's `sub` or a service account's id).")]
        subject: Option<String>,
        #[graphql(desc = "Only this tenant's member grants.")] tenant_id: Option<String>,
        #[graphql(desc = "Only operator grants limited to this site or pool.")] scope_id: Option<
            String,
        >,
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
    ) -> GqlResult<Connection<String, GrantObj, GrantCount>> {
        require_admin(ctx)?;
        let filter = GrantFilter {
            principal: None,
            subject: subject
                .map(|s| Principal::parse("subject", "any", &s).map(|p| p.subject))
                .transpose()?,
            tenant_id: tenant_id
                .map(|t| TenantId::parse("tenantId", &t))
                .transpose()?,
            scope_id: scope_id
                .map(|s| ScopeId::parse("scopeId", &s))
                .transpose()?,
        };
        let args = page_request(first, after, last, before).resolve()?;
        let page = authz::list(db(ctx)?, &filter, &args).await?;
        Ok(connection(
            page,
            GrantCount(filter),
            |g| g.id.as_str(),
            GrantObj,
        ))
    }

    /// Service accounts, by id; administrators only.
    async fn service_accounts(
        &self,
        ctx: &Context<'_>,
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
    ) -> GqlResult<Connection<String, ServiceAccountObj, ServiceAccountCount>> {
        require_admin(ctx)?;
        let args = page_request(first, after, last, before).resolve()?;
        let page = authz::list_service_accounts(db(ctx)?, &args).await?;
        Ok(connection(
            page,
            ServiceAccountCount,
            |a| a.id.as_str(),
            ServiceAccountObj,
        ))
    }
}

/// The arguments of `grantRole`.
#[derive(InputObject)]
pub struct GrantRoleInput {
    /// A token's `sub`, or a service account's id (`sa_…`).
    subject: String,
    /// The subject's token issuer; this server's issuer by default (`compute:service-account`
    /// for a service account's id).
    issuer: Option<String>,
    /// The role.
    role: GqlGrantRole,
    /// The tenant of a member grant (required for `MEMBER`, refused otherwise).
    tenant_id: Option<String>,
    /// Limits an operator grant to this site or pool.
    scope_id: Option<String>,
    /// Makes a retry safe: the same key and arguments get the same answer.
    idempotency_key: Option<String>,
}

/// The grant given.
#[derive(SimpleObject)]
pub struct GrantRolePayload {
    /// The grant (the one that existed when the same grant was given before).
    grant: GrantObj,
    /// The subject's event sinks paused because its grants do not cover them: its first grant
    /// makes it managed, and what its token's claims gave stops counting (empty on a replay).
    paused_event_sink_ids: Vec<ID>,
    /// Whether this is the stored answer to an earlier request with the same idempotency key.
    idempotent_replay: bool,
}

/// The arguments of `revokeRole`: the grant it takes away, as it was given.
#[derive(InputObject)]
pub struct RevokeRoleInput {
    /// A token's `sub`, or a service account's id.
    subject: String,
    /// The subject's token issuer; this server's by default.
    issuer: Option<String>,
    /// The role.
    role: GqlGrantRole,
    /// The tenant of a member grant.
    tenant_id: Option<String>,
    /// The site or pool of a limited operator grant.
    scope_id: Option<String>,
    /// Makes a retry safe: the same key and arguments get the same answer.
    idempotency_key: Option<String>,
}

/// What was taken away.
#[derive(SimpleObject)]
pub struct RevokeRolePayload {
    /// The id of the grant deleted; null when the subject had no grants and its token's claims
    /// stopped counting (it is managed now).
    revoked_grant_id: Option<ID>,
    /// The subject's event sinks paused because its remaining grants do not cover them.
    paused_event_sink_ids: Vec<ID>,
    /// Whether this is the stored answer to an earlier request with the same idempotency key.
    idempotent_replay: bool,
}

/// The arguments of `createServiceAccount`.
#[derive(InputObject)]
pub struct CreateServiceAccountInput {
    /// What it is for, 1 to 100 characters.
    name: String,
    /// How long its token lives, 60 seconds to 366 days.
    expires_in_seconds: i64,
    /// A role to grant it at once (more with `grantRole`).
    role: Option<GqlGrantRole>,
    /// The tenant of a member role.
    tenant_id: Option<String>,
    /// Limits an operator role to this site or pool.
    scope_id: Option<String>,
}

/// A new service account and its token, shown this once.
#[derive(SimpleObject)]
pub struct CreateServiceAccountPayload {
    /// The account.
    service_account: ServiceAccountObj,
    /// The grant made with it, if a role was given.
    grant: Option<GrantObj>,
    /// Its bearer token (`cst_…`). Store it now: only its hash is kept.
    token: String,
}

/// The arguments of `revokeServiceAccount`.
#[derive(InputObject)]
pub struct RevokeServiceAccountInput {
    /// The account (`sa_…`).
    id: ID,
}

/// The account revoked.
#[derive(SimpleObject)]
pub struct RevokeServiceAccountPayload {
    /// The account, with `revokedAt` set.
    service_account: ServiceAccountObj,
}

/// The grant mutations (administrators only).
#[derive(Default)]
pub struct GrantMutation;

/// The grant mutations (administrators only).
#[Object]
impl GrantMutation {
    /// Gives a subject a role (administrators only). A subject with grants is governed by its
    /// grants alone: its token's `roles` and `tenant` no longer count. The same grant twice is
    /// one grant.
    async fn grant_role(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `grantRole`.")] input: GrantRoleInput,
    ) -> GqlResult<GrantRolePayload> {
        require_admin(ctx)?;
        let spec = spec(
            ctx,
            &input.subject,
            input.issuer.as_deref(),
            input.role,
            input.tenant_id.as_deref(),
            input.scope_id.as_deref(),
        )?;
        let outcome =
            authz::grant(db(ctx)?, &operator_actor(ctx)?, spec, input.idempotency_key).await?;
        if outcome.replayed {
            ReplayFlag::mark(ctx);
        }
        Ok(GrantRolePayload {
            grant: GrantObj(outcome.value.grant),
            paused_event_sink_ids: outcome.value.paused_sinks.iter().map(gql_id).collect(),
            idempotent_replay: outcome.replayed,
        })
    }

    /// Takes a role away (administrators only); every API process refuses what it covered
    /// within a second, and closes the subject's subscriptions it no longer covers. A subject
    /// without grants loses what its token's claims gave. The last administrator grant cannot
    /// go (`CONFLICT`).
    async fn revoke_role(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `revokeRole`.")] input: RevokeRoleInput,
    ) -> GqlResult<RevokeRolePayload> {
        require_admin(ctx)?;
        let spec = spec(
            ctx,
            &input.subject,
            input.issuer.as_deref(),
            input.role,
            input.tenant_id.as_deref(),
            input.scope_id.as_deref(),
        )?;
        let outcome =
            authz::revoke(db(ctx)?, &operator_actor(ctx)?, spec, input.idempotency_key).await?;
        if outcome.replayed {
            ReplayFlag::mark(ctx);
        }
        Ok(RevokeRolePayload {
            revoked_grant_id: outcome.value.grant_id.as_ref().map(gql_id),
            paused_event_sink_ids: outcome.value.paused_sinks.iter().map(gql_id).collect(),
            idempotent_replay: outcome.replayed,
        })
    }

    /// Makes a service account and returns its token once (administrators only).
    async fn create_service_account(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `createServiceAccount`.")]
        input: CreateServiceAccountInput,
    ) -> GqlResult<CreateServiceAccountPayload> {
        require_admin(ctx)?;
        let grant = match input.role {
            Some(role) => Some((
                GrantRole::from(role),
                input
                    .tenant_id
                    .as_deref()
                    .map(|t| TenantId::parse("tenantId", t))
                    .transpose()?,
                input
                    .scope_id
                    .as_deref()
                    .map(|s| ScopeId::parse("scopeId", s))
                    .transpose()?,
            )),
            None if input.tenant_id.is_some() || input.scope_id.is_some() => {
                return Err(compute_domain::Error::bad_input(
                    "role",
                    "`tenantId` and `scopeId` go with a `role`",
                )
                .into());
            }
            None => None,
        };
        let (account, grant, token) = authz::create_service_account(
            db(ctx)?,
            &operator_actor(ctx)?,
            &input.name,
            input.expires_in_seconds,
            grant,
        )
        .await?;
        Ok(CreateServiceAccountPayload {
            service_account: ServiceAccountObj(account),
            grant: grant.map(GrantObj),
            token,
        })
    }

    /// Revokes a service account's token for good and pauses its event sinks (administrators
    /// only). Revoking it again returns it as it is.
    async fn revoke_service_account(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `revokeServiceAccount`.")]
        input: RevokeServiceAccountInput,
    ) -> GqlResult<RevokeServiceAccountPayload> {
        require_admin(ctx)?;
        let id = ServiceAccountId::parse("id", input.id.as_str())?;
        let account = authz::revoke_service_account(db(ctx)?, &operator_actor(ctx)?, &id).await?;
        Ok(RevokeServiceAccountPayload {
            service_account: ServiceAccountObj(account),
        })
    }
}
