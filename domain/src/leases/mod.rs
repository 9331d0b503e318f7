//! Leases with fencing: rows in `leases`, acquired and renewed with one guarded upsert, and a
//! fence that is the first statement of every transaction done under a lease.
//!
//! Names: `shard:<kind>:<n>`, `singleton:<name>`, `gateway:<id>`, built in [`name`] only (the
//! table's `CHECK` refuses any other; `pool:` and `site:` were taken out by migration 0023:
//! per-pool work runs on the shards). Shard and singleton leases live [`TTL`] and are renewed
//! every [`RENEW_EVERY`].

mod held;

use std::time::Duration;

use crate::db::Db;
use crate::error::Result;

pub use crate::db::fence::{Fence, check};
pub use held::{Bound, HeldLease, PassLease};

/// How long a lease lives without renewal.
pub const TTL: Duration = Duration::from_secs(15);
/// How often a holder renews.
pub const RENEW_EVERY: Duration = Duration::from_secs(5);

/// Every lease name, built here and nowhere else: `shard:<kind>:<n>`, `singleton:<name>` (and
/// `singleton:<family>:<owner>` presence leases), `singleton:outbox-dispatch:<sink id>`,
/// `gateway:<id>`.
pub mod name {
    /// The reservation reconciler's (resync, liveness, pruning).
    pub const RESERVATIONS: &str = "singleton:reservations";
    /// The usage meter's.
    pub const USAGE: &str = "singleton:usage";

    /// Shard `n` of the work-queue kind `kind`.
    pub fn shard(kind: &str, n: i32) -> String {
        format!("shard:{kind}:{n}")
    }

    /// The presence lease of `owner` among the processes of `family` (`worker` for the queue,
    /// `dispatcher` for webhooks): `singleton:<family>:<owner>`, the owner's characters outside
    /// `[a-z0-9_-]` written `-`.
    pub fn presence(family: &str, owner: &str) -> String {
        let clean: String = owner
            .to_ascii_lowercase()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        format!("{}{clean}", presence_prefix(family))
    }

    /// What every presence lease of `family` starts with (to count the live ones).
    pub fn presence_prefix(family: &str) -> String {
        format!("singleton:{family}:")
    }

    /// The lease of one webhook sink's delivery.
    pub fn outbox_dispatch(sink: &str) -> String {
        format!("singleton:outbox-dispatch:{sink}")
    }

    /// A gateway's lease.
    pub fn gateway(id: &crate::ids::GatewayId) -> String {
        format!("gateway:{id}")
    }
}

/// Acquires `name` for `owner`, or renews it when `owner` holds it. Returns the fence, or `None`
/// when another owner holds an unexpired lease. A takeover increments the epoch; it waits for
/// the old holder's fenced transactions (their `FOR SHARE`) to end.
pub async fn acquire(db: &Db, name: &str, owner: &str, ttl: Duration) -> Result<Option<Fence>> {
    let epoch = sqlx::query_scalar!(
        "INSERT INTO leases AS l (name, owner, epoch, expires_at) \
         VALUES ($1, $2, 1, compute_now() + make_interval(secs => $3::float8)) \
         ON CONFLICT (name) DO UPDATE \
            SET owner = EXCLUDED.owner, \
                epoch = CASE WHEN l.owner = EXCLUDED.owner THEN l.epoch ELSE l.epoch + 1 END, \
                expires_at = EXCLUDED.expires_at, updated_at = compute_now() \
          WHERE l.owner = EXCLUDED.owner OR l.expires_at < compute_now() \
         RETURNING l.epoch",
        name,
        owner,
        ttl.as_secs_f64(),
    )
    .fetch_optional(db.pool())
    .await?;
    Ok(epoch.map(|epoch| Fence {
        name: name.to_owned(),
        owner: owner.to_owned(),
        epoch,
    }))
}

/// Renews a held lease at its epoch; `false` when it was lost (taken over, or expired and taken).
pub async fn renew(db: &Db, fence: &Fence, ttl: Duration) -> Result<bool> {
    let done = sqlx::query!(
        "UPDATE leases SET expires_at = compute_now() + make_interval(secs => $4::float8), updated_at = compute_now() \
          WHERE name = $1 AND owner = $2 AND epoch = $3 AND expires_at > compute_now()",
        fence.name,
        fence.owner,
        fence.epoch,
        ttl.as_secs_f64(),
    )
    .execute(db.pool())
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Gives a lease up at once (on shutdown), so another process need not wait for its expiry.
pub async fn release(db: &Db, fence: &Fence) -> Result<()> {
    sqlx::query!(
        "UPDATE leases SET expires_at = '-infinity' WHERE name = $1 AND owner = $2 AND epoch = $3",
        fence.name,
        fence.owner,
        fence.epoch,
    )
    .execute(db.pool())
    .await?;
    Ok(())
}

/// How many unexpired leases have a name starting with `prefix` (the live workers, from their
/// presence leases).
pub async fn count_live(db: &Db, prefix: &str) -> Result<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM leases WHERE starts_with(name, $1) AND expires_at > compute_now()"#,
        prefix,
    )
    .fetch_one(db.pool())
    .await?)
}

/// How long a lease that no process will take again stays after it expired, before
/// [`prune`] deletes it.
pub const PRUNE_AFTER: Duration = Duration::from_secs(3600);

/// Deletes the leases no process will take again, expired for longer than `after`: presence
/// leases (`singleton:<family>:<owner>`: each process names its own, and a new process a new
/// one), gateways' (`gateway:<id>`, one per process), and the delivery leases of sinks that no
/// longer exist. Shard and fixed singleton leases stay: their epochs fence their next holders.
/// A deleted lease fails every fence check as an expired one does, and a node session on a
/// deleted gateway's lease reads as lost as on an expired one. How many it deleted.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn prune(db: &Db, after: Duration) -> Result<u64> {
    let done = sqlx::query!(
        r#"DELETE FROM leases l
            WHERE l.expires_at < compute_now() - make_interval(secs => $1::float8)
              AND (starts_with(l.name, 'gateway:')
                   OR (l.name ~ '^singleton:[^:]+:' AND NOT starts_with(l.name, $2))
                   OR (starts_with(l.name, $2)
                       AND NOT EXISTS (SELECT 1 FROM event_sinks s WHERE $2 || s.id = l.name)))"#,
        after.as_secs_f64(),
        name::outbox_dispatch(""),
    )
    .execute(db.pool())
    .await?;
    Ok(done.rows_affected())
}
