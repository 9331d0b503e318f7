//! `/healthz` (the process is alive) and `/readyz` (it can serve: database reachable, migrations
//! current, clock skew).

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::state::AppState;

/// Liveness: answers as long as the process runs.
pub async fn healthz() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

/// Readiness: 200 when the database answers and every migration is applied, 503 otherwise. The
/// clock skew is reported (`clock.skew`) and warns past one second, without making the process
/// unready: business time comes from `compute_now()`, not from this machine's clock.
pub async fn readyz(State(app): State<AppState>) -> Response {
    let timeout = Duration::from_secs(2);
    let mut ready = true;
    let mut checks = serde_json::Map::new();

    match tokio::time::timeout(timeout, app.clock.sample(&app.db)).await {
        Ok(Ok(reading)) => {
            checks.insert(
                "database".into(),
                json!({ "status": "pass", "round_trip_ms": reading.round_trip_ms }),
            );
            let simulated = tokio::time::timeout(timeout, app.db.clock_is_simulated())
                .await
                .ok()
                .and_then(Result::ok);
            checks.insert(
                "clock.skew".into(),
                json!({
                    "status": if reading.ok() { "pass" } else { "warn" },
                    "skew_ms": reading.skew_ms,
                    "limit_ms": compute_domain::clock::MAX_SKEW.as_millis() as u64,
                    "simulated": simulated,
                }),
            );
        }
        Ok(Err(e)) => {
            ready = false;
            checks.insert(
                "database".into(),
                json!({ "status": "fail", "error": e.to_string() }),
            );
        }
        Err(_) => {
            ready = false;
            checks.insert(
                "database".into(),
                json!({ "status": "fail", "error": "no answer within 2 s" }),
            );
        }
    }

    if ready {
        match tokio::time::timeout(timeout, app.db.migration_status()).await {
            Ok(Ok(status)) => {
                ready &= status.is_current();
                checks.insert(
                    "migrations".into(),
                    json!({
                        "status": if status.is_current() { "pass" } else { "fail" },
                        "applied": status.applied,
                        "expected": status.expected,
                        "pending": status.pending,
                        "failed": status.failed,
                        "unknown": status.unknown,
                    }),
                );
            }
            Ok(Err(e)) => {
                ready = false;
                checks.insert(
                    "migrations".into(),
                    json!({ "status": "fail", "error": e.to_string() }),
                );
            }
            Err(_) => {
                ready = false;
                checks.insert(
                    "migrations".into(),
                    json!({ "status": "fail", "error": "no answer within 2 s" }),
                );
            }
        }
    }

    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({ "status": if ready { "ready" } else { "unavailable" }, "checks": checks })),
    )
        .into_response()
}

/// `/metrics`: the process's registry in the OpenMetrics text format.
pub async fn metrics(State(app): State<AppState>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            compute_domain::metrics::CONTENT_TYPE,
        )],
        app.registry.encode(),
    )
        .into_response()
}
