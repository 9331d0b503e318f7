//! The fence: what a transaction done under a lease proves first (`FOR SHARE` on the lease's
//! row at its epoch). It lives here, below the leases, because [`super::Db::fenced`] runs it at
//! the start of every fenced transaction; `leases` acquires, renews and releases.

use sqlx::PgConnection;

use crate::error::{Error, Result};

/// A held lease: what a fenced transaction proves it still holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub name: String,
    pub owner: String,
    pub epoch: i64,
}

/// The first statement of a fenced transaction: the lease row `FOR SHARE` at the holder's epoch.
/// A plain existence check would not fence under READ COMMITTED; the row lock does.
pub async fn check(conn: &mut PgConnection, fence: &Fence) -> Result<()> {
    let held = sqlx::query_scalar!(
        "SELECT 1 AS held FROM leases WHERE name = $1 AND owner = $2 AND epoch = $3 AND expires_at > compute_now() FOR SHARE",
        fence.name,
        fence.owner,
        fence.epoch,
    )
    .fetch_optional(&mut *conn)
    .await?;
    if held.is_none() {
        return Err(Error::LeaseLost(format!(
            "lease {} (epoch {}) is no longer held by {}",
            fence.name, fence.epoch, fence.owner
        )));
    }
    Ok(())
}
