//! Business time in Rust, anchored to `compute_now()`.
//!
//! The database's `compute_now()` is the one clock of the system (in tests, a simulated clock).
//! [`Clock::now`] extrapolates from the last sample with the monotonic clock, so reading it costs
//! no round trip; on simulated time it does not extrapolate (simulated time moves only when it is
//! moved), and reads the last sample until the next. [`Clock::sample`] re-anchors it, at start-up and on a timer, and measures the
//! skew between this process's wall clock and `compute_now()`; a skew over one second is logged
//! as `ClockSkew` (on the wall clock only: simulated time differs from it by design) and shown by
//! `/readyz` as `clock.skew`.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tracing::warn;

use crate::db::Db;
use crate::error::Result;

/// A skew above this is logged as `ClockSkew` and reported as a warning by `/readyz`.
pub const MAX_SKEW: Duration = Duration::from_secs(1);

/// How often [`Clock::run_sampler`] samples a simulated clock.
pub const SIMULATED_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy)]
struct Anchor {
    db_time: DateTime<Utc>,
    at: Instant,
    skew_ms: i64,
    round_trip: Duration,
    simulated: bool,
}

/// A clock anchored to `compute_now()`. Cheap to clone; clones share the anchor.
#[derive(Debug, Clone)]
pub struct Clock {
    anchor: Arc<RwLock<Anchor>>,
    /// Bumped at every sample: a timer on business time ([`Clock::resampled`]) looks again.
    samples: Arc<tokio::sync::watch::Sender<u64>>,
}

/// What [`Clock::sample`] observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockReading {
    /// `compute_now()` minus this process's wall clock, in milliseconds.
    pub skew_ms: i64,
    /// The round trip of the sample.
    pub round_trip_ms: u64,
}

impl ClockReading {
    /// Whether the skew is within [`MAX_SKEW`].
    pub fn ok(&self) -> bool {
        self.skew_ms.unsigned_abs() <= MAX_SKEW.as_millis() as u64
    }
}

impl Clock {
    /// Samples `compute_now()` once and anchors a new clock to it.
    pub async fn anchored(db: &Db) -> Result<Clock> {
        let anchor = take_sample(db).await?;
        let clock = Clock {
            anchor: Arc::new(RwLock::new(anchor)),
            samples: Arc::new(tokio::sync::watch::Sender::new(0)),
        };
        clock.report(&anchor);
        Ok(clock)
    }

    /// Business time now: the last sample of `compute_now()` plus the monotonic time since
    /// (on simulated time, the last sample itself).
    pub fn now(&self) -> DateTime<Utc> {
        let anchor = *self.anchor.read().unwrap_or_else(|p| p.into_inner());
        if anchor.simulated {
            return anchor.db_time;
        }
        let elapsed = chrono::Duration::from_std(anchor.at.elapsed()).unwrap_or_default();
        anchor.db_time + elapsed
    }

    /// Samples `compute_now()` again and re-anchors.
    pub async fn sample(&self, db: &Db) -> Result<ClockReading> {
        let anchor = take_sample(db).await?;
        *self.anchor.write().unwrap_or_else(|p| p.into_inner()) = anchor;
        self.report(&anchor);
        self.samples.send_modify(|n| *n += 1);
        Ok(reading(&anchor))
    }

    /// A receiver that changes at every sample. A timer on business time sleeps on the monotonic
    /// clock and on this, and measures again when either fires: on simulated time the clock moves
    /// only at a sample (every 30 s, or when a test moves time), so a deadline passed by a move
    /// is noticed at once.
    pub fn resampled(&self) -> tokio::sync::watch::Receiver<u64> {
        self.samples.subscribe()
    }

    /// Business time `d` from now: the deadline of a timer on business time ([`Clock::sleep_until`]).
    pub fn after(&self, d: Duration) -> DateTime<Utc> {
        chrono::Duration::from_std(d)
            .ok()
            .and_then(|d| self.now().checked_add_signed(d))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }

    /// Resolves when business time reaches `at`. It sleeps on the monotonic clock for what is
    /// left and measures again at every sample ([`Clock::resampled`]), so a move of simulated
    /// time past `at` ends it at once, and in production it ends when the monotonic time runs out.
    pub async fn sleep_until(&self, at: DateTime<Utc>) {
        let mut resampled = self.resampled();
        loop {
            let Ok(left) = (at - self.now()).to_std() else {
                return;
            };
            if left.is_zero() {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(left) => {}
                changed = resampled.changed() => {
                    if changed.is_err() {
                        tokio::time::sleep(left).await;
                    }
                }
            }
        }
    }

    /// How long business time has run since `since` (zero if `since` is ahead).
    pub fn since(&self, since: DateTime<Utc>) -> Duration {
        (self.now() - since).to_std().unwrap_or_default()
    }

    /// The last reading, without a round trip.
    pub fn last_reading(&self) -> ClockReading {
        reading(&self.anchor.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn report(&self, anchor: &Anchor) {
        let r = reading(anchor);
        // Simulated time differs from the wall clock by design (a test, the simulator): the
        // skew is still measured and shown, but it is no warning.
        if !r.ok() && !anchor.simulated {
            warn!(
                event = "ClockSkew",
                clock.skew_ms = r.skew_ms,
                clock.round_trip_ms = r.round_trip_ms,
                "this process's wall clock and compute_now() differ by more than {} ms",
                MAX_SKEW.as_millis()
            );
        }
    }

    /// Re-samples every `every` until `stop` resolves.
    pub async fn run_sampler(
        self,
        db: Db,
        every: Duration,
        stop: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(stop);
        loop {
            // Simulated time does not run between samples, and a test or the simulator may move
            // it at any moment: sampled every second, so every process follows a move at once.
            let simulated = self.anchor.read().map(|a| a.simulated).unwrap_or(false);
            let wait = if simulated {
                every.min(SIMULATED_EVERY)
            } else {
                every
            };
            tokio::select! {
                () = &mut stop => return,
                () = tokio::time::sleep(wait) => {
                    if let Err(e) = self.sample(&db).await {
                        warn!(error = %e, "clock sample failed");
                    }
                }
            }
        }
    }
}

fn reading(anchor: &Anchor) -> ClockReading {
    ClockReading {
        skew_ms: anchor.skew_ms,
        round_trip_ms: anchor.round_trip.as_millis() as u64,
    }
}

async fn take_sample(db: &Db) -> Result<Anchor> {
    let sent = Instant::now();
    let wall_sent = Utc::now();
    let (db_time, simulated) = db.compute_now_and_mode().await?;
    let round_trip = sent.elapsed();
    // The server read its clock about half way through the round trip.
    let half = chrono::Duration::from_std(round_trip / 2).unwrap_or_default();
    let wall_mid = wall_sent + half;
    Ok(Anchor {
        db_time,
        at: sent + round_trip / 2,
        skew_ms: (db_time - wall_mid).num_milliseconds(),
        round_trip,
        simulated,
    })
}
