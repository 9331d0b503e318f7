//! The worker's own listener: `/healthz` and `/metrics` (the process's registry, OpenMetrics
//! text).

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use compute_domain::clock::{Clock, MAX_SKEW};
use compute_domain::metrics::Registry;
use serde_json::json;

#[derive(Clone)]
struct Listener {
    registry: Registry,
    clock: Clock,
}

/// The router of the worker's listener.
pub fn router(registry: Registry, clock: Clock) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(Listener { registry, clock })
}

/// The process is alive; `clock.skew` is the last reading of the clock (sampled at every lease
/// renewal, no round trip here): `pass` within a second of `compute_now()`, `warn` past it.
async fn healthz(State(l): State<Listener>) -> impl IntoResponse {
    let reading = l.clock.last_reading();
    axum::Json(json!({
        "status": "pass",
        "checks": {
            "clock.skew": {
                "status": if reading.ok() { "pass" } else { "warn" },
                "skew_ms": reading.skew_ms,
                "limit_ms": MAX_SKEW.as_millis() as u64,
            }
        }
    }))
}

async fn metrics(State(Listener { registry, .. }): State<Listener>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, compute_domain::metrics::CONTENT_TYPE)],
        registry.encode(),
    )
}
