//! Pokes that wake the workers' idle loops early.
//!
//! Every writing commit of any process is followed by the outbox poke: `NOTIFY compute_outbox`
//! from a transaction of its own, debounced (`compute_domain::db::poke`), never inside the
//! writing transaction. A worker process holds one `LISTEN` connection on that channel
//! ([`Waker::listen`]) and fans each notification out to the loops that subscribed: the work
//! queue's loops (a commit may have enqueued work) and each webhook sink's delivery (a commit
//! may have written an event). A loop sleeps until its interval passes or a poke comes, which
//! ever is first, so a lost poke (a dropped connection, a pooler without a direct `LISTEN`
//! URL, a notification queued while the loop was busy) only delays the work until the next
//! poll: every loop still polls on its own interval.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use compute_domain::db::Db;
use tokio::sync::Notify;
use tracing::{debug, warn};

/// Wakes the loops of one worker process.
#[derive(Debug, Clone, Default)]
pub struct Waker {
    loops: Arc<Mutex<Vec<Arc<Notify>>>>,
    pokes: Arc<AtomicU64>,
}

impl Waker {
    /// A new loop's own wake-up: [`Waker::wake_all`] stores one permit for it, so a poke that
    /// comes while the loop works wakes its next wait at once.
    pub fn subscribe(&self) -> Arc<Notify> {
        let n = Arc::new(Notify::new());
        let mut loops = self.loops.lock().unwrap_or_else(|p| p.into_inner());
        // Ended loops are forgotten here too: without a `LISTEN` connection (`--db-pooled`)
        // nothing wakes them, and every sink task started (each backoff, each pause and
        // resume) left its handle behind for good.
        loops.retain(|n| Arc::strong_count(n) > 1);
        loops.push(n.clone());
        n
    }

    /// Wakes every subscribed loop.
    pub fn wake_all(&self) {
        self.pokes.fetch_add(1, Ordering::Relaxed);
        let mut loops = self.loops.lock().unwrap_or_else(|p| p.into_inner());
        // A loop that ended (a sink handed over) dropped its handle: forget it.
        loops.retain(|n| Arc::strong_count(n) > 1);
        for n in loops.iter() {
            n.notify_one();
        }
    }

    /// How many pokes this process heard.
    pub fn pokes(&self) -> u64 {
        self.pokes.load(Ordering::Relaxed)
    }

    /// Listens on the outbox poke's channel until `stop` resolves, waking every loop at each
    /// notification; reconnects after a second when the connection fails (the loops poll
    /// meanwhile).
    pub async fn listen(self, db: Db, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        loop {
            let heard = async {
                let mut listener = db.listener().await?;
                listener
                    .listen(compute_domain::db::poke::NOTIFY_CHANNEL)
                    .await?;
                debug!("listening for the writers' pokes");
                loop {
                    listener.recv().await?;
                    self.wake_all();
                }
            };
            tokio::select! {
                () = &mut stop => return,
                r = heard => {
                    let r: compute_domain::Result<()> = r;
                    if let Err(e) = r {
                        warn!(error = %e, "the pokes' LISTEN connection failed; the loops poll until it is back");
                    }
                }
            }
            tokio::select! {
                () = &mut stop => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
}

/// Waits `wait`, or less when `woken` is poked first.
pub async fn idle(wait: Duration, woken: Option<&Notify>) {
    match woken {
        Some(n) => {
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = n.notified() => {}
            }
        }
        None => tokio::time::sleep(wait).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ended_loops_are_forgotten_without_a_poke() {
        let waker = Waker::default();
        let kept = waker.subscribe();
        for _ in 0..10_000 {
            drop(waker.subscribe());
        }
        let held = waker.loops.lock().map(|l| l.len()).unwrap_or(usize::MAX);
        assert!(held <= 2, "{held} handles held for one live loop");
        drop(kept);
    }
}
