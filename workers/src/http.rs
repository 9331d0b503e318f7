//! The worker's own listener: `/healthz` and `/metrics` (Prometheus text).

use std::fmt::Write;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::Stats;

/// The router of the worker's listener.
pub fn router(stats: Stats) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .with_state(stats)
}

async fn metrics(State(s): State<Stats>) -> impl IntoResponse {
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let series: [(&str, &str, &str, u64); 6] = [
        (
            "compute_work_items_total",
            "Work-queue items run, by outcome.",
            "{outcome=\"done\"}",
            n(&s.queue.succeeded),
        ),
        (
            "compute_work_items_total",
            "",
            "{outcome=\"rescheduled\"}",
            n(&s.queue.rescheduled),
        ),
        (
            "compute_work_items_total",
            "",
            "{outcome=\"failed\"}",
            n(&s.queue.failed),
        ),
        (
            "compute_lease_losses_total",
            "Shard leases this process lost while holding them.",
            "",
            n(&s.queue.lease_losses),
        ),
        (
            "compute_webhook_deliveries_total",
            "Webhook POSTs answered 2xx.",
            "",
            n(&s.dispatch.delivered),
        ),
        (
            "compute_webhook_failures_total",
            "Webhook POSTs that failed (the sink then backs off).",
            "",
            n(&s.dispatch.failed),
        ),
    ];
    let mut out = String::new();
    for (name, help, labels, value) in series {
        // The HELP and TYPE lines come once, before a metric's first series.
        if !help.is_empty() {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
        }
        let _ = writeln!(out, "{name}{labels} {value}");
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
}
