//! The API's metrics, declared once each with their help text and registered in the process's
//! registry (`compute_domain::metrics::Registry`), which `/metrics` encodes: requests and their
//! latency per route, GraphQL errors by code, and, read at each scrape, the connection pool, the
//! clock skew and the subscriptions.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::time::Duration;

use compute_domain::clock::Clock;
use compute_domain::db::Db;
use compute_domain::metrics::prometheus_client::encoding::EncodeLabelSet;
use compute_domain::metrics::prometheus_client::metrics::counter::Counter;
use compute_domain::metrics::prometheus_client::metrics::family::Family;
use compute_domain::metrics::prometheus_client::metrics::histogram::Histogram;
use compute_domain::metrics::{Registry, Sampled, latency_histogram};

use crate::tailer::Tailer;

/// A request's labels, OpenTelemetry's HTTP server attributes in Prometheus form
/// (`http.route`, `http.request.method`, `http.response.status_code`). The route is the router's
/// pattern (`/console/{*path}`, never the path asked for; empty when no route matched) and the
/// method one of the standard ones or `_OTHER`, so no caller can make new series; both are
/// static strings for every request the router knows (no allocation).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    http_route: Cow<'static, str>,
    http_request_method: &'static str,
    http_response_status_code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: &'static str,
}

/// A subscription metric read from the tailer at each scrape: name, help, kind, reading.
type StreamMetric = (&'static str, &'static str, Sampled, fn(&Tailer) -> f64);

/// The API's own metrics (the handles its middleware and transports record into).
#[derive(Clone, Debug)]
pub struct Metrics {
    requests: Family<RequestLabels, Histogram, fn() -> Histogram>,
    graphql_errors: Family<CodeLabels, Counter>,
    refusals: Family<ReasonLabels, Counter>,
    /// The router's paths (`crate::server::routes::ALL`, handed in by the server): a request's
    /// `route` label is one of these static strings.
    routes: &'static [&'static str],
}

impl Metrics {
    /// Declares the API's metrics in `registry`, with the readings of `db`, `clock` and `tailer`
    /// taken at each scrape; requests are labelled by the router's paths `routes`.
    pub fn new(
        registry: &Registry,
        db: &Db,
        clock: &Clock,
        tailer: &Tailer,
        routes: &'static [&'static str],
    ) -> Metrics {
        let metrics = Metrics {
            requests: Family::new_with_constructor(latency_histogram),
            graphql_errors: Family::default(),
            refusals: Family::default(),
            routes,
        };
        registry.register(
            "compute_api_refusals",
            "Requests and connections refused at a published limit, by reason (cost, rate_limited, \
             document_bytes, aliases, root_fields, directives, selections, errors, nul_character, \
             list_items, timeout, body_timeout, ws_message_bytes, streams, anonymous_stream, \
             connections).",
            metrics.refusals.clone(),
        );
        registry.register(
            "compute_http_server_request_duration_seconds",
            "HTTP requests and their duration (OpenTelemetry's http.server.request.duration), by \
             http_route (the router's pattern; empty when none matched), http_request_method (a \
             standard method, or _OTHER) and http_response_status_code. A WebSocket or SSE \
             request ends when its response starts.",
            metrics.requests.clone(),
        );
        registry.register(
            "compute_graphql_errors",
            "GraphQL errors by extensions.code.",
            metrics.graphql_errors.clone(),
        );
        let pool = db.clone();
        registry.sample(
            "compute_db_pool_connections",
            "Connections of the database pool by state.",
            Sampled::Gauge,
            Some("state"),
            move || {
                let s = pool.pool_stats();
                vec![
                    ("idle", f64::from(s.idle)),
                    ("in_use", f64::from(s.size.saturating_sub(s.idle))),
                ]
            },
        );
        let pool = db.clone();
        registry.sample(
            "compute_db_pool_max_connections",
            "The pool's connection limit.",
            Sampled::Gauge,
            None,
            move || vec![("", f64::from(pool.pool_stats().max))],
        );
        let clock = clock.clone();
        registry.sample(
            "compute_clock_skew_seconds",
            "compute_now() minus this process's wall clock at the last sample.",
            Sampled::Gauge,
            None,
            move || vec![("", clock.last_reading().skew_ms as f64 / 1000.0)],
        );
        let stream: [StreamMetric; 9] = [
            (
                "compute_subscriptions_open",
                "Subscriptions open now, on every transport.",
                Sampled::Gauge,
                |t| t.stats().open.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_subscription_events_delivered",
                "Events handed to subscriptions.",
                Sampled::Counter,
                |t| t.stats().delivered.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_subscription_fallbacks",
                "Times a slow subscription fell behind the live stream and read the outbox to catch up.",
                Sampled::Counter,
                |t| t.stats().fallbacks.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_subscription_frames_rendered",
                "Payloads of the events subscription rendered by one subscription and kept for the others of its shape (docs/subscriptions.md).",
                Sampled::Counter,
                |t| t.frames().rendered.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_subscription_frames_shared",
                "Payloads of the events subscription sent as another subscription of the same shape rendered them, without resolving them again.",
                Sampled::Counter,
                |t| t.frames().shared.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_outbox_tailer_polls",
                "Reads of the outbox by this process's tailer.",
                Sampled::Counter,
                |t| t.stats().polls.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_outbox_tailer_pokes",
                "Writers' pokes this process's tailer heard on its LISTEN connection (none behind a transaction pooler without --listen-database-url: then only its polls read the outbox).",
                Sampled::Counter,
                |t| t.stats().pokes.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_outbox_tailer_events",
                "Events this process's tailer read from the outbox.",
                Sampled::Counter,
                |t| t.stats().read.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_outbox_tailer_lag_seconds",
                "How far behind the newest committed event the tailer was at its last read (0 when it read everything there was).",
                Sampled::Gauge,
                |t| t.stats().lag_ms.load(Ordering::Relaxed) as f64 / 1000.0,
            ),
        ];
        for (name, help, kind, read) in stream {
            let tailer = tailer.clone();
            registry.sample(name, help, kind, None, move || vec![("", read(&tailer))]);
        }
        metrics
    }

    /// Counts one HTTP request and its latency. `route` is the matched route's pattern, or `None`
    /// for a request no route matched.
    pub fn record_request(
        &self,
        route: Option<&str>,
        method: &axum::http::Method,
        status: u16,
        elapsed: Duration,
    ) {
        self.requests
            .get_or_create(&RequestLabels {
                http_route: route_label(self.routes, route),
                http_request_method: method_label(method),
                http_response_status_code: status,
            })
            .observe(elapsed.as_secs_f64());
    }

    /// Counts one GraphQL error by its `extensions.code`.
    pub fn record_graphql_error(&self, code: &'static str) {
        self.graphql_errors
            .get_or_create(&CodeLabels { code })
            .inc();
    }

    /// Counts one refusal at a published limit by its reason.
    pub fn record_refusal(&self, reason: &'static str) {
        self.refusals.get_or_create(&ReasonLabels { reason }).inc();
    }
}

/// The `route` label of a matched route's pattern: the router's own static string from
/// `routes`; a pattern outside that list (a route added without naming it there) is copied.
/// Empty when no route matched (OpenTelemetry sets no `http.route` then).
fn route_label(routes: &'static [&'static str], route: Option<&str>) -> Cow<'static, str> {
    let Some(route) = route else {
        return Cow::Borrowed("");
    };
    routes
        .iter()
        .find(|r| **r == route)
        .map_or_else(|| Cow::Owned(route.to_owned()), |r| Cow::Borrowed(*r))
}

/// The `http_request_method` label: a standard method's name, `_OTHER` for any other (a caller
/// cannot make new series by inventing methods).
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "_OTHER",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_routers_patterns_and_the_standard_methods() {
        const ROUTES: &[&str] = &["/graphql", "/console/{*path}"];
        let route_label = |r| route_label(ROUTES, r);
        assert!(matches!(
            route_label(Some("/graphql")),
            Cow::Borrowed("/graphql")
        ));
        assert!(matches!(
            route_label(Some("/console/{*path}")),
            Cow::Borrowed("/console/{*path}")
        ));
        assert_eq!(route_label(Some("/not/a/route")), "/not/a/route");
        assert_eq!(route_label(None), "");
        assert_eq!(method_label(&axum::http::Method::POST), "POST");
        let invented = axum::http::Method::from_bytes(b"FOO1").expect("a token");
        assert_eq!(method_label(&invented), "_OTHER");
    }
}
