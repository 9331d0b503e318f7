//! `/metrics` (Prometheus text) and `/healthz` (JSON) of the agent.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::agent::Agent;
use crate::journal::WorkloadState;
use crate::metrics::StateLabels;

const STATES: [WorkloadState; 5] = [
    WorkloadState::Starting,
    WorkloadState::Running,
    WorkloadState::Stopping,
    WorkloadState::Exited,
    WorkloadState::Stopped,
];

fn count_workloads(agent: &Agent) -> Result<[i64; 5], String> {
    let mut counts = [0i64; 5];
    for w in agent.journal().all_workloads().map_err(|e| e.to_string())? {
        if let Some(i) = STATES.iter().position(|s| *s == w.state) {
            counts[i] += 1;
        }
    }
    Ok(counts)
}

pub fn metrics(agent: &Agent) -> Response {
    let m = agent.metrics();
    m.sample_traces();
    match count_workloads(agent) {
        Ok(counts) => {
            for (state, n) in STATES.iter().zip(counts) {
                m.workloads
                    .get_or_create(&StateLabels {
                        state: state.as_str(),
                    })
                    .set(n);
            }
        }
        Err(_) => {
            m.journal_errors.inc();
        }
    }
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, &m.registry).is_err() {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub fn health(agent: &Agent) -> Response {
    let connected = agent.metrics().connected.get() == 1;
    let body = match count_workloads(agent) {
        Ok(counts) => serde_json::json!({
            "status": "ok",
            "journalId": agent.journal().id(),
            "connected": connected,
            "workloads": { "running": counts[1], "stopping": counts[2] },
        }),
        Err(e) => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(serde_json::json!({ "status": "fail", "error": e })),
            )
                .into_response();
        }
    };
    axum::Json(body).into_response()
}
