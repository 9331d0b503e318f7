//! The trace a request belongs to, from its entry (`ops::TrackLayer` for HTTP, a WebSocket's
//! `connection_init` for its operations) to every error it answers with (`extensions.traceId`).
//!
//! With tracing on (`compute_telemetry::enabled`), the trace is the HTTP server span's, which
//! continues the caller's `traceparent` when it sent one. With tracing off, the id is still
//! chosen (the caller's, or a new one) and written on the request's log lines and its response,
//! so a user who quotes it finds the request in the logs.

use std::future::Future;

use compute_telemetry::TraceParent;
use compute_telemetry::context::{fresh_trace_id, trace_id_hex};

/// The `traceparent` header, in and out.
pub const TRACEPARENT: &str = "traceparent";
/// The response header naming the trace (32 hex digits), on every response.
pub const TRACE_ID_HEADER: &str = "x-trace-id";

/// One request's trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trace {
    /// What the request's own spans continue: the HTTP server span when tracing is on, else the
    /// caller's `traceparent`.
    pub parent: Option<TraceParent>,
    /// The trace id a response names.
    pub id: [u8; 16],
}

impl Trace {
    /// A trace continuing `parent` (a caller's, or the server span's), or a new id.
    pub fn continuing(parent: Option<TraceParent>) -> Trace {
        Trace {
            parent,
            id: parent.map_or_else(fresh_trace_id, |p| p.trace_id),
        }
    }

    /// The id as 32 lowercase hex digits.
    pub fn hex(&self) -> String {
        trace_id_hex(&self.id)
    }
}

tokio::task_local! {
    static CURRENT: Trace;
}

/// The trace of the request this task serves, if it is one.
pub fn current() -> Option<Trace> {
    CURRENT.try_with(|t| *t).ok()
}

/// Runs `future` as part of `trace` ([`current`]).
pub fn scope<F: Future>(
    trace: Trace,
    future: F,
) -> tokio::task::futures::TaskLocalFuture<Trace, F> {
    CURRENT.scope(trace, future)
}

/// Writes `traceId` into the extensions of every error of a response, so a user can quote it.
pub fn stamp(errors: &mut [async_graphql::ServerError], trace: Option<&Trace>) {
    let Some(trace) = trace else { return };
    if errors.is_empty() {
        return;
    }
    let hex = trace.hex();
    for e in errors {
        e.extensions
            .get_or_insert_with(Default::default)
            .set("traceId", hex.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_continues_its_parent_or_starts_anew() {
        let parent = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("valid");
        let t = Trace::continuing(Some(parent));
        assert_eq!(t.hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(Trace::continuing(None).id, Trace::continuing(None).id);
    }
}
