//! What operators' tools call: `/healthz`, `/readyz` and `/metrics`, and the middleware that
//! measures every request.

pub mod health;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::state::AppState;

/// Middleware that counts every request by its matched route.
pub async fn track(State(app): State<AppState>, req: Request, next: Next) -> Response {
    // The matched path is shared (an `Arc` inside), so keeping it costs no copy.
    let route = req.extensions().get::<MatchedPath>().cloned();
    let method = req.method().clone();
    let started = std::time::Instant::now();
    let response = next.run(req).await;
    app.metrics.record_request(
        route.as_ref().map(MatchedPath::as_str),
        &method,
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}
