//! Held leases, renewed in the background, with a signal that fires the moment one is lost.
//!
//! [`HeldLease::acquire`] takes a lease (the reference's guarded upsert) and starts a task that
//! renews it every [`RENEW_EVERY`]. The lease is lost when a renewal finds it taken over or
//! expired, or when no renewal has succeeded for the lease's TTL (the database is unreachable:
//! another process may already hold it). Work bound to the lease runs under
//! [`HeldLease::bound`], which cancels it at that moment rather than at its next loop. Fenced
//! transactions remain the guarantee: a cancelled or zombie holder's write fails its fence.

use std::future::Future;
use std::time::Duration;

use crate::db::Db;
use crate::leases::{self, Fence, RENEW_EVERY, TTL};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

/// A lease this process holds, until [`HeldLease::lost`] fires or it is released.
pub struct HeldLease {
    fence: Fence,
    ttl: Duration,
    lost: watch::Receiver<bool>,
    renewer: tokio::task::JoinHandle<()>,
}

/// The outcome of work run under [`HeldLease::bound`].
#[derive(Debug)]
pub enum Bound<T> {
    Done(T),
    /// The lease was lost first; the work was dropped where it stood.
    LeaseLost,
}

impl HeldLease {
    /// Acquires `name` for `owner` (or renews it if `owner` holds it already); `None` when
    /// another owner holds it.
    pub async fn acquire(db: &Db, name: &str, owner: &str) -> crate::Result<Option<HeldLease>> {
        Self::acquire_with(db, name, owner, TTL, RENEW_EVERY).await
    }

    /// [`HeldLease::acquire`] with a TTL and renewal period of one's own (tests).
    pub async fn acquire_with(
        db: &Db,
        name: &str,
        owner: &str,
        ttl: Duration,
        renew_every: Duration,
    ) -> crate::Result<Option<HeldLease>> {
        let started = Instant::now();
        let Some(fence) = leases::acquire(db, name, owner, ttl).await? else {
            return Ok(None);
        };
        info!(lease.name = %fence.name, lease.epoch = fence.epoch, "lease acquired");
        let (tx, lost) = watch::channel(false);
        let renewer = tokio::spawn(renew(
            db.clone(),
            fence.clone(),
            ttl,
            renew_every,
            started + ttl,
            tx,
        ));
        Ok(Some(HeldLease {
            fence,
            ttl,
            lost,
            renewer,
        }))
    }

    /// The fence every transaction under this lease starts with.
    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// The lease's name.
    pub fn name(&self) -> &str {
        &self.fence.name
    }

    /// Whether the lease has been lost.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves when the lease is lost.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.lost.clone();
        async move {
            let _ = rx.wait_for(|lost| *lost).await;
        }
    }

    /// Runs `work` until it finishes or the lease is lost, whichever comes first.
    pub async fn bound<T>(&self, work: impl Future<Output = T>) -> Bound<T> {
        if self.is_lost() {
            return Bound::LeaseLost;
        }
        tokio::select! {
            biased;
            () = self.lost() => Bound::LeaseLost,
            out = work => Bound::Done(out),
        }
    }

    /// Renews the lease now (or takes it back with the same epoch if it expired and nobody
    /// took it); `false` when it is lost. A worker stepped on the simulated clock calls this
    /// after moving time, instead of waiting for the background renewal.
    pub async fn refresh(&self, db: &Db) -> crate::Result<bool> {
        if self.is_lost() {
            return Ok(false);
        }
        match leases::acquire(db, &self.fence.name, &self.fence.owner, self.ttl).await? {
            Some(f) if f.epoch == self.fence.epoch => Ok(true),
            _ => Ok(false),
        }
    }

    /// Gives the lease up at once, so another process need not wait for it to expire.
    pub async fn release(self, db: &Db) {
        self.renewer.abort();
        if !self.is_lost() {
            if let Err(e) = leases::release(db, &self.fence).await {
                warn!(lease.name = %self.fence.name, error = %e, "releasing a lease failed; it expires on its own");
            } else {
                info!(lease.name = %self.fence.name, "lease released");
            }
        }
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

async fn renew(
    db: Db,
    fence: Fence,
    ttl: Duration,
    every: Duration,
    mut valid_until: Instant,
    lost: watch::Sender<bool>,
) {
    let mut tick = tokio::time::interval_at(Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let attempt = Instant::now();
                match leases::renew(&db, &fence, ttl).await {
                    Ok(true) => valid_until = attempt + ttl,
                    Ok(false) => {
                        warn!(lease.name = %fence.name, lease.epoch = fence.epoch, "lease lost: taken over or expired; its work stops now");
                        let _ = lost.send(true);
                        return;
                    }
                    Err(e) => warn!(lease.name = %fence.name, error = %e, "renewing a lease failed; retrying until it would expire"),
                }
            }
            () = tokio::time::sleep_until(valid_until) => {
                warn!(lease.name = %fence.name, lease.epoch = fence.epoch, "lease lost: not renewed within its TTL; its work stops now");
                let _ = lost.send(true);
                return;
            }
        }
    }
}

/// A singleton lease held pass by pass: acquired or renewed at the start of each pass (the
/// reconcilers' way, for work that runs in short passes rather than under [`HeldLease::bound`]).
/// Logs when it is gained and lost.
#[derive(Debug, Clone)]
pub struct PassLease {
    db: Db,
    name: &'static str,
    owner: String,
    fence: Option<Fence>,
}

impl PassLease {
    /// The lease `name` for `owner`, not held yet.
    pub fn new(db: Db, name: &'static str, owner: impl Into<String>) -> PassLease {
        PassLease {
            db,
            name,
            owner: owner.into(),
            fence: None,
        }
    }

    /// Acquires or renews the lease; the fence when this process holds it.
    pub async fn keep(&mut self) -> crate::Result<Option<Fence>> {
        let fence = match &self.fence {
            Some(f) if leases::renew(&self.db, f, TTL).await? => Some(f.clone()),
            _ => leases::acquire(&self.db, self.name, &self.owner, TTL).await?,
        };
        match (&self.fence, &fence) {
            (None, Some(f)) => info!(
                lease.name = self.name,
                lease.epoch = f.epoch,
                "lease acquired"
            ),
            (Some(f), None) => warn!(
                lease.name = self.name,
                lease.epoch = f.epoch,
                "lease lost; work stops"
            ),
            _ => {}
        }
        self.fence = fence;
        Ok(self.fence.clone())
    }

    /// The database the lease lives in (unfenced).
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// Whether the lease was held at the last [`PassLease::keep`].
    pub fn is_held(&self) -> bool {
        self.fence.is_some()
    }

    /// Gives the lease up (on shutdown).
    pub async fn release(&mut self) {
        if let Some(f) = self.fence.take() {
            let _ = leases::release(&self.db, &f).await;
        }
    }
}
