//! The usage meter (`--role reconcile`): closes usage windows and checks reservation changes
//! against them, under `singleton:usage` (`compute_domain::usage`, `docs/usage.md`).
//!
//! A pass keeps the lease, then runs the meter's transactions, each fenced, in slices of
//! [`SLICE`] transactions with the lease renewed between slices, until nothing is due: a worker
//! catching up after an outage works through the missed windows in order in one pass, logging
//! its progress. A pass cut short (a kill, a lost lease) loses at most the transaction in flight,
//! which rolls back; the next holder goes on from the meter's row.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::time::Duration;

use compute_domain::Result;
use compute_domain::db::Db;
use compute_domain::usage::{self, MeterPass};
use tracing::{info, warn};

use compute_domain::leases::PassLease;

/// The lease the meter runs under.
pub const USAGE_LEASE: &str = compute_domain::leases::name::USAGE;

/// How often the meter looks for due windows by default.
pub const USAGE_EVERY: Duration = Duration::from_secs(10);

/// Transactions run between two renewals of the lease.
pub const SLICE: u64 = 50;

/// What one process's meter has done, for its `/metrics`.
#[derive(Debug, Default)]
pub struct UsageStats {
    pub windows_closed: AtomicU64,
    pub records: AtomicU64,
    pub checked: AtomicU64,
    /// Seconds from the end of the last closed window to the database's now, at the last pass
    /// of the process that holds the lease (-1 before one; a window is closed 60 s after its
    /// end at the earliest, so this stays between the grace and a window plus the grace).
    pub lag_seconds: AtomicI64,
}

/// The usage meter of one process.
#[derive(Debug, Clone)]
pub struct UsageMeter {
    lease: PassLease,
    stats: Arc<UsageStats>,
}

impl UsageMeter {
    /// A meter for this process; `owner` names it in the lease.
    pub fn new(db: Db, owner: impl Into<String>) -> UsageMeter {
        let stats = UsageStats {
            lag_seconds: AtomicI64::new(-1),
            ..UsageStats::default()
        };
        UsageMeter {
            lease: PassLease::new(db, USAGE_LEASE, owner),
            stats: Arc::new(stats),
        }
    }

    /// Its counters.
    pub fn stats(&self) -> Arc<UsageStats> {
        self.stats.clone()
    }

    /// One pass: if this process holds the lease, everything due, in order. Returns what it did
    /// (all zero when another process holds the lease).
    pub async fn pass(&mut self) -> Result<MeterPass> {
        let mut total = MeterPass::default();
        loop {
            let Some(fence) = self.lease.keep().await? else {
                return Ok(total);
            };
            let db = self.lease.db().fenced(&fence);
            let slice = usage::meter_pass(&db, SLICE).await?;
            total.windows_closed += slice.windows_closed;
            total.records += slice.records;
            total.checked += slice.checked;
            total.batches += slice.batches;
            self.stats
                .windows_closed
                .fetch_add(slice.windows_closed, Relaxed);
            self.stats.records.fetch_add(slice.records, Relaxed);
            self.stats.checked.fetch_add(slice.checked, Relaxed);
            let lag = usage::lag_seconds(self.lease.db()).await?;
            self.stats.lag_seconds.store(lag.unwrap_or(-1), Relaxed);
            if !slice.more {
                return Ok(total);
            }
            info!(
                usage.windows_closed = total.windows_closed,
                usage.records = total.records,
                usage.lag_seconds = lag,
                "usage meter catching up"
            );
        }
    }

    /// Gives the lease up (on shutdown).
    pub async fn release(&mut self) {
        self.lease.release().await;
    }

    /// Runs passes every `every` until `stop` resolves. A pass that fails is logged and the loop
    /// goes on.
    pub async fn run(mut self, every: Duration, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut stop => {
                    self.release().await;
                    info!("usage meter stopped");
                    return;
                }
                _ = ticker.tick() => {
                    let pass = tokio::select! {
                        () = &mut stop => { self.release().await; return; }
                        pass = self.pass() => pass,
                    };
                    match pass {
                        Ok(p) if p.windows_closed + p.records + p.checked > 0 => info!(
                            usage.windows_closed = p.windows_closed,
                            usage.records = p.records,
                            usage.checked = p.checked,
                            "usage meter pass"
                        ),
                        Ok(_) => {}
                        Err(e) => warn!(error = %e, "usage meter pass failed"),
                    }
                }
            }
        }
    }
}
