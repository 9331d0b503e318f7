//! Prometheus metrics in the text exposition format, kept in memory and rendered on `/metrics`.
//!
//! Small and dependency-free on purpose: counters and one latency histogram per route, GraphQL
//! errors by code, the connection pool and the clock skew.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use compute_domain::db::PoolStats;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

#[derive(Debug, Default)]
struct Inner {
    requests: BTreeMap<(String, String, u16), u64>,
    latency: BTreeMap<String, Histogram>,
    graphql_errors: BTreeMap<&'static str, u64>,
}

/// The process's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one HTTP request and its latency.
    pub fn record_request(&self, route: &str, method: &str, status: u16, elapsed: Duration) {
        let mut inner = self.lock();
        *inner
            .requests
            .entry((route.to_owned(), method.to_owned(), status))
            .or_default() += 1;
        let h = inner.latency.entry(route.to_owned()).or_default();
        let secs = elapsed.as_secs_f64();
        for (i, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound {
                h.counts[i] += 1;
            }
        }
        h.sum += secs;
        h.count += 1;
    }

    /// Counts one GraphQL error by its `extensions.code`.
    pub fn record_graphql_error(&self, code: &'static str) {
        *self.lock().graphql_errors.entry(code).or_default() += 1;
    }

    /// Renders everything in the Prometheus text format.
    pub fn render(
        &self,
        pool: PoolStats,
        clock_skew_ms: i64,
        stream: &crate::tailer::StreamStats,
    ) -> String {
        let inner = self.lock();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP http_requests_total HTTP requests by route, method and status."
        );
        let _ = writeln!(out, "# TYPE http_requests_total counter");
        for ((route, method, status), n) in &inner.requests {
            let _ = writeln!(
                out,
                "http_requests_total{{route=\"{}\",method=\"{}\",status=\"{status}\"}} {n}",
                escape(route),
                escape(method)
            );
        }
        let _ = writeln!(
            out,
            "# HELP http_request_duration_seconds HTTP request latency by route."
        );
        let _ = writeln!(out, "# TYPE http_request_duration_seconds histogram");
        for (route, h) in &inner.latency {
            let route = escape(route);
            for (bound, n) in BUCKETS.iter().zip(h.counts) {
                let _ = writeln!(
                    out,
                    "http_request_duration_seconds_bucket{{route=\"{route}\",le=\"{bound}\"}} {n}"
                );
            }
            let _ = writeln!(
                out,
                "http_request_duration_seconds_bucket{{route=\"{route}\",le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(
                out,
                "http_request_duration_seconds_sum{{route=\"{route}\"}} {}",
                h.sum
            );
            let _ = writeln!(
                out,
                "http_request_duration_seconds_count{{route=\"{route}\"}} {}",
                h.count
            );
        }
        let _ = writeln!(
            out,
            "# HELP graphql_errors_total GraphQL errors by extensions.code."
        );
        let _ = writeln!(out, "# TYPE graphql_errors_total counter");
        for (code, n) in &inner.graphql_errors {
            let _ = writeln!(out, "graphql_errors_total{{code=\"{code}\"}} {n}");
        }
        let (size, idle) = (pool.size, pool.idle);
        let _ = writeln!(
            out,
            "# HELP db_pool_connections Connections of the database pool by state."
        );
        let _ = writeln!(out, "# TYPE db_pool_connections gauge");
        let _ = writeln!(out, "db_pool_connections{{state=\"idle\"}} {idle}");
        let _ = writeln!(
            out,
            "db_pool_connections{{state=\"in_use\"}} {}",
            size.saturating_sub(idle)
        );
        let _ = writeln!(
            out,
            "# HELP db_pool_max_connections The pool's connection limit."
        );
        let _ = writeln!(out, "# TYPE db_pool_max_connections gauge");
        let _ = writeln!(out, "db_pool_max_connections {}", pool.max);
        let _ = writeln!(
            out,
            "# HELP compute_clock_skew_seconds compute_now() minus this process's wall clock at the last sample."
        );
        let _ = writeln!(out, "# TYPE compute_clock_skew_seconds gauge");
        let _ = writeln!(
            out,
            "compute_clock_skew_seconds {}",
            clock_skew_ms as f64 / 1000.0
        );
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        for (name, kind, help, value) in [
            (
                "compute_subscriptions_open",
                "gauge",
                "Subscriptions open now, on every transport.",
                stream.open.load(std::sync::atomic::Ordering::Relaxed) as f64,
            ),
            (
                "compute_subscription_events_delivered_total",
                "counter",
                "Events handed to subscriptions.",
                load(&stream.delivered) as f64,
            ),
            (
                "compute_subscription_fallbacks_total",
                "counter",
                "Times a slow subscription fell behind the live stream and read the outbox to catch up.",
                load(&stream.fallbacks) as f64,
            ),
            (
                "compute_outbox_tailer_polls_total",
                "counter",
                "Reads of the outbox by this process's tailer.",
                load(&stream.polls) as f64,
            ),
            (
                "compute_outbox_tailer_events_total",
                "counter",
                "Events this process's tailer read from the outbox.",
                load(&stream.read) as f64,
            ),
            (
                "compute_outbox_tailer_lag_seconds",
                "gauge",
                "How far behind the newest committed event the tailer was at its last read (0 when it read everything there was).",
                stream.lag_ms.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1000.0,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {value}");
        }
        out
    }
}

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
