//! What operators' tools call: `/healthz`, `/readyz` and `/metrics`, and the layer that
//! measures every request.

pub mod health;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::Method;
use axum::response::Response;

use crate::metrics::Metrics;

/// The layer that counts every request by its matched route, method and status, with its
/// latency ([`Metrics::record_request`]). Written as a tower layer rather than with
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
        Tracked {
            inner: self.inner.call(req),
            measure: Some(Measure {
                metrics: self.metrics.clone(),
                route,
                method,
                started: Instant::now(),
            }),
        }
    }
}

/// What a request's measurement needs when its response is ready.
struct Measure {
    metrics: Arc<Metrics>,
    route: Option<MatchedPath>,
    method: Method,
    started: Instant,
}

pin_project_lite::pin_project! {
    /// A route's future, recording its request when the response is ready. A request whose
    /// future is dropped first (its client went away) is not counted, as with any middleware
    /// that records after the response.
    pub struct Tracked<F> {
        #[pin]
        inner: F,
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
        let result = std::task::ready!(this.inner.poll(cx));
        if let (Ok(response), Some(m)) = (&result, this.measure.take()) {
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
