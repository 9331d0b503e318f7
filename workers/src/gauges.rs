//! The fleet as gauges, for dashboards and alerts: what the database holds now (live
//! reservations by state, nodes by reachability, the work queue's due items and their age, each
//! webhook sink's lag and the sinks by state, the latency of recent commands). A reconcile
//! worker reads them in one statement every [`EVERY`] and `/metrics` serves the last reading, so
//! a scrape never waits on the database and a slow database delays only the figures. Every
//! reconcile worker reports the same figures: a dashboard takes their `max`.

use std::borrow::Cow;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use compute_domain::db::Db;
use compute_domain::metrics::{Registry, Sampled};
use tracing::warn;

/// How often the figures are read.
pub const EVERY: Duration = Duration::from_secs(15);

/// One reading: (family, label value, value) rows.
type Reading = Vec<(String, String, f64)>;

/// The last reading, shared with `/metrics`.
#[derive(Clone, Default)]
pub struct FleetGauges {
    last: Arc<Mutex<Reading>>,
}

/// The families: name, help, label.
const FAMILIES: [(&str, &str, &str); 7] = [
    (
        "compute_reservations",
        "Live reservations by stored state (pending, scheduled, active).",
        "state",
    ),
    (
        "compute_nodes",
        "Nodes by reachability (connected, disconnected, unreachable, lost).",
        "reachability",
    ),
    (
        "compute_work_queue_due_items",
        "Work-queue items due now and not claimed, by kind.",
        "kind",
    ),
    (
        "compute_work_queue_oldest_due_seconds",
        "How long the oldest due, unclaimed work-queue item of each kind has waited.",
        "kind",
    ),
    (
        "compute_webhook_sink_lag_seconds",
        "Each webhook sink's lag: the age of the oldest event it has not delivered (0 when caught up).",
        "sink",
    ),
    (
        "compute_webhook_sinks",
        "Webhook sinks by state (healthy, failing, behind).",
        "state",
    ),
    (
        "compute_commands_recent_latency_seconds",
        "runCommand to its result (created to finished), over the last 1,000 commands finished in \
         the last 5 minutes, at the quantile of the label (0.5, 0.99).",
        "quantile",
    ),
];

impl FleetGauges {
    /// Declares the families in `registry`, each served from the last reading.
    pub fn register(&self, registry: &Registry) {
        for (name, help, label) in FAMILIES {
            let last = self.last.clone();
            registry.sample(name, help, Sampled::Gauge, Some(label), move || {
                last.lock()
                    .map(|r| {
                        r.iter()
                            .filter(|(family, _, _)| family == name)
                            .map(|(_, key, value)| (Cow::Owned(key.clone()), *value))
                            .collect()
                    })
                    .unwrap_or_default()
            });
        }
    }

    /// Reads the figures now.
    pub async fn read(&self, db: &Db) -> compute_domain::Result<()> {
        let rows = compute_domain::fleet::gauges::read(db).await?;
        if let Ok(mut last) = self.last.lock() {
            *last = rows;
        }
        Ok(())
    }

    /// Reads the figures every [`EVERY`] until `stop` resolves.
    pub async fn run(self, db: Db, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        let mut ticker = tokio::time::interval(EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut stop => return,
                _ = ticker.tick() => {
                    if let Err(e) = self.read(&db).await {
                        warn!(error = %e, "reading the fleet's gauges failed");
                    }
                }
            }
        }
    }
}
