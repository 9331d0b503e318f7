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
    let mut out = String::new();
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let _ = writeln!(
        out,
        "# HELP compute_work_items_total Work-queue items run, by outcome."
    );
    let _ = writeln!(out, "# TYPE compute_work_items_total counter");
    let _ = writeln!(
        out,
        "compute_work_items_total{{outcome=\"done\"}} {}",
        n(&s.queue.succeeded)
    );
    let _ = writeln!(
        out,
        "compute_work_items_total{{outcome=\"rescheduled\"}} {}",
        n(&s.queue.rescheduled)
    );
    let _ = writeln!(
        out,
        "compute_work_items_total{{outcome=\"failed\"}} {}",
        n(&s.queue.failed)
    );
    let _ = writeln!(
        out,
        "# HELP compute_lease_losses_total Shard leases this process lost while holding them."
    );
    let _ = writeln!(out, "# TYPE compute_lease_losses_total counter");
    let _ = writeln!(
        out,
        "compute_lease_losses_total {}",
        n(&s.queue.lease_losses)
    );
    let _ = writeln!(
        out,
        "# HELP compute_webhook_deliveries_total Webhook POSTs answered 2xx."
    );
    let _ = writeln!(out, "# TYPE compute_webhook_deliveries_total counter");
    let _ = writeln!(
        out,
        "compute_webhook_deliveries_total {}",
        n(&s.dispatch.delivered)
    );
    let _ = writeln!(
        out,
        "# HELP compute_webhook_failures_total Webhook POSTs that failed (the sink then backs off)."
    );
    let _ = writeln!(out, "# TYPE compute_webhook_failures_total counter");
    let _ = writeln!(
        out,
        "compute_webhook_failures_total {}",
        n(&s.dispatch.failed)
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
}
