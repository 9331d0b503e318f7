//! What operators' tools call: `/healthz`, `/readyz` and `/metrics`, and the middleware that
//! measures every request.

pub mod health;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::state::AppState;

/// Middleware that counts every request by its matched route.
pub async fn track(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = req.method().as_str().to_owned();
    let started = std::time::Instant::now();
    let response = next.run(req).await;
    app.metrics.record_request(
        &route,
        &method,
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}
