//! Enrollment: a machine joins the fleet by itself (`docs/nodes.md`, "Enrollment").
//!
//! An operator makes a one-time join token for a pool ([`create_join_token`]); its secret is
//! shown once and stored only as a SHA-256 digest. The node daemon sends the secret with the
//! machine's inventory (`join` in `compute-agent.v1`); [`join`] registers the node from the
//! inventory in the same transaction that uses the token, and makes the node's credential, which
//! opens its sessions from then on ([`credential_opens`]). Retiring the node revokes it.
//!
//! Lock order (`docs/database-locks.md`): the token row first (the guarded `UPDATE` that uses
//! it: a second machine racing for the same token waits for the first's transaction and then
//! finds it used), then registration's order (pool `FOR NO KEY UPDATE`, the node, its devices, its
//! resources, the rollup), the credential row last.

mod payload;
use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{self, EventType, JoinTokenPayload};
use crate::fleet::changes::{NewDevice, NewNode, Registered, register_in};
use crate::fleet::model::{self as m, DeviceMode, GpuUuid, Labels, Layout};
use crate::idempotency::{self, Actor, Claim, Outcome};
use crate::ids::{JoinTokenId, NodeId, PoolId};
use crate::outbox::{self, NewEvent};
use crate::page::{Page, PageArgs};
use compute_protocol::Inventory;

/// The prefix of a join token's secret.
pub const JOIN_SECRET_PREFIX: &str = "cjt_";
/// The prefix of a node credential.
pub const CREDENTIAL_PREFIX: &str = "cnc_";
/// The shortest and longest life of a join token, in seconds (one minute, 30 days).
pub const TOKEN_LIFE_SECONDS: (i64, i64) = (60, 30 * 86_400);

/// A join token as operators see it (never its secret).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct JoinToken {
    pub id: JoinTokenId,
    pub pool_id: PoolId,
    pub labels: Json<Labels>,
    pub expires_at: DateTime<Utc>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
    pub used_at: Option<DateTime<Utc>>,
    /// The node that joined with it.
    pub node_id: Option<NodeId>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub revoked_by: Option<String>,
    /// `active`, `used`, `revoked` or `expired`, by the database's clock.
    pub state: String,
}

const TOKEN_COLS: &str = "t.id, t.pool_id, t.labels, t.expires_at, t.created_by, t.created_at, \
     t.used_at, t.node_id, t.revoked_at, t.revoked_by, \
     CASE WHEN t.used_at IS NOT NULL THEN 'used' WHEN t.revoked_at IS NOT NULL THEN 'revoked' \
          WHEN t.expires_at <= compute_now() THEN 'expired' ELSE 'active' END AS state";

/// A checked `query_as!` of [`JoinToken`]s: `$head` + the columns of `t` (the table, or a
/// `WITH t AS (… RETURNING *)`) + `$tail`; the same columns as [`TOKEN_COLS`], which the
/// listing's dynamic builder uses. Columns that cannot be null are marked `!`, because the
/// database cannot tell through a `WITH`.
macro_rules! query_tokens {
    ($head:literal, $tail:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            JoinToken,
            $head
                + r#" t.id AS "id!: _", t.pool_id AS "pool_id!: _", t.labels AS "labels!: _",
                     t.expires_at AS "expires_at!", t.created_by AS "created_by!", t.created_at AS "created_at!",
                     t.used_at, t.node_id AS "node_id: _", t.revoked_at, t.revoked_by,
                     CASE WHEN t.used_at IS NOT NULL THEN 'used' WHEN t.revoked_at IS NOT NULL THEN 'revoked'
                          WHEN t.expires_at <= compute_now() THEN 'expired' ELSE 'active' END AS "state!" "#
                + $tail
            $(, $arg)*
        )
    };
}

/// The input of [`create_join_token`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct NewJoinToken {
    pub pool_id: PoolId,
    pub expires_in_seconds: i64,
    pub labels: Labels,
}

/// A token just made: its secret, shown once (`None` when a retry replays the creation: the
/// secret is not kept, so a lost one is revoked and made again).
#[derive(Debug, Clone)]
pub struct CreatedToken {
    pub token: JoinToken,
    pub secret: Option<String>,
}

/// 32 random bytes from the operating system, hex, after `prefix`.
fn new_secret(prefix: &str) -> Result<String> {
    Ok(format!("{prefix}{}", crate::process::random_hex(32)?))
}

/// Whether `s` has the shape of a secret with `prefix` (64 lowercase hex digits after it).
fn well_formed(prefix: &str, s: &str) -> bool {
    s.strip_prefix(prefix).is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

fn digest(secret: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, secret.as_bytes())
        .as_ref()
        .to_vec()
}

async fn emit_token(conn: &mut PgConnection, event: EventType, token: &JoinToken) -> Result<()> {
    outbox::emit(
        conn,
        NewEvent {
            event_type: event,
            tenant_id: None,
            subject: token.id.as_str(),
            data: events::to_data(&JoinTokenPayload::of(token))?,
        },
    )
    .await?;
    Ok(())
}

async fn load(conn: &mut PgConnection, id: &str) -> Result<Option<JoinToken>> {
    Ok(
        query_tokens!("SELECT", "FROM node_join_tokens t WHERE t.id = $1", id)
            .fetch_optional(&mut *conn)
            .await?,
    )
}

/// Makes a one-time join token for a pool, valid `expires_in_seconds`; with an idempotency key,
/// a retry returns the same token (without its secret).
#[tracing::instrument(level = "debug", skip_all, fields(pool = %input.pool_id))]
pub async fn create_join_token(
    db: &Db,
    actor: &Actor,
    input: NewJoinToken,
    idempotency_key: Option<String>,
) -> Result<Outcome<CreatedToken>> {
    let (min, max) = TOKEN_LIFE_SECONDS;
    if !(min..=max).contains(&input.expires_in_seconds) {
        return Err(Error::bad_input(
            "expiresInSeconds",
            format!("a join token lives from {min} to {max} seconds"),
        ));
    }
    let key = idempotency_key
        .map(|k| idempotency::parse_key("idempotencyKey", &k))
        .transpose()?;
    let request = serde_json::to_value(&input).map_err(Error::internal)?;
    let id = JoinTokenId::generate();
    let secret = new_secret(JOIN_SECRET_PREFIX)?;
    db.tx("create_join_token", TxKind::Write, |conn| {
        let (actor, key, request, input, id, secret) = (
            actor.clone(),
            key.clone(),
            request.clone(),
            input.clone(),
            id.clone(),
            secret.clone(),
        );
        Box::pin(async move {
            if let Some(key) = &key {
                match idempotency::claim(conn, &actor, key, "createNodeJoinToken", &request).await? {
                    Claim::New => {}
                    Claim::Refused(e) => return Ok(Err(e)),
                    Claim::Replay(id) => {
                        let token = load(conn, &id).await?.ok_or_else(|| {
                            Error::internal("a stored createNodeJoinToken names a missing token")
                        })?;
                        return Ok(Ok(Outcome {
                            value: CreatedToken {
                                token,
                                secret: None,
                            },
                            replayed: true,
                        }));
                    }
                }
            }
            let created = async {
                // The pool FOR KEY SHARE by the foreign key; its absence is NOT_FOUND.
                let token: Option<JoinToken> = query_tokens!(
                    "WITH t AS (INSERT INTO node_join_tokens (id, pool_id, secret_sha256, labels, expires_at, created_by) \
                     SELECT $1, p.id, $3, $4, compute_now() + make_interval(secs => $5), $6 FROM pools p WHERE p.id = $2 \
                     RETURNING *) SELECT",
                    "FROM t",
                    id.as_str(),
                    input.pool_id.as_str(),
                    &digest(&secret)[..],
                    Json(&input.labels) as _,
                    input.expires_in_seconds as f64,
                    actor.subject,
                )
                .fetch_optional(&mut *conn)
                .await?;
                let token = token.ok_or_else(|| Error::NotFound {
                    kind: "pool",
                    id: input.pool_id.to_string(),
                })?;
                emit_token(conn, EventType::JoinTokenCreated, &token).await?;
                Ok(Outcome {
                    value: CreatedToken {
                        token,
                        secret: Some(secret.clone()),
                    },
                    replayed: false,
                })
            }
            .await;
            idempotency::settle(conn, &actor, key.as_deref(), created, |o| {
                o.value.token.id.to_string()
            })
            .await
        })
    })
    .await?
}

/// Revokes a join token that was not used. Revoking a revoked or expired one returns it as it
/// is; a used one is `CONFLICT` (retire the node instead).
#[tracing::instrument(level = "debug", skip_all, fields(token = %id))]
pub async fn revoke_join_token(db: &Db, actor: &Actor, id: &JoinTokenId) -> Result<JoinToken> {
    db.tx("revoke_join_token", TxKind::Write, |conn| {
        let (id, by) = (id.clone(), actor.subject.clone());
        Box::pin(async move {
            let revoked: Option<JoinToken> = query_tokens!(
                "WITH t AS (UPDATE node_join_tokens SET revoked_at = compute_now(), revoked_by = $2 \
                  WHERE id = $1 AND used_at IS NULL AND revoked_at IS NULL AND expires_at > compute_now() RETURNING *) \
                 SELECT",
                "FROM t",
                id.as_str(),
                by,
            )
            .fetch_optional(&mut *conn)
            .await?;
            if let Some(token) = revoked {
                emit_token(conn, EventType::JoinTokenRevoked, &token).await?;
                return Ok(token);
            }
            match load(conn, id.as_str()).await? {
                None => Err(Error::NotFound {
                    kind: "join token",
                    id: id.to_string(),
                }),
                Some(t) if t.used_at.is_some() => Err(Error::Conflict {
                    message: format!(
                        "join token {id} was used by node {}; retire the node to take it out of the fleet",
                        t.node_id.as_ref().map_or("?", NodeId::as_str)
                    ),
                    current_version: None,
                }),
                Some(t) => Ok(t),
            }
        })
    })
    .await
}

/// Which join tokens a listing shows.
#[derive(Debug, Clone, Default)]
pub struct JoinTokenFilter {
    pub pool_id: Option<PoolId>,
}

/// A page of join tokens, in id (creation) order.
pub async fn list_join_tokens(
    db: &Db,
    filter: &JoinTokenFilter,
    page: &PageArgs,
) -> Result<Page<JoinToken>> {
    let mut qb = sqlx::QueryBuilder::new(format!(
        "SELECT {TOKEN_COLS} FROM node_join_tokens t WHERE true"
    ));
    if let Some(pool) = &filter.pool_id {
        qb.push(" AND t.pool_id = ")
            .push_bind(pool.as_str().to_owned());
    }
    crate::page::fetch_page(qb, "t.id", page, db).await
}

/// How many join tokens a filter matches.
pub async fn count_join_tokens(db: &Db, filter: &JoinTokenFilter) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM node_join_tokens WHERE ($1::text IS NULL OR pool_id = $1)",
    )
    .bind(filter.pool_id.as_ref().map(PoolId::as_str))
    .fetch_one(db.pool())
    .await?)
}

/// Why a join was refused: a stable code (`docs/agent-protocol.md`) and words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinRefused {
    /// `JOIN_TOKEN_INVALID`, `JOIN_TOKEN_USED`, `JOIN_TOKEN_EXPIRED`, `JOIN_TOKEN_REVOKED` or
    /// `JOIN_TOKEN_OTHER_POOL`.
    pub code: &'static str,
    pub message: String,
}

/// A machine that joined.
#[derive(Debug, Clone)]
pub struct Joined {
    pub registered: Registered,
    /// The node credential: shown once, stored as a digest.
    pub credential: String,
}

/// The registration an inventory asks for: its GPUs as they are (MIG mode with its instances'
/// profiles; otherwise exclusive: time-slicing is the operator's choice, made later with
/// `changeDeviceMode`). Malformed inventory is `BAD_USER_INPUT` naming the field.
pub fn new_node(pool_id: PoolId, labels: Labels, inventory: &Inventory) -> Result<NewNode> {
    let hostname = m::parse_hostname("inventory.hostname", &inventory.hostname)?;
    let vcpu = m::parse_count("inventory.vcpu", inventory.vcpu, 1, 100_000)?;
    let memory_mib = m::parse_count("inventory.memoryMib", inventory.memory_mib, 1, 1 << 40)?;
    let disk_gib = m::parse_count("inventory.diskGib", inventory.disk_gib, 0, 1 << 30)?;
    let devices = inventory
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let f = |name: &str| format!("inventory.gpus[{i}].{name}");
            let memory_mib = m::parse_count(&f("memoryMib"), g.memory_mib, 1, 1 << 30)?;
            let layout = if g.mig_enabled && !g.mig.is_empty() {
                let profiles: Vec<String> = g.mig.iter().map(|x| x.profile.clone()).collect();
                Layout::parse(
                    &f("mig"),
                    DeviceMode::Mig,
                    Some(&profiles),
                    None,
                    memory_mib,
                )?
            } else {
                Layout::Exclusive
            };
            Ok(NewDevice {
                uuid: GpuUuid::parse(&f("uuid"), &g.uuid)?,
                vendor: m::parse_vendor(&f("vendor"), &g.vendor)?,
                model: m::parse_name(&f("model"), &g.model)?,
                memory_mib,
                layout,
                topology: m::parse_topology(
                    &format!("inventory.gpus[{i}]"),
                    g.pci_bus_id.as_deref(),
                    g.numa_node.map(i64::from),
                    g.nvlink_domain.as_deref(),
                )?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let node = NewNode {
        pool_id,
        hostname,
        labels,
        taints: vec![],
        vcpu,
        memory_mib,
        disk_gib,
        devices,
    };
    node.check()?;
    Ok(node)
}

/// Uses join token `secret` (for `pool`, when the daemon names one) to register the machine of
/// `inventory`: the node, its GPUs, its credential and the token's use commit together, or
/// nothing does. A refused token writes nothing.
#[tracing::instrument(level = "debug", skip_all, fields(hostname = %inventory.hostname))]
pub async fn join(
    db: &Db,
    secret: &str,
    pool: Option<&PoolId>,
    inventory: &Inventory,
) -> Result<std::result::Result<Joined, JoinRefused>> {
    if !well_formed(JOIN_SECRET_PREFIX, secret) {
        return Ok(Err(JoinRefused {
            code: "JOIN_TOKEN_INVALID",
            message: format!(
                "this is not a join token (expected {JOIN_SECRET_PREFIX} and 64 hex digits, as createNodeJoinToken shows it)"
            ),
        }));
    }
    let hash = digest(secret);
    let node_id = NodeId::generate();
    let credential = new_secret(CREDENTIAL_PREFIX)?;
    db.tx("join_node", TxKind::Write, |conn| {
        let (hash, node_id, credential, pool, inventory) = (
            hash.clone(),
            node_id.clone(),
            credential.clone(),
            pool.cloned(),
            inventory.clone(),
        );
        Box::pin(async move {
            // 1. The token, used in one guarded statement (the first lock).
            let used: Option<JoinToken> = query_tokens!(
                "WITH t AS (UPDATE node_join_tokens SET used_at = compute_now(), node_id = $2 \
                  WHERE secret_sha256 = $1 AND used_at IS NULL AND revoked_at IS NULL \
                    AND expires_at > compute_now() AND ($3::text IS NULL OR pool_id = $3) RETURNING *) \
                 SELECT",
                "FROM t",
                &hash[..],
                node_id.as_str(),
                pool.as_ref().map(PoolId::as_str),
            )
            .fetch_optional(&mut *conn)
            .await?;
            let Some(token) = used else {
                return Ok(Err(explain_refusal(conn, &hash, pool.as_ref()).await?));
            };
            // 2. The node, from the inventory, with the token's labels.
            let input = new_node(token.pool_id.clone(), token.labels.0.clone(), &inventory)?;
            let registered = register_in(conn, &input, &node_id).await?;
            // 3. Its credential.
            sqlx::query("INSERT INTO node_credentials (node_id, secret_sha256) VALUES ($1, $2)")
                .bind(node_id.as_str())
                .bind(digest(&credential))
                .execute(&mut *conn)
                .await?;
            let token = load(conn, token.id.as_str())
                .await?
                .ok_or_else(|| Error::internal("a join token vanished while used"))?;
            emit_token(conn, EventType::JoinTokenUsed, &token).await?;
            Ok(Ok(Joined {
                registered,
                credential: credential.clone(),
            }))
        })
    })
    .await
}

/// Why no token with digest `hash` could be used (read after the guarded update found none).
async fn explain_refusal(
    conn: &mut PgConnection,
    hash: &[u8],
    pool: Option<&PoolId>,
) -> Result<JoinRefused> {
    let found: Option<JoinToken> = query_tokens!(
        "SELECT",
        "FROM node_join_tokens t WHERE t.secret_sha256 = $1",
        hash,
    )
    .fetch_optional(&mut *conn)
    .await?;
    let Some(t) = found else {
        return Ok(JoinRefused {
            code: "JOIN_TOKEN_INVALID",
            message: "no such join token: check it was copied whole, or ask for a new one".into(),
        });
    };
    Ok(match t.state.as_str() {
        "used" => JoinRefused {
            code: "JOIN_TOKEN_USED",
            message: format!(
                "join token {} was already used (by node {}): a token joins one machine; ask for a new one",
                t.id,
                t.node_id.as_ref().map_or("?", NodeId::as_str)
            ),
        },
        "revoked" => JoinRefused {
            code: "JOIN_TOKEN_REVOKED",
            message: format!("join token {} was revoked; ask for a new one", t.id),
        },
        "expired" => JoinRefused {
            code: "JOIN_TOKEN_EXPIRED",
            message: format!(
                "join token {} expired at {}; ask for a new one",
                t.id,
                t.expires_at.to_rfc3339()
            ),
        },
        _ => JoinRefused {
            code: "JOIN_TOKEN_OTHER_POOL",
            message: format!(
                "join token {} is for pool {}, not {}",
                t.id,
                t.pool_id,
                pool.map_or("?", PoolId::as_str)
            ),
        },
    })
}

/// Whether `secret` is node `node`'s credential, not revoked, of a node not retired.
pub async fn credential_opens(db: &Db, node: &NodeId, secret: &str) -> Result<bool> {
    if !well_formed(CREDENTIAL_PREFIX, secret) {
        return Ok(false);
    }
    Ok(sqlx::query_scalar::<_, bool>(
        "SELECT EXISTS (SELECT 1 FROM node_credentials c JOIN nodes n ON n.id = c.node_id \
          WHERE c.node_id = $1 AND c.secret_sha256 = $2 AND c.revoked_at IS NULL AND n.retired_at IS NULL)",
    )
    .bind(node.as_str())
    .bind(digest(secret))
    .fetch_one(db.pool())
    .await?)
}

/// Whether `token` has the shape of a node credential (so the gateway checks it here rather
/// than as a JWT).
pub fn is_credential(token: &str) -> bool {
    token.starts_with(CREDENTIAL_PREFIX)
}

/// Revokes node `node`'s credential, in the transaction that retires it (after the node row);
/// whether there was one to revoke.
pub(crate) async fn revoke_credential(conn: &mut PgConnection, node: &NodeId) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE node_credentials SET revoked_at = compute_now() WHERE node_id = $1 AND revoked_at IS NULL",
    )
    .bind(node.as_str())
    .execute(&mut *conn)
    .await?
    .rows_affected()
        > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_have_one_shape() {
        let s = new_secret(JOIN_SECRET_PREFIX).expect("random");
        assert!(well_formed(JOIN_SECRET_PREFIX, &s), "{s}");
        assert!(!well_formed(CREDENTIAL_PREFIX, &s));
        assert!(!well_formed(JOIN_SECRET_PREFIX, &s[..s.len() - 1]));
        assert!(!well_formed(JOIN_SECRET_PREFIX, &s.to_uppercase()));
        assert_eq!(digest(&s).len(), 32);
        assert_ne!(new_secret(CREDENTIAL_PREFIX).expect("random"), s);
    }
}
