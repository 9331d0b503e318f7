//! What operators' tools call: `/healthz`, `/readyz` and `/metrics`, and the layer that
//! measures and traces every request.

pub mod health;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderValue, Method};
use axum::response::Response;
use compute_telemetry::TraceParent;
use tracing::Instrument;

use crate::metrics::Metrics;
use crate::trace::{TRACE_ID_HEADER, TRACEPARENT, Trace};

/// The layer that counts every request by its matched route, method and status, with its
/// latency ([`Metrics::record_request`]), and traces it: the caller's `traceparent` is read,
/// the request runs in an HTTP server span continuing it when tracing is on
/// (OpenTelemetry's HTTP conventions: `http.request.method`, `http.route`, `url.path`,
/// `http.response.status_code`), its [`Trace`] is [`crate::trace::current`] for the handler,
/// and the response names the trace (`X-Trace-Id`, and `traceresponse` when a span was
/// recorded). Written as a tower layer rather than with
/// `axum::middleware::from_fn`, which boxes the rest of the stack and the middleware's future
/// for every request: this one wraps the route's future where it lies.
#[derive(Clone, Debug)]
pub struct TrackLayer {
    metrics: Arc<Metrics>,
}

impl TrackLayer {
    pub fn new(metrics: Metrics) -> TrackLayer {
        TrackLayer {
            metrics: Arc::new(metrics),
        }
    }
}

impl<S> tower::Layer<S> for TrackLayer {
    type Service = Track<S>;

    fn layer(&self, inner: S) -> Track<S> {
        Track {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// A route measured by [`TrackLayer`].
#[derive(Clone, Debug)]
pub struct Track<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> tower::Service<Request> for Track<S>
where
    S: tower::Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Tracked<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        // The matched path is shared (an `Arc` inside), so keeping it costs no copy.
        let route = req.extensions().get::<MatchedPath>().cloned();
        let method = req.method().clone();
        let caller = req
            .headers()
            .get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(TraceParent::parse);
        let span = if compute_telemetry::enabled() {
            server_span(&req, route.as_ref(), caller.as_ref())
        } else {
            tracing::Span::none()
        };
        let server = compute_telemetry::context::of_span(&span);
        let trace = Trace::continuing(server.or(caller));
        Tracked {
            inner: crate::trace::scope(trace, self.inner.call(req).instrument(span.clone())),
            measure: Some(Measure {
                metrics: self.metrics.clone(),
                route,
                method,
                started: Instant::now(),
                span,
                trace,
                server,
            }),
        }
    }
}

/// The span of one HTTP request, named `<method> <route>` as OpenTelemetry asks.
fn server_span(
    req: &Request,
    route: Option<&MatchedPath>,
    caller: Option<&TraceParent>,
) -> tracing::Span {
    let route = route.map_or("", MatchedPath::as_str);
    let span = tracing::info_span!(
        "http.server",
        otel.name = %format_args!("{} {}", req.method(), if route.is_empty() { "unmatched" } else { route }),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %req.method(),
        http.route = route,
        url.path = req.uri().path(),
        http.response.status_code = tracing::field::Empty,
    );
    if let Some(caller) = caller {
        compute_telemetry::context::continue_from(&span, caller);
    }
    span
}

/// What a request's measurement needs when its response is ready.
struct Measure {
    metrics: Arc<Metrics>,
    route: Option<MatchedPath>,
    method: Method,
    started: Instant,
    span: tracing::Span,
    trace: Trace,
    /// The server span's context, when one is recorded.
    server: Option<TraceParent>,
}

pin_project_lite::pin_project! {
    /// A route's future, recording its request when the response is ready. A request whose
    /// future is dropped first (its client went away) is not counted, as with any middleware
    /// that records after the response.
    pub struct Tracked<F> {
        #[pin]
        inner: tokio::task::futures::TaskLocalFuture<Trace, tracing::instrument::Instrumented<F>>,
        measure: Option<Measure>,
    }
}

impl<F, E> Future for Tracked<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut result = std::task::ready!(this.inner.poll(cx));
        if let (Ok(response), Some(m)) = (&mut result, this.measure.take()) {
            let status = response.status().as_u16();
            let headers = response.headers_mut();
            if let Ok(v) = HeaderValue::from_str(&m.trace.hex()) {
                headers.insert(TRACE_ID_HEADER, v);
            }
            if let Some(server) = m.server {
                // W3C Trace Context level 2: the span that served the request.
                if let Ok(v) = HeaderValue::from_str(&server.to_string()) {
                    headers.insert("traceresponse", v);
                }
                m.span.record("http.response.status_code", status);
                if status >= 500 {
                    m.span.record("otel.status_code", "ERROR");
                }
            }
            m.metrics.record_request(
                m.route.as_ref().map(MatchedPath::as_str),
                &m.method,
                response.status().as_u16(),
                m.started.elapsed(),
            );
        }
        Poll::Ready(result)
    }
}
