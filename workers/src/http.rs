//! The worker's own listener: `/healthz` and `/metrics` (the process's registry, OpenMetrics
//! text).

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use compute_domain::metrics::Registry;

/// The router of the worker's listener.
pub fn router(registry: Registry) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .with_state(registry)
}

async fn metrics(State(registry): State<Registry>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, compute_domain::metrics::CONTENT_TYPE)],
        registry.encode(),
    )
}
