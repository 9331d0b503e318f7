//! Authorization as rows (issue 40): principals, their grants, service accounts, and the
//! `authz_changes` feed every API process tails to keep its projection in memory.
//!
//! A token says who someone is; these rows say what they may do. A principal with a row in
//! `authz_principals` is *managed*: its grants alone decide, its token's `roles` and `tenant`
//! claims no longer count. Every change writes one `authz_changes` row per principal it touched,
//! in its own transaction, and the readers re-read that principal's rows when the row arrives
//! ([`changes_after`], [`load`]). docs/security.md#grants has the rules; docs/database-locks.md
//! the locks, in this order: the idempotency key, the principal's row, the administrator
//! grants (id order, revocations of `admin` only), the scope's site or pool (`FOR KEY SHARE`),
//! the principal's event sinks.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{self, AuthzPayload, EventType, GrantView};
use crate::idempotency::{self, Actor, Claim, Outcome};
use crate::ids::{GrantId, ScopeId, ServiceAccountId, SinkId, TenantId};
use crate::outbox::{self, NewEvent};
use crate::page::{Page, PageArgs};
use crate::text_enum::text_enum;

/// The issuer of every service account's principal: no token issuer can be configured with it,
/// since it is not a URL or a name an identity provider would use, and the verifier refuses a
/// JWT that claims it.
pub const SERVICE_ACCOUNT_ISSUER: &str = "compute:service-account";

/// What a service account's bearer token starts with.
pub const SERVICE_ACCOUNT_TOKEN_PREFIX: &str = "cst_";

/// The longest a service account's token may live.
pub const MAX_SERVICE_ACCOUNT_SECONDS: i64 = 366 * 86_400;

text_enum!(
    /// A role a grant gives.
    GrantRole {
        /// Grants and service accounts, and everything an operator of the whole fleet may do.
        Admin = "admin",
        /// Manages the fleet, or only the site or pool of its scope.
        Operator = "operator",
        /// Reserves in its tenant and sees only its tenant's objects.
        Member = "member",
    }
);

/// An identity grants govern: a token's issuer and `sub`, or a service account.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Principal {
    pub issuer: String,
    pub subject: String,
}

impl Principal {
    /// Checks a principal given as input (`field` names the subject in errors).
    pub fn parse(field: &str, issuer: &str, subject: &str) -> Result<Principal> {
        let printable =
            |s: &str| !s.is_empty() && s.chars().count() <= 255 && !s.chars().any(char::is_control);
        if !printable(subject) {
            return Err(Error::bad_input(
                field,
                "a subject is 1 to 255 printable characters (a token's `sub`, or a service account's id)",
            ));
        }
        if !printable(issuer) {
            return Err(Error::bad_input(
                "issuer",
                "an issuer is 1 to 255 printable characters",
            ));
        }
        if issuer == SERVICE_ACCOUNT_ISSUER {
            ServiceAccountId::parse(field, subject)?;
        }
        Ok(Principal {
            issuer: issuer.to_owned(),
            subject: subject.to_owned(),
        })
    }

    /// A service account's principal.
    pub fn service_account(id: &ServiceAccountId) -> Principal {
        Principal {
            issuer: SERVICE_ACCOUNT_ISSUER.to_owned(),
            subject: id.as_str().to_owned(),
        }
    }
}

/// One grant.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub id: GrantId,
    pub issuer: String,
    pub subject: String,
    pub role: GrantRole,
    pub tenant_id: Option<TenantId>,
    pub scope_id: Option<ScopeId>,
    pub granted_by: String,
    pub granted_at: DateTime<Utc>,
}

impl From<&Grant> for GrantView {
    fn from(g: &Grant) -> Self {
        GrantView {
            id: g.id.clone(),
            issuer: g.issuer.clone(),
            subject: g.subject.clone(),
            role: g.role.as_str().to_owned(),
            tenant_id: g.tenant_id.clone(),
            scope_id: g.scope_id.clone(),
            granted_by: g.granted_by.clone(),
            granted_at: g.granted_at,
        }
    }
}

/// What a grant gives, as asked for (and as a revocation names the grant it takes away).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GrantSpec {
    #[serde(skip)]
    pub principal: Principal,
    pub role: GrantRole,
    pub tenant_id: Option<TenantId>,
    pub scope_id: Option<ScopeId>,
}

impl GrantSpec {
    /// A grant of `role` to `principal`, checking that the tenant and scope go with the role.
    pub fn new(
        principal: Principal,
        role: GrantRole,
        tenant_id: Option<TenantId>,
        scope_id: Option<ScopeId>,
    ) -> Result<GrantSpec> {
        let spec = GrantSpec {
            principal,
            role,
            tenant_id,
            scope_id,
        };
        spec.check()?;
        Ok(spec)
    }

    fn check(&self) -> Result<()> {
        match (self.role, &self.tenant_id) {
            (GrantRole::Member, None) => {
                return Err(Error::bad_input(
                    "tenantId",
                    "a member grant names its tenant (`tenantId`)",
                ));
            }
            (GrantRole::Admin | GrantRole::Operator, Some(_)) => {
                return Err(Error::bad_input(
                    "tenantId",
                    "only a member grant names a tenant",
                ));
            }
            _ => {}
        }
        if self.scope_id.is_some() && self.role != GrantRole::Operator {
            return Err(Error::bad_input(
                "scopeId",
                "only an operator grant can be limited to a site or a pool",
            ));
        }
        Ok(())
    }

    fn fingerprint(&self) -> serde_json::Value {
        serde_json::json!({
            "issuer": self.principal.issuer,
            "subject": self.principal.subject,
            "role": self.role.as_str(),
            "tenantId": self.tenant_id.as_ref().map(TenantId::as_str),
            "scopeId": self.scope_id.as_ref().map(ScopeId::as_str),
        })
    }
}

/// A service account, without its token.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceAccount {
    pub id: ServiceAccountId,
    pub name: String,
    pub expires_at: DateTime<Utc>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub revoked_by: Option<String>,
}

/// What `revoke` took away.
#[derive(Debug, Clone, PartialEq)]
pub struct Revoked {
    /// The grant deleted; `None` when the principal had none and was only made managed (its
    /// token's claims stopped counting), and on a replay (the row is gone: see `grant_id`).
    pub grant: Option<Grant>,
    /// The id of the grant deleted, on a replay too.
    pub grant_id: Option<GrantId>,
    /// The principal's event sinks paused because nothing it still holds covers them.
    pub paused_sinks: Vec<crate::ids::SinkId>,
}

fn grant_id(g: &Outcome<Revoked>) -> String {
    g.value
        .grant
        .as_ref()
        .map(|g| g.id.to_string())
        .unwrap_or_default()
}

macro_rules! query_grants {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            Grant,
            $head + r#" g.id AS "id: _", g.issuer, g.subject, g.role AS "role: _", g.tenant_id AS "tenant_id: _",
                       g.scope_id AS "scope_id: _", g.granted_by, g.granted_at "# + $tail
            $(, $arg)*
        )
    };
}

/// Marks the principal managed (if it was not) and locks its row: the first lock of every
/// change to a principal. Whether it was managed before.
async fn lock_principal(conn: &mut PgConnection, p: &Principal, by: &str) -> Result<bool> {
    Ok(sqlx::query_scalar!(
        r#"INSERT INTO authz_principals AS a (issuer, subject, managed_by) VALUES ($1, $2, $3)
           ON CONFLICT (issuer, subject) DO UPDATE SET managed_by = a.managed_by
           RETURNING (xmax <> 0) AS "was_managed!""#,
        p.issuer,
        p.subject,
        by,
    )
    .fetch_one(&mut *conn)
    .await?)
}

/// Writes the feed row that tells every reader to re-read `p`.
async fn changed(conn: &mut PgConnection, p: &Principal) -> Result<()> {
    sqlx::query!(
        "INSERT INTO authz_changes (issuer, subject) VALUES ($1, $2)",
        p.issuer,
        p.subject,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn emit_change(
    conn: &mut PgConnection,
    event_type: EventType,
    p: &Principal,
    grant: Option<&Grant>,
    by: &str,
) -> Result<()> {
    let subject = grant
        .map(|g| g.id.to_string())
        .unwrap_or_else(|| format!("{}|{}", p.issuer, p.subject));
    outbox::emit(
        conn,
        NewEvent {
            event_type,
            // Grants are the fleet's business: only operators see these events.
            tenant_id: None,
            subject: &subject,
            data: events::to_data(&AuthzPayload {
                issuer: p.issuer.clone(),
                subject: p.subject.clone(),
                grant: grant.map(GrantView::from),
                by: by.to_owned(),
            })?,
        },
    )
    .await?;
    Ok(())
}

/// Checks that the scope exists and keeps it while the grant is written.
async fn check_scope(conn: &mut PgConnection, scope: &ScopeId) -> Result<()> {
    let found = match scope {
        ScopeId::Pool(p) => {
            sqlx::query_scalar!(
                "SELECT 1 AS found FROM pools WHERE id = $1 FOR KEY SHARE",
                p.as_str()
            )
            .fetch_optional(&mut *conn)
            .await?
        }
        ScopeId::Site(s) => {
            sqlx::query_scalar!(
                "SELECT 1 AS found FROM sites WHERE id = $1 FOR KEY SHARE",
                s.as_str()
            )
            .fetch_optional(&mut *conn)
            .await?
        }
    };
    if found.is_none() {
        return Err(Error::bad_input(
            "scopeId",
            format!("no {} `{scope}` exists", scope.kind()),
        ));
    }
    Ok(())
}

async fn check_service_account(conn: &mut PgConnection, p: &Principal) -> Result<()> {
    if p.issuer != SERVICE_ACCOUNT_ISSUER {
        return Ok(());
    }
    let live = sqlx::query_scalar!(
        "SELECT 1 AS live FROM service_accounts WHERE id = $1 AND revoked_at IS NULL FOR KEY SHARE",
        p.subject,
    )
    .fetch_optional(&mut *conn)
    .await?;
    if live.is_none() {
        return Err(Error::bad_input(
            "subject",
            format!("no live service account `{}` exists", p.subject),
        ));
    }
    Ok(())
}

/// Inserts a grant (or finds the same one), in the caller's transaction, after the principal's
/// lock. `None` when the same grant already existed.
async fn insert_grant(
    conn: &mut PgConnection,
    spec: &GrantSpec,
    by: &str,
) -> Result<(Grant, bool)> {
    if let Some(scope) = &spec.scope_id {
        check_scope(conn, scope).await?;
    }
    let p = &spec.principal;
    let tenant = spec.tenant_id.as_ref().map(TenantId::as_str);
    let scope_kind = spec.scope_id.as_ref().map(ScopeId::kind);
    let scope_id = spec.scope_id.as_ref().map(ScopeId::as_str);
    let id = GrantId::generate();
    let inserted = query_grants!(
        "INSERT INTO authz_grants AS g (id, issuer, subject, role, tenant_id, scope_kind, scope_id, granted_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
         ON CONFLICT (issuer, subject, role, coalesce(tenant_id, ''), coalesce(scope_kind, ''), coalesce(scope_id, ''))
         DO NOTHING RETURNING",
        "",
        id.as_str(),
        p.issuer,
        p.subject,
        spec.role.as_str(),
        tenant,
        scope_kind,
        scope_id,
        by,
    )
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| {
        crate::error::on_constraint(
            e,
            &[("authz_grants_one_tenant", &|| Error::Conflict {
                message: format!(
                    "`{}` is already a member of another tenant: revoke that grant first",
                    p.subject
                ),
                current_version: None,
            })],
        )
    })?;
    if let Some(g) = inserted {
        return Ok((g, true));
    }
    let existing = query_grants!(
        "SELECT",
        "FROM authz_grants g WHERE g.issuer = $1 AND g.subject = $2 AND g.role = $3
           AND g.tenant_id IS NOT DISTINCT FROM $4 AND g.scope_id IS NOT DISTINCT FROM $5",
        p.issuer,
        p.subject,
        spec.role.as_str(),
        tenant,
        scope_id,
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok((existing, false))
}

/// What `grant` did: the grant, and the principal's event sinks it paused.
#[derive(Debug, Clone)]
pub struct Granted {
    pub grant: Grant,
    /// The principal's sinks its grants no longer cover: a first grant makes a principal
    /// managed, so what its token's claims gave (a sink of its claimed tenant, a fleet sink of
    /// a claimed operator) stops counting. Empty on a replay.
    pub paused_sinks: Vec<SinkId>,
}

/// Gives `spec.principal` a role. The same grant again is the grant that exists (no new row,
/// no event); with an idempotency key, a retry gets the same answer. The principal's event
/// sinks its grants do not cover are paused in the same transaction, as a revocation's are:
/// moving a member to another tenant stops its sinks of the first.
#[tracing::instrument(level = "debug", skip_all, fields(subject = %spec.principal.subject, role = %spec.role))]
pub async fn grant(
    db: &Db,
    actor: &Actor,
    spec: GrantSpec,
    idempotency_key: Option<String>,
) -> Result<Outcome<Granted>> {
    spec.check()?;
    let key = idempotency_key
        .map(|k| idempotency::parse_key("idempotencyKey", &k))
        .transpose()?;
    let outcome = db
        .tx("grant_role", TxKind::Write, |conn| {
            let (spec, key, actor) = (spec.clone(), key.clone(), actor.clone());
            Box::pin(async move {
                if let Some(key) = &key {
                    match idempotency::claim(conn, &actor, key, "grantRole", &spec.fingerprint())
                        .await?
                    {
                        Claim::New => {}
                        Claim::Refused(e) => return Ok(Err(e)),
                        Claim::Replay(id) => {
                            let value =
                                query_grants!("SELECT", "FROM authz_grants g WHERE g.id = $1", id)
                                    .fetch_optional(&mut *conn)
                                    .await?
                                    .ok_or_else(|| Error::NotFound {
                                        kind: "grant",
                                        id: id.clone(),
                                    })?;
                            return Ok(Ok(Outcome {
                                value: Granted {
                                    grant: value,
                                    paused_sinks: Vec::new(),
                                },
                                replayed: true,
                            }));
                        }
                    }
                }
                let made = async {
                    // The account row before the principal's, as its revocation takes them
                    // (docs/database-locks.md): the other way round, a grant holding the
                    // principal and a revocation holding the account waited on each other.
                    check_service_account(conn, &spec.principal).await?;
                    lock_principal(conn, &spec.principal, &actor.subject).await?;
                    let (grant, new) = insert_grant(conn, &spec, &actor.subject).await?;
                    let paused_sinks = crate::sinks::pause_uncovered(
                        conn,
                        &spec.principal.issuer,
                        &spec.principal.subject,
                        false,
                    )
                    .await?;
                    changed(conn, &spec.principal).await?;
                    if new {
                        emit_change(
                            conn,
                            EventType::AuthzGranted,
                            &spec.principal,
                            Some(&grant),
                            &actor.subject,
                        )
                        .await?;
                    }
                    Ok(Outcome {
                        value: Granted {
                            grant,
                            paused_sinks,
                        },
                        replayed: false,
                    })
                }
                .await;
                idempotency::settle(conn, &actor, key.as_deref(), made, |o| {
                    o.value.grant.id.to_string()
                })
                .await
            })
        })
        .await??;
    Ok(outcome)
}

/// Takes a role away. A principal that was not managed becomes managed, so its token's claims
/// stop counting (revoking a role its claims gave takes away everything the claims gave); a
/// managed principal without that grant is `NOT_FOUND`. The last administrator grant cannot
/// go (`CONFLICT`). The principal's event sinks that its remaining grants do not cover are
/// paused in the same transaction.
#[tracing::instrument(level = "debug", skip_all, fields(subject = %spec.principal.subject, role = %spec.role))]
pub async fn revoke(
    db: &Db,
    actor: &Actor,
    spec: GrantSpec,
    idempotency_key: Option<String>,
) -> Result<Outcome<Revoked>> {
    spec.check()?;
    let key = idempotency_key
        .map(|k| idempotency::parse_key("idempotencyKey", &k))
        .transpose()?;
    let outcome = db
        .tx("revoke_role", TxKind::Write, |conn| {
            let (spec, key, actor) = (spec.clone(), key.clone(), actor.clone());
            Box::pin(async move {
                if let Some(key) = &key {
                    match idempotency::claim(conn, &actor, key, "revokeRole", &spec.fingerprint())
                        .await?
                    {
                        Claim::New => {}
                        Claim::Refused(e) => return Ok(Err(e)),
                        Claim::Replay(id) => {
                            // The grant is gone; the replay says which one it was, as stored.
                            return Ok(Ok(Outcome {
                                value: Revoked {
                                    grant: None,
                                    grant_id: GrantId::parse("id", &id).ok(),
                                    paused_sinks: Vec::new(),
                                },
                                replayed: true,
                            }));
                        }
                    }
                }
                let done = revoke_in(conn, &spec, &actor.subject).await;
                idempotency::settle(conn, &actor, key.as_deref(), done, grant_id).await
            })
        })
        .await??;
    Ok(outcome)
}

async fn revoke_in(
    conn: &mut PgConnection,
    spec: &GrantSpec,
    by: &str,
) -> Result<Outcome<Revoked>> {
    let p = &spec.principal;
    let was_managed = lock_principal(conn, p, by).await?;
    if spec.role == GrantRole::Admin {
        // Every administrator grant, in id order: two revocations of the last two cannot both
        // see the other one left.
        sqlx::query_scalar!(
            r#"SELECT id AS "id!" FROM authz_grants WHERE role = 'admin' ORDER BY id FOR UPDATE"#
        )
        .fetch_all(&mut *conn)
        .await?;
    }
    let tenant = spec.tenant_id.as_ref().map(TenantId::as_str);
    let scope_id = spec.scope_id.as_ref().map(ScopeId::as_str);
    let deleted = query_grants!(
        "DELETE FROM authz_grants g WHERE g.issuer = $1 AND g.subject = $2 AND g.role = $3
           AND g.tenant_id IS NOT DISTINCT FROM $4 AND g.scope_id IS NOT DISTINCT FROM $5 RETURNING",
        "",
        p.issuer,
        p.subject,
        spec.role.as_str(),
        tenant,
        scope_id,
    )
    .fetch_optional(&mut *conn)
    .await?;
    if deleted.is_none() && was_managed {
        return Err(Error::NotFound {
            kind: "grant",
            id: format!(
                "{} {} of {}",
                spec.role,
                scope_id.or(tenant).unwrap_or("fleet"),
                p.subject
            ),
        });
    }
    if spec.role == GrantRole::Admin && deleted.is_some() {
        let left = sqlx::query_scalar!(
            r#"SELECT count(*) AS "n!" FROM authz_grants WHERE role = 'admin'"#
        )
        .fetch_one(&mut *conn)
        .await?;
        if left == 0 {
            return Err(Error::Conflict {
                message: "this is the last administrator grant: grant another administrator first"
                    .into(),
                current_version: None,
            });
        }
    }
    let paused_sinks = crate::sinks::pause_uncovered(conn, &p.issuer, &p.subject, false).await?;
    changed(conn, p).await?;
    emit_change(conn, EventType::AuthzRevoked, p, deleted.as_ref(), by).await?;
    Ok(Outcome {
        value: Revoked {
            grant_id: deleted.as_ref().map(|g| g.id.clone()),
            grant: deleted,
            paused_sinks,
        },
        replayed: false,
    })
}

/// What `list` filters on; `None` is any.
#[derive(Debug, Clone, Default)]
pub struct GrantFilter {
    pub principal: Option<Principal>,
    pub subject: Option<String>,
    pub tenant_id: Option<TenantId>,
    pub scope_id: Option<ScopeId>,
}

/// Grants by id.
pub async fn list(db: &Db, filter: &GrantFilter, page: &PageArgs) -> Result<Page<Grant>> {
    let rows = query_grants!(
        "SELECT",
        "FROM authz_grants g
          WHERE ($1::text IS NULL OR g.subject = $1) AND ($2::text IS NULL OR g.issuer = $2)
            AND ($3::text IS NULL OR g.tenant_id = $3) AND ($4::text IS NULL OR g.scope_id = $4)
            AND ($5::text IS NULL OR g.id > $5) AND ($6::text IS NULL OR g.id < $6)
          ORDER BY CASE WHEN $7 THEN g.id END DESC, g.id
          LIMIT $8",
        filter.subject.as_deref(),
        filter.principal.as_ref().map(|p| p.issuer.as_str()),
        filter.tenant_id.as_ref().map(TenantId::as_str),
        filter.scope_id.as_ref().map(ScopeId::as_str),
        page.after.as_deref(),
        page.before.as_deref(),
        page.backward,
        page.limit + 1,
    )
    .fetch_all(db.pool())
    .await?;
    Ok(Page::from_rows(rows, page))
}

/// How many grants `filter` matches.
pub async fn count(db: &Db, filter: &GrantFilter) -> Result<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM authz_grants g
            WHERE ($1::text IS NULL OR g.subject = $1) AND ($2::text IS NULL OR g.issuer = $2)
              AND ($3::text IS NULL OR g.tenant_id = $3) AND ($4::text IS NULL OR g.scope_id = $4)"#,
        filter.subject.as_deref(),
        filter.principal.as_ref().map(|p| p.issuer.as_str()),
        filter.tenant_id.as_ref().map(TenantId::as_str),
        filter.scope_id.as_ref().map(ScopeId::as_str),
    )
    .fetch_one(db.pool())
    .await?)
}

// ---- service accounts ----

fn token_digest(token: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
        .as_ref()
        .to_vec()
}

/// The SHA-256 of a service account's token, as stored and as the projection keys it.
pub fn token_hash(token: &str) -> [u8; 32] {
    let mut key = [0u8; 32];
    key.copy_from_slice(&token_digest(token));
    key
}

macro_rules! query_accounts {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            ServiceAccount,
            $head + r#" s.id AS "id: _", s.name, s.expires_at, s.created_by, s.created_at, s.revoked_at, s.revoked_by "# + $tail
            $(, $arg)*
        )
    };
}

/// Creates a service account whose token is valid for `valid_seconds`, with `grant` if given
/// (its principal is managed from the start: only its grants count). The token is returned
/// this once; only its SHA-256 is kept.
#[tracing::instrument(level = "debug", skip_all, fields(name = %name))]
pub async fn create_service_account(
    db: &Db,
    actor: &Actor,
    name: &str,
    valid_seconds: i64,
    grant: Option<(GrantRole, Option<TenantId>, Option<ScopeId>)>,
) -> Result<(ServiceAccount, Option<Grant>, String)> {
    if name.is_empty() || name.chars().count() > 100 || name.chars().any(char::is_control) {
        return Err(Error::bad_input(
            "name",
            "a service account's name is 1 to 100 printable characters",
        ));
    }
    if !(60..=MAX_SERVICE_ACCOUNT_SECONDS).contains(&valid_seconds) {
        return Err(Error::bad_input(
            "expiresInSeconds",
            format!("a service account's token lives 60 to {MAX_SERVICE_ACCOUNT_SECONDS} seconds"),
        ));
    }
    let id = ServiceAccountId::generate();
    let principal = Principal::service_account(&id);
    let spec = grant
        .map(|(role, tenant_id, scope_id)| {
            GrantSpec::new(principal.clone(), role, tenant_id, scope_id)
        })
        .transpose()?;
    let token = format!(
        "{SERVICE_ACCOUNT_TOKEN_PREFIX}{}",
        crate::process::random_hex(32)?
    );
    let hash = token_digest(&token);
    let (account, grant) = db
        .tx("create_service_account", TxKind::Write, |conn| {
            let (id, principal, spec, hash, actor) = (
                id.clone(),
                principal.clone(),
                spec.clone(),
                hash.clone(),
                actor.clone(),
            );
            let name = name.to_owned();
            Box::pin(async move {
                let account = query_accounts!(
                    "INSERT INTO service_accounts AS s (id, name, token_hash, expires_at, created_by)
                     VALUES ($1, $2, $3, compute_now() + make_interval(secs => $4), $5) RETURNING",
                    "",
                    id.as_str(),
                    name,
                    hash,
                    valid_seconds as f64,
                    actor.subject,
                )
                .fetch_one(&mut *conn)
                .await?;
                lock_principal(conn, &principal, &actor.subject).await?;
                let grant = match &spec {
                    Some(spec) => {
                        let (grant, _) = insert_grant(conn, spec, &actor.subject).await?;
                        emit_change(
                            conn,
                            EventType::AuthzGranted,
                            &principal,
                            Some(&grant),
                            &actor.subject,
                        )
                        .await?;
                        Some(grant)
                    }
                    None => None,
                };
                changed(conn, &principal).await?;
                Ok((account, grant))
            })
        })
        .await?;
    Ok((account, grant, token))
}

/// Revokes a service account's token for good and pauses its event sinks. Revoking it again is
/// the account as it is.
#[tracing::instrument(level = "debug", skip_all, fields(account = %id))]
pub async fn revoke_service_account(
    db: &Db,
    actor: &Actor,
    id: &ServiceAccountId,
) -> Result<ServiceAccount> {
    let account = db
        .tx("revoke_service_account", TxKind::Write, |conn| {
            let (id, actor) = (id.clone(), actor.clone());
            Box::pin(async move {
                let principal = Principal::service_account(&id);
                let account = query_accounts!(
                    "SELECT",
                    "FROM service_accounts s WHERE s.id = $1 FOR UPDATE",
                    id.as_str()
                )
                .fetch_optional(&mut *conn)
                .await?
                .ok_or_else(|| Error::NotFound {
                    kind: "service account",
                    id: id.to_string(),
                })?;
                if account.revoked_at.is_some() {
                    return Ok(account);
                }
                lock_principal(conn, &principal, &actor.subject).await?;
                let account = query_accounts!(
                    "UPDATE service_accounts AS s SET revoked_at = compute_now(), revoked_by = $2
                      WHERE s.id = $1 RETURNING",
                    "",
                    id.as_str(),
                    actor.subject,
                )
                .fetch_one(&mut *conn)
                .await?;
                crate::sinks::pause_uncovered(conn, &principal.issuer, &principal.subject, true)
                    .await?;
                changed(conn, &principal).await?;
                Ok(account)
            })
        })
        .await?;
    Ok(account)
}

/// Service accounts by id.
pub async fn list_service_accounts(db: &Db, page: &PageArgs) -> Result<Page<ServiceAccount>> {
    let rows = query_accounts!(
        "SELECT",
        "FROM service_accounts s
          WHERE ($1::text IS NULL OR s.id > $1) AND ($2::text IS NULL OR s.id < $2)
          ORDER BY CASE WHEN $3 THEN s.id END DESC, s.id
          LIMIT $4",
        page.after.as_deref(),
        page.before.as_deref(),
        page.backward,
        page.limit + 1,
    )
    .fetch_all(db.pool())
    .await?;
    Ok(Page::from_rows(rows, page))
}

/// How many service accounts there are.
pub async fn count_service_accounts(db: &Db) -> Result<i64> {
    Ok(
        sqlx::query_scalar!(r#"SELECT count(*) AS "n!" FROM service_accounts"#)
            .fetch_one(db.pool())
            .await?,
    )
}

// ---- the projection's reads ----

/// A position in `authz_changes`, as the outbox's cursor.
pub type FeedCursor = outbox::Cursor;

/// Everything a reader needs to decide for one principal.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrincipalRows {
    /// Whether it has a row in `authz_principals` (its grants alone decide).
    pub managed: bool,
    pub grants: Vec<Grant>,
    /// For a service account: its token's hash, when it expires, whether it is revoked.
    pub account: Option<AccountAuth>,
}

/// What authenticates a service account.
#[derive(Debug, Clone, PartialEq)]
pub struct AccountAuth {
    pub token_hash: Vec<u8>,
    pub expires_at: DateTime<Utc>,
    pub revoked: bool,
}

/// The feed's head: after the last change no running transaction can still precede. Read it
/// Pauses the event sinks of service accounts that expired (the reconciler's step, every pass):
/// an expired token holds nothing, as a revoked one (`revoke_service_account` pauses them in
/// its transaction; an expiry has no transaction of its own). One transaction per account,
/// the principal's row first as a revocation takes it (docs/database-locks.md), each paused
/// sink with its `event_sink.updated` event. Level-triggered: a sink re-activated later is
/// paused again at the next pass. How many sinks it paused.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn pause_sinks_of_expired_accounts(db: &Db) -> Result<u64> {
    let expired = sqlx::query_scalar!(
        r#"SELECT s.id AS "id: ServiceAccountId" FROM service_accounts s
            WHERE s.revoked_at IS NULL AND s.expires_at <= compute_now()
              AND EXISTS (SELECT 1 FROM event_sinks k WHERE k.created_by = s.id AND k.active)
            ORDER BY s.id LIMIT 100"#,
    )
    .fetch_all(db.pool())
    .await?;
    let mut paused = 0;
    for id in expired {
        let n = db
            .tx("pause_sinks_of_expired_account", TxKind::Maintenance, |conn| {
                let id = id.clone();
                Box::pin(async move {
                    let principal = Principal::service_account(&id);
                    // Its row only when it has one (locking it by an insert would make a
                    // principal managed).
                    sqlx::query!(
                        "SELECT 1 AS one FROM authz_principals WHERE issuer = $1 AND subject = $2 FOR UPDATE",
                        principal.issuer,
                        principal.subject,
                    )
                    .fetch_optional(&mut *conn)
                    .await?;
                    Ok(crate::sinks::pause_uncovered(conn, &principal.issuer, &principal.subject, true)
                        .await?
                        .len() as u64)
                })
            })
            .await?;
        if n > 0 {
            tracing::info!(account = %id, sinks = n, "paused the event sinks of an expired service account");
        }
        paused += n;
    }
    Ok(paused)
}

/// How long the `authz_changes` feed keeps a change: far past the projection's trust (10 s),
/// after which a process that could not read re-reads every principal instead of the feed.
pub const FEED_RETENTION_HOURS: i32 = 24;

/// Deletes the feed's changes older than [`FEED_RETENTION_HOURS`], only below the snapshot's
/// xmin (as the outbox's pruning: a row a reader could still be about to pass is kept). The
/// grants themselves are the rows of `authz_grants`; the feed only names who changed.
pub async fn prune(db: &Db) -> Result<u64> {
    let done = sqlx::query!(
        "DELETE FROM authz_changes
          WHERE at < compute_now() - make_interval(hours => $1)
            AND txid < pg_snapshot_xmin(pg_current_snapshot())",
        FEED_RETENTION_HOURS,
    )
    .execute(db.pool())
    .await?;
    Ok(done.rows_affected())
}

/// before [`load`] reads the rows, so the rows are at least as new as the cursor.
pub async fn head(db: &Db) -> Result<FeedCursor> {
    let row = sqlx::query!(
        r#"SELECT c.txid::text::bigint AS "txid!", c.seq FROM authz_changes c
            WHERE c.txid < pg_snapshot_xmin(pg_current_snapshot())
            ORDER BY c.txid DESC, c.seq DESC LIMIT 1"#
    )
    .fetch_optional(db.pool())
    .await?;
    Ok(row
        .map(|r| FeedCursor {
            txid: r.txid,
            seq: r.seq,
        })
        .unwrap_or(FeedCursor::START))
}

/// The rows of `who`, or of every principal when `who` is `None`.
pub async fn load(
    db: &Db,
    who: Option<&[Principal]>,
) -> Result<std::collections::HashMap<Principal, PrincipalRows>> {
    let all = who.is_none();
    let issuers: Vec<&str> = who
        .unwrap_or_default()
        .iter()
        .map(|p| p.issuer.as_str())
        .collect();
    let subjects: Vec<&str> = who
        .unwrap_or_default()
        .iter()
        .map(|p| p.subject.as_str())
        .collect();
    let mut out: std::collections::HashMap<Principal, PrincipalRows> = who
        .unwrap_or_default()
        .iter()
        .map(|p| (p.clone(), PrincipalRows::default()))
        .collect();
    let mut conn = db.pool().acquire().await?;
    let principals = sqlx::query!(
        r#"SELECT a.issuer, a.subject, s.token_hash AS "token_hash?", s.expires_at AS "expires_at?",
                  (s.revoked_at IS NOT NULL) AS "revoked?"
             FROM authz_principals a
             LEFT JOIN service_accounts s ON a.issuer = $4 AND s.id = a.subject
            WHERE $1 OR (a.issuer, a.subject) IN (SELECT * FROM unnest($2::text[], $3::text[]))"#,
        all,
        &issuers as &[&str],
        &subjects as &[&str],
        SERVICE_ACCOUNT_ISSUER,
    )
    .fetch_all(&mut *conn)
    .await?;
    for r in principals {
        let rows = out
            .entry(Principal {
                issuer: r.issuer,
                subject: r.subject,
            })
            .or_default();
        rows.managed = true;
        if let (Some(token_hash), Some(expires_at)) = (r.token_hash, r.expires_at) {
            rows.account = Some(AccountAuth {
                token_hash,
                expires_at,
                revoked: r.revoked.unwrap_or(true),
            });
        }
    }
    let grants = query_grants!(
        "SELECT",
        "FROM authz_grants g
          WHERE $1 OR (g.issuer, g.subject) IN (SELECT * FROM unnest($2::text[], $3::text[]))
          ORDER BY g.id",
        all,
        &issuers as &[&str],
        &subjects as &[&str],
    )
    .fetch_all(&mut *conn)
    .await?;
    for g in grants {
        let rows = out
            .entry(Principal {
                issuer: g.issuer.clone(),
                subject: g.subject.clone(),
            })
            .or_default();
        // A grant read after its principal's row appeared: managed (the rows are re-read when
        // the change that made them arrives).
        rows.managed = true;
        rows.grants.push(g);
    }
    Ok(out)
}

/// The feed after `after`: the principals changed (each once), and the cursor to read from
/// next, which passes only the changes no running transaction can still precede. Changes
/// committed behind a transaction still running are returned too (their principals are
/// re-read at once, and again when the cursor passes them), so a revocation is felt without
/// waiting for an unrelated long transaction to end.
pub async fn changes_after(db: &Db, after: FeedCursor) -> Result<(Vec<Principal>, FeedCursor)> {
    let rows = sqlx::query!(
        r#"SELECT c.txid::text::bigint AS "txid!", c.seq, c.issuer, c.subject,
                  (c.txid < pg_snapshot_xmin(pg_current_snapshot())) AS "settled!"
             FROM authz_changes c
            WHERE (c.txid, c.seq) > ($1::text::xid8, $2)
            ORDER BY c.txid, c.seq LIMIT 1000"#,
        after.txid.to_string(),
        after.seq,
    )
    .fetch_all(db.pool())
    .await?;
    let mut next = after;
    let mut settled = true;
    let mut changed = Vec::new();
    for r in rows {
        settled &= r.settled;
        if settled {
            next = FeedCursor {
                txid: r.txid,
                seq: r.seq,
            };
        }
        let p = Principal {
            issuer: r.issuer,
            subject: r.subject,
        };
        if !changed.contains(&p) {
            changed.push(p);
        }
    }
    Ok((changed, next))
}

/// Makes `subject` of `issuer` an administrator without a caller (the `grant-admin` command:
/// the first administrator of a deployment whose grants are the only source).
pub async fn bootstrap_admin(db: &Db, issuer: &str, subject: &str) -> Result<Grant> {
    let principal = Principal::parse("subject", issuer, subject)?;
    let actor = Actor::operator("compute-api grant-admin");
    Ok(grant(
        db,
        &actor,
        GrantSpec::new(principal, GrantRole::Admin, None, None)?,
        None,
    )
    .await?
    .value
    .grant)
}

/// What a scoped operator acts on: its pool and site are looked up to check its scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Site(crate::ids::SiteId),
    Pool(crate::ids::PoolId),
    Node(crate::ids::NodeId),
    Device(crate::ids::DeviceId),
    Command(crate::ids::CommandId),
    JoinToken(crate::ids::JoinTokenId),
}

/// The site and the pool (none for a site) `target` lies in; `None` when it does not exist.
/// Pools do not move between sites, nor nodes between pools, so the answer holds after the
/// read.
pub async fn place_of(
    db: &Db,
    target: &Target,
) -> Result<Option<(crate::ids::SiteId, Option<crate::ids::PoolId>)>> {
    use crate::ids::{PoolId, SiteId};
    let (kind, id) = match target {
        Target::Site(s) => return Ok(Some((s.clone(), None))),
        Target::Pool(p) => ("pool", p.as_str()),
        Target::Node(n) => ("node", n.as_str()),
        Target::Device(d) => ("device", d.as_str()),
        Target::Command(c) => ("command", c.as_str()),
        Target::JoinToken(t) => ("join_token", t.as_str()),
    };
    let row = sqlx::query!(
        r#"SELECT p.site_id AS "site_id: SiteId", p.id AS "pool_id: PoolId"
             FROM pools p
            WHERE p.id = CASE $1
                    WHEN 'pool' THEN $2
                    WHEN 'node' THEN (SELECT n.pool_id FROM nodes n WHERE n.id = $2)
                    WHEN 'device' THEN (SELECT n.pool_id FROM devices d JOIN nodes n ON n.id = d.node_id WHERE d.id = $2)
                    WHEN 'command' THEN (SELECT n.pool_id FROM commands c JOIN nodes n ON n.id = c.node_id WHERE c.id = $2)
                    WHEN 'join_token' THEN (SELECT t.pool_id FROM node_join_tokens t WHERE t.id = $2)
                  END"#,
        kind,
        id,
    )
    .fetch_optional(db.pool())
    .await?;
    Ok(row.map(|r| (r.site_id, Some(r.pool_id))))
}
